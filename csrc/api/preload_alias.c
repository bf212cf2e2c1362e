/* torch_memory_saver's preload library as frameworks find it: a file named
   torch_memory_saver_hook_mode_preload*.so beside the package torch_memory_saver is imported
   from (for our alias, torch_mem_saver_lite/_alias/). This library only needs ours
   (DT_NEEDED, found through RUNPATH $ORIGIN/..): in LD_PRELOAD it loads libtorch_mem_saver_lite.so
   ahead of the CUDA runtime, the same file ctypes loads, so one copy of the saver serves both.
   It is installed with the package (pip records it), so nothing is written there at run time. */

/* miles reads the preload library's bytes for this name to learn whether it supports disk
   backup; the library this one loads does. Exported, so that no linker drops it as unused
   (zig's did, with a static one). */
__attribute__((visibility("default"))) const char tmsl_preload_alias_supports[] = "TMS_INIT_ENABLE_DISK_BACKUP";

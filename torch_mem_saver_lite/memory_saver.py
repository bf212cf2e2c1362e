"""The user-facing MemorySaver: regions, pause/resume by tag, backups, stats."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, cast, overload

import torch

from . import (
    _lib,
    breakdown,
    cpu_backup,
    graph_capture,
    hook_modes,
    leftovers,
    nccl_suspend,
    options,
    paused_block,
    shared_store,
    transition_log,
)
from . import stray_access as strays
from .breakdown import MemoryBreakdown
from .choices import CaptureErrorMode, CpuBackupBackend, HookModeName, StrayAccessMode
from .disk_backup import DiskDirectory
from .errors import InvalidArgumentError, MemorySaverError
from .leftovers import LeftoverReport
from .options import SaverOption, SaverOptions
from .paused_guard import PausedMemoryGuard
from .pool_routing import TorchPools
from .regions import Region, Undo, prepare_quietly, pushed, refusals_explained, retire_pool
from .settings import Settings, backup_choice, check_bool, check_selection, check_tag
from .stats import HostMemoryReport, TagStats, TagStatus, host_memory_report
from .transitions import Hook, Transitions


class MemorySaver:
    """Releases the device memory of tagged allocations and gives it back at the same addresses.

    There is one per process, ``torch_mem_saver_lite.saver``, and ``MemorySaver()`` returns
    it: the native library has one CUDA saver a process (the allocation hooks and torch's
    pluggable allocator find it without being told), and the tag hooks, torch pools and
    settings that go with its tags must have one owner too. (``torch_mem_saver_lite.testing.
    HostSaver`` runs the same core over host memory, a new one each time, for tests.)

    Touching a paused tensor is a user error. Where it has no backup, the saver's scratch
    takes the access (``stray_access``) and the resume reports it; where it has one, the GPU
    reports an illegal memory access, which ends the CUDA context. Resume before touching it.
    """

    _platform: hook_modes.Platform = hook_modes.CUDA  # what the memory is (HostSaver: its own)

    _process_wide: MemorySaver | None = None
    _process_wide_lock = threading.Lock()

    def __new__(cls, *args: Any, **kwargs: Any) -> MemorySaver:
        if cls is not MemorySaver:  # HostSaver: one per call (its own arguments go to its __init__)
            return super().__new__(cls)
        with MemorySaver._process_wide_lock:
            if MemorySaver._process_wide is None:
                MemorySaver._process_wide = super().__new__(cls)
            return MemorySaver._process_wide

    def __init__(self) -> None:
        if "_transitions" in self.__dict__:
            return  # MemorySaver() again: the process-wide saver, set up already
        self._native: _lib.NativeSaver | None = None  # the core, once made or found: _core()
        self._mode = hook_modes.TORCH
        self._lock = threading.RLock()
        self._pools: TorchPools | None = None
        self._settings = Settings()
        self._options = SaverOptions(self._core, self._settings.environment)
        self._disk = DiskDirectory()  # the disk backup directory; the core writes the files
        self._transitions = Transitions()

    # ----- configuration -------------------------------------------------------------
    @property
    def hook_mode(self) -> HookModeName:
        """How allocations are intercepted.

        ``"torch"`` (default): a ``CUDAPluggableAllocator`` under one MemPool per tag.
        ``"preload"``: the library, preloaded with ``LD_PRELOAD``, answers ``cudaMalloc`` and
        ``cudaFree`` for the whole process. Set it before the first region: later assignments
        of another mode are ignored with a RuntimeWarning, and so is ``"torch"`` in a process
        that runs with the library preloaded once the mode is ``"preload"``.
        """
        return cast(HookModeName, self._mode.name)

    @hook_mode.setter
    def hook_mode(self, mode: HookModeName) -> None:
        if mode not in hook_modes.MODES:
            raise ValueError(f"hook_mode must be one of {tuple(hook_modes.MODES)}, got {mode!r}")
        if mode == self._mode.name:
            return
        # Libraries assign it at import (Megatron-Core "torch") or at start-up (AReaL, slime's
        # preloaded workers "preload"); whichever comes second must not break the other's
        # import, nor split one process between two hooks: the mode in use is kept, loudly.
        native = self._core(create=False)
        if self._pools is not None or (native is not None and native.stats()):
            warnings.warn(f"torch_mem_saver_lite: hook_mode stays {self._mode.name!r}, which regions have "
                          f"used already; the assignment of {mode!r} is ignored (set it before the first "
                          "region)", RuntimeWarning, stacklevel=2)
            return
        self._mode = hook_modes.chosen(self._mode, mode)

    # ----- options (the native options table: csrc/platform/options.h) -----------------
    memory_margin_bytes = SaverOption[int](
        """Device memory (bytes) allocations and resumes must leave free; 0 = none.""")
    retain_cpu_backup = SaverOption[bool](
        """Keep every host backup after resume, whatever its size, and reuse it at the next
        pause (faster cycles, host memory held throughout). Default False (or
        ``TMS_RETAIN_CPU_BACKUP`` / ``TMSL_RETAIN_CPU_BACKUP``): after a resume, backups stay
        only as far as the host cache holds them (``host_cache_bytes``, on by default) and the
        rest is freed; with ``host_cache_bytes = 0`` every backup is freed.""")
    host_cache_bytes = SaverOption[int](
        """Host memory (bytes) that backups may keep between cycles: after a resume, its
        backups stay page-locked for the next pause of the same memory while everything kept
        this way fits in the budget, so later cycles skip preparing host memory and run at
        the link's speed. It is filled ahead of the first pause too: when a region with
        ``enable_cpu_backup=True`` (or a ``cuda_graph`` block backing its pool up) closes, host
        memory for the backups of what it allocated is set aside in the background if it
        fits, so the first pause copies at once. Default: an eighth of the host memory this
        process may use (the least of the machine's memory, what is available at start and its
        container's cgroup limit), at most 32 GiB; 0 turns the cache off. Lowering it gives
        back at once what no longer fits. ``release_host_cache()`` frees what it holds.""")
    poison_on_resume = SaverOption[bool](
        """Debugging aid: fill resumed memory that has no backup with 0xFF bytes (NaN in every
        float format, -1 as integers), so code that wrongly relies on discarded content fails
        visibly instead of reading leftovers. Default: off, or ``TMSL_POISON_ON_RESUME=1``.""")
    verify_wake = SaverOption[bool](
        """A pause fingerprints every backed-up allocation on its GPU; a resume checks the
        restored bytes and, where they differ, raises ``WakeVerificationError`` naming the tag
        and allocation, everything it covered still paused with its backups. Default: on, or
        ``TMSL_VERIFY_WAKE=0``; per tag: ``region(..., verify_wake=False)``.""")
    stray_access = SaverOption[StrayAccessMode](
        """What a kernel that touches paused memory without a backup (a KV cache, say) meets.
        ``"warn"`` (default) and ``"raise"``: while paused, that memory's addresses map a small
        scratch of device memory (pieces of 128 MiB down to 2 MiB, each made once an allocation
        needs it: at most 254 MiB per device), so the kernel reads 0xFF bytes and its writes
        are dropped, instead of an illegal address that ends the CUDA context. A resume that finds writes there warns
        (``StrayAccessWarning``) or raises ``StrayAccessError`` once the tags are awake, naming
        them; ``TagStats.stray_writes`` counts them. Reads are harmless but not seen. ``"off"``:
        the raw behaviour, the memory unmapped while paused. Default: ``TMSL_STRAY_ACCESS``;
        per tag: ``region(..., stray_access=...)``. Applies from the next pause on: a resume
        tells the writes as the mode its pause began with said.""")
    soft_pause = SaverOption[bool](
        """Soft pauses: while a tag is paused, each of its allocations with a host backup keeps
        that host copy mapped at its own address (host memory the GPU maps, made by the CUDA
        driver; the copy the pause made, not a second one). A kernel, a graph replay or a copy
        that touches the paused tensor reads its exact bytes and writes into the copy, over the
        link, instead of hitting an illegal address; the resume brings back what the copy holds
        then, so writing into a paused tensor works (a weight update into a sleeping engine).
        The wake check takes such writes as the tag's content. The copy stays set aside after a
        resume where the host cache has room (the next pause reuses it: making it costs about
        0.3 s per GiB). Not soft: allocations without a backup (``stray_access``), on disk or
        in the node's store. Default: off, or ``TMSL_SOFT_PAUSE=1``; per tag:
        ``region(..., soft_pause=True)``. Applies from the next pause on.""")

    @property
    def host_memory_budget(self) -> int:
        """The node's host-memory budget (bytes): every process of the node (or container)
        that uses the library takes the host memory of its backups and host cache from it.
        A pause that would go beyond it (1) gives this process's host cache back, (2) asks the
        node's other processes to give theirs back and waits up to 2 s for the room, (3) where
        a disk backup directory is set, sends what still does not fit to disk, and (4) is
        otherwise refused (``OutOfMemoryError``) before anything is released. Setting it sets
        it for every process of the node; ``TMSL_HOST_MEMORY_BUDGET`` sets it when a process
        starts (a bad value raises at first use). Default: half of the
        host memory the node's first process could use (the least of the machine's memory,
        what was available and its container's cgroup limit). ``host_memory()`` shows who
        holds what."""
        return self.host_memory().budget_bytes

    @host_memory_budget.setter
    def host_memory_budget(self, nbytes: int) -> None:
        _lib.set_node_option("host_memory_budget", options.check("host_memory_budget", nbytes))

    def host_memory(self) -> HostMemoryReport:
        """The node's host-memory budget, what this process and the others hold of it, and
        this process's disk backups beside it. Starts nothing (no CUDA, no saver)."""
        native = self._core(create=False)
        environment = self._settings.environment().disk_backup_dir
        return host_memory_report(
            _lib.host_memory(), _lib.MAX_HOLDERS,
            on_disk_bytes=sum(s.on_disk_bytes for s in self.status()),
            spilled_bytes=native.spilled_bytes() if native is not None else 0,
            disk_tier=self._disk.named(native, environment),
            disk_tier_problem=self._disk.problem(native, environment))

    def release_host_cache(self) -> None:
        """Free the host memory the cache (and retention) keeps for resident memory; the
        next pause prepares new host memory again."""
        native = self._core(create=False)
        if native is not None:
            native.release_host_cache()
            native.wait_for_released_backups()

    @property
    def enabled(self) -> bool:
        """Always True (torch_memory_saver compatibility)."""
        return True

    @overload
    def _core(self, create: Literal[True] = True) -> _lib.NativeSaver: ...
    @overload
    def _core(self, create: bool) -> _lib.NativeSaver | None: ...

    def _core(self, create: bool = True) -> _lib.NativeSaver | None:
        """The native core: the one way to it. ``create``: made at first use (the CUDA saver
        starts the driver; DriverNotFoundError without one). Else only if it exists already (made
        by a region, or by the allocation hooks of a preloaded process), so reads never start
        the driver: None otherwise. Handed the settings and the environment's region defaults
        before it is published: a setting that fails fails every first use."""
        native = self._native
        if native is not None:
            return native
        with self._lock:
            if self._native is None:
                native = self._platform.make_core(self) if create else self._platform.find_core()
                if native is None:
                    return None
                env = self._settings.environment()
                self._options.apply(native)
                # A default region with disk backup and no directory yet is not refused here: the
                # program may still set one; the core refuses a pause of its memory until then.
                self._disk.apply(native, env.disk_backup_dir)
                self._platform.default_region(native, env.default_tag, env.default_caches_backups)
                self._native = native
            return self._native

    # ----- regions -------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag: str = "default", enable_cpu_backup: bool | None = None,
               enable_disk_backup: bool = False, cpu_backup_backend: CpuBackupBackend | None = None,
               verify_wake: bool | None = None, stray_access: StrayAccessMode | None = None,
               soft_pause: bool | None = None) -> Iterator[None]:
        """Allocations made on this thread inside the block become pauseable under ``tag``.

        Args:
            tag: names the memory for ``pause``/``resume``.
            enable_cpu_backup: ``True``: keep the content across a pause (copied to host
                memory). Not given: a resumed allocation holds fresh memory of undefined
                content, except that a tag holding *graph memory* (a CUDA graph was captured
                while one of its regions was open, e.g. ``torch.compile(mode=
                "reduce-overhead")`` recording its graphs) is backed up, because replays read
                state written at capture time. ``False``: never back up, graph memory
                included; a replay after resume may then compute something else. Each
                allocation keeps the setting of the region it was made in, as in
                torch_memory_saver; a region that gives none follows the first explicit
                setting its tag was given.
            enable_disk_backup: keep the content across a pause in files on disk instead of
                host memory (``set_disk_backup_dir``), one per allocation, visible while
                paused; excludes ``enable_cpu_backup=True``.
            cpu_backup_backend: with ``enable_cpu_backup=True``: ``"pinned"`` (default) lets
                backups stay in the host cache after a resume (``host_cache_bytes``);
                ``"mmap"`` gives their host memory back before every resume returns.
            verify_wake: ``False``: the tag's wakes are not checked against its pauses'
                fingerprints (``MemorySaver.verify_wake``), for code that writes into its
                backups on purpose or wants the raw behaviour; ``True``: checked again. Not
                given: the tag keeps its setting (checked, unless turned off before). A
                setting of the tag, not of the region's allocations.
            stray_access: the tag's own ``MemorySaver.stray_access`` ("off", "warn" or
                "raise"), from its next pause on; not given: the tag keeps its setting (the
                saver's, unless set before). A setting of the tag, like ``verify_wake``.
            soft_pause: the tag's own ``MemorySaver.soft_pause``, from its next pause on; not
                given: the tag keeps its setting (the saver's, unless set before). A region
                refused because its tag is paused changes none of these three.
        Regions nest; leaving one restores the enclosing one. Allocations on the current
        CUDA device are routed. Routing is per thread: a thread started inside a region is
        not routed.
        """
        choice = self._region_choice(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        disk = choice == _lib.CHOICE_DISK
        tag_options = options.tag_texts(dict(verify_wake=verify_wake, stray_access=stray_access, soft_pause=soft_pause))
        native = self._enter()
        check_tag(tag)
        if disk:
            self._disk.require(native)
        route = self._platform.route(self._torch_pools, tag, choice)
        _lib.take_allocation_failure()  # only failures inside this block are explained below
        with pushed(Region(native, tag, choice, route)):
            # Once the region is open: a refused one (its tag paused) changes none of the tag's
            # settings, so a paused tag's wake is checked and told as its pause was promised.
            options.set_tag_options(native, tag, tag_options)
            transition_log.region_entered(native, tag, choice)
            if self._platform.capturing():
                _lib.note_graph_capture()  # entered inside a capture: graph memory too
            try:
                with refusals_explained(tag):
                    yield
            finally:
                transition_log.region_left(native, tag)
        if choice in (_lib.CHOICE_ON, _lib.CHOICE_ON_UNCACHED):
            prepare_quietly(native, tag)

    def _enter(self) -> _lib.NativeSaver:
        """Checks shared by region() and cuda_graph(); returns the native saver."""
        _lib.check_process()
        self._platform.before_region(self._mode)
        native = self._core()
        self._platform.core_entered(native)
        return native

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: torch.cuda.CUDAGraph,
        pool: tuple[int, int] | None = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: CaptureErrorMode = "global",
        tag: str = "cuda_graph",
        enable_cpu_backup: bool | None = None,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """Like ``torch.cuda.graph``, with the graph's memory pool pauseable under ``tag``.

        The pool is backed up at a pause unless ``enable_cpu_backup=False`` is given: a graph
        pool holds state written once at capture time (or filled after it) that replays read
        but never rewrite, so without a backup a replay after resume can compute something
        else. Opt out only for pools whose every byte each replay rewrites before reading.

        Graphs captured with the same tag share one pool (on the current device), as
        inference engines do when they capture one graph per batch size, largest first.
        In torch hook mode that pool is the tag's saver pool, and a ``pool`` argument other
        than it is ignored with a warning; in preload mode a given ``pool`` is used and its
        memory is pauseable because its ``cudaMalloc`` calls happen inside the region.

        Turns NCCL's graph buffer registration off for the process (``NCCL_GRAPH_REGISTER=0``),
        or raises if NCCL is already initialized without it.
        """
        backup, caches = graph_capture.backup_of(enable_cpu_backup, cpu_backup_backend, self._settings.default_caches)
        with graph_capture.captured(self._enter(), self._torch_pools(), self._mode, check_tag(tag), backup, caches,
                                    cuda_graph, pool, stream, capture_error_mode):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations on this thread inside the block are ordinary, even within a region.

        They come from a torch pool of their own, made for the block and freed when it ends
        (its cached memory goes back to the device then; inside a region, once no thread is in
        one, since torch frees no pool's cache while another is in use): torch's caching allocator would
        otherwise hand out cached blocks of the enclosing region's pool, or, in preload mode
        with a process-wide region (``TMS_INIT_ENABLE=1``), of the default pool, which a
        pause may have released. Tensors made inside stay valid after the block."""
        route = self._platform.disable_route()
        try:
            with pushed(Region(None, route=route)):
                yield
        finally:
            retire_pool(route)

    def _region_choice(self, enable_cpu_backup: object, enable_disk_backup: object,
                       cpu_backup_backend: object) -> int:
        """A region's backup settings, checked, as the C ABI's choice."""
        return backup_choice(enable_cpu_backup, enable_disk_backup, cpu_backup_backend,
                             self._settings.default_caches)

    def _torch_pools(self) -> TorchPools:
        with self._lock:
            if self._pools is None:
                self._pools = TorchPools(self._mode.allocator_library())
            return self._pools

    # ----- pause / resume --------------------------------------------------------------
    def _core_for(self, names: list[str] | None) -> _lib.NativeSaver | None:
        """The core for a pause/resume of ``names`` (after refusing a forked child, before
        any lock is taken); None when there is none, where naming a tag is an error, as the
        core would say."""
        _lib.check_process()
        native = self._core(create=False)
        if native is None:
            self._platform.check_usable()
        if native is None and names:
            raise InvalidArgumentError(f"unknown tag {names[0]!r}: no region has used it; known tags: none yet")
        return native

    def pause(self, tag: str | Sequence[str] | None = None) -> None:
        """Release the device memory of the tag(s) (None: every tag), keeping addresses.

        Waits for the devices' queued work first; content of regions with
        ``enable_cpu_backup`` (and graph memory) is copied to host memory. Pausing a paused
        tag does nothing. Hooks registered for a tag run before its memory is released. On
        failure every allocation is either still resident or paused with a full backup.
        """
        names = check_selection(tag)
        native = self._core_for(names)
        if native is None:
            return
        self._refuse_during_capture("pause")
        transition_log.asked("pause", native, names)
        try:
            with torch.profiler.record_function("torch_mem_saver_lite.pause"):
                self._transitions.pause(native, names, transition_log.wrap("pause", native, native.pause))
        finally:
            self._disk.tell(native)  # what the disk tier did (nothing asked without a directory)
            shared_store.tell(native)  # what the node's store refused (private copies instead)

    def resume(self, tag: str | Sequence[str] | None = None) -> None:
        """Give the tag(s) (None: every tag) device memory again, at the same addresses.

        Backed-up content is restored, then hooks registered for a tag run (newest first).
        Resuming an active tag does nothing. Raises ``OutOfMemoryError`` if the memory is
        not there; then everything this call covered stays paused with its backups and a
        later ``resume`` can succeed. A hook that raises leaves the call's tags paused again.
        """
        names = check_selection(tag)
        native = self._core_for(names)
        if native is None:
            return
        self._refuse_during_capture("resume")
        transition_log.asked("resume", native, names)
        try:
            with torch.profiler.record_function("torch_mem_saver_lite.resume"):
                self._transitions.resume(native, names, transition_log.wrap("resume", native, native.resume))
        finally:
            shared_store.tell(native)  # what the node's store refused (in the background too)
        strays.report(native, names)  # once awake, hooks run

    # ----- disk backup -------------------------------------------------------------------
    def set_disk_backup_dir(self, path: str | os.PathLike[str] | None) -> None:
        """The directory (on a real disk; created if needed) that disk backups go to, and
        the node's host-memory budget's disk tier with them (``host_memory_budget``).
        Default: ``TMSL_DISK_BACKUP_DIR`` or ``TMS_DISK_BACKUP_DIR``. tmpfs is refused.
        Backup files left there by processes that no longer exist are removed. None: no
        directory (the environment's neither): the disk tier is off, and regions with
        ``enable_disk_backup=True`` need a directory again. Tags paused already keep their files
        until resumed. A path given before the saver is first used is checked at once."""
        self._disk.choose(path, self._core(create=False))

    def register_hooks(self, tag: str, before_pause: Hook | None = None,
                       after_resume: Hook | None = None) -> Callable[[], None]:
        """Run ``before_pause()`` before ``tag``'s memory is released and ``after_resume()``
        after it is mapped again (and its backup restored). For state that lives exactly as
        long as a mapping: CUDA IPC handles, NCCL buffer registrations, RDMA registrations.

        Hooks run only when the tag really changes state, on the thread that calls
        pause/resume: before_pause in registration order, after_resume in reverse, and
        alternating: each hook whose before_pause ran gets its after_resume once (hooks
        registered while the tag is paused run from its next pause on). A hook may pause or
        resume other tags; each tag's state is read when its turn comes, so no hook runs
        twice or on memory in the wrong state. Pausing or resuming the hook's own tag (or
        every tag) from inside it raises MemorySaverError. Pauses and resumes of hooked tags
        are serialized by a lock (concurrent calls run one after the other), so a hook must
        not wait for another thread's pause or resume. A before_pause that raises aborts the
        pause (the hooks that already ran get their after_resume) and nothing is released;
        an after_resume that raises pauses the call's tags again (hooks that ran get their
        before_pause) and the exception propagates. Returns a function that removes the hooks.
        """
        check_tag(tag)
        _lib.check_process()  # a forked child is refused before the hooks' lock is taken
        for name, hook in (("before_pause", before_pause), ("after_resume", after_resume)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable or None, got {type(hook).__name__}")
        return self._transitions.register(tag, before_pause, after_resume)

    def _refuse_during_capture(self, what: str) -> None:
        # Synchronizing or remapping while a graph captures would break the capture. (Callers
        # refused a forked child first, before CUDA is asked anything.)
        if self._platform.capturing():
            raise MemorySaverError(f"cannot {what} while a CUDA graph is being captured on this "
                                   f"thread's stream; {what} before or after the capture")

    @contextlib.contextmanager
    def paused(self, tag: str | Sequence[str] | None = None, release_leftovers: bool = False,
               process_groups: Any = None) -> Iterator[LeftoverReport | None]:
        """Pause the tag(s) for the block and resume them on exit, also when it raises or is
        interrupted (Ctrl-C) at any point. Tags that were paused already stay paused.

        With ``release_leftovers=True`` the block also runs with what the process holds
        outside regions released (``release_leftovers(process_groups)`` after the pause;
        ``restore_leftovers`` of what this block suspended before the resume), and ``as``
        gives its LeftoverReport (else None). Every rank of the NCCL groups concerned must
        enter and leave such a block together, and no collective may run on them inside it.
        """
        names = check_selection(tag)
        _lib.check_process()  # a forked child is refused before anything else is asked
        release = check_bool(release_leftovers, "release_leftovers")
        if process_groups is not None and not release:
            raise ValueError("process_groups is only used with release_leftovers=True")
        groups = nccl_suspend.check_groups(process_groups)  # bad input refused before anything is paused
        native = self._core_for(names)
        active = paused_block.active_tags(native, names)
        # What was suspended before the block stays suspended after it, like tags paused before.
        suspended_before = nccl_suspend.suspended_names()
        undo = Undo(functools.partial(paused_block.resume_despite_interrupts, self.resume, active,
                                       suspended_before if release else None))
        try:
            self.pause(active)
            report = self._release_leftovers(groups) if release else None
            yield report
        finally:
            undo()

    # ----- leftovers outside regions -------------------------------------------------------
    def release_leftovers(self, process_groups: Any = None, cublas_workspaces: bool = False) -> LeftoverReport:
        """Release what the process holds on the GPU outside regions, where that is safe.

        Meant for after pausing tags (``paused(..., release_leftovers=True)`` does both):
        torch's cached free blocks (``torch.cuda.empty_cache()``, every device), the cached
        free blocks of the saver's pools of resident tags no open region or CUDA graph uses,
        and the device memory of NCCL communicators (``process_groups``: a ProcessGroup or a
        list of them; None: every NCCL group torch.distributed created in this process),
        suspended through torch's process-group suspend or NCCL's ``ncclCommSuspend``
        (NCCL >= 2.29.7). Groups that cannot be suspended are listed in the report with the
        reason. Suspending is collective: every rank of a group must call this, with the same
        groups. A suspended group must not be used until ``restore_leftovers()``.

        ``cublas_workspaces=True`` also frees torch's cuBLAS workspaces first (torch makes
        them again on next use): one cut out of a large freed block keeps that whole segment
        reserved. Only safe when no CUDA graph that will replay recorded a workspace from
        outside its own pool (a graph whose warm-up ran on its capture stream, or one captured
        on the stream of a graph in another pool) and no capture into a pool follows while
        graphs of that pool live; graphs captured by ``cuda_graph`` after warm-up on another
        stream, as the RL example does, are fine.
        """
        workspaces = check_bool(cublas_workspaces, "cublas_workspaces")
        return self._release_leftovers(nccl_suspend.check_groups(process_groups), workspaces)

    def _release_leftovers(self, groups: list[Any] | None, cublas_workspaces: bool = False) -> LeftoverReport:
        _lib.check_process()
        self._refuse_during_capture("release leftovers")
        return leftovers.release(self._pools, self._core(create=False), self._platform.routes_torch, groups,
                                 cublas_workspaces)

    def restore_leftovers(self) -> None:
        """Resume the NCCL communicators ``release_leftovers`` suspended (every rank of their
        groups must call it). Idempotent: does nothing when nothing is suspended. Collectives
        work again afterwards; the released caches need nothing back."""
        leftovers.restore()

    def memory_breakdown(self, device: Any = None) -> MemoryBreakdown:
        """What holds the memory of ``device`` (None: the current one): CUDA context, torch's
        caching allocator outside regions, NCCL communicators, the saver's tags, unknown.
        The first call (or the first region) on a device measures its CUDA context."""
        self._platform.check_breakdown()
        index = breakdown.check_device(device)
        return breakdown.breakdown(index, self._core(create=False))

    # ----- inspection ------------------------------------------------------------------
    def stats(self) -> dict[str, TagStats]:
        """Per tag: allocations, reserved, resident, paused and host backup bytes, and
        whether the tag is paused, holds graph memory and is backed up at a pause: a view of
        ``status()``, its entries summed over each tag's devices. To log or export what the
        saver holds, take ``status()``: it also says where each paused byte is."""
        by_tag: dict[str, list[TagStatus]] = {}
        for entry in self.status():
            by_tag.setdefault(entry.tag, []).append(entry)
        return {tag: TagStats.of(entries) for tag, entries in sorted(by_tag.items())}

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Debugging aid (eager mode, calling thread): an op on a paused tag's memory raises
        ``PausedTensorError`` naming the tag before it runs, instead of an illegal address that
        ends the CUDA context. A native query per tensor argument; blind to what bypasses
        torch's dispatcher (graph replays, kernels given raw pointers)."""
        with PausedMemoryGuard(self._core()):
            yield

    def status(self) -> list[TagStatus]:
        """Each tag's ``TagStatus`` per device: awake or paused, where each byte is, its last
        wake, what it holds. The one record of what the saver holds, and the one to log
        (``dataclasses.asdict`` of each entry); ``stats()`` is its sum per tag.

        Every reserved byte of a tag on a device is counted once, in one of five places:
        ``on_device_bytes`` (backed by device memory: the tag is awake, or the byte is of an
        allocation a failed pause left resident), ``in_host_bytes`` (paused, its content in
        this process's host memory), ``in_store_bytes`` (paused, its content in the node's
        store, held once however many processes pause the same bytes), ``on_disk_bytes``
        (paused, its content in a disk backup file) and ``discarded_bytes`` (paused without a
        backup: its content is gone, undefined after the resume or 0xFF with
        ``poison_on_resume``). ``last_wake_check`` says what the last resume's check of the
        restored bytes found, ``stray_writes`` how many checks found writes into paused memory
        without a backup. A tag no region has allocated in has one entry with device -1."""
        native = self._core(create=False)
        return [TagStatus.from_figures(f) for f in native.figures()] if native is not None else []

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        """The host copy of a paused tensor from a region with ``enable_cpu_backup=True``.

        Returns None while the tensor is resident, unless ``retain_cpu_backup`` kept the copy
        of its last pause (then that copy, as torch_memory_saver does). With
        ``zero_copy=True`` the result shares the backup's page-locked memory (a copy to
        the GPU from it runs at full link speed); that memory stays valid as long as the
        tensor lives, but after the next resume it no longer follows the device tensor
        (and with a host cache or retention a later pause may write over it).
        """
        return cpu_backup.leased(self._core, x, zero_copy, self._platform.on_device)

    def empty_cache(self, tag: str) -> None:
        """Free the memory ``tag``'s pool caches for tensors that no longer exist.

        PyTorch keeps freed blocks of a region cached in the tag's pool (so pausing the tag
        still covers them). Call this once none of the tag's tensors is alive to give that
        memory back for good; the next region of the tag starts a new pool.
        """
        check_tag(tag)
        if self._pools is not None:
            self._pools.drop(tag)
        torch.cuda.empty_cache()

    def wait_for_released_backups(self) -> None:
        """Wait until host backups that resumes let go of are freed, and host memory being
        set aside for backups (when a backed-up region closed) is claimed.

        A resume returns as soon as the content is back on the device and frees its host
        memory on a background thread; call this before measuring host memory.
        """
        native = self._core(create=False)
        if native is not None:
            native.wait_for_released_backups()
            shared_store.tell()  # what the node's store refused meanwhile (private copies instead)

"""The torch_memory_saver drop-in: every public signature, the behaviour where the compat
object follows torch_memory_saver, the environment variables (TMS_* and TMSL_*),
cpu_backup_backend and the opt-in `import torch_memory_saver` alias, without a GPU; then, on
a GPU, torch_memory_saver programs, unmodified, each in a fresh process in both hook modes
(preload mode with the library in LD_PRELOAD, as torch_memory_saver's configure_subprocess
arranges), asserting real effects: memory released, addresses kept, content bit-identical."""

from __future__ import annotations

import ctypes
import inspect
import os
import subprocess
import sys
import textwrap
import typing

import pytest
import torch

import torch_mem_saver_lite
from children import SUPPORT, run_python
from host_memory import rss_anon_bytes
from torch_mem_saver_lite import TorchMemorySaver, _lib, alias, saver, torch_memory_saver
from torch_mem_saver_lite.compat import TorchMemorySaver as CompatClass

MiB = 1 << 20


def params(f) -> list[str]:
    return list(inspect.signature(f).parameters)


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "TMSL_"))}
    environment.update(env, PYTHONPATH=SUPPORT)
    return run_python(code, env=environment)


def test_every_public_signature_of_torch_memory_saver():
    tms = torch_memory_saver
    assert isinstance(tms, TorchMemorySaver) and TorchMemorySaver is CompatClass
    assert params(tms.region) == ["tag", "enable_cpu_backup", "enable_disk_backup", "cpu_backup_backend"]
    assert inspect.signature(tms.region).parameters["tag"].default == "default"
    assert params(tms.cuda_graph) == ["cuda_graph", "pool", "stream", "capture_error_mode", "tag",
                                      "enable_cpu_backup", "cpu_backup_backend"]
    assert inspect.signature(tms.cuda_graph).parameters["tag"].default == "default"
    assert params(tms.pause) == ["tag"] and params(tms.resume) == ["tag"]
    assert inspect.signature(tms.pause).parameters["tag"].default is None
    assert params(tms.get_cpu_backup) == ["x", "zero_copy"]
    assert params(tms.set_disk_backup_dir) == ["path"]
    assert params(tms.disable) == []
    assert tms.enabled is True
    for name in ("hook_mode", "memory_margin_bytes", "retain_cpu_backup"):
        assert isinstance(inspect.getattr_static(TorchMemorySaver, name), property)
    assert callable(torch_mem_saver_lite.configure_subprocess)
    # saver takes the same keywords (its graph tag default differs on purpose), and its region
    # one more of its own, last
    assert params(saver.region) == [*params(tms.region), "verify_wake", "stray_access", "soft_pause"]
    assert params(saver.cuda_graph) == params(tms.cuda_graph)


def test_settings_of_the_compat_object_are_the_savers():
    before = saver.memory_margin_bytes
    try:
        torch_memory_saver.memory_margin_bytes = 3 * MiB
        assert saver.memory_margin_bytes == 3 * MiB == torch_memory_saver.memory_margin_bytes
    finally:
        saver.memory_margin_bytes = before
    assert torch_memory_saver.hook_mode == saver.hook_mode
    assert torch_memory_saver.stats == saver.stats  # ours, passed through


def test_the_members_served_from_saver_keep_their_signatures_docstrings_and_types():
    from torch_mem_saver_lite import MemorySaver
    from torch_mem_saver_lite.compat import TorchMemorySaver, _Method, _Setting

    served = {name: member for name, member in vars(TorchMemorySaver).items()
              if isinstance(member, (_Method, _Setting))}
    assert {"stats", "paused", "host_cache_bytes", "poison_on_resume"} <= set(served)
    for name, member in served.items():
        ours = getattr(MemorySaver, name)
        assert getattr(TorchMemorySaver, name) is ours and member.__doc__ == ours.__doc__, name
        if isinstance(member, _Method):
            assert getattr(torch_memory_saver, name) == getattr(saver, name), name  # bound to saver
        else:  # the type declared here (_Setting[int]) is the one saver's property returns
            declared = member.__orig_class__.__args__[0]  # type: ignore[attr-defined]
            option = vars(MemorySaver)[name]  # an option's descriptor carries its type
            assert declared == typing.get_args(option.__orig_class__)[0], name
            assert getattr(torch_memory_saver, name) == getattr(saver, name), name


def test_the_members_served_from_saver_are_the_wrapped_savers_own(host_saver):
    from unittest import mock

    from torch_mem_saver_lite.compat import TorchMemorySaver

    compat = TorchMemorySaver(host_saver)
    with mock.patch.object(host_saver, "stats", return_value={"patched": None}):
        assert compat.stats() == {"patched": None}  # looked up on the saver it wraps
    compat.host_cache_bytes = 12 * MiB
    assert host_saver.host_cache_bytes == 12 * MiB == compat.host_cache_bytes


def test_unknown_tags_are_a_no_op_for_the_compat_object_and_an_error_for_saver(host_saver, mem):
    compat = TorchMemorySaver(host_saver)
    with compat.region("kv"):
        mem.malloc(2 * MiB)
    compat.pause("never_used")  # torch_memory_saver ignores it; so do we here
    compat.resume("never_used")
    assert not host_saver.stats()["kv"].paused
    compat.pause(["kv", "never_used"])
    assert host_saver.stats()["kv"].paused
    compat.resume()
    with pytest.raises(ValueError, match="unknown tag 'never_used'.*known tags"):
        host_saver.pause("never_used")


def test_cpu_backup_backend_is_checked_and_mmap_gives_host_memory_back(host_saver, mem):
    with pytest.raises(ValueError, match="requires enable_cpu_backup=True"):
        with host_saver.region("a", cpu_backup_backend="mmap"):
            pass
    with pytest.raises(ValueError, match="cpu_backup_backend must be one of 'pinned', 'mmap'"):
        with host_saver.region("a", enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with host_saver.region("pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        pinned = mem.malloc(8 * MiB)
    with host_saver.region("mmap", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        mapped = mem.malloc(8 * MiB)
    mem.write(pinned, b"p" * 8 * MiB)
    mem.write(mapped, b"m" * 8 * MiB)
    host_saver.pause()
    host_saver.resume()
    stats = host_saver.stats()
    assert stats["pinned"].host_backup_bytes == 8 * MiB  # kept in the host cache for the next pause
    assert stats["mmap"].host_backup_bytes == 0  # given back at the resume
    assert mem.read(mapped, 8 * MiB) == b"m" * 8 * MiB and mem.read(pinned, 8 * MiB) == b"p" * 8 * MiB

    # The process's own memory says the same: an "mmap" tag's backup has left RSS when the
    # resume returns (torch_memory_saver's programs read RSS right after it).
    host_saver.wait_for_released_backups()
    before = rss_anon_bytes()
    for _ in range(2):
        host_saver.pause("mmap")
        assert rss_anon_bytes() - before >= 8 * MiB  # the backup really is in host memory
        host_saver.resume("mmap")
        assert rss_anon_bytes() - before < 2 * MiB, "the mmap tag's backup was not given back"
    assert mem.read(mapped, 8 * MiB) == b"m" * 8 * MiB


def test_environment_variables_take_torch_memory_savers_names():
    result = run(
        """
        from torch_mem_saver_lite import saver, torch_memory_saver
        print(saver.retain_cpu_backup, torch_memory_saver.retain_cpu_backup)
        """,
        TMS_RETAIN_CPU_BACKUP="1",
    )
    assert result.stdout.split() == ["True", "True"], result.stderr


@pytest.mark.parametrize(("env", "message"), [
    ({"TMS_RETAIN_CPU_BACKUP": "yes"}, "TMS_RETAIN_CPU_BACKUP must be 0, 1, false or true, got 'yes'"),
    ({"TMS_INIT_CPU_BACKUP_BACKEND": "disk"}, "TMS_INIT_CPU_BACKUP_BACKEND must be one of pinned, mmap, got 'disk'"),
    ({"TMS_RETAIN_CPU_BACKUP": "1", "TMSL_RETAIN_CPU_BACKUP": "0"}, "disagree"),
    ({"TMS_INIT_ENABLE_DISK_BACKUP": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}, "exclude each other"),
    ({"TMS_DISK_BACKUP_DIR": "/" + "d" * 5000}, "TMS_DISK_BACKUP_DIR is longer than 4095 bytes"),
])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_bad_environment_values_are_reported_by_name_at_first_use(env, message):
    result = run(
        """
        import torch_mem_saver_lite                  # the import itself still works
        from torch_mem_saver_lite.testing import HostSaver
        try:
            HostSaver()._core()
        except Exception as error:
            print(type(error).__name__, error)
        """,
        **env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("MemorySaverError") and message in result.stdout


def test_python_reads_the_environment_through_the_native_library(tmp_path):
    # One reader for both languages: what the core read is what the Python side uses.
    result = run(
        """
        from torch_mem_saver_lite import _lib
        from torch_mem_saver_lite.settings import read_environment
        d, env = _lib.process_defaults(), read_environment()
        print(_lib.process_option("retain_cpu_backup"), d.caches_backups, d.tag.decode(),
              d.disk_backup_dir_variable.decode())
        from torch_mem_saver_lite import saver
        print(saver.retain_cpu_backup, env.default_caches_backups, env.default_tag, env.disk_backup_dir[0],
              env.disk_backup_dir[1] == d.disk_backup_dir.decode(), env.default_disk_backup)
        """,
        TMS_RETAIN_CPU_BACKUP="1", TMS_INIT_CPU_BACKUP_BACKEND="mmap", TMSL_DEFAULT_TAG="wé",
        TMS_DISK_BACKUP_DIR=str(tmp_path / "disk"),
    )
    expected = ["1 0 wé TMS_DISK_BACKUP_DIR", "True False wé TMS_DISK_BACKUP_DIR True False"]
    assert result.stdout.splitlines() == expected, result.stdout + result.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_bad_retention_or_directory_variable_leaves_the_process_wide_region_off():
    code = """
        from torch_mem_saver_lite import _lib
        print(_lib.process_defaults().region_all_threads)
        """
    assert run(code, TMS_INIT_ENABLE="1").stdout.split() == ["1"]  # the control
    assert run(code, TMS_INIT_ENABLE="1", TMS_RETAIN_CPU_BACKUP="yes").stdout.split() == ["0"]
    assert run(code, TMS_INIT_ENABLE="1", TMS_DISK_BACKUP_DIR="/a", TMSL_DISK_BACKUP_DIR="/b").stdout.split() == ["0"]


def test_native_defaults_take_torch_memory_savers_names():
    result = run(
        """
        from torch_mem_saver_lite import _lib
        print(_lib.lib().tmsl_process_defaults_error())
        """,
        TMS_INIT_ENABLE="1", TMSL_REGION_ALL_THREADS="0",
    )
    assert "TMSL_REGION_ALL_THREADS='0' and TMS_INIT_ENABLE='1' disagree" in result.stdout, result.stderr


def test_the_disk_backup_directory_comes_from_the_environment(disk_dir):
    result = run(
        """
        import os
        from host_memory import HostMemory
        from torch_mem_saver_lite.testing import HostSaver
        saver, mem = HostSaver(), HostMemory()
        with saver.region("kv", enable_disk_backup=True):
            ptr = mem.malloc(2 << 20)
        mem.write(ptr, b"disk")
        saver.pause("kv"); saver.resume("kv")
        print(mem.read(ptr, 4), os.path.isdir(os.environ["TMS_DISK_BACKUP_DIR"]))
        """,
        TMS_DISK_BACKUP_DIR=str(disk_dir / "from-env"),
    )
    assert result.stdout.split() == ["b'disk'", "True"], result.stderr


def test_import_torch_memory_saver_resolves_to_us_only_when_asked():
    if alias.real_installation() is not None:
        pytest.skip("a real torch_memory_saver is installed here")
    plain = run("import torch_memory_saver")
    assert "No module named 'torch_memory_saver'" in plain.stderr  # nothing without the opt-in

    path = subprocess.run([sys.executable, "-m", "torch_mem_saver_lite", "--alias-path"], capture_output=True,
                          text=True, timeout=60).stdout.strip()
    code = """
        from torch_memory_saver import torch_memory_saver, configure_subprocess, TorchMemorySaver
        from torch_memory_saver.utils import get_binary_path_from_package
        from torch_memory_saver.hooks.mode_preload import configure_subprocess as c2
        import torch_mem_saver_lite
        from torch_mem_saver_lite import _lib
        print(torch_memory_saver is torch_mem_saver_lite.torch_memory_saver, c2 is configure_subprocess)
        print(str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload")) == _lib.library_path())
    """
    environment = {**os.environ, "PYTHONPATH": path}
    aliased = run_python(code, env=environment)
    assert aliased.stdout.split() == ["True", "True", "True"], aliased.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_alias_never_hides_a_real_installation(tmp_path):
    fake = tmp_path / "site" / "torch_memory_saver"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([alias.ALIAS_PATH, str(fake.parent)])}
    result = run_python("import torch_memory_saver", env=environment)
    assert result.returncode != 0 and "installed too" in result.stderr
    code = f"""
        import sys
        sys.path.append({str(fake.parent)!r})
        from torch_mem_saver_lite import alias
        try:
            alias.enable()
        except Exception as error:
            print("refused", "is installed" in str(error))
    """
    assert run(code).stdout.split() == ["refused", "True"]


def test_the_in_process_alias_is_undone_by_disable():
    code = """
        import sys
        from torch_mem_saver_lite import alias, torch_memory_saver as ours
        alias.enable()
        import torch_memory_saver
        print(torch_memory_saver.torch_memory_saver is ours)
        alias.disable()
        print("torch_memory_saver" in sys.modules, alias.ALIAS_PATH in sys.path)
        try:
            import torch_memory_saver
        except ImportError:
            print("gone")
    """
    if alias.real_installation() is not None:
        pytest.skip("a real torch_memory_saver is installed here")
    assert run(code).stdout.split() == ["True", "False", "False", "gone"]


def test_configure_subprocess_is_torch_memory_savers_module_level_context_manager():
    before = os.environ.get("LD_PRELOAD")
    with torch_mem_saver_lite.configure_subprocess():
        assert os.environ["LD_PRELOAD"].split()[0] == torch_mem_saver_lite._lib.library_path()
    assert os.environ.get("LD_PRELOAD") == before


@pytest.mark.parametrize("selection", [b"kv", [3], [None], ["kv", 3], {"kv": 1}, 3, 3.5, object()])
def test_a_selection_that_is_not_tags_is_a_clear_error_that_changes_nothing(host_saver, mem, selection):
    compat = TorchMemorySaver(host_saver)
    with compat.region("kv"):
        mem.malloc(2 * MiB)
    for verb in (compat.pause, compat.resume):
        with pytest.raises(TypeError, match="tag must be a str, a list of str or None"):
            verb(selection)
    assert not host_saver.stats()["kv"].paused


def test_the_internals_torch_memory_savers_examples_reach(host_saver, mem):
    compat = TorchMemorySaver(host_saver)
    compat._ensure_initialized()
    cdll = compat._impl._binary_wrapper.cdll
    assert not cdll.tms_get_interesting_region()
    with compat.region("kv", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        # The native configuration follows the thread's regions, as torch_memory_saver's does.
        assert cdll.tms_get_interesting_region() and cdll.tms_get_current_tag() == b"kv"
        assert cdll.tms_get_enable_cpu_backup() and cdll.tms_get_cpu_backup_backend() == b"mmap"
        with compat.region("grad", enable_cpu_backup=False):
            assert cdll.tms_get_current_tag() == b"grad" and not cdll.tms_get_enable_cpu_backup()
            assert cdll.tms_get_cpu_backup_backend() == b"pinned"
        with compat.disable():
            assert not cdll.tms_get_interesting_region()
        assert cdll.tms_get_current_tag() == b"kv"
    with compat._impl._with_region_config(tag="cfg", enable_cpu_backup=True):
        assert cdll.tms_get_current_tag() == b"cfg" and cdll.tms_get_enable_cpu_backup()
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"configured")
    compat.pause("cfg")
    with compat._impl._with_region_config(tag="cfg", enable_cpu_backup=True):
        pass  # a paused tag's configuration is taken without the checks, as there
    compat.resume("cfg")
    assert mem.read(ptr, 10) == b"configured"
    assert dict(compat._impl._mem_pools) == {}  # the host saver routes no torch pools


# AReaL's patch of torch_memory_saver's hook_mode, as it is applied: the class's property is
# replaced by one whose setter writes only the dict that torch_memory_saver keeps until first use.
AREAL_PATCH = """
import torch_mem_saver_lite
def _getter(self):
    return self._impl_ctor_kwargs.get("hook_mode")
def _setter(self, hook_mode):
    if hasattr(self, "_impl_ctor_kwargs"):
        self._impl_ctor_kwargs["hook_mode"] = hook_mode
type(torch_mem_saver_lite.torch_memory_saver).hook_mode = property(_getter, _setter)
"""


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_a_patched_hook_mode_setter_sets_the_mode_before_first_use():
    # Preloaded, so that "preload" is a mode this process may take.
    result = run(AREAL_PATCH + """
from torch_mem_saver_lite import saver, torch_memory_saver
torch_memory_saver.hook_mode = "preload"          # through AReaL's setter: the dict only
print(saver.hook_mode, torch_memory_saver._impl_ctor_kwargs)
torch_memory_saver.pause("never_used")            # first use
print(saver.hook_mode, hasattr(torch_memory_saver, "_impl_ctor_kwargs"))
""", LD_PRELOAD=_lib.library_path())
    assert result.stdout.splitlines() == ["torch {'hook_mode': 'preload'}", "preload False"], result.stderr
    # Not preloaded: the first use says what is missing, and the setting stays for the next one.
    refused = run(AREAL_PATCH + """
from torch_mem_saver_lite import MemorySaverError, saver, torch_memory_saver
torch_memory_saver.hook_mode = "preload"
try:
    torch_memory_saver.pause("never_used")
except MemorySaverError as error:
    print("LD_PRELOAD" in str(error), saver.hook_mode, torch_memory_saver._impl_ctor_kwargs)
""")
    assert refused.stdout.splitlines() == ["True torch {'hook_mode': 'preload'}"], refused.stderr


def test_the_hook_mode_setter_keeps_torch_memory_savers_dict_until_first_use(host_saver):
    compat = TorchMemorySaver(host_saver)
    compat.hook_mode = "torch"
    assert compat._impl_ctor_kwargs.get("hook_mode") == "torch"  # Dynamo reads it there
    compat._ensure_initialized()
    assert not hasattr(compat, "_impl_ctor_kwargs")
    compat.hook_mode = "torch"  # after first use: the saver's setter alone, as before


def test_one_tag_takes_regions_with_and_without_backup_as_torch_memory_saver_does(host_saver, mem):
    compat = TorchMemorySaver(host_saver)
    with compat.region(enable_cpu_backup=True):
        kept = mem.malloc(2 * MiB)
    with compat.region(enable_cpu_backup=False):
        lost = mem.malloc(2 * MiB)
    mem.write(kept, b"kept")
    mem.write(lost, b"lost")
    compat.pause()
    compat.resume()
    assert mem.read(kept, 4) == b"kept" and mem.read(lost, 4) == bytes(4)


# How frameworks find torch_memory_saver's preload library beside the package: slime and AReaL
# by its exact name, others by a glob (the CUDA major's name first); miles then reads the file's
# bytes to learn whether it supports disk backup.
PRELOAD_PROBES = ["torch_memory_saver_hook_mode_preload.abi3.so", "torch_memory_saver_hook_mode_preload*.so",
                  "torch_memory_saver_hook_mode_preload_cu13*.so", "torch_memory_saver_hook_mode_preload_cu12*.so"]


@pytest.mark.parametrize("probe", PRELOAD_PROBES)
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_preload_library_is_found_where_frameworks_look_beside_the_alias_package(probe):
    found = run(f"""
        import glob, os
        from torch_mem_saver_lite import alias
        alias.enable()
        import torch_memory_saver
        matches = sorted(glob.glob(os.path.join(os.path.dirname(torch_memory_saver.__file__), "..", {probe!r})))
        with open(matches[0], "rb") as library:
            print(matches[0])
            print(b"TMS_INIT_ENABLE_DISK_BACKUP" in library.read())   # miles's check for disk backup
    """)
    path, supports_disk_backup = found.stdout.split()
    assert supports_disk_backup == "True", found.stderr
    # Preloaded, it is our library that answers cudaMalloc, the one copy ctypes loads too.
    preloaded = run("""
        from torch_mem_saver_lite import _lib
        with open("/proc/self/maps") as maps:
            copies = {line.split()[-1] for line in maps if line.rstrip().endswith("libtorch_mem_saver_lite.so")}
        print(_lib.lib().tmsl_preload_active(), copies == {_lib.library_path()})
    """, LD_PRELOAD=path)
    assert preloaded.stdout.split() == ["1", "True"], preloaded.stderr


def test_get_cpu_backup_with_zero_copy_shares_the_backup_through_the_drop_in(host_saver, mem):
    compat = TorchMemorySaver(host_saver)
    with compat.region("w", enable_cpu_backup=True):
        ptr = mem.malloc(2 * MiB)
    content = os.urandom(2 * MiB)
    mem.write(ptr, content)
    device_view = host_saver_tensor(ptr)
    compat.pause("w")
    shared = compat.get_cpu_backup(device_view, zero_copy=True)
    again = compat.get_cpu_backup(device_view, zero_copy=True)
    copied = compat.get_cpu_backup(device_view)
    assert bytes(shared.numpy()) == bytes(copied.numpy()) == content
    assert shared.data_ptr() == again.data_ptr() != copied.data_ptr()  # the backup's memory itself, not a copy
    assert shared.data_ptr() != ptr
    compat.resume("w")
    assert mem.read(ptr, 2 * MiB) == content
    assert len(bytes(shared.numpy())) == 2 * MiB  # still readable after the resume (it holds the memory)


def test_mmap_memory_goes_back_at_resume_also_when_paused_with_cached_memory(host_saver, mem):
    with host_saver.region("a", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        mapped = mem.malloc(64 * MiB)
    with host_saver.region("b", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        cached = mem.malloc(8 * MiB)
    mem.write(mapped, b"m")
    mem.write(cached, b"p")
    host_saver.wait_for_released_backups()
    before = rss_anon_bytes()
    host_saver.pause(None)  # one pause, both kinds of backup
    host_saver.resume(None)
    assert rss_anon_bytes() - before < 24 * MiB, "the mmap backup shared an arena that stayed cached"
    assert (mem.read(mapped, 1), mem.read(cached, 1)) == (b"m", b"p")


def test_a_retained_copy_given_back_is_never_handed_out_again(host_saver, mem):
    host_saver.retain_cpu_backup = True
    with host_saver.region("w", enable_cpu_backup=True):
        ptr = mem.malloc(2 * MiB)
    mem.write(ptr, b"\x07" * 16)
    host_saver.pause("w")
    host_saver.resume("w")
    tensor_view = host_saver_tensor(ptr)
    assert host_saver.get_cpu_backup(tensor_view)[:16].tolist() == [7] * 16  # retained: handed out
    host_saver.release_host_cache()
    with host_saver.region("w", enable_cpu_backup=True):  # sets fresh host memory aside for "w"
        mem.malloc(2 * MiB)
    host_saver.wait_for_released_backups()
    assert host_saver.get_cpu_backup(tensor_view) is None  # not a stale or empty "retained" copy
    host_saver.retain_cpu_backup = False


def host_saver_tensor(ptr: int):
    import torch

    return torch.frombuffer((ctypes.c_uint8 * (2 * MiB)).from_address(ptr), dtype=torch.uint8)


def test_mem_pools_answer_under_torch_memory_savers_keys(host_saver):
    compat = TorchMemorySaver(host_saver)
    table = host_saver._torch_pools().table
    default, mmap = object(), object()
    table[("kv", 0, _lib.CHOICE_AUTO)] = default  # a region that gave no setting
    table[("w", 1, _lib.CHOICE_ON_UNCACHED)] = mmap
    pools = compat._impl._mem_pools
    assert set(pools) == {("kv", False, False, "", 0), ("w", True, False, "mmap", 1)}
    assert dict(pools) == {("kv", False, False, "", 0): default, ("w", True, False, "mmap", 1): mmap}
    assert ("kv", True, False, "pinned", 0) not in pools and "kv" not in pools
    with pytest.raises(KeyError):
        pools["nonsense"]
    assert pools.pop(("w", True, False, "mmap", 1)) is mmap and len(pools) == 1
    pools.clear()
    assert table == {}


def test_region_config_checks_its_arguments_as_region_does(host_saver):
    compat = TorchMemorySaver(host_saver)
    with pytest.raises(ValueError, match="cpu_backup_backend must be one of"):
        with compat._impl._with_region_config(tag="t", enable_cpu_backup=True, cpu_backup_backend="disk"):
            pass
    with pytest.raises(ValueError, match="exclude each other"):
        with compat._impl._with_region_config(tag="t", enable_cpu_backup=True, enable_disk_backup=True):
            pass


# On a GPU

PRELUDE = """
import os, torch
from torch_memory_saver import torch_memory_saver
torch_memory_saver.hook_mode = os.environ["TMSL_TEST_MODE"]
MiB = 1 << 20

def used():
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free

def check_released(before, nbytes):
    # The README's promise: at least 99 % of a paused region's bytes come back to the device
    # (the driver's own bookkeeping may take a page meanwhile).
    released = before - used()
    assert released >= 0.99 * nbytes, f"released {released / MiB:.1f} MiB of {nbytes / MiB:.0f} MiB"
"""

PROGRAMS = {
    "basic_pause_releases_memory_and_keeps_addresses": """
        with torch_memory_saver.region():
            x = torch.full((256 * MiB,), 7, dtype=torch.uint8, device="cuda")
        ptr, before = x.data_ptr(), used()
        torch_memory_saver.pause()
        check_released(before, 256 * MiB)
        torch_memory_saver.resume()
        assert x.data_ptr() == ptr
        x.fill_(3)
        assert int(x.sum()) == 3 * 256 * MiB
    """,
    "cpu_backup_keeps_content_and_no_backup_does_not_need_it": """
        with torch_memory_saver.region(enable_cpu_backup=True):
            weights = torch.randn(64 * MiB // 4, device="cuda")
        with torch_memory_saver.region(tag="kv_cache", enable_cpu_backup=False):
            kv = torch.full((64 * MiB // 4,), 5.0, device="cuda")
        reference = weights.cpu()
        before = used()
        torch_memory_saver.pause()
        check_released(before, 128 * MiB)
        torch_memory_saver.resume()
        assert torch.equal(weights.cpu(), reference)
        kv.fill_(1.0)
        assert float(kv.sum()) == kv.numel()
    """,
    "tags_pause_and_resume_separately": """
        with torch_memory_saver.region(tag="type1"):
            t1 = torch.full((128 * MiB,), 1, dtype=torch.uint8, device="cuda")
        with torch_memory_saver.region(tag="type2", enable_cpu_backup=True):
            t2 = torch.full((128 * MiB,), 2, dtype=torch.uint8, device="cuda")
        before = used()
        torch_memory_saver.pause("type1")
        released = before - used()
        assert 0.99 * 128 * MiB <= released < 200 * MiB, f"released {released / MiB:.1f} MiB"  # type1 only
        torch_memory_saver.pause("type2")
        torch_memory_saver.resume("type2")
        assert int(t2.sum()) == 2 * 128 * MiB
        torch_memory_saver.resume("type1")
        t1.fill_(4)
        assert int(t1.sum()) == 4 * 128 * MiB
    """,
    "cuda_graph_default_tag_is_default_and_replays_after_resume": """
        static_in = torch.ones(4 * MiB // 4, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                static_in * 2 + 1
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch_memory_saver.cuda_graph(graph):
            static_out = static_in * 2 + 1
        graph.replay()
        assert torch_memory_saver.stats()["default"].graph_memory
        before = used()
        torch_memory_saver.pause("default")  # covers the graph's memory, as with torch_memory_saver
        check_released(before, 4 * MiB)
        torch_memory_saver.resume("default")
        static_in.fill_(3)
        graph.replay()
        assert torch.equal(static_out, torch.full_like(static_out, 7))
    """,
    "nested_regions_and_disable": """
        with torch_memory_saver.region(tag="outer"):
            a = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
            with torch_memory_saver.region(tag="inner"):
                b = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
                with torch_memory_saver.disable():
                    c = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
            d = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
        stats = torch_memory_saver.stats()
        assert stats["inner"].reserved_bytes >= 16 * MiB and stats["outer"].reserved_bytes >= 32 * MiB
        before = used()
        torch_memory_saver.pause()
        check_released(before, 48 * MiB)
        c.fill_(2)  # ordinary memory: usable while everything else is paused
        assert int(c.sum()) == 32 * MiB
        torch_memory_saver.resume()
        a.fill_(1); b.fill_(1); d.fill_(1)
    """,
    "retain_cpu_backup_and_get_cpu_backup": """
        torch_memory_saver.retain_cpu_backup = True
        assert torch_memory_saver.retain_cpu_backup
        with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
            w = torch.randn(32 * MiB // 4, device="cuda")
        reference = w.cpu()
        torch_memory_saver.pause("weights")
        assert torch.equal(torch_memory_saver.get_cpu_backup(w), reference)
        assert torch.equal(torch_memory_saver.get_cpu_backup(w, zero_copy=True), reference)
        torch_memory_saver.resume("weights")
        # Retained: handed out while resident too, at the same host address, as there.
        assert torch.equal(torch_memory_saver.get_cpu_backup(w), reference)
        assert torch_memory_saver.stats()["weights"].host_backup_bytes >= w.nbytes
        torch_memory_saver.retain_cpu_backup = False
        torch_memory_saver.pause("weights")
        torch_memory_saver.resume("weights")
        assert torch.equal(w.cpu(), reference)
    """,
    "cpu_backup_backend_mmap_gives_host_memory_back": """
        with torch_memory_saver.region(tag="m", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            m = torch.randn(64 * MiB // 4, device="cuda")
        with torch_memory_saver.region(tag="p", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            p = torch.randn(64 * MiB // 4, device="cuda")
        reference_m, reference_p = m.cpu(), p.cpu()
        torch_memory_saver.pause()
        torch_memory_saver.resume()
        assert torch.equal(m.cpu(), reference_m) and torch.equal(p.cpu(), reference_p)
        stats = torch_memory_saver.stats()
        assert stats["m"].host_backup_bytes == 0 and stats["p"].host_backup_bytes >= p.nbytes
    """,
    "disable_after_a_process_wide_pause_uses_fresh_memory": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1 (slime's training engine): torch's
        # default pool is full of paused blocks, none of which disable() may hand out.
        weights = torch.full((256 * MiB,), 42, dtype=torch.uint8, device="cuda")
        activations = [torch.ones(64 * MiB // 4, device="cuda") for _ in range(8)]
        del activations  # cached free blocks in the default pool, paused with it below
        before = used()
        torch_memory_saver.pause()
        check_released(before, 256 * MiB + 512 * MiB)
        paused = used()
        with torch_memory_saver.disable():
            x = torch.full((64 * MiB,), 53, dtype=torch.uint8, device="cuda")
            small = torch.arange(1000, device="cuda", dtype=torch.float32)
            assert float(x.float().mean()) == 53.0 and float(small.sum()) == 499500.0
            assert torch.equal(torch.cumsum(small, 0).cpu(), torch.cumsum(small.cpu(), 0))
            del x, small
        assert used() <= paused + 8 * MiB, f"{(used() - paused) / MiB:.1f} MiB kept after disable()"
        torch_memory_saver.resume()
        assert int(weights.sum()) == 42 * 256 * MiB
    """,
    "allocations_outside_and_in_disable_while_a_pool_is_paused": """
        with torch_memory_saver.region(tag="w", enable_cpu_backup=True):
            w = torch.full((128 * MiB,), 7, dtype=torch.uint8, device="cuda")
            scratch = [torch.empty(16 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
            del scratch  # the tag's pool caches free blocks that the pause releases
        torch_memory_saver.pause("w")
        with torch_memory_saver.region(tag="other"):
            with torch_memory_saver.disable():
                inside = torch.full((16 * MiB,), 3, dtype=torch.uint8, device="cuda")
                assert int(inside.sum()) == 3 * 16 * MiB
        outside = torch.full((16 * MiB,), 5, dtype=torch.uint8, device="cuda")
        assert int(outside.sum()) == 5 * 16 * MiB and int(inside.sum()) == 3 * 16 * MiB
        torch_memory_saver.resume("w")
        assert int(w.sum()) == 7 * 128 * MiB
    """,
    "pausing_a_tag_no_region_used_does_nothing": """
        with torch_memory_saver.region(tag="kv_cache"):
            kv = torch.ones(16 * MiB, dtype=torch.uint8, device="cuda")
        torch_memory_saver.pause("cuda_graph")  # an engine with graphs turned off
        torch_memory_saver.resume("cuda_graph")
        kv.fill_(2)
        assert int(kv.sum()) == 32 * MiB
    """,
    "disk_backup_keeps_content_and_releases_memory": """
        torch_memory_saver.set_disk_backup_dir(os.environ["TMSL_TEST_DISK_DIR"])
        with torch_memory_saver.region(tag="weights", enable_disk_backup=True):
            w = torch.randn(256 * MiB // 4, device="cuda")
        reference = w.cpu()
        before = used()
        torch_memory_saver.pause("weights")
        check_released(before, 256 * MiB)
        assert torch_memory_saver.stats()["weights"].host_backup_bytes == 0
        torch_memory_saver.resume("weights")
        assert torch.equal(w.cpu(), reference)
    """,
    "disk_backup_directory_from_the_environment": """
        assert os.environ["TMS_DISK_BACKUP_DIR"]
        with torch_memory_saver.region(tag="w", enable_disk_backup=True):
            w = torch.arange(16 * MiB // 4, device="cuda", dtype=torch.int32)
        torch_memory_saver.pause("w")
        torch_memory_saver.resume("w")
        assert torch.equal(w, torch.arange(16 * MiB // 4, device="cuda", dtype=torch.int32))
    """,
    "environment_defaults_make_every_allocation_pauseable": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1: no region needed (preload mode)
        x = torch.full((64 * MiB,), 9, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        assert torch_memory_saver.stats()["default"].reserved_bytes >= 64 * MiB
        torch_memory_saver.pause("default")
        torch_memory_saver.resume("default")
        assert int(x.sum()) == 9 * 64 * MiB
    """,
    "environment_defaults_with_disk_backup": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_DISK_BACKUP=1, TMS_DISK_BACKUP_DIR=...
        x = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8, device="cuda")
        reference = x.cpu()
        before = used()
        torch_memory_saver.pause("default")
        check_released(before, 64 * MiB)
        assert torch_memory_saver.stats()["default"].host_backup_bytes == 0  # on disk, not in RAM
        torch_memory_saver.resume("default")
        assert torch.equal(x.cpu(), reference)
    """,
    "environment_defaults_with_the_mmap_backend": """
        # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1, TMS_INIT_CPU_BACKUP_BACKEND=mmap
        x = torch.full((64 * MiB,), 5, dtype=torch.uint8, device="cuda")
        torch_memory_saver.pause("default")
        assert torch_memory_saver.stats()["default"].host_backup_bytes >= 64 * MiB
        torch_memory_saver.resume("default")
        assert int(x.sum()) == 5 * 64 * MiB
        assert torch_memory_saver.stats()["default"].host_backup_bytes == 0  # given back at resume
    """,
    "several_devices": """
        tensors = []
        for device in range(2):
            with torch.cuda.device(device), torch_memory_saver.region(tag=f"gpu{device}", enable_cpu_backup=True):
                tensors.append(torch.full((64 * MiB,), device + 1, dtype=torch.uint8, device="cuda"))
        torch_memory_saver.pause()
        torch_memory_saver.resume()
        assert [int(t.sum()) for t in tensors] == [64 * MiB, 2 * 64 * MiB]
        assert [t.device.index for t in tensors] == [0, 1]
    """,
}

EXTRA_ENV = {
    "environment_defaults_make_every_allocation_pauseable": {"TMS_INIT_ENABLE": "1",
                                                             "TMS_INIT_ENABLE_CPU_BACKUP": "1"},
    "environment_defaults_with_disk_backup": {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_DISK_BACKUP": "1"},
    "disable_after_a_process_wide_pause_uses_fresh_memory": {"TMS_INIT_ENABLE": "1",
                                                             "TMS_INIT_ENABLE_CPU_BACKUP": "1"},
    "environment_defaults_with_the_mmap_backend": {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1",
                                                   "TMS_INIT_CPU_BACKUP_BACKEND": "mmap"},
}
ONLY_PRELOAD = {name for name in EXTRA_ENV if "TMS_INIT_ENABLE" in EXTRA_ENV[name]}
FROM_ENV_DISK_DIR = {"disk_backup_directory_from_the_environment", "environment_defaults_with_disk_backup"}


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TMSL_TEST_HOOK_MODE") == "preload", reason="runs both hook modes itself")
@pytest.mark.parametrize("mode", ["torch", "preload"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_torch_memory_saver_program(name, mode, disk_dir):
    if name in ONLY_PRELOAD and mode != "preload":
        pytest.skip("process-wide regions from the environment are a preload-mode feature, as there")
    if name == "several_devices" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    if alias.real_installation() is not None:
        pytest.skip("a real torch_memory_saver is installed: the alias refuses to hide it")
    disk_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "TMSL_", "LD_PRELOAD"))}
    env.update(PYTHONPATH=alias.ALIAS_PATH, TMSL_TEST_MODE=mode, TMSL_TEST_DISK_DIR=str(disk_dir),
               TMS_DISK_BACKUP_DIR=str(disk_dir), **EXTRA_ENV.get(name, {}))
    if name not in FROM_ENV_DISK_DIR:
        env.pop("TMS_DISK_BACKUP_DIR")
    if mode == "preload":
        env["LD_PRELOAD"] = _lib.library_path()
    code = PRELUDE + textwrap.dedent(PROGRAMS[name]) + "\nprint('OK')\n"
    result = run_python(code, timeout=300, env=env)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-4000:]

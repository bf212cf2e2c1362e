"""The package as a user gets it: this checkout built into a wheel (as `pip install .` builds
it), installed into a fresh virtual environment, used, and uninstalled. The wheel's library
exports no testing ABI; the preload library frameworks find beside the alias package loads
ours; using the alias writes nothing pip does not know; `pip uninstall` leaves nothing behind.
Slow (a full build of the library): marked `slow`."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TESTING_FUNCTIONS = ("tmsl_create_host_saver", "tmsl_destroy_saver", "tmsl_malloc", "tmsl_free",
                     "tmsl_inject_fault", "tmsl_host_memory_limit", "tmsl_tiers_figures", "tmsl_hold_foreground",
                     "tmsl_set_patience_for_replicas", "tmsl_fingerprint_host_bytes", "tmsl_fingerprint_memory")

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Venv:
    python: Path
    site: Path  # its site-packages
    env: dict[str, str]  # how to run it: torch (and pip) from this environment, nothing of ours


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    for tool in ("scikit_build_core", "hatch_fancy_pypi_readme"):  # pyproject.toml's build tools
        pytest.importorskip(tool, reason="building the wheel needs the build tools (make install has them)")
    out = tmp_path_factory.mktemp("wheel")
    # Its own build folder (kept, so a second run only relinks), apart from the editable install's;
    # one build in it at a time (test runs in parallel each build their wheel).
    build = ROOT / "build" / "test-install"
    build.parent.mkdir(exist_ok=True)
    with open(f"{build}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w",
                        str(out), "--config-settings", f"build-dir={build}", str(ROOT)],
                       check=True, capture_output=True, text=True, timeout=1800)
    return next(out.glob("torch_mem_saver_lite-*.whl"))


def _dependencies(folder: Path) -> Path:
    """A folder with links to everything beside torch in this environment's site-packages
    except torch_mem_saver_lite itself (nor its editable install's hooks, nor any .pth): the
    fresh environment imports torch and pip from there, and nothing of ours."""
    site = Path(torch.__file__).resolve().parents[1]
    folder.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if "torch_mem_saver_lite" in name or "torch_memory_saver" in name or name.endswith(".pth"):
            continue
        (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture
def venv(tmp_path, wheel) -> Venv:
    root = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
    python = root / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "TMSL_", "PYTHON", "LD_PRELOAD"))}
    env["PYTHONPATH"] = str(_dependencies(tmp_path / "dependencies"))
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=env).stdout.strip())
    made = Venv(python, site, env)
    run(made, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel))
    return made


def run(venv: Venv, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    # Run from the venv's folder, never this checkout: its package must not be importable.
    result = subprocess.run([str(venv.python), *args], capture_output=True, text=True, timeout=300,
                            cwd=venv.python.parents[1], env={**venv.env, **env})
    assert result.returncode == 0 or not check, result.stdout + result.stderr
    return result


def ours(site: Path) -> list[str]:
    """Every file and folder of torch_mem_saver_lite's in ``site``."""
    return sorted(str(path.relative_to(site)) for path in site.rglob("*")
                  if "torch_mem_saver_lite" in str(path.relative_to(site)))


def test_the_wheels_library_exports_no_testing_abi(wheel):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "check_exports.py"), str(wheel)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "torch_mem_saver_lite/libtorch_mem_saver_lite.so" in names
    exported = result.stdout.split(": ", 1)[1].split(", ")
    assert "tmsl_pause" in exported and not set(TESTING_FUNCTIONS) & set(exported)


def test_host_saver_says_what_it_needs_where_the_library_has_no_testing_abi(venv):
    result = run(venv, "-c", "from torch_mem_saver_lite.testing import HostSaver; HostSaver()._core()", check=False)
    assert result.returncode != 0 and "has no testing ABI" in result.stderr and "pip install -e ." in result.stderr


def test_the_preload_library_beside_the_installed_alias_loads_ours(venv):
    found = run(venv, "-c", "from torch_mem_saver_lite import alias; alias.enable(); import torch_memory_saver, os; "
                            "print(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)))")
    folder = Path(found.stdout.strip())
    assert folder.is_relative_to(venv.site)
    for name in ("torch_memory_saver_hook_mode_preload.abi3.so", "torch_memory_saver_hook_mode_preload_cu12.abi3.so",
                 "torch_memory_saver_hook_mode_preload_cu13.abi3.so"):
        assert b"TMS_INIT_ENABLE_DISK_BACKUP" in (folder / name).read_bytes()
        preloaded = run(venv, "-c", "from torch_mem_saver_lite import _lib; print(_lib.lib().tmsl_preload_active())",
                        LD_PRELOAD=str(folder / name))
        assert preloaded.stdout.strip() == "1", preloaded.stderr


def test_uninstall_leaves_nothing_behind(venv):
    installed = ours(venv.site)
    assert "torch_mem_saver_lite/__init__.py" in installed
    run(venv, "-c", "from torch_mem_saver_lite import alias; alias.enable(); import torch_memory_saver")
    run(venv, "-m", "torch_mem_saver_lite", "alias", "install")
    pth = venv.site / "torch_mem_saver_lite_alias.pth"
    assert pth.is_file()
    assert set(ours(venv.site)) - {pth.name} == set(installed), "using the alias wrote into the installed package"

    run(venv, "-m", "pip", "uninstall", "-y", "-q", "torch-mem-saver-lite")
    # The next interpreter start: the package is gone, and the hook's .pth removes itself.
    gone = run(venv, "-c", "import torch_mem_saver_lite", check=False)
    assert gone.returncode != 0 and "No module named 'torch_mem_saver_lite'" in gone.stderr, gone.stderr
    assert ours(venv.site) == [] and not pth.exists()
    assert run(venv, "-c", "print('clean')").stderr == ""  # no leftover hook complains at start

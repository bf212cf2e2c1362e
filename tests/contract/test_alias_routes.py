"""The routes that make `import torch_memory_saver` load torch_mem_saver_lite where the real
torch_memory_saver is installed, in a fresh virtual environment with torch_memory_saver 0.0.10
really installed into it (its wheel installs without a GPU): without an override the alias
refuses; the .pth hook (`alias install` / `alias remove`), the variable with the alias folder on
PYTHONPATH, and `alias.enable(override=True)` each load us with a warning, and undoing each gives
the installed package back. Nothing here touches the environment running the tests."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from torch_mem_saver_lite import alias

TMS_VERSION = "0.0.10"
# Prints "ours" when the import gave torch_mem_saver_lite's object, else the file it loaded;
# the submodules frameworks import must come from the same package.
WHICH = """
import torch_memory_saver, torch_mem_saver_lite
from torch_memory_saver.hooks.mode_preload import configure_subprocess
from torch_memory_saver.utils import get_binary_path_from_package
ours = isinstance(torch_memory_saver.torch_memory_saver, torch_mem_saver_lite.TorchMemorySaver)
print("ours" if ours else torch_memory_saver.__file__)
"""


@dataclass(frozen=True)
class Venv:
    python: Path
    wheel: Path
    installed: str  # the real torch_memory_saver's __init__.py there


def _wheel(folder: Path) -> Path:
    """torch_memory_saver's wheel: TMSL_TEST_TMS_WHEEL names a local copy (offline machines),
    else pip downloads it; the tests skip, saying why, when neither gives one."""
    if os.environ.get("TMSL_TEST_TMS_WHEEL"):
        return Path(os.environ["TMSL_TEST_TMS_WHEEL"])
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                             "-d", str(folder), f"torch_memory_saver=={TMS_VERSION}"],
                            capture_output=True, text=True, timeout=300)
    wheels = sorted(folder.glob("torch_memory_saver-*.whl"))
    if result.returncode != 0 or not wheels:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"no torch_memory_saver {TMS_VERSION} wheel (pip download failed: {reason}); "
                    "set TMSL_TEST_TMS_WHEEL to a local copy")
    return wheels[0]


def _pip_install(python: Path, wheel: Path) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    if sys.prefix != sys.base_prefix:
        # A venv made from inside a venv sees the base interpreter's packages, not this one's:
        # it would test another copy of torch_mem_saver_lite (make test runs these, with the
        # machine's interpreter; the wheel test runs inside a venv).
        pytest.skip("running inside a venv: a nested --system-site-packages venv would not see its packages")
    wheel = _wheel(tmp_path_factory.mktemp("wheel"))
    root = tmp_path_factory.mktemp("venv") / "env"
    # Sees this environment's torch and torch_mem_saver_lite; pip comes from there too.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)],
                   check=True, timeout=300)
    python = root / "bin" / "python"
    _pip_install(python, wheel)
    installed = run(python, "import torch_memory_saver; print(torch_memory_saver.__file__)").stdout.strip()
    assert Path(installed).is_relative_to(root), installed
    return Venv(python, wheel, installed)


def environment(**changes: str) -> dict[str, str]:
    """This environment without any alias route, plus ``changes``; warnings shown."""
    env = {k: v for k, v in os.environ.items() if k != alias.VARIABLE}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != alias.ALIAS_PATH]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONWARNINGS"] = "default"
    return {**env, **changes}


def run(python: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120,
                          env=environment(**env))


def command(venv: Venv, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(venv.python), "-m", "torch_mem_saver_lite", *args], capture_output=True, text=True,
                            timeout=120, env=environment())
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def with_alias_path() -> str:
    return os.pathsep.join([alias.ALIAS_PATH, *environment()["PYTHONPATH"].split(os.pathsep)]).rstrip(os.pathsep)


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_without_an_override_the_alias_refuses_to_hide_the_installed_package(venv):
    assert run(venv.python, WHICH).stdout.strip() == venv.installed  # nothing asked: the real one
    for variable in ({}, {alias.VARIABLE: "0"}):
        refused = run(venv.python, WHICH, PYTHONPATH=with_alias_path(), **variable)
        assert refused.returncode != 0 and "installed too" in refused.stderr, refused.stderr
        assert venv.installed in refused.stderr and "alias install" in refused.stderr
    in_process = run(venv.python, """
from torch_mem_saver_lite import alias
try:
    alias.enable()
except Exception as error:
    print("refused", "override=True" in str(error))
""")
    assert in_process.stdout.split() == ["refused", "True"], in_process.stderr


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_pth_hook_loads_us_with_a_warning_survives_a_reinstall_and_removal_restores_the_package(venv):
    hook = Path(run(venv.python, "from torch_mem_saver_lite import alias; print(alias.hook_path())").stdout.strip())
    assert hook.is_relative_to(venv.python.parents[1]), hook  # the venv's site-packages, never ours
    try:
        assert str(hook) in command(venv, "alias", "install").stdout and hook.is_file()
        loaded = run(venv.python, WHICH)
        assert loaded.stdout.strip() == "ours", loaded.stderr
        assert "AliasWarning" in loaded.stderr
        assert f"torch_memory_saver at {venv.installed} is shadowed by torch_mem_saver_lite" in loaded.stderr
        assert str(hook) in loaded.stderr and "alias remove" in loaded.stderr

        _pip_install(venv.python, venv.wheel)  # `pip install -r requirements.txt` puts it back
        assert run(venv.python, WHICH).stdout.strip() == "ours"
        opted_out = run(venv.python, WHICH, **{alias.VARIABLE: "0"})  # one process tree
        assert opted_out.stdout.strip() == venv.installed and "AliasWarning" not in opted_out.stderr
        assert "loads torch_mem_saver_lite and warns" in command(venv, "alias", "status").stdout
    finally:
        removed = command(venv, "alias", "remove")
    assert str(hook) in removed.stdout and not hook.exists()
    restored = run(venv.python, WHICH)
    assert restored.stdout.strip() == venv.installed and "AliasWarning" not in restored.stderr
    assert "loads the installed torch_memory_saver" in command(venv, "alias", "status").stdout


@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_the_variable_with_the_alias_folder_on_pythonpath_loads_us_with_a_warning(venv):
    loaded = run(venv.python, WHICH, PYTHONPATH=with_alias_path(), **{alias.VARIABLE: "1"})
    assert loaded.stdout.strip() == "ours", loaded.stderr
    assert f"torch_memory_saver at {venv.installed} is shadowed by torch_mem_saver_lite" in loaded.stderr
    assert f"{alias.VARIABLE}=1" in loaded.stderr and f"unset {alias.VARIABLE}" in loaded.stderr
    misspelt = run(venv.python, WHICH, PYTHONPATH=with_alias_path(), **{alias.VARIABLE: "yes"})
    assert misspelt.returncode != 0 and f"{alias.VARIABLE} must be 1" in misspelt.stderr, misspelt.stderr
    assert run(venv.python, WHICH, **{alias.VARIABLE: "1"}).stdout.strip() == venv.installed  # undone: off the path


def test_enable_with_override_shadows_in_process_and_disable_gives_the_package_back(venv):
    code = """
import warnings
from torch_mem_saver_lite import alias, TorchMemorySaver
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    alias.enable(override=True)
    import torch_memory_saver
print(isinstance(torch_memory_saver.torch_memory_saver, TorchMemorySaver),
      [w.category.__name__ for w in caught] == ["AliasWarning"], "alias.disable()" in str(caught[0].message))
alias.disable()
import torch_memory_saver
print(torch_memory_saver.__file__)
"""
    result = run(venv.python, code)
    assert result.stdout.split() == ["True", "True", "True", venv.installed], result.stderr

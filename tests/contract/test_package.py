"""What a user installing the package sees: version, typing marker, license, logging and
the doctor's command line (without a GPU here)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_mem_saver_lite
from children import prelude, run_python
from torch_mem_saver_lite import OutOfMemoryError, StrayAccessWarning, _lib, alias

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_version_typing_marker_and_license():
    assert torch_mem_saver_lite.__version__ == importlib.metadata.version("torch-mem-saver-lite")
    assert (Path(torch_mem_saver_lite.__file__).parent / "py.typed").is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch_mem_saver_lite", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_the_doctor_has_a_command_line():
    assert doctor("--version").stdout.strip() == f"torch_mem_saver_lite {torch_mem_saver_lite.__version__}"
    assert "--check" in doctor("--help").stdout


# Runs the command line in a fresh interpreter and says afterwards whether torch was imported.
WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["torch_mem_saver_lite", *sys.argv[1:]]
try:
    runpy.run_module("torch_mem_saver_lite", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("option", ["--version", "--alias-path"])
def test_version_and_alias_path_import_no_torch(option):
    result = run_python(WITHOUT_TORCH, option, cwd=ROOT.parent)
    assert result.returncode == 0, result.stderr
    answer, verdict = result.stdout.strip().splitlines()
    assert verdict == "torch imported: False"
    assert answer in (f"torch_mem_saver_lite {torch_mem_saver_lite.__version__}", alias.ALIAS_PATH)
    assert result.stderr == ""  # not torch's NumPy warning, nor anything else


def test_the_help_says_what_is_checked_and_what_each_exit_status_means():
    text = doctor("--help").stdout
    assert "what the doctor checks:" in text and "--check then allocates 64 MiB" in text
    statuses = {line.split()[0] for line in text.split("exit status:")[1].splitlines() if line[:3].strip().isdigit()}
    assert statuses == {"0", "1", "2"}
    assert doctor("--no-such-option").returncode == 2  # as the help says


@pytest.mark.parametrize("document", ["README.md", "docs/migration.md"])
def test_the_documented_alias_line_adds_no_empty_pythonpath_entry(document):
    # An empty entry would put the current directory on sys.path of every process.
    documented = (ROOT / document).read_text()
    commands = set(re.findall(r"export PYTHONPATH=\$\(python -m torch_mem_saver_lite --alias-path\)[^\s`]*",
                              documented))
    assert commands
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])  # `python` is ours
    for command in commands:
        for before in (None, "/elsewhere"):
            shell_env = env if before is None else {**env, "PYTHONPATH": before}
            result = subprocess.run(["bash", "-c", f'{command}\nprintf "%s" "$PYTHONPATH"'], capture_output=True,
                                    text=True, timeout=60, env=shell_env)
            expected = [alias.ALIAS_PATH] + ([before] if before else [])
            assert result.stdout.split(os.pathsep) == expected, (document, command, result.stdout, result.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_the_doctor_without_a_gpu_answers_in_json_and_fails():
    result = doctor("--json", "--check")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["problems"] and report["checks"] == []
    assert report["version"] == torch_mem_saver_lite.__version__
    assert "check: not run" in doctor("--check").stdout


def test_pause_and_resume_log_tags_bytes_and_speed_at_info(host_saver, mem, caplog):
    with host_saver.region("weights", enable_cpu_backup=True):
        mem.malloc(8 * MiB)
    with caplog.at_level(logging.INFO, logger="torch_mem_saver_lite"):
        host_saver.pause("weights")
        host_saver.resume("weights")
        host_saver.pause("weights")
        host_saver.pause("weights")  # nothing changes: nothing logged
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("pause ['weights']: 0.01 GiB of device memory released, 0.01 GiB backed up")
    assert lines[1].startswith("resume ['weights']: 0.01 GiB of device memory mapped again")
    assert lines[1].endswith("; weights: wake passed")  # what its check found
    assert all("ms (" in line and "GB/s)" in line for line in lines)


def test_a_resume_logs_the_stray_writes_it_found(host_saver, mem, caplog):
    with host_saver.region("kv"):
        ptr = mem.malloc(4 * MiB)
    host_saver.pause("kv")
    mem.write(ptr, b"stray")
    with caplog.at_level(logging.INFO, logger="torch_mem_saver_lite"), pytest.warns(StrayAccessWarning):
        host_saver.resume("kv")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume")]
    assert len(lines) == 1 and lines[0].endswith("; kv: 1 stray write check(s) found writes"), lines


def test_nothing_is_logged_at_info_by_default(host_saver, mem, caplog):
    with host_saver.region("kv"):
        mem.malloc(2 * MiB)
    with caplog.at_level(logging.WARNING, logger="torch_mem_saver_lite"):
        host_saver.pause("kv")
        host_saver.resume("kv")
    assert caplog.records == []


def test_at_debug_regions_and_the_pauses_and_resumes_asked_are_logged_with_their_bytes(host_saver, mem, caplog):
    with caplog.at_level(logging.DEBUG, logger="torch_mem_saver_lite"):
        with host_saver.region("kv"):
            mem.malloc(4 * MiB)
        host_saver.pause("kv")
        host_saver.resume()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert lines == ["region 'kv' entered (backup choice -1); 'kv': 0 allocations, 0.00 MiB (0.00 MiB resident)",
                     "region 'kv' left; 'kv': 1 allocations, 4.00 MiB (4.00 MiB resident)",
                     "pause of ['kv'] asked; 'kv': 1 allocations, 4.00 MiB (4.00 MiB resident)",
                     "resume of every tag asked; 'kv': 1 allocations, 4.00 MiB (0.00 MiB resident)"], lines


ALLOCATIONS = prelude() + """
saver, mem = HostSaver(), HostMemory()
with saver.region("kv"):
    ptr = mem.malloc(3 << 20)
saver.pause("kv")
mem.free(ptr)
print(hex(ptr))
"""


@pytest.mark.parametrize("value", ["1", None])
def test_TMSL_LOG_ALLOCATIONS_prints_a_line_per_allocation_and_free(value):
    env = {k: v for k, v in os.environ.items() if k != "TMSL_LOG_ALLOCATIONS"}
    if value is not None:
        env["TMSL_LOG_ALLOCATIONS"] = value
    result = run_python(ALLOCATIONS, env=env)
    assert result.returncode == 0, result.stderr
    address = result.stdout.strip()
    lines = [line for line in result.stderr.splitlines() if line.startswith("torch_mem_saver_lite: ")]
    if value is None:
        assert lines == [], lines  # off by default
        return
    assert lines == [f"torch_mem_saver_lite: allocated 4.00 MiB at {address} on device 0, tag 'kv' "
                     "(backup as its tag decides)",
                     f"torch_mem_saver_lite: freeing 4.00 MiB at {address} on device 0, tag 'kv' (paused)"], lines


def test_a_refused_allocation_is_logged_as_a_warning(caplog):
    from torch_mem_saver_lite.testing import HostSaver

    saver = HostSaver(capacity_bytes=8 * MiB)
    try:
        saver.memory_margin_bytes = 6 * MiB
        with caplog.at_level(logging.WARNING, logger="torch_mem_saver_lite"):
            with pytest.raises(torch.cuda.OutOfMemoryError):
                with saver.region("kv"):
                    if not _lib.lib().tmsl_torch_malloc(4 * MiB, 0, None):
                        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        assert any(r.levelno == logging.WARNING and "'kv' was refused" in r.getMessage() for r in caplog.records)
        assert isinstance(caplog.records[-1].args[1], OutOfMemoryError)
    finally:
        saver.close()


def test_the_library_exports_only_the_c_abi_and_the_preload_symbols():
    # A preloaded library exporting C++ template instances could rebind them process-wide.
    library = _lib.library_path()
    testing = ["--testing"] if _lib.has_testing_abi() else []
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "check_exports.py"), *testing, library],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    exported = set(result.stdout.split(": ", 1)[1].split(", "))
    assert {"cudaMalloc", "cudaFree", "tmsl_pause", "tmsl_resume", "tmsl_torch_malloc"} <= exported
    # torch_memory_saver's C entry points under its names, for code that binds them by name.
    assert all(name.startswith(("tmsl_", "tms_")) for name in exported - {"cudaMalloc", "cudaFree",
                                                                          "set_memory_margin_bytes"})


def test_the_readmes_platform_matrix_agrees_with_the_package_and_the_library():
    rows = dict(re.findall(r"^\| (OS and CPU|Python|torch|NVIDIA driver|GPU|not supported) \| (.*) \|$",
                           (ROOT / "README.md").read_text(), re.M))
    assert len(rows) == 6, rows
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11+)
    python_floor = re.match(r"≥ ([\d.]+)$", rows["Python"]).group(1)
    assert re.search(rf'^requires-python = ">={re.escape(python_floor)}"$', pyproject, re.M)
    torch_floor = re.match(r"≥ ([\d.]+), a CUDA 12 or CUDA 13 build", rows["torch"]).group(1)
    assert re.search(rf'^dependencies = \["torch>={re.escape(torch_floor)}"\]$', pyproject, re.M)
    abi = re.search(r"constexpr int kDriverAbiVersion = (\d+);", (ROOT / "csrc" / "platform" / "driver.h").read_text())
    major, minor = divmod(int(abi.group(1)), 1000)
    assert f"CUDA ≥ {major}.{minor // 10}" in rows["NVIDIA driver"]
    assert f"the CUDA {major}.{minor // 10} ABI" in rows["NVIDIA driver"]
    assert "ROCm" in rows["not supported"] and "XPU" in rows["not supported"]


def test_the_published_metadata_says_where_the_project_lives_and_publishes_nothing_internal():
    metadata = importlib.metadata.metadata("torch-mem-saver-lite")
    urls = dict(entry.split(", ", 1) for entry in metadata.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Repository", "Issues"} <= set(urls), urls
    assert all(url.startswith("https://") for url in urls.values()), urls
    assert len(metadata["Keywords"].split(",")) >= 4
    # Python classifiers from the declared floor up, no gap.
    floor = re.fullmatch(r">=3\.(\d+)", metadata["Requires-Python"]).group(1)
    minors = sorted(int(c.rsplit(".", 1)[1]) for c in metadata.get_all("Classifier")
                    if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert minors == list(range(int(floor), 14)), minors
    # Extras are what a user installs (the tests' tools, the example's); the developers' lint
    # and docs tools are dependency groups, which a published package does not carry.
    assert sorted(metadata.get_all("Provides-Extra")) == ["examples", "test"]


def test_the_long_description_is_the_readme_with_links_that_work_outside_the_repository():
    metadata = importlib.metadata.metadata("torch-mem-saver-lite")
    assert metadata["Description-Content-Type"] == "text/markdown"
    text = metadata.get_payload() or metadata["Description"]
    readme = (ROOT / "README.md").read_text()
    # The metadata is written at install time: a README edited since needs `make install` again.
    stale = "the README changed since the package was installed: run make install"
    assert text.splitlines()[:6] == readme.splitlines()[:6], stale  # the README, its two commands first
    urls = dict(entry.split(", ", 1) for entry in metadata.get_all("Project-URL"))
    site, files = urls["Documentation"], urls["Repository"] + "/blob/main/"
    def link_targets(markdown: str) -> list[str]:
        return re.findall(r"\]\(([^)\s]+)\)", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S))

    targets = link_targets(text)
    assert len(targets) == len(link_targets(readme)), stale
    wrong = []
    for target in targets:
        address, _, anchor = target.partition("#")
        if address.startswith(site):
            page = ROOT / "docs" / (address.removeprefix(site).strip("/") + ".md")
            if not page.is_file() or (anchor and f"](docs/{page.name}#{anchor})" not in readme):
                wrong.append(target)
        elif address.startswith(files):
            if not (ROOT / address.removeprefix(files)).is_file():
                wrong.append(target)
        elif not address.startswith("https://"):
            wrong.append(target)  # relative: broken on the package index
    assert not wrong, wrong

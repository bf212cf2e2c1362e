"""A fresh Python process with only the TMSL_*/TMS_* variables a test gives it: the library
reads them once per process, so each combination needs its own."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

from children import run_python, start_python

DEFAULTS = """
import json
from torch_mem_saver_lite import _lib
from torch_mem_saver_lite.testing import HostSaver
d = _lib.process_defaults()
facts = {name: getattr(d, name) for name, _ in d._fields_ if not name.startswith(("tag", "disk"))}
facts["tag"] = d.tag.decode()
# The saver's options as the process defaults them (a new saver's values), under the names
# and numbers the tests compare: flags 0/1, stray_access as the core's mode number.
for option, fact in (("poison_on_resume", "poison_on_resume"), ("retain_cpu_backup", "retain_backups"),
                     ("verify_wake", "verify_wake"), ("soft_pause", "soft_pause")):
    facts[fact] = int(_lib.process_option(option))
facts["stray_access"] = ("off", "warn", "raise").index(_lib.process_option("stray_access"))
try:
    HostSaver()._core()  # the first use
    facts["first_use"] = "ok"
except Exception as error:
    facts["first_use"] = f"{type(error).__name__}: {error}"
print(json.dumps(facts))
"""


def clean_environment(**env: str) -> dict[str, str]:
    """This process's environment without any TMS_*/TMSL_* variable but the tests' own ledger
    (TMSL_HOST_LEDGER, conftest.py), plus ``env``."""
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("TMS_", "TMSL_")) or k == "TMSL_HOST_LEDGER"}
    environment.update(env)
    return environment


def run_in_child(code: str, **env: str) -> str:
    """What ``code`` prints in a fresh process with these variables (and no other TMS*)."""
    result = run_python(code, env=clean_environment(**env))
    assert result.returncode == 0, result.stderr
    return result.stdout


def defaults_in_child(**env: str) -> dict:
    """The process defaults a fresh process reads (TmslProcessDefaults' numbers and its tag,
    and the saver options' defaults) and what its first use says ("ok", or the exception)."""
    return json.loads(run_in_child(DEFAULTS, **env))


@contextlib.contextmanager
def neighbour(**env: str) -> Iterator[None]:
    """Another process of the node that uses the library and holds nothing (an engine not yet
    paused, say), alive for the block: its saver, made by its first use, puts it in the node's
    ledger (the one ``env`` or the tests' own names), so that a pause there is not alone."""
    code = "import sys; from torch_mem_saver_lite.testing import HostSaver; h = HostSaver(); h.host_memory(); " \
           "print('here', flush=True); sys.stdin.read()"
    process = start_python(code, env=clean_environment(**env))
    try:
        said = process.stdout.readline().strip()
        assert said == "here", said + process.stderr.read()
        yield
    finally:
        process.communicate(input="", timeout=60)

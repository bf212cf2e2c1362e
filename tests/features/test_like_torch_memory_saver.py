"""TMSL_LIKE_TORCH_MEMORY_SAVER=1: the five behaviours torch_memory_saver has no counterpart for
turn to its behaviour in one switch (no host cache kept after a resume, no host-memory budget,
no backups shared through the node's store, no wake check, no stray-access cover), read by the
one reader of the environment, so the core's defaults and Python's agree. It changes defaults
only: each setting's own variable, or a setting made in Python, still wins. Each case runs in a
fresh process (the variables are read once per process), on a ledger (and store) of its own in
memory, so that sharing would happen where it is on."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from environment_child import defaults_in_child, neighbour, run_in_child

from children import prelude

MiB = 1 << 20
SWITCH = "TMSL_LIKE_TORCH_MEMORY_SAVER"

# What both children start with: a host-backend saver and memory to put in its regions.
PRELUDE = prelude() + """
mem, host = HostMemory(), HostSaver()
"""

# A child that meets four of the five: a 96 MiB backed-up tag (large enough to be shared)
# paused (what it holds, what the node's store holds), its backup damaged through a zero-copy
# lease and resumed (refused or woken as it is), what stays held after the resume, and where
# paused memory without a backup lies (mapped over a scratch, or unmapped). CACHE_MIB: a host
# cache set in Python.
FOUR = PRELUDE + """
import json, ctypes
from backends import permissions
from torch_mem_saver_lite import WakeVerificationError, _lib
if os.environ.get("CACHE_MIB"):
    host.host_cache_bytes = int(os.environ["CACHE_MIB"]) * MiB
facts = dict(host_cache_bytes=host.host_cache_bytes, verify_wake=host.verify_wake, stray_access=host.stray_access)
with host.region("weights", enable_cpu_backup=True):
    weights = mem.malloc(96 * MiB)
with host.region("kv"):
    kv = mem.malloc(4 * MiB)
data = os.urandom(96 * MiB)
mem.write(weights, data)
host.pause(["weights", "kv"])
host.wait_for_released_backups()
report = host.host_memory()
facts.update(held_paused=report.held_by_this_process, store_paused=report.shared_bytes,
             backups_shared=report.backups_shared, kv_while_paused=permissions(kv))
def flip():
    address, lease = host._core().lease_backup(weights, 96 * MiB)
    byte = ctypes.c_uint8.from_address(address + 5 * MiB + 17)
    byte.value ^= 0xFF
    _lib.release_lease(lease)
flip()
try:
    host.resume(["weights", "kv"])
    facts["damaged_wake"] = "woken"
    facts["content"] = "damaged" if mem.read(weights, 96 * MiB) != data else "intact"
except WakeVerificationError:
    facts["damaged_wake"] = "refused"
    flip()
    host.resume(["weights", "kv"])
    facts["content"] = "intact" if mem.read(weights, 96 * MiB) == data else "damaged"
host.wait_for_released_backups()
after = host.host_memory()
facts["kept_after_resume"] = after.held_by_this_process + after.shared_bytes
print(json.dumps(facts))
"""

# A child pausing 96 MiB backed up on a ledger whose budget another process set to 64 MiB.
# BUDGET_MIB: a budget set in Python first.
OVER_BUDGET = PRELUDE + """
from torch_mem_saver_lite import OutOfMemoryError
if os.environ.get("BUDGET_MIB"):
    host.host_memory_budget = int(os.environ["BUDGET_MIB"]) * MiB
with host.region("weights", enable_cpu_backup=True):
    weights = mem.malloc(96 * MiB)
mem.write(weights, bytes(range(256)) * (96 * MiB // 256))
try:
    host.pause("weights")
    host.resume("weights")
    print("paused", mem.read(weights, 96 * MiB) == bytes(range(256)) * (96 * MiB // 256))
except OutOfMemoryError as error:
    print("refused", "budget" in str(error))
"""


@pytest.fixture
def ledger() -> Iterator[str]:
    """A ledger (and a store beside it) of the test's own, in memory."""
    directory = tempfile.mkdtemp(prefix="tmsl-test-like-", dir="/dev/shm")
    yield str(Path(directory) / "host-memory.ledger")
    shutil.rmtree(directory, ignore_errors=True)


def four(ledger: str, **env: str) -> dict:
    return json.loads(run_in_child(FOUR, TMSL_HOST_LEDGER=ledger, **env))


def over_budget(ledger: str, **env: str) -> str:
    # The node's budget, set by a process started with the variable (it stays the node's).
    run_in_child("from torch_mem_saver_lite import saver; saver.host_memory()", TMSL_HOST_LEDGER=ledger,
                 TMSL_HOST_MEMORY_BUDGET="64M")
    return run_in_child(OVER_BUDGET, TMSL_HOST_LEDGER=ledger, **env).strip()


def test_by_default_the_four_behaviours_are_ours(ledger):
    # The control: what the switch changes is there without it (sharing, with another process
    # of the node there: one alone copies privately).
    with neighbour(TMSL_HOST_LEDGER=ledger):
        facts = four(ledger)
    assert facts["host_cache_bytes"] > 0 and facts["verify_wake"] is True and facts["stray_access"] == "warn"
    assert facts["held_paused"] == 0 and facts["store_paused"] == 96 * MiB and facts["backups_shared"] is True
    assert facts["kv_while_paused"].startswith("rw")  # the scratch covers paused memory
    assert (facts["damaged_wake"], facts["content"]) == ("refused", "intact")
    assert facts["kept_after_resume"] > 0


def test_the_switch_gives_torch_memory_savers_behaviour_for_all_four(ledger):
    facts = four(ledger, **{SWITCH: "1"})
    assert facts["host_cache_bytes"] == 0 and facts["verify_wake"] is False and facts["stray_access"] == "off"
    # Its own private copy, as torch_memory_saver holds it: nothing in the node's store.
    assert facts["held_paused"] == 96 * MiB and facts["store_paused"] == 0 and facts["backups_shared"] is False
    assert facts["kv_while_paused"] == "---p"  # unmapped while paused: the raw behaviour
    assert (facts["damaged_wake"], facts["content"]) == ("woken", "damaged")  # unchecked, as there
    assert facts["kept_after_resume"] == 0  # the backup freed at resume


def test_each_settings_own_variable_or_python_setting_still_wins(ledger):
    facts = four(ledger, **{SWITCH: "1", "TMSL_SHARE_BACKUPS": "1", "TMSL_VERIFY_WAKE": "1",
                            "TMSL_STRAY_ACCESS": "warn", "CACHE_MIB": "512"})
    assert facts["host_cache_bytes"] == 512 * MiB and facts["verify_wake"] is True and facts["stray_access"] == "warn"
    assert facts["held_paused"] == 0 and facts["store_paused"] == 96 * MiB and facts["backups_shared"] is True
    assert facts["kv_while_paused"].startswith("rw")
    assert (facts["damaged_wake"], facts["content"]) == ("refused", "intact")
    assert facts["kept_after_resume"] > 0


def test_the_switch_takes_no_host_memory_budget_and_an_explicit_one_still_applies(ledger):
    assert over_budget(ledger) == "refused True"  # the control: the node's budget of 64 MiB applies
    assert over_budget(ledger, **{SWITCH: "1"}) == "paused True"  # as torch_memory_saver: no budget
    assert over_budget(ledger, **{SWITCH: "1", "TMSL_HOST_MEMORY_BUDGET": "64M"}) == "refused True"
    assert over_budget(ledger, **{SWITCH: "1", "BUDGET_MIB": "64"}) == "refused True"  # set in Python


def test_the_switch_is_a_flag_read_with_the_other_process_defaults():
    on = defaults_in_child(**{SWITCH: "true"})
    assert on["first_use"] == "ok" and on["like_torch_memory_saver"] == 1
    assert (on["share_backups"], on["verify_wake"], on["stray_access"]) == (0, 0, 0)
    assert defaults_in_child()["like_torch_memory_saver"] == 0
    bad = defaults_in_child(**{SWITCH: "yes"})
    assert f"{SWITCH} must be 0, 1, false or true, got 'yes'" in bad["first_use"]
    assert (bad["like_torch_memory_saver"], bad["verify_wake"]) == (0, 1)  # nothing taken from it

"""Every TMSL_*/TMS_* variable is read in one place (csrc/platform/environment.cpp) with one grammar
per kind: flags take 0, 1, false or true in any case, whole numbers ASCII digits within their
range, sizes a whole number with an optional K, M, G or T; anything else, and two names of one
setting that disagree, is a MemorySaverError at first use naming the variable, the value and
what it takes. The process defaults are read once per process, so each case runs in a child."""

from __future__ import annotations

import pytest
from environment_child import defaults_in_child

from torch_mem_saver_lite import InvalidArgumentError, MemorySaverError, _lib, alias

MiB = 1 << 20
FLAG_TAKES = "must be 0, 1, false or true, got"

# The flags read once per process: the fact defaults_in_child reports -> our name, torch_memory_saver's.
FLAGS = {
    "region_all_threads": ("TMSL_REGION_ALL_THREADS", "TMS_INIT_ENABLE"),
    "poison_on_resume": ("TMSL_POISON_ON_RESUME", None),
    "retain_backups": ("TMSL_RETAIN_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP"),
    "share_backups": ("TMSL_SHARE_BACKUPS", None),
    "verify_wake": ("TMSL_VERIFY_WAKE", None),
}
ON_BY_DEFAULT = {"verify_wake", "share_backups"}
# The default region's backup flags show in backup_choice (they exclude each other when both on).
BACKUP_FLAGS = (("TMSL_DEFAULT_CPU_BACKUP", "TMS_INIT_ENABLE_CPU_BACKUP"),
                ("TMSL_DEFAULT_DISK_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP"))

@pytest.mark.parametrize(("spelling", "meaning"), [("1", True), ("TRUE", True), (" True ", True), ("0", False),
                                                   ("false", False)])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_every_flag_takes_0_1_false_or_true_in_any_case(spelling, meaning, monkeypatch):
    env = {name: spelling for names in FLAGS.values() for name in names if name}
    env[BACKUP_FLAGS[1][0]] = env[BACKUP_FLAGS[1][1]] = spelling  # disk backup of the default region
    env[BACKUP_FLAGS[0][1]] = "false"  # its CPU backup off (the two exclude each other)
    found = defaults_in_child(**env)

    assert found["first_use"] == "ok"
    assert {field: bool(found[field]) for field in FLAGS} == dict.fromkeys(FLAGS, meaning)
    assert found["backup_choice"] == (_lib.CHOICE_DISK if meaning else _lib.CHOICE_OFF)
    # The alias's variable, read in Python before the library loads, keeps the same grammar.
    monkeypatch.setenv(alias.VARIABLE, spelling)
    assert alias.variable() is meaning


@pytest.mark.parametrize("value", ["yes", "2", "tru"])
@pytest.mark.slow  # 30 s or more on 2 cores (fresh processes, sweeps): make test-slow's
def test_any_other_flag_value_is_refused_by_name_at_first_use(value, monkeypatch):
    names = [name for pair in (*FLAGS.values(), *BACKUP_FLAGS) for name in pair if name]
    found = defaults_in_child(**dict.fromkeys(names, value))

    assert found["first_use"].startswith("MemorySaverError: ")
    for name in names:
        assert f"{name} {FLAG_TAKES} '{value}'" in found["first_use"], name
    # Nothing taken from a refused value: each flag keeps its default.
    assert {field: bool(found[field]) for field in FLAGS} == {field: field in ON_BY_DEFAULT for field in FLAGS}
    monkeypatch.setenv(alias.VARIABLE, value)
    with pytest.raises(MemorySaverError, match=alias.VARIABLE):
        alias.variable()


def test_both_names_of_a_setting_agree_when_they_mean_the_same():
    # That two different values are refused, for every pair: test_docs.py, from the guide's table.
    same = defaults_in_child(TMSL_REGION_ALL_THREADS="1", TMS_INIT_ENABLE="True",
                             TMSL_DEFAULT_CPU_BACKUP_BACKEND="mmap", TMS_INIT_CPU_BACKUP_BACKEND="MMAP")
    assert same["first_use"] == "ok" and same["region_all_threads"] == 1 and same["caches_backups"] == 0


@pytest.mark.parametrize(("env", "expected"), [
    ({}, (64 * MiB, 4)),  # the defaults
    ({"TMSL_DISK_BACKUP_CHUNK_MB": "8"}, (8 * MiB, 4)),
    ({"TMS_DISK_BACKUP_CHUNK_MB": " 4096 ", "TMSL_DISK_BACKUP_WORKERS": "64"}, (4096 * MiB, 64)),
    ({"TMSL_DISK_BACKUP_CHUNK_MB": "8", "TMS_DISK_BACKUP_CHUNK_MB": "08", "TMSL_DISK_BACKUP_WORKERS": "1"},
     (8 * MiB, 1)),
])
def test_the_disk_backup_numbers_are_read_at_each_call(env, expected, monkeypatch):
    for name in ("TMSL_DISK_BACKUP_CHUNK_MB", "TMS_DISK_BACKUP_CHUNK_MB", "TMSL_DISK_BACKUP_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _lib.disk_backup_settings() == expected


@pytest.mark.parametrize(("env", "message"), [
    ({"TMSL_DISK_BACKUP_CHUNK_MB": "8", "TMS_DISK_BACKUP_CHUNK_MB": "256"},
     "TMSL_DISK_BACKUP_CHUNK_MB='8' and TMS_DISK_BACKUP_CHUNK_MB='256' disagree; set one of them"),
    ({"TMSL_DISK_BACKUP_CHUNK_MB": "4097"}, "TMSL_DISK_BACKUP_CHUNK_MB must be a whole number of MiB from 1 to 4096, "
                                            "got '4097'"),
    ({"TMS_DISK_BACKUP_CHUNK_MB": "8M"}, "TMS_DISK_BACKUP_CHUNK_MB must be a whole number of MiB from 1 to 4096"),
    ({"TMSL_DISK_BACKUP_WORKERS": "65"}, "TMSL_DISK_BACKUP_WORKERS must be a whole number from 1 to 64, got '65'"),
    ({"TMSL_DISK_BACKUP_WORKERS": "-1"}, "TMSL_DISK_BACKUP_WORKERS must be a whole number from 1 to 64, got '-1'"),
    ({"TMSL_DISK_BACKUP_WORKERS": "0x10"}, "TMSL_DISK_BACKUP_WORKERS must be a whole number from 1 to 64"),
    ({"TMSL_DISK_BACKUP_WORKERS": "99999999999999999999999"}, "TMSL_DISK_BACKUP_WORKERS must be a whole number"),
])
def test_bad_or_disagreeing_disk_backup_numbers_are_refused_by_name(env, message, monkeypatch):
    for name in ("TMSL_DISK_BACKUP_CHUNK_MB", "TMS_DISK_BACKUP_CHUNK_MB", "TMSL_DISK_BACKUP_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgumentError) as refused:
        _lib.disk_backup_settings()
    assert message in str(refused.value)

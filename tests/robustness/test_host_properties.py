"""Random sequences of region/alloc/free/pause/resume on the host backend, checked after
every step against a simple model of what each allocation should hold."""

from __future__ import annotations

import ctypes

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from host_memory import HostMemory
from torch_mem_saver_lite import MemorySaverError
from torch_mem_saver_lite.testing import HostSaver

MiB = 1 << 20
GRANULE = 64 << 10
TAGS = {"weights": True, "kv": False, "graph": True}  # tag -> enable_cpu_backup


def rounded(size: int) -> int:
    return -(-size // GRANULE) * GRANULE


class SaverModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.saver = HostSaver(granularity_bytes=GRANULE)
        self.saver.host_cache_bytes = 0  # backups leave with the resume (the cache is tested apart)
        self.mem = HostMemory()
        self.live: dict[int, dict] = {}  # ptr -> {tag, size, byte, paused}
        self.known: set[str] = set()  # tags a region has used
        self.paused_tags: set[str] = set()  # paused and not resumed since, allocations or not
        self.counter = 0

    def teardown(self):
        self.saver.close()

    def tag_paused(self, tag: str) -> bool:
        return tag in self.paused_tags

    @rule(tag=st.sampled_from(sorted(TAGS)), size=st.integers(1, 3 * GRANULE + 5))
    def allocate(self, tag, size):
        if self.tag_paused(tag):
            try:
                with self.saver.region(tag, enable_cpu_backup=TAGS[tag]):
                    raise AssertionError("entered the region of a paused tag")
            except MemorySaverError:
                return
        with self.saver.region(tag, enable_cpu_backup=TAGS[tag]):
            ptr = self.mem.malloc(size)
        self.known.add(tag)
        self.counter += 1
        value = self.counter % 251 + 1
        ctypes.memset(ptr, value, size)
        self.live[ptr] = {"tag": tag, "size": size, "byte": value, "paused": False}

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.mem.free(ptr)
        del self.live[ptr]

    @rule(tags=st.one_of(st.none(), st.lists(st.sampled_from(sorted(TAGS)), max_size=3)))
    def pause(self, tags):
        if tags is not None and not set(tags) <= self.known:
            return  # an unknown tag is a ValueError, tested elsewhere
        self.saver.pause(tags)
        self.paused_tags |= self.known if tags is None else set(tags)
        for a in self.live.values():
            if tags is None or a["tag"] in tags:
                a["paused"] = True

    @rule(tags=st.one_of(st.none(), st.lists(st.sampled_from(sorted(TAGS)), max_size=3)))
    def resume(self, tags):
        if tags is not None and not set(tags) <= self.known:
            return
        self.saver.resume(tags)
        self.paused_tags -= self.known if tags is None else set(tags)
        for a in self.live.values():
            if a["paused"] and (tags is None or a["tag"] in tags):
                a["paused"] = False
                if not TAGS[a["tag"]]:
                    a["byte"] = 0  # fresh memory without a backup

    @invariant()
    def stats_match_the_model(self):
        stats = self.saver.stats()
        for tag, backup in TAGS.items():
            mine = [a for a in self.live.values() if a["tag"] == tag]
            s = stats.get(tag)
            if s is None:
                assert not mine
                continue
            paused = sum(rounded(a["size"]) for a in mine if a["paused"])
            assert s.allocations == len(mine)
            assert s.reserved_bytes == sum(rounded(a["size"]) for a in mine)
            assert s.paused_bytes == paused
            backed_up = sum(-(-a["size"] // 4096) * 4096 for a in mine if a["paused"])  # exact, to pages
            assert s.host_backup_bytes == (backed_up if backup else 0)
            assert s.paused == (tag in self.paused_tags)
            assert s.backs_up == backup

    @invariant()
    def resident_content_matches_the_model(self):
        for ptr, a in self.live.items():
            if not a["paused"]:
                assert ctypes.string_at(ptr, a["size"]) == bytes([a["byte"]]) * a["size"], a


TestSaverModel = SaverModel.TestCase
TestSaverModel.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

"""Memory figures: each tag's state per device (``saver.status()``, the one record), its sum
per tag (``saver.stats()``, a view of it) and the node's host memory (``saver.host_memory()``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TagStats:
    """What one tag holds right now: its ``TagStatus`` entries summed over its devices
    (``saver.stats()`` is a view of ``saver.status()``), in torch_memory_saver's terms.

    Attributes:
        allocations: live allocations made in the tag's regions.
        reserved_bytes: virtual address space they reserve (device memory when resident):
            the sum of ``TagStatus``'s five byte counts.
        resident_bytes: bytes backed by device memory now (``on_device_bytes``).
        paused_bytes: bytes whose device memory is released (reserved - resident).
        host_backup_bytes: host memory holding paused content, and host memory kept for
            the next pause of resident memory (the host cache: backups kept after a resume,
            and memory set aside when a backed-up region closed) (``host_memory_bytes``).
        disk_backup_bytes: paused bytes whose content is in disk backup files (regions with
            ``enable_disk_backup=True``, and what the host-memory budget sent to disk)
            (``on_disk_bytes``). Where the other paused bytes are: ``saver.status()``.
        paused: the tag is paused (and not resumed since).
        graph_memory: a CUDA graph was captured while a region of the tag was open.
        backs_up: a pause copies the tag's content to host memory (``enable_cpu_backup=True``,
            or graph memory in a region that did not opt out).
        last_pause_seconds: wall time of the last successful ``pause`` call that released
            memory of the tag (the whole call, every tag it released); None before the first.
        last_resume_seconds: the same for ``resume`` and restored memory.
        last_wake_check: what the last resume that restored the tag's backed-up content found
            when it compared the restored bytes with the fingerprints its pause took
            (``verify_wake``): "passed", "failed" (the resume raised ``WakeVerificationError``
            and the tag stayed paused), "unchecked" (some of its bytes were not checked: the
            check was off, or the device cannot fingerprint), or None (none yet).
        stray_writes: how many times a pause or resume found that something wrote into the
            tag's paused memory without a backup (``stray_access``); each such check counts
            every tag whose memory was paused without a backup on that device then.
    """

    allocations: int = 0
    reserved_bytes: int = 0
    resident_bytes: int = 0
    paused_bytes: int = 0
    host_backup_bytes: int = 0
    disk_backup_bytes: int = 0
    paused: bool = False
    graph_memory: bool = False
    backs_up: bool = False
    # Timings describe the past, not what the tag holds: equality ignores them.
    last_pause_seconds: float | None = field(default=None, compare=False)
    last_resume_seconds: float | None = field(default=None, compare=False)
    last_wake_check: str | None = field(default=None, compare=False)
    stray_writes: int = field(default=0, compare=False)

    @classmethod
    def of(cls, entries: Sequence[TagStatus]) -> TagStats:
        """The sum of one tag's ``TagStatus`` entries (one per device; the tag's own facts are
        the same in each)."""
        first = entries[0]
        reserved = sum(e.on_device_bytes + e.in_host_bytes + e.in_store_bytes + e.on_disk_bytes + e.discarded_bytes
                       for e in entries)
        resident = sum(e.on_device_bytes for e in entries)
        return cls(allocations=sum(e.allocations for e in entries), reserved_bytes=reserved,
                   resident_bytes=resident, paused_bytes=reserved - resident,
                   host_backup_bytes=sum(e.host_memory_bytes for e in entries),
                   disk_backup_bytes=sum(e.on_disk_bytes for e in entries), paused=first.state == "paused",
                   graph_memory=first.graph_memory, backs_up=any(e.backs_up for e in entries),
                   last_pause_seconds=first.last_pause_seconds, last_resume_seconds=first.last_resume_seconds,
                   last_wake_check=first.last_wake_check, stray_writes=sum(e.stray_writes for e in entries))


# A tag's last wake check, as the native figures number it (WakeCheck, csrc/core/saver.h).
WAKE_CHECKS = (None, "passed", "failed", "unchecked")


def wake_check(number: int) -> str | None:
    """The name of a native wake check number (None for none, or one this version does not know)."""
    return WAKE_CHECKS[number] if 0 <= number < len(WAKE_CHECKS) else None


@dataclass(frozen=True)
class TagStatus:
    """One tag on one device (``saver.status()``): its state, where each of its bytes is, and
    what its last wake found. The record to log (``dataclasses.asdict(status)``): ``TagStats``
    is its sum per tag.

    Attributes:
        tag: the tag.
        device: the CUDA device (-1: the tag has no allocation).
        state: "awake" (never paused, or resumed since) or "paused". What each state allows is
            in the guide ("The state of a tag").
        on_device_bytes: bytes backed by device memory (the tag's resident allocations).
        in_host_bytes: paused bytes whose content is in this process's host memory.
        in_store_bytes: paused bytes whose content is in the node's store, held once per node
            however many processes pause the same bytes (on by default; ``TMSL_SHARE_BACKUPS=0``
            turns it off).
        on_disk_bytes: paused bytes whose content is in disk backup files.
        discarded_bytes: paused bytes without any backup: their content is gone (undefined
            after the resume, or 0xFF with ``poison_on_resume``).
        last_wake_check: what the tag's last wake found when it checked the restored bytes
            against its pause's fingerprints: "passed", "failed", "unchecked", or None (as in
            ``TagStats``).
        stray_writes: checks that found writes into the tag's paused memory without a backup
            on this device (as in ``TagStats``).
        allocations: the tag's live allocations on the device.
        host_memory_bytes: host memory this process holds for the tag's allocations on the
            device: their paused content's host copies, and the host cache kept for the next
            pause of resident ones (not the node's store).
        graph_memory: a CUDA graph was captured while a region of the tag was open.
        backs_up: a pause copies the tag's content to host memory.
        last_pause_seconds: wall time of the last ``pause`` call that released memory of the
            tag (None before the first); ``last_resume_seconds`` the same for ``resume``.

    The five byte counts partition the tag's reserved bytes on the device.
    """

    tag: str
    device: int
    state: str
    on_device_bytes: int = 0
    in_host_bytes: int = 0
    in_store_bytes: int = 0
    on_disk_bytes: int = 0
    discarded_bytes: int = 0
    last_wake_check: str | None = None
    stray_writes: int = 0
    allocations: int = 0
    host_memory_bytes: int = 0
    graph_memory: bool = False
    backs_up: bool = False
    # Timings describe the past, not the state: equality ignores them.
    last_pause_seconds: float | None = field(default=None, compare=False)
    last_resume_seconds: float | None = field(default=None, compare=False)

    @classmethod
    def from_figures(cls, figures: Any) -> TagStatus:
        """From one TmslTagFigures entry."""
        return cls(tag=figures.tag.decode(errors="replace"), device=figures.device,
                   state="paused" if figures.paused else "awake", on_device_bytes=figures.resident_bytes,
                   in_host_bytes=figures.paused_in_host, in_store_bytes=figures.paused_in_store,
                   on_disk_bytes=figures.paused_on_disk, discarded_bytes=figures.paused_discarded,
                   last_wake_check=wake_check(figures.last_wake_check), stray_writes=figures.stray_writes,
                   allocations=figures.allocations, host_memory_bytes=figures.host_backup_bytes,
                   graph_memory=bool(figures.graph_memory), backs_up=bool(figures.backs_up),
                   last_pause_seconds=_seconds(figures.last_pause_seconds),
                   last_resume_seconds=_seconds(figures.last_resume_seconds))


def _seconds(value: float) -> float | None:
    """A native duration (negative: none yet)."""
    return value if value >= 0 else None


@dataclass(frozen=True)
class HostMemoryHolder:
    """One process holding part of the node's host-memory budget.

    Attributes:
        entry: its entry in the node's ledger, unique among the live holders (pids are not:
            processes of different pid namespaces sharing the ledger may have the same one).
        pid: its process id, as the process itself saw it (in its own pid namespace).
        bytes: host memory its backups and host cache hold.
        cached_bytes: of which its host cache, which it could give back.
        this_process: it is the process asking.
        shared_bytes: backups of the node's store it maps (held once by the node, counted in
            the report's ``shared_bytes``, not in its ``bytes``): the processes sharing the
            store's bytes are those with some.
    """

    entry: int
    pid: int
    bytes: int
    cached_bytes: int
    this_process: bool
    shared_bytes: int = 0


@dataclass(frozen=True)
class HostMemoryReport:
    """The node's host-memory budget for backups and host caches, and who holds it.

    Every process of the node (or container) that uses the library takes the host memory of
    its backups and host cache from one budget, kept in a small shared ledger; a pause that
    needs more than the budget leaves gives back this process's host cache first (least
    recently used first); what the budget cannot hold even with every process's host cache
    given back goes to disk backup where a directory is set (``set_disk_backup_dir`` or
    ``TMSL_DISK_BACKUP_DIR``), and otherwise the pause is refused before anything is released.

    Attributes:
        budget_bytes: the node's budget (``TMSL_HOST_MEMORY_BUDGET``, or half of the host
            memory the first process could use: the least of the machine's memory, what was
            available and its container's limit).
        held_by_this_process: host memory this process's backups and host cache hold.
        held_by_others: what the node's other processes hold.
        holders: each process holding some (this process included), a ``HostMemoryHolder``:
            its entry in the ledger, its pid, what it holds and how much of it is host cache.
        on_disk_bytes: content of this process's tags written to disk backups (outside the
            budget).
        ledger: the ledger's path.
        error: why no budget applies ("" while one does).
        spilled_bytes: paused memory of this process whose backup went to disk for want of
            budget (the budget's disk tier), whose files ``on_disk_bytes`` counts too.
        disk_tier: the directory what the budget cannot hold goes to (``set_disk_backup_dir``
            or ``TMSL_DISK_BACKUP_DIR``); "" where there is none, or the environment's cannot
            serve, and such pauses are refused.
        disk_tier_problem: why the environment's directory (``TMSL_DISK_BACKUP_DIR``) cannot
            serve, naming the variable and the directory ("" where it can, or none is named).
        shared_bytes: the distinct bytes of the node's store of backups held once
            (identical content stored once per node unless ``TMSL_SHARE_BACKUPS=0``, whichever
            processes map it), counted in the budget once and in no holder's ``bytes``; each
            holder's ``shared_bytes`` says how much of it that process maps.
        backups_shared: this process's large backups go into the node's store (held once
            however many processes pause the same bytes), as the native core decided.
        sharing_off_reason: why not ("" while they do): this process alone on the node (no
            other live process uses the library: nobody to share with, so private copies until
            one does; ``TMSL_SHARE_BACKUPS=1`` stores them anyway), sharing turned off
            (``TMSL_SHARE_BACKUPS=0``, ``TMSL_LIKE_TORCH_MEMORY_SAVER=1``), a store that is not
            in memory (it lies beside the ledger, ``<ledger>.store``: a ``TMSL_HOST_LEDGER`` on
            a disk puts it there) or not trusted, or what the latest backup offered to it met
            (no room in its file system, no file descriptors left): two processes pausing the
            same bytes then hold two copies.
        alone: sharing is on, but this process is alone on the node (``sharing_off_reason``
            says so): its backups go into the store from its first pause with another process
            of the node there.
        store: the node's store's directory (``<ledger>.store``, beside the ledger).
    """

    budget_bytes: int
    held_by_this_process: int
    held_by_others: int
    holders: list[HostMemoryHolder]
    on_disk_bytes: int
    ledger: str
    error: str = ""
    spilled_bytes: int = 0
    disk_tier: str = ""
    disk_tier_problem: str = ""
    shared_bytes: int = 0
    backups_shared: bool = False
    sharing_off_reason: str = ""
    alone: bool = False
    store: str = ""


def host_memory_report(figures: Any, max_holders: int, **ours: Any) -> HostMemoryReport:
    """The report from the library's figures (``_lib.HostMemoryFigures``) and this process's
    own (``on_disk_bytes``, ``spilled_bytes``, ``disk_tier``, ``disk_tier_problem``)."""
    holders = [HostMemoryHolder(entry=int(figures.holder_entry[i]), pid=int(figures.holder_pid[i]),
                                bytes=int(figures.holder_bytes[i]), cached_bytes=int(figures.holder_cached_bytes[i]),
                                this_process=bool(figures.holder_this_process[i]),
                                shared_bytes=int(figures.holder_shared_bytes[i]))
               for i in range(min(figures.holder_count, max_holders))]
    return HostMemoryReport(budget_bytes=int(figures.budget_bytes) if figures.active else 0,
                            held_by_this_process=int(figures.held_by_this_process),
                            held_by_others=int(figures.held_by_others), holders=holders,
                            shared_bytes=int(figures.shared_bytes), ledger=figures.path.decode(errors="replace"),
                            error=figures.error.decode(errors="replace"),
                            backups_shared=bool(figures.backups_shared),
                            sharing_off_reason=figures.sharing_off.decode(errors="replace"),
                            alone=bool(figures.alone),
                            store=figures.store.decode(errors="replace"), **ours)

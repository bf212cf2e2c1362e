"""The saver's switches for what a touch of paused memory meets and what a wake checks:
``poison_on_resume``, ``verify_wake``, ``stray_access`` and ``soft_pause``. Each is kept in the settings until
the core exists and forwarded to it afterwards (settings.py)."""

from __future__ import annotations

from collections.abc import Callable

from . import _lib, stray_access
from .choices import StrayAccessMode
from .settings import Settings, check_bool


class SafetySwitches:
    """MemorySaver's switches (a part of MemorySaver: it gives ``_settings`` and ``_core``)."""

    _settings: Settings
    _core: Callable[..., _lib.NativeSaver | None]

    @property
    def poison_on_resume(self) -> bool:
        """Debugging aid: fill resumed memory that has no backup with 0xFF bytes (NaN in every
        float format, -1 as integers), so code that wrongly relies on discarded content fails
        visibly instead of reading leftovers. Default: off, or ``TMSL_POISON_ON_RESUME=1``."""
        native = self._core(create=False)
        if native is not None:
            return native.poison_on_resume()
        return self._settings.poison()

    @poison_on_resume.setter
    def poison_on_resume(self, poison: bool) -> None:
        self._settings.poison_on_resume = check_bool(poison, "poison_on_resume")
        self._settings.forward(self._core(create=False), _lib.NativeSaver.set_poison_on_resume, poison)

    @property
    def verify_wake(self) -> bool:
        """A pause fingerprints every backed-up allocation on its GPU; a resume checks the
        restored bytes and, where they differ, raises ``WakeVerificationError`` naming the tag
        and allocation, everything it covered still paused with its backups. Default: on, or
        ``TMSL_VERIFY_WAKE=0``; per tag: ``region(..., verify_wake=False)``."""
        native = self._core(create=False)
        if native is not None:
            return native.verify_wake()
        return self._settings.verify()

    @verify_wake.setter
    def verify_wake(self, verify: bool) -> None:
        self._settings.verify_wake = check_bool(verify, "verify_wake")
        self._settings.forward(self._core(create=False), _lib.NativeSaver.set_verify_wake, verify)

    @property
    def stray_access(self) -> StrayAccessMode:
        """What a kernel that touches paused memory without a backup (a KV cache, say) meets.
        ``"warn"`` (default) and ``"raise"``: while paused, that memory's addresses map a small
        scratch of device memory (pieces of 128 MiB down to 2 MiB, each made once an allocation
        needs it: at most 254 MiB per device), so the kernel reads 0xFF bytes and its writes
        are dropped, instead of an illegal address that ends the CUDA context. A resume that finds writes there warns
        (``StrayAccessWarning``) or raises ``StrayAccessError`` once the tags are awake, naming
        them; ``TagStats.stray_writes`` counts them. Reads are harmless but not seen. ``"off"``:
        the raw behaviour, the memory unmapped while paused. Default: ``TMSL_STRAY_ACCESS``;
        per tag: ``region(..., stray_access=...)``. Applies from the next pause on: a resume
        tells the writes as the mode its pause began with said."""
        native = self._core(create=False)
        return stray_access.MODES[native.stray_access() if native is not None else self._settings.stray()]

    @stray_access.setter
    def stray_access(self, mode: StrayAccessMode) -> None:
        self._settings.stray_access = stray_access.check_mode(mode)
        self._settings.forward(self._core(create=False), _lib.NativeSaver.set_stray_access, self._settings.stray_access)

    @property
    def soft_pause(self) -> bool:
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
        ``region(..., soft_pause=True)``. Applies from the next pause on."""
        native = self._core(create=False)
        return native.soft_pause() if native is not None else self._settings.soft()

    @soft_pause.setter
    def soft_pause(self, soft: bool) -> None:
        self._settings.soft_pause = check_bool(soft, "soft_pause")
        self._settings.forward(self._core(create=False), _lib.NativeSaver.set_soft_pause, soft)

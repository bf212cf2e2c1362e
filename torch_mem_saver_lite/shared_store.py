"""What the node's store of shared backups refused (csrc/node/node_store.h): a key or directory
other users may read or write, a chunk not this user's alone, one made in another PID namespace,
or one cut short. Each means private copies, as with sharing off; the core tells each once per
process, and this warns of it after the pause, resume or wait that met it (possibly in the
background before it)."""

from __future__ import annotations

import warnings

from . import _lib


def tell(native: _lib.NativeSaver | None = None) -> None:
    """A RuntimeWarning for each refusal the store has not told yet. After a pause or resume of
    ``native``: only where it said there are some (no call into the library otherwise)."""
    if native is not None and not native.take_store_notices_to_tell():
        return
    for notice in _lib.store_notices():
        warnings.warn(f"torch_mem_saver_lite: {notice}", RuntimeWarning, stacklevel=3)

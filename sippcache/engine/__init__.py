"""The cache logic shared by every built-in backend, over a transactional key-value store.

A backend supplies transactions on a byte-keyed map (`KVTxn`); `KVBackend`
does the rest once. The parts, one concept each:

- `layout`: which key holds what (the on-disk format);
- `records`: packing and validating those records;
- `replica`: this process's index of the store (a `sippcache.mirror.Mirror`): how a change
  is written to the byte map and read back from it, and rebuilding from the records;
- `backend`: `KVBackend`, the operations, budgets and the write path;
- `storage`: the `KVTxn` protocol a storage library implements;
- `snapshots`: zero-copy matches, valid while their read snapshot is open;
- `directory`: where persistent stores live;
- `forking`: keeping open stores usable across `os.fork`.
"""

from __future__ import annotations

from .backend import KVBackend
from .directory import directory_path, prepare_directory
from .forking import fork_safe_lock, hold_across_forks
from .layout import LOG_KEEP, entry_id
from .snapshots import SnapshotMatch
from .storage import KVTxn, owned_bytes

__all__ = [
    "LOG_KEEP",
    "KVBackend",
    "KVTxn",
    "SnapshotMatch",
    "directory_path",
    "entry_id",
    "fork_safe_lock",
    "hold_across_forks",
    "owned_bytes",
    "prepare_directory",
]

"""What a backend plugin may build on: one module, with a promise (docs/plugins.md).

A backend is written against `sippcache` itself (`CacheBackend`, `Match`, the errors, ...),
the conformance suite in `sippcache.testing`, and the names here: the base classes, the
catalog and mirror that give a store sippcache's own index, budget and eviction, the changes
a store persists, and the helpers the built-in backends use (ids, the key's byte form,
options, directories, fork safety, zero-copy matches). fsspec draws the same line with
`AbstractFileSystem` and its test suite: a filesystem implements the one, passes the other,
and builds on nothing else.

The promise. The names in `__all__` keep their meaning and signatures from release to release:
a change a backend could notice (a name removed or renamed, an argument made required, a
return type changed, a changes record persisted differently) is made by adding the new next to
the old, which keeps working and warns (`DeprecationWarning`) for at least one release, and
CHANGELOG.md says so. A backend that passes `sippcache.testing`'s suite keeps passing it
after an upgrade unless the CHANGELOG names a new requirement. The modules these names come
from (`sippcache.catalog`, `sippcache.mirror`, `sippcache.engine`, ...) are sippcache's own:
anything else in them may change in any release, so a backend that imports them pins
sippcache's exact version.
"""

from __future__ import annotations

from .base import BaseBackend
from .blob import Blob
from .catalog import (
    UNSET,
    Budget,
    Catalog,
    Change,
    Clear,
    EntryState,
    Mark,
    Op,
    Put,
    Remove,
    StorePlan,
    Unset,
    Use,
    Uses,
)
from .engine import (
    KVBackend,
    KVTxn,
    SnapshotMatch,
    directory_path,
    entry_id,
    fork_safe_lock,
    hold_across_forks,
    owned_bytes,
    prepare_directory,
)
from .engine.snapshots import shared_end
from .errors import (
    BadOption,
    CacheClosed,
    CacheFull,
    CorruptStore,
    MissingDependency,
    ReadOnlyStore,
    SippcacheError,
    StoreError,
)
from .eviction import DEFAULT_POLICY, LRU, EvictionPolicy, GreedyDual, Rank
from .mirror import Limit, Mirror, OutOfStep, check_limits
from .options import Size, coerce_options
from .protocol import CacheBackend, EntryInfo, Match, Peek, Stats, StoreOptions
from .registry import parse_url
from .tokens import decode as decode_tokens
from .tokens import encode as encode_tokens

__all__ = [
    "DEFAULT_POLICY",
    "LRU",
    "UNSET",
    "BadOption",
    "BaseBackend",
    "Blob",
    "Budget",
    "CacheBackend",
    "CacheClosed",
    "CacheFull",
    "Catalog",
    "Change",
    "Clear",
    "CorruptStore",
    "EntryInfo",
    "EntryState",
    "EvictionPolicy",
    "GreedyDual",
    "KVBackend",
    "KVTxn",
    "Limit",
    "Mark",
    "Match",
    "Mirror",
    "MissingDependency",
    "Op",
    "OutOfStep",
    "Peek",
    "Put",
    "Rank",
    "ReadOnlyStore",
    "Remove",
    "SippcacheError",
    "Size",
    "SnapshotMatch",
    "Stats",
    "StoreError",
    "StoreOptions",
    "StorePlan",
    "Unset",
    "Use",
    "Uses",
    "check_limits",
    "coerce_options",
    "decode_tokens",
    "directory_path",
    "encode_tokens",
    "entry_id",
    "fork_safe_lock",
    "hold_across_forks",
    "owned_bytes",
    "parse_url",
    "prepare_directory",
    "shared_end",
]

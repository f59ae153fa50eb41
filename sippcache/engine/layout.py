"""Which key of the engine's byte map holds what, and what its change-log records look like.

Entry ids are xxh3_128 of namespace + key, so LMDB's 511-byte key limit never
matters. Each entry has up to four records, keyed by a one-byte prefix and its
id; a few single keys describe the whole store::

    B<id>   the blob
    M<id>   msgpack [namespace, key bytes, size, created_ns, priority, generation]
            (stores written before pins and priorities have the first four only)
    U<id>   u64 last-use time (ns), updated in batches
    V<id>   msgpack [retention value, pinned, superseded] (absent: the defaults)
    L<seq>  the change log: msgpack [op, ...], op a `sippcache.catalog.Op` code:
            ["p", id] an entry was stored (read its records), ["d", id] removed,
            ["t", [[id, used_ns, value?], ...]] used, ["v", id] its V record
            changed, ["c"] every entry removed, ["b"] the K record changed
    S       u64 sequence number of the newest log record
    T       u64 log records at or below this number were trimmed
    G       f64 the eviction clock (see `sippcache.eviction`)
    K       msgpack [max_bytes, max_entries] (None: no limit): the budget saved with
            the store (absent: none is; stores written before budgets were saved)
    I       the catalog's snapshot (`sippcache.catalog.Catalog.snapshot`): loading
            it and replaying the log after it replaces reading every entry at open
    J       u64 the log record the snapshot reflects

These bytes are the on-disk format of every existing store: never change one.
"""

from __future__ import annotations

import struct

import xxhash

#: Per-entry record prefixes (followed by the 16-byte entry id).
PREFIX_BLOB = b"B"
PREFIX_META = b"M"
PREFIX_USED = b"U"
PREFIX_VALUES = b"V"
#: The records each entry has besides its log entries.
ENTRY_PREFIXES = (PREFIX_BLOB, PREFIX_META, PREFIX_USED, PREFIX_VALUES)

#: Change-log record prefix (followed by the big-endian u64 sequence number).
PREFIX_LOG = b"L"
#: Single keys describing the store.
KEY_NEWEST = b"S"
KEY_TRIMMED = b"T"
KEY_CLOCK = b"G"
KEY_BUDGET = b"K"
KEY_INDEX_SNAPSHOT = b"I"
KEY_INDEX_SNAPSHOT_SEQ = b"J"

#: Log records kept for processes that fall behind; further behind means a rebuild.
LOG_KEEP = 10_000

_U64 = struct.Struct("<Q")
_SEQ = struct.Struct(">Q")  # big-endian so log keys sort by number


def entry_id(namespace: str, key: bytes) -> bytes:
    """The 16-byte id of `key` (token bytes) in `namespace`: xxh3-128 of the namespace's length and
    bytes and the key, fed in parts (a chunk's key is its whole prefix, up to 128 KB at 32K tokens:
    joined first, each id cost a copy of it, 4x the hash)."""
    ns = namespace.encode("utf-8")
    digest = xxhash.xxh3_128(_U64.pack(len(ns)))
    digest.update(ns)
    digest.update(key)
    return digest.digest()


def log_key(seq: int) -> bytes:
    """The key of change-log record number `seq`."""
    return PREFIX_LOG + _SEQ.pack(seq)

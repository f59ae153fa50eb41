"""The backend's records on the server, and reading them back as sippcache changes.

The data layout is in docs/redis.md (and `sippcache_redis.scripts`). Each
function here turns one kind of value into bytes for the server or back;
readers treat what they get as untrusted: a value that does not parse, has the
wrong types or does not belong to its key reads as absent, and a log record
that makes no sense raises `BadRecord` (the mirror is then rebuilt).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack  # type: ignore[import-untyped]  # msgpack ships no type information

from sippcache.plugin import Budget, Change, Clear, EntryState, Mark, Op, Put, Remove, Use, Uses, entry_id

MIN_CHUNK_SIZE, MAX_CHUNK_SIZE = 1024, 256 * 1024**2

_VALUES = struct.Struct(">Qd??")  # used (ns), retention value, pinned, superseded: 18 bytes
_USE = struct.Struct(">16sQd")  # id, used, value: 32 bytes
_BLOB_ID = 8  # bytes of random blob id in front of a `cat` value


class BadRecord(Exception):
    """A log record that cannot be applied: the mirror must be rebuilt."""


@dataclass(frozen=True, slots=True)
class BlobRef:
    """Where an entry's bytes are: `count` chunks of `chunk_size` (the last shorter)."""

    blob_id: bytes  # 8 random bytes, new for every store
    length: int
    chunk_size: int
    checksum: int  # xxh3_64 of the blob

    @property
    def count(self) -> int:
        return -(-self.length // self.chunk_size)

    def sizes(self) -> list[int]:
        count = self.count
        return [self.chunk_size] * (count - 1) + [self.length - self.chunk_size * (count - 1)]


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """An entry as the server holds it: the change that puts it in a catalog, and its chunks."""

    put: Put
    ref: BlobRef


class Values(NamedTuple):
    """A `val` value."""

    used: int  # ns since the epoch
    value: float
    pinned: bool
    superseded: bool


@dataclass(frozen=True, slots=True)
class Logged:
    """One log record as a script returns it, read: its number, the change it stands for
    (None: nothing left to apply), the chunks of a put entry, and whether the entry's
    metadata is damaged (the entry is removed from memory, and from the server later)."""

    seq: int
    change: Change | None
    ref: BlobRef | None = None
    damaged: bool = False


def pack_meta(key: bytes, state: EntryState, ref: BlobRef) -> bytes:
    """A `cat` value: the blob id, then msgpack of the entry's fixed fields and its chunking."""
    body = [
        state.namespace,
        key,
        state.size,
        state.created,
        state.priority,
        state.generation,
        ref.chunk_size,
        ref.checksum,
    ]
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return ref.blob_id + packed


def read_entry(eid: bytes, meta: Any, values: Any) -> StoredEntry | None:
    """The entry a `cat` value (and its `val` value, if any) describe; None unless the
    `cat` value is well formed and belongs to `eid`."""
    if not isinstance(meta, bytes) or len(meta) <= _BLOB_ID:
        return None
    try:
        namespace, key, size, created, priority, generation, chunk_size, checksum = msgpack.unpackb(
            meta[_BLOB_ID:], raw=False
        )
    except Exception:
        return None
    if not (
        isinstance(namespace, str)
        and isinstance(key, bytes)
        and key
        and len(key) % 4 == 0
        and len(namespace.encode("utf-8", "surrogatepass")) <= 1024
        and type(size) is int
        and size > len(key)
        and type(created) is int
        and created >= 0
        and isinstance(priority, (int, float))
        and not isinstance(priority, bool)
        and math.isfinite(priority)
        and priority >= 0
        and type(generation) is int
        and 0 <= generation < 2**63
        and type(chunk_size) is int
        and MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
        and type(checksum) is int
        and 0 <= checksum < 2**64
    ):
        return None
    try:
        if entry_id(namespace, key) != eid:
            return None
    except UnicodeEncodeError:
        return None
    tokens = len(key) // 4
    used, value, pinned, superseded = read_values(values) or Values(created, priority / tokens, False, False)
    state = EntryState(
        namespace, tokens, size, float(priority), generation, created, max(used, created), value, pinned, superseded
    )
    return StoredEntry(Put(eid, key, state), BlobRef(meta[:_BLOB_ID], size - len(key), chunk_size, checksum))


def blob_of(eid: bytes, meta: Any) -> BlobRef | None:
    """The chunks a `cat` value names (to unlink them), or None if it is not one."""
    entry = read_entry(eid, meta, None)
    return None if entry is None else entry.ref


def pack_values(used: int, value: float, pinned: bool, superseded: bool) -> bytes:
    """A `val` value."""
    return _VALUES.pack(used, value, pinned, superseded)


def read_values(raw: Any) -> Values | None:
    """A `val` value, or None if absent or damaged."""
    if not isinstance(raw, bytes) or len(raw) != _VALUES.size or raw[16] > 1 or raw[17] > 1:
        return None
    values = Values(*_VALUES.unpack(raw))
    return values if math.isfinite(values.value) else None


def pack_uses(uses: Uses) -> list[bytes]:
    """Pending uses as the sync script takes them: (id, used + value) pairs."""
    return [part for use in uses.items for part in (use.eid, _USE.pack(use.eid, use.used, use.value or 0.0)[16:])]


def read_uses(data: Any) -> Uses:
    """A touch record's 32-byte items (uses with a value that is not finite are skipped)."""
    if not isinstance(data, bytes) or len(data) % _USE.size:
        raise BadRecord("bad touch record in the log")
    return Uses(tuple(Use(*item) for item in _USE.iter_unpack(data) if math.isfinite(item[2])))


def read_clock(raw: Any) -> float:
    """The state's eviction clock; 0.0 if it does not parse."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


def pack_limit(limit: int | None) -> str:
    """A budget limit as the state hash holds it."""
    return "none" if limit is None else str(limit)


def read_budget(raw: Any) -> Budget | None:
    """The budget the scripts return (the state's max_bytes and max_entries, false when
    absent); None if the store holds none, or not a readable one."""
    if not (isinstance(raw, list) and len(raw) == 2):
        return None
    limits: list[int | None] = []
    for field in raw:
        if field == b"none":
            limits.append(None)
        elif isinstance(field, bytes) and field.isdigit() and 0 < int(field) < 2**63:
            limits.append(int(field))
        else:
            return None
    return Budget(*limits)


def read_record(record: Any) -> Logged:
    """A log record as the scripts return it, ``{seq, kind, a, b, c}``: for a put the
    entry's current `cat` and `val` values (false once it is gone), for a value change
    its current `val` value, for touches their items. Raises `BadRecord` for garbage."""
    if not (isinstance(record, list) and len(record) >= 2 and type(record[0]) is int):
        raise BadRecord("not a log record")
    seq, kind = record[0], record[1]
    try:
        op = Op(kind.decode() if isinstance(kind, bytes) else kind)
    except (ValueError, UnicodeDecodeError):
        raise BadRecord("unknown log record") from None
    if op == Op.CLEAR:
        return Logged(seq, Clear())
    if op == Op.TOUCH:
        return Logged(seq, read_uses(record[2] if len(record) > 2 else None))
    eid = record[2] if len(record) > 2 else None
    if not isinstance(eid, bytes) or len(eid) != 16:
        raise BadRecord("bad entry id in the log")
    if op == Op.PUT:
        meta = record[3] if len(record) > 3 else None
        entry = read_entry(eid, meta, record[4] if len(record) > 4 else None)
        if entry is None:  # gone since (a later record says so), or damaged
            return Logged(seq, Remove(eid), damaged=meta is not None)
        return Logged(seq, entry.put, entry.ref)
    if op == Op.VALUES:
        values = read_values(record[4] if len(record) > 4 else None)
        return Logged(seq, None if values is None else Mark(eid, values.value, values.pinned, values.superseded))
    if op == Op.DELETE:
        return Logged(seq, Remove(eid))
    raise BadRecord("unknown log record")

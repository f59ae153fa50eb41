"""Packing and validating the engine's records (see `sippcache.engine.layout`).

Every reader here treats its input as untrusted: a record that does not parse,
has the wrong types or does not belong to its key reads as absent (None, or 0
for numbers), so a damaged store makes entries invisible, never wrong.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

import msgpack  # type: ignore[import-untyped]  # msgpack ships no type information

from ..catalog import Budget, EntryState, Op
from ..protocol import Blob
from .layout import entry_id

_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


class Meta(NamedTuple):
    """An M record's fields."""

    namespace: str
    key: bytes
    size: int
    created: int  # ns since the epoch
    priority: float
    generation: int


def pack_u64(number: int) -> bytes:
    """A u64 record (S, T, U)."""
    return _U64.pack(number)


def read_u64(raw: Blob | None) -> int:
    """A stored u64; 0 when absent or damaged (the callers treat 0 as 'unknown')."""
    return int(_U64.unpack(raw)[0]) if raw is not None and len(raw) == 8 else 0


def pack_f64(number: float) -> bytes:
    """An f64 record (G)."""
    return _F64.pack(number)


def read_f64(raw: Blob | None) -> float:
    """A stored f64; 0.0 when absent or damaged."""
    value = float(_F64.unpack(raw)[0]) if raw is not None and len(raw) == 8 else 0.0
    return value if math.isfinite(value) else 0.0


def pack_meta(key: bytes, state: EntryState) -> bytes:
    """An entry's M record."""
    return _pack([state.namespace, key, state.size, state.created, state.priority, state.generation])


def read_meta(eid: bytes, raw: Blob) -> Meta | None:
    """An M record as (namespace, key, size, created, priority, generation), or None
    if it is damaged (does not parse, has wrong types, or does not belong to `eid`).
    A four-field record (written before priorities) gets the default priority and
    its creation time as generation."""
    try:
        fields = msgpack.unpackb(raw, raw=False)
        namespace, key, size, created = fields[:4]
        if len(fields) == 6:
            priority, generation = fields[4:]
        elif len(fields) == 4:
            priority, generation = len(key) // 4, created
        else:
            return None
    except Exception:
        return None
    if not (
        isinstance(namespace, str)
        and isinstance(key, bytes)
        and key
        and len(key) % 4 == 0
        and isinstance(size, int)
        and size > 0
        and isinstance(created, int)
        and isinstance(priority, (int, float))
        and not isinstance(priority, bool)
        and math.isfinite(priority)
        and priority >= 0
        and isinstance(generation, int)
        and not isinstance(generation, bool)
        and entry_id(namespace, key) == eid
    ):
        return None
    return Meta(namespace, key, size, created, float(priority), generation)


def pack_values(value: float, pinned: bool, superseded: bool) -> bytes:
    """An entry's V record."""
    return _pack([value, pinned, superseded])


def read_values(raw: Blob | None) -> tuple[float, bool, bool] | None:
    """A V record as (value, pinned, superseded), or None if absent or damaged."""
    if raw is None:
        return None
    try:
        value, pinned, superseded = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    if not (
        isinstance(value, float) and math.isfinite(value) and isinstance(pinned, bool) and isinstance(superseded, bool)
    ):
        return None
    return value, pinned, superseded


def pack_budget(budget: Budget) -> bytes:
    """The K record."""
    return _pack([budget.max_bytes, budget.max_entries])


def read_budget(raw: Blob | None) -> Budget | None:
    """The K record, or None if absent or damaged (then no budget is saved with the store)."""
    if raw is None:
        return None
    try:
        max_bytes, max_entries = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    limits = (max_bytes, max_entries)
    if not all(limit is None or (type(limit) is int and limit > 0) for limit in limits):
        return None
    return Budget(max_bytes, max_entries)


def pack_record(record: list[Any]) -> bytes:
    """A change-log record."""
    return _pack(record)


def read_record(raw: Blob) -> list[Any] | None:
    """A change-log record, or None if it is damaged."""
    try:
        record = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    valid = (
        isinstance(record, list)
        and record
        and (
            (record[0] in (Op.PUT, Op.DELETE, Op.VALUES) and len(record) == 2 and isinstance(record[1], bytes))
            or (
                record[0] == Op.TOUCH
                and len(record) == 2
                and isinstance(record[1], list)
                and all(
                    isinstance(t, list)
                    and len(t) in (2, 3)
                    and isinstance(t[0], bytes)
                    and isinstance(t[1], int)
                    and (len(t) == 2 or isinstance(t[2], float))
                    for t in record[1]
                )
            )
            or record in ([Op.CLEAR], [Op.BUDGET])
        )
    )
    return record if valid else None


def _pack(fields: list[Any]) -> bytes:
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed

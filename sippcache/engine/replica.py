"""This process's copy of a store's index, kept in step with the store's change log.

Every process rebuilds its in-memory index from the M records when it opens
the store, then replays the log records newer than the last one it saw before
each operation: a lookup costs one small read when nothing changed, and another
process's store is visible at once without reopening.
"""

from __future__ import annotations

import logging
from typing import Any

from ..catalog import Catalog, EntryState, PendingUses
from ..protocol import Blob
from .layout import (
    KEY_CLOCK,
    KEY_NEWEST,
    KEY_TRIMMED,
    OP_CLEAR,
    OP_DELETE,
    OP_PUT,
    OP_TOUCH,
    OP_VALUES,
    PREFIX_META,
    PREFIX_USED,
    PREFIX_VALUES,
    log_key,
)
from .records import read_f64, read_meta, read_record, read_u64, read_values
from .storage import KVTxn

log = logging.getLogger("sippcache")


class Replica:
    """The catalog of one store as of log record `seq`, with this process's
    pending uses and the ids of damaged entries awaiting removal."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.catalog = Catalog()
        self.seq = -1  # newest log record applied; -1 forces a rebuild
        self.uses = PendingUses()
        self.damaged: set[bytes] = set()  # ids whose M record is damaged: removed on the next write

    def invalidate(self) -> None:
        """Rebuild from the store's entries on the next `sync`."""
        self.seq = -1

    def sync(self, txn: KVTxn) -> None:
        """Bring memory up to the store's newest log record."""
        seq = read_u64(txn.get(KEY_NEWEST))
        if seq == self.seq:
            return
        if self.seq < read_u64(txn.get(KEY_TRIMMED)) or self.seq > seq:
            self.rebuild(txn, seq)
            return
        for number in range(self.seq + 1, seq + 1):
            raw = txn.get(log_key(number))
            record = read_record(raw) if raw is not None else None
            if record is None:  # trimmed while we read, or damaged: start from the entries
                self.rebuild(txn, seq)
                return
            self._apply(txn, record)
        self.catalog.clock = read_f64(txn.get(KEY_CLOCK))
        self.seq = seq

    def rebuild(self, txn: KVTxn, seq: int) -> None:
        """Load every entry from its records, as of log record `seq`."""
        self.catalog.clear()
        self.uses.items.clear()
        found = []
        for key, raw in txn.scan(PREFIX_META):
            eid = bytes(key[1:])
            loaded = self._load(txn, eid, raw)
            if loaded is not None:
                found.append((loaded[1].used, eid, loaded))
        if self.damaged:
            log.warning("sippcache: %s has %d damaged entries; they are removed on the next write",
                        self.location, len(self.damaged))  # fmt: skip
        for _, eid, (key, state) in sorted(found):
            self.catalog.put(eid, key, state)
        self.catalog.clock = read_f64(txn.get(KEY_CLOCK))
        self.seq = seq

    def _load(self, txn: KVTxn, eid: bytes, raw: Blob | None = None) -> tuple[bytes, EntryState] | None:
        """An entry's key and state from its M, U and V records; None if it is gone
        or its M record is damaged (then it is marked for removal)."""
        raw = txn.get(PREFIX_META + eid) if raw is None else raw
        if raw is None:
            return None
        meta = read_meta(eid, raw)
        if meta is None:
            self.damaged.add(eid)
            return None
        namespace, key, size, created, priority, generation = meta
        tokens = len(key) // 4
        used = read_u64(txn.get(PREFIX_USED + eid)) or created
        values = read_values(txn.get(PREFIX_VALUES + eid))
        value, pinned, superseded = values if values is not None else (priority / tokens, False, False)
        return key, EntryState(namespace, tokens, size, priority, generation, created, used, value, pinned, superseded)

    def _apply(self, txn: KVTxn, record: list[Any]) -> None:
        op = record[0]
        if op == OP_PUT:
            loaded = self._load(txn, record[1])  # None: deleted by a later record, or damaged
            if loaded is not None:
                self.catalog.put(record[1], *loaded)
        elif op == OP_DELETE:
            self.catalog.remove(record[1])
            self.uses.items.pop(record[1], None)
        elif op == OP_TOUCH:
            for eid, used, *value in record[1]:
                self.catalog.use(eid, used, value[0] if value else None)
        elif op == OP_VALUES:
            values = read_values(txn.get(PREFIX_VALUES + record[1]))
            if values is not None:
                value, pinned, superseded = values
                self.catalog.update(record[1], value=value, pinned=pinned, superseded=superseded)
        elif op == OP_CLEAR:
            self.catalog.clear()
            self.uses.items.clear()

"""This process's copy of a store's index, kept in step with the store's change log.

When a process opens a store it loads the catalog's snapshot (`I`, see
`sippcache.engine.layout`) and replays the log records written after it; only
without a usable snapshot (none, damaged, or older than the trimmed log) does
it read every entry's records. Then it replays the log records newer than the
last one it saw before each operation: a lookup costs one small read when
nothing changed, and another process's store is visible at once without
reopening.

A snapshot is a copy of checked records, so an entry it lists is checked
against its own M record the first time a lookup finds it (`confirm`): a record
damaged after the snapshot was written still makes its entry a miss.
"""

from __future__ import annotations

import logging
from typing import Any

from ..catalog import Catalog, EntryState, PendingUses, paused_gc
from ..protocol import Blob
from .layout import (
    KEY_CLOCK,
    KEY_INDEX_SNAPSHOT,
    KEY_INDEX_SNAPSHOT_SEQ,
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
from .records import pack_u64, read_f64, read_meta, read_record, read_u64, read_values
from .storage import KVTxn

log = logging.getLogger("sippcache")

#: Stores with fewer entries get no snapshot: reading their records at open takes
#: less than 40 ms, and checks every one of them.
INDEX_SNAPSHOT_MIN_ENTRIES = 1_000
#: On close, a snapshot this many log records behind the store is written again
#: (replaying that many records at open costs about what loading the snapshot does).
INDEX_SNAPSHOT_LAG = 1_000


class Replica:
    """The catalog of one store as of log record `seq`, with this process's
    pending uses and the ids of damaged entries awaiting removal."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.catalog = Catalog()
        self.seq = -1  # newest log record applied; -1 forces a rebuild
        self.uses = PendingUses()
        self.damaged: set[bytes] = set()  # ids whose M record is damaged: removed on the next write
        self.unconfirmed: set[bytes] = set()  # ids loaded from a snapshot whose M record is not read yet
        self.read_every_entry = False  # the last rebuild found no usable snapshot

    def invalidate(self) -> None:
        """Rebuild from the store on the next `sync`."""
        self.seq = -1

    def sync(self, txn: KVTxn) -> None:
        """Bring memory up to the store's newest log record."""
        seq = read_u64(txn.get(KEY_NEWEST))
        if seq == self.seq:
            return
        if self.seq < read_u64(txn.get(KEY_TRIMMED)) or self.seq > seq or not self._replay(txn, seq):
            self.rebuild(txn, seq)

    def rebuild(self, txn: KVTxn, seq: int, *, snapshot: bool = True) -> None:
        """Load the catalog as of log record `seq`: from the store's snapshot and the
        log after it if there is a usable one (and `snapshot`), else from every entry's records."""
        self.uses.items.clear()
        with paused_gc():  # hundreds of thousands of objects at once (see `paused_gc`)
            if snapshot and self._load_index_snapshot(txn, seq):
                self.read_every_entry = False
                return
            self._read_entries(txn, seq)
        self.read_every_entry = True

    def confirm(self, txn: KVTxn, eid: bytes) -> bool:
        """Whether entry `eid`, found by a lookup, may be returned. An entry loaded from
        a snapshot is checked against its M record once: if the record is gone,
        damaged (then it is marked for removal) or names another key, the entry is
        dropped from memory and False returned."""
        if eid not in self.unconfirmed:
            return True
        self.unconfirmed.discard(eid)
        raw = txn.get(PREFIX_META + eid)
        meta = read_meta(eid, raw) if raw is not None else None
        index = self.catalog.index
        if meta is not None and meta[:2] == (index.namespace_of(eid), index.key_of(eid)):
            return True
        if raw is not None and meta is None:
            self.damaged.add(eid)
        self.catalog.remove(eid)
        self.uses.items.pop(eid, None)
        return False

    def snapshot_wanted(self) -> bool:
        """Whether this store is big enough for an index snapshot to pay."""
        return len(self.catalog) >= INDEX_SNAPSHOT_MIN_ENTRIES

    def snapshot_stale(self, txn: KVTxn) -> bool:
        """Whether the store's snapshot should be written again: this process had
        to read every entry, or it is missing, older than the trimmed log
        (useless), or `INDEX_SNAPSHOT_LAG` log records behind the store."""
        saved = txn.get(KEY_INDEX_SNAPSHOT_SEQ)
        if self.read_every_entry or saved is None:
            return True
        at = read_u64(saved)
        return at < read_u64(txn.get(KEY_TRIMMED)) or read_u64(txn.get(KEY_NEWEST)) - at >= INDEX_SNAPSHOT_LAG

    def save_snapshot(self, txn: KVTxn) -> None:
        """Write the catalog's snapshot as of the store's newest log record (in
        `txn`, a write transaction), if memory is exactly the store then."""
        self.sync(txn)
        if not self.uses.items and not self.damaged:
            txn.put(KEY_INDEX_SNAPSHOT, self.catalog.snapshot(self.seq))
            txn.put(KEY_INDEX_SNAPSHOT_SEQ, pack_u64(self.seq))

    def _replay(self, txn: KVTxn, seq: int) -> bool:
        """Apply the log records after `self.seq` up to `seq`; False if one is
        missing (trimmed while we read) or damaged: then only a rebuild will do."""
        for number in range(self.seq + 1, seq + 1):
            raw = txn.get(log_key(number))
            record = read_record(raw) if raw is not None else None
            if record is None:
                return False
            self._apply(txn, record)
        self.catalog.clock = read_f64(txn.get(KEY_CLOCK))
        self.seq = seq
        return True

    def _load_index_snapshot(self, txn: KVTxn, seq: int) -> bool:
        """Load the store's snapshot and replay the log after it; False (memory to be
        rebuilt) if there is none, it is damaged, or the log after it is trimmed."""
        raw = txn.get(KEY_INDEX_SNAPSHOT)
        if raw is None:
            return False
        loaded = Catalog.from_snapshot(raw)
        if loaded is None:
            log.warning("sippcache: %s: the index snapshot is damaged; reading every entry instead", self.location)
            return False
        catalog, position = loaded
        if not read_u64(txn.get(KEY_TRIMMED)) <= position <= seq:
            return False  # log records it would need are gone, or the store is older than the snapshot
        self.catalog, self.seq = catalog, position
        self.damaged.clear()
        self.unconfirmed = set(catalog.ids())
        return self._replay(txn, seq)

    def _read_entries(self, txn: KVTxn, seq: int) -> None:
        """Load every entry from its records, as of log record `seq`."""
        self.catalog = Catalog()
        self.damaged.clear()
        self.unconfirmed.clear()
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

"""This process's copy of a KV store's index, kept in step with the store's change log.

`Replica` is the engine's `sippcache.mirror.Mirror`: the catalog, the log
position, pending uses and the budget are the mirror's; what is here is the
engine's own format, how a change is written to the byte map and read back
from it (see `sippcache.engine.layout`), and how a mirror is rebuilt from it.

When a process opens a store it loads the catalog's snapshot (`I`) and replays
the log records written after it; only without a usable snapshot (none,
damaged, or older than the trimmed log) does it read every entry's records.
Then it replays the log records newer than the last one it saw before each
operation: a lookup costs one small read when nothing changed, and another
process's store is visible at once without reopening.

A snapshot is a copy of checked records, so an entry it lists is checked
against its own M record the first time a lookup finds it (`confirm`): a record
damaged after the snapshot was written still makes its entry a miss.
"""

from __future__ import annotations

import logging
from typing import Any

from ..catalog import Budget, Catalog, Change, Clear, EntryState, Mark, Op, Put, Remove, Use, Uses, paused_gc
from ..mirror import Mirror
from ..protocol import Blob
from .layout import (
    ENTRY_PREFIXES,
    KEY_BUDGET,
    KEY_CLOCK,
    KEY_INDEX_SNAPSHOT,
    KEY_INDEX_SNAPSHOT_SEQ,
    KEY_NEWEST,
    KEY_TRIMMED,
    PREFIX_META,
    PREFIX_USED,
    PREFIX_VALUES,
    log_key,
)
from .records import (
    pack_budget,
    pack_meta,
    pack_u64,
    pack_values,
    read_budget,
    read_f64,
    read_meta,
    read_record,
    read_u64,
    read_values,
)
from .storage import KVTxn

log = logging.getLogger("sippcache")

#: Stores with fewer entries get no snapshot: reading their records at open takes
#: less than 40 ms, and checks every one of them.
INDEX_SNAPSHOT_MIN_ENTRIES = 1_000
#: On close, a snapshot this many log records behind the store is written again
#: (replaying that many records at open costs about what loading the snapshot does).
INDEX_SNAPSHOT_LAG = 1_000


class Replica(Mirror):
    """The catalog of one KV store as of log record `seq`, read from and written to its records."""

    unconfirmed: set[bytes]  # ids loaded from a snapshot whose M record is not read yet
    read_every_entry = False  # the last rebuild found no usable snapshot

    def __init__(self, location: str, **options: Any) -> None:
        super().__init__(location, **options)
        self.unconfirmed = set()

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
        with paused_gc():  # hundreds of thousands of objects at once (see `paused_gc`)
            self.read_every_entry = not (snapshot and self._load_index_snapshot(txn, seq))
            if self.read_every_entry:
                self._read_entries(txn, seq)
        self.catalog.budget = read_budget(txn.get(KEY_BUDGET))

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
        if meta is not None and (meta.namespace, meta.key) == (index.namespace_of(eid), index.key_of(eid)):
            return True
        if raw is not None and meta is None:
            self.damaged.add(eid)
        self.apply(Remove(eid))
        return False

    # -- writing a change ----------------------------------------------------------------

    def write(self, txn: KVTxn, change: Change) -> list[Any] | None:
        """Write `change`'s records in `txn` (a write transaction, in sync with the store);
        return its log record (None: nothing to log)."""
        match change:
            case Put(eid=eid, key=key, state=state):
                txn.put(PREFIX_META + eid, pack_meta(key, state))
                txn.put(PREFIX_USED + eid, pack_u64(state.used))
                txn.put(PREFIX_VALUES + eid, pack_values(state.value, state.pinned, state.superseded))
                return [change.op, eid]
            case Remove(eid=eid):
                for prefix in ENTRY_PREFIXES:
                    txn.delete(prefix + eid)
                return [change.op, eid]
            case Mark(eid=eid):
                txn.put(PREFIX_VALUES + eid, pack_values(change.value, change.pinned, change.superseded))
                return [change.op, eid]
            case Uses(items=items):
                saved = []
                for eid, used, value in items:
                    used_entry = self.catalog.get(eid)
                    if used_entry is not None and value is not None and txn.get(PREFIX_META + eid) is not None:
                        txn.put(PREFIX_USED + eid, pack_u64(used))
                        txn.put(PREFIX_VALUES + eid, pack_values(value, used_entry.pinned, False))
                        saved.append([eid, used, value])
                return [change.op, saved] if saved else None
            case Clear():
                for key, _ in list(txn.scan(PREFIX_META)):
                    for prefix in ENTRY_PREFIXES:
                        txn.delete(prefix + key[1:])
                for single in (KEY_CLOCK, KEY_INDEX_SNAPSHOT, KEY_INDEX_SNAPSHOT_SEQ):
                    txn.delete(single)
                return [change.op]
            case Budget():
                txn.put(KEY_BUDGET, pack_budget(change))
                return [change.op]
        raise TypeError(f"not a change: {change!r}")

    # -- the index snapshot ----------------------------------------------------------

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

    # -- reading the store -------------------------------------------------------------

    def _replay(self, txn: KVTxn, seq: int) -> bool:
        """Apply the log records after `self.seq` up to `seq`; False if one is
        missing (trimmed while we read) or damaged: then only a rebuild will do."""
        for number in range(self.seq + 1, seq + 1):
            raw = txn.get(log_key(number))
            record = read_record(raw) if raw is not None else None
            if record is None:
                return False
            self.follow(number, self._change(txn, record))
        self.catalog.clock = read_f64(txn.get(KEY_CLOCK))
        return True

    def _change(self, txn: KVTxn, record: list[Any]) -> Change | None:
        """The change a (valid) log record stands for, as the store holds it now."""
        op, eid = record[0], record[1] if len(record) > 1 else b""
        if op == Op.PUT:  # an entry gone (deleted by a later record) or damaged is removed
            return self._load(txn, eid) or Remove(eid)
        if op == Op.DELETE:
            return Remove(eid)
        if op == Op.TOUCH:
            return Uses(tuple(Use(item[0], item[1], item[2] if len(item) == 3 else None) for item in record[1]))
        if op == Op.VALUES:
            values = read_values(txn.get(PREFIX_VALUES + eid))
            return None if values is None else Mark(eid, *values)
        if op == Op.CLEAR:
            return Clear()
        return read_budget(txn.get(KEY_BUDGET))  # Op.BUDGET; a damaged K record changes nothing

    def _load_index_snapshot(self, txn: KVTxn, seq: int) -> bool:
        """Load the store's snapshot and replay the log after it; False (memory to be
        rebuilt) if there is none, it is damaged, or the log after it is trimmed."""
        raw = txn.get(KEY_INDEX_SNAPSHOT)
        if raw is None:
            return False
        loaded = Catalog.from_snapshot(raw, self.catalog.policy)
        if loaded is None:
            log.warning("sippcache: %s: the index snapshot is damaged; reading every entry instead", self.location)
            return False
        catalog, position = loaded
        if not read_u64(txn.get(KEY_TRIMMED)) <= position <= seq:
            return False  # log records it would need are gone, or the store is older than the snapshot
        self.replace(catalog, position)
        self.damaged.clear()
        self.unconfirmed = set(catalog.ids())
        return self._replay(txn, seq)

    def _read_entries(self, txn: KVTxn, seq: int) -> None:
        """Load every entry from its records, as of log record `seq`."""
        self.damaged.clear()
        self.unconfirmed.clear()
        found = [put for key, raw in txn.scan(PREFIX_META) if (put := self._load(txn, bytes(key[1:]), raw))]
        if self.damaged:
            log.warning(
                "sippcache: %s has %d damaged entries; they are removed on the next write",
                self.location,
                len(self.damaged),
            )
        self.reload(found, seq, read_f64(txn.get(KEY_CLOCK)))

    def _load(self, txn: KVTxn, eid: bytes, raw: Blob | None = None) -> Put | None:
        """An entry as its M, U and V records hold it; None if it is gone or its M
        record is damaged (then it is marked for removal)."""
        raw = txn.get(PREFIX_META + eid) if raw is None else raw
        if raw is None:
            return None
        meta = read_meta(eid, raw)
        if meta is None:
            self.damaged.add(eid)
            return None
        tokens = len(meta.key) // 4
        used = read_u64(txn.get(PREFIX_USED + eid)) or meta.created
        values = read_values(txn.get(PREFIX_VALUES + eid))
        value, pinned, superseded = values if values is not None else (meta.priority / tokens, False, False)
        state = EntryState(
            meta.namespace,
            tokens,
            meta.size,
            meta.priority,
            meta.generation,
            meta.created,
            used,
            value,
            pinned,
            superseded,
        )
        return Put(eid, meta.key, state)

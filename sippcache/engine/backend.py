"""`KVBackend`: a complete `CacheBackend` over any transactional byte map.

A backend only supplies transactions (`sippcache.engine.storage.KVTxn`); this
class does the rest once: budgets, pins, generations, the change log that
keeps several processes sharing one store in step (`sippcache.engine.replica`),
and batched recency.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ..base import BaseBackend
from ..catalog import StorePlan, refuse
from ..errors import CacheFull, ReadOnlyStore
from ..protocol import EntryInfo, Match, Peek, Stats, StoreOptions
from . import forking
from .layout import (
    ENTRY_PREFIXES,
    KEY_CLOCK,
    KEY_INDEX_SNAPSHOT,
    KEY_INDEX_SNAPSHOT_SEQ,
    KEY_NEWEST,
    KEY_TRIMMED,
    LOG_KEEP,
    OP_CLEAR,
    OP_DELETE,
    OP_PUT,
    OP_TOUCH,
    OP_VALUES,
    PREFIX_BLOB,
    PREFIX_META,
    PREFIX_USED,
    PREFIX_VALUES,
    entry_id,
    log_key,
)
from .records import pack_f64, pack_meta, pack_record, pack_u64, pack_values, read_u64
from .replica import Replica
from .snapshots import SnapshotMatch, release_unreferenced_blobs
from .storage import KVTxn

log = logging.getLogger("sippcache")

#: Log records a write transaction appends (see `sippcache.engine.layout`).
Records = list[list[Any]]
#: In-memory updates to run once a write transaction commits.
AfterCommit = list[Callable[[], None]]
#: A change made in a write transaction: it writes to the map, appends its log
#: records, and appends the in-memory updates to run once the transaction commits.
Change = Callable[[KVTxn, Records, AfterCommit], None]


def _nothing(txn: KVTxn, records: Records, after: AfterCommit) -> None:
    """The empty change: a write that only saves pending uses and removes damaged entries."""


class KVBackend(BaseBackend):
    """A complete `CacheBackend` on top of a transactional byte map.

    Subclasses implement `_transaction` and `_reader` (and `_close_store`);
    everything else is here. All in-memory state is guarded by one lock, so an
    instance may be shared by threads. A `read_only` instance never starts a
    write transaction: uses are not recorded and damaged entries stay.
    """

    def __init__(
        self, *, max_bytes: int | None, max_entries: int | None, location: str, read_only: bool = False
    ) -> None:
        super().__init__(read_only=read_only)
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.location = location
        self._lock = threading.RLock()
        self._replica = Replica(location)
        self._counters = dict(hits=0, misses=0, stores=0, evictions=0, refused=0, stale=0)
        forking.track(self)

    # -- storage hooks ---------------------------------------------------------

    @abstractmethod
    def _transaction(self) -> AbstractContextManager[KVTxn]:
        """A write transaction: committed when the block exits normally, else rolled back.
        Raise `CacheFull` when the store has no room."""

    @abstractmethod
    def _reader(self) -> tuple[KVTxn, Callable[[], None]]:
        """A read transaction and the function that ends it. Values it returns
        as memoryviews stay valid until it ends (zero-copy backends)."""

    @abstractmethod
    def _close_store(self) -> None:
        """Close the store's files or connections (after the last write)."""

    # -- fork handlers (`sippcache.engine.forking`) --------------------------------

    def _hold_for_fork(self) -> None:
        self._lock.acquire()

    def _resume_after_fork(self) -> None:
        self._lock.release()

    def _renew_after_fork(self) -> None:
        self._lock = threading.RLock()
        self._replica.invalidate()

    # -- BaseBackend hooks -------------------------------------------------------

    def _store(self, key: bytes, blob: memoryview, namespace: str, options: StoreOptions) -> bool:
        size = blob.nbytes + len(key)
        eid = entry_id(namespace, key)
        plans: list[StorePlan] = []

        def put(txn: KVTxn, records: Records, after: AfterCommit) -> None:
            catalog = self._replica.catalog
            plan = catalog.plan_store(
                eid, key, namespace, size, options, self._replica.uses.now(),
                max_bytes=self.max_bytes, max_entries=self.max_entries,
            )  # fmt: skip
            plans[:] = [plan]  # a retried transaction plans again
            state = plan.state
            if state is None:
                return
            for victim in plan.victims:
                self._remove_entry(txn, records, after, victim, evicted=True)
            if plan.clock != catalog.clock:
                txn.put(KEY_CLOCK, pack_f64(plan.clock))
            if plan.superseded is not None:
                self._write_values(txn, records, after, plan.superseded, superseded=True)
            txn.put(PREFIX_BLOB + eid, blob)
            txn.put(PREFIX_META + eid, pack_meta(namespace, key, size, state))
            txn.put(PREFIX_USED + eid, pack_u64(state.used))
            txn.put(PREFIX_VALUES + eid, pack_values(state.value, state.pinned, False))
            records.append([OP_PUT, eid])
            after.append(lambda: catalog.put(eid, key, state))

        with self._lock:
            if self.max_bytes is not None and size > self.max_bytes:  # no transaction for what cannot fit
                plans.append(StorePlan(None, "larger than max_bytes"))
            else:
                self._write(put)
            plan = plans[0]
            if plan.state is not None:
                self._counters["stores"] += 1
                return True
            if plan.reason == "stale":
                self._counters["stale"] += 1
                return False
            self._counters["refused"] += 1
            budgets = f"max_bytes={self.max_bytes}, max_entries={self.max_entries}"
            return refuse(self.location, size, len(key) // 4, options.pinned, plan.reason, budgets)

    def _lookup(self, key: bytes, namespace: str, partial: bool, touch: bool) -> Match | None:
        with self._lock:
            txn, end = self._reader()
            try:
                self._replica.sync(txn)
                index = self._replica.catalog.index
                find = index.longest_common if partial else index.longest_prefix
                hit = find(namespace, key)
                while hit is not None and not self._replica.confirm(txn, hit.entry_id):
                    hit = find(namespace, key)
                blob = txn.get(PREFIX_BLOB + hit.entry_id) if hit is not None else None
            except BaseException:
                end()
                raise
            if hit is None or blob is None:
                end()
                self._counters["misses"] += 1
                self._flush_touches_if_due()
                return None
            if not isinstance(blob, memoryview):
                end()
            if touch and not self.read_only:
                self._replica.uses.record(self._replica.catalog, hit.entry_id)
            self._counters["hits"] += 1
            stored_key = index.key_of(hit.entry_id)
            self._flush_touches_if_due()
        if isinstance(blob, memoryview):
            return SnapshotMatch(hit.length, stored_key, blob, namespace, end)
        return Match(hit.length, stored_key, blob, namespace)

    def _peek(self, key: bytes, namespace: str, partial: bool) -> Peek | None:
        with self._lock:
            self._refresh()
            return self._replica.catalog.peek(namespace, key, partial)

    def _touch_entry(self, key: bytes, namespace: str) -> bool:
        eid = entry_id(namespace, key)
        with self._lock:
            self._refresh()
            found = eid in self._replica.catalog
            if found and not self.read_only:
                self._replica.uses.record(self._replica.catalog, eid)
                self._flush_touches_if_due()
            return found

    def _delete(self, key: bytes, namespace: str) -> bool:
        eid = entry_id(namespace, key)
        found: list[bytes] = []

        def remove(txn: KVTxn, records: Records, after: AfterCommit) -> None:
            found.clear()  # a retried transaction starts over
            if txn.get(PREFIX_META + eid) is not None:
                self._remove_entry(txn, records, after, eid)
                found.append(eid)

        self._write(remove)
        return bool(found)

    def _set_pinned(self, key: bytes, namespace: str, pinned: bool) -> bool:
        eid = entry_id(namespace, key)
        outcome: list[str] = []

        def change(txn: KVTxn, records: Records, after: AfterCommit) -> None:
            outcome.clear()  # a retried transaction starts over
            catalog = self._replica.catalog
            state = catalog.get(eid)
            if state is None:
                return
            if state.pinned != pinned:
                if pinned and not catalog.pins_fit(state.size, self.max_bytes, self.max_entries):
                    outcome.append("full")
                    return
                self._write_values(txn, records, after, eid, pinned=pinned)
            outcome.append("done")

        with self._lock:
            self._write(change)
        if outcome == ["full"]:
            raise CacheFull(
                f"{self.location}: cannot pin {len(key) // 4} tokens: pinned entries would exceed "
                f"max_bytes={self.max_bytes}, max_entries={self.max_entries}"
            )
        return bool(outcome)

    def _clear(self) -> None:
        def clear(txn: KVTxn, records: Records, after: AfterCommit) -> None:
            for key, _ in list(txn.scan(PREFIX_META)):
                eid = key[1:]
                for prefix in ENTRY_PREFIXES:
                    txn.delete(prefix + eid)
            for single in (KEY_CLOCK, KEY_INDEX_SNAPSHOT, KEY_INDEX_SNAPSHOT_SEQ):
                txn.delete(single)
            records.append([OP_CLEAR])
            after.append(self._replica.catalog.clear)

        self._write(clear)

    def _stats(self) -> Stats:
        with self._lock:
            self._refresh()
            return self._replica.catalog.stats(
                backend=type(self).__name__, location=self.location, max_bytes=self.max_bytes,
                max_entries=self.max_entries, damaged=len(self._replica.damaged), **self._counters,
            )  # fmt: skip

    def _entries(self, namespace: str | None) -> list[EntryInfo]:
        with self._lock:
            self._refresh()
            return self._replica.catalog.entries(namespace)

    def _remove_damaged(self) -> int:
        """An index loaded from a snapshot is read again from every entry's records
        first, so records damaged after the snapshot was written are found too."""
        with self._lock:
            txn, end = self._reader()
            try:
                if self._replica.unconfirmed:
                    self._replica.rebuild(txn, read_u64(txn.get(KEY_NEWEST)), snapshot=False)
                else:
                    self._replica.sync(txn)
            finally:
                end()
            count = len(self._replica.damaged)
            if count:
                self._write(_nothing)
            return count

    def _len(self) -> int:
        with self._lock:
            self._refresh()
            return len(self._replica.catalog)

    def _close(self) -> None:
        release_unreferenced_blobs()
        with self._lock:
            try:
                if self._replica.uses.items and not self.read_only:
                    self._write(_nothing)
            except Exception as exc:  # closing must not fail over lost recency data
                log.warning("sippcache: could not save recency updates on close: %s", exc)
            else:
                self._save_index_snapshot(if_stale=True)
            self._close_store()

    # -- writing -----------------------------------------------------------------

    def _write(self, change: Change) -> None:
        """Run `change` in a write transaction together with pending touches and its
        log records, then apply its in-memory updates. On `CacheFull` (the store
        itself has no room), retry once (the backend may have made room: LMDB grows
        its map), then evict down to half the stored bytes and retry a last time."""
        if self.read_only:  # the public methods refuse first; this guards every other path
            raise ReadOnlyStore(f"{self.location} is open read-only")
        with self._lock:
            try:
                self._write_once(change)
            except CacheFull:
                try:
                    self._write_once(change)
                except CacheFull:
                    if not self._replica.catalog.total:
                        raise
                    log.warning("sippcache: %s is full; evicting down to half its stored bytes", self.location)
                    self._write_once(self._evict_to_half)
                    self._write_once(change)
            if self._replica.read_every_entry:
                self._save_index_snapshot()

    def _write_once(self, change: Change) -> None:
        replica = self._replica
        records: Records = []
        after: AfterCommit = []
        with self._transaction() as txn:
            replica.sync(txn)
            if replica.uses.items:
                touched = []
                for eid, (used, value) in replica.uses.items.items():
                    state = replica.catalog.get(eid)
                    if state is not None and txn.get(PREFIX_META + eid) is not None:
                        txn.put(PREFIX_USED + eid, pack_u64(used))
                        txn.put(PREFIX_VALUES + eid, pack_values(value, state.pinned, False))
                        touched.append([eid, used, value])
                if touched:
                    records.append([OP_TOUCH, touched])
            for eid in replica.damaged:
                self._remove_entry(txn, records, after, eid)
            change(txn, records, after)
            seq = replica.seq
            for record in records:
                seq += 1
                txn.put(log_key(seq), pack_record(record))
            if records:
                txn.put(KEY_NEWEST, pack_u64(seq))
                self._trim_log(txn, seq)
        # Committed: bring memory to the state after our records (touches are in memory already).
        replica.uses.items.clear()
        replica.damaged.clear()
        replica.seq = seq
        for update in after:
            update()

    def _trim_log(self, txn: KVTxn, seq: int) -> None:
        trimmed = read_u64(txn.get(KEY_TRIMMED))
        if seq - trimmed > 2 * LOG_KEEP:
            for old in range(trimmed + 1, seq - LOG_KEEP + 1):
                txn.delete(log_key(old))
            txn.put(KEY_TRIMMED, pack_u64(seq - LOG_KEEP))

    # -- the index snapshot (see `sippcache.engine.replica`) ----------------------------

    def _save_index_snapshot(self, *, if_stale: bool = False) -> None:
        """Write the catalog's snapshot in a write transaction of its own (with
        `if_stale`, only if `Replica.snapshot_stale` says so). Written rarely (on
        close, and once after this process had to read every entry), so stores
        never wait for it; one that cannot be written (a full disk) is skipped:
        it only saves time."""
        replica = self._replica
        try:
            if self.read_only or not type(self).persistent or not replica.snapshot_wanted():
                return
            if if_stale:
                txn, end = self._reader()
                try:
                    stale = replica.snapshot_stale(txn)
                finally:
                    end()
                if not stale:
                    return
            with self._transaction() as txn:
                replica.save_snapshot(txn)
        except Exception as exc:
            log.info("sippcache: could not save %s's index snapshot: %s", self.location, exc)
        finally:
            replica.read_every_entry = False  # tried once, whatever happened

    def _evict_to_half(self, txn: KVTxn, records: Records, after: AfterCommit) -> None:
        """Evict (by the eviction order, never pinned entries) down to half the stored bytes."""
        catalog = self._replica.catalog
        for victim in catalog.victims(max_bytes=catalog.total // 2, max_entries=None) or ():
            self._remove_entry(txn, records, after, victim, evicted=True)

    def _remove_entry(
        self, txn: KVTxn, records: Records, after: AfterCommit, eid: bytes, *, evicted: bool = False
    ) -> None:
        for prefix in ENTRY_PREFIXES:
            txn.delete(prefix + eid)
        records.append([OP_DELETE, eid])
        after.append(lambda: self._forget(eid, evicted))

    def _forget(self, eid: bytes, evicted: bool) -> None:
        if self._replica.catalog.remove(eid, evicted=evicted) is not None and evicted:
            self._counters["evictions"] += 1
        self._replica.uses.items.pop(eid, None)

    def _write_values(
        self, txn: KVTxn, records: Records, after: AfterCommit, eid: bytes,
        *, pinned: bool | None = None, superseded: bool | None = None,
    ) -> None:  # fmt: skip
        """Change an entry's pinned or superseded flag (its V record)."""
        catalog = self._replica.catalog
        state = catalog.get(eid)
        assert state is not None
        value = state.value
        new_pinned = state.pinned if pinned is None else pinned
        new_superseded = state.superseded if superseded is None else superseded
        txn.put(PREFIX_VALUES + eid, pack_values(value, new_pinned, new_superseded))
        records.append([OP_VALUES, eid])
        after.append(lambda: catalog.update(eid, value=value, pinned=new_pinned, superseded=new_superseded))

    # -- reading the store ---------------------------------------------------------

    def _refresh(self) -> None:
        txn, end = self._reader()
        try:
            self._replica.sync(txn)
        finally:
            end()

    # -- recency -------------------------------------------------------------------

    def _flush_touches_if_due(self) -> None:
        if self._replica.uses.due() and not self.read_only:
            try:
                self._write(_nothing)
            except Exception as exc:  # recency is advisory: never fail a lookup over it
                log.warning("sippcache: could not save recency updates: %s", exc)

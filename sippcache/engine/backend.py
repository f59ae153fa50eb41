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
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from functools import partial
from typing import ClassVar, NamedTuple, cast

from ..base import BaseBackend
from ..catalog import Budget, Change, Clear, Remove, StorePlan
from ..errors import CacheFull, ReadOnlyStore
from ..eviction import DEFAULT_POLICY, EvictionPolicy
from ..mirror import Limit, check_limits
from ..protocol import Blob, EntryInfo, Match, Peek, Stats, StoreOptions
from . import forking
from .layout import KEY_CLOCK, KEY_NEWEST, KEY_TRIMMED, LOG_KEEP, PREFIX_BLOB, PREFIX_META, entry_id, log_key
from .records import pack_f64, pack_record, pack_u64, read_u64
from .replica import Replica
from .snapshots import End, SnapshotMatch, release_unreferenced_blobs, shared_end
from .storage import KVTxn

log = logging.getLogger("sippcache")

#: A write: given the write transaction (in sync with the store), it writes what no
#: change stands for (a blob) and returns its changes, which the engine writes and logs.
Write = Callable[[KVTxn], Iterable[Change]]


#: Whether a found entry may be returned (`Replica.confirm`, which may change memory).
Confirm = Callable[[KVTxn, bytes], bool]

#: `_lock_or_answer`'s answers: the caller holds the lock; no answer without it.
_HELD, _WAIT = object(), object()

#: How often a call waiting for another thread's write looks whether it can be answered without it.
_POLL_SECONDS = 0.002


class _Found(NamedTuple):
    """An entry a lookup found: its id, its length in tokens, its key and its blob."""

    eid: bytes
    length: int
    key: bytes | memoryview
    blob: Blob


class _Unconfirmed(Exception):
    """A read without `_lock` found an entry that must first be confirmed against its records."""


def _nothing(txn: KVTxn) -> tuple[Change, ...]:
    """The empty write: one that only saves pending uses and the budget, and removes damaged entries."""
    return ()


class KVBackend(BaseBackend):
    """A complete `CacheBackend` on top of a transactional byte map.

    Subclasses implement `_transaction` and `_reader` (and `_close_store`);
    everything else is here. All in-memory state is guarded by one lock, so an
    instance may be shared by threads. A `read_only` instance never starts a
    write transaction: uses are not recorded and damaged entries stay.

    `max_bytes` and `max_entries` are the limits this handle enforces; `UNSET`
    (what a subclass passes for a URL without them) follows the budget saved
    with the store, else `default_max_bytes` and no entry limit. Limits that are
    given are saved with the store at the handle's first use (see
    `sippcache.mirror.Mirror`). `eviction` orders entries for eviction.
    """

    #: The byte budget of a handle given none, on a store that saves none.
    default_max_bytes: ClassVar[int | None] = 8 * 1024**3

    #: Whether a read transaction (`_reader`) may begin and read in one thread while another
    #: thread's write transaction is open, and sees only committed data (MVCC: LMDB, SQLite in
    #: WAL mode). Then lookups are answered during another thread's long write of an entry's
    #: bytes rather than after it.
    reads_during_writes: ClassVar[bool] = False

    #: Whether a memoryview that a read transaction's `get` returns views the store's memory,
    #: valid only while the transaction is open (LMDB's map): its match then keeps the
    #: transaction open until released (`SnapshotMatch`). False for views that hold their own
    #: memory (diskcache's mapped value files).
    views_need_their_reader: ClassVar[bool] = True

    def __init__(
        self,
        *,
        max_bytes: Limit,
        max_entries: Limit,
        location: str,
        read_only: bool = False,
        eviction: EvictionPolicy = DEFAULT_POLICY,
    ) -> None:
        super().__init__(read_only=read_only)
        check_limits(max_bytes, max_entries)
        self.location = location
        self._lock = threading.RLock()
        # Nonzero (a new number each time) while a write holding `_lock` copies an entry's bytes
        # or commits: stretches that change nothing in memory, so peeks and lookups may read the
        # catalog without waiting for them (a whole state of a gigabyte takes seconds to write
        # to LMDB). See `_lock_or_answer`.
        self._bulk = 0
        self._bulks = 0
        # Held by a lookup reading the store during such a stretch (so a fork, which takes it
        # after `_lock`, never copies an open read transaction), and the hits, misses and uses
        # of those lookups, which change memory: settled once `_lock` is held.
        self._through = threading.Lock()
        self._late: deque[tuple[int, int, tuple[bytes, ...]]] = deque()
        self._replica = Replica(
            location,
            max_bytes=max_bytes,
            max_entries=max_entries,
            default=Budget(self.default_max_bytes),
            policy=eviction,
            claim=not read_only,
        )
        forking.hold_across_forks(self)

    @property
    def max_bytes(self) -> int | None:
        """The byte budget this handle enforces (as of its last use of the store)."""
        return self._replica.budget.max_bytes

    @property
    def max_entries(self) -> int | None:
        """The entry limit this handle enforces (as of its last use of the store)."""
        return self._replica.budget.max_entries

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
        self._through.acquire()

    def _resume_after_fork(self) -> None:
        self._through.release()
        self._lock.release()

    def _renew_after_fork(self) -> None:
        self._lock = threading.RLock()
        self._through = threading.Lock()
        self._replica.invalidate()

    # -- BaseBackend hooks -------------------------------------------------------

    def _store(self, key: bytes, blob: memoryview, namespace: str, options: StoreOptions) -> bool:
        size = blob.nbytes + len(key)
        eid = entry_id(namespace, key)
        replica = self._replica
        plans: list[StorePlan] = []

        def put(txn: KVTxn) -> tuple[Change, ...]:
            plan = replica.plan_store(eid, key, namespace, size, options)
            plans[:] = [plan]  # a retried transaction plans again
            if plan.state is not None:
                try:
                    self._start_bulk()
                    txn.put(PREFIX_BLOB + eid, blob)
                finally:
                    self._bulk = 0
            return plan.changes

        with self._lock:
            limit = replica.budget.max_bytes
            if replica.seq >= 0 and limit is not None and size > limit:  # no transaction for what cannot fit
                plans.append(StorePlan(None, "larger than max_bytes"))
            else:
                self._write(put)
            return replica.settle_store(plans[0], size, len(key) // 4, options.pinned)

    def _lookup(self, key: bytes, namespace: str, partial: bool, touch: bool) -> Match | None:
        def find(txn: KVTxn, confirm: Confirm) -> list[_Found]:
            index = self._replica.catalog.index
            longest = index.longest_common if partial else index.longest_prefix
            hit = longest(namespace, key)
            while hit is not None and not confirm(txn, hit.entry_id):
                hit = longest(namespace, key)
            blob = txn.get(PREFIX_BLOB + hit.entry_id) if hit is not None else None
            if hit is None or blob is None:
                return []
            return [_Found(hit.entry_id, hit.length, index.key_of(hit.entry_id), blob)]

        matches = self._read(find, namespace, 1, touch)
        return matches[0] if matches else None

    def _lookup_prefixes(self, key: bytes, lengths: list[int], namespace: str, touch: bool) -> list[Match]:
        """One walk down the index and one read transaction for the whole chain: its matches
        share the snapshot, which ends when the last of them is released."""

        keys = memoryview(key)  # a view of it per match, not a copy: a chain's would be quadratic

        def find(txn: KVTxn, confirm: Confirm) -> list[_Found]:
            found: list[_Found] = []
            eids = self._replica.catalog.index.entries_along(namespace, key, [4 * n for n in lengths])
            for eid, n in zip(eids, lengths, strict=False):
                blob = txn.get(PREFIX_BLOB + eid) if confirm(txn, eid) else None
                if blob is None:
                    break
                found.append(_Found(eid, n, keys[: 4 * n], blob))
            return found

        return self._read(find, namespace, len(lengths), touch)

    def _read(
        self, find: Callable[[KVTxn, Confirm], list[_Found]], namespace: str, wanted: int, touch: bool
    ) -> list[Match]:
        """The matches of the entries `find` gives, found in one read transaction, in step
        with the store; their hits, the misses of the `wanted` less those found, and their uses
        (with `touch`) counted. Read under `_lock`, or without it while another thread's write
        is in a stretch that changes nothing in memory (`_read_during_write`)."""
        read = self._lock_or_answer(partial(self._read_during_write, find) if self.reads_during_writes else None)
        held = read is _HELD
        try:
            if held:
                if self._replica.seq < 0:
                    self._refresh()  # the first use: in step with the store, this handle's budget saved
                txn, end = self._reader()
                try:
                    self._replica.sync(txn)
                    found = find(txn, self._replica.confirm)
                except BaseException:
                    end()
                    raise
            else:
                found, end = cast(tuple[list[_Found], End], read)
            views = sum(isinstance(entry.blob, memoryview) for entry in found) if self.views_need_their_reader else 0
            ends = iter(shared_end(end, views)) if views else None
            if ends is None:
                end()
            # The matches exist before the flush's write: a backend that must end the
            # snapshot to make room (LMDB growing its map) can detach it.
            matches = [
                SnapshotMatch(entry.length, entry.key, entry.blob, namespace, next(ends))
                if isinstance(entry.blob, memoryview) and ends is not None
                else Match(entry.length, entry.key, entry.blob, namespace)
                for entry in found
            ]
            self._late.append((len(found), len(found) < wanted, tuple(entry.eid for entry in found) if touch else ()))
            if held:
                self._settle_late()
                self._flush_touches_if_due()
            return matches
        finally:
            if held:
                self._lock.release()

    def _read_during_write(self, find: Callable[[KVTxn, Confirm], list[_Found]]) -> object:
        """`find`'s answer and the end of its read transaction, without `_lock`, while another
        thread's write copies an entry's bytes or commits; `_WAIT` where it cannot be had so.
        The transaction must see the records memory is in step with (the writer excludes every
        other, and its own are not committed yet), and memory must not change during the walk;
        an entry that would have to be confirmed against its records (one loaded from an index
        snapshot) waits."""
        with self._through:
            bulk = self._bulk
            if not bulk:
                return _WAIT
            replica = self._replica
            try:
                txn, end = self._reader()
            except Exception:  # answered under the lock, raised there if it still fails
                return _WAIT
            try:
                if read_u64(txn.get(KEY_NEWEST)) != replica.seq:
                    end()
                    return _WAIT
                found = find(txn, self._confirmed_without_lock)
            except Exception:  # memory changed under the walk, or an unconfirmed entry
                end()
                return _WAIT
            if self._bulk != bulk:
                end()
                return _WAIT
            return found, end

    def _touch_prefixes(self, key: bytes, lengths: list[int], namespace: str) -> int:
        """One walk down the index; the chain's uses recorded as one change."""
        with self._lock:
            self._refresh()
            eids = self._replica.catalog.index.entries_along(namespace, key, [4 * n for n in lengths])
            if eids and not self.read_only:
                self._replica.uses.record(self._replica.catalog, *eids)
                self._flush_touches_if_due()
            return len(eids)

    def _confirmed_without_lock(self, txn: KVTxn, eid: bytes) -> bool:
        """`Confirm` for a read without `_lock`, which must not change memory."""
        if eid in self._replica.unconfirmed:
            raise _Unconfirmed
        return True

    def _peek(self, key: bytes, namespace: str, partial: bool) -> Peek | None:
        def during_write() -> object:
            bulk = self._bulk
            try:
                peek = self._replica.catalog.peek(namespace, key, partial)
            except Exception:  # the stretch ended and memory changed under the walk
                return _WAIT
            return peek if bulk and self._bulk == bulk else _WAIT

        answer = self._lock_or_answer(during_write)
        if answer is not _HELD:
            return cast(Peek | None, answer)
        try:
            self._refresh()
            return self._replica.catalog.peek(namespace, key, partial)
        finally:
            self._lock.release()

    def _lock_or_answer(self, during_write: Callable[[], object] | None) -> object:
        """Take `_lock` (`_HELD`: the caller releases it), or, while another thread holds it
        in a stretch of a write that changes nothing in memory (`_start_bulk`), what
        `during_write` answers without it (other than `_WAIT`): no other process can commit
        then, so memory is in step with the store. Polls, so that a write that reaches such a
        stretch after the call began is read through too."""
        if during_write is None:
            self._lock.acquire()
            return _HELD
        while not self._lock.acquire(blocking=False):
            if self._bulk:
                answer = during_write()
                if answer is not _WAIT:
                    return answer
            if self._lock.acquire(timeout=_POLL_SECONDS):
                break
        return _HELD

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

        def remove(txn: KVTxn) -> tuple[Change, ...]:
            found.clear()  # a retried transaction starts over
            if txn.get(PREFIX_META + eid) is None:
                return ()
            found.append(eid)
            return (Remove(eid),)

        self._write(remove)
        return bool(found)

    def _set_pinned(self, key: bytes, namespace: str, pinned: bool) -> bool:
        eid = entry_id(namespace, key)
        outcome: list[CacheFull | None] = []

        def change(txn: KVTxn) -> tuple[Change, ...]:
            outcome.clear()  # a retried transaction starts over
            if eid not in self._replica.catalog:
                return ()
            try:
                mark = self._replica.plan_pin(eid, pinned, len(key) // 4)
            except CacheFull as exc:  # raised after the transaction: inside, it would mean "the store is full"
                outcome.append(exc)
                return ()
            outcome.append(None)
            return () if mark is None else (mark,)

        with self._lock:
            self._write(change)
        if outcome and outcome[0] is not None:
            raise outcome[0]
        return bool(outcome)

    def _clear(self) -> None:
        self._write(lambda txn: (Clear(),))

    def _stats(self) -> Stats:
        with self._lock:
            self._refresh()
            self._settle_late()
            replica = self._replica
            return replica.catalog.stats(
                backend=type(self).__name__,
                location=self.location,
                budget=replica.budget,
                damaged=len(replica.damaged),
                **replica.counters,
            )

    def _entries(self, namespace: str | None) -> list[EntryInfo]:
        with self._lock:
            self._refresh()
            return self._replica.catalog.entries(namespace)

    def _namespaces(self) -> list[str]:
        with self._lock:
            self._refresh()
            return self._replica.catalog.namespaces()

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

    def _write(self, write: Write) -> None:
        """Run `write` in a write transaction together with pending uses, the budget to
        save and the removal of damaged entries, log its changes, then apply them. On
        `CacheFull` (the store itself has no room), retry once (the backend may have
        made room: LMDB grows its map), then evict down to half the stored bytes and
        retry a last time."""
        if self.read_only:  # the public methods refuse first; this guards every other path
            raise ReadOnlyStore(f"{self.location} is open read-only")
        with self._lock:
            try:
                self._write_once(write)
            except CacheFull:
                try:
                    self._write_once(write)
                except CacheFull:
                    if not self._replica.catalog.total:
                        raise
                    log.warning("sippcache: %s is full; evicting down to half its stored bytes", self.location)
                    self._write_once(self._evict_to_half)
                    self._write_once(write)
            if self._replica.read_every_entry:
                self._save_index_snapshot()

    def _write_once(self, write: Write) -> None:
        replica = self._replica
        try:
            with self._transaction() as txn:
                replica.sync(txn)
                self._settle_late()
                changes: list[Change] = [Remove(eid) for eid in replica.damaged]
                for pending in (replica.uses.batch(), replica.budget_claim()):
                    if pending is not None:
                        changes.append(pending)
                changes.extend(write(txn))
                clock = replica.catalog.clock_after(changes)
                if clock != replica.catalog.clock:
                    txn.put(KEY_CLOCK, pack_f64(clock))
                seq = replica.seq
                for change in changes:
                    record = replica.write(txn, change)
                    if record is not None:
                        seq += 1
                        txn.put(log_key(seq), pack_record(record))
                if seq != replica.seq:
                    txn.put(KEY_NEWEST, pack_u64(seq))
                    self._trim_log(txn, seq)
                self._start_bulk()  # the commit, as the block ends: memory changes only after it
        finally:
            self._bulk = 0
        # Committed: bring memory to the state after our records (uses are in memory already).
        replica.uses.items.clear()
        replica.damaged.clear()
        replica.committed(changes, seq)

    def _settle_late(self) -> None:
        """(With `_lock` held.) Count the hits and misses, and record the uses, of the lookups
        answered during a write."""
        counters, replica = self._replica.counters, self._replica
        while self._late:
            hits, misses, used = self._late.popleft()
            counters["hits"] += hits
            counters["misses"] += misses
            if used and not self.read_only:
                replica.uses.record(replica.catalog, *used)

    def _start_bulk(self) -> None:
        """Mark the start of a stretch of a write that changes nothing in memory (see `_lock_or_answer`);
        the caller sets `_bulk` to 0 when it ends."""
        self._bulks += 1
        self._bulk = self._bulks

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

    def _evict_to_half(self, txn: KVTxn) -> list[Change]:
        """Evict (by the eviction order, never pinned entries) down to half the stored bytes."""
        catalog = self._replica.catalog
        return [Remove(victim, evicted=True) for victim in catalog.victims(Budget(catalog.total // 2)) or ()]

    # -- reading the store ---------------------------------------------------------

    def _refresh(self) -> None:
        """Bring memory up to the store; at the first use, save this handle's budget with it."""
        txn, end = self._reader()
        try:
            self._replica.sync(txn)
        finally:
            end()
        if self._replica.budget_claim() is not None:
            self._write(_nothing)

    # -- recency -------------------------------------------------------------------

    def _flush_touches_if_due(self) -> None:
        if self._replica.uses.due() and not self.read_only:
            try:
                self._write(_nothing)
            except Exception as exc:  # recency is advisory: never fail a lookup over it
                log.warning("sippcache: could not save recency updates: %s", exc)

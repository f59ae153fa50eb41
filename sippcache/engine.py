"""The cache logic shared by every built-in backend, over a transactional key-value store.

A backend only supplies transactions on a byte-keyed map (`KVTxn`); this
module does the rest once: the prefix index and the eviction order (both kept
in a `sippcache.catalog.Catalog`), budgets, pins, generations, and keeping
several processes that share one store in step.

Layout of the map (ids are xxh3_128 of namespace + key, so LMDB's 511-byte key
limit never matters)::

    B<id>   the blob
    M<id>   msgpack [namespace, key bytes, size, created_ns, priority, generation]
            (stores written before pins and priorities have the first four only)
    U<id>   u64 last-use time (ns), updated in batches
    V<id>   msgpack [retention value, pinned, superseded] (absent: the defaults)
    L<seq>  the change log: msgpack [op, ...] with op p(ut) / d(elete) / t(ouch) /
            v(alues changed) / c(lear)
    S       u64 sequence number of the newest log record
    T       u64 log records at or below this number were trimmed
    G       f64 the eviction clock (see `sippcache.catalog`)

Every process rebuilds its in-memory index from the M records when it opens
the store, then replays the log records newer than the last one it saw before
each operation: a lookup costs one small read when nothing changed, and another
process's store is visible at once without reopening.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import struct
import threading
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import msgpack
import xxhash

from . import tokens as _tokens
from .catalog import Catalog, EntryState, PendingUses, StorePlan, refuse
from .errors import CacheFull, CorruptStore
from .protocol import BaseBackend, EntryInfo, Match, Peek, Stats, StoreOptions

log = logging.getLogger("sippcache")

_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
#: The records each entry has besides its log entries.
_ENTRY_RECORDS = (b"B", b"M", b"U", b"V")
_SEQ_KEY = struct.Struct(">Q")  # big-endian so log keys sort by number
#: Log records kept for processes that fall behind; further behind means a rebuild.
LOG_KEEP = 10_000


class KVTxn(Protocol):
    """A transaction on the backing byte map; reads see one consistent state."""

    def get(self, key: bytes) -> bytes | memoryview | None: ...

    def put(self, key: bytes, value: bytes | memoryview) -> None: ...

    def delete(self, key: bytes) -> None: ...

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes | memoryview]]:
        """Every (key, value) whose key starts with `prefix`."""


def directory_path(scheme: str, location: str) -> str:
    """The absolute directory a persistent store at `scheme://location` lives in (`~` expanded)."""
    if not location:
        raise ValueError(f"{scheme}:// needs a directory, e.g. {scheme}:///var/cache/sipp")
    path = os.path.abspath(os.path.expanduser(location))
    if len(path) > 4000 or any(len(part) > 255 for part in path.split(os.sep)):
        raise ValueError(f"{scheme}:// path is too long: {path[:80]}...")
    return path


def prepare_directory(path: str, files: tuple[str, ...]) -> None:
    """Create the store directory (0700: entries hold users' prompts) and refuse
    store files that are symbolic links, so nothing is written through them."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{path} is not a directory")
    for name in files:
        try:
            mode = os.lstat(os.path.join(path, name)).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise CorruptStore(f"{os.path.join(path, name)} is not a regular file (a link or a folder?); refusing it")


def entry_id(namespace: str, key: bytes) -> bytes:
    """The 16-byte id of `key` (token bytes) in `namespace`."""
    ns = namespace.encode("utf-8")
    return xxhash.xxh3_128_digest(_U64.pack(len(ns)) + ns + key)


def _u64(raw: bytes | memoryview | None) -> int:
    """A stored u64; 0 when absent or damaged (the callers treat 0 as 'unknown')."""
    return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0


def _f64(raw: bytes | memoryview | None) -> float:
    """A stored f64; 0.0 when absent or damaged."""
    value = _F64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0.0
    return value if math.isfinite(value) else 0.0


def _meta(eid: bytes, raw: bytes | memoryview) -> tuple[str, bytes, int, int, float, int] | None:
    """An M record as (namespace, key, size, created, priority, generation), or None
    if it is damaged (does not parse, has wrong types, or does not belong to `eid`).
    A four-field record (written before priorities) gets the default priority and
    its creation time as generation."""
    try:
        fields = msgpack.unpackb(raw, raw=False)
        namespace, key, size, created = fields[:4]
        priority, generation = fields[4:] if len(fields) == 6 else (len(key) // 4, created) if len(fields) == 4 else ()
    except Exception:
        return None
    if not (
        isinstance(namespace, str) and isinstance(key, bytes) and key and len(key) % 4 == 0
        and isinstance(size, int) and size > 0 and isinstance(created, int)
        and isinstance(priority, (int, float)) and not isinstance(priority, bool)
        and math.isfinite(priority) and priority >= 0
        and isinstance(generation, int) and not isinstance(generation, bool)
        and entry_id(namespace, key) == eid
    ):  # fmt: skip
        return None
    return namespace, key, size, created, float(priority), generation


def _pack_values(value: float, pinned: bool, superseded: bool) -> bytes:
    return msgpack.packb([value, pinned, superseded])


def _values(raw: bytes | memoryview | None) -> tuple[float, bool, bool] | None:
    """A V record as (value, pinned, superseded), or None if absent or damaged."""
    if raw is None:
        return None
    try:
        value, pinned, superseded = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    if not (isinstance(value, float) and math.isfinite(value) and isinstance(pinned, bool)
            and isinstance(superseded, bool)):  # fmt: skip
        return None
    return value, pinned, superseded


def _record(raw: bytes | memoryview) -> list[Any] | None:
    """A log record, or None if it is damaged."""
    try:
        record = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    valid = isinstance(record, list) and record and (
        (record[0] in ("p", "d", "v") and len(record) == 2 and isinstance(record[1], bytes))
        or (record[0] == "t" and len(record) == 2 and isinstance(record[1], list)
            and all(isinstance(t, list) and len(t) in (2, 3) and isinstance(t[0], bytes) and isinstance(t[1], int)
                    and (len(t) == 2 or isinstance(t[2], float)) for t in record[1]))
        or record == ["c"]
    )  # fmt: skip
    return record if valid else None


_open_backends: weakref.WeakSet[KVBackend] = weakref.WeakSet()

#: A change made in a write transaction: it writes to the map, appends its log
#: records, and appends the in-memory updates to run once the transaction commits.
Change = Callable[[KVTxn, list[list[Any]], list[Callable[[], None]]], None]


# Module-level locks taken inside backend operations: (get the lock, replace it in a child).
_inner_locks: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []


def fork_safe_lock(get: Callable[[], Any], replace: Callable[[Any], None]) -> None:
    """Register a module-level lock that backend operations take (after their own
    lock): it is held across fork, like the backend locks, and renewed in the child."""
    _inner_locks.append((get, replace))


def _before_fork() -> None:
    """Fork only between operations: no backend may be inside a transaction
    (an SQLite or LMDB lock copied mid-transaction wedges the child). Locks are
    taken in the order operations take them: backends first, then inner locks."""
    for backend in sorted(_open_backends, key=id):
        backend._lock.acquire()
    for get, _ in _inner_locks:
        get().acquire()


def _after_fork_in_parent() -> None:
    for get, _ in reversed(_inner_locks):
        get().release()
    for backend in sorted(_open_backends, key=id):
        backend._lock.release()


def _after_fork_in_child() -> None:
    """Give the child fresh locks, and rebuild each index from the store on its next use."""
    for _, replace in _inner_locks:
        replace(threading.Lock())
    for backend in list(_open_backends):
        backend._lock = threading.RLock()
        backend._seq = -1


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


class KVBackend(BaseBackend):
    """A complete `CacheBackend` on top of a transactional byte map.

    Subclasses implement `_transaction` and `_reader` (and `_close_store`);
    everything else is here. All in-memory state is guarded by one lock, so an
    instance may be shared by threads.
    """

    def __init__(self, *, max_bytes: int | None, max_entries: int | None, location: str) -> None:
        super().__init__()
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.location = location
        self._lock = threading.RLock()
        self._catalog = Catalog()
        self._seq = -1  # newest log record applied; -1 forces a rebuild
        self._uses = PendingUses()
        self._damaged: set[bytes] = set()  # ids whose M record is damaged: removed on the next write
        self._counters = dict(hits=0, misses=0, stores=0, evictions=0, refused=0, stale=0)
        _open_backends.add(self)

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
    def _close_store(self) -> None: ...

    # -- BaseBackend hooks -------------------------------------------------------

    def _store(self, key: bytes, blob: memoryview, namespace: str, options: StoreOptions) -> bool:
        size = blob.nbytes + len(key)
        eid = entry_id(namespace, key)
        plans: list[StorePlan] = []

        def put(txn: KVTxn, records: list[list[Any]], after: list[Callable[[], None]]) -> None:
            catalog = self._catalog
            plan = catalog.plan_store(
                eid, key, namespace, size, options, self._uses.now(), max_bytes=self.max_bytes, max_entries=self.max_entries
            )
            plans[:] = [plan]  # a retried transaction plans again
            state = plan.state
            if state is None:
                return
            for victim in plan.victims:
                self._remove_entry(txn, records, after, victim, evicted=True)
            if plan.clock != catalog.clock:
                txn.put(b"G", _F64.pack(plan.clock))
            if plan.superseded is not None:
                self._write_values(txn, records, after, plan.superseded, superseded=True)
            txn.put(b"B" + eid, blob)
            txn.put(b"M" + eid, msgpack.packb([namespace, key, size, state.created, state.priority, state.generation]))
            txn.put(b"U" + eid, _U64.pack(state.used))
            txn.put(b"V" + eid, _pack_values(state.value, state.pinned, False))
            records.append(["p", eid])
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
                self._sync(txn)
                index = self._catalog.index
                hit = index.longest_common(namespace, key) if partial else index.longest_prefix(namespace, key)
                blob = txn.get(b"B" + hit.entry_id) if hit is not None else None
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
                end = None  # type: ignore[assignment]
            if touch:
                self._uses.record(self._catalog, hit.entry_id)
            self._counters["hits"] += 1
            stored_key = index.key_of(hit.entry_id)
            self._flush_touches_if_due()
        return Match(hit.length, stored_key, blob, namespace, end)

    def _peek(self, key: bytes, namespace: str, partial: bool) -> Peek | None:
        with self._lock:
            self._refresh()
            return self._catalog.peek(namespace, key, partial)

    def _touch_entry(self, key: bytes, namespace: str) -> bool:
        eid = entry_id(namespace, key)
        with self._lock:
            self._refresh()
            found = eid in self._catalog
            if found:
                self._uses.record(self._catalog, eid)
                self._flush_touches_if_due()
            return found

    def _delete(self, key: bytes, namespace: str) -> bool:
        eid = entry_id(namespace, key)
        found = []

        def remove(txn: KVTxn, records: list[list[Any]], after: list[Callable[[], None]]) -> None:
            found.clear()  # a retried transaction starts over
            if txn.get(b"M" + eid) is not None:
                self._remove_entry(txn, records, after, eid)
                found.append(eid)

        self._write(remove)
        return bool(found)

    def _set_pinned(self, key: bytes, namespace: str, pinned: bool) -> bool:
        eid = entry_id(namespace, key)
        outcome: list[str] = []

        def change(txn: KVTxn, records: list[list[Any]], after: list[Callable[[], None]]) -> None:
            outcome.clear()  # a retried transaction starts over
            state = self._catalog.get(eid)
            if state is None:
                return
            if state.pinned != pinned:
                if pinned and not self._catalog.pins_fit(state.size, self.max_bytes, self.max_entries):
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
        def clear(txn: KVTxn, records: list[list[Any]], after: list[Callable[[], None]]) -> None:
            for key, _ in list(txn.scan(b"M")):
                eid = key[1:]
                for prefix in _ENTRY_RECORDS:
                    txn.delete(prefix + eid)
            txn.delete(b"G")
            records.append(["c"])
            after.append(self._catalog.clear)

        self._write(clear)

    def _stats(self) -> Stats:
        with self._lock:
            self._refresh()
            return self._catalog.stats(
                backend=type(self).__name__, location=self.location, max_bytes=self.max_bytes,
                max_entries=self.max_entries, damaged=len(self._damaged), **self._counters,
            )

    def _entries(self, namespace: str | None) -> list[EntryInfo]:
        with self._lock:
            self._refresh()
            catalog = self._catalog
            found = []
            for eid in catalog.by_use(namespace):  # least recently used first
                state = catalog.get(eid)
                assert state is not None
                found.append(
                    EntryInfo(
                        state.namespace, _tokens.decode(catalog.index.key_of(eid)), state.size,
                        state.created / 1e9, state.used / 1e9, state.priority, state.pinned, state.generation,
                    )  # fmt: skip
                )
            return found

    def purge_damaged(self) -> int:
        """Remove entries whose index record is unreadable now, rather than on the next write."""
        with self._lock:
            self._refresh()
            count = len(self._damaged)
            if count:
                self._write(lambda txn, records, after: None)
            return count

    def _len(self) -> int:
        with self._lock:
            self._refresh()
            return len(self._catalog)

    def _close(self) -> None:
        with self._lock:
            try:
                if self._uses.items:
                    self._write(lambda txn, records, after: None)
            except Exception as exc:  # closing must not fail over lost recency data
                log.warning("sippcache: could not save recency updates on close: %s", exc)
            self._close_store()

    # -- writing -----------------------------------------------------------------

    def _write(self, change: Change) -> None:
        """Run `change` in a write transaction together with pending touches and its
        log records, then apply its in-memory updates. On `CacheFull` (the store
        itself has no room), retry once (the backend may have made room: LMDB grows
        its map), then evict down to half the stored bytes and retry a last time."""
        with self._lock:
            try:
                self._write_once(change)
            except CacheFull:
                try:
                    self._write_once(change)
                except CacheFull:
                    if not self._catalog.total:
                        raise
                    log.warning("sippcache: %s is full; evicting down to half its stored bytes", self.location)
                    self._write_once(self._evict_to_half)
                    self._write_once(change)

    def _write_once(self, change: Change) -> None:
        records: list[list[Any]] = []
        after: list[Callable[[], None]] = []
        with self._transaction() as txn:
            self._sync(txn)
            if self._uses.items:
                touched = []
                for eid, (used, value) in self._uses.items.items():
                    state = self._catalog.get(eid)
                    if state is not None and txn.get(b"M" + eid) is not None:
                        txn.put(b"U" + eid, _U64.pack(used))
                        txn.put(b"V" + eid, _pack_values(value, state.pinned, False))
                        touched.append([eid, used, value])
                if touched:
                    records.append(["t", touched])
            for eid in self._damaged:
                self._remove_entry(txn, records, after, eid)
            change(txn, records, after)
            seq = self._seq
            for record in records:
                seq += 1
                txn.put(b"L" + _SEQ_KEY.pack(seq), msgpack.packb(record, use_bin_type=True))
            if records:
                txn.put(b"S", _U64.pack(seq))
                self._trim_log(txn, seq)
        # Committed: bring memory to the state after our records (touches are in memory already).
        self._uses.items.clear()
        self._damaged.clear()
        self._seq = seq
        for update in after:
            update()

    def _trim_log(self, txn: KVTxn, seq: int) -> None:
        trimmed = _u64(txn.get(b"T"))
        if seq - trimmed > 2 * LOG_KEEP:
            for old in range(trimmed + 1, seq - LOG_KEEP + 1):
                txn.delete(b"L" + _SEQ_KEY.pack(old))
            txn.put(b"T", _U64.pack(seq - LOG_KEEP))

    def _evict_to_half(self, txn: KVTxn, records: list[list[Any]], after: list[Callable[[], None]]) -> None:
        """Evict (by the eviction order, never pinned entries) down to half the stored bytes."""
        for victim in self._catalog.victims(max_bytes=self._catalog.total // 2, max_entries=None) or ():
            self._remove_entry(txn, records, after, victim, evicted=True)

    def _remove_entry(
        self, txn: KVTxn, records: list[list[Any]], after: list[Callable[[], None]], eid: bytes, *, evicted: bool = False
    ) -> None:
        for prefix in _ENTRY_RECORDS:
            txn.delete(prefix + eid)
        records.append(["d", eid])
        after.append(lambda: self._forget(eid, evicted))

    def _forget(self, eid: bytes, evicted: bool) -> None:
        if self._catalog.remove(eid, evicted=evicted) is not None and evicted:
            self._counters["evictions"] += 1
        self._uses.items.pop(eid, None)

    def _write_values(
        self, txn: KVTxn, records: list[list[Any]], after: list[Callable[[], None]], eid: bytes,
        *, pinned: bool | None = None, superseded: bool | None = None,
    ) -> None:  # fmt: skip
        """Change an entry's pinned or superseded flag (its V record)."""
        state = self._catalog.get(eid)
        assert state is not None
        values = dict(
            value=state.value,
            pinned=state.pinned if pinned is None else pinned,
            superseded=state.superseded if superseded is None else superseded,
        )
        txn.put(b"V" + eid, _pack_values(**values))
        records.append(["v", eid])
        after.append(lambda: self._catalog.update(eid, **values))

    # -- reading the store ---------------------------------------------------------

    def _refresh(self) -> None:
        txn, end = self._reader()
        try:
            self._sync(txn)
        finally:
            end()

    def _sync(self, txn: KVTxn) -> None:
        """Bring memory up to the store's newest log record."""
        seq = _u64(txn.get(b"S"))
        if seq == self._seq:
            return
        if self._seq < _u64(txn.get(b"T")) or self._seq > seq:
            self._rebuild(txn, seq)
            return
        for number in range(self._seq + 1, seq + 1):
            raw = txn.get(b"L" + _SEQ_KEY.pack(number))
            record = _record(raw) if raw is not None else None
            if record is None:  # trimmed while we read, or damaged: start from the entries
                self._rebuild(txn, seq)
                return
            self._apply(txn, record)
        self._catalog.clock = _f64(txn.get(b"G"))
        self._seq = seq

    def _rebuild(self, txn: KVTxn, seq: int) -> None:
        self._catalog.clear()
        self._uses.items.clear()
        found = []
        for key, raw in txn.scan(b"M"):
            eid = bytes(key[1:])
            loaded = self._load(txn, eid, raw)
            if loaded is not None:
                found.append((loaded[1].used, eid, loaded))
        if self._damaged:
            log.warning("sippcache: %s has %d damaged entries; they are removed on the next write",
                        self.location, len(self._damaged))  # fmt: skip
        for _, eid, (key, state) in sorted(found):
            self._catalog.put(eid, key, state)
        self._catalog.clock = _f64(txn.get(b"G"))
        self._seq = seq

    def _load(
        self, txn: KVTxn, eid: bytes, raw: bytes | memoryview | None = None
    ) -> tuple[bytes, EntryState] | None:
        """An entry's key and state from its M, U and V records; None if it is gone
        or its M record is damaged (then it is marked for removal)."""
        raw = txn.get(b"M" + eid) if raw is None else raw
        if raw is None:
            return None
        meta = _meta(eid, raw)
        if meta is None:
            self._damaged.add(eid)
            return None
        namespace, key, size, created, priority, generation = meta
        tokens = len(key) // 4
        used = _u64(txn.get(b"U" + eid)) or created
        values = _values(txn.get(b"V" + eid))
        value, pinned, superseded = values if values is not None else (priority / tokens, False, False)
        return key, EntryState(namespace, tokens, size, priority, generation, created, used, value, pinned, superseded)

    def _apply(self, txn: KVTxn, record: list[Any]) -> None:
        op = record[0]
        if op == "p":
            loaded = self._load(txn, record[1])  # None: deleted by a later record, or damaged
            if loaded is not None:
                self._catalog.put(record[1], *loaded)
        elif op == "d":
            self._catalog.remove(record[1])
            self._uses.items.pop(record[1], None)
        elif op == "t":
            for eid, used, *value in record[1]:
                self._catalog.use(eid, used, value[0] if value else None)
        elif op == "v":
            values = _values(txn.get(b"V" + record[1]))
            if values is not None:
                value, pinned, superseded = values
                self._catalog.update(record[1], value=value, pinned=pinned, superseded=superseded)
        elif op == "c":
            self._catalog.clear()
            self._uses.items.clear()

    # -- recency -------------------------------------------------------------------

    def _flush_touches_if_due(self) -> None:
        if self._uses.due():
            try:
                self._write(lambda txn, records, after: None)
            except Exception as exc:  # recency is advisory: never fail a lookup over it
                log.warning("sippcache: could not save recency updates: %s", exc)

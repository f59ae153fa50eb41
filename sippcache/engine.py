"""The cache logic shared by every built-in backend, over a transactional key-value store.

A backend only supplies transactions on a byte-keyed map (`KVTxn`); this
module does the rest once: the prefix index, LRU eviction within `max_bytes`
and `max_entries`, and keeping several processes that share one store in step.

Layout of the map (ids are xxh3_128 of namespace + key, so LMDB's 511-byte key
limit never matters)::

    B<id>   the blob
    M<id>   msgpack [namespace, key bytes, size, created_ns]
    U<id>   u64 last-use time (ns), updated in batches
    L<seq>  the change log: msgpack [op, ...] with op p(ut) / d(elete) / t(ouch) / c(lear)
    S       u64 sequence number of the newest log record
    T       u64 log records at or below this number were trimmed

Every process rebuilds its in-memory index from the M records when it opens
the store, then replays the log records newer than the last one it saw before
each operation: a lookup costs one small read when nothing changed, and another
process's store is visible at once without reopening.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import threading
import time
import weakref
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol, Union

import msgpack
import xxhash

from . import tokens as _tokens
from .errors import CacheFull, CorruptStore
from .index import PrefixIndex
from .protocol import BaseBackend, EntryInfo, Match, Stats

log = logging.getLogger("sippcache")

_U64 = struct.Struct("<Q")
_SEQ_KEY = struct.Struct(">Q")  # big-endian so log keys sort by number
#: Log records kept for processes that fall behind; further behind means a rebuild.
LOG_KEEP = 10_000
#: Pending recency updates are written once this many accumulate or this much time passes.
TOUCH_BATCH = 256
TOUCH_SECONDS = 1.0


class KVTxn(Protocol):
    """A transaction on the backing byte map; reads see one consistent state."""

    def get(self, key: bytes) -> Optional[Union[bytes, memoryview]]: ...

    def put(self, key: bytes, value: Union[bytes, memoryview]) -> None: ...

    def delete(self, key: bytes) -> None: ...

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, Union[bytes, memoryview]]]:
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


def _u64(raw: Optional[Union[bytes, memoryview]]) -> int:
    """A stored u64; 0 when absent or damaged (the callers treat 0 as 'unknown')."""
    return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0


def _meta(eid: bytes, raw: Union[bytes, memoryview]) -> Optional[tuple[str, bytes, int, int]]:
    """An M record as (namespace, key, size, created), or None if it is damaged
    (does not parse, has wrong types, or does not belong to `eid`)."""
    try:
        namespace, key, size, created = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    if not (
        isinstance(namespace, str) and isinstance(key, bytes) and key and len(key) % 4 == 0
        and isinstance(size, int) and size > 0 and isinstance(created, int)
        and entry_id(namespace, key) == eid
    ):  # fmt: skip
        return None
    return namespace, key, size, created


def _record(raw: Union[bytes, memoryview]) -> Optional[list[Any]]:
    """A log record, or None if it is damaged."""
    try:
        record = msgpack.unpackb(raw, raw=False)
    except Exception:
        return None
    valid = isinstance(record, list) and record and (
        (record[0] in ("p", "d") and len(record) == 2 and isinstance(record[1], bytes))
        or (record[0] == "t" and len(record) == 2 and isinstance(record[1], list)
            and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], bytes) and isinstance(t[1], int)
                    for t in record[1]))
        or record == ["c"]
    )  # fmt: skip
    return record if valid else None


_open_backends: weakref.WeakSet[KVBackend] = weakref.WeakSet()


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

    def __init__(self, *, max_bytes: Optional[int], max_entries: Optional[int], location: str) -> None:
        super().__init__()
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_entries is not None and max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.location = location
        self._lock = threading.RLock()
        self._index = PrefixIndex()
        self._sizes: dict[bytes, int] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._total = 0
        self._seq = -1  # newest log record applied; -1 forces a rebuild
        self._pending: dict[bytes, int] = {}  # id -> use time not yet written
        self._damaged: set[bytes] = set()  # ids whose M record is damaged: removed on the next write
        self._pending_since = 0.0
        self._last_time = 0
        self._counters = dict(hits=0, misses=0, stores=0, evictions=0, refused=0)
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

    def _store(self, key: bytes, blob: memoryview, namespace: str) -> None:
        size = blob.nbytes + len(key)
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning(
                "sippcache: not storing a %d-byte entry (%d tokens): larger than max_bytes=%d of %s",
                size, len(key) // 4, self.max_bytes, self.location,
            )  # fmt: skip
            self._counters["refused"] += 1
            return
        eid = entry_id(namespace, key)

        def put(txn: KVTxn, records: list[list[Any]]) -> None:
            max_bytes, max_entries = self.max_bytes, self.max_entries
            self._evict(
                txn,
                records,
                max_bytes=None if max_bytes is None else max_bytes - size,
                max_entries=None if max_entries is None else max_entries - 1,
                keep=eid,
            )
            txn.put(b"B" + eid, blob)
            txn.put(b"M" + eid, msgpack.packb([namespace, key, size, now], use_bin_type=True))
            txn.put(b"U" + eid, _U64.pack(now))
            records.append(["p", eid])

        with self._lock:
            now = self._now()
            self._write(put, applied=lambda: self._apply_put(eid, namespace, key, size, now))
            self._counters["stores"] += 1

    def _lookup(self, key: bytes, namespace: str, partial: bool, touch: bool) -> Optional[Match]:
        with self._lock:
            txn, end = self._reader()
            try:
                self._sync(txn)
                find = self._index.longest_common if partial else self._index.longest_prefix
                hit = find(namespace, key)
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
                self._touch(hit.entry_id)
            self._counters["hits"] += 1
            stored_key = self._index.key_of(hit.entry_id)
            self._flush_touches_if_due()
        return Match(hit.length, stored_key, blob, namespace, end)

    def _delete(self, key: bytes, namespace: str) -> bool:
        eid = entry_id(namespace, key)
        found = []

        def remove(txn: KVTxn, records: list[list[Any]]) -> None:
            if txn.get(b"M" + eid) is not None:
                self._remove_entry(txn, records, eid)
                found.append(eid)

        self._write(remove)
        return bool(found)

    def _clear(self) -> None:
        def clear(txn: KVTxn, records: list[list[Any]]) -> None:
            for key, _ in list(txn.scan(b"M")):
                eid = key[1:]
                for prefix in (b"B", b"M", b"U"):
                    txn.delete(prefix + eid)
            records.append(["c"])

        self._write(clear)

    def _stats(self) -> Stats:
        with self._lock:
            self._refresh()
            return Stats(
                backend=type(self).__name__,
                location=self.location,
                entries=len(self._index),
                bytes=self._total,
                max_bytes=self.max_bytes,
                max_entries=self.max_entries,
                namespaces=len(self._index.namespaces()),
                damaged=len(self._damaged),
                **self._counters,
            )

    def _entries(self, namespace: Optional[str]) -> list[EntryInfo]:
        with self._lock:
            txn, end = self._reader()
            try:
                self._sync(txn)
                found = []
                for eid in self._lru:  # least recently used first
                    if namespace is not None and self._index.namespace_of(eid) != namespace:
                        continue
                    raw = txn.get(b"M" + eid)
                    meta = _meta(eid, raw) if raw is not None else None
                    if meta is None:
                        continue
                    ns, key, size, created = meta
                    used = max(self._pending.get(eid, 0), _u64(txn.get(b"U" + eid)) or created)
                    found.append(EntryInfo(ns, _tokens.decode(key), size, created / 1e9, used / 1e9))
                return found
            finally:
                end()

    def purge_damaged(self) -> int:
        """Remove entries whose index record is unreadable now, rather than on the next write."""
        with self._lock:
            self._refresh()
            count = len(self._damaged)
            if count:
                self._write(lambda txn, records: None)
            return count

    def _len(self) -> int:
        with self._lock:
            self._refresh()
            return len(self._index)

    def _close(self) -> None:
        with self._lock:
            try:
                if self._pending:
                    self._write(lambda txn, records: None)
            except Exception as exc:  # closing must not fail over lost recency data
                log.warning("sippcache: could not save recency updates on close: %s", exc)
            self._close_store()

    # -- writing -----------------------------------------------------------------

    def _write(
        self, change: Callable[[KVTxn, list[list[Any]]], None], applied: Optional[Callable[[], None]] = None
    ) -> None:
        """Run `change` in a write transaction together with pending touches and its
        log records; then `applied` updates memory. On `CacheFull` (the store itself
        has no room), retry once (the backend may have made room: LMDB grows its
        map), then evict down to half the stored bytes and retry a last time."""
        with self._lock:
            try:
                self._write_once(change)
            except CacheFull:
                try:
                    self._write_once(change)
                except CacheFull:
                    if not self._total:
                        raise
                    log.warning("sippcache: %s is full; evicting down to half its stored bytes", self.location)
                    half = self._total // 2
                    self._write_once(lambda txn, records: self._evict(txn, records, max_bytes=half, max_entries=None))
                    self._write_once(change)
            if applied is not None:
                applied()

    def _write_once(self, change: Callable[[KVTxn, list[list[Any]]], None]) -> None:
        records: list[list[Any]] = []
        with self._transaction() as txn:
            self._sync(txn)
            if self._pending:
                for eid, used in self._pending.items():
                    if txn.get(b"M" + eid) is not None:
                        txn.put(b"U" + eid, _U64.pack(used))
                records.append(["t", list(self._pending.items())])
            for eid in self._damaged:
                self._remove_entry(txn, records, eid)
            change(txn, records)
            seq = self._seq
            for record in records:
                seq += 1
                txn.put(b"L" + _SEQ_KEY.pack(seq), msgpack.packb(record, use_bin_type=True))
            if records:
                txn.put(b"S", _U64.pack(seq))
                self._trim_log(txn, seq)
        # Committed: bring memory to the state after our records. Puts are applied
        # by the caller, which has their data; touches are in memory already.
        self._pending.clear()
        self._damaged.clear()
        self._seq = seq
        for record in records:
            if record[0] == "d":
                self._apply_delete(record[1])
            elif record[0] == "c":
                self._apply_clear()

    def _trim_log(self, txn: KVTxn, seq: int) -> None:
        trimmed = _u64(txn.get(b"T"))
        if seq - trimmed > 2 * LOG_KEEP:
            for old in range(trimmed + 1, seq - LOG_KEEP + 1):
                txn.delete(b"L" + _SEQ_KEY.pack(old))
            txn.put(b"T", _U64.pack(seq - LOG_KEEP))

    def _evict(
        self,
        txn: KVTxn,
        records: list[list[Any]],
        *,
        max_bytes: Optional[int],
        max_entries: Optional[int],
        keep: bytes = b"",
    ) -> None:
        """Evict least recently used entries (never `keep`, which is about to be
        replaced) until the others hold at most `max_bytes` and `max_entries`.
        Memory is updated after commit."""
        total = self._total - self._sizes.get(keep, 0)
        count = len(self._sizes) - (keep in self._sizes)
        victims = (eid for eid in self._lru if eid != keep)  # _lru changes only after commit
        while (max_bytes is not None and total > max_bytes) or (max_entries is not None and count > max_entries):
            victim = next(victims, None)
            if victim is None:
                break
            total -= self._sizes[victim]
            count -= 1
            self._remove_entry(txn, records, victim)
            self._counters["evictions"] += 1

    def _remove_entry(self, txn: KVTxn, records: list[list[Any]], eid: bytes) -> None:
        for prefix in (b"B", b"M", b"U"):
            txn.delete(prefix + eid)
        records.append(["d", eid])

    # -- reading the log ---------------------------------------------------------

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
        self._seq = seq

    def _rebuild(self, txn: KVTxn, seq: int) -> None:
        self._apply_clear()
        found = []
        for key, raw in txn.scan(b"M"):
            eid = bytes(key[1:])
            meta = _meta(eid, raw)
            if meta is None:
                self._damaged.add(eid)
                continue
            namespace, tokens, size, created = meta
            found.append((_u64(txn.get(b"U" + eid)) or created, eid, namespace, tokens, size))
        if self._damaged:
            log.warning("sippcache: %s has %d damaged entries; they are removed on the next write",
                        self.location, len(self._damaged))  # fmt: skip
        for used, eid, namespace, tokens, size in sorted(found):
            self._apply_put(eid, namespace, tokens, size, used)
        self._seq = seq

    def _apply(self, txn: KVTxn, record: list[Any]) -> None:
        op = record[0]
        if op == "p":
            eid = record[1]
            raw = txn.get(b"M" + eid)
            meta = _meta(eid, raw) if raw is not None else None  # None: deleted by a later record
            if meta is not None:
                namespace, tokens, size, created = meta
                self._apply_put(eid, namespace, tokens, size, _u64(txn.get(b"U" + eid)) or created)
            elif raw is not None:
                self._damaged.add(eid)
        elif op == "d":
            self._apply_delete(record[1])
        elif op == "t":
            for eid, used in record[1]:
                if eid in self._sizes:
                    self._lru.move_to_end(eid)
                    self._index.touch(eid, used)
        elif op == "c":
            self._apply_clear()

    def _apply_put(self, eid: bytes, namespace: str, key: bytes, size: int, used: int) -> None:
        self._total += size - self._sizes.get(eid, 0)
        self._sizes[eid] = size
        self._lru[eid] = None
        self._lru.move_to_end(eid)
        self._index.insert(namespace, key, eid, used)

    def _apply_delete(self, eid: bytes) -> None:
        size = self._sizes.pop(eid, None)
        if size is not None:
            self._total -= size
            del self._lru[eid]
            self._index.remove(eid)
            self._pending.pop(eid, None)

    def _apply_clear(self) -> None:
        self._index.clear()
        self._sizes.clear()
        self._lru.clear()
        self._pending.clear()
        self._total = 0

    # -- recency -------------------------------------------------------------------

    def _now(self) -> int:
        self._last_time = max(time.time_ns(), self._last_time + 1)
        return self._last_time

    def _touch(self, eid: bytes) -> None:
        used = self._now()
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending[eid] = used
        self._lru.move_to_end(eid)
        self._index.touch(eid, used)

    def _flush_touches_if_due(self) -> None:
        if self._pending and (
            len(self._pending) >= TOUCH_BATCH or time.monotonic() - self._pending_since >= TOUCH_SECONDS
        ):
            try:
                self._write(lambda txn, records: None)
            except Exception as exc:  # recency is advisory: never fail a lookup over it
                log.warning("sippcache: could not save recency updates: %s", exc)


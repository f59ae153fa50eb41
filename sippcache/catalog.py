"""What a store holds, kept in memory: the prefix index and the eviction order.

Backends that index their entries themselves (the KV engine, the Redis
plugin) mirror their store here and ask it two questions: which entry answers
a lookup (`index`), and which entries make room for a new one (`victims`). So
every such backend evicts by one policy:

1. Pinned entries are never evicted.
2. Superseded entries go first. An entry is superseded when a newer entry is
   stored that shares at least half of its tokens and goes on past them: the
   next turn of a conversation supersedes the turn before, one user's question
   after a shared document supersedes the previous user's. A use of the entry
   clears the mark.
3. Then GreedyDual-Size (Cao and Irani, 1997). An entry's retention value is
   the store's clock at its last use plus its priority per token; the lowest
   value goes first, least recently used among equals, and evicting an entry
   moves the clock up to its value. With the default priority (the token count:
   recomputing a prefix costs in proportion to its length, and so does storing
   it) every entry has the same priority per token and the order is exactly
   least recently used; a higher priority keeps an entry longer, and the clock
   makes sure that an entry nobody uses any more still goes in the end.

Replaying the Mooncake trace (benchmarks/trace.py) this reuses 15.8%, 21.5% and
22.5% more prompt tokens than plain LRU at budgets of 1M, 3M and 10M tokens;
ordering strictly by token count, oldest last, reuses less than half as many.
"""

from __future__ import annotations

import gc
import heapq
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from itertools import compress, repeat
from operator import attrgetter
from typing import Any

import msgpack  # type: ignore[import-untyped]  # msgpack ships no type information
import xxhash

from . import tokens as _tokens
from .errors import CacheFull
from .index import PrefixIndex
from .protocol import Blob, EntryInfo, Peek, Stats, StoreOptions

log = logging.getLogger("sippcache")

_TOKEN = 4  # bytes per token in index keys
#: Starts every `Catalog.snapshot`; a new layout gets a new one, and older snapshots are ignored.
SNAPSHOT_MAGIC = b"sippcache-catalog-1\n"
_DIGEST = 16  # xxh3_128 of the snapshot's body


@dataclass(slots=True)
class EntryState:
    """One entry's size and retention state (its key lives in the index)."""

    namespace: str
    tokens: int
    size: int  # bytes counted against max_bytes
    priority: float
    generation: int
    created: int  # ns since the epoch
    used: int  # ns since the epoch
    value: float  # GreedyDual retention value
    pinned: bool = False
    superseded: bool = False

    def order(self) -> tuple[bool, float, int]:
        """Eviction order: lowest first."""
        return (not self.superseded, self.value, self.used)


#: The `EntryState` fields a snapshot keeps, in constructor order: all but the
#: namespace, which the index knows.
_COLUMNS = tuple(f.name for f in fields(EntryState))[1:]


@dataclass
class StorePlan:
    """What storing an entry takes, decided by `Catalog.plan_store`.

    `state` is the new entry's state, or None if it is not stored: `reason` then
    says why ("stale": the stored entry has a newer generation; otherwise it does
    not fit). To carry it out: delete `victims` (evictions), set the clock to
    `clock`, mark `superseded` (if any) superseded, and write the entry.
    """

    state: EntryState | None
    reason: str = ""
    victims: list[bytes] = field(default_factory=list)
    clock: float = 0.0
    superseded: bytes | None = None


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection inside: building a catalog of many entries
    allocates objects faster than the collector's thresholds assume, and its
    full passes over the growing heap would cost more than the build itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Catalog:
    """Entries of one store: index, sizes, pins, and the eviction order.

    Ids are opaque bytes chosen by the backend. Nothing here touches storage:
    the backend persists a change and then applies it here.
    """

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.clock = 0.0
        self._entries: dict[bytes, EntryState] = {}
        #: The eviction order: (*order, id) items, some stale; None until first needed
        #: after a snapshot load (most processes that open a store never evict).
        self._heap: list[tuple[bool, float, int, bytes]] | None = []
        self.total = 0
        self.pinned_bytes = 0
        self.pinned_count = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, eid: bytes) -> bool:
        return eid in self._entries

    def get(self, eid: bytes) -> EntryState | None:
        return self._entries.get(eid)

    def ids(self) -> Iterator[bytes]:
        return iter(self._entries)

    def by_use(self, namespace: str | None = None) -> list[bytes]:
        """Ids, least recently used first (of one namespace, if given)."""
        chosen = [(e.used, eid) for eid, e in self._entries.items() if namespace is None or e.namespace == namespace]
        return [eid for _, eid in sorted(chosen)]

    def value(self, priority: float, tokens: int) -> float:
        """The retention value of an entry used now."""
        return self.clock + priority / max(tokens, 1)

    # -- changes (already persisted by the backend) ---------------------------------

    def put(self, eid: bytes, key: bytes, entry: EntryState) -> None:
        """Add `entry` under `key` (token bytes), replacing one with the same id."""
        self.remove(eid)
        self._entries[eid] = entry
        self.total += entry.size
        if entry.pinned:
            self.pinned_bytes += entry.size
            self.pinned_count += 1
        self.index.insert(entry.namespace, key, eid, entry.used)
        self._push(eid, entry)

    def remove(self, eid: bytes, *, evicted: bool = False) -> EntryState | None:
        """Forget `eid`; an eviction (of an entry not superseded) moves the clock up to its value."""
        entry = self._entries.pop(eid, None)
        if entry is None:
            return None
        self.total -= entry.size
        if entry.pinned:
            self.pinned_bytes -= entry.size
            self.pinned_count -= 1
        self.index.remove(eid)
        if evicted and not entry.superseded:
            self.clock = max(self.clock, entry.value)
        return entry

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self, position: int) -> bytes:
        """The whole catalog as bytes that `from_snapshot` loads much faster than
        putting every entry again (no key is inserted into the index one by one).
        `position` is the backend's: what the snapshot reflects (a log sequence
        number). Checksummed, so damage makes `from_snapshot` refuse it."""
        trees = self.index.dump()
        states = [self._entries[eid] for tree in trees for eid in compress(tree[3], tree[3])]  # in the dump's order
        columns = [list(map(attrgetter(name), states)) for name in _COLUMNS]
        body: bytes = msgpack.packb([position, self.clock, trees, columns])
        return SNAPSHOT_MAGIC + xxhash.xxh3_128_digest(body) + body

    @classmethod
    def from_snapshot(cls, raw: Blob) -> tuple[Catalog, int] | None:
        """The catalog a `snapshot` holds and its position; None if `raw` is not an
        intact snapshot of this layout (damaged, cut short, another version)."""
        start = len(SNAPSHOT_MAGIC)
        if bytes(raw[:start]) != SNAPSHOT_MAGIC or len(raw) < start + _DIGEST:
            return None
        body = memoryview(raw)[start + _DIGEST :]
        if xxhash.xxh3_128_digest(body) != bytes(raw[start : start + _DIGEST]):
            return None
        catalog = cls()
        with paused_gc():
            try:
                position, clock, trees, columns = msgpack.unpackb(body, raw=False)
                catalog._load(float(clock), trees, columns)
            except (ValueError, TypeError, IndexError, StopIteration, msgpack.UnpackException):
                return None
        if type(position) is not int:
            return None
        return catalog, position

    def _load(self, clock: float, trees: list[list[Any]], columns: list[list[Any]]) -> None:
        """Fill an empty catalog from a snapshot's parts; raises if they do not fit together."""
        if len(columns) != len(_COLUMNS):
            raise ValueError("not a snapshot of this layout")
        column = dict(zip(_COLUMNS, columns, strict=True))
        self.index.load(trees)
        ids = [eid for tree in trees for eid in compress(tree[3], tree[3])]  # in the dump's order
        namespaces = [name for tree in trees for name in repeat(tree[0], len(tree[3]) - tree[3].count(None))]
        if not all(len(values) == len(ids) for values in columns):
            raise ValueError("snapshot index and entries differ")
        self._entries = dict(zip(ids, map(EntryState, namespaces, *columns), strict=True))
        self.clock = clock
        sizes, pinned = column["size"], column["pinned"]
        self.total = sum(sizes)
        pinned_sizes = list(compress(sizes, pinned))
        self.pinned_bytes, self.pinned_count = sum(pinned_sizes), len(pinned_sizes)
        self._heap = None

    def use(self, eid: bytes, used: int, value: float | None = None) -> None:
        """Record a use at `used` (ns): a new retention value, and no longer superseded."""
        entry = self._entries.get(eid)
        if entry is None:
            return
        entry.used = max(entry.used, used)
        entry.value = self.value(entry.priority, entry.tokens) if value is None else value
        entry.superseded = False
        self.index.touch(eid, entry.used)
        self._push(eid, entry)

    def update(self, eid: bytes, *, value: float, pinned: bool, superseded: bool) -> None:
        """Set an entry's retention state (as read back from the store)."""
        entry = self._entries.get(eid)
        if entry is None:
            return
        if entry.pinned != pinned:
            sign = 1 if pinned else -1
            self.pinned_bytes += sign * entry.size
            self.pinned_count += sign
        entry.value, entry.pinned, entry.superseded = value, pinned, superseded
        self._push(eid, entry)

    # -- questions -------------------------------------------------------------------

    def stats(
        self, *, backend: str, location: str, max_bytes: int | None, max_entries: int | None,
        damaged: int = 0, **counters: int,
    ) -> Stats:  # fmt: skip
        """A backend's `Stats`: the store's sizes from here, its own counters added."""
        return Stats(
            backend=backend, location=location, entries=len(self), bytes=self.total, max_bytes=max_bytes,
            max_entries=max_entries, namespaces=len(self.index.namespaces()), damaged=damaged,
            pinned=self.pinned_count, pinned_bytes=self.pinned_bytes, **counters,
        )  # fmt: skip

    def entries(self, namespace: str | None = None) -> list[EntryInfo]:
        """Every entry (of one namespace, if given) as `EntryInfo`, least recently used first."""
        found = []
        for eid in self.by_use(namespace):
            e = self._entries[eid]
            key = _tokens.decode(self.index.key_of(eid))
            found.append(EntryInfo(e.namespace, key, e.size, e.created / 1e9, e.used / 1e9, e.priority, e.pinned,
                                   e.generation))  # fmt: skip
        return found

    def peek(self, namespace: str, key: bytes, partial: bool) -> Peek | None:
        """The index's answer to a lookup of `key` (token bytes), as `Peek`."""
        hit = self.index.longest_common(namespace, key) if partial else self.index.longest_prefix(namespace, key)
        return None if hit is None else Peek(hit.length, self._entries[hit.entry_id].tokens)

    def plan_store(
        self, eid: bytes, key: bytes, namespace: str, size: int, options: StoreOptions, now: int,
        *, max_bytes: int | None, max_entries: int | None,
    ) -> StorePlan:  # fmt: skip
        """Decide how to store an entry of `size` bytes under `key` (token bytes),
        as of `now` (ns). A store over a pinned entry keeps the pin."""
        tokens = len(key) // _TOKEN
        old = self._entries.get(eid)
        if old is not None and old.generation > options.generation:
            return StorePlan(None, "stale")
        if max_bytes is not None and size > max_bytes:
            return StorePlan(None, "larger than max_bytes")
        pinned = options.pinned or (old is not None and old.pinned)
        victims = self.victims(max_bytes=max_bytes, max_entries=max_entries, size=size, count=1, keep=eid)
        if victims is None or (pinned and not self.pins_fit(size, max_bytes, max_entries, replaced=old)):
            return StorePlan(None, "more than the unpinned room left")
        clock = self.clock
        for victim in victims:
            state = self._entries[victim]
            if not state.superseded:
                clock = max(clock, state.value)
        superseded = self.superseded_by(namespace, key)
        state = EntryState(
            namespace, tokens, size, options.priority, options.generation, now, now,
            clock + options.priority / max(tokens, 1), pinned,
        )  # fmt: skip
        return StorePlan(state, "", victims, clock, None if superseded in victims else superseded)

    def pins_fit(
        self, size: int, max_bytes: int | None, max_entries: int | None, *, replaced: EntryState | None = None
    ) -> bool:
        """Whether pinned entries plus one more of `size` bytes (replacing `replaced`) stay within the budgets."""
        pinned_bytes, pinned_count = self.pinned_bytes, self.pinned_count
        if replaced is not None and replaced.pinned:
            pinned_bytes, pinned_count = pinned_bytes - replaced.size, pinned_count - 1
        return (max_bytes is None or pinned_bytes + size <= max_bytes) and (
            max_entries is None or pinned_count + 1 <= max_entries
        )

    def superseded_by(self, namespace: str, key: bytes) -> bytes | None:
        """The entry that storing `key` supersedes, if any (see the module docstring)."""
        hit = self.index.longest_common(namespace, key)
        if hit is None:
            return None
        entry = self._entries[hit.entry_id]
        shared = hit.length
        if entry.superseded or entry.pinned or shared >= len(key) // _TOKEN or 2 * shared < entry.tokens:
            return None
        return hit.entry_id

    def victims(
        self, *, max_bytes: int | None, max_entries: int | None, size: int = 0, count: int = 0, keep: bytes = b""
    ) -> list[bytes] | None:
        """The entries to evict, in order, so that the rest (without `keep`, which
        is about to be replaced) and `count` new entries of `size` bytes fit the
        budgets; None if they cannot fit even with every unpinned entry gone.
        Changes nothing: evict them, then `remove(..., evicted=True)`."""
        kept = self._entries.get(keep)
        total = self.total - (kept.size if kept else 0) + size
        number = len(self._entries) - (kept is not None) + count

        def over() -> bool:
            return (max_bytes is not None and total > max_bytes) or (max_entries is not None and number > max_entries)

        chosen: list[bytes] = []
        popped: list[tuple[bool, float, int, bytes]] = []
        seen: set[bytes] = set()
        heap = self._order()
        while over() and heap:
            item = heapq.heappop(heap)
            eid = item[3]
            entry = self._entries.get(eid)
            if entry is None or entry.pinned or eid in seen or item[:3] != entry.order():
                continue  # stale (a newer item stands for this entry, or it is gone or pinned) or a duplicate
            seen.add(eid)
            popped.append(item)
            if eid == keep:
                continue
            chosen.append(eid)
            total -= entry.size
            number -= 1
        for item in popped:
            heapq.heappush(heap, item)
        return None if over() else chosen

    # -- the order -------------------------------------------------------------------

    def _order(self) -> list[tuple[bool, float, int, bytes]]:
        """The eviction heap, built from the entries when there is none."""
        if self._heap is None:
            self._heap = [(*e.order(), i) for i, e in self._entries.items() if not e.pinned]
            heapq.heapify(self._heap)
        return self._heap

    def _push(self, eid: bytes, entry: EntryState) -> None:
        if self._heap is None:
            return  # `_order` builds it, with this entry's order, when it is needed
        if len(self._heap) > 2 * len(self._entries) + 1024:  # mostly stale items: rebuild
            self._heap = None
            self._order()
        elif not entry.pinned:
            heapq.heappush(self._heap, (*entry.order(), eid))


#: Pending uses are saved once this many accumulate or this much time passes.
TOUCH_BATCH = 256
TOUCH_SECONDS = 1.0


class PendingUses:
    """Uses (hits, touches) applied to the catalog at once and saved to the store in
    batches, so a hit never waits for a write. Use times are strictly increasing
    nanoseconds, so two uses in one clock tick still have an order."""

    def __init__(self) -> None:
        #: entry id -> (use time, value), not yet saved.
        self.items: dict[bytes, tuple[int, float]] = {}
        self._since = 0.0
        self._last_time = 0

    def now(self) -> int:
        """A use time: the wall clock in ns, later than every one given before."""
        self._last_time = max(time.time_ns(), self._last_time + 1)
        return self._last_time

    def record(self, catalog: Catalog, eid: bytes) -> None:
        """Entry `eid` was used now: in `catalog` at once, in the store later."""
        state = catalog.get(eid)
        if state is None:
            return
        used = self.now()
        value = catalog.value(state.priority, state.tokens)
        if not self.items:
            self._since = time.monotonic()
        self.items[eid] = (used, value)
        catalog.use(eid, used, value)

    def due(self) -> bool:
        """Whether the pending uses should be saved now."""
        return bool(self.items) and (len(self.items) >= TOUCH_BATCH or time.monotonic() - self._since >= TOUCH_SECONDS)


def refuse(location: str, size: int, tokens: int, pinned: bool, why: str, budgets: str) -> bool:
    """Refuse an entry that does not fit: a pinned one raises `CacheFull`, another
    is dropped with a warning. Returns False (not stored)."""
    if pinned:
        raise CacheFull(f"{location}: cannot pin a {size}-byte entry ({tokens} tokens): {why} ({budgets})")
    log.warning(
        "sippcache: not storing a %d-byte entry (%d tokens): %s (%s) of %s", size, tokens, why, budgets, location
    )
    return False

"""What a store holds, kept in memory: the prefix index, sizes, pins, the retention
state eviction orders by, and the budget saved with the store.

Backends that index their entries themselves (the KV engine, the Redis plugin)
mirror their store here (through `sippcache.mirror.Mirror`) and ask it two
questions: which entry answers a lookup (`index`), and what storing an entry
takes (`plan_store`: which entries to evict, which one the new entry
supersedes, or why it is refused), by the eviction policy of
`sippcache.eviction`.

Every change to a store is one of six `Change` values: an entry put, removed,
re-marked (pin, supersession) or used, the store cleared, its budget set.
They are what the store's change log records (`Op` names them there) and what
a plan consists of. A backend persists a change its own way, then
`Catalog.apply` makes memory match, whether the change is its own or one
another process logged: there is one way for the catalog to change.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from enum import Enum, StrEnum
from itertools import compress, repeat
from operator import attrgetter
from typing import Any, ClassVar, Final, NamedTuple

import msgpack  # type: ignore[import-untyped]  # msgpack ships no type information
import xxhash

from . import tokens as _tokens
from .eviction import DEFAULT_POLICY, EvictionPolicy, Rank
from .index import PrefixIndex
from .protocol import Blob, EntryInfo, Peek, Stats, StoreOptions

_TOKEN = 4  # bytes per token in index keys
#: Starts every `Catalog.snapshot`; a new layout gets a new one, and older snapshots are ignored.
SNAPSHOT_MAGIC = b"sippcache-catalog-1\n"
_DIGEST = 16  # xxh3_128 of the snapshot's body


class Op(StrEnum):
    """A change's name in a store's change log (the first field of an engine log
    record, the kind of a Redis log entry). These strings are on-disk format."""

    PUT = "p"
    DELETE = "d"
    TOUCH = "t"
    VALUES = "v"
    CLEAR = "c"
    BUDGET = "b"


class Unset(Enum):
    """The type of `UNSET`."""

    UNSET = "unset"


#: A budget limit a handle was not given: it follows the one saved with the store.
UNSET: Final = Unset.UNSET


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


#: An entry's retention state, as `EvictionPolicy.rank` takes it.
_state = attrgetter("superseded", "value", "used")

#: The `EntryState` fields a snapshot keeps, in constructor order: all but the
#: namespace, which the index knows.
_COLUMNS = tuple(f.name for f in fields(EntryState))[1:]


# -- changes ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Put:
    """Entry `eid` is stored under `key` (token bytes), replacing an entry with that
    id. The catalog keeps `state` itself (and changes it as the entry is used)."""

    op: ClassVar[Op] = Op.PUT
    eid: bytes
    key: bytes
    state: EntryState


@dataclass(frozen=True, slots=True)
class Remove:
    """Entry `eid` is gone; `evicted`: to make room (it moves the eviction clock)."""

    op: ClassVar[Op] = Op.DELETE
    eid: bytes
    evicted: bool = False


@dataclass(frozen=True, slots=True)
class Mark:
    """Entry `eid`'s retention value, pin and superseded mark are now these."""

    op: ClassVar[Op] = Op.VALUES
    eid: bytes
    value: float
    pinned: bool
    superseded: bool


class Use(NamedTuple):
    """One use of an entry: when (ns) and its retention value after it (None: worked
    out from the clock, for records written before values were logged)."""

    eid: bytes
    used: int
    value: float | None


@dataclass(frozen=True, slots=True)
class Uses:
    """Entries were used (hits, touches), saved in a batch."""

    op: ClassVar[Op] = Op.TOUCH
    items: tuple[Use, ...]


@dataclass(frozen=True, slots=True)
class Clear:
    """Every entry is gone (the budget stays)."""

    op: ClassVar[Op] = Op.CLEAR


@dataclass(frozen=True, slots=True)
class Budget:
    """A store's limits (None: no limit): `max_bytes` counts blob bytes plus 4 per key
    token. Saved with the store, so that handles opened without limits of their own,
    other processes and `sippcache prune` all go by one budget; as a change: the
    budget saved with the store is now this one."""

    op: ClassVar[Op] = Op.BUDGET
    max_bytes: int | None
    max_entries: int | None = None

    def __str__(self) -> str:
        return f"max_bytes={self.max_bytes}, max_entries={self.max_entries}"


Change = Put | Remove | Mark | Uses | Clear | Budget


@dataclass(frozen=True)
class StorePlan:
    """What storing an entry takes, decided by `Catalog.plan_store`.

    `state` is the new entry's state, or None if it is not stored: `reason` then
    says why ("stale": the stored entry has a newer generation; otherwise it does
    not fit). To carry it out, persist `changes` (evictions, the entry it
    supersedes, then the entry itself) and the eviction clock they lead to
    (`Catalog.clock_after`), then apply them to the catalog.
    """

    state: EntryState | None
    reason: str = ""
    changes: tuple[Change, ...] = ()


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
    """Entries of one store: index, sizes, pins, retention state and the store's budget.

    Ids are opaque bytes chosen by the backend. Nothing here touches storage:
    the backend persists a change and then `apply`s it here. `policy` orders the
    entries for eviction.
    """

    def __init__(self, policy: EvictionPolicy = DEFAULT_POLICY) -> None:
        self.policy = policy
        self._rank = policy.rank
        self.index = PrefixIndex()
        #: The GreedyDual clock (see `sippcache.eviction.GreedyDual`), saved with the store.
        self.clock = 0.0
        #: The budget saved with the store; None: none is.
        self.budget: Budget | None = None
        self._entries: dict[bytes, EntryState] = {}
        #: The eviction order: (rank, id) items, some stale; None until first needed
        #: after a snapshot load (most processes that open a store never evict).
        self._heap: list[tuple[Rank, bytes]] | None = []
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

    def apply(self, change: Change) -> None:
        """Make memory match a change the store holds (this process's or another's)."""
        match change:
            case Put():
                self._put(change.eid, change.key, change.state)
            case Remove():
                self._remove(change.eid, evicted=change.evicted)
            case Mark():
                self._mark(change.eid, value=change.value, pinned=change.pinned, superseded=change.superseded)
            case Uses():
                touched = [(use[0], used) for use in change.items if (used := self._use(*use)) is not None]
                self.index.touch_many(touched)
            case Clear():
                policy, budget = self.policy, self.budget
                self.__init__(policy)  # type: ignore[misc]
                self.budget = budget
            case Budget():
                self.budget = change

    def _put(self, eid: bytes, key: bytes, entry: EntryState) -> None:
        self._remove(eid)
        self._entries[eid] = entry
        self.total += entry.size
        if entry.pinned:
            self.pinned_bytes += entry.size
            self.pinned_count += 1
        self.index.insert(entry.namespace, key, eid, entry.used)
        self._push(eid, entry)

    def _remove(self, eid: bytes, *, evicted: bool = False) -> None:
        """Forget `eid`; an eviction (of an entry not superseded) moves the clock up to its value."""
        entry = self._entries.pop(eid, None)
        if entry is None:
            return
        self.total -= entry.size
        if entry.pinned:
            self.pinned_bytes -= entry.size
            self.pinned_count -= 1
        self.index.remove(eid)
        if evicted and not entry.superseded:
            self.clock = max(self.clock, entry.value)

    def _use(self, eid: bytes, used: int, value: float | None) -> int | None:
        """A use at `used` (ns): a new retention value, and no longer superseded. Returns the
        entry's recency for the index (`PrefixIndex.touch_many`), None for an unknown entry."""
        entry = self._entries.get(eid)
        if entry is None:
            return None
        entry.used = max(entry.used, used)
        entry.value = self.value(entry.priority, entry.tokens) if value is None else value
        entry.superseded = False
        self._push(eid, entry)
        return entry.used

    def _mark(self, eid: bytes, *, value: float, pinned: bool, superseded: bool) -> None:
        entry = self._entries.get(eid)
        if entry is None:
            return
        if entry.pinned != pinned:
            sign = 1 if pinned else -1
            self.pinned_bytes += sign * entry.size
            self.pinned_count += sign
        entry.value, entry.pinned, entry.superseded = value, pinned, superseded
        self._push(eid, entry)

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self, position: int) -> bytes:
        """The whole catalog (but its budget, which the store keeps apart) as bytes that
        `from_snapshot` loads much faster than putting every entry again (no key is
        inserted into the index one by one). `position` is the backend's: what the
        snapshot reflects (a log sequence number). Checksummed, so damage makes
        `from_snapshot` refuse it."""
        trees = self.index.dump()
        states = [self._entries[eid] for tree in trees for eid in compress(tree[3], tree[3])]  # in the dump's order
        columns = [list(map(attrgetter(name), states)) for name in _COLUMNS]
        body: bytes = msgpack.packb([position, self.clock, trees, columns])
        return SNAPSHOT_MAGIC + xxhash.xxh3_128_digest(body) + body

    @classmethod
    def from_snapshot(cls, raw: Blob, policy: EvictionPolicy = DEFAULT_POLICY) -> tuple[Catalog, int] | None:
        """The catalog a `snapshot` holds and its position; None if `raw` is not an
        intact snapshot of this layout (damaged, cut short, another version)."""
        start = len(SNAPSHOT_MAGIC)
        if bytes(raw[:start]) != SNAPSHOT_MAGIC or len(raw) < start + _DIGEST:
            return None
        body = memoryview(raw)[start + _DIGEST :]
        if xxhash.xxh3_128_digest(body) != bytes(raw[start : start + _DIGEST]):
            return None
        catalog = cls(policy)
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

    # -- questions -------------------------------------------------------------------

    def clock_after(self, changes: Iterable[Change]) -> float:
        """The eviction clock once `changes` are applied: evicting an entry that is not
        superseded moves it up to the entry's retention value."""
        clock = self.clock
        for change in changes:
            if isinstance(change, Remove) and change.evicted:
                state = self._entries.get(change.eid)
                if state is not None and not state.superseded:
                    clock = max(clock, state.value)
        return clock

    def stats(self, *, backend: str, location: str, budget: Budget, damaged: int = 0, **counters: int) -> Stats:
        """A backend's `Stats` under `budget`: the store's sizes from here, its own counters added."""
        return Stats(
            backend=backend,
            location=location,
            entries=len(self),
            bytes=self.total,
            max_bytes=budget.max_bytes,
            max_entries=budget.max_entries,
            namespaces=len(self.namespaces()),
            damaged=damaged,
            pinned=self.pinned_count,
            pinned_bytes=self.pinned_bytes,
            **counters,
        )

    def namespaces(self) -> list[str]:
        """The namespaces holding at least one entry (from the index: no entry is listed)."""
        return self.index.namespaces()

    def entries(self, namespace: str | None = None) -> list[EntryInfo]:
        """Every entry (of one namespace, if given) as `EntryInfo`, least recently used first."""
        found = []
        for eid in self.by_use(namespace):
            e = self._entries[eid]
            key = _tokens.decode(self.index.key_of(eid))
            found.append(
                EntryInfo(
                    e.namespace,
                    key,
                    e.size,
                    e.created / 1e9,
                    e.used / 1e9,
                    e.priority,
                    e.pinned,
                    e.generation,
                    e.value,
                    e.superseded,
                )
            )
        return found

    def peek(self, namespace: str, key: bytes, partial: bool) -> Peek | None:
        """The index's answer to a lookup of `key` (token bytes), as `Peek`."""
        hit = self.index.longest_common(namespace, key) if partial else self.index.longest_prefix(namespace, key)
        if hit is None:
            return None
        entry = self._entries[hit.entry_id]
        return Peek(hit.length, entry.tokens, entry.pinned)

    def plan_store(
        self, eid: bytes, key: bytes, namespace: str, size: int, options: StoreOptions, now: int, budget: Budget
    ) -> StorePlan:
        """Decide how to store an entry of `size` bytes under `key` (token bytes), as of
        `now` (ns), within `budget`. A store over a pinned entry keeps the pin."""
        tokens = len(key) // _TOKEN
        old = self._entries.get(eid)
        if old is not None and old.generation > options.generation:
            return StorePlan(None, "stale")
        if budget.max_bytes is not None and size > budget.max_bytes:
            return StorePlan(None, "larger than max_bytes")
        pinned = options.pinned or (old is not None and old.pinned)
        victims = self.victims(budget, size=size, count=1, keep=eid)
        if victims is None or (pinned and not self.pins_fit(size, budget, replaced=old)):
            return StorePlan(None, "more than the unpinned room left")
        changes: list[Change] = [Remove(victim, evicted=True) for victim in victims]
        clock = self.clock_after(changes)
        superseded = self.policy.superseded_by(self, namespace, key)
        if superseded is not None and superseded not in victims:
            mark = self._entries[superseded]
            changes.append(Mark(superseded, mark.value, mark.pinned, True))
        state = EntryState(
            namespace,
            tokens,
            size,
            options.priority,
            options.generation,
            now,
            now,
            clock + options.priority / max(tokens, 1),
            pinned,
        )
        changes.append(Put(eid, key, state))
        return StorePlan(state, "", tuple(changes))

    def pins_fit(self, size: int, budget: Budget, *, replaced: EntryState | None = None) -> bool:
        """Whether pinned entries plus one more of `size` bytes (replacing `replaced`) stay within `budget`."""
        pinned_bytes, pinned_count = self.pinned_bytes, self.pinned_count
        if replaced is not None and replaced.pinned:
            pinned_bytes, pinned_count = pinned_bytes - replaced.size, pinned_count - 1
        return (budget.max_bytes is None or pinned_bytes + size <= budget.max_bytes) and (
            budget.max_entries is None or pinned_count + 1 <= budget.max_entries
        )

    def victims(self, budget: Budget, *, size: int = 0, count: int = 0, keep: bytes = b"") -> list[bytes] | None:
        """The entries to evict, in the policy's order, so that the rest (without
        `keep`, which is about to be replaced) and `count` new entries of `size`
        bytes fit `budget`; None if they cannot fit even with every unpinned entry
        gone. Changes nothing: evict them, then apply `Remove(..., evicted=True)`."""
        kept = self._entries.get(keep)
        total = self.total - (kept.size if kept else 0) + size
        number = len(self._entries) - (kept is not None) + count
        max_bytes, max_entries = budget.max_bytes, budget.max_entries

        def over() -> bool:
            return (max_bytes is not None and total > max_bytes) or (max_entries is not None and number > max_entries)

        chosen: list[bytes] = []
        popped: list[tuple[Rank, bytes]] = []
        seen: set[bytes] = set()
        heap = self._order()
        while over() and heap:
            item = heapq.heappop(heap)
            rank, eid = item
            entry = self._entries.get(eid)
            if entry is None or entry.pinned or eid in seen or rank != self._rank(*_state(entry)):
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

    def _order(self) -> list[tuple[Rank, bytes]]:
        """The eviction heap, built from the entries when there is none."""
        if self._heap is None:
            rank = self._rank
            self._heap = [(rank(*_state(e)), i) for i, e in self._entries.items() if not e.pinned]
            heapq.heapify(self._heap)
        return self._heap

    def _push(self, eid: bytes, entry: EntryState) -> None:
        if self._heap is None:
            return  # `_order` builds it, with this entry's rank, when it is needed
        if len(self._heap) > 2 * len(self._entries) + 1024:  # mostly stale items: rebuild
            self._heap = None
            self._order()
        elif not entry.pinned:
            heapq.heappush(self._heap, (self._rank(*_state(entry)), eid))

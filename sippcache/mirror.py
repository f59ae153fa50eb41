"""This process's copy of a shared store's catalog, kept in step with the store's change log.

Every backend that indexes a store several processes share (the KV engine's
`sippcache.engine.replica.Replica`, the Redis plugin) keeps one `Mirror` per
handle. The store holds the truth and a numbered change log; the mirror holds
a `sippcache.catalog.Catalog` as of log record `seq`. What differs between
stores is only how a record is read (the engine reads its records from a
transactional byte map, Redis gets them inline in a script's reply) and how a
change is written; the rest is here, once:

- `follow`: apply the log record numbered `seq + 1` (anything else means a
  record was missed: `OutOfStep`, rebuild);
- `plan_store`, `plan_pin` and `committed`: plan a change under the store's
  budget, and apply it once the store has it;
- `PendingUses`: hits update the catalog at once and reach the store in batches;
- the budget: the limits a handle was given, else the ones saved with the
  store, else the backend's defaults (`budget`, `budget_claim`);
- the counters `Stats` reports, and how a refused store is reported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from .catalog import UNSET, Budget, Catalog, Change, Clear, Mark, Put, Remove, StorePlan, Unset, Use, Uses
from .errors import CacheFull
from .eviction import DEFAULT_POLICY, EvictionPolicy
from .protocol import StoreOptions

log = logging.getLogger("sippcache")

#: Pending uses are saved once this many accumulate or this much time passes.
TOUCH_BATCH = 256
TOUCH_SECONDS = 1.0

#: A budget limit as a handle was given it: a number, None (no limit) or `UNSET`.
Limit = int | None | Unset


#: The largest limit a store saves (a u64 would do; msgpack and Lua's numbers agree up to here).
MAX_LIMIT = 2**63 - 1


def check_limits(max_bytes: Limit, max_entries: Limit) -> None:
    """Raise ValueError (`BadOption` from a URL) for a limit that is not a positive number a store can save."""
    for name, limit in (("max_bytes", max_bytes), ("max_entries", max_entries)):
        if isinstance(limit, int) and not 0 < limit <= MAX_LIMIT:
            raise ValueError(f"{name} must be positive and at most {MAX_LIMIT}, got {limit}")


class OutOfStep(Exception):
    """A log record does not follow the last one applied: rebuild the mirror."""


class PendingUses:
    """Uses (hits, touches) applied to the catalog at once and saved to the store in
    batches, so a hit never waits for a write. Use times are strictly increasing
    nanoseconds, so two uses in one clock tick still have an order."""

    def __init__(self) -> None:
        #: entry id -> its newest use, not yet saved.
        self.items: dict[bytes, Use] = {}
        self._since = 0.0
        self._last_time = 0

    def now(self) -> int:
        """A use time: the wall clock in ns, later than every one given before."""
        self._last_time = max(time.time_ns(), self._last_time + 1)
        return self._last_time

    def record(self, catalog: Catalog, *eids: bytes) -> None:
        """Entries `eids` were used now, in that order: in `catalog` at once (one change), in
        the store later."""
        uses = []
        for eid in eids:
            state = catalog.get(eid)
            if state is not None:
                uses.append(Use(eid, self.now(), catalog.value(state.priority, state.tokens)))
        if not uses:
            return
        if not self.items:
            self._since = time.monotonic()
        for use in uses:
            self.items[use.eid] = use
        catalog.apply(Uses(tuple(uses)))

    def due(self) -> bool:
        """Whether the pending uses should be saved now."""
        return bool(self.items) and (len(self.items) >= TOUCH_BATCH or time.monotonic() - self._since >= TOUCH_SECONDS)

    def batch(self) -> Uses | None:
        """The pending uses as one change to save (they are in the catalog already);
        empty `items` once the store has them."""
        return Uses(tuple(self.items.values())) if self.items else None


class Mirror:
    """One handle's copy of a store's catalog as of log record `seq` (-1: to be rebuilt),
    with its pending uses, the ids of damaged entries awaiting removal, and its counters.

    `max_bytes` and `max_entries` are the limits the handle was given (`UNSET`: follow
    the store's); `default` is what applies when neither the handle nor the store
    has one. A handle that may write (`claim`) saves its limits with the store when
    it first uses it, so handles opened without limits follow them.
    """

    def __init__(
        self,
        location: str,
        *,
        max_bytes: Limit = UNSET,
        max_entries: Limit = UNSET,
        default: Budget,
        policy: EvictionPolicy = DEFAULT_POLICY,
        claim: bool = True,
    ) -> None:
        self.location = location
        self.catalog = Catalog(policy)
        self.seq = -1
        self.uses = PendingUses()
        self.damaged: set[bytes] = set()
        self.counters = dict(hits=0, misses=0, stores=0, evictions=0, refused=0, stale=0)
        self._max_bytes, self._max_entries, self._default = max_bytes, max_entries, default
        self._budget_from: Budget | None = None
        self._budget = default
        self._claim_pending = claim and (max_bytes is not UNSET or max_entries is not UNSET)

    def invalidate(self) -> None:
        """Rebuild from the store before the next use."""
        self.seq = -1

    def replace(self, catalog: Catalog, seq: int) -> None:
        """Take a catalog rebuilt from the store as of log record `seq`."""
        self.catalog, self.seq = catalog, seq
        self.uses.items.clear()

    def reload(self, entries: Iterable[Put], seq: int, clock: float) -> None:
        """Rebuild the catalog from every entry the store holds as of log record `seq`
        (and its eviction clock), keeping the policy and the budget known so far.
        Entries go in longest key first: a chunked state's chain of keys, each a
        chunk longer than the one before, then costs a step of the index apiece,
        not a walk down every shorter one (the index's ranks are the entries' uses
        whatever the order; of entries used at once, the shorter answers a partial
        match in their common part)."""
        catalog = Catalog(self.catalog.policy)
        catalog.budget, catalog.clock = self.catalog.budget, clock
        for put in sorted(entries, key=_longest_first):
            catalog.apply(put)
        self.replace(catalog, seq)

    # -- the log -----------------------------------------------------------------------

    def follow(self, seq: int, change: Change | None) -> None:
        """Apply log record number `seq` (None: a record with nothing left to apply, such
        as a put whose entry a later record deletes). Raises `OutOfStep` unless it is
        the record after the last one applied."""
        if seq != self.seq + 1:
            raise OutOfStep(f"log record {seq} after {self.seq}")
        if change is not None:
            self.apply(change)
        self.seq = seq

    def apply(self, change: Change) -> None:
        """Make memory match `change`, which the store holds."""
        self.catalog.apply(change)
        if isinstance(change, Remove):
            self.uses.items.pop(change.eid, None)
        elif isinstance(change, Clear):
            self.uses.items.clear()
            self.damaged.clear()

    def committed(self, changes: Iterable[Change], seq: int | None = None) -> None:
        """This handle's own `changes` are in the store, its log (if it keeps one) now
        ending at record `seq`."""
        for change in changes:
            if isinstance(change, Uses):
                continue  # applied when they happened
            if isinstance(change, Remove) and change.evicted and change.eid in self.catalog:
                self.counters["evictions"] += 1
            if isinstance(change, Budget):
                self._claim_pending = False
            self.apply(change)
        if seq is not None:
            self.seq = seq

    # -- the budget ----------------------------------------------------------------------

    @property
    def budget(self) -> Budget:
        """The limits this handle enforces: its own, else the store's, else the defaults."""
        stored = self.catalog.budget or self._default
        if stored is not self._budget_from:  # worked out again only when the store's changes
            self._budget_from = stored
            self._budget = Budget(
                stored.max_bytes if self._max_bytes is UNSET else self._max_bytes,
                stored.max_entries if self._max_entries is UNSET else self._max_entries,
            )
        return self._budget

    def budget_claim(self) -> Budget | None:
        """The budget to save with the store (in sync with it): this handle's limits, once,
        if the store does not hold them already."""
        if not self._claim_pending:
            return None
        wanted = self.budget
        if wanted == self.catalog.budget:
            self._claim_pending = False
            return None
        return wanted

    # -- planning ------------------------------------------------------------------------

    def plan_store(self, eid: bytes, key: bytes, namespace: str, size: int, options: StoreOptions) -> StorePlan:
        """What storing an entry takes now, under this handle's budget (see `Catalog.plan_store`)."""
        return self.catalog.plan_store(eid, key, namespace, size, options, self.uses.now(), self.budget)

    def plan_pin(self, eid: bytes, pinned: bool, tokens: int) -> Mark | None:
        """The change that pins or unpins entry `eid` (of `tokens` tokens); None if there is no
        such entry or it is already so. Raises `CacheFull` if pinned entries would exceed the budget."""
        state = self.catalog.get(eid)
        if state is None or state.pinned == pinned:
            return None
        budget = self.budget
        if pinned and not self.catalog.pins_fit(state.size, budget):
            raise CacheFull(f"{self.location}: cannot pin {tokens} tokens: pinned entries would exceed {budget}")
        return Mark(eid, state.value, pinned, state.superseded)

    def settle_store(self, plan: StorePlan, size: int, tokens: int, pinned: bool) -> bool:
        """Count a store that went by `plan` and say whether it stored: a refused one is
        reported by `refuse` (a pinned one raises `CacheFull`)."""
        if plan.state is not None:
            self.counters["stores"] += 1
            return True
        if plan.reason == "stale":
            self.counters["stale"] += 1
            return False
        self.counters["refused"] += 1
        return refuse(self.location, size, tokens, pinned, plan.reason, self.budget)


def refuse(location: str, size: int, tokens: int, pinned: bool, why: str, budget: Budget) -> bool:
    """Refuse an entry that does not fit: a pinned one raises `CacheFull`, another
    is dropped with a warning. Returns False (not stored)."""
    if pinned:
        raise CacheFull(f"{location}: cannot pin a {size}-byte entry ({tokens} tokens): {why} ({budget})")
    log.warning(
        "sippcache: not storing a %d-byte entry (%d tokens): %s (%s) of %s", size, tokens, why, budget, location
    )
    return False


def _longest_first(put: Put) -> tuple[int, int, bytes]:
    """`Mirror.reload`'s order: longest key first, then least recently used, then by id."""
    return -len(put.key), put.state.used, put.eid

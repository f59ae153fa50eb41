"""Eviction policies: which entries make room for a new one, and in what order.

Every store that indexes its entries itself (the KV engine, the Redis plugin)
keeps a retention state for each entry in its `sippcache.catalog.Catalog`: the
last use, a GreedyDual retention value and a "superseded" mark, saved with the
entry so every process sees the same. A policy turns that state into an order
(`rank`: the lowest rank is evicted first) and decides which entry a new one
supersedes. The catalog evicts by it within a store's budget, and
`sippcache prune` orders `entries()` by it (`EvictionPolicy.order`), so a
prune drops the entries the store itself would have dropped first.

Two policies:

- `LRU`: least recently used first. The reference every other policy is
  measured against (benchmarks/trace.py).
- `GreedyDual` (the default): superseded entries first, then GreedyDual-Size
  on priorities, least recently used among equals. With the default priority
  (the token count) this is least recently used once superseded entries are
  gone, so it can only differ from LRU where an entry is superseded.

What "superseded" means decides whether the default ever loses to LRU. A newer
entry supersedes an older one when it shares at least half of the older
entry's tokens and *takes over its place* in the prefix index: it branches off
inside the older entry's own edge (no other stored key branches off there), or
it extends the older entry's whole key and nothing else extends it. That is the
next turn of one conversation (in the Mooncake trace a turn differs from the
next only in its last, partial block), or one user's question after a document
only that user had asked about. A key that branches off where other keys
already branch (many conversations after one shared system prompt) is their
sibling and supersedes nothing: an earlier rule that superseded there evicted
live conversations first and reused up to 8% fewer tokens than LRU on a
conversation workload (`python -m benchmarks.trace`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar, Protocol

from .index import PrefixIndex
from .protocol import EntryInfo

#: A place in the eviction order: tuples compare element by element, the lowest goes first.
Rank = tuple[float, ...]


class Retained(Protocol):
    """One entry's retention state as a policy reads it (`sippcache.catalog.EntryState`)."""

    @property
    def tokens(self) -> int: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def superseded(self) -> bool: ...


class CatalogView(Protocol):
    """What a policy reads of a store's catalog (`sippcache.catalog.Catalog`): its prefix index
    and each entry's retention state. Named here, by what the policy needs, because the catalog
    orders its entries by a policy: the catalog builds on this module, not the other way."""

    @property
    def index(self) -> PrefixIndex: ...

    def get(self, eid: bytes) -> Retained | None: ...


class EvictionPolicy(ABC):
    """How a store orders its entries for eviction. Pinned entries are never ranked:
    nothing evicts them."""

    #: What `sippcache stats` and the benchmarks call the policy.
    name: ClassVar[str]

    @abstractmethod
    def rank(self, superseded: bool, value: float, used: float) -> Rank:
        """Where an entry stands in the eviction order (the lowest rank goes first),
        from its retention state: superseded or not, its GreedyDual retention value,
        and its last use (any unit that grows with time)."""

    def superseded_by(self, catalog: CatalogView, namespace: str, key: bytes) -> bytes | None:
        """The id of the entry that storing `key` (token bytes) supersedes, if any.
        By default none: a policy that ranks by recency alone has no use for the mark."""
        return None

    def order(self, entries: Iterable[EntryInfo]) -> list[EntryInfo]:
        """The unpinned `entries` (as `CacheBackend.entries` lists them) in eviction
        order: what `sippcache prune` deletes first."""
        unpinned = (e for e in entries if not e.pinned)
        return sorted(unpinned, key=lambda e: self.rank(e.superseded, e.retention, e.last_used))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRU(EvictionPolicy):
    """Least recently used first, nothing else considered."""

    name = "lru"

    def rank(self, superseded: bool, value: float, used: float) -> Rank:
        return (used,)


class GreedyDual(EvictionPolicy):
    """The default: superseded entries first, then GreedyDual-Size (Cao and Irani, 1997).

    An entry's retention value is the store's clock at its last use plus its
    priority per token (the catalog keeps both); the lowest value goes first,
    least recently used among equals, and evicting an entry moves the clock up to
    its value. With the default priority (the token count: recomputing a prefix
    costs in proportion to its length, and so does storing it) every entry has
    the same priority per token and the order is least recently used; a higher
    priority keeps an entry longer, and the clock makes sure that an entry nobody
    uses any more still goes in the end. A use clears the superseded mark.
    """

    name = "greedy-dual"

    def rank(self, superseded: bool, value: float, used: float) -> Rank:
        return (0.0 if superseded else 1.0, value, used)

    def superseded_by(self, catalog: CatalogView, namespace: str, key: bytes) -> bytes | None:
        """The entry `key` takes the place of in the index (see the module docstring),
        if it shares at least half of that entry's tokens and goes past them."""
        hit = catalog.index.branch_of(namespace, key)
        if hit is None:
            return None
        entry = catalog.get(hit.entry_id)
        if entry is None or entry.superseded or entry.pinned or 2 * hit.length < entry.tokens:
            return None
        return hit.entry_id


#: What every backend evicts by unless it is given another policy.
DEFAULT_POLICY: EvictionPolicy = GreedyDual()

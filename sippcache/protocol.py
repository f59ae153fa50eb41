"""The types every backend shares: the `CacheBackend` protocol and the values it takes and returns.

A backend maps token sequences (per namespace) to opaque bytes and answers
prefix questions about them. It never parses the bytes: the format belongs to
`sippcache.frame`. Only plain types and interfaces live here (as dogpile.cache's
``api.py``); `sippcache.base.BaseBackend` supplies the parts every backend
shares, and `sippcache.engine` the zero-copy snapshots that outlive a match.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from . import tokens as _tokens
from .blob import Blob as Blob  # a stored value; named here too, with the protocol it is part of
from .tokens import Tokens


class Match:
    """A lookup answer.

    `length` is how many query tokens the entry covers: ``len(key)`` for a
    prefix hit, the longest common prefix for a partial one. `blob` is the
    stored bytes. Release a match when done with it (`release()`, or a `with`
    block around it): for the backends that return zero-copy views (LMDB, see
    `sippcache.engine.SnapshotMatch`) the blob stays valid until then, after
    which reading it raises ValueError. Slices and other views made from it
    are not invalidated: do not use them after release (they may show other
    data). Release matches promptly: an unreleased LMDB match pins its snapshot.
    """

    __slots__ = ("__weakref__", "_key", "blob", "length", "namespace")

    def __init__(self, length: int, key: tuple[int, ...] | bytes | memoryview, blob: Blob, namespace: str = "") -> None:
        self.length = length
        self._key = key  # token ids, or their `sippcache.tokens.encode` bytes (decoded when read)
        self.blob = blob
        self.namespace = namespace

    @property
    def key(self) -> tuple[int, ...]:
        """The stored token sequence."""
        if isinstance(self._key, bytes | memoryview):
            self._key = _tokens.decode(self._key)
        return tuple(self._key)

    def release(self) -> None:
        """End the blob's validity and free what pins it (idempotent); nothing to
        free for a blob the match owns outright."""

    def __enter__(self) -> Match:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"Match(length={self.length}, key=<{len(self.key)} tokens>, blob=<{len(self.blob)} bytes>, "
            f"namespace={self.namespace!r})"
        )


@dataclass(frozen=True)
class Peek:
    """What `lookup` would return, without the blob: how many query tokens the entry
    covers, how long its key is (longer than `length` for a partial match), and whether
    it is pinned (None where a backend cannot tell without reading more: then a caller
    that deletes entries it supersedes leaves it alone)."""

    length: int
    key_length: int
    pinned: bool | None = None


@dataclass(frozen=True)
class EntryInfo:
    """One stored entry, as listed by `CacheBackend.entries` (no blob)."""

    namespace: str
    key: tuple[int, ...]
    size: int  # bytes counted against max_bytes: blob + 4 per key token
    created: float  # seconds since the epoch
    last_used: float  # seconds since the epoch (recency is saved in batches)
    priority: float = 0.0  # retention priority (default: the token count)
    pinned: bool = False  # never evicted
    generation: int = 0  # the writer's generation: an older one never replaces it
    #: The retention state eviction orders by (`sippcache.eviction`): what `sippcache prune`
    #: orders entries by, so it deletes what the store itself would evict first.
    retention: float = 0.0  # the GreedyDual retention value
    superseded: bool = False  # a newer entry took this one's place (evicted first by default)


@dataclass(frozen=True)
class StoreOptions:
    """A store's retention settings, defaults resolved (what `BaseBackend._store` receives).

    `priority`: the cost of recomputing the entry, by default its token count;
    eviction takes the lowest priority per token first (see `sippcache.catalog`).
    `pinned`: never evicted by a budget, never pruned. `generation`: when the
    stored state was made (by default the time of the call, in ns); an entry is
    never replaced by one of an older generation.
    """

    priority: float
    pinned: bool
    generation: int

    @classmethod
    def resolve(cls, tokens: int, priority: Any, pinned: Any, generation: Any) -> StoreOptions:
        """Check the arguments of `store` and fill in the defaults."""
        if priority is None:
            priority = float(tokens)
        elif isinstance(priority, bool) or not isinstance(priority, (int, float)):
            raise TypeError(f"priority must be a number, not {type(priority).__name__}")
        elif not (math.isfinite(priority) and priority >= 0):
            raise ValueError(f"priority must be a finite number >= 0, got {priority}")
        if not isinstance(pinned, bool):
            raise TypeError(f"pinned must be True or False, not {type(pinned).__name__}")
        if generation is None:
            generation = time.time_ns()
        elif isinstance(generation, bool) or not isinstance(generation, int):
            raise TypeError(f"generation must be an int, not {type(generation).__name__}")
        elif not 0 <= generation < 2**63:
            raise ValueError(f"generation must be in 0..2**63-1, got {generation}")
        return cls(float(priority), pinned, generation)


@dataclass(frozen=True)
class Stats:
    """A snapshot of a cache's size and this handle's counters.

    `entries`, `bytes` and `namespaces` describe the whole store (every
    process); `hits`, `misses`, `stores`, `evictions` and `refused` count what
    this handle did since it was opened.
    """

    backend: str
    location: str
    entries: int
    bytes: int
    max_bytes: int | None
    max_entries: int | None
    namespaces: int
    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    refused: int = 0
    damaged: int = 0  # entries whose index record is unreadable (invisible; removed on the next write)
    pinned: int = 0  # pinned entries in the store
    pinned_bytes: int = 0
    stale: int = 0  # stores skipped because the entry held a newer generation
    errors: int = 0  # operations the backend could not do (e.g. server down), answered as misses or dropped


@runtime_checkable
class CacheBackend(Protocol):
    """What sippcache needs of a store of prefix states.

    Keys are token sequences (ints in 0..2**31-1), values opaque bytes, each
    under a namespace; namespaces never see each other's entries.
    """

    #: Entries survive close/reopen and are shared between processes.
    persistent: ClassVar[bool]

    def store(
        self,
        tokens: Tokens,
        blob: Blob,
        *,
        namespace: str = "",
        priority: float | None = None,
        pinned: bool = False,
        generation: int | None = None,
    ) -> bool:
        """Store `blob` under `tokens`, replacing an entry with the same key
        unless that entry has a newer `generation`. False if not stored (an older
        generation, or no room: an unpinned entry larger than the budget is
        refused with a warning; a pinned one that does not fit raises `CacheFull`).
        See `StoreOptions` for `priority`, `pinned` and `generation`."""

    def lookup(self, tokens: Tokens, *, namespace: str = "", partial: bool = False, touch: bool = True) -> Match | None:
        """The entry with the longest stored prefix of `tokens` (or, with
        `partial`, the longest common prefix); ties go to the most recently used.
        A hit counts as a use for eviction unless `touch` is False (for tools
        that read entries without using them)."""

    def lookup_prefixes(
        self, tokens: Tokens, lengths: Sequence[int], *, namespace: str = "", touch: bool = True
    ) -> list[Match]:
        """The entries stored under exactly ``tokens[:n]`` for each `n` of `lengths` (ascending,
        from 1 to ``len(tokens)``), in that order, up to the first one not stored: a chain of
        chunks (`sippcache.state.chunks`) read in one call, not one lookup each (one read snapshot
        locally, one round trip to a server). Each match is released on its own; each hit
        counts as a use unless `touch` is False."""

    def touch_prefixes(self, tokens: Tokens, lengths: Sequence[int], *, namespace: str = "") -> int:
        """Count a use of the entries stored under exactly ``tokens[:n]`` for each `n` of
        `lengths` (as `lookup_prefixes` takes them), up to the first one not stored, without
        reading them: a new state keeping the chain of chunks it extends, in one call, not one
        `touch` each. Returns how many were there."""

    def peek(self, tokens: Tokens, *, namespace: str = "", partial: bool = False) -> Peek | None:
        """What `lookup` would find, without reading the blob or counting a use: to
        decide whether an entry is worth fetching (a large state over a network)."""

    def delete(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """Remove the entry stored under exactly `tokens`; True if there was one."""

    def touch(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """Count a use of the entry stored under exactly `tokens`, as a hit would,
        without reading it (a tier in front of this one had the hit); True if there is one."""

    def pin(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """Keep the entry stored under exactly `tokens` whatever the budgets; True
        if there is one. Raises `CacheFull` if pinned entries would exceed a budget."""

    def unpin(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """Make the entry under exactly `tokens` evictable again; True if there is one."""

    def clear(self) -> None:
        """Remove every entry in every namespace (pinned ones too)."""

    def stats(self) -> Stats:
        """Size and counters."""

    def entries(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        """Every stored entry (of one namespace, if given), least recently used first."""

    def namespaces(self) -> list[str]:
        """The namespaces holding at least one entry, sorted: a store's tenants (and its chunk
        namespaces, `sippcache.state.chunks`) without listing every entry of each."""

    def close(self) -> None:
        """Release files and memory; the handle is unusable afterwards."""

    def __len__(self) -> int: ...

    def __enter__(self) -> CacheBackend: ...

    def __exit__(self, *exc: object) -> None: ...

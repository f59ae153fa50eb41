"""The `CacheBackend` protocol every backend implements, and the values it returns.

A backend maps token sequences (per namespace) to opaque bytes and answers
prefix questions about them. It never parses the bytes: the format belongs to
`sippcache.frame`. `BaseBackend` supplies the parts every backend shares
(input validation, the context-manager protocol, URL option parsing), so a
third-party backend only writes its storage.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Protocol, Union, runtime_checkable

from . import tokens as _tokens
from .errors import BadOption, CacheClosed, CorruptStore
from .options import coerce_options

Blob = Union[bytes, memoryview]


# Zero-copy blobs still referenced when their Match was collected, with the
# function that ends their snapshot. Swept whenever a match is made.
_outliving_blobs: list[tuple[memoryview, Callable[[], None]]] = []
_outliving_lock = threading.Lock()


def _reset_outliving_lock_in_child() -> None:
    global _outliving_lock
    _outliving_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_outliving_lock_in_child)


def _release_unreferenced_blobs() -> None:
    """End the snapshots of outliving blobs that nothing references any more."""
    with _outliving_lock:
        keep = []
        for blob, release in _outliving_blobs:
            # References: the list's tuple, the loop variable, getrefcount's argument.
            if sys.getrefcount(blob) > 3:
                keep.append((blob, release))
                continue
            try:
                blob.release()
                release()
            except Exception:  # exported (BufferError): try again at the next sweep
                keep.append((blob, release))
        _outliving_blobs[:] = keep


class Match:
    """A lookup answer.

    `length` is how many query tokens the entry covers: ``len(key)`` for a
    prefix hit, the longest common prefix for a partial one. `blob` is the
    stored bytes; for backends that return zero-copy views (LMDB) it stays
    valid until `release()` is called or the `with` block around the match
    ends, after which reading it raises ValueError. Slices and other views
    made from it are not invalidated: do not use them after release (they
    may show other data). Release matches promptly: an unreleased LMDB match
    pins its snapshot.
    """

    __slots__ = ("__weakref__", "_key", "_release", "blob", "length", "namespace")

    def __init__(
        self,
        length: int,
        key: tuple[int, ...] | bytes,
        blob: Blob,
        namespace: str = "",
        release: Callable[[], None] | None = None,
    ) -> None:
        self.length = length
        self._key = key  # token ids, or their `sippcache.tokens.encode` bytes (decoded when read)
        self.blob = blob
        self.namespace = namespace
        self._release = release
        if _outliving_blobs:
            _release_unreferenced_blobs()

    @property
    def key(self) -> tuple[int, ...]:
        """The stored token sequence."""
        if isinstance(self._key, bytes):
            self._key = _tokens.decode(self._key)
        return tuple(self._key)

    def release(self) -> None:
        """End the blob's validity and free what pins it (idempotent).

        Raises BufferError while an object made from the blob with the buffer
        protocol (a numpy array, say) is alive; delete it and call again.
        """
        if self._release is None:
            return
        if isinstance(self.blob, memoryview):
            self.blob.release()
        release, self._release = self._release, None
        release()

    def __enter__(self) -> Match:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if self._release is None:
            return
        if isinstance(self.blob, memoryview) and sys.getrefcount(self.blob) > 2:
            # The blob outlives its match, as in `bytes(cache.lookup(k).blob)`: keep
            # it valid and end the snapshot once nothing holds the blob any more.
            with _outliving_lock:
                _outliving_blobs.append((self.blob, self._release))
            self._release = None
            return
        try:
            self.release()
        except Exception:  # exported elsewhere; the snapshot goes with the GC
            pass

    def __repr__(self) -> str:
        return f"Match(length={self.length}, key=<{len(self.key)} tokens>, blob=<{len(self.blob)} bytes>, namespace={self.namespace!r})"


@dataclass(frozen=True)
class Peek:
    """What `lookup` would return, without the blob: how many query tokens the entry
    covers, and how long its key is (longer than `length` for a partial match)."""

    length: int
    key_length: int


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
        tokens: _tokens.Tokens,
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

    def lookup(
        self, tokens: _tokens.Tokens, *, namespace: str = "", partial: bool = False, touch: bool = True
    ) -> Match | None:
        """The entry with the longest stored prefix of `tokens` (or, with
        `partial`, the longest common prefix); ties go to the most recently used.
        A hit counts as a use for eviction unless `touch` is False (for tools
        that read entries without using them)."""

    def peek(self, tokens: _tokens.Tokens, *, namespace: str = "", partial: bool = False) -> Peek | None:
        """What `lookup` would find, without reading the blob or counting a use: to
        decide whether an entry is worth fetching (a large state over a network)."""

    def delete(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        """Remove the entry stored under exactly `tokens`; True if there was one."""

    def touch(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        """Count a use of the entry stored under exactly `tokens`, as a hit would,
        without reading it (a tier in front of this one had the hit); True if there is one."""

    def pin(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        """Keep the entry stored under exactly `tokens` whatever the budgets; True
        if there is one. Raises `CacheFull` if pinned entries would exceed a budget."""

    def unpin(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        """Make the entry under exactly `tokens` evictable again; True if there is one."""

    def clear(self) -> None:
        """Remove every entry in every namespace (pinned ones too)."""

    def stats(self) -> Stats:
        """Size and counters."""

    def entries(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        """Every stored entry (of one namespace, if given), least recently used first."""

    def close(self) -> None:
        """Release files and memory; the handle is unusable afterwards."""

    def __len__(self) -> int: ...

    def __enter__(self) -> CacheBackend: ...

    def __exit__(self, *exc: object) -> None: ...


class BaseBackend(ABC):
    """Shared defaults for backends: argument checks, context manager, URL options.

    Subclasses implement the `_store`, `_lookup`, `_delete`, `_set_pinned`,
    `_clear`, `_stats`, `_len`, `_entries` and `_close` hooks (and may override
    `_peek` and `_touch_entry`), which receive
    validated arguments: tokens as little-endian uint32 bytes
    (`sippcache.tokens.encode`), a str namespace, a non-empty bytes-like blob,
    resolved `StoreOptions`.

    Promise every backend keeps: an open `Match` stays valid while its holder
    keeps it, whatever deletes, evictions, overwrites or clears happen meanwhile.
    """

    persistent: ClassVar[bool] = False
    #: Exceptions of the backend's library that mean damaged files; the public
    #: methods re-raise them as `CorruptStore`.
    damage_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: URL query options this backend accepts: name -> type (int, float, bool, str
    #: or `sippcache.options.Size`); coerced by `sippcache.options.coerce_options`.
    options: ClassVar[Mapping[str, type]] = {}

    def __init__(self) -> None:
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> BaseBackend:
        """Build a backend from a URL's location and raw query options."""
        kwargs = coerce_options(cls.__name__, options, cls.options)
        try:
            return cls(location, **kwargs)  # type: ignore[call-arg]
        except ValueError as exc:  # out-of-range values, a missing or extra path
            raise BadOption(f"{cls.__name__}: {exc}") from exc

    # -- public API: validate, then delegate ---------------------------------

    def store(
        self,
        tokens: _tokens.Tokens,
        blob: Blob,
        *,
        namespace: str = "",
        priority: float | None = None,
        pinned: bool = False,
        generation: int | None = None,
    ) -> bool:
        key = _tokens.encode(tokens)
        if not key:
            raise ValueError("cannot store an empty token sequence")
        _check_namespace(namespace)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"blob must be bytes-like, not {type(blob).__name__}")
        view = memoryview(blob)
        if view.nbytes == 0:
            raise ValueError("cannot store an empty blob")
        options = StoreOptions.resolve(len(key) // 4, priority, pinned, generation)
        self._check_open()
        with self._damage_as_corrupt_store():
            return self._store(key, view if view.contiguous else memoryview(view.tobytes()), namespace, options)

    def lookup(
        self, tokens: _tokens.Tokens, *, namespace: str = "", partial: bool = False, touch: bool = True
    ) -> Match | None:
        key = self._query_key(tokens, namespace)
        if not key:
            return None
        with self._damage_as_corrupt_store():
            return self._lookup(key, namespace, bool(partial), bool(touch))

    def peek(self, tokens: _tokens.Tokens, *, namespace: str = "", partial: bool = False) -> Peek | None:
        key = self._query_key(tokens, namespace)
        if not key:
            return None
        with self._damage_as_corrupt_store():
            return self._peek(key, namespace, bool(partial))

    def delete(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        key = self._query_key(tokens, namespace)
        with self._damage_as_corrupt_store():
            return bool(key) and self._delete(key, namespace)

    def touch(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        key = self._query_key(tokens, namespace)
        with self._damage_as_corrupt_store():
            return bool(key) and self._touch_entry(key, namespace)

    def pin(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        return self._pin(tokens, namespace, True)

    def unpin(self, tokens: _tokens.Tokens, *, namespace: str = "") -> bool:
        return self._pin(tokens, namespace, False)

    def _pin(self, tokens: _tokens.Tokens, namespace: str, pinned: bool) -> bool:
        key = self._query_key(tokens, namespace)
        with self._damage_as_corrupt_store():
            return bool(key) and self._set_pinned(key, namespace, pinned)

    def clear(self) -> None:
        self._check_open()
        with self._damage_as_corrupt_store():
            self._clear()

    def stats(self) -> Stats:
        self._check_open()
        with self._damage_as_corrupt_store():
            return self._stats()

    def entries(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        if namespace is not None:
            _check_namespace(namespace)
        self._check_open()
        with self._damage_as_corrupt_store():
            return iter(self._entries(namespace))

    def __len__(self) -> int:
        self._check_open()
        with self._damage_as_corrupt_store():
            return self._len()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _release_unreferenced_blobs()
        self._close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> BaseBackend:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @contextmanager
    def _damage_as_corrupt_store(self) -> Iterator[None]:
        try:
            yield
        except self.damage_errors as exc:
            raise CorruptStore(f"{type(self).__name__}: the store's files are damaged: {exc}") from exc

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosed(f"{type(self).__name__} is closed")

    def _query_key(self, tokens: _tokens.Tokens, namespace: str) -> bytes:
        """The encoded key of a query (empty for no tokens), after the argument checks
        every keyed call makes, in the same order."""
        key = _tokens.encode(tokens)
        _check_namespace(namespace)
        self._check_open()
        return key

    # -- storage hooks -------------------------------------------------------

    def _peek(self, key: bytes, namespace: str, partial: bool) -> Peek | None:
        """`peek`: by default a lookup that does not count as a use, its blob unread;
        override where the index can answer alone (every built-in backend does)."""
        match = self._lookup(key, namespace, partial, False)
        if match is None:
            return None
        with match:
            return Peek(match.length, len(match.key))

    def _touch_entry(self, key: bytes, namespace: str) -> bool:
        """`touch`: by default an exact lookup whose blob is not read; override
        where a use can be recorded without fetching the entry."""
        match = self._lookup(key, namespace, False, True)
        if match is None:
            return False
        with match:
            return match.length * 4 == len(key) and len(match.key) * 4 == len(key)

    @abstractmethod
    def _store(self, key: bytes, blob: memoryview, namespace: str, options: StoreOptions) -> bool: ...

    @abstractmethod
    def _lookup(self, key: bytes, namespace: str, partial: bool, touch: bool) -> Match | None: ...

    @abstractmethod
    def _delete(self, key: bytes, namespace: str) -> bool: ...

    @abstractmethod
    def _set_pinned(self, key: bytes, namespace: str, pinned: bool) -> bool: ...

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _stats(self) -> Stats: ...

    @abstractmethod
    def _len(self) -> int: ...

    @abstractmethod
    def _entries(self, namespace: str | None) -> list[EntryInfo]: ...

    @abstractmethod
    def _close(self) -> None: ...


def _check_namespace(namespace: Any) -> None:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
    if len(namespace.encode("utf-8")) > 1024:
        raise ValueError("namespace is longer than 1024 bytes")

"""`BaseBackend`: what every backend shares, so a backend only writes its storage.

The public methods check their arguments (tokens, namespace, blob, store
options) in one order for every backend, refuse a closed handle, and turn the
backend library's damage errors into `CorruptStore`; then they call the
backend's `_store`, `_lookup`, ... hooks with validated arguments.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any, ClassVar, cast

from . import tokens as _tokens
from .errors import BadOption, CacheClosed, CorruptStore, ReadOnlyStore, SippcacheError, StoreError
from .options import coerce_options
from .protocol import Blob, EntryInfo, Match, Peek, Stats, StoreOptions
from .tokens import Tokens


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
    #: `store` keeps a blob given as a whole `bytes` object as it is, no copy (it holds entries, or
    #: queues them, in this process's memory). A caller framing an entry for such a store makes
    #: the frame new bytes (`frame.encode`); for any other (the default, and what a backend that
    #: does not say is taken to be) it frames into a buffer it uses again (`frame.encode_into`),
    #: which the store copies into storage of its own: new memory's pages cost more than the copy.
    keeps_bytes: ClassVar[bool] = False
    #: Exceptions of the backend's library that mean damaged files; the public
    #: methods re-raise them as `CorruptStore`.
    damage_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: Every other exception of the backend's library: the public methods re-raise
    #: them as what `_library_error` makes of them (by default `StoreError`), so
    #: callers only ever see sippcache's errors (and ValueError, TypeError, OSError).
    library_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    #: URL query options this backend accepts: name -> type (int, float, bool, str
    #: or `sippcache.options.Size`); coerced by `sippcache.options.coerce_options`.
    options: ClassVar[Mapping[str, type]] = {}

    def __init__(self, *, read_only: bool = False) -> None:
        self._closed = False
        self._close_lock = threading.Lock()
        #: Writes (store, delete, pin, unpin, clear, purge_damaged) raise `ReadOnlyStore`.
        self.read_only = read_only

    # -- opening ----------------------------------------------------------------

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> BaseBackend:
        """Build a backend from a URL's location and raw query options."""
        return cls._from_url(location, options)

    @classmethod
    def open_read_only(cls, location: str, options: Mapping[str, str]) -> BaseBackend:
        """Like `from_url`, for reading only: listing, stats and lookups work where
        this user may not write the store, and nothing is written (not even
        recency). By default a normal open: backends that can open read-only
        override it and return a handle whose `read_only` is True."""
        return cls.from_url(location, options)

    @classmethod
    def missing_store(cls, location: str) -> str | None:
        """Why there is no store at `location` (a URL's location), e.g. "directory
        /x does not exist"; None if there is one or the backend cannot tell
        without opening it (the default). `sippcache.open(must_exist=True)`
        raises `NoStore` with this reason."""
        return None

    @classmethod
    def _from_url(cls, location: str, options: Mapping[str, str], **fixed: Any) -> BaseBackend:
        """`cls(location, **options, **fixed)`, the options coerced to their types."""
        kwargs = coerce_options(cls.__name__, options, cls.options)
        build = cast(Callable[..., BaseBackend], cls)  # a concrete subclass: its own __init__ takes the location
        try:
            return build(location, **kwargs, **fixed)
        except ValueError as exc:  # out-of-range values, a missing or extra path
            raise BadOption(f"{cls.__name__}: {exc}") from exc

    # -- public API: validate, then delegate ---------------------------------

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
        """See `CacheBackend.store`; checks the tokens, namespace, blob and options first."""
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
        self._check_writable()
        with self._library_errors_translated():
            return self._store(key, view if view.contiguous else memoryview(view.tobytes()), namespace, options)

    def lookup(self, tokens: Tokens, *, namespace: str = "", partial: bool = False, touch: bool = True) -> Match | None:
        """See `CacheBackend.lookup`; an empty query is a miss."""
        key = self._query_key(tokens, namespace)
        if not key:
            return None
        with self._library_errors_translated():
            return self._lookup(key, namespace, bool(partial), bool(touch))

    def lookup_prefixes(
        self, tokens: Tokens, lengths: Sequence[int], *, namespace: str = "", touch: bool = True
    ) -> list[Match]:
        """See `CacheBackend.lookup_prefixes`; checks that `lengths` ascend within the query."""
        key = self._query_key(tokens, namespace)
        wanted = _chain_lengths(key, lengths)
        if not wanted:
            return []
        with self._library_errors_translated():
            return self._lookup_prefixes(key, wanted, namespace, bool(touch))

    def touch_prefixes(self, tokens: Tokens, lengths: Sequence[int], *, namespace: str = "") -> int:
        """See `CacheBackend.touch_prefixes`; checks `lengths` as `lookup_prefixes` does."""
        key = self._query_key(tokens, namespace)
        wanted = _chain_lengths(key, lengths)
        if not wanted:
            return 0
        with self._library_errors_translated():
            return self._touch_prefixes(key, wanted, namespace)

    def peek(self, tokens: Tokens, *, namespace: str = "", partial: bool = False) -> Peek | None:
        """See `CacheBackend.peek`; an empty query finds nothing."""
        key = self._query_key(tokens, namespace)
        if not key:
            return None
        with self._library_errors_translated():
            return self._peek(key, namespace, bool(partial))

    def delete(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """See `CacheBackend.delete`."""
        key = self._query_key(tokens, namespace)
        self._check_writable()
        with self._library_errors_translated():
            return bool(key) and self._delete(key, namespace)

    def touch(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """See `CacheBackend.touch`."""
        key = self._query_key(tokens, namespace)
        with self._library_errors_translated():
            return bool(key) and self._touch_entry(key, namespace)

    def pin(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """See `CacheBackend.pin`."""
        return self._pin(tokens, namespace, True)

    def unpin(self, tokens: Tokens, *, namespace: str = "") -> bool:
        """See `CacheBackend.unpin`."""
        return self._pin(tokens, namespace, False)

    def _pin(self, tokens: Tokens, namespace: str, pinned: bool) -> bool:
        key = self._query_key(tokens, namespace)
        self._check_writable()
        with self._library_errors_translated():
            return bool(key) and self._set_pinned(key, namespace, pinned)

    def clear(self) -> None:
        """See `CacheBackend.clear`."""
        self._check_open()
        self._check_writable()
        with self._library_errors_translated():
            self._clear()

    def stats(self) -> Stats:
        """See `CacheBackend.stats`."""
        self._check_open()
        with self._library_errors_translated():
            return self._stats()

    def entries(self, namespace: str | None = None) -> Iterator[EntryInfo]:
        """See `CacheBackend.entries`."""
        if namespace is not None:
            _check_namespace(namespace)
        self._check_open()
        with self._library_errors_translated():
            return iter(self._entries(namespace))

    def namespaces(self) -> list[str]:
        """See `CacheBackend.namespaces`."""
        self._check_open()
        with self._library_errors_translated():
            return sorted(self._namespaces())

    def __len__(self) -> int:
        self._check_open()
        with self._library_errors_translated():
            return self._len()

    def purge_damaged(self) -> int:
        """Remove entries whose index record is unreadable now, rather than on the
        next write; how many there were (0 for backends that have none to remove)."""
        self._check_open()
        self._check_writable()
        with self._library_errors_translated():
            return self._remove_damaged()

    def close(self) -> None:
        """See `CacheBackend.close`; closing twice does nothing."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def __enter__(self) -> BaseBackend:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @contextmanager
    def _library_errors_translated(self) -> Iterator[None]:
        try:
            yield
        except SippcacheError:
            raise
        except self.damage_errors + self.library_errors as exc:
            raise self._library_error(exc) from exc

    def _library_error(self, exc: BaseException) -> SippcacheError:
        """The sippcache error an exception of the backend's library becomes:
        `CorruptStore` for `damage_errors`, else `StoreError`. Override to tell
        more apart (a read-only store, say)."""
        if isinstance(exc, self.damage_errors):
            return CorruptStore(f"{type(self).__name__}: the store's files are damaged: {exc}")
        return StoreError(f"{type(self).__name__}: {exc}")

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosed(f"{type(self).__name__} is closed")

    def _check_writable(self) -> None:
        if self.read_only:
            where = getattr(self, "location", type(self).__name__)
            raise ReadOnlyStore(f"{where} is open read-only: it cannot be changed through this handle")

    def _query_key(self, tokens: Tokens, namespace: str) -> bytes:
        """The encoded key of a query (empty for no tokens), after the argument checks
        every keyed call makes, in the same order."""
        key = _tokens.encode(tokens)
        _check_namespace(namespace)
        self._check_open()
        return key

    # -- storage hooks -------------------------------------------------------

    def _lookup_prefixes(self, key: bytes, lengths: list[int], namespace: str, touch: bool) -> list[Match]:
        """`lookup_prefixes`: by default one lookup per length; override where one read can
        serve the chain (every built-in backend, and Redis in one round trip)."""
        matches: list[Match] = []
        try:
            for n in lengths:
                match = self._lookup(key[: 4 * n], namespace, False, touch)
                if match is not None and match.length != n:
                    match.release()
                    match = None
                if match is None:
                    break
                matches.append(match)
        except BaseException:
            for match in matches:
                match.release()
            raise
        return matches

    def _touch_prefixes(self, key: bytes, lengths: list[int], namespace: str) -> int:
        """`touch_prefixes`: by default one `_touch_entry` per length; override where the index
        can record the chain's uses at once (every built-in backend does)."""
        for count, n in enumerate(lengths):
            if not self._touch_entry(key[: 4 * n], namespace):
                return count
        return len(lengths)

    def _peek(self, key: bytes, namespace: str, partial: bool) -> Peek | None:
        """`peek`: by default a lookup that does not count as a use, its blob unread;
        override where the index can answer alone (every built-in backend does)."""
        match = self._lookup(key, namespace, partial, False)
        if match is None:
            return None
        with match:
            return Peek(match.length, len(match.key))

    def _remove_damaged(self) -> int:
        """`purge_damaged`: by default there is nothing to remove."""
        return 0

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

    def _namespaces(self) -> Iterable[str]:
        """The namespaces holding entries. This default lists every entry; a backend that indexes
        its entries (`sippcache.catalog.Catalog.namespaces`) answers from the index."""
        return {entry.namespace for entry in self._entries(None)}


def _check_namespace(namespace: Any) -> None:
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
    if len(namespace.encode("utf-8")) > 1024:
        raise ValueError("namespace is longer than 1024 bytes")


def _chain_lengths(key: bytes, lengths: Sequence[int]) -> list[int]:
    """`lengths` of a chain of prefixes of `key` (packed tokens) as a list, checked: ints ascending
    from 1 to at most the query's tokens."""
    wanted = list(lengths)
    if any(isinstance(n, bool) or not isinstance(n, int) for n in wanted):
        raise TypeError("lengths must be ints")
    if any(a >= b for a, b in zip([0, *wanted], wanted, strict=False)) or (wanted and wanted[-1] > len(key) // 4):
        raise ValueError(f"lengths must ascend from 1 to at most the {len(key) // 4} query tokens")
    return wanted

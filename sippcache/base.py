"""`BaseBackend`: what every backend shares, so a backend only writes its storage.

The public methods check their arguments (tokens, namespace, blob, store
options) in one order for every backend, refuse a closed handle, and turn the
backend library's damage errors into `CorruptStore`; then they call the
backend's `_store`, `_lookup`, ... hooks with validated arguments.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, ClassVar

from . import tokens as _tokens
from .errors import BadOption, CacheClosed, CorruptStore
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
        tokens: Tokens,
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
        self, tokens: Tokens, *, namespace: str = "", partial: bool = False, touch: bool = True
    ) -> Match | None:
        key = self._query_key(tokens, namespace)
        if not key:
            return None
        with self._damage_as_corrupt_store():
            return self._lookup(key, namespace, bool(partial), bool(touch))

    def peek(self, tokens: Tokens, *, namespace: str = "", partial: bool = False) -> Peek | None:
        key = self._query_key(tokens, namespace)
        if not key:
            return None
        with self._damage_as_corrupt_store():
            return self._peek(key, namespace, bool(partial))

    def delete(self, tokens: Tokens, *, namespace: str = "") -> bool:
        key = self._query_key(tokens, namespace)
        with self._damage_as_corrupt_store():
            return bool(key) and self._delete(key, namespace)

    def touch(self, tokens: Tokens, *, namespace: str = "") -> bool:
        key = self._query_key(tokens, namespace)
        with self._damage_as_corrupt_store():
            return bool(key) and self._touch_entry(key, namespace)

    def pin(self, tokens: Tokens, *, namespace: str = "") -> bool:
        return self._pin(tokens, namespace, True)

    def unpin(self, tokens: Tokens, *, namespace: str = "") -> bool:
        return self._pin(tokens, namespace, False)

    def _pin(self, tokens: Tokens, namespace: str, pinned: bool) -> bool:
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

    def _query_key(self, tokens: Tokens, namespace: str) -> bytes:
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

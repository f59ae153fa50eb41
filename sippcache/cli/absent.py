"""The default store before anything created it, shown as an empty store.

A new user's first ``sippcache stats`` (or ``ls``, ``verify``) names no store,
so it reads the default one (LMDB in the user cache folder), which the first
store creates. Until then the reporting commands show it as empty, with its
location and that it does not exist yet, instead of failing; nothing is
created. A store the user named (an argument, ``--cache``, ``SIPPCACHE_URL``)
that is not there stays an error: a typo must not look like an empty cache.
"""

from __future__ import annotations

import os
from typing import ClassVar

from ..base import BaseBackend
from ..engine.directory import directory_path
from ..protocol import EntryInfo, Match, Stats, StoreOptions
from ..registry import backend_class, parse_url


class AbsentStore(BaseBackend):
    """An empty, read-only stand-in for the store `url` names, which does not exist
    yet: its `stats` give the backend, the location and the limits a store made
    there would start with (the backend's defaults); it has no entries. Writes raise
    `ReadOnlyStore` (a command that writes must create the store, or refuse)."""

    persistent: ClassVar[bool] = True

    def __init__(self, url: str, backend: type, reason: str) -> None:
        super().__init__(read_only=True)
        self.location = url
        #: Why there is no store (``directory /x does not exist``).
        self.reason = reason
        self._backend = backend.__name__
        max_bytes = getattr(backend, "default_max_bytes", None)
        self._max_bytes = max_bytes if isinstance(max_bytes, int) else None

    def _store(self, key: bytes, blob: memoryview, namespace: str, options: StoreOptions) -> bool:
        return False  # never reached: the handle is read-only

    def _lookup(self, key: bytes, namespace: str, partial: bool, touch: bool) -> Match | None:
        return None

    def _delete(self, key: bytes, namespace: str) -> bool:
        return False

    def _set_pinned(self, key: bytes, namespace: str, pinned: bool) -> bool:
        return False

    def _clear(self) -> None:
        pass

    def _stats(self) -> Stats:
        return Stats(
            backend=self._backend,
            location=self.location,
            entries=0,
            bytes=0,
            max_bytes=self._max_bytes,
            max_entries=None,
            namespaces=0,
        )

    def _len(self) -> int:
        return 0

    def _entries(self, namespace: str | None) -> list[EntryInfo]:
        return []

    def _close(self) -> None:
        pass


def absent_store(url: str) -> AbsentStore | None:
    """An `AbsentStore` for `url` if its backend says there is no store there and the
    first store would make one: its directory does not exist, or holds no store files
    yet. None if there is a store, if the backend cannot tell, if the URL has options
    (the default has none), or if something else is in the way (a file where the
    directory goes): those stay errors."""
    name, location, options = parse_url(url)
    if options:
        return None
    backend = backend_class(name)
    missing = getattr(backend, "missing_store", None)
    reason = missing(location) if missing is not None else None
    if not isinstance(reason, str):
        return None
    path = directory_path(name, location)
    if os.path.lexists(path) and not os.path.isdir(path):
        return None
    return AbsentStore(url, backend, reason)

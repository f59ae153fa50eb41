"""What every part of the conformance suite stands on: the fixtures that open the
store under test, and small helpers to build URLs and read matches.

Each mixin derives from `BackendFixtures`, so a mixin alone (with a `cache_url`
fixture) is a runnable suite: an author can run a subset while building a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode

import pytest

import sippcache
from sippcache import CacheBackend, Match

#: `open_cache`'s type: open the store under test with extra URL options (`max_bytes=3500`).
Opener = Callable[..., CacheBackend]


def url_with_options(url: str, options: dict[str, Any]) -> str:
    """`url` with `options` added to (or replacing those in) its query string."""
    base, _, query = url.partition("?")
    merged = dict(parse_qsl(query, keep_blank_values=True))
    merged.update({name: str(value) for name, value in options.items()})
    return f"{base}?{urlencode(merged)}" if merged else base


def blob_of(match: Match | None) -> bytes | None:
    """The match's bytes (released afterwards), or None for a miss."""
    if match is None:
        return None
    with match:
        return bytes(match.blob)


class BackendFixtures:
    """The fixtures the tests use. Subclasses provide `cache_url`: a fresh, empty store's URL."""

    @pytest.fixture
    def cache_url(self) -> str:
        """Overridden by every concrete test class."""
        raise NotImplementedError("subclasses provide a cache_url fixture returning a fresh store's URL")

    @pytest.fixture
    def open_cache(self, cache_url: str) -> Iterator[Opener]:
        """Open the store under test with extra URL options; closed at teardown."""
        opened: list[CacheBackend] = []

        def opener(**options: Any) -> CacheBackend:
            cache = sippcache.open(url_with_options(cache_url, options))
            opened.append(cache)
            return cache

        yield opener
        for cache in opened:
            cache.close()

    @pytest.fixture
    def cache(self, open_cache: Opener) -> CacheBackend:
        """The store under test, opened with the URL as given."""
        return open_cache()

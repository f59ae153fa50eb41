"""What the store accepts and refuses as tokens, blobs, namespaces, store options
and URL options: a refused call raises and writes nothing.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest

import sippcache
from sippcache import CacheBackend

from .fixtures import BackendFixtures, blob_of, url_with_options


class InputTests(BackendFixtures):
    """Token sequence types that work, and bad arguments that are rejected."""

    def test_token_sequence_types(self, cache: CacheBackend) -> None:
        numpy = pytest.importorskip("numpy")
        cache.store(array("i", [9, 8, 7]), b"x")
        for query in (
            [9, 8, 7],
            (9, 8, 7),
            array("I", [9, 8, 7]),
            array("q", [9, 8, 7]),
            numpy.array([9, 8, 7], dtype=numpy.int32),
            numpy.array([9, 8, 7], dtype=numpy.int64),
            numpy.array([9, 8, 7], dtype=numpy.uint32),
            range(9, 6, -1),
        ):
            assert blob_of(cache.lookup(query)) == b"x", type(query)
        assert cache.delete(numpy.array([9, 8, 7], dtype=numpy.int64))

    def test_largest_token_id(self, cache: CacheBackend) -> None:
        top = 2**31 - 1
        cache.store([0, top], b"edge")
        assert blob_of(cache.lookup([0, top, top])) == b"edge"

    @pytest.mark.parametrize(
        "tokens, error, position",
        [
            ([1, -1, 2], ValueError, "position 1"),
            ([0, 1, 2**31], ValueError, "position 2"),
            ([1, 2**70], ValueError, "position 1"),
            ([1.0, 2], TypeError, "position 0"),
            ("abc", TypeError, "str"),
            (b"abc", TypeError, "bytes"),
            ([1, None], TypeError, "position 1"),
        ],
    )
    def test_bad_tokens_rejected_and_nothing_written(
        self, cache: CacheBackend, tokens: Any, error: type, position: str
    ) -> None:
        for call in (lambda: cache.store(tokens, b"x"), lambda: cache.lookup(tokens), lambda: cache.delete(tokens)):
            with pytest.raises(error, match=position):
                call()
        assert len(cache) == 0

    def test_empty_sequences(self, cache: CacheBackend) -> None:
        with pytest.raises(ValueError, match="empty"):
            cache.store([], b"x")
        assert cache.lookup([]) is None
        assert cache.lookup([], partial=True) is None
        assert cache.delete([]) is False
        assert len(cache) == 0

    @pytest.mark.parametrize(
        "blob, error", [(b"", ValueError), ("text", TypeError), (None, TypeError), (123, TypeError)]
    )
    def test_bad_blob_rejected(self, cache: CacheBackend, blob: Any, error: type) -> None:
        with pytest.raises(error):
            cache.store([1, 2], blob)
        assert len(cache) == 0

    def test_bad_namespace_rejected(self, cache: CacheBackend) -> None:
        with pytest.raises(TypeError):
            cache.store([1], b"x", namespace=None)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cache.lookup([1], namespace=b"ns")  # type: ignore[arg-type]
        assert len(cache) == 0

    @pytest.mark.parametrize(
        "options, error",
        [
            ({"priority": -1}, ValueError),
            ({"priority": float("nan")}, ValueError),
            ({"priority": "high"}, TypeError),
            ({"priority": True}, TypeError),
            ({"pinned": 1}, TypeError),
            ({"pinned": None}, TypeError),
            ({"generation": -1}, ValueError),
            ({"generation": 2**63}, ValueError),
            ({"generation": 1.5}, TypeError),
        ],
    )
    def test_bad_retention_options_rejected(self, cache: CacheBackend, options: dict[str, Any], error: type) -> None:
        with pytest.raises(error):
            cache.store([1, 2], b"x", **options)
        assert len(cache) == 0

    def test_unknown_option_rejected(self, cache_url: str) -> None:
        with pytest.raises(sippcache.BadOption, match="no_such_option"):
            sippcache.open(url_with_options(cache_url, {"no_such_option": 1}))
        with pytest.raises(sippcache.BadOption, match="max_bytes"):
            sippcache.open(url_with_options(cache_url, {"max_bytes": "lots"}))

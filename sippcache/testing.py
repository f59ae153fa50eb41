"""The conformance suite every backend runs unchanged, built-in or third-party.

Subclass `BackendTests` in a test module and give it one fixture, `cache_url`,
returning the URL of a fresh, empty store (the backend must be installed, so
its entry point resolves). Persistent backends also mix in
`PersistentBackendTests`::

    import pytest
    from sippcache.testing import BackendTests, PersistentBackendTests

    class TestMyBackend(PersistentBackendTests, BackendTests):
        @pytest.fixture
        def cache_url(self, tmp_path):
            return f"mybackend://{tmp_path}/store"

The suite opens stores through `sippcache.open`, so the URL scheme, the
entry point and the shared options (`max_bytes`, `max_entries`) are tested
too. Needs pytest (and numpy for the array-type test).
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode

import pytest

import sippcache
from sippcache import CacheBackend, CacheClosed, Match

Opener = Callable[..., CacheBackend]


def _with_options(url: str, options: dict[str, Any]) -> str:
    """`url` with `options` added to (or replacing those in) its query string."""
    base, _, query = url.partition("?")
    merged = dict(parse_qsl(query, keep_blank_values=True))
    merged.update({name: str(value) for name, value in options.items()})
    return f"{base}?{urlencode(merged)}" if merged else base


def _blob(match: Match | None) -> bytes | None:
    """The match's bytes (released afterwards), or None for a miss."""
    if match is None:
        return None
    with match:
        return bytes(match.blob)


class BackendTests:
    """Behaviour every `CacheBackend` must have. Provide the `cache_url` fixture."""

    @pytest.fixture
    def cache_url(self) -> str:
        raise NotImplementedError("subclasses provide a cache_url fixture returning a fresh store's URL")

    @pytest.fixture
    def open_cache(self, cache_url: str) -> Iterator[Opener]:
        """Open the store under test with extra URL options; closed at teardown."""
        opened: list[CacheBackend] = []

        def opener(**options: Any) -> CacheBackend:
            cache = sippcache.open(_with_options(cache_url, options))
            opened.append(cache)
            return cache

        yield opener
        for cache in opened:
            cache.close()

    @pytest.fixture
    def cache(self, open_cache: Opener) -> CacheBackend:
        return open_cache()

    # -- the protocol ----------------------------------------------------------

    def test_implements_protocol(self, cache: CacheBackend) -> None:
        assert isinstance(cache, CacheBackend)
        assert isinstance(type(cache).persistent, bool)

    def test_empty_store_misses(self, cache: CacheBackend) -> None:
        assert len(cache) == 0
        assert cache.lookup([1, 2, 3]) is None
        assert cache.lookup([1, 2, 3], partial=True) is None
        assert cache.stats().entries == 0

    def test_store_then_exact_lookup(self, cache: CacheBackend) -> None:
        cache.store([5, 6, 7], b"state")
        match = cache.lookup([5, 6, 7])
        assert match is not None
        with match:
            assert match.length == 3
            assert tuple(match.key) == (5, 6, 7)
            assert bytes(match.blob) == b"state"
        assert len(cache) == 1

    def test_longest_stored_prefix(self, cache: CacheBackend) -> None:
        cache.store([1], b"a")
        cache.store([1, 2], b"ab")
        cache.store([1, 2, 3], b"abc")
        cache.store([1, 2, 3, 4, 5, 6], b"abcdef")
        assert _blob(cache.lookup([1, 2, 3, 4])) == b"abc"
        assert _blob(cache.lookup([1, 2, 9])) == b"ab"
        assert _blob(cache.lookup([1, 7])) == b"a"
        assert _blob(cache.lookup([1, 2, 3, 4, 5, 6, 7])) == b"abcdef"
        assert cache.lookup([2, 1]) is None
        match = cache.lookup([1, 2, 3, 4, 5, 6, 0, 0])
        assert match is not None and match.length == 6 and tuple(match.key) == (1, 2, 3, 4, 5, 6)
        match.release()

    def test_prefix_lookup_never_returns_longer_key(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3], b"abc")
        assert cache.lookup([1, 2]) is None
        assert cache.lookup([1, 2, 4]) is None

    def test_partial_returns_longest_common_prefix(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3, 4, 5], b"long")
        cache.store([1, 2, 8], b"short")
        match = cache.lookup([1, 2, 3, 4, 9, 9], partial=True)
        assert match is not None
        with match:
            assert match.length == 4
            assert tuple(match.key) == (1, 2, 3, 4, 5)
            assert bytes(match.blob) == b"long"
        match = cache.lookup([1, 2, 3], partial=True)  # query shorter than the key
        assert match is not None and match.length == 3 and bytes(match.blob) == b"long"
        match.release()
        assert cache.lookup([7, 1, 2], partial=True) is None

    def test_partial_exact_and_prefix_keys_count_as_common(self, cache: CacheBackend) -> None:
        cache.store([4, 5], b"prefix")
        match = cache.lookup([4, 5, 6], partial=True)
        assert match is not None and match.length == 2 and bytes(match.blob) == b"prefix"
        match.release()

    def test_partial_tie_goes_to_most_recently_used(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3, 5], b"first")
        cache.store([1, 2, 3, 6], b"second")
        assert _blob(cache.lookup([1, 2, 3, 7], partial=True)) == b"second"
        assert _blob(cache.lookup([1, 2, 3, 5])) == b"first"  # a hit is a use
        assert _blob(cache.lookup([1, 2, 3, 7], partial=True)) == b"first"

    def test_peek_answers_as_lookup_would_without_using(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        cache.store([1, 2, 3], bytes(1000))
        cache.store([1, 2, 3, 4, 5, 6], bytes(1000))
        cache.store([9], bytes(1000))
        assert cache.peek([1, 2, 3, 4, 7]) == sippcache.Peek(3, 3)
        assert cache.peek([1, 2, 3, 4, 7], partial=True) == sippcache.Peek(4, 6)
        assert cache.peek([1, 2, 3, 4, 5, 6, 7]) == sippcache.Peek(6, 6)
        assert cache.peek([2]) is None and cache.peek([]) is None and cache.peek([1, 2, 3], namespace="x") is None
        for query, partial in (([1, 2, 3, 4, 7], False), ([1, 2, 3, 4, 7], True), ([9, 9], False)):
            peeked, match = cache.peek(query, partial=partial), cache.lookup(query, partial=partial, touch=False)
            assert match is not None and peeked == sippcache.Peek(match.length, len(match.key))
            match.release()
        for _ in range(5):
            cache.peek([1, 2, 3])  # not a use: [1, 2, 3] stays the least recently used
        cache.store([8], bytes(1000))
        assert cache.lookup([1, 2, 3], touch=False) is None

    def test_token_sequence_types(self, cache: CacheBackend) -> None:
        numpy = pytest.importorskip("numpy")
        cache.store(array("i", [9, 8, 7]), b"x")
        for query in ([9, 8, 7], (9, 8, 7), array("I", [9, 8, 7]), array("q", [9, 8, 7]),
                      numpy.array([9, 8, 7], dtype=numpy.int32), numpy.array([9, 8, 7], dtype=numpy.int64),
                      numpy.array([9, 8, 7], dtype=numpy.uint32), range(9, 6, -1)):  # fmt: skip
            assert _blob(cache.lookup(query)) == b"x", type(query)
        assert cache.delete(numpy.array([9, 8, 7], dtype=numpy.int64))

    def test_largest_token_id(self, cache: CacheBackend) -> None:
        top = 2**31 - 1
        cache.store([0, top], b"edge")
        assert _blob(cache.lookup([0, top, top])) == b"edge"

    @pytest.mark.parametrize(
        "tokens, error, position",
        [([1, -1, 2], ValueError, "position 1"), ([0, 1, 2**31], ValueError, "position 2"),
         ([1, 2**70], ValueError, "position 1"), ([1.0, 2], TypeError, "position 0"),
         ("abc", TypeError, "str"), (b"abc", TypeError, "bytes"), ([1, None], TypeError, "position 1")],
    )  # fmt: skip
    def test_bad_tokens_rejected_and_nothing_written(
        self, cache: CacheBackend, tokens: Any, error: type, position: str
    ) -> None:
        for call in (lambda: cache.store(tokens, b"x"), lambda: cache.lookup(tokens),
                     lambda: cache.delete(tokens)):  # fmt: skip
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

    @pytest.mark.parametrize("blob, error", [(b"", ValueError), ("text", TypeError), (None, TypeError), (123, TypeError)])
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

    def test_blob_is_copied_on_store(self, cache: CacheBackend) -> None:
        data = bytearray(b"original")
        cache.store([3], data)
        data[:] = b"mutated!"
        assert _blob(cache.lookup([3])) == b"original"
        cache.store([4], memoryview(b"abcdef")[1:4])
        assert _blob(cache.lookup([4])) == b"bcd"

    def test_overwrite_replaces(self, cache: CacheBackend) -> None:
        cache.store([1, 2], b"old")
        cache.store([1, 2], b"new, longer")
        assert len(cache) == 1
        assert _blob(cache.lookup([1, 2, 3])) == b"new, longer"
        assert cache.stats().bytes == len(b"new, longer") + 2 * 4

    def test_delete(self, cache: CacheBackend) -> None:
        cache.store([1], b"a")
        cache.store([1, 2], b"ab")
        assert cache.delete([1, 2]) is True
        assert cache.delete([1, 2]) is False
        assert cache.delete([1, 2, 3]) is False
        assert _blob(cache.lookup([1, 2, 3])) == b"a"
        assert len(cache) == 1

    def test_clear(self, cache: CacheBackend) -> None:
        for i in range(10):
            cache.store([i, i], b"x" * (i + 1), namespace=f"ns{i % 3}")
        cache.clear()
        assert len(cache) == 0
        assert cache.stats().bytes == 0
        assert cache.lookup([1, 1], namespace="ns1") is None
        cache.store([1, 1], b"again", namespace="ns1")
        assert _blob(cache.lookup([1, 1], namespace="ns1")) == b"again"

    def test_namespaces_are_isolated(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3], b"tenant-a", namespace="a")
        cache.store([1, 2], b"tenant-b", namespace="b")
        assert _blob(cache.lookup([1, 2, 3, 4], namespace="a")) == b"tenant-a"
        assert _blob(cache.lookup([1, 2, 3, 4], namespace="b")) == b"tenant-b"
        assert cache.lookup([1, 2, 3, 4]) is None
        assert cache.lookup([1, 2, 3], namespace="c", partial=True) is None
        assert cache.delete([1, 2, 3], namespace="b") is False
        assert cache.delete([1, 2, 3], namespace="a") is True
        assert _blob(cache.lookup([1, 2, 3], namespace="b")) == b"tenant-b"
        assert cache.stats().namespaces == 1

    def test_namespaces_with_tricky_names(self, cache: CacheBackend) -> None:
        names = ["", "a", "a\x00", "\x00a", "ü/é:?&=#", "x" * 1000]
        for i, name in enumerate(names):
            cache.store([7, 7], bytes([i + 1]), namespace=name)
        for i, name in enumerate(names):
            assert _blob(cache.lookup([7, 7], namespace=name)) == bytes([i + 1])
        assert len(cache) == len(names)

    def test_one_token_keys(self, cache: CacheBackend) -> None:
        for t in range(0, 2000, 7):
            cache.store([t], t.to_bytes(4, "little"))
        for t in range(0, 2000, 7):
            assert _blob(cache.lookup([t, 1, 2])) == t.to_bytes(4, "little")
        assert cache.lookup([1]) is None

    def test_chain_of_prefix_keys(self, cache: CacheBackend) -> None:
        base = list(range(100, 150))
        for n in range(1, 51):
            cache.store(base[:n], str(n).encode())
        for n in range(1, 51, 5):
            assert _blob(cache.lookup(base[:n] + [0])) == str(n).encode()
        for n in range(2, 50, 2):
            assert cache.delete(base[:n])
        assert _blob(cache.lookup(base[:20])) == b"19"
        assert _blob(cache.lookup(base)) == b"50"
        assert len(cache) == 26

    def test_hundred_thousand_token_key(self, cache: CacheBackend) -> None:
        rng = random.Random(1)
        key = [rng.randrange(2**31) for _ in range(100_000)]
        cache.store(key, b"long key")
        match = cache.lookup(key + [1, 2, 3])
        assert match is not None
        with match:
            assert match.length == 100_000 and list(match.key) == key
        diverging = key[:60_000] + [key[60_000] ^ 1]
        match = cache.lookup(diverging, partial=True)
        assert match is not None and match.length == 60_000
        match.release()
        assert cache.lookup(key[:-1]) is None

    def test_large_blob(self, cache: CacheBackend) -> None:
        blob = random.Random(2).randbytes(24 * 1024 * 1024)
        cache.store([1, 2, 3], blob)
        match = cache.lookup([1, 2, 3, 4])
        assert match is not None
        with match:
            assert len(match.blob) == len(blob)
            assert bytes(match.blob) == blob

    def test_max_bytes_evicts_least_recently_used(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i], bytes(1000))  # 1004 bytes each with the key
        assert _blob(cache.lookup([0])) is not None  # entry 0 becomes the most recent
        cache.store([3], bytes(1000))
        assert cache.lookup([1]) is None  # the least recently used went
        for i in (0, 2, 3):
            assert cache.lookup([i]) is not None
        stats = cache.stats()
        assert stats.entries == 3 and stats.bytes <= 3500 and stats.evictions >= 1

    def test_lookup_without_touch_leaves_recency_alone(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i], bytes(1000))
        assert _blob(cache.lookup([0], touch=False)) is not None
        cache.store([3], bytes(1000))
        assert cache.lookup([0]) is None and cache.lookup([1]) is not None
        assert [tuple(e.key) for e in cache.entries()][-1] == (1,)

    def test_byte_budget_holds_under_churn(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=20_000)
        rng = random.Random(3)
        for i in range(300):
            cache.store([rng.randrange(50), i], bytes(rng.randrange(1, 3000)))
            if i % 7 == 0:
                cache.lookup([rng.randrange(50)], partial=True)
            assert cache.stats().bytes <= 20_000
        assert len(cache) > 0

    def test_oversized_entry_refused_without_evicting(
        self, open_cache: Opener, caplog: pytest.LogCaptureFixture
    ) -> None:
        cache = open_cache(max_bytes=10_000)
        cache.store([1], bytes(3000))
        cache.store([2], bytes(3000))
        with caplog.at_level(logging.WARNING, logger="sippcache"):
            cache.store([3], bytes(10_000))
        assert "max_bytes" in caplog.text
        assert cache.lookup([3]) is None
        assert cache.lookup([1]) is not None and cache.lookup([2]) is not None
        assert len(cache) == 2 and cache.stats().refused == 1

    # -- retention: priorities, pins, supersession, generations --------------------

    def test_default_priority_is_the_token_count(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3], b"x")
        cache.store([4], b"y", priority=7.5)
        info = {tuple(e.key): e for e in cache.entries()}
        assert info[(1, 2, 3)].priority == 3 and info[(4,)].priority == 7.5
        assert not info[(1, 2, 3)].pinned

    def test_lowest_priority_is_evicted_first(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)  # room for three 1,004-byte entries
        for key, priority in (([1], 30), ([2], 10), ([3], 20)):
            cache.store(key, bytes(1000), priority=priority)
        cache.store([4], bytes(1000), priority=40)
        assert cache.lookup([2], touch=False) is None
        cache.store([5], bytes(1000), priority=40)
        assert cache.lookup([3], touch=False) is None
        assert all(cache.lookup([k], touch=False) is not None for k in (1, 4, 5))
        assert cache.stats().evictions == 2

    def test_equal_priorities_evict_least_recently_used(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i], bytes(1000), priority=5)
        assert _blob(cache.lookup([0])) is not None
        cache.store([3], bytes(1000), priority=5)
        assert cache.lookup([1], touch=False) is None
        assert all(cache.lookup([k], touch=False) is not None for k in (0, 2, 3))

    def test_touch_counts_as_a_use(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        for i in range(3):
            cache.store([i, i], bytes(1000))
        assert cache.touch([0, 0]) is True
        assert cache.touch([0]) is False and cache.touch([0, 0, 0]) is False  # exactly the key, or nothing
        assert cache.touch([0, 0], namespace="other") is False and cache.touch([]) is False
        assert (cache.stats().hits, cache.stats().misses) == (0, 0)  # a touch is not a lookup
        cache.store([3, 3], bytes(1000))
        assert cache.lookup([1, 1], touch=False) is None
        assert cache.lookup([0, 0], touch=False) is not None

    def test_pinned_entry_survives_a_flood(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=20_000)
        system = list(range(1000, 1500))  # 500 tokens: 2,000 key bytes + 1,000 blob bytes
        assert cache.store(system, b"s" * 1000, pinned=True)
        for i in range(400):  # 400 kB of one-off prompts through a 20 kB budget
            cache.store([i, i + 1, i + 2], bytes(1000))
            assert cache.stats().bytes <= 20_000
        assert _blob(cache.lookup(system + [7])) == b"s" * 1000
        entry = next(e for e in cache.entries() if tuple(e.key) == tuple(system))
        assert entry.pinned
        stats = cache.stats()
        assert (stats.pinned, stats.pinned_bytes) == (1, 3000) and stats.evictions > 300

    def test_pin_and_unpin(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        cache.store([1], bytes(1000))
        assert cache.pin([1]) is True
        assert cache.pin([1]) is True  # already pinned
        assert cache.pin([9]) is False and cache.unpin([9]) is False
        assert cache.pin([1], namespace="other") is False
        for i in range(2, 10):
            cache.store([i], bytes(1000))
        assert cache.lookup([1], touch=False) is not None
        assert cache.unpin([1]) is True
        assert not next(e for e in cache.entries() if tuple(e.key) == (1,)).pinned
        for i in range(10, 14):
            cache.store([i], bytes(1000))
        assert cache.lookup([1], touch=False) is None
        assert cache.stats().pinned == 0

    def test_a_store_keeps_a_pin(self, cache: CacheBackend) -> None:
        cache.store([1, 2], b"old", pinned=True)
        cache.store([1, 2], b"new")
        assert _blob(cache.lookup([1, 2])) == b"new"
        assert next(iter(cache.entries())).pinned

    def test_pins_beyond_the_budget_are_refused(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=2500)
        assert cache.store([1], bytes(1000), pinned=True)
        assert cache.store([2], bytes(1000), pinned=True)
        with pytest.raises(sippcache.CacheFull, match="pin"):
            cache.store([3], bytes(1000), pinned=True)
        assert cache.lookup([3], touch=False) is None
        assert cache.lookup([1], touch=False) is not None and cache.lookup([2], touch=False) is not None
        assert cache.stats().pinned == 2
        assert cache.store([6], bytes(600)) is False  # no unpinned room left
        assert cache.stats().refused >= 1

    def test_pinned_entries_count_against_max_entries(self, open_cache: Opener) -> None:
        cache = open_cache(max_entries=2)
        cache.store([1], b"a", pinned=True)
        cache.store([2], b"b", pinned=True)
        with pytest.raises(sippcache.CacheFull):
            cache.store([3], b"c", pinned=True)
        assert cache.store([4], b"d") is False
        assert len(cache) == 2

    def test_superseded_entry_goes_first(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=4 * 1100)  # room for four entries of 1,000 + 4 * 20 bytes
        old = list(range(100, 120))
        cache.store(list(range(500, 520)), bytes(1000))  # the oldest
        cache.store(old, bytes(1000))
        cache.store(old[:15] + list(range(600, 605)), bytes(1000))  # shares 15 of old's 20 tokens
        cache.store(list(range(700, 720)), bytes(1000))
        cache.store(list(range(800, 820)), bytes(1000))  # over budget: `old` goes, not the oldest
        assert cache.lookup(old, touch=False) is None
        assert cache.lookup(list(range(500, 520)), touch=False) is not None

    def test_a_use_clears_supersession(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=4 * 1100)
        old = list(range(100, 120))
        cache.store(list(range(500, 520)), bytes(1000))
        cache.store(old, bytes(1000))
        cache.store(old + [1, 2, 3], bytes(1000))  # the next turn: supersedes `old`
        assert _blob(cache.lookup(old + [9])) is not None  # used again: valuable again
        cache.store(list(range(700, 720)), bytes(1000))
        cache.store(list(range(800, 820)), bytes(1000))
        assert cache.lookup(old, touch=False) is not None
        assert cache.lookup(list(range(500, 520)), touch=False) is None

    def test_a_shorter_entry_supersedes_nothing(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3 * 1100)
        cache.store(list(range(500, 520)), bytes(1000))
        cache.store(list(range(100, 120)), bytes(1000))
        cache.store(list(range(100, 110)), bytes(1040))  # a checkpoint inside the entry above
        cache.store(list(range(700, 720)), bytes(1000))
        assert cache.lookup(list(range(500, 520)), touch=False) is None  # plain LRU
        assert cache.lookup(list(range(100, 120)), touch=False) is not None

    def test_an_older_generation_never_replaces_a_newer_one(self, cache: CacheBackend) -> None:
        assert cache.store([1, 2], b"newer", generation=20) is True
        assert cache.store([1, 2], b"older", generation=10) is False
        assert _blob(cache.lookup([1, 2])) == b"newer"
        assert next(iter(cache.entries())).generation == 20
        assert cache.stats().stale == 1
        assert cache.store([1, 2], b"newest", generation=30) is True
        assert _blob(cache.lookup([1, 2])) == b"newest"
        assert cache.store([1, 2], b"same generation", generation=30) is True  # ties replace

    def test_default_generation_is_the_time_of_the_store(self, cache: CacheBackend) -> None:
        before = time.time_ns()
        cache.store([1], b"x")
        assert before <= next(iter(cache.entries())).generation <= time.time_ns()
        assert cache.store([1], b"from the past", generation=before - 10**9) is False

    @pytest.mark.parametrize(
        "options, error",
        [({"priority": -1}, ValueError), ({"priority": float("nan")}, ValueError), ({"priority": "high"}, TypeError),
         ({"priority": True}, TypeError), ({"pinned": 1}, TypeError), ({"pinned": None}, TypeError),
         ({"generation": -1}, ValueError), ({"generation": 2**63}, ValueError), ({"generation": 1.5}, TypeError)],
    )  # fmt: skip
    def test_bad_retention_options_rejected(self, cache: CacheBackend, options: dict[str, Any], error: type) -> None:
        with pytest.raises(error):
            cache.store([1, 2], b"x", **options)
        assert len(cache) == 0

    def test_an_open_match_outlives_delete_overwrite_eviction_and_clear(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=5000)
        blobs = {i: bytes([i]) * 1000 for i in range(4)}
        for i, blob in blobs.items():
            cache.store([i], blob)
        held = {i: cache.lookup([i], touch=False) for i in blobs}
        cache.delete([0])
        cache.store([1], b"replaced" * 100)
        for i in range(10, 20):  # evicts 2 and 3
            cache.store([i], bytes(1000))
        assert cache.lookup([2], touch=False) is None
        cache.clear()
        for i, match in held.items():
            assert match is not None
            with match:
                assert bytes(match.blob) == blobs[i]

    def test_max_entries(self, open_cache: Opener) -> None:
        cache = open_cache(max_entries=5)
        for i in range(8):
            cache.store([i], b"x")
        assert len(cache) == 5
        assert cache.lookup([2]) is None and cache.lookup([3]) is not None

    def test_unknown_option_rejected(self, cache_url: str) -> None:
        with pytest.raises(sippcache.BadOption, match="no_such_option"):
            sippcache.open(_with_options(cache_url, {"no_such_option": 1}))
        with pytest.raises(sippcache.BadOption, match="max_bytes"):
            sippcache.open(_with_options(cache_url, {"max_bytes": "lots"}))

    def test_stats_counts(self, cache: CacheBackend) -> None:
        cache.store([1, 2], b"abc")
        _blob(cache.lookup([1, 2, 3]))
        assert cache.lookup([9]) is None
        stats = cache.stats()
        assert (stats.entries, stats.bytes, stats.hits, stats.misses, stats.stores) == (1, 3 + 8, 1, 1, 1)

    def test_entries_lists_every_entry_least_recently_used_first(self, cache: CacheBackend) -> None:
        before = time.time()
        cache.store([1, 2], b"aa", namespace="x")
        cache.store([3], b"bbb", namespace="y")
        cache.store([4, 5, 6], b"c", namespace="x")
        assert cache.lookup([1, 2], namespace="x") is not None  # now the most recent
        listed = list(cache.entries())
        assert [(e.namespace, tuple(e.key), e.size) for e in listed] == [
            ("y", (3,), 3 + 4), ("x", (4, 5, 6), 1 + 12), ("x", (1, 2), 2 + 8)
        ]
        assert all(before - 1 <= e.created <= e.last_used <= time.time() + 1 for e in listed)
        assert [tuple(e.key) for e in cache.entries(namespace="x")] == [(4, 5, 6), (1, 2)]
        assert list(cache.entries(namespace="nobody")) == []

    def test_close(self, open_cache: Opener) -> None:
        cache = open_cache()
        with cache:
            cache.store([1], b"x")
        for call in (lambda: cache.store([1], b"x"), lambda: cache.lookup([1]), lambda: len(cache)):
            with pytest.raises(CacheClosed):
                call()
        cache.close()  # idempotent

    def test_match_release_is_idempotent(self, cache: CacheBackend) -> None:
        cache.store([1], b"x")
        match = cache.lookup([1])
        assert match is not None
        match.release()
        match.release()

    def test_threads_share_one_instance(self, cache: CacheBackend) -> None:
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            try:
                rng = random.Random(n)
                for i in range(150):
                    key = [n, i % 20, rng.randrange(4)]
                    cache.store(key, f"{n}-{key}".encode())
                    match = cache.lookup(key + [9])
                    assert match is not None
                    with match:
                        assert bytes(match.blob) == f"{n}-{key}".encode()
                    cache.lookup([rng.randrange(8)], partial=True)
                    if i % 10 == 0:
                        cache.delete([n, rng.randrange(20), rng.randrange(4)])
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "deadlock"
        assert not errors, errors
        assert 0 < len(cache) <= 8 * 80

    def test_matches_a_reference_model(self, cache: CacheBackend) -> None:
        """Random stores, deletes and lookups agree with a brute-force model."""
        rng = random.Random(4)
        model: dict[tuple[int, ...], bytes] = {}
        for step in range(400):
            key = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 7)))
            if rng.random() < 0.5:
                model[key] = f"{step}".encode()
                cache.store(key, model[key])
            elif rng.random() < 0.3:
                assert cache.delete(key) == (model.pop(key, None) is not None)
            query = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 9)))
            prefixes = [k for k in model if query[: len(k)] == k]
            expected = model[max(prefixes, key=len)] if prefixes and query else None
            assert _blob(cache.lookup(query)) == expected, (step, query)
            match = cache.lookup(query, partial=True)
            best = max((_common(k, query) for k in model), default=0)
            assert (match.length if match else 0) == best, (step, query)
            if match is not None:
                assert _common(tuple(match.key), query) == best
                assert model[tuple(match.key)] == bytes(match.blob)
                match.release()
        assert len(cache) == len(model)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_CHILD = textwrap.dedent(
    """
    import sys, sippcache
    url, action, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with sippcache.open(url) as cache:
        for i in range(first, first + count):
            if action == "store":
                cache.store([42, i], b"from-child-%d" % i)
            else:
                assert cache.delete([42, i])
    """
)


def run_in_child(url: str, action: str, first: int, count: int) -> subprocess.Popen[bytes]:
    """Start another Python process that stores (or deletes) keys [42, i] in the store at `url`."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(sippcache.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", _CHILD, url, action, str(first), str(count)], env=env)


def _wait(*children: subprocess.Popen[bytes]) -> None:
    for child in children:
        assert child.wait(timeout=120) == 0


class PersistentBackendTests:
    """Extra behaviour for backends whose `persistent` is True: mix into `BackendTests`."""

    def test_declares_persistent(self, cache: CacheBackend) -> None:
        assert type(cache).persistent is True

    def test_survives_close_and_reopen(self, open_cache: Opener) -> None:
        first = open_cache()
        first.store([1, 2, 3], b"kept", namespace="ns")
        first.store([1, 2], b"also kept")
        first.close()
        again = open_cache()
        assert len(again) == 2
        assert _blob(again.lookup([1, 2, 3, 4], namespace="ns")) == b"kept"
        assert _blob(again.lookup([1, 2, 3, 4])) == b"also kept"
        assert again.stats().bytes == len(b"kept") + len(b"also kept") + 5 * 4

    def test_recency_survives_reopen(self, open_cache: Opener) -> None:
        first = open_cache(max_bytes=3500)
        for i in range(3):
            first.store([i], bytes(1000))
        assert first.lookup([0]) is not None
        first.close()
        again = open_cache(max_bytes=3500)
        again.store([3], bytes(1000))
        assert again.lookup([1]) is None and again.lookup([0]) is not None

    def test_pin_beyond_this_handles_budget_is_refused(self, open_cache: Opener) -> None:
        roomy = open_cache(max_bytes=10_000)
        roomy.store([1], bytes(3000), pinned=True)
        roomy.store([2], bytes(3000))
        tight = open_cache(max_bytes=5000)
        with pytest.raises(sippcache.CacheFull, match="pin"):
            tight.pin([2])
        assert roomy.pin([2]) is True
        assert tight.stats().pinned == 2

    def test_pins_priorities_and_generations_survive_reopen(self, open_cache: Opener) -> None:
        first = open_cache()
        first.store([1, 2], b"pinned", pinned=True, generation=7)
        first.store([3], b"valued", priority=99.5)
        first.close()
        again = open_cache()
        info = {tuple(e.key): e for e in again.entries()}
        assert (info[(1, 2)].pinned, info[(1, 2)].generation) == (True, 7)
        assert (info[(3,)].priority, info[(3,)].pinned) == (99.5, False)
        assert again.store([1, 2], b"stale", generation=6) is False

    def test_generations_hold_across_processes(self, cache_url: str, cache: CacheBackend) -> None:
        cache.store([42, 0], b"newer", generation=2**62)
        _wait(run_in_child(cache_url, "store", 0, 3))  # generation: the child's clock, older
        assert _blob(cache.lookup([42, 0])) == b"newer"
        assert _blob(cache.lookup([42, 1])) == b"from-child-1"

    def test_two_handles_in_one_process(self, open_cache: Opener) -> None:
        a, b = open_cache(), open_cache()
        a.store([5, 5], b"from a")
        assert _blob(b.lookup([5, 5, 5])) == b"from a"
        b.delete([5, 5])
        assert a.lookup([5, 5]) is None
        a.close()
        b.store([6], b"b still works")
        assert _blob(b.lookup([6])) == b"b still works"

    def test_other_process_writes_are_visible_without_reopening(self, cache_url: str, cache: CacheBackend) -> None:
        cache.store([1], b"mine")
        assert cache.lookup([42, 0]) is None
        _wait(run_in_child(cache_url, "store", 0, 5))
        assert _blob(cache.lookup([42, 3, 7])) == b"from-child-3"
        assert len(cache) == 6
        _wait(run_in_child(cache_url, "delete", 0, 2))
        assert cache.lookup([42, 0]) is None
        assert len(cache) == 4
        assert _blob(cache.lookup([1])) == b"mine"

    def test_concurrent_writer_processes(self, cache_url: str, cache: CacheBackend) -> None:
        children = [run_in_child(cache_url, "store", n * 100, 40) for n in range(3)]
        for i in range(40):
            cache.store([43, i], b"parent")
        _wait(*children)
        assert len(cache) == 160
        for n in range(3):
            for i in range(n * 100, n * 100 + 40, 13):
                assert _blob(cache.lookup([42, i])) == b"from-child-%d" % i

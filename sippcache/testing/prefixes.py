"""Prefix matching: the longest stored prefix of a query, the longest common
prefix with `partial=True`, `peek`, which answers both without counting a use, and
`lookup_prefixes`, a chain of keys each a prefix of the next, read in one call.
"""

from __future__ import annotations

import random

import pytest

import sippcache
from sippcache import CacheBackend

from .fixtures import BackendFixtures, Opener, blob_of


class PrefixTests(BackendFixtures):
    """Lookups of queries longer than, shorter than or diverging from the stored keys."""

    def test_longest_stored_prefix(self, cache: CacheBackend) -> None:
        cache.store([1], b"a")
        cache.store([1, 2], b"ab")
        cache.store([1, 2, 3], b"abc")
        cache.store([1, 2, 3, 4, 5, 6], b"abcdef")
        assert blob_of(cache.lookup([1, 2, 3, 4])) == b"abc"
        assert blob_of(cache.lookup([1, 2, 9])) == b"ab"
        assert blob_of(cache.lookup([1, 7])) == b"a"
        assert blob_of(cache.lookup([1, 2, 3, 4, 5, 6, 7])) == b"abcdef"
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
        assert blob_of(cache.lookup([1, 2, 3, 7], partial=True)) == b"second"
        assert blob_of(cache.lookup([1, 2, 3, 5])) == b"first"  # a hit is a use
        assert blob_of(cache.lookup([1, 2, 3, 7], partial=True)) == b"first"

    def test_peek_answers_as_lookup_would_without_using(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        cache.store([1, 2, 3], bytes(1000))
        cache.store([1, 2, 3, 4, 5, 6], bytes(1000))
        cache.store([9], bytes(1000))
        assert _shape(cache.peek([1, 2, 3, 4, 7])) == (3, 3)
        assert _shape(cache.peek([1, 2, 3, 4, 7], partial=True)) == (4, 6)
        assert _shape(cache.peek([1, 2, 3, 4, 5, 6, 7])) == (6, 6)
        assert cache.peek([2]) is None and cache.peek([]) is None and cache.peek([1, 2, 3], namespace="x") is None
        for query, partial in (([1, 2, 3, 4, 7], False), ([1, 2, 3, 4, 7], True), ([9, 9], False)):
            peeked, match = cache.peek(query, partial=partial), cache.lookup(query, partial=partial, touch=False)
            assert match is not None and _shape(peeked) == (match.length, len(match.key))
            match.release()
        for _ in range(5):
            cache.peek([1, 2, 3])  # not a use: [1, 2, 3] stays the least recently used
        cache.store([8], bytes(1000))
        assert cache.lookup([1, 2, 3], touch=False) is None

    def test_lookup_prefixes_reads_a_chain_up_to_its_first_gap(self, cache: CacheBackend) -> None:
        base = list(range(500, 540))
        for n in (4, 8, 12, 20, 24):
            cache.store(base[:n], f"chunk {n}".encode())
        cache.store(base[:8], b"other namespace", namespace="x")
        cache.store(base[:16] + [1], b"not on the query's path")
        matches = cache.lookup_prefixes(base, [4, 8, 12, 16, 20, 24])
        try:  # 16 is not stored: 20 and 24 are not reached, whatever is stored there
            assert [(m.length, tuple(m.key), bytes(m.blob), m.namespace) for m in matches] == [
                (n, tuple(base[:n]), f"chunk {n}".encode(), "") for n in (4, 8, 12)
            ]
        finally:
            for match in matches:
                match.release()
        matches = cache.lookup_prefixes(base + [9], [8, 12], namespace="x")
        assert [bytes(m.blob) for m in matches] == [b"other namespace"]
        matches[0].release()
        assert cache.lookup_prefixes(base, [2, 4]) == []  # the first length is not stored
        assert cache.lookup_prefixes(base, []) == [] and cache.lookup_prefixes([], []) == []
        assert blob_of(cache.lookup(base[:13])) == b"chunk 12"  # the chain's matches are each released

    def test_lookup_prefixes_matches_each_stay_valid_until_released(self, cache: CacheBackend) -> None:
        base = list(range(1, 33))
        for n in range(8, 33, 8):
            cache.store(base[:n], bytes([n]) * 5000)
        matches = cache.lookup_prefixes(base, [8, 16, 24, 32])
        assert len(matches) == 4
        for n in (8, 16):  # released one by one, in any order; the others stay readable
            matches[n // 8 - 1].release()
        cache.store(base[:24], b"replaced")  # a held match keeps its bytes (the store's promise)
        cache.delete(base[:32])
        assert [bytes(m.blob) for m in matches[2:]] == [bytes([24]) * 5000, bytes([32]) * 5000]
        for match in matches:
            match.release()
        assert blob_of(cache.lookup(base)) == b"replaced"

    def test_lookup_prefixes_checks_its_lengths(self, cache: CacheBackend) -> None:
        cache.store([1, 2, 3], b"abc")
        for chain in (cache.lookup_prefixes, cache.touch_prefixes):
            for lengths in ([2, 2], [3, 1], [0, 1], [1, 4], [-1]):
                with pytest.raises(ValueError):
                    chain([1, 2, 3], lengths)
            with pytest.raises(TypeError):
                chain([1, 2, 3], [1.5])  # type: ignore[list-item]

    def test_touch_prefixes_counts_a_chain_up_to_its_first_gap(self, cache: CacheBackend) -> None:
        base = list(range(1, 25))
        for n in (4, 8, 16, 20):
            cache.store(base[:n], bytes([n]) * 10)
        cache.store(base[:12], b"x", namespace="x")
        assert cache.touch_prefixes(base, [4, 8, 12, 16, 20]) == 2  # nothing under 12 here
        assert cache.touch_prefixes(base, [4, 8]) == 2
        assert cache.touch_prefixes(base, [2, 4]) == 0  # the first length is not stored
        assert cache.touch_prefixes(base, [12], namespace="x") == 1
        assert cache.touch_prefixes(base, []) == 0 and cache.touch_prefixes([], []) == 0
        assert blob_of(cache.lookup(base[:20], touch=False)) == bytes([20]) * 10  # nothing read or changed

    def test_touch_prefixes_counts_uses(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        cache.store([9], bytes(1000))
        cache.store([1, 2], bytes(1000))
        cache.store([1, 2, 3, 4], bytes(1000))
        cache.touch([9])  # now the least recently used is the chain
        assert cache.touch_prefixes([1, 2, 3, 4], [2, 4]) == 2  # ... and now [9]
        cache.store([8], bytes(1000))
        assert cache.lookup([9], touch=False) is None
        assert blob_of(cache.lookup([1, 2, 3, 4], touch=False)) == bytes(1000)

    def test_lookup_prefixes_counts_uses_unless_told_not_to(self, open_cache: Opener) -> None:
        cache = open_cache(max_bytes=3500)
        cache.store([1, 2], bytes(1000))
        cache.store([1, 2, 3, 4], bytes(1000))
        cache.store([9], bytes(1000))
        for match in cache.lookup_prefixes([1, 2, 3, 4], [2, 4], touch=False):
            match.release()
        for match in cache.lookup_prefixes([9], [1]):
            match.release()
        cache.store([8], bytes(1000))  # evicts the least recently used: the chain, untouched
        assert cache.lookup([1, 2], touch=False) is None and blob_of(cache.lookup([9])) == bytes(1000)
        for match in cache.lookup_prefixes([1, 2, 3, 4], [4]):
            match.release()
        cache.store([7], bytes(1000))  # now [9] and [8] are older than the chain's last entry
        assert blob_of(cache.lookup([1, 2, 3, 4])) == bytes(1000)

    def test_one_token_keys(self, cache: CacheBackend) -> None:
        for t in range(0, 2000, 7):
            cache.store([t], t.to_bytes(4, "little"))
        for t in range(0, 2000, 7):
            assert blob_of(cache.lookup([t, 1, 2])) == t.to_bytes(4, "little")
        assert cache.lookup([1]) is None

    def test_chain_of_prefix_keys(self, cache: CacheBackend) -> None:
        base = list(range(100, 150))
        for n in range(1, 51):
            cache.store(base[:n], str(n).encode())
        for n in range(1, 51, 5):
            assert blob_of(cache.lookup(base[:n] + [0])) == str(n).encode()
        for n in range(2, 50, 2):
            assert cache.delete(base[:n])
        assert blob_of(cache.lookup(base[:20])) == b"19"
        assert blob_of(cache.lookup(base)) == b"50"
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
            assert blob_of(cache.lookup(query)) == expected, (step, query)
            match = cache.lookup(query, partial=True)
            best = max((_common(k, query) for k in model), default=0)
            assert (match.length if match else 0) == best, (step, query)
            if match is not None:
                assert _common(tuple(match.key), query) == best
                assert model[tuple(match.key)] == bytes(match.blob)
                match.release()
        assert len(cache) == len(model)


def _shape(peek: sippcache.Peek | None) -> tuple[int, int] | None:
    """A peek's (length, key_length)."""
    return None if peek is None else (peek.length, peek.key_length)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens `a` and `b` share: the reference model's partial match length."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

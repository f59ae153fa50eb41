"""Eviction: sippcache's own `max_bytes` budget (the conformance suite checks the policy),
and a server that evicts by itself (`maxmemory` + `allkeys-lru`: any chunk may vanish),
or refuses writes (`noeviction`): never a wrong blob, never an exception."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
from sippcache_redis.servers import ValkeyServer

import sippcache


def _blob(i: int) -> bytes:
    return random.Random(i).randbytes(20_000 + 97 * i)


def test_server_eviction_tears_entries_but_never_returns_a_wrong_blob(
    make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str
) -> None:
    """Every hit is the right blob and every torn entry found is removed. allkeys-lru may
    also evict the metadata keys (the whole mirror is then gone: every lookup misses,
    which is correct too), so the store is filled again, under a new prefix, until one
    round leaves both hits to check and misses to clean up."""
    server = make_server(args=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"])
    evicted_before = 0
    for attempt in range(5):
        cache = sippcache.open(f"{server.url}?prefix={prefix}{attempt}&chunk_size=4KiB&max_bytes=1GiB")
        opened.append(cache)
        for i in range(300):  # about 9 MB of blobs into 4 MB: the server evicts chunks (and maybe more)
            cache.store([i, i + 1], _blob(i))
        with server.client() as raw:
            evicted = int(raw.info("stats")["evicted_keys"])
        assert evicted - evicted_before > 100
        evicted_before = evicted
        missed = set()
        for i in range(300):
            match = cache.lookup([i, i + 1, 5])
            if match is None:
                missed.add(i)
            else:
                assert bytes(match.blob) == _blob(i) and match.key == (i, i + 1)
        listed = {e.key[0] for e in cache.entries()}
        assert not listed & missed  # every torn entry found was removed
        assert cache.stats().errors == 0
        # Still a working store.
        assert cache.store([7, 7, 7], b"fresh") and bytes(cache.lookup([7, 7, 7]).blob) == b"fresh"
        if missed and len(missed) < 300:
            return
    pytest.fail("in 5 rounds the server never left both intact and torn entries: nothing was checked")


def test_noeviction_server_refuses_stores_but_serves_lookups(
    make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(args=["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"])
    cache = sippcache.open(f"{server.url}?prefix={prefix}&chunk_size=64KiB&max_bytes=1GiB")
    opened.append(cache)
    results = [cache.store([i], _blob(i)) for i in range(200)]
    assert results[0] and not all(results)  # the server filled up: later stores were dropped
    stored = [i for i, ok in enumerate(results) if ok]
    assert cache.stats().errors >= results.count(False)
    assert any("refused" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for i in stored[:20]:  # lookups (and their recency updates) still work on a full server
        assert bytes(cache.lookup([i, 9]).blob) == _blob(i)
    assert cache.delete([stored[0]]) is True  # and deletes free room
    assert len(cache) == len(stored) - 1
    with server.client() as raw:  # a refused upload leaves no chunks behind
        assert len(raw.keys(f"{prefix}:b:*")) == sum(-(-len(_blob(e.key[0])) // 65536) for e in cache.entries())


def test_max_bytes_below_maxmemory_keeps_a_noeviction_server_working(
    make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str
) -> None:
    """The recommended deployment: sippcache evicts (by its policy) before the server fills."""
    server = make_server(args=["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"])
    cache = sippcache.open(f"{server.url}?prefix={prefix}&chunk_size=64KiB&max_bytes=3MB")
    opened.append(cache)
    assert all(cache.store([i], _blob(i)) for i in range(300))
    stats = cache.stats()
    assert stats.errors == 0 and stats.evictions > 100 and stats.bytes <= 3_000_000
    assert bytes(cache.lookup([299]).blob) == _blob(299)
    with server.client() as raw:
        assert len(raw.keys(f"{prefix}:b:*")) == sum(-(-len(_blob(e.key[0])) // 65536) for e in cache.entries())


def test_volatile_lru_server_evicts_only_blobs(
    make_server: Callable[..., ValkeyServer], opened: list[Any], prefix: str
) -> None:
    """Chunks carry a (ten-year) TTL and metadata none, so `volatile-lru` never evicts the
    catalog: entries torn by eviction are found and removed one by one, the rest stay."""
    server = make_server(args=["--maxmemory", "4mb", "--maxmemory-policy", "volatile-lru"])
    # One chunk per entry here: a chunk evicted is an entry gone. (With many chunks each,
    # random picks among equally idle keys tear nearly every entry: docs/redis.md.)
    cache = sippcache.open(f"{server.url}?prefix={prefix}&chunk_size=64KiB&max_bytes=1GiB")
    opened.append(cache)
    for i in range(300):
        assert cache.store([i, i + 1], _blob(i))
    tag = "{" + prefix + "}"
    with server.client() as raw:
        assert int(raw.info("stats")["evicted_keys"]) > 100
        assert all(raw.exists(f"{tag}:{name}") for name in ("state", "cat", "val", "log"))
        assert raw.hlen(f"{tag}:cat") == 300  # every entry is still listed: only blobs went
    hits = 0
    for i in range(300):
        match = cache.lookup([i, i + 1])
        if match is not None:
            assert bytes(match.blob) == _blob(i)
            hits += 1
    assert 20 < hits < 300 and len(cache) == hits  # the torn ones were removed, the whole ones kept
    assert cache.stats().errors == 0

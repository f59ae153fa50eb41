"""Cluster specifics: any node's URL reaches the same store; a master that dies makes
its slots miss (fast, no exception) until it is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_testtools import Clock, open_with_clock
from sippcache_redis.backend import BACKOFF_MAX
from sippcache_redis.servers import ValkeyCluster

import sippcache


def test_any_node_reaches_the_same_store(valkey_cluster: ValkeyCluster, prefix: str) -> None:
    caches = [sippcache.open(f"{node.url}?prefix={prefix}") for node in valkey_cluster.nodes]
    try:
        assert all(cache.cluster for cache in caches)
        caches[0].store([1, 2, 3], b"via the first node" * 1000)
        for cache in caches[1:]:
            assert bytes(cache.lookup([1, 2, 3]).blob) == b"via the first node" * 1000
        caches[2].delete([1, 2, 3])
        assert caches[0].lookup([1, 2, 3]) is None
    finally:
        for cache in caches:
            cache.close()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        yield cluster


def _owner(cluster: ValkeyCluster, key: str) -> Any:
    """The node that holds `key`'s slot."""
    client = cluster.client()
    try:
        port = client.get_node_from_key(key).port
    finally:
        client.close()
    return next(node for node in cluster.nodes if node.port == port)


def test_a_dead_master_is_a_miss_until_it_is_back(own_cluster: ValkeyCluster, prefix: str) -> None:
    clock = Clock()  # the backoff's clock: it moves only when this test moves it
    cache = open_with_clock(f"{own_cluster.url}?prefix={prefix}&timeout=1", clock)
    try:
        assert cache.cluster
        for i in range(20):
            assert cache.store([i, i], bytes([i]) * 5000)
        owner = _owner(own_cluster, "{" + prefix + "}:state")
        owner.kill()  # the master holding the store's metadata
        attempts = cache.attempts
        for i in range(20):
            assert cache.lookup([i, i]) is None
            assert cache.store([100 + i], b"dropped") is False
        assert len(cache) == 20  # the last known mirror
        assert cache.stats().errors >= 40
        assert cache.attempts == attempts + 1  # fast: one failed try, then the backoff answers without the cluster
        owner.start()  # it rejoins with its nodes.conf (its data is gone: no persistence)
        deadline = time.monotonic() + 60
        while True:
            clock.advance(BACKOFF_MAX)  # every try below comes after the backoff
            if cache.store([7, 7, 7], b"back"):
                break
            assert time.monotonic() < deadline, "the cluster did not come back"  # bounds the wait only
            time.sleep(0.5)
        assert bytes(cache.lookup([7, 7, 7]).blob) == b"back"
    finally:
        cache.close()

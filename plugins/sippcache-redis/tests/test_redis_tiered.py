"""`tiered://` with a local LMDB L1 and Redis as the shared L2: the unchanged conformance
suite, replicas sharing through L2, and an L2 that is stalled or dead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from sippcache_redis.servers import ValkeyServer

import sippcache
from sippcache.testing import BackendTests, PersistentBackendTests


def tiered_url(l1: str, l2: str) -> str:
    """The `tiered://` URL of `l1` in front of `l2`, each percent-encoded whole, as docs/backends.md
    spells it (a user's URL: the plugin needs nothing of the tiered backend's code)."""
    return "tiered://?" + urlencode({"l1": l1, "l2": l2})


class TestTieredLMDBOverRedis(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path, valkey_server: ValkeyServer, prefix: str) -> str:
        return tiered_url(f"lmdb://{tmp_path}/l1?max_bytes=256MiB", f"{valkey_server.url}?prefix={prefix}")


def test_replicas_share_through_l2_and_keep_l1_hits_when_it_dies(
    tmp_path: Path, make_server: Callable[..., ValkeyServer], prefix: str, opened: list[Any]
) -> None:
    server = make_server()
    l2 = f"{server.url}?prefix={prefix}&timeout=1"
    a = sippcache.open(tiered_url(f"lmdb://{tmp_path}/a", l2))
    b = sippcache.open(tiered_url(f"lmdb://{tmp_path}/b", l2))
    opened += [a, b]
    assert a.persistent  # both tiers are: the persistent tiered store
    assert a.store([1, 2, 3], b"computed on replica a")
    assert len(a) == 1  # drains a's queue: the entry is in L2
    match = b.lookup([1, 2, 3, 4])  # b's L1 misses, L2 has it: copied into b's L1
    assert match is not None and bytes(match.blob) == b"computed on replica a"
    assert bytes(b.l1.lookup([1, 2, 3]).blob) == b"computed on replica a"
    server.kill()
    # L2 is gone: both replicas keep working from their L1, nothing raises, errors are counted.
    assert bytes(b.lookup([1, 2, 3, 4]).blob) == b"computed on replica a"
    assert a.store([5, 6], b"local only") and bytes(a.lookup([5, 6, 7]).blob) == b"local only"
    assert a.lookup([8, 9]) is None and b.delete([1, 2, 3]) is True and a.pin([5, 6]) is True
    assert len(a) >= 1 and list(a.entries())
    assert a.stats().errors >= 1 and b.stats().errors >= 1


def test_a_store_does_not_wait_for_a_stalled_l2(
    tmp_path: Path, make_server: Callable[..., ValkeyServer], prefix: str, opened: list[Any]
) -> None:
    server = make_server()
    cache = sippcache.open(tiered_url(f"lmdb://{tmp_path}/l1", f"{server.url}?prefix={prefix}&timeout=10"))
    opened.append(cache)
    assert cache.store([0], b"before") and len(cache) == 1
    server.pause()  # SIGSTOP: an L2 call waits until the server answers again (or its 10 s timeout)
    try:
        for i in range(1, 6):
            assert cache.store([i, i], bytes(100_000)) is True
        assert bytes(cache.lookup([3, 3]).blob) == bytes(100_000)  # L1 covers the query: no L2 involved
    finally:
        server.resume()
    # No clock: a store that had waited for L2 would have hit the 10 s timeout while the server
    # was stopped and been dropped; all five land once L2 answers again, so none of them waited.
    assert len(cache) == 6

"""The unchanged conformance suite on a single server and on a 3-master cluster."""

from __future__ import annotations

import pytest
from sippcache_redis.servers import ValkeyCluster, ValkeyServer

from sippcache.testing import BackendTests, PersistentBackendTests


class TestRedisServer(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, valkey_server: ValkeyServer, prefix: str) -> str:
        return f"{valkey_server.url}?prefix={prefix}"


class TestRedisCluster(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, valkey_cluster: ValkeyCluster, prefix: str) -> str:
        return f"{valkey_cluster.url}?prefix={prefix}"

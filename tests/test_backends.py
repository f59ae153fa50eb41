"""The conformance suite, run against each built-in backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from sippcache.testing import BackendTests, PersistentBackendTests


class TestRAMBackend(BackendTests):
    @pytest.fixture
    def cache_url(self) -> str:
        return "ram://"


class TestLMDBBackend(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path) -> str:
        return f"lmdb://{tmp_path}/store?max_bytes=256MiB"


class TestDiskCacheBackend(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path) -> str:
        return f"diskcache://{tmp_path}/store"

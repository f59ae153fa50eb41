"""Helpers for tests that compare logits with the never-cached path on a real llama.cpp model."""

from __future__ import annotations

import ctypes
import itertools
import json
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np


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
            input=json.dumps(tokens),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return int(result.stdout.strip().splitlines()[-1]), np.load(out)

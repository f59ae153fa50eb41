"""Helpers for tests that compare logits with the never-cached path on a real llama.cpp model, and
llama.cpp's own count of the tokens it evaluated (which the benchmarks report too)."""

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

#: The repository root (a child process imports `harness.llama_tools` from it).
ROOT = Path(__file__).resolve().parent.parent


#: The text `unique_text_tokens` numbers word by word: a keeper's log.
LOG_TEXT = (
    "The lighthouse keeper kept a log of every ship that passed the northern cape. "
    "Each entry named the vessel, its flag, the hour, the weather and the state of the sea. "
    "Over forty years the log grew to eleven volumes, and historians now read it to learn "
    "how trade moved along the coast before the railway arrived. "
)


def unique_text_tokens(model: Path, words: int, at_least: int) -> list[int]:
    """The tokens of `words` words of text that never repeats itself (each word numbered), so
    prefixes are unambiguous; at least `at_least` of them."""
    import llama_cpp

    vocabulary = LOG_TEXT.split()
    text = " ".join(f"{vocabulary[i % len(vocabulary)]}-{i}" for i in range(words))
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=512, vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode())
    llm.close()
    assert len(ids) > at_least, (len(ids), at_least)
    return ids


def last_logits(llm: object) -> np.ndarray:
    """A copy of the logits of the last evaluated token, read from the llama context."""
    import llama_cpp

    n_vocab = llm.n_vocab()  # type: ignore[attr-defined]
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)  # type: ignore[attr-defined]
    return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).copy()


def start_counting(ctx: object) -> None:
    """Count from now: `tokens_evaluated` afterwards counts only later evaluations (a decode
    not yet waited for is counted first, so it does not fall into the new count)."""
    import llama_cpp

    llama_cpp.llama_synchronize(ctx)
    llama_cpp.llama_perf_context_reset(ctx)


def tokens_evaluated(ctx: object) -> int:
    """Tokens llama.cpp evaluated in `ctx` since `llama_perf_context_reset`: prompt batches
    (`n_p_eval`) and single tokens (`n_eval`). llama.cpp counts a decode when it waits for
    its result, so this waits first; it reports each count as at least 1, so a count that
    took no time is read as 0."""
    import llama_cpp

    llama_cpp.llama_synchronize(ctx)
    data = llama_cpp.llama_perf_context(ctx)
    return (data.n_p_eval if data.t_p_eval_ms > 0 else 0) + (data.n_eval if data.t_eval_ms > 0 else 0)


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
    model, url, out, n_ctx, root = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    sys.path.insert(0, root)
    from sippcache.llama import PrefixCache
    from harness.llama_tools import start_counting, tokens_evaluated
    tokens = json.loads(sys.stdin.read())
    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, verbose=False)
    start_counting(llm.ctx)
    with PrefixCache(llm, url) as cache:
        reused = cache.prefill(tokens)
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),))
    np.save(out, logits)
    print(reused, tokens_evaluated(llm.ctx))
    """
)


def prefill_in_new_process(model: Path, url: str, tokens: list[int], n_ctx: int = 2048) -> tuple[int, np.ndarray, int]:
    """Run `PrefixCache.prefill(tokens)` in a new Python process: (tokens reused, last logits,
    tokens llama.cpp evaluated)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        result = subprocess.run(
            [sys.executable, "-c", _PREFILL_SCRIPT, str(model), url, str(out), str(n_ctx), str(ROOT)],
            input=json.dumps(tokens),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        reused, evaluated = result.stdout.strip().splitlines()[-1].split()
        return int(reused), np.load(out), int(evaluated)

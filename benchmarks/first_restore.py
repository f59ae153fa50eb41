"""A new process's first restore from chunks: with the join buffer made ahead, against without.

A state stored in chunks is joined into one buffer before llama.cpp loads it. A new process has
no such buffer yet, and faulting in a new one's pages costs about as much as the copy. Where the
rates kept from the processes before (`CacheOptions.rates_dir`) say how large states are here,
the cache makes the buffer for the largest at start, in a helper thread (`SequenceCache`). This
stores one SmolLM2-135M state of --tokens tokens (LMDB, chunks of 64, flash attention off: V
transposed), then alternates new processes that restore it (the prompt plus one token): with the
rates kept (the buffer made ahead) and with none kept (`rates_dir=""`), --rounds each; the median
of `PrefillResult.restore_seconds` (lookup to loaded) each way. Each process waits 0.2 s after
opening the cache (a request's own way there: HTTP, a template, tokenizing). Goal: made ahead at
most 0.8x of without.

    python benchmarks/first_restore.py [--tokens 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(model: str, url: str, rates_dir: str, n: int, store: bool) -> dict[str, float]:
    """One new process: store the state, or restore it (prompt + 1 token) and say how long it took."""
    import time

    import llama_cpp

    from sippcache.llama import PrefixCache

    rng = random.Random(0)
    tokens = [1] + [rng.randrange(3, 250) for _ in range(n - 1)]
    llm = llama_cpp.Llama(model_path=model, n_ctx=n + 64, n_batch=512, flash_attn=False, verbose=False)
    with PrefixCache(llm, url, restore="always", rates_dir=rates_dir) as cache:
        if store:
            cache.prefill(tokens)
            cache.flush()
            return {}
        time.sleep(0.2)
        result = cache.prefill([*tokens, 5])
        assert result.restored >= n - 1, result
        return {"restore_seconds": result.restore_seconds}


def run(model: str, url: str, rates_dir: str, n: int, store: bool = False) -> dict[str, float]:
    code = f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.first_restore import child; "
    code += f"print(json.dumps(child({model!r}, {url!r}, {rates_dir!r}, {n}, {store})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from sippcache.demo.model import smollm2_model_path

    model = str(smollm2_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        url, rates = f"lmdb://{tmp}/store", f"{tmp}/rates"
        run(model, url, rates, args.tokens, store=True)
        ahead, without = [], []
        for _ in range(args.rounds):
            ahead.append(run(model, url, rates, args.tokens)["restore_seconds"])
            without.append(run(model, url, "", args.tokens)["restore_seconds"])
    a, w = statistics.median(ahead), statistics.median(without)
    print(f"{args.tokens} tokens, SmolLM2-135M, LMDB, chunks of 64; median of {args.rounds} new processes each:")
    print(f"  join buffer made ahead: {a * 1e3:.1f} ms  ({', '.join(f'{x * 1e3:.1f}' for x in ahead)})")
    print(f"  without:                {w * 1e3:.1f} ms  ({', '.join(f'{x * 1e3:.1f}' for x in without)})")
    ok = a <= 0.8 * w
    print(f"{'PASS' if ok else 'FAIL'}: made ahead {a / w:.2f}x of without <= 0.8x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Decided: snapshots are copied out of llama.cpp into buffers used before, not new memory (f1a3a35:
`StateBuffers`, each reserved at twice its state; a 268-352 MB state in 37-60 ms, was 198-301 ms).

Copying a sequence state out of llama.cpp (the llama-cpp-python layer's save): into new memory
against into a buffer used before (`sippcache.state.buffers.StateBuffers`), and a memory copy of the same bytes.

A snapshot is copied out of the context on the thread that computes (the next prefill waits for
it), then framed and stored in the background. On a fast GPU a state's bytes are the whole cost
of caching it, and into new memory the copy pays a page fault for every 4 KiB first: on this
project's CPU machines several times the copy itself. So snapshots are copied into buffers that
are given back once stored, each reserved at twice its state, so that a conversation's next,
longer state fits the same pages.

A KV-heavy, compute-light generated model (`benchmarks/gpu/mkmodel.py`'s "wide": 64 KiB of K/V a token,
flash attention on) is run as a conversation: a 4,096-token prompt, then turns of 256 tokens;
after each, the state is copied both ways (alternating, median of --repeat) and a warm memory
copy of as many bytes is the anchor. Goals: the copy into a used buffer at least 0.3x a memory
copy (issue 29's floor for sippcache's part of a save) and at least 2x faster than into new
memory, on the median turn.

    python -m benchmarks.probes.state_copy [--turns 5] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
import numpy as np

from benchmarks.gpu import mkmodel
from sippcache.llama import states
from sippcache.state.buffers import StateBuffers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096, help="tokens of the first prompt (4096)")
    parser.add_argument("--turns", type=int, default=5, help="turns of 256 tokens after it (5)")
    parser.add_argument("--repeat", type=int, default=5, help="copies each way per turn; the median is shown (5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = mkmodel.write("wide", str(Path(tmp) / "wide.gguf"))
        n_ctx = args.prompt + 256 * args.turns + 64
        llm = llama_cpp.Llama(model_path=model["path"], n_ctx=n_ctx, n_batch=512, flash_attn=True, verbose=False)
        rng = random.Random(0)
        ctx, buffers = llm._ctx.ctx, StateBuffers(limit=2 * 1024**3)
        rows, turn_tokens = [], [1] + [rng.randrange(3, 259) for _ in range(args.prompt - 1)]
        print(f"model: {model['kv_bytes_per_token'] // 1024} KiB of K/V a token; {args.repeat} copies each way a turn")
        print(f"{'turn':>4} {'tokens':>7} {'MB':>7} {'new memory':>11} {'used buffer':>12} {'memcpy':>7}  ratios")
        for turn in range(args.turns + 1):
            llm.eval(turn_tokens)
            size = states.state_size(ctx, 0)
            anchor_src, anchor_dst = np.ones(size, np.uint8), np.empty(size, np.uint8)
            anchor_dst[:] = anchor_src  # its pages made before it is timed
            new, used, copy = [], [], []
            for _ in range(args.repeat):
                t = time.perf_counter()
                state = states.copy_state(ctx, 0)
                new.append(time.perf_counter() - t)
                assert state is not None and state.nbytes == size
                del state
                t = time.perf_counter()
                state = states.copy_state(ctx, 0, buffers)
                used.append(time.perf_counter() - t)
                assert state is not None and state.nbytes == size
                buffers.give_back(state)  # stored: the buffer is free again
                del state
                t = time.perf_counter()
                np.copyto(anchor_dst, anchor_src)
                copy.append(time.perf_counter() - t)
            n, u, c = (statistics.median(x) for x in (new, used, copy))
            rows.append((n, u, c))
            print(
                f"{turn:>4} {llm.n_tokens:>7} {size / 1e6:>7.1f} {n * 1e3:>8.1f} ms {u * 1e3:>9.1f} ms"
                f" {c * 1e3:>4.1f} ms  used {c / u:.2f}x memcpy, new {c / n:.2f}x; used {n / u:.2f}x faster"
            )
            turn_tokens = [rng.randrange(3, 259) for _ in range(256)]
        llm.close()
    median_used = statistics.median(c / u for _, u, c in rows)
    median_gain = statistics.median(n / u for n, u, _ in rows)
    ok = True
    for name, value, goal in (("used buffer x memcpy", median_used, 0.3), ("used over new memory", median_gain, 2.0)):
        passed = value >= goal
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'}: {name} {value:.2f}x >= {goal}x (median turn)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

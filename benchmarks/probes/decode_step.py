"""Decided: `sippcache serve --parallel` defaults to 4 (a006c5c): a step of 4 requests gave 2.5x the
tokens/s of 1, and 8 gave 3.1x for twice the KV (this script, f81a542, is that measurement).

What one batched decode step costs as requests are added: the default of ``--parallel``.

A step of `sippcache serve --parallel N` decodes the next token of every running
request in one `llama_decode`, then samples each with its own chain (upstream's:
penalties at its server's default 1.1, then greedy here). On a small model the
step is bound by reading the weights, which a bigger batch shares, so tokens
per second grow with N until the batch's own arithmetic takes over. This measures it on gemma-3-270m with
`sippcache.llama.batch.BatchEngine` for each N, in one process: N requests with
200-token prompts decoding, the median of `--steps` steps.

    python -m benchmarks.probes.decode_step [--slots 1,2,4,8,16] [--steps 30] [--rounds 2]

Printed per N: decode and sampling time per step, tokens per second, against
N = 1, and each request's time per output token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

import llama_cpp

from sippcache.demo.model import gemma_model_path
from sippcache.llama import CacheOptions
from sippcache.llama.batch import BatchEngine, Job
from sippcache.llama.fingerprint import llama_fingerprint
from sippcache.llama.seqcache import SequenceCache
from sippcache.llama.states import MemoryKind


def measure(llm: llama_cpp.Llama, slots: int, steps: int) -> tuple[float, float]:
    """(median decode seconds, median sampling seconds) of a step with `slots` requests decoding."""
    cache = SequenceCache(
        "ram://?max_bytes=1MiB",
        fingerprint=llama_fingerprint(llm),
        kind=MemoryKind.of(llm.model),
        n_vocab=llm.n_vocab(),
        options=CacheOptions(scope=f"step-{slots}", min_tokens=1 << 30),
    )
    # min_tokens=2**30: nothing stored, pure decoding
    engine = BatchEngine(llm, cache, slots=slots, n_ctx=slots * 1024, chunk=512)
    # upstream's chain, with its server's default repetition penalty: a pass over the vocabulary per token
    samplers = [llama_cpp.Llama._init_sampler(llm, temp=0.0, repeat_penalty=1.1) for _ in range(slots)]
    try:
        jobs = [
            Job([2] + [random.Random(i).randrange(1000, 200_000) for _ in range(199)], s.sampler, 800)
            for i, s in enumerate(samplers)
        ]
        for job in jobs:
            engine.submit(job)
        while any(job.state != "decode" for job in jobs):
            engine.step()
        for _ in range(3):
            engine.step()
        reports = [engine.step() for _ in range(steps)]
        decode = statistics.median(r.decode_seconds for r in reports)
        return decode, statistics.median(r.sample_seconds for r in reports)
    finally:
        engine.free()
        cache.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sizes = [int(n) for n in args.slots.split(",")]
    # flash attention on, as `sippcache serve --parallel` runs the engine by default
    llm = llama_cpp.Llama(model_path=str(gemma_model_path()), n_ctx=512, n_batch=512, flash_attn=True, verbose=False)
    measure(llm, sizes[0], 3)  # warm up
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    for _ in range(args.rounds):  # sizes interleaved, so a busy moment hits all alike
        for n in sizes:
            runs[n].append(measure(llm, n, args.steps))
    print(f"gemma-3-270m, requests decoding at once, median step of {args.steps}, {args.rounds} rounds")
    print(f"{'N':>3} {'decode':>9} {'sampling':>9} {'tokens/s':>9} {'vs N=1':>7} {'TPOT':>8}")
    base = None
    for n in sizes:
        decode = statistics.median(r[0] for r in runs[n])
        sample = statistics.median(r[1] for r in runs[n])
        rate = n / (decode + sample)
        base = base or rate
        print(
            f"{n:>3} {decode * 1000:>6.1f} ms {sample * 1000:>6.1f} ms {rate:>9.1f} {rate / base:>6.2f}x "
            f"{(decode + sample) * 1000:>5.0f} ms"
        )
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

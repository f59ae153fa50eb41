"""Decided: ``--prefill_chunk`` defaults to 128 (4280ca6): on gemma-3-270m the prefill rate beside the
decoders is flat from 64 to 512 tokens a step, and the decoders wait a step per chunk.

How many prompt tokens one batched step should take: the default of ``--prefill_chunk``.

A step of `sippcache serve --parallel` decodes one token of every running request
together with at most a chunk of a new prompt. A bigger chunk prefills faster
(fewer, fuller batches); a smaller one holds the running requests' next tokens
back less (their time per output token while a long prompt comes in). This
measures both on gemma-3-270m with `sippcache.llama.batch.BatchEngine`, for
each chunk size, in one process: a long prompt prefilled while `--decoding`
requests decode, and the same prompt prefilled alone.

    python -m benchmarks.probes.prefill_chunk [--chunks 64,128,256,512] [--prompt 2048] [--decoding 4] [--rounds 3]

A first round warms llama.cpp up and is not counted. Printed per chunk: prefill
tokens/s alone, prefill tokens/s beside the decoders (what the newcomer's time
to first token follows), the decoders' time per output token during that
prefill (median step, which the chunk bounds), and that against a step with no
prefill. The choice printed: the smallest chunk whose prefill rate beside the
decoders is within `--within` (10%) of the best, so the decoders are held back
least for a newcomer prefilled almost as fast as it can be.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import llama_cpp

from sippcache.demo.model import gemma_model_path
from sippcache.llama import CacheOptions
from sippcache.llama.batch import BatchEngine, Job
from sippcache.llama.fingerprint import llama_fingerprint
from sippcache.llama.pool import Sampling
from sippcache.llama.seqcache import SequenceCache
from sippcache.llama.states import MemoryKind


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200_000) for _ in range(n - 1)]


def run(
    llm: llama_cpp.Llama, chunk: int, prompt_len: int, decoding: int, seed: int
) -> tuple[float, float, list[float]]:
    """(prefill seconds alone, prefill seconds beside decoders, decoders' step times during it)."""
    n_vocab = llm.n_vocab()
    cache = SequenceCache(
        "ram://?max_bytes=1MiB",
        fingerprint=llama_fingerprint(llm),
        kind=MemoryKind.of(llm.model),
        n_vocab=n_vocab,
        options=CacheOptions(scope=f"bench-{seed}", min_tokens=1 << 30),
    )
    # min_tokens=2**30: nothing stored or restored, pure evaluation
    engine = BatchEngine(llm, cache, slots=decoding + 1, n_ctx=(decoding + 1) * (prompt_len + 512), chunk=chunk)
    chains = []
    try:

        def job(prompt: list[int], max_new: int) -> Job:
            chains.append(Sampling().chain(n_vocab))
            return Job(prompt, chains[-1], max_new)

        alone = job(tokens(prompt_len, seed), 1)
        engine.submit(alone)
        started = time.perf_counter()
        while alone.state != "done":
            engine.step()
        seconds_alone = time.perf_counter() - started
        decoders = [job(tokens(32, seed * 100 + i), 10_000) for i in range(decoding)]
        for j in decoders:
            engine.submit(j)
        while any(j.state != "decode" for j in decoders):
            engine.step()
        for _ in range(3):  # warm: decode-only steps
            engine.step()
        newcomer = job(tokens(prompt_len, seed + 1), 1)
        engine.submit(newcomer)
        steps = []
        started = time.perf_counter()
        while newcomer.state != "done":
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        seconds_beside = time.perf_counter() - started
        plain = []
        for _ in range(5):
            t = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - t)
        return seconds_alone, seconds_beside, [statistics.median(steps), statistics.median(plain)]
    finally:
        engine.free()
        cache.close()
        for chain in chains:
            llama_cpp.llama_sampler_free(chain)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="64,128,256,512")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--decoding", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--within", type=float, default=0.10)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    # flash attention on, as `sippcache serve --parallel` runs the engine by default
    llm = llama_cpp.Llama(model_path=str(gemma_model_path()), n_ctx=512, n_batch=512, flash_attn=True, verbose=False)
    results: dict[int, list[tuple[float, float, list[float]]]] = {c: [] for c in chunks}
    for round_ in range(args.rounds + 1):  # chunks interleaved, so a busy moment hits all alike
        for chunk in chunks:
            result = run(llm, chunk, args.prompt, args.decoding, seed=round_ * 10 + chunk)
            if round_:  # the first round warms llama.cpp up (buffers, graphs for each batch shape)
                results[chunk].append(result)
    rows = []
    print(
        f"prompt {args.prompt} tokens, {args.decoding} requests decoding, median of {args.rounds} rounds "
        "after a warm-up round"
    )
    print(
        f"{'chunk':>6} {'prefill alone tok/s':>20} {'prefill beside tok/s':>21} {'decoders TPOT':>14} "
        f"{'vs no prefill':>14}"
    )
    for chunk in chunks:
        alone = statistics.median(r[0] for r in results[chunk])
        beside = statistics.median(r[1] for r in results[chunk])
        tpot = statistics.median(r[2][0] for r in results[chunk])
        plain = statistics.median(r[2][1] for r in results[chunk])
        rows.append((chunk, args.prompt / beside))
        print(
            f"{chunk:>6} {args.prompt / alone:>20.0f} {args.prompt / beside:>21.0f} {tpot * 1000:>11.0f} ms "
            f"{tpot / plain:>13.1f}x"
        )
    best = max(rate for _, rate in rows)
    chosen = min(chunk for chunk, rate in rows if rate >= best * (1 - args.within))
    print(f"smallest chunk within {args.within:.0%} of the best prefill rate beside the decoders: {chosen}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decided: a request batched with others is held to its answer alone except at near-ties (a006c5c,
which added this script beside --parallel's default): every token a batch flipped was at a small
top-2 margin, so tests/test_serve_parallel.py checks the solo margin where the two texts part.

How far llama.cpp's batched arithmetic moves a request's logits, and which tokens it flips.

`sippcache serve --parallel` decodes several requests in one `llama_decode`. The
quantized CPU kernels give results that depend on the shape of the batch (and
on where a sequence's cells sit in the KV buffer), so a request decoded with
others can get slightly other logits than decoded alone, and where its two
best tokens are nearly tied, another token. This measures it on gemma-3-270m
with `sippcache.llama.batch.BatchEngine`: `--requests` greedy requests (a shared
system prompt, each its own question) run one at a time, then all together;
for each, the logits of every token both runs generated alike are compared,
and at the first token that differs, the solo run's top-2 margin is recorded.

    python -m benchmarks.probes.batch_ties [--requests 8] [--tokens 64] [--rounds 3]

Printed: tokens compared, the largest and the 99th-percentile logit shift, how
many requests flipped a token, and the solo margins at those flips. The figures
in docs/serve.md ("Results") come from here.
"""

from __future__ import annotations

import argparse
import random
import sys

import llama_cpp
import numpy as np

from sippcache.demo.model import gemma_model_path
from sippcache.llama import CacheOptions
from sippcache.llama.batch import BatchEngine, Job
from sippcache.llama.fingerprint import llama_fingerprint
from sippcache.llama.pool import Sampling
from sippcache.llama.seqcache import SequenceCache
from sippcache.llama.states import MemoryKind


def run(llm: llama_cpp.Llama, prompts: list[list[int]], tokens: int, together: bool, tag: str) -> list[Job]:
    """Greedy jobs with their logits, all submitted at once or one after another."""
    cache = SequenceCache(
        "ram://?max_bytes=1MiB",
        fingerprint=llama_fingerprint(llm),
        kind=MemoryKind.of(llm.model),
        n_vocab=llm.n_vocab(),
        options=CacheOptions(scope=tag, min_tokens=1 << 30),
    )
    engine = BatchEngine(llm, cache, slots=len(prompts), n_ctx=len(prompts) * 2048, chunk=256)
    chains = [Sampling().chain(llm.n_vocab()) for _ in prompts]
    jobs = [Job(p, chain, tokens, keep_logits=True) for p, chain in zip(prompts, chains, strict=True)]
    rows: dict[int, list[np.ndarray]] = {id(job): [] for job in jobs}
    for job in jobs:
        job.on_token = lambda j, token, logits: rows[id(j)].append(logits)  # type: ignore[misc]
    try:
        for job in jobs:
            engine.submit(job)
            while not together and job.state != "done":
                engine.step()
        while any(job.state != "done" for job in jobs):
            engine.step()
    finally:
        engine.free()
        cache.close()
        for chain in chains:
            llama_cpp.llama_sampler_free(chain)
    for job in jobs:
        job.keepalive = rows[id(job)]  # the logits each token was sampled from
    return jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # flash attention on, as `sippcache serve --parallel` runs the engine by default
    llm = llama_cpp.Llama(model_path=str(gemma_model_path()), n_ctx=512, n_batch=512, flash_attn=True, verbose=False)
    shifts: list[float] = []
    margins: list[float] = []
    compared = flipped = 0
    for round_ in range(args.rounds):
        rng = random.Random(round_)
        system = [2] + [rng.randrange(1000, 200_000) for _ in range(400)]
        prompts = [
            system + [rng.randrange(1000, 200_000) for _ in range(rng.randrange(10, 60))] for _ in range(args.requests)
        ]
        alone = run(llm, prompts, args.tokens, False, f"alone-{round_}")
        batched = run(llm, prompts, args.tokens, True, f"together-{round_}")
        for solo, both in zip(alone, batched, strict=True):
            for i, (a, b) in enumerate(zip(solo.generated, both.generated, strict=False)):
                shifts.append(float(np.max(np.abs(solo.keepalive[i] - both.keepalive[i]))))
                compared += 1
                if a != b:
                    top = np.sort(solo.keepalive[i])[-2:]
                    margins.append(float(top[1] - top[0]))
                    flipped += 1
                    break
    print(f"{args.rounds} rounds x {args.requests} requests x {args.tokens} greedy tokens, gemma-3-270m")
    print(f"tokens compared (until a request's first difference): {compared}")
    print(
        f"logit shift, together vs alone: max {max(shifts):.3f}, p99 {np.percentile(shifts, 99):.3f}, "
        f"median {np.median(shifts):.3f}"
    )
    print(f"requests that flipped a token: {flipped} of {args.rounds * args.requests}")
    if margins:
        print(f"solo top-2 margin at those flips: {', '.join(f'{m:.3f}' for m in sorted(margins))}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

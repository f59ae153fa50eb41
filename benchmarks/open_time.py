"""Open-time benchmark: a 100,000-entry LMDB store opened from its index snapshot
against reading every entry's records (what every open did before snapshots).

The store is built once and kept in the temporary folder (about 600 MB; built
again if missing or incomplete): keys are one of 16 shared prefixes of 100 to
2,000 tokens plus a suffix of 10 to 99 tokens of its own, blobs are 64 bytes.
Closing the builder writes the snapshot.

Each measurement is a new Python process (imports done before the clock
starts) that opens the store (`sippcache.open`) and makes one lookup of a
stored key plus a few tokens: the first operation is the one that loads the
index. The full read is the same code with the snapshot ignored. The two
alternate, so machine noise hits both alike; the medians and their ratio are
printed. Every timed lookup must return the stored key. Goal: open plus first
lookup from the snapshot under 0.5 s. Exit status 1 if it is missed.

    python -m benchmarks.open_time             # 3 rounds; the first run builds the store (about a minute)
    python -m benchmarks.open_time --rounds 5
    python -m benchmarks.open_time --json      # one JSON object instead of the table
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

import numpy as np

import sippcache

ENTRIES, PREFIXES, VOCAB, BLOB = 100_000, 16, 32_000, bytes(range(64))
PREFIX_LENGTHS = np.linspace(100, 2_000, PREFIXES).astype(int)
SUFFIX_LENGTHS = (10, 100)  # from, below
GOAL_S = 0.5
STORE = os.path.join(tempfile.gettempdir(), f"sippcache-open-time-{ENTRIES}-v1")
URL = f"lmdb://{STORE}?sync=false&max_bytes=16GiB"
QUERY_EXTRA = [7, 8, 9]  # tokens after the stored key in the query

_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import sippcache
    from sippcache.engine.replica import Replica

    url, key, full_read, EXTRA = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1", json.loads(sys.argv[4])
    if full_read:  # the same code with the snapshot ignored: every entry's records are read
        Replica._load_index_snapshot = lambda self, txn, seq: False
    start = time.perf_counter()
    cache = sippcache.open(url)
    opened = time.perf_counter()
    match = cache.lookup(key + EXTRA)
    first = time.perf_counter()
    found = match is not None and list(match.key) == key
    match.release()
    again = time.perf_counter()
    cache.lookup(key + EXTRA).release()
    second = time.perf_counter()
    print(json.dumps({"open_s": opened - start, "first_lookup_s": first - opened,
                      "second_lookup_s": second - again, "found": found, "entries": len(cache)}))
    sys.stdout.flush()
    os._exit(0)  # no close: closing after a full read would write a snapshot
    """
)


def key_bytes(i: int, prefixes: list[bytes]) -> bytes:
    """The i-th stored key as token bytes (the same every run): prefix i mod 16, then its own suffix."""
    rng = np.random.default_rng(i)
    suffix = rng.integers(VOCAB, size=int(rng.integers(*SUFFIX_LENGTHS))).astype("<u4").tobytes()
    return prefixes[i % PREFIXES] + suffix


def shared_prefixes() -> list[bytes]:
    rng = np.random.default_rng(ENTRIES)
    return [rng.integers(VOCAB, size=int(n)).astype("<u4").tobytes() for n in PREFIX_LENGTHS]


def build() -> dict[str, float]:
    """Build the store unless a complete one is there; the fill and close (snapshot) times."""
    marker = os.path.join(STORE, "complete")
    if os.path.exists(marker):
        return {}
    shutil.rmtree(STORE, ignore_errors=True)
    print(f"building {ENTRIES:,} entries in {STORE} ...", file=sys.stderr, flush=True)
    prefixes = shared_prefixes()
    start = time.perf_counter()
    cache = sippcache.open(URL)
    for i in range(ENTRIES):
        cache.store(np.frombuffer(key_bytes(i, prefixes), dtype="<u4"), BLOB)
    filled = time.perf_counter()
    if len(cache) != ENTRIES:
        sys.exit(f"FAIL: the store holds {len(cache)} entries after storing {ENTRIES}")
    cache.close()  # writes the snapshot
    closed = time.perf_counter()
    with open(marker, "w") as f:
        f.write("built\n")
    return {"fill_s": filled - start, "stores_per_s": ENTRIES / (filled - start), "close_s": closed - filled}


_WRITE_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import sippcache

    cache = sippcache.open(sys.argv[1])
    len(cache)
    start = time.perf_counter()
    cache._save_index_snapshot()  # what close() does when the snapshot is behind
    print(json.dumps({"write_s": time.perf_counter() - start}))
    sys.stdout.flush()
    os._exit(0)
    """
)


def snapshot_write_s() -> float:
    """How long writing the snapshot takes (in close(), when it is behind the store)."""
    result = subprocess.run([sys.executable, "-c", _WRITE_CHILD, URL], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"FAIL: the measuring process failed:\n{result.stderr[-3000:]}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["write_s"])


def open_once(full_read: bool, key: list[int]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, URL, json.dumps(key), "1" if full_read else "0", json.dumps(QUERY_EXTRA)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        sys.exit(f"FAIL: the measuring process failed:\n{result.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    if not row["found"] or row["entries"] != ENTRIES:
        sys.exit(f"FAIL: {'full read' if full_read else 'snapshot'}: wrong answer ({row})")
    row["total_s"] = row["open_s"] + row["first_lookup_s"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each way (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    built = build()
    key = np.frombuffer(key_bytes(ENTRIES // 2, shared_prefixes()), dtype="<u4").tolist()
    runs: dict[str, list[dict[str, Any]]] = {"snapshot": [], "full read": []}
    for round_ in range(args.rounds):
        order = ("snapshot", "full read") if round_ % 2 == 0 else ("full read", "snapshot")
        for way in order:
            print(f"round {round_ + 1}: {way} ...", file=sys.stderr, flush=True)
            runs[way].append(open_once(way == "full read", key))
    medians = {
        way: {
            field: statistics.median(row[field] for row in rows)
            for field in ("open_s", "first_lookup_s", "total_s", "second_lookup_s")
        }
        for way, rows in runs.items()
    }
    write_s = snapshot_write_s()
    load = os.getloadavg()[0]
    speedup = medians["full read"]["total_s"] / medians["snapshot"]["total_s"]
    snapshot_mb = _snapshot_bytes() / 1e6
    passed = medians["snapshot"]["total_s"] < GOAL_S

    if args.json:
        print(
            json.dumps(
                {
                    "entries": ENTRIES,
                    "rounds": args.rounds,
                    "build": built,
                    "medians": medians,
                    "speedup": speedup,
                    "snapshot_mb": snapshot_mb,
                    "snapshot_write_s": write_s,
                    "load_average": load,
                    "pass": passed,
                }
            )
        )
    else:
        from rich.console import Console
        from rich.table import Table

        caption = f"median of {args.rounds}; index snapshot {snapshot_mb:.1f} MB; speedup {speedup:.1f}x"
        table = Table(title=f"Opening a {ENTRIES:,}-entry LMDB store (new process each time)", caption=caption)
        for column in ("index from", "open ms", "first lookup ms", "open + first lookup ms", "next lookup µs"):
            table.add_column(column, justify="left" if column == "index from" else "right")
        for way, m in medians.items():
            table.add_row(
                way,
                f"{m['open_s'] * 1e3:,.1f}",
                f"{m['first_lookup_s'] * 1e3:,.0f}",
                f"{m['total_s'] * 1e3:,.0f}",
                f"{m['second_lookup_s'] * 1e6:,.0f}",
            )
        Console().print(table)
        print(
            f"writing the snapshot (close, when it is behind): {write_s:.2f} s; "
            f"load average {load:.1f} on {os.cpu_count()} CPUs"
        )
        if built:
            print(
                f"built: {built['fill_s']:.1f} s ({built['stores_per_s']:,.0f} stores/s), "
                f"close with snapshot {built['close_s']:.2f} s"
            )
        print(
            f"{'PASS' if passed else 'FAIL'}: open + first lookup from the snapshot "
            f"{medians['snapshot']['total_s']:.2f} s < {GOAL_S} s for {ENTRIES:,} entries"
        )
    return 0 if passed else 1


def _snapshot_bytes() -> int:
    import lmdb

    env = lmdb.open(STORE, subdir=True, readonly=True, lock=False, max_dbs=0)
    try:
        with env.begin() as txn:
            raw = txn.get(b"I")
            return len(raw) if raw is not None else 0
    finally:
        env.close()


if __name__ == "__main__":
    sys.exit(main())

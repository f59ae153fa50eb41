"""Decided: a new handle reads a chunked state's chain of keys longest key first (86e0553; measured
here in 940bc71: a new process's first lookup over 32K tokens 54 ms against 209 ms, 0.26x).

Chain-open probe: a new process's first lookup in a store that holds a long state in chunks.

A state stored in chunks of 64 tokens is a chain of entries, each keyed by its whole prefix (a
chunk longer than the one before: 512 entries and 33 MB of keys for 32K tokens). A store of fewer
than `INDEX_SNAPSHOT_MIN_ENTRIES` entries has no index snapshot, so a new process's first
operation reads every entry and indexes its key (`Mirror.reload`). Read longest key first, each
key is one step of the index; read least recently used first (the order before 2026-11-29), the
chain's entries, used at once, came in hash order, and each walked down every shorter key
already there.

Per chain length: one LMDB store holding the chain (blobs of 64 bytes: the keys are what is
read), stored deepest first and then used at once, as `ChunkedStates` stores a state; then new
processes, alternating, each opening it and timing its first lookup (the chain's
key plus one token: every chunk entry is indexed first), the order swapped in the "before" ones.
Every lookup must return the whole chain's key. Goal, at the longest chain: the first lookup at
most 0.6x of the order before. Exit status 1 if missed (unless --no-goals).

    python -m benchmarks.probes.chain_open                           # chains of 8K, 16K and 32K tokens
    python -m benchmarks.probes.chain_open --tokens 32768 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap

import sippcache

CHUNK = 64
GOAL = 0.6
BLOB = bytes(64)

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import sippcache
    from sippcache import mirror

    url, before, key = sys.argv[1], sys.argv[2] == "1", json.load(sys.stdin)
    if before:  # the order before 2026-11-29: least recently used first
        mirror._longest_first = lambda put: (put.state.used, put.eid)
    cache = sippcache.open(url)
    start = time.perf_counter()
    match = cache.lookup(key + [1], namespace="chunks")
    took = time.perf_counter() - start
    print(json.dumps({"first_lookup_s": took, "length": match.length if match else 0, "entries": len(cache)}))
    match.release()
    cache.close()
    """
)


def chain_key(n: int) -> list[int]:
    """The chain's whole key: `n` tokens."""
    return [(7 * i) % 30_000 + 3 for i in range(n)]


def build(url: str, n: int) -> None:
    key = chain_key(n)
    with sippcache.open(url) as cache:
        for end in range(n, 0, -CHUNK):  # deepest first, then used at once: as `ChunkedStates` stores a state
            cache.store(key[:end], BLOB, namespace="chunks")
        cache.touch_prefixes(key, list(range(CHUNK, n + 1, CHUNK)), namespace="chunks")


def first_lookup(url: str, n: int, before: bool) -> float:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, url, "1" if before else "0"],
        input=json.dumps(chain_key(n)),  # on standard input: 32K tokens pass the limit of one argument
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        sys.exit(f"FAIL: the measuring process failed:\n{result.stderr[-3000:]}")
    row = json.loads(result.stdout.strip().splitlines()[-1])
    if row["length"] != n or row["entries"] != n // CHUNK:
        sys.exit(f"FAIL: a lookup of the chain of {n} tokens gave {row}")
    return float(row["first_lookup_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8192,16384,32768", help="chain lengths (tokens, multiples of 64)")
    parser.add_argument("--rounds", type=int, default=5, help="new processes of each way (default 5)")
    parser.add_argument("--no-goals", action="store_true", help="report only: exit 0 whatever the ratio")
    args = parser.parse_args()
    lengths = sorted(int(t) for t in args.tokens.split(","))
    if any(n % CHUNK or n <= 0 for n in lengths) or args.rounds < 1:
        parser.error(f"--tokens must be positive multiples of {CHUNK}, --rounds at least 1")
    print("tokens | entries | first lookup, longest key first | before: least recently used first | ratio")
    ratio = 0.0
    with tempfile.TemporaryDirectory(prefix="sippcache-chain-open-") as tmp:
        for n in lengths:
            url = f"lmdb://{tmp}/chain-{n}?sync=false"
            build(url, n)
            times: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(args.rounds):
                for before in (False, True) if round_ % 2 == 0 else (True, False):
                    times[before].append(first_lookup(url, n, before))
            now, then = statistics.median(times[False]), statistics.median(times[True])
            ratio = now / then
            print(f"{n:,} | {n // CHUNK} | {now * 1e3:.1f} ms | {then * 1e3:.1f} ms | {ratio:.2f}x")
    verdict = "PASS" if ratio <= GOAL else "MISS (--no-goals)" if args.no_goals else "FAIL"
    print(f"{verdict}: the first lookup at {lengths[-1]:,} tokens {ratio:.2f}x the order before <= {GOAL}x")
    return 1 if ratio > GOAL and not args.no_goals else 0


if __name__ == "__main__":
    sys.exit(main())

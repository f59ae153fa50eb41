"""Replay a real request trace through a cache with a byte budget: how many prompt tokens are reused.

The trace is the synthetic workload of the Mooncake FAST'25 release
(../shared/traces/synthetic_trace.jsonl; 3,993 requests, 15,325 prompt tokens
on average; its README describes the format): every prompt is a list of
512-token blocks, equal ids meaning equal tokens. Each block id becomes 512
token ids, the prompt is cut to its length, and for each request, in order:

1. lookup(prompt, partial=True): the tokens it shares with the best stored
   entry are reused;
2. store(prompt), with a blob of 4 bytes per token (so an entry counts 8 bytes
   per token against the budget: a budget of T tokens is max_bytes = 8 T).

Two eviction policies at the same budgets (1M, 3M and 10M tokens):

- sippcache: the real RAM backend, through the public protocol
  (`sippcache.open("ram://?max_bytes=...")`): superseded entries first, then
  GreedyDual-Size on priorities (see sippcache/catalog.py);
- plain LRU: the same prefix index and lookups, evicting the least recently
  used entry (`LRUCache` below).

The replay is checked against the trace README's own figures for plain LRU
(0.125, 0.260, 0.478 of prompt tokens reused at 1M, 3M, 10M). Goal:
sippcache reuses at least as many tokens as LRU at every budget.

    python benchmarks/trace.py [--trace PATH] [--budgets 1e6,3e6,1e7] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import sippcache
from sippcache.index import PrefixIndex

BLOCK = 512
BYTES_PER_TOKEN = 8  # a 4-byte-per-token blob plus the 4-byte-per-token key
DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "synthetic_trace.jsonl"
#: Plain LRU's figures in the trace's README, which this replay must reproduce.
PUBLISHED_LRU = {1_000_000: 0.125, 3_000_000: 0.260, 10_000_000: 0.478}


def requests(path: Path) -> Iterator[bytes]:
    """Each request's prompt as token bytes (uint32 little-endian)."""
    with path.open() as lines:
        for line in lines:
            request = json.loads(line)
            ids = array("I")
            for block in request["hash_ids"]:
                ids.extend(range(block * BLOCK, block * BLOCK + BLOCK))
            yield ids[: request["input_length"]].tobytes()


class LRUCache:
    """Plain LRU over the same prefix index the backends use: the reference policy."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.index = PrefixIndex()
        self.sizes: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.total = 0
        self.clock = 0

    def lookup(self, key: bytes) -> int:
        hit = self.index.longest_common("", key)
        if hit is None:
            return 0
        self.clock += 1
        self.sizes.move_to_end(hit.entry_id)
        self.index.touch(hit.entry_id, self.clock)
        return hit.length

    def store(self, key: bytes) -> None:
        size = len(key) // 4 * BYTES_PER_TOKEN
        if size > self.max_bytes:
            return
        self.clock += 1
        if key in self.sizes:
            self.total -= self.sizes.pop(key)
        while self.total + size > self.max_bytes:
            victim, victim_size = self.sizes.popitem(last=False)
            self.index.remove(victim)
            self.total -= victim_size
        self.sizes[key] = size
        self.total += size
        self.index.insert("", key, key, self.clock)


def replay_lru(prompts: list[bytes], budget_tokens: int) -> float:
    cache = LRUCache(budget_tokens * BYTES_PER_TOKEN)
    reused = total = 0
    for key in prompts:
        reused += cache.lookup(key)
        total += len(key) // 4
        cache.store(key)
    return reused / total


def replay_sippcache(prompts: list[bytes], budget_tokens: int | None) -> tuple[float, int]:
    url = "ram://?max_bytes=" + (str(budget_tokens * BYTES_PER_TOKEN) if budget_tokens else str(2**62))
    reused = total = 0
    with sippcache.open(url) as cache:
        for key in prompts:
            tokens = array("I", key)
            match = cache.lookup(tokens, partial=True)
            if match is not None:
                reused += match.length
                match.release()
            total += len(tokens)
            cache.store(tokens, bytes(len(key)))
        evictions = cache.stats().evictions
    return reused / total, evictions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"the trace (default {DEFAULT_TRACE})")
    parser.add_argument("--budgets", default="1e6,3e6,1e7", help="budgets in tokens (default 1e6,3e6,1e7)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not args.trace.is_file():
        print(f"error: no trace at {args.trace} (give --trace PATH)", file=sys.stderr)
        return 2
    budgets = [int(float(b)) for b in args.budgets.split(",")]
    prompts = list(requests(args.trace))
    rows = []
    for budget in budgets:
        started = time.perf_counter()
        lru = replay_lru(prompts, budget)
        ours, evictions = replay_sippcache(prompts, budget)
        rows.append({"budget_tokens": budget, "lru": lru, "sippcache": ours, "gain": ours / lru - 1,
                     "evictions": evictions, "seconds": time.perf_counter() - started})  # fmt: skip
    unlimited, _ = replay_sippcache(prompts, None)
    goals = {f"sippcache >= LRU at {r['budget_tokens']:,} tokens": r["sippcache"] >= r["lru"] for r in rows}
    goals.update({
        f"plain LRU reproduces the published {PUBLISHED_LRU[r['budget_tokens']]} at {r['budget_tokens']:,}":
            abs(r["lru"] - PUBLISHED_LRU[r["budget_tokens"]]) < 0.0025
        for r in rows if r["budget_tokens"] in PUBLISHED_LRU
    })  # fmt: skip
    if args.json:
        print(json.dumps({"requests": len(prompts), "unlimited": unlimited, "rows": rows, "goals": goals}))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"Mooncake synthetic trace ({len(prompts):,} requests): fraction of prompt tokens reused")
        for column in ("budget (tokens)", "plain LRU", "sippcache", "gain", "evictions"):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(f"{r['budget_tokens']:,}", f"{r['lru']:.3f}", f"{r['sippcache']:.3f}",
                          f"{r['gain'] * 100:+.1f}%", f"{r['evictions']:,}")  # fmt: skip
        table.caption = f"unlimited space: {unlimited:.3f} (the trace README: 0.651)"
        console = Console()
        console.print(table)
        for goal, ok in goals.items():
            console.print(f"{'PASS' if ok else 'FAIL'}  {goal}")
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

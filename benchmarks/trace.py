"""Replay request workloads through a cache with a byte budget: how many prompt tokens each eviction policy reuses.

Two workloads:

- mooncake: the synthetic workload of the Mooncake FAST'25 release
  (../shared/traces/synthetic_trace.jsonl; 3,993 requests, 15,325 prompt
  tokens on average; its README describes the format): every prompt is a list
  of 512-token blocks, equal ids meaning equal tokens. Each block id becomes
  512 token ids and the prompt is cut to its length.
- conversations: generated here, deterministic for a seed (`conversations`):
  3,000 multi-turn chats (1 + Exp(3) turns, at most 12) starting as a Poisson
  process (4 a second), each on one of four shared system prompts (4,000,
  2,000, 1,000 and 500 tokens, picked 40/30/20/10%). A turn's prompt is the
  system prompt, the earlier turns and their answers, and the new message
  (LogNormal(4.5, 0.8) + 5 tokens; answers LogNormal(5.3, 0.6) + 10, written
  at 50 tokens a second); the next turn comes Exp(60 s) after the answer.
  About 10,500 requests of 3,500 tokens on average.

For each request, in arrival order:

1. lookup(prompt, partial=True): the tokens it shares with the best stored
   entry are reused;
2. store(prompt), with a blob of 4 bytes per token (so an entry counts 8 bytes
   per token against the budget: a budget of T tokens is max_bytes = 8 T).

Both policies run on the real RAM backend through the public protocol, with
the same prefix index and lookups; only the eviction policy differs
(`sippcache.eviction`):

- plain LRU (`LRU`): the least recently used entry goes first;
- sippcache (the default, `GreedyDual`): superseded entries first, then
  GreedyDual-Size on priorities.

The replay is checked against the Mooncake README's own figures for plain LRU
(0.125, 0.260, 0.478 of prompt tokens reused at 1M, 3M, 10M). Goal: the
default reuses at least as many tokens as LRU on every workload at every
budget; each is printed as PASS or FAIL, and the exit code is 1 if any fails.

    python -m benchmarks.trace [--trace PATH] [--workloads mooncake,conversations]
                               [--budgets 1e6,3e6,1e7] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from sippcache.backends.ram import RAMBackend
from sippcache.eviction import DEFAULT_POLICY, LRU, EvictionPolicy

BLOCK = 512
BYTES_PER_TOKEN = 8  # a 4-byte-per-token blob plus the 4-byte-per-token key
#: Where the trace is looked for: beside the checkout (../shared/traces), or its parent's (a git worktree).
TRACE_PLACES = [Path(__file__).resolve().parents[n] / "shared" / "traces" / "synthetic_trace.jsonl" for n in (2, 3)]
#: Plain LRU's figures in the trace's README, which this replay must reproduce.
PUBLISHED_LRU = {1_000_000: 0.125, 3_000_000: 0.260, 10_000_000: 0.478}

# The conversation workload (see the module docstring).
VOCABULARY = 32_000
SYSTEM_PROMPTS = (4_000, 2_000, 1_000, 500)  # tokens
SYSTEM_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
CONVERSATIONS = 3_000
ARRIVALS_PER_SECOND = 4.0
MEAN_EXTRA_TURNS, MAX_TURNS = 3.0, 12
MESSAGE_LOGNORMAL, ANSWER_LOGNORMAL = (4.5, 0.8), (5.3, 0.6)
ANSWER_TOKENS_PER_SECOND = 50.0
MEAN_THINK_SECONDS = 60.0


def mooncake(path: Path) -> Iterator[bytes]:
    """Each request's prompt as token bytes (uint32 little-endian)."""
    with path.open() as lines:
        for line in lines:
            request = json.loads(line)
            ids = array("I")
            for block in request["hash_ids"]:
                ids.extend(range(block * BLOCK, block * BLOCK + BLOCK))
            yield ids[: request["input_length"]].tobytes()


def conversations(seed: int, count: int = CONVERSATIONS) -> list[bytes]:
    """The conversation workload's prompts (token bytes) in arrival order (`count` conversations)."""
    rng = random.Random(seed)

    def tokens(count: int) -> array[int]:
        return array("I", [rng.randrange(VOCABULARY) for _ in range(count)])

    systems = [tokens(length) for length in SYSTEM_PROMPTS]
    requests: list[tuple[float, int, bytes]] = []
    start = 0.0
    for number in range(count):
        start += rng.expovariate(ARRIVALS_PER_SECOND)
        history = array("I", rng.choices(systems, SYSTEM_WEIGHTS)[0])
        turns = min(MAX_TURNS, 1 + int(rng.expovariate(1 / MEAN_EXTRA_TURNS)))
        at = start
        for _ in range(turns):
            prompt = history + tokens(int(rng.lognormvariate(*MESSAGE_LOGNORMAL)) + 5)
            requests.append((at, number, prompt.tobytes()))
            answer = tokens(int(rng.lognormvariate(*ANSWER_LOGNORMAL)) + 10)
            history = prompt + answer
            at += len(answer) / ANSWER_TOKENS_PER_SECOND + rng.expovariate(1 / MEAN_THINK_SECONDS)
    requests.sort()
    return [prompt for _, _, prompt in requests]


def replay(prompts: list[bytes], budget_tokens: int | None, policy: EvictionPolicy) -> tuple[float, int]:
    """The fraction of prompt tokens reused, and the evictions, with `policy` at `budget_tokens`."""
    reused = total = 0
    with RAMBackend(max_bytes=budget_tokens * BYTES_PER_TOKEN if budget_tokens else None, eviction=policy) as cache:
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


@dataclass
class Row:
    """One budget: each policy's fraction of prompt tokens reused and evictions."""

    budget_tokens: int
    lru: float
    sippcache: float
    lru_evictions: int
    sippcache_evictions: int
    seconds: float

    @property
    def gain(self) -> float:
        return self.sippcache / self.lru - 1

    @property
    def passed(self) -> bool:
        return self.sippcache >= self.lru


@dataclass
class Result:
    workload: str
    requests: int
    mean_tokens: float
    unlimited: float  # reused with no budget at all: the ceiling
    rows: list[Row]


def measure(workload: str, prompts: list[bytes], budgets: list[int]) -> Result:
    rows = []
    for budget in budgets:
        started = time.perf_counter()
        lru, lru_evictions = replay(prompts, budget, LRU())
        ours, evictions = replay(prompts, budget, DEFAULT_POLICY)
        rows.append(Row(budget, lru, ours, lru_evictions, evictions, time.perf_counter() - started))
    unlimited, _ = replay(prompts, None, DEFAULT_POLICY)
    return Result(workload, len(prompts), sum(len(p) for p in prompts) / 4 / len(prompts), unlimited, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help=f"the Mooncake trace (default: {TRACE_PLACES[0]})")
    parser.add_argument("--workloads", default="mooncake,conversations", help="which to replay (default: both)")
    parser.add_argument("--budgets", default="1e6,3e6,1e7", help="budgets in tokens (default 1e6,3e6,1e7)")
    parser.add_argument("--seed", type=int, default=0, help="the conversation workload's seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    budgets = [int(float(b)) for b in args.budgets.split(",")]
    names = args.workloads.split(",")
    if not set(names) <= {"mooncake", "conversations"}:
        parser.error("--workloads: mooncake, conversations or both")
    results = []
    goals: dict[str, bool] = {}
    for name in names:
        if name == "mooncake":
            path = args.trace or next((p for p in TRACE_PLACES if p.is_file()), TRACE_PLACES[0])
            if not path.is_file():
                print(f"error: no trace at {path} (give --trace PATH)", file=sys.stderr)
                return 2
            result = measure(name, list(mooncake(path)), budgets)
        else:
            result = measure(f"conversations (seed {args.seed})", conversations(args.seed), budgets)
        results.append(result)
        for row in result.rows:
            goals[f"{result.workload}: sippcache >= plain LRU at {row.budget_tokens:,} tokens"] = row.passed
            published = PUBLISHED_LRU.get(row.budget_tokens)
            if name == "mooncake" and published is not None:
                goals[f"mooncake: plain LRU reproduces the published {published} at {row.budget_tokens:,}"] = (
                    abs(row.lru - published) < 0.0025
                )
    if args.json:
        print(json.dumps({"results": [asdict(result) for result in results], "goals": goals}))
    else:
        print_tables(results, goals)
    return 0 if all(goals.values()) else 1


def print_tables(results: list[Result], goals: dict[str, bool]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for result in results:
        table = Table(
            title=f"{result.workload}: {result.requests:,} requests, {result.mean_tokens:,.0f} tokens "
            "on average: fraction of prompt tokens reused"
        )
        for column in ("budget (tokens)", "plain LRU", "sippcache", "gain", "evictions", "goal"):
            table.add_column(column, justify="right")
        for r in result.rows:
            evictions = f"{r.lru_evictions:,} / {r.sippcache_evictions:,}"
            table.add_row(
                f"{r.budget_tokens:,}",
                f"{r.lru:.4f}",
                f"{r.sippcache:.4f}",
                f"{r.gain * 100:+.1f}%",
                evictions,
                "PASS" if r.passed else "FAIL",
            )
        table.caption = f"unlimited space: {result.unlimited:.4f}; evictions: plain LRU / sippcache"
        console.print(table)
    for goal, ok in goals.items():
        console.print(f"{'PASS' if ok else 'FAIL'}  {goal}")


if __name__ == "__main__":
    sys.exit(main())

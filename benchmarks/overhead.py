"""What a cache miss costs: the first call with sippcache against no cache at all.

On gemma-3-270m, for prompts of 1,000 / 2,000 / 4,000 tokens, every prompt new
(so every cached call is a miss that evaluates everything and stores its
entries), interleaved in one process, the side that goes first alternating,
so machine noise hits both sides alike:

- time to first token: `llm.eval(prompt)` + `sample()` with no cache, against
  `PrefixCache(...).prefill(prompt)` + `sample()` (LMDB, `sippcache.llama.Llama`);
- a completion: `create_completion(prompt, max_tokens=16)` on a plain
  `llama_cpp.Llama` without a cache, against `sippcache.llama.Llama` with
  `LlamaCache` (LMDB): the prefill, the snapshot with its logits, the
  background write overlapping the generated tokens, the state after the
  completion.

Each cached call's background writes are waited for after its timing ends, so
they never spill into the next measurement. Goal: the median overhead of a
miss is <= 5% for every size, both ways. A warm repeat of the last prompt is
printed too (the prompt restored with its logits from LMDB into an emptied
context), so the speed a cache exists for is in the same table.

    python -m benchmarks.overhead [--runs 5] [--sizes 1000,2000,4000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

N_CTX = 4608
TEXT = (
    "The lighthouse keeper kept a log of every ship that passed the northern cape. Each entry named the "
    "vessel, its flag, the hour, the weather and the state of the sea. "
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="prompts per size (default 5)")
    parser.add_argument("--sizes", default="1000,2000,4000", help="prompt lengths (default 1000,2000,4000)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    import llama_cpp

    from sippcache.demo.model import gemma_model_path
    from sippcache.llama import Llama as SippLlama
    from sippcache.llama import LlamaCache, PrefixCache

    model = str(gemma_model_path())
    options = dict(model_path=model, n_ctx=N_CTX, n_batch=512, verbose=False)
    plain, ours, hooked = llama_cpp.Llama(**options), SippLlama(**options), SippLlama(**options)
    words = TEXT.split()

    def prompt(n: int, salt: str) -> list[int]:
        text = " ".join(f"{salt}{words[i % len(words)]}{i % 89}" for i in range(2 * n))
        return plain.tokenize(text.encode())[:n]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix_cache = PrefixCache(ours, f"lmdb://{tmp}/prefill")
        hook = LlamaCache(f"lmdb://{tmp}/hook")
        hooked.set_cache(hook)
        for n in sizes:
            times: dict[str, list[float]] = {"ttft none": [], "ttft miss": [], "completion none": [],
                                             "completion miss": []}  # fmt: skip
            for run in range(args.runs):
                tokens = prompt(n, f"r{run}n{n}")
                text = plain.detokenize(tokens).decode(errors="ignore")

                def ttft_none(tokens: list[int] = tokens) -> None:
                    plain.reset()
                    plain.eval(tokens)
                    plain.sample(temp=0.0)

                def ttft_miss(tokens: list[int] = tokens) -> None:
                    result = prefix_cache.prefill(tokens)
                    ours.sample(temp=0.0)
                    assert result.restored == 0  # a miss (the live context may still share the first token)

                def completion_none(text: str = text) -> None:
                    plain.reset()
                    plain.create_completion(text, max_tokens=16, temperature=0.0)

                def completion_miss(text: str = text) -> None:
                    hooked.create_completion(text, max_tokens=16, temperature=0.0)

                pairs = [
                    ("ttft", ttft_none, ttft_miss, prefix_cache),
                    ("completion", completion_none, completion_miss, hook),
                ]
                for way, none, miss, cache in pairs:
                    # Which side goes first alternates, so a drift of the machine's speed favours neither.
                    order = (("none", none), ("miss", miss)) if run % 2 == 0 else (("miss", miss), ("none", none))
                    for side, call in order:
                        started = time.perf_counter()
                        call()
                        times[f"{way} {side}"].append(time.perf_counter() - started)
                        cache.flush()  # its background writes never spill into the next measurement
            ours.reset()  # a warm repeat restores from the store, not from the live context
            started = time.perf_counter()
            warm = prefix_cache.prefill(tokens)
            ours.sample(temp=0.0)
            warm_seconds = time.perf_counter() - started
            assert warm.restored == n and warm.logits_from_store
            median = {name: statistics.median(values) for name, values in times.items()}
            rows.append(
                {
                    "tokens": n,
                    **{f"{k}_s": v for k, v in median.items()},
                    "ttft_overhead": median["ttft miss"] / median["ttft none"] - 1,
                    "completion_overhead": median["completion miss"] / median["completion none"] - 1,
                    "warm_repeat_s": warm_seconds,
                    "warm_restored": warm.restored,
                    "runs": {name: [round(v, 4) for v in values] for name, values in times.items()},
                }
            )
        prefix_cache.close()
        hook.close()
    goals = {
        f"miss overhead <= 5% ({row['tokens']:,} tokens, {way})": row[f"{way}_overhead"] <= 0.05
        for row in rows
        for way in ("ttft", "completion")
    }
    if args.json:
        print(json.dumps({"rows": rows, "goals": goals}))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"cache miss vs no cache (gemma-3-270m, LMDB, median of {args.runs} new prompts)")
        for column in (
            "tokens",
            "TTFT none",
            "TTFT miss",
            "overhead",
            "completion none",
            "completion miss",
            "overhead",
            "warm repeat",
        ):
            table.add_column(column, justify="right")
        for r in rows:
            table.add_row(
                f"{r['tokens']:,}",
                f"{r['ttft none_s'] * 1000:.0f} ms",
                f"{r['ttft miss_s'] * 1000:.0f} ms",
                f"{r['ttft_overhead'] * 100:+.1f}%",
                f"{r['completion none_s'] * 1000:.0f} ms",
                f"{r['completion miss_s'] * 1000:.0f} ms",
                f"{r['completion_overhead'] * 100:+.1f}%",
                f"{r['warm_repeat_s'] * 1000:.1f} ms",
            )
        console = Console()
        console.print(table)
        for goal, ok in goals.items():
            console.print(f"{'PASS' if ok else 'FAIL'}  {goal}")
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

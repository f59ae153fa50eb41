"""An exact repeat of a prompt, in a new process: time to first token on gemma-3-270m.

Three ways to answer the same 2,000-token prompt, each measured in fresh
processes (as after a restart), side by side in one run:

- cold: no cache, the whole prompt evaluated, then the first token sampled;
- restore + decode: what sippcache did before stored logits (and still does
  for a plain `llama_cpp.Llama`): restore the prompt minus its last token from
  LMDB, evaluate that token, sample;
- stored logits: `sippcache.llama.Llama` + `PrefixCache` restore the whole
  prompt with its logits from LMDB and sample from them; nothing is evaluated.

Time to first token runs from `prefill` (or `eval`) to the sampled token; the
three must sample the same token. Goals: stored logits >= 400x faster than
cold and >= 3x faster than restore + decode.

    python -m benchmarks.repeat [--tokens 2000] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import ROOT

N_CTX = 4608
TEXT = (
    "The lighthouse keeper kept a log of every ship that passed the northern cape. Each entry named the "
    "vessel, its flag, the hour, the weather and the state of the sea. "
)


def prompt_tokens(llm, n: int) -> list[int]:
    words = TEXT.split()
    tokens = llm.tokenize(" ".join(f"{words[i % len(words)]}{i % 89}" for i in range(2 * n)).encode())
    assert len(tokens) >= n
    return tokens[:n]


def child(model: str, mode: str, url: str, n: int) -> dict:
    """One fresh process: load the model, time one prefill + first token."""
    import llama_cpp

    from sippcache.llama import Llama as SippLlama
    from sippcache.llama import PrefixCache

    cls = SippLlama if mode in ("logits", "store-logits") else llama_cpp.Llama
    llm = cls(model_path=model, n_ctx=N_CTX, n_batch=512, verbose=False)
    tokens = prompt_tokens(llm, n)
    if mode == "cold":
        started = time.perf_counter()
        llm.eval(tokens)
        token = llm.sample(temp=0.0)
        return {"seconds": time.perf_counter() - started, "token": token}
    with PrefixCache(llm, url) as cache:
        started = time.perf_counter()
        result = cache.prefill(tokens)
        token = llm.sample(temp=0.0)
        seconds = time.perf_counter() - started
    return {
        "seconds": seconds,
        "token": token,
        "restored": result.restored,
        "evaluated": result.evaluated,
        "logits_from_store": result.logits_from_store,
    }


def run_child(model: str, mode: str, url: str, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--child", model, mode, url, str(n)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length (default 2,000)")
    parser.add_argument("--runs", type=int, default=5, help="processes per way (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "MODE", "URL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, mode, url, n = args.child
        print(json.dumps(child(model, mode, url, int(n))))
        return 0

    from sippcache.demo.model import gemma_model_path

    model, n = str(gemma_model_path()), args.tokens
    with tempfile.TemporaryDirectory() as tmp:
        decode_url, logits_url = f"lmdb://{tmp}/decode", f"lmdb://{tmp}/logits"
        # Fill each store once (a plain Llama stores the prompt minus one; sippcache's Llama the whole prompt).
        assert run_child(model, "store-decode", decode_url, n)["evaluated"] == n
        assert run_child(model, "store-logits", logits_url, n)["evaluated"] == n
        runs: dict[str, list[dict]] = {"cold": [], "restore + decode": [], "stored logits": []}
        for _ in range(args.runs):  # interleaved, so machine noise hits all three alike
            runs["cold"].append(run_child(model, "cold", "", n))
            runs["restore + decode"].append(run_child(model, "decode", decode_url, n))
            runs["stored logits"].append(run_child(model, "logits", logits_url, n))
    tokens = {r["token"] for rows in runs.values() for r in rows}
    assert len(tokens) == 1, f"the three ways sampled different tokens: {tokens}"
    assert all(r["evaluated"] == 1 and r["restored"] == n - 1 for r in runs["restore + decode"])
    assert all(r["evaluated"] == 0 and r["logits_from_store"] for r in runs["stored logits"])
    ttft = {name: statistics.median(r["seconds"] for r in rows) for name, rows in runs.items()}
    vs_cold = ttft["cold"] / ttft["stored logits"]
    vs_decode = ttft["restore + decode"] / ttft["stored logits"]
    goals = {
        "stored logits >= 400x faster than cold": vs_cold >= 400,
        "stored logits >= 3x faster than restore + decode": vs_decode >= 3,
    }
    if args.json:
        print(
            json.dumps(
                {
                    "tokens": n,
                    "runs": args.runs,
                    "ttft_seconds": ttft,
                    "vs_cold": vs_cold,
                    "vs_decode": vs_decode,
                    "goals": goals,
                }
            )
        )
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"exact repeat of a {n:,}-token prompt, new process each (gemma-3-270m, LMDB)")
        for column in ("way", "median TTFT", "all runs (ms)", "stored logits faster by"):
            table.add_column(column, justify="right")
        for name, rows in runs.items():
            all_ms = " ".join(f"{r['seconds'] * 1000:.1f}" for r in rows)
            table.add_row(name, f"{ttft[name] * 1000:.1f} ms", all_ms, f"{ttft[name] / ttft['stored logits']:.1f}x")
        console = Console()
        console.print(table)
        for goal, ok in goals.items():
            console.print(f"{'PASS' if ok else 'FAIL'}  {goal}")
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

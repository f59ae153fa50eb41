"""Prompt-ids benchmark: what the proxy's tokenizing of a completion prompt adds to its time to first token.

The proxy asks llama-server to tokenize every prompt (`/tokenize`: the store is keyed by tokens).
Until 2026-11-28 it then passed the prompt on as text, and llama-server tokenized it a second
time, inside the request's time to first token; now a completion's text prompt goes on as the
ids the proxy already has (`sippcache.proxy.app._ids_for_text`). This benchmark prices that on a
prompt the slot already holds (llama-server computes one token of it: what is left is
tokenizing, JSON and the proxy), the case where the proxy's own steps weigh the most.

One llama-server (gemma-3-270m, one slot, ``--swa-full``, ``--cache-ram 0``, as the proxy's attach
example starts it) and, in front of it, `sippcache proxy --upstream`. Per prompt length, rounds
alternating (median ms of the non-streamed ``/completion``, ``n_predict`` 1, the wall time as the
client sees it):

- direct, text: the request straight to llama-server (what a user has without sippcache);
- direct, ids: the same with the prompt as token ids (llama-server does not tokenize: the floor);
- through the proxy, text: what a client of the proxy sends (the proxy tokenizes; ids go on);
- before 2026-11-28: `/tokenize` of the text, then the text straight to llama-server: the two
  tokenizations the proxy's path made (its other steps aside).

Goal, judged on the longest prompt: through the proxy at most 1.25x direct-text's time (before
this change: about 2x, tokenizing twice). Exit status 1 if it fails (unless --no-goals).

    python benchmarks/prompt_ids.py                      # 2K, 8K, 28K tokens of gemma-3
    python benchmarks/prompt_ids.py --tokens 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sippcache.demo.model import gemma_model_path
from tests.proxy_tools import LlamaServer, ProxyServer

WORDS = [
    "the",
    "harbour",
    "of",
    "a",
    "quiet",
    "town",
    "where",
    "boats",
    "rest",
    "under",
    "grey",
    "skies",
    "and",
    "gulls",
    "cry",
    "over",
    "the",
    "long",
    "pier",
]
GOAL = 1.25


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(the decoded answer, wall ms)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        answer = json.loads(response.read())
    return answer, (time.perf_counter() - start) * 1000


def prompt_text(tokens: int, seed: int) -> str:
    """Words enough for about `tokens` tokens of gemma-3 (one a word, near enough)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2000,8000,28000", help="prompt lengths (words of gemma-3)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-goals", action="store_true")
    args = parser.parse_args()
    lengths = [int(n) for n in args.tokens.split(",")]
    model = gemma_model_path()
    with tempfile.TemporaryDirectory(prefix="sippcache-prompt-ids-") as tmp:
        slots = Path(tmp) / "slots"
        slots.mkdir()
        flags = ["-c", str(max(lengths) + 4096), "-np", "1", "--slot-save-path", str(slots)]
        server = LlamaServer(model, Path(tmp) / "llama.log", *flags, "--swa-full", "--cache-ram", "0")
        server.start()
        proxy = ProxyServer(
            ["--upstream", server.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp}/store"],
            Path(tmp) / "proxy.log",
        )
        try:
            proxy.wait_ready()
            rows = [measure(server.url, proxy.url, n, args.rounds) for n in lengths]
        finally:
            proxy.stop()
            server.stop()
    return report(rows, args.no_goals)


def measure(direct: str, proxied: str, words: int, rounds: int) -> dict[str, Any]:
    text = prompt_text(words, words)
    ids = post(direct + "/tokenize", {"content": text, "add_special": True, "parse_special": True})[0]["tokens"]
    body = {"n_predict": 1, "temperature": 0, "cache_prompt": True}

    def before() -> float:
        took = post(direct + "/tokenize", {"content": text, "add_special": True, "parse_special": True})[1]
        return took + post(direct + "/completion", {**body, "prompt": text})[1]

    ways: dict[str, Callable[[], float]] = {
        "direct, text": lambda: post(direct + "/completion", {**body, "prompt": text})[1],
        "direct, ids": lambda: post(direct + "/completion", {**body, "prompt": ids})[1],
        "through the proxy, text": lambda: post(proxied + "/completion", {**body, "prompt": text})[1],
        "before: /tokenize, then the text": before,
    }
    answer = post(proxied + "/completion", {**body, "prompt": text})[0]  # the slot holds it from now on
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, run in ways.items():
            times[way].append(run())
    held = post(direct + "/completion", {**body, "prompt": text})[0]["timings"]
    if held["prompt_n"] > 1:
        sys.exit(f"FAIL: the slot did not hold the prompt ({held}); first answer's timings {answer.get('timings')}")
    return {"tokens": len(ids), **{way: statistics.median(t) for way, t in times.items()}}


def report(rows: list[dict[str, Any]], no_goals: bool) -> int:
    ways = [k for k in rows[0] if k != "tokens"]
    print(f"{'tokens':>8}  " + "  ".join(f"{w:>32}" for w in ways))
    for row in rows:
        base = row["direct, text"]
        cells = [f"{row[w]:8.1f} ms ({row[w] / base:4.2f}x)" for w in ways]
        print(f"{row['tokens']:>8,}  " + "  ".join(f"{c:>32}" for c in cells))
    print("(median ms, wall, n_predict 1, the prompt held in the slot; x: over direct, text)")
    last = rows[-1]
    ratio = last["through the proxy, text"] / last["direct, text"]
    ok = ratio <= GOAL
    verdict = "PASS" if ok else ("MISS (--no-goals)" if no_goals else "FAIL")
    print(
        f"{verdict}: through the proxy at {last['tokens']:,} tokens {ratio:.2f}x direct's time <= {GOAL}x"
        f" (before: {last['before: /tokenize, then the text'] / last['direct, text']:.2f}x)"
    )
    return 0 if ok or no_goals else 1


if __name__ == "__main__":
    sys.exit(main())

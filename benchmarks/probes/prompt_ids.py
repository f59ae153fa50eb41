"""Decided: a completion's text prompt goes on to llama-server as the ids the proxy made (da13b47: 29.5K
tokens, 163 ms through the proxy against 139 ms straight and 235 ms tokenizing twice), and a chat is
tokenized only past the prompt text it begins with (6078f6f, `sippcache.proxy.prompts`).

Prompt-ids probe: what the proxy's tokenizing of a prompt adds to a request's time to first token.

The proxy asks llama-server to tokenize every prompt (`/tokenize`: the store is keyed by tokens).
Until 2026-11-28 it then passed the prompt on as text, and llama-server tokenized it a second
time, inside the request's time to first token; now a completion's text prompt goes on as the
ids the proxy already has (`sippcache.proxy.app._ids_for_text`). This probe prices that on a
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

A chat has no token-id form: llama-server tokenizes it whatever the proxy does. The proxy now
has it tokenize only the text past the last prompt text a chat begins with
(`sippcache.proxy.prompts`). Rows for a conversation's next turn (a new one each round, over a
first turn the proxy has seen and the slot holds), each less llama-server's prompt processing
(`timings.prompt_ms`: on a CPU a turn's new tokens over a long context take most of a second,
and vary by more than the token calls cost): direct, through the proxy, and before 2026-11-28
(`/apply-template` and `/tokenize` of the whole text, then the chat, straight).

Goal, judged on the longest prompt of each table: what the proxy adds over straight to
llama-server at most half of what the old path's token calls added (the proxy's own steps, an
HTTP hop and its JSON, count against it). Exit status 1 if one fails (unless --no-goals).

    python -m benchmarks.probes.prompt_ids                      # 2K, 8K, 28K tokens of gemma-3
    python -m benchmarks.probes.prompt_ids --tokens 2000 --rounds 3
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

from harness.proxy_tools import LlamaServer, ProxyServer
from sippcache.demo.model import gemma_model_path

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
GOAL = 0.5
CHAT_ROWS = "a chat's next turn, less llama-server's prompt processing (timings.prompt_ms)"


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(the decoded answer, wall ms)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        answer = json.loads(response.read())
    return answer, (time.perf_counter() - start) * 1000


def tokenize(url: str, text: str) -> tuple[list[int], float]:
    """(`text`'s tokens as llama-server at `url` tokenizes a prompt, as the proxy asks; wall ms)."""
    answer, took = post(url + "/tokenize", {"content": text, "add_special": True, "parse_special": True})
    return answer["tokens"], took


def prompt_text(tokens: int, seed: int) -> str:
    """Words enough for about `tokens` tokens of gemma-3 (one a word, near enough)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
            chats = [measure_chat(server.url, proxy.url, n, args.rounds) for n in lengths]
        finally:
            proxy.stop()
            server.stop()
    return judge(rows, chats, args.no_goals)


def measure(direct: str, proxied: str, words: int, rounds: int) -> dict[str, Any]:
    text = prompt_text(words, words)
    ids = tokenize(direct, text)[0]
    body = {"n_predict": 1, "temperature": 0, "cache_prompt": True}

    def before() -> float:
        return tokenize(direct, text)[1] + post(direct + "/completion", {**body, "prompt": text})[1]

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


def measure_chat(direct: str, proxied: str, words: int, rounds: int) -> dict[str, Any]:
    """A conversation's next turn (the slot holds the turns before; the proxy saw the first), each
    turn sent one of three ways in turn: straight to llama-server, through the proxy, and the
    proxy's token calls before 2026-11-28 (`/apply-template`, `/tokenize` of the whole) then the chat."""
    first = [{"role": "user", "content": prompt_text(words, words) + "\n\nWhich boat came in first?"}]
    body = {"max_tokens": 1, "temperature": 0, "cache_prompt": True}
    post(proxied + "/v1/chat/completions", {**body, "messages": first})  # the slot holds it from now on

    def outside(url: str, messages: list[dict[str, str]]) -> float:
        """Wall ms of the chat less llama-server's prompt processing (its `timings.prompt_ms`): on
        a CPU a turn's new tokens over a long context take most of a second, and vary by more
        than the token calls cost."""
        answer, took = post(url + "/v1/chat/completions", {**body, "messages": messages})
        return took - float(answer["timings"]["prompt_ms"])

    def before(messages: list[dict[str, str]]) -> float:
        text, took = post(direct + "/apply-template", {"messages": messages})
        took += tokenize(direct, text["prompt"])[1]
        return took + outside(direct, messages)

    ways: dict[str, Callable[[list[dict[str, str]]], float]] = {
        "direct, chat": lambda m: outside(direct, m),
        "through the proxy, chat": lambda m: outside(proxied, m),
        "before: template + /tokenize, then the chat": before,
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    messages = first
    for turn in range(rounds * len(ways)):  # one conversation, each turn through the next way
        way = list(ways)[turn % len(ways)]
        messages = [*messages, {"role": "assistant", "content": f"Boat {turn}."}, {"role": "user", "content": "And?"}]
        times[way].append(ways[way](messages))
    timings = post(direct + "/v1/chat/completions", {**body, "messages": messages})[0]["timings"]
    tokens = timings["prompt_n"] + timings["cache_n"]
    if timings["cache_n"] < tokens - 64:
        sys.exit(f"FAIL: the slot did not hold the conversation ({timings})")
    return {"tokens": tokens, **{way: statistics.median(t) for way, t in times.items()}}


def table(rows: list[dict[str, Any]], what: str) -> list[str]:
    """Print the rows; their ways, the first (straight to llama-server) the one the others are over."""
    print(f"{what}:")
    ways = [k for k in rows[0] if k != "tokens"]
    print(f"{'tokens':>8}  " + "  ".join(f"{w:>32}" for w in ways))
    for row in rows:
        base = row[ways[0]]
        cells = [f"{row[w]:8.1f} ms ({row[w] / base:4.2f}x)" for w in ways]
        print(f"{row['tokens']:>8,}  " + "  ".join(f"{c:>32}" for c in cells))
    print(f"(median ms, 1 token generated, the prompt held in the slot; x: over {ways[0]})")
    return ways


def judge(rows: list[dict[str, Any]], chats: list[dict[str, Any]], no_goals: bool) -> int:
    """The goal, on the longest prompt of each table: what the proxy adds over straight at most
    `GOAL` times what the old path's token calls added. PASS, or FAIL (exit status 1) / MISS."""
    failed = 0
    for found, what in (rows, "a completion's prompt, wall"), (chats, CHAT_ROWS):
        ways = table(found, what)
        last = found[-1]
        straight, proxied, before = (
            last[w] for w in (ways[0], *[w for w in ways if w.startswith(("through", "before"))])
        )
        ok = proxied - straight <= GOAL * (before - straight)
        verdict = "PASS" if ok else "MISS (--no-goals)" if no_goals else "FAIL"
        print(
            f"{verdict}: at {last['tokens']:,} tokens the proxy adds {proxied - straight:.1f} ms to straight's"
            f" {straight:.1f} ms ({proxied / straight:.2f}x), <= {GOAL}x the {before - straight:.1f} ms the old"
            f" path's token calls added ({before / straight:.2f}x)\n"
        )
        failed += not ok
    return 1 if failed and not no_goals else 0


if __name__ == "__main__":
    sys.exit(main())

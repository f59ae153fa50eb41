"""Every memory kind, side by side with llama-cpp-python's `LlamaRAMCache` on the same model.

One row per memory kind: tiny generated models (harness/tinymodel.py) of full attention
(llama), sliding window (gemma3, iSWA), recurrent (mamba) and hybrid (jamba), and the
real gemma-3-270m (iSWA) when its PyPI package is installed. For each, in one run:

1. Time to first token (TTFT) in a new process, the demo's path: `sippcache.llama.Llama`
   and `PrefixCache` on LMDB, `prefill` then `sample`. A cold process on an empty store,
   then a new process on the store the first one left (medians of `--runs` pairs on each
   tiny model, `--gemma-runs` on gemma; model loading is not timed). `LlamaRAMCache` keeps
   its entries in the memory of the process that made them: a new process starts with it
   empty, so there its warm TTFT is its cold one. What it does in process is measured
   instead: `create_completion(max_tokens=1)` on a fresh `llama_cpp.Llama`, then on another
   fresh `Llama` given the same cache object (TTFT up to the first token sampled, not the
   state it saves afterwards).
2. Tokens reused on a 3-turn conversation: each turn's prompt is the conversation so far
   (the previous prompt and the answer the model gave, as tokens) and a new question;
   every turn runs on a fresh `Llama` (a context that holds nothing, as after a restart or
   on another worker), through `create_completion`: sippcache's `Llama` with its
   `LlamaCache` (LMDB), and a plain `llama_cpp.Llama` with one `LlamaRAMCache` object.
   Reuse is counted from what llama.cpp did not evaluate (`llama_perf_context`: the prompt
   tokens its decode calls took), never from what a cache handed over.

Goals (PASS/FAIL, exit code 1 if one fails), on every kind: sippcache's warm new process
reaches its first token at least `MIN_SPEEDUP` times sooner than the cold one, evaluates at
most one prompt token and samples the first token the cold process sampled; sippcache's
turns 2 and 3 reuse at least the previous turn's prompt (minus `MARGIN` tokens); and
sippcache reuses no smaller share of any turn's prompt than `LlamaRAMCache`. The answers
are compared with the no-cache run's, token for token, and reported, not a goal: a
restored state's batch split differs from a cold one's, so a near-tie may go the other way.

    python -m benchmarks.families [--kinds attention,swa,recurrent,hybrid,gemma] [--tokens 2000]
                                  [--runs 5] [--gemma-runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import ROOT

#: One measurement, as the JSON output carries it.
Result = dict[str, Any]

#: Tiny generated models (harness/tinymodel.py) and the real gemma-3-270m.
KINDS = ("attention", "swa", "recurrent", "hybrid", "gemma")
N_CTX = 4096
#: Tokens the model answers each turn with (greedy; fewer if it ends its answer, more if the
#: text would end inside a UTF-8 character: see `timed_completion`).
ANSWER_TOKENS = 16
#: The warm new process's TTFT against the cold one's. "Faster at all" is not enough: with the
#: cache's reads turned off, noise alone made a warm process 1.1x faster on the tiny model.
MIN_SPEEDUP = 5.0
#: A warm turn may evaluate this many tokens of the previous turn's prompt again and still pass.
MARGIN = 1
QUESTIONS = (
    "\nQuestion: which vessel passed on day 12, and what was she carrying? Answer:",
    "\nQuestion: and what was the weather that day? Answer:",
    "\nQuestion: which flag did the vessel on day 40 fly? Answer:",
)


def document(llm: Any, n: int) -> list[int]:
    """The first `n` tokens of the demo's document (a keeper's log of ships), BOS included."""
    from sippcache.demo.run import demo_prompt

    text = demo_prompt()
    while len(tokens := llm.tokenize(text.encode())) < n:
        text += "\n" + text
    return [int(t) for t in tokens[:n]]


def question(llm: Any, k: int) -> list[int]:
    return [int(t) for t in llm.tokenize(QUESTIONS[k].encode(), add_bos=False)]


def load(model: str, cls: Any = None) -> Any:
    import llama_cpp

    return (cls or llama_cpp.Llama)(model_path=model, n_ctx=N_CTX, n_batch=512, verbose=False)


# -- children: each runs in a new process --------------------------------------------


def child_sippcache_ttft(model: str, url: str, n: int) -> Result:
    """The demo's path in a fresh process: `PrefixCache.prefill` then `sample`, timed."""
    from harness.llama_tools import start_counting, tokens_evaluated
    from sippcache.llama import Llama, PrefixCache

    llm = load(model, Llama)
    tokens = document(llm, n - len(question(llm, 0))) + question(llm, 0)
    with PrefixCache(llm, url) as cache:
        start_counting(llm.ctx)
        started = time.perf_counter()
        result = cache.prefill(tokens)
        token = llm.sample(temp=0.0)
        seconds = time.perf_counter() - started
        evaluated = tokens_evaluated(llm.ctx)
    llm.close()
    return {"seconds": seconds, "token": int(token), "restored": result.restored, "evaluated": evaluated}


def record_tokens(llm: Any, sink: list[int]) -> None:
    """Append every token `llm.generate` yields (what `create_completion` samples) to `sink`."""
    original = llm.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        inner = original(*args, **kwargs)
        try:
            sent = None
            while True:
                try:
                    token = inner.send(sent)
                except StopIteration:
                    return
                sink.append(int(token))
                sent = yield token
        finally:
            inner.close()

    llm.generate = generate


def timed_completion(llm: Any, tokens: list[int], max_tokens: int) -> Result:
    """`create_completion` of `tokens`, greedy: seconds to the first token sampled, the prompt
    tokens llama.cpp evaluated for it (all it evaluated but the answer's tokens the context
    holds), and the answer's tokens (an end-of-generation token left out). The answer may be
    longer than `max_tokens`: llama-cpp-python samples on while the text ends inside a UTF-8
    character (which the tiny models' byte tokens often do)."""
    import llama_cpp

    from harness.llama_tools import start_counting, tokens_evaluated

    first: list[float] = []
    sampled: list[int] = []

    def note_first_token(_ids: Any, _logits: Any) -> bool:
        if not first:
            first.append(time.perf_counter())
        return False

    record_tokens(llm, sampled)
    start_counting(llm.ctx)
    started = time.perf_counter()
    llm.create_completion(
        tokens,
        max_tokens=max_tokens,
        temperature=0.0,
        stopping_criteria=llama_cpp.StoppingCriteriaList([note_first_token]),
    )
    answer_evaluated = llm.n_tokens - len(tokens)
    vocab = llm._model.vocab
    return {
        "seconds": first[0] - started,
        "prompt_evaluated": tokens_evaluated(llm.ctx) - answer_evaluated,
        "answer": [t for t in sampled if not llama_cpp.llama_vocab_is_eog(vocab, t)],
    }


def child_ram_ttft(model: str, n: int) -> Result:
    """`LlamaRAMCache` in one process: a fresh `Llama` cold, then another fresh `Llama` with
    the same cache object."""
    from llama_cpp.llama_cache import LlamaRAMCache

    cache = LlamaRAMCache(capacity_bytes=8 << 30)
    runs = []
    for _ in range(2):
        llm = load(model)
        tokens = document(llm, n - len(question(llm, 0))) + question(llm, 0)
        llm.set_cache(cache)
        runs.append(timed_completion(llm, tokens, 1))
        llm.set_cache(None)
        llm.close()
    return {"cold": runs[0], "warm": runs[1]}


def child_conversation(model: str, url: str, n: int) -> Result:
    """Three turns, each on a fresh `Llama`, each turn's prompt the previous prompt, the
    answer the model gave to it and a new question: with no cache, with sippcache's
    `LlamaCache` (LMDB) and with one `LlamaRAMCache` object."""
    import llama_cpp
    from llama_cpp.llama_cache import LlamaRAMCache

    from sippcache.llama import Llama, LlamaCache

    def conversation(cls: Any, make_cache: Any) -> Result:
        prompts: list[list[int]] = []
        answers: list[list[int]] = []
        evaluated: list[int] = []
        for k in range(3):
            llm = load(model, cls)
            if k == 0:
                prompt = document(llm, n - len(question(llm, 0))) + question(llm, 0)
            else:
                prompt = prompts[-1] + answers[-1] + question(llm, k)
            cache = make_cache()
            if cache is not None:
                llm.set_cache(cache)
            done = timed_completion(llm, prompt, ANSWER_TOKENS)
            prompts.append(prompt)
            answers.append(done["answer"])
            evaluated.append(done["prompt_evaluated"])
            llm.set_cache(None)
            if isinstance(cache, LlamaCache):
                cache.close()  # writes what is pending: the next turn's fresh Llama finds it
            llm.close()
        return {
            "prompt_tokens": [len(p) for p in prompts],
            "evaluated": evaluated,
            "reused": [len(p) - e for p, e in zip(prompts, evaluated, strict=True)],
            "answers": answers,
        }

    ram = LlamaRAMCache(capacity_bytes=8 << 30)
    result = {
        "no cache": conversation(llama_cpp.Llama, lambda: None),
        "sippcache": conversation(Llama, lambda: LlamaCache(url)),
        "LlamaRAMCache": conversation(llama_cpp.Llama, lambda: ram),
    }
    for name in ("sippcache", "LlamaRAMCache"):
        result[name]["same_answers"] = result[name]["answers"] == result["no cache"]["answers"]
    for turns in result.values():
        turns["answer_tokens"] = [len(a) for a in turns.pop("answers")]
    return result


def run_child(*args: str) -> Result:
    out = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--child", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{out.stderr[-3000:]}")
    result: Result = json.loads(out.stdout.strip().splitlines()[-1])
    return result


CHILDREN = {
    "sippcache-ttft": lambda model, url, n: child_sippcache_ttft(model, url, int(n)),
    "ram-ttft": lambda model, url, n: child_ram_ttft(model, int(n)),
    "conversation": lambda model, url, n: child_conversation(model, url, int(n)),
}


# -- the parent ----------------------------------------------------------------------


def measure(kind: str, model: str, n: int, runs: int) -> Result:
    """Every measurement of one kind's model."""
    cold, warm, ram = [], [], []
    for _ in range(runs):  # interleaved, so machine noise hits each way alike
        with tempfile.TemporaryDirectory() as tmp:
            url = f"lmdb://{tmp}/cache"
            cold.append(run_child("sippcache-ttft", model, url, str(n)))
            warm.append(run_child("sippcache-ttft", model, url, str(n)))
        ram.append(run_child("ram-ttft", model, "", str(n)))
    with tempfile.TemporaryDirectory() as tmp:
        talk = run_child("conversation", model, f"lmdb://{tmp}/cache", str(n))
    return {
        "kind": kind,
        "prompt_tokens": n,
        "sippcache": {
            "cold_s": statistics.median(r["seconds"] for r in cold),
            "warm_s": statistics.median(r["seconds"] for r in warm),
            "cold_evaluated": max(r["evaluated"] for r in cold),
            "warm_evaluated": max(r["evaluated"] for r in warm),
            "warm_restored": min(r["restored"] for r in warm),
            "same_first_token": all(c["token"] == w["token"] for c, w in zip(cold, warm, strict=True)),
        },
        "LlamaRAMCache": {
            "cold_s": statistics.median(r["cold"]["seconds"] for r in ram),
            "warm_s": statistics.median(r["warm"]["seconds"] for r in ram),
            "cold_evaluated": max(r["cold"]["prompt_evaluated"] for r in ram),
            "warm_evaluated": max(r["warm"]["prompt_evaluated"] for r in ram),
        },
        "conversation": talk,
    }


def goals_of(row: Result) -> dict[str, bool]:
    kind, sipp, talk = row["kind"], row["sippcache"], row["conversation"]
    ours, ram = talk["sippcache"], talk["LlamaRAMCache"]
    prompts = ours["prompt_tokens"]

    def share(turns: Result, k: int) -> float:
        return float(turns["reused"][k] / turns["prompt_tokens"][k])

    return {
        f"{kind}: sippcache's warm new-process TTFT >= {MIN_SPEEDUP:g}x faster than cold": (
            sipp["cold_s"] >= MIN_SPEEDUP * sipp["warm_s"]
        ),
        f"{kind}: warm new process evaluates at most 1 prompt token, same first token as cold": (
            sipp["warm_evaluated"] <= 1 and sipp["same_first_token"]
        ),
        f"{kind}: turns 2 and 3 reuse at least the previous turn's prompt (-{MARGIN})": all(
            ours["reused"][k] >= prompts[k - 1] - MARGIN for k in (1, 2)
        ),
        f"{kind}: sippcache reuses no smaller share of each prompt than LlamaRAMCache": all(
            share(ours, k) >= share(ram, k) for k in range(3)
        ),
    }


def model_paths(kinds: list[str], folder: Path) -> dict[str, str]:
    from harness.tinymodel import write_tiny_model

    paths = {}
    for kind in kinds:
        if kind == "gemma":
            from sippcache.demo.model import gemma_model_path
            from sippcache.errors import MissingDependency

            try:
                paths[kind] = str(gemma_model_path())
            except MissingDependency as exc:
                print(f"gemma-3-270m left out: {exc}", file=sys.stderr)
        else:
            paths[kind] = str(write_tiny_model(folder / f"{kind}.gguf", kind=kind))
    return paths


def print_tables(rows: list[Result], goals: dict[str, bool]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(
        title="time to first token, medians (model loading not timed)",
        caption="sippcache: the demo's path, cold and warm each in a new process on one LMDB store. "
        "LlamaRAMCache lives in one process's memory, so a new process finds nothing: its warm is a "
        "fresh Llama in the same process. (n): prompt tokens llama.cpp evaluated.",
    )
    for column in ("kind", "prompt", "sippcache cold", "warm, new process", "speedup",
                   "LlamaRAMCache cold", "warm, same process", "speedup"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        sipp, ram = r["sippcache"], r["LlamaRAMCache"]
        table.add_row(
            r["kind"],
            f"{r['prompt_tokens']:,}",
            f"{sipp['cold_s'] * 1000:.1f} ms",
            f"{sipp['warm_s'] * 1000:.1f} ms ({sipp['warm_evaluated']:,})",
            f"{sipp['cold_s'] / sipp['warm_s']:.1f}x",
            f"{ram['cold_s'] * 1000:.1f} ms",
            f"{ram['warm_s'] * 1000:.1f} ms ({ram['warm_evaluated']:,})",
            f"{ram['cold_s'] / ram['warm_s']:.1f}x",
        )
    console.print(table)
    table = Table(
        title="3-turn conversation, each turn on a fresh Llama: prompt tokens reused on turns 1 / 2 / 3",
        caption="reused: prompt tokens llama.cpp did not evaluate. same answers: the greedy answers "
        "token for token as with no cache.",
    )
    for column in ("kind", "prompts", "sippcache reused", "LlamaRAMCache reused", "same answers (sipp / RAM)"):
        table.add_column(column, justify="right")
    for r in rows:
        talk = r["conversation"]
        ours, ram = talk["sippcache"], talk["LlamaRAMCache"]
        table.add_row(
            r["kind"],
            " / ".join(f"{x:,}" for x in ours["prompt_tokens"]),
            " / ".join(f"{x:,}" for x in ours["reused"]),
            " / ".join(f"{x:,}" for x in ram["reused"]),
            f"{'yes' if ours['same_answers'] else 'no'} / {'yes' if ram['same_answers'] else 'no'}",
        )
    console.print(table)
    for goal, ok in goals.items():
        console.print(f"{'PASS' if ok else 'FAIL'}  {goal}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length of turn 1 (default 2,000)")
    parser.add_argument("--runs", type=int, default=5, help="cold/warm process pairs per tiny model (default 5)")
    parser.add_argument("--gemma-runs", type=int, default=3, help="cold/warm process pairs on gemma (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", nargs=4, metavar=("WHAT", "MODEL", "URL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, model, url, n = args.child
        print(json.dumps(CHILDREN[what](model, url, n)))
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = model_paths(kinds, Path(tmp))
        rows = [
            measure(kind, path, args.tokens, args.gemma_runs if kind == "gemma" else args.runs)
            for kind, path in paths.items()
        ]
    goals = {goal: ok for row in rows for goal, ok in goals_of(row).items()}
    if args.json:
        print(json.dumps({"rows": rows, "goals": goals}))
    else:
        print_tables(rows, goals)
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

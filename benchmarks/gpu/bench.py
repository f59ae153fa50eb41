"""Restore a stored KV state vs recompute it, on llama-server, raw and through `sippcache proxy`.

Run by run.sh (which builds llama-server and sets the environment); every step is
bounded by $DEADLINE (epoch seconds) and skipped, with a note, when too little time is left.
Results go to $OUT/gpu.json after every step (a run cut short still leaves what it measured).

Phases, in order of priority:
  raw      plain llama-server: per N, cold prefill, slot save, erase, slot restore, prompt + 32
           tokens (the suffix), cold again (warm GPU), and the streamed end-to-end TTFT of the
           follow-up (prompt + 32) cold and after a restore;
  proxy    `python -m sippcache.proxy` managed, on an LMDB store on disk: request 1 (N tokens, a new
           conversation: stored at once; run with --keep-ready, so its slot files outlive it), then,
           per mode (PROXY_MODES: auto, warm, ready, always), a copy of that store behind a restarted
           proxy is asked request 2 (N + 32 tokens), streamed: TTFT, llama-server's timings and the
           proxy's /metrics (restores done and skipped, restore and save seconds, bytes). Modes
           auto and always are --restore's, from the store alone (--no-warm-ready); warm is auto
           as users run it (--warm-ready, the default: the store's states made ready files after
           the start, waited for before the requests); ready is auto with --keep-ready, which
           restores run 1's slot files as llama-server saved them (nothing copied). The
           proxy keeps its measured rates in a --rates-dir of its own, as a user's proxy keeps
           them across restarts;
  micro    sippcache's own part of a save and a restore on this host's CPU, stage by stage, as
           ratios to a memory copy: benchmarks/state_path.py (STATE_PATH_SIZES, RAM and LMDB), on
           /dev/shm and, with STAGING_DIR, there too.

STAGING_DIR (run.sh sets it with HUGE_TMPFS=1: a tmpfs mounted with huge=within_size) is where
the managed proxy's slot files go (`--staging-dir`) and, with SLOT_DIR in it, the raw server's.

A shape may name a KV cache type after a colon (SHAPES=8b-slice,8b-slice:q8_0: -ctk/-ctv q8_0).

Goals (the summary's PASS/MISS lines): the proxy's follow-up with `--restore auto` (modes auto, warm
and ready) at least as fast as the same follow-up cold, and within 15% of llama-server's own restore +
the follow-up wherever that restore beats cold. Exit status 1 if a goal is missed (unless NO_GOALS=1) or a step
failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu-out")
DEADLINE = float(os.environ.get("DEADLINE") or time.time() + 540)
T0 = float(os.environ.get("T0") or time.time())
LS = os.environ.get("LLAMA_SERVER", "")
GPU = os.environ.get("GPU", "1") == "1"
SHAPES = [s for s in os.environ.get("SHAPES", "8b-slice,1b").split(",") if s]
NS = [int(n) for n in os.environ.get("NS", "2048,8192,32768").split(",") if n]
PROXY_NS = [int(n) for n in os.environ.get("PROXY_NS", "8192,32768").split(",") if n]
PROXY_SHAPES = [s for s in os.environ.get("PROXY_SHAPES", SHAPES[0] if SHAPES else "").split(",") if s]
# a shape may name a KV cache type after a colon ("8b-slice:q8_0": -ctk q8_0 -ctv q8_0)
# --restore of each run 2 (its store path: --no-warm-ready); "warm": auto with --warm-ready (the states made
# ready files after the start); "ready": auto with --keep-ready (run 1's ready slot files restored as they are)
PROXY_MODES = [m for m in os.environ.get("PROXY_MODES", "auto,warm,ready,always").split(",") if m]
STATE_PATH_SIZES = os.environ.get("STATE_PATH_SIZES", "256M,1G")  # benchmarks/state_path.py on this host
CTX = int(os.environ.get("CTX", "65536"))
SERVER_ARGS = os.environ.get("SERVER_ARGS", "-ngl 99 -fa on" if GPU else "-fa on").split()
WORK = os.environ.get("WORK", "/tmp/gpubench")
# the managed proxy's --staging-dir (run.sh's HUGE_TMPFS=1 mounts a tmpfs with huge pages and sets it)
STAGING_DIR = os.environ.get("STAGING_DIR", "")
SUFFIX = 32  # tokens the follow-up adds
WARMUP = int(os.environ.get("WARMUP", "512"))  # tokens of the first request to a new server (not measured)
PIDFILE = os.path.join(WORK, "pids")

RESULTS: dict = {
    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0)),
    "gpu": GPU,
    "llama_server": LS,
    "ctx": CTX,
    "server_args": SERVER_ARGS,
    "ns": NS,
    "proxy_ns": PROXY_NS,
    "suffix_tokens": SUFFIX,
    "build": {},
    "env": {},
    "shapes": {},
    "proxy": {},
    "micro": {},
    "skipped": [],
    "errors": [],
    "goals": [],
}
LIVE: list[subprocess.Popen] = []  # processes started here, stopped (by pid) at the end


# -- small things ------------------------------------------------------------------


def now() -> float:
    return time.time()


def left() -> float:
    return DEADLINE - now()


def say(msg: str) -> None:
    print(f"[+{now() - T0:6.1f}s {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_results() -> None:
    RESULTS["elapsed_s"] = round(now() - T0, 1)
    tmp = os.path.join(OUT, "gpu.json.part")
    with open(tmp, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    os.replace(tmp, os.path.join(OUT, "gpu.json"))


def skip(what: str, need: float) -> bool:
    """True (and noted) when fewer than `need` seconds are left before the deadline."""
    if left() >= need:
        return False
    note = f"{what}: skipped, {left():.0f} s left (needs ~{need:.0f} s)"
    RESULTS["skipped"].append(note)
    say(note)
    save_results()
    return True


def error(what: str, exc: BaseException) -> None:
    note = f"{what}: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    RESULTS["errors"].append(note)
    say("ERROR " + note)
    save_results()


def tmo(cap: float = 300.0) -> float:
    """A request timeout: at most `cap`, never past the deadline."""
    return max(1.0, min(cap, left() - 3))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gbps(nbytes: float, ms: float | None) -> float | None:
    return round(nbytes / (ms / 1000) / 1e9, 2) if ms else None


def r1(x: float | None) -> float | None:
    return None if x is None else round(float(x), 1)


def note_pid(pid: int) -> None:
    with open(PIDFILE, "a") as f:
        f.write(f"{pid}\n")


def children(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return kids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(proc: subprocess.Popen, grace: float = 30.0, name: str = "process") -> float:
    """SIGTERM, wait up to `grace` s, then SIGKILL (its children found first, killed by pid too).
    Returns the seconds it took to exit."""
    started = now()
    kids = children(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=max(1.0, min(grace, left() + 10)))
        except subprocess.TimeoutExpired:
            say(f"{name} (pid {proc.pid}) did not exit in {grace:.0f} s of SIGTERM: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=30)
    took = now() - started
    for kid in kids:  # the proxy's llama-server: it stops it itself; if not, by pid
        for _ in range(100):
            if not alive(kid):
                break
            time.sleep(0.1)
        if alive(kid):
            say(f"{name}: child {kid} still alive: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)
    if proc in LIVE:
        LIVE.remove(proc)
    return took


def gpu_mem() -> str | None:
    """nvidia-smi's memory.used / total (a check that the model and KV cache are on the GPU)."""
    if not GPU:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total,utilization.gpu", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        return out.stdout.strip() or out.stderr.strip()[:200]
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: {exc}"


def tail(path: str, n: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def grep(path: str, pattern: str, n: int = 30) -> str:
    rx = re.compile(pattern)
    try:
        with open(path, errors="replace") as f:
            return "".join([line for line in f if rx.search(line)][:n])
    except OSError:
        return "(no log)"


# -- llama-server over HTTP ------------------------------------------------------------


class Server:
    """A llama-server (or the proxy) at `url`."""

    def __init__(self, url: str) -> None:
        self.url = url
        # no kept-alive connections: llama-server may close one after a streamed answer, and the next
        # request sent on it would fail (a loopback connect costs a fraction of a ms)
        limits = httpx.Limits(max_keepalive_connections=0)
        self.client = httpx.Client(timeout=httpx.Timeout(60.0), trust_env=False, limits=limits)

    def post(self, path: str, body: dict, cap: float = 300.0) -> tuple[dict, float]:
        """(JSON answer, wall ms)."""
        started = time.perf_counter()
        r = self.client.post(self.url + path, json=body, timeout=tmo(cap))
        ms = (time.perf_counter() - started) * 1000
        if r.status_code >= 400:
            raise RuntimeError(f"POST {path}: {r.status_code} {r.text[:300]}")
        return r.json(), ms

    def get(self, path: str, cap: float = 30.0) -> httpx.Response:
        return self.client.get(self.url + path, timeout=tmo(cap))

    def tokenize(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": True})[0]["tokens"]

    def tokenize_ms(self, text: str) -> float | None:
        """Wall ms of one /tokenize of `text` as the proxy asks it (the token call a text prompt costs
        it before llama-server tokenizes the text again)."""
        return r1(self.post("/tokenize", {"content": text, "add_special": True, "parse_special": True})[1])

    def complete(self, prompt: str, cap: float = 300.0) -> dict:
        """/completion, one token, greedy, cache_prompt on: llama-server's timings + wall ms."""
        body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True, "id_slot": 0}
        answer, ms = self.post("/completion", body, cap)
        t = answer.get("timings") or {}
        return {
            "prompt_n": t.get("prompt_n"),
            "cache_n": t.get("cache_n"),
            "prompt_ms": r1(t.get("prompt_ms")),
            "wall_ms": r1(ms),
            "tokens_evaluated": answer.get("tokens_evaluated"),
        }

    def slot(self, action: str, filename: str | None = None, cap: float = 300.0) -> tuple[dict, float]:
        body = {"filename": filename} if filename else {}
        return self.post(f"/slots/0?action={action}", body, cap)

    def stream(self, prompt: str, cap: float = 300.0) -> dict:
        """/v1/completions streamed, max_tokens 1: client-side time to the first event and to the end,
        the X-Sippcache-Prompt-Reused header (proxy), and the last timings seen."""
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
        started = time.perf_counter()
        first = None
        timings: dict = {}
        text = ""
        with self.client.stream("POST", self.url + "/v1/completions", json=body, timeout=tmo(cap)) as r:
            if r.status_code >= 400:
                r.read()
                raise RuntimeError(f"stream: {r.status_code} {r.text[:300]}")
            reused = r.headers.get("x-sippcache-prompt-reused")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if first is None:
                    first = time.perf_counter()
                if line.startswith("data: [DONE]"):
                    continue
                with contextlib.suppress(ValueError):
                    data = json.loads(line[6:])
                    if isinstance(data.get("timings"), dict):
                        timings = data["timings"]
                    for c in data.get("choices") or []:
                        text += c.get("text") or ""
        end = time.perf_counter()
        return {
            "ttft_ms": r1(((first or end) - started) * 1000),
            "total_ms": r1((end - started) * 1000),
            "reused_header": None if reused is None else int(reused or 0),
            "prompt_n": timings.get("prompt_n"),
            "cache_n": timings.get("cache_n"),
            "prompt_ms": r1(timings.get("prompt_ms")),
            "text": text[:20],
        }

    def wait_ready(self, proc: subprocess.Popen, seconds: float, log: str) -> float:
        started = now()
        deadline = min(now() + seconds, DEADLINE - 5)
        while now() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited ({proc.returncode}) while starting: {tail(log, 6)}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return now() - started
            time.sleep(0.2)
        raise RuntimeError(f"not ready in {seconds:.0f} s: {tail(log, 6)}")


def metrics(server: Server) -> dict[str, float]:
    """The proxy's /metrics, each series summed over its labels; restores and prompt tokens by label."""
    out: dict[str, float] = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if not name.startswith("sippcache_proxy_"):
            continue
        short = name[len("sippcache_proxy_") :]
        if short.endswith(("_bucket", "_created")):
            continue
        for key in ("outcome", "how", "reason", "part"):
            lm = re.search(key + r'="([^"]*)"', labels)
            if lm:
                short += "." + lm.group(1)
        out[short] = out.get(short, 0.0) + value
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 4) for k, v in after.items() if v - before.get(k, 0.0)}


# -- prompts --------------------------------------------------------------------------

ALPHABET = string.ascii_letters + string.digits + ".,;:!?-"  # no spaces: one byte, one token


class Prompts:
    """Texts of exactly N tokens (BOS included), and the same text + SUFFIX tokens."""

    def __init__(self, server: Server) -> None:
        probe = "abcdefgh"
        self.offset = len(server.tokenize(probe)) - len(probe)  # BOS (and a leading "▁" if any)
        self.server = server

    def make(self, n: int, seed: int) -> tuple[str, str]:
        rng = random.Random(seed)
        body = "".join(rng.choice(ALPHABET) for _ in range(n - self.offset + SUFFIX))
        text, text2 = body[: n - self.offset], body
        got = len(self.server.tokenize(text))
        if got != n:
            raise RuntimeError(f"a prompt meant to be {n} tokens is {got}")
        return text, text2


# -- processes --------------------------------------------------------------------------


def launch(argv: list[str], port: int, log: str) -> tuple[subprocess.Popen, Server, float]:
    """Start `argv` (logging to `log`, its pid noted for the cleanup) and wait until it answers on `port`."""
    say("start: " + " ".join(argv))
    with open(log, "ab") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    LIVE.append(proc)
    note_pid(proc.pid)
    server = Server(f"http://127.0.0.1:{port}")
    return proc, server, server.wait_ready(proc, 300, log)


def base_shape(shape: str) -> str:
    return shape.split(":")[0]


def server_args(shape: str) -> list[str]:
    """SERVER_ARGS, plus the KV cache type a shape names after a colon."""
    kv = shape.split(":")[1] if ":" in shape else ""
    return SERVER_ARGS + (["-ctk", kv, "-ctv", kv] if kv else [])


def start_llama_server(model: str, slot_dir: str, log: str, args: list[str]) -> tuple[subprocess.Popen, Server]:
    port = free_port()
    argv = [LS, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(CTX), "-np", "1"]
    # the flags the proxy gives its own llama-server (docs/proxy.md: --no-cache-idle-slots, --swa-full, the
    # latter ignored for llama, and --cache-ram 0: a prompt after an erase is computed cold, not served from
    # llama-server's RAM cache, and no displaced state is copied there on a request's path)
    argv += ["--slot-save-path", slot_dir + os.sep, "--no-cache-idle-slots", "--swa-full", "--cache-ram", "0"]
    proc, server, took = launch([*argv, *args], port, log)
    say(f"llama-server ready in {took:.1f} s (pid {proc.pid})")
    return proc, server


def start_proxy(
    model: str, store_url: str, log: str, args: list[str], rates_dir: str, mode: str = "auto"
) -> tuple[subprocess.Popen, Server, float]:
    port = free_port()
    # --save-idle 1: a follow-up's slot is saved a second after its answer, so the next request finds its
    # slot saved (-np 1) and no save of the last conversation lands on its path
    argv = [sys.executable, "-m", "sippcache.proxy", "--llama-server", LS, "--model", model]
    argv += ["--restore", "auto" if mode in ("warm", "ready", "run1") else mode]
    argv += ["--save-idle", "1", "--rates-dir", rates_dir]
    if mode in ("ready", "run1"):  # run 1 keeps its slot files for run 2's ready mode
        argv += ["--keep-ready"]
    if mode != "warm":  # the others measure the store path, or the files kept
        argv += ["--no-warm-ready"]
    if STAGING_DIR:  # run.sh's HUGE_TMPFS=1: a tmpfs with huge pages
        argv += ["--staging-dir", STAGING_DIR]
    argv += ["--cache", store_url, "--port", str(port), "--", *args, "-c", str(CTX)]
    proc, server, took = launch(argv, port, log)  # /health is llama-server's, passed through once the proxy serves
    for kid in children(proc.pid):
        note_pid(kid)
    say(f"proxy ready in {took:.1f} s (pid {proc.pid}, llama-server {children(proc.pid)})")
    return proc, server, took


# -- phases ----------------------------------------------------------------------------


def make_model(shape: str) -> dict | None:
    import mkmodel  # beside this script, which Python puts first on sys.path

    need = 15 + mkmodel.describe(shape)["params"] * 2 / 0.5e9  # generous: 0.5 GB/s
    if skip(f"{shape}: model", need):
        return None
    d = mkmodel.ensure(shape, os.environ.get("MODEL_DIR", "/dev/shm"))
    say(f"{shape}: model {d['file_bytes'] / 1e9:.2f} GB written in {d['write_s']} s -> {d['path']}")
    return d


def raw_phase(shape: str, model: dict) -> None:
    res = RESULTS["shapes"].setdefault(shape, {})
    res["model"] = model
    slot_dir = os.path.join(os.environ.get("SLOT_DIR", "/dev/shm/gpubench-slots"), shape)
    shutil.rmtree(slot_dir, ignore_errors=True)
    os.makedirs(slot_dir)
    log = os.path.join(WORK, f"llama-server-{shape}.log")
    proc, server = start_llama_server(model["path"], slot_dir, log, server_args(shape))
    try:
        props = server.get("/props").json()
        res["build_info"] = props.get("build_info")
        res["n_ctx"] = (props.get("default_generation_settings") or {}).get("n_ctx")
        res["load_lines"] = grep(
            log, r"offloaded|CUDA0|KV buffer|kv_unified|flash_attn|n_ctx_seq|using device|compute buffer"
        )
        res["gpu_mem_after_load"] = gpu_mem()
        say(f"{shape}: GPU memory after load: {res['gpu_mem_after_load']}")
        prompts = Prompts(server)
        warm = server.complete(prompts.make(WARMUP, 7)[0])  # cuBLAS handles, first kernels
        server.slot("erase")
        res["warmup"] = warm
        say(f"{shape}: warm-up {WARMUP} tokens: {warm}")
        res["raw"] = {}
        kv = model["kv_bytes_per_token"]
        for n in NS:
            if n + SUFFIX + 8 > CTX:
                RESULTS["skipped"].append(f"{shape} N={n}: longer than -c {CTX}")
                continue
            # a generous bound: 3 prefills at ~1,000 tokens/s on the slowest shape, 8 slot moves at 1 GB/s
            if skip(f"{shape} raw N={n}", 10 + (0 if GPU else 3 * n / 1000) + 8 * n * kv / 1e9):
                break
            try:
                res["raw"][str(n)] = raw_one(server, prompts, n, slot_dir, shape)
            except Exception as exc:
                error(f"{shape} raw N={n}", exc)
            save_results()
    finally:
        with contextlib.suppress(Exception):
            res["server_log_tail"] = tail(log, 12)
        stop(proc, 30, "llama-server")


def slot_timed(server: Server, action: str, path: str) -> dict:
    """llama-server's own slot `action` (save or restore) of the file at `path`: its timing, the
    wall time, its counts (n_saved and n_written, or n_restored and n_read), the file's bytes and
    the GB/s llama-server's timing gives them."""
    ans, ms = server.slot(action, os.path.basename(path))
    took = (ans.get("timings") or {}).get(f"{action}_ms")
    nbytes = os.path.getsize(path)
    counts = {k: v for k, v in ans.items() if k.startswith("n_")}
    return {f"{action}_ms": r1(took), "wall_ms": r1(ms), **counts, "file_bytes": nbytes, "gbps": gbps(nbytes, took)}


def raw_one(server: Server, prompts: Prompts, n: int, slot_dir: str, shape: str) -> dict:
    text, text2 = prompts.make(n, 1000 + n)
    fname = f"raw-{n}.bin"
    path = os.path.join(slot_dir, fname)
    r: dict = {"n": n}
    server.slot("erase")
    r["cold1"] = server.complete(text)
    r["save"] = slot_timed(server, "save", path)
    server.slot("erase")
    r["restore"] = slot_timed(server, "restore", path)
    r["suffix"] = server.complete(text2)  # prompt + 32 tokens on the restored state
    r["gpu_mem"] = gpu_mem()
    server.slot("erase")
    r["cold2"] = server.complete(text)  # the same prefill again, GPU warm
    server.slot("erase")
    r["cold_req2_stream"] = server.stream(text2)  # the follow-up, cold, end to end
    server.slot("erase")
    started = time.perf_counter()
    server.slot("restore", fname)
    restored_ms = (time.perf_counter() - started) * 1000
    s = server.stream(text2)
    s["restore_wall_ms"] = r1(restored_ms)
    s["restore_plus_ttft_ms"] = r1(restored_ms + s["ttft_ms"])
    r["restore_req2_stream"] = s  # the floor for a cache in front of llama-server
    server.slot("erase")
    cold = r["cold2"]["prompt_ms"] or r["cold1"]["prompt_ms"]
    warm = (r["restore"]["restore_ms"] or 0) + (r["suffix"]["prompt_ms"] or 0)
    r["cold_over_restore_plus_suffix"] = round(cold / warm, 2) if cold and warm else None
    r["cold_ms_per_token"] = round(cold / n, 4) if cold else None
    os.unlink(path)
    say(
        f"{shape} N={n}: cold {cold} ms (first {r['cold1']['prompt_ms']}), save {r['save']['save_ms']} ms, "
        f"restore {r['restore']['restore_ms']} ms, suffix {r['suffix']['prompt_ms']} ms "
        f"(prompt_n {r['suffix']['prompt_n']}, cache_n {r['suffix']['cache_n']}), "
        f"{r['save']['file_bytes'] / 1e6:.1f} MB, "
        f"x{r['cold_over_restore_plus_suffix']}; TTFT req2 cold {r['cold_req2_stream']['ttft_ms']} ms, "
        f"restore+req2 {s['restore_plus_ttft_ms']} ms"
    )
    for k in ("cold1", "cold2"):
        if r[k]["cache_n"]:
            RESULTS["errors"].append(f"{shape} N={n} {k}: cache_n {r[k]['cache_n']}, not cold")
    return r


def proxy_phase(shape: str, model: dict) -> None:
    """Run 1 stores each prompt (a new conversation is stored at once); then, per --restore mode, a copy of
    that store behind a restarted proxy is asked each prompt + SUFFIX tokens (run 2)."""
    res = RESULTS["proxy"].setdefault(shape, {"runs": {}})
    store_dir = os.environ.get("STORE_DIR", "/tmp/sippstore") + "-" + shape.replace(":", "-")
    shutil.rmtree(store_dir, ignore_errors=True)
    url = f"lmdb://{store_dir}?max_bytes=24GiB"
    res["store"] = url
    log = os.path.join(WORK, f"proxy-{shape.replace(':', '-')}.log")
    kv = model["kv_bytes_per_token"]
    args = server_args(shape)
    ns = [n for n in PROXY_NS if n + SUFFIX + 8 <= CTX]
    # a raw server for the prompts' texts is not running: the proxy's /tokenize (passed through) makes them
    rates_dir = os.path.join(WORK, "rates-" + shape.replace(":", "-"))  # this run's own, kept across its restarts
    shutil.rmtree(rates_dir, ignore_errors=True)
    clear_kept()
    proc, server, took = start_proxy(model["path"], url, log, args, rates_dir, "run1")
    res["start1_s"] = round(took, 1)
    texts: dict[int, tuple[str, str]] = {}
    try:
        prompts = Prompts(server)
        res["warmup1"] = proxy_warmup(server, prompts, 7)
        for n in ns:
            if skip(f"{shape} proxy request 1 N={n}", 20 + 4 * n * kv / 1e9 + (0 if GPU else 3 * n / 1000)):
                break
            texts[n] = prompts.make(n, 1000 + n)  # the raw phase's texts
            tokenize_ms = server.tokenize_ms(texts[n][0])  # passed through the proxy to its llama-server
            before = metrics(server)
            r1_ = server.stream(texts[n][0])
            stored = wait_saved(server, before, 120)
            run = res["runs"].setdefault(str(n), {})
            run["request1"] = {**r1_, "metrics": diff(metrics(server), before), **stored, "tokenize_ms": tokenize_ms}
            raw = RESULTS["shapes"].get(shape, {}).get("raw", {}).get(str(n))
            ss = run["request1"]["metrics"].get("save_seconds_sum")
            if raw and ss is not None and raw["save"]["save_ms"] is not None:
                run["raw_save_ms"] = raw["save"]["save_ms"]
                run["sippcache_save_overhead_ms"] = r1(ss * 1000 - raw["save"]["save_ms"])
            say(f"{shape} proxy N={n} request 1 (cold): {r1_} stored: {stored}; metrics {run['request1']['metrics']}")
            save_results()
    except Exception as exc:
        error(f"{shape} proxy run 1", exc)
    finally:
        keep_proxy_logs(log)
        res["stop1_s"] = round(stop(proc, 120, "proxy"), 1)
        say(f"{shape} proxy stopped in {res['stop1_s']} s")
    with contextlib.suppress(OSError):
        res["store_bytes_after_run1"] = sum(os.path.getsize(os.path.join(store_dir, f)) for f in os.listdir(store_dir))
    try:
        for mode in PROXY_MODES:
            if not texts or skip(f"{shape} proxy run 2 ({mode})", 30 + 3 * max(texts) * kv / 1e9):
                return
            mode_dir = f"{store_dir}-{mode}"  # each mode starts from the same store: run 1's
            shutil.rmtree(mode_dir, ignore_errors=True)
            shutil.copytree(store_dir, mode_dir)
            proxy_run2(shape, model, mode, f"lmdb://{mode_dir}?max_bytes=24GiB", log, args, rates_dir, texts)
            shutil.rmtree(mode_dir, ignore_errors=True)
            save_results()
    finally:
        clear_kept()  # not left in RAM after the run


def clear_kept() -> None:
    """Remove the ready slot files earlier proxies kept (--keep-ready) wherever a managed proxy keeps
    them: a proxy of an earlier run, asked the same texts, left states this run must not find (a
    second CPU run's "ready" follow-ups reused all of their prompts that way)."""
    for base in {STAGING_DIR, "/dev/shm", tempfile.gettempdir()} - {""}:
        shutil.rmtree(os.path.join(base, f"sippcache-kept-{os.getuid()}"), ignore_errors=True)


def proxy_run2(
    shape: str,
    model: dict,
    mode: str,
    url: str,
    log: str,
    args: list[str],
    rates_dir: str,
    texts: dict[int, tuple[str, str]],
) -> None:
    res = RESULTS["proxy"][shape]
    kv = model["kv_bytes_per_token"]
    proc, server, took = start_proxy(model["path"], url, log, args, rates_dir, mode)
    res[f"start2_{mode}_s"] = round(took, 1)
    try:
        if mode == "warm":  # the requests come once the stored states are ready files, as a later user's would
            res["warmed"] = wait_warmed(server, 60 + 4 * max(texts) * kv / 1e9)
            say(f"{shape} proxy (warm): {res['warmed']}")
        # the new process's first request pays one-time costs (CUDA modules loaded on first use, buffers):
        # measured here, apart, so that request 2 compares with the raw phase's warm server
        res[f"warmup2_{mode}"] = proxy_warmup(server, Prompts(server), 8)  # another text: computed, not restored
        for n, (_, text2) in texts.items():
            if skip(
                f"{shape} proxy request 2 ({mode}) N={n}", 10 + 4 * n * kv / 1e9 + (0 if GPU else 3 * SUFFIX / 1000)
            ):
                break
            before = metrics(server)
            r2 = server.stream(text2)
            # its slot saved (--save-idle 1) before the next request, so that no save lands on that one's path
            stored = wait_saved(server, before, 30)
            run = res["runs"].setdefault(str(n), {})
            key = f"request2_{mode}"
            run[key] = {**r2, "metrics": diff(metrics(server), before), **stored}
            raw = RESULTS["shapes"].get(shape, {}).get("raw", {}).get(str(n))
            if raw:
                run["raw_cold_req2_ttft_ms"] = raw["cold_req2_stream"]["ttft_ms"]
                run["raw_restore_plus_req2_ttft_ms"] = raw["restore_req2_stream"]["restore_plus_ttft_ms"]
                run["raw_restore_ms"] = raw["restore"]["restore_ms"]
                run[f"speedup_vs_raw_cold_{mode}"] = (
                    round(run["raw_cold_req2_ttft_ms"] / r2["ttft_ms"], 2) if r2["ttft_ms"] else None
                )
                rs = run[key]["metrics"].get("restore_seconds_sum")
                if rs is not None and raw["restore"]["restore_ms"] is not None:
                    run[f"sippcache_restore_overhead_ms_{mode}"] = r1(rs * 1000 - raw["restore"]["restore_ms"])
                run[f"proxy_over_raw_floor_ms_{mode}"] = r1(r2["ttft_ms"] - run["raw_restore_plus_req2_ttft_ms"])
                # Beside llama-server's own compute of the 32 new tokens (timings.prompt_ms), which
                # varies from one request to the next by more than a restore costs on a CPU: the rest
                # of the time to first token (the restore, the proxy's steps), each way.
                raw_req2 = raw["restore_req2_stream"]
                if raw_req2.get("prompt_ms") is not None and r2.get("prompt_ms") is not None:
                    run["raw_beside_compute_ms"] = r1(
                        raw_req2["restore_wall_ms"] + raw_req2["ttft_ms"] - raw_req2["prompt_ms"]
                    )
                    run[f"beside_compute_ms_{mode}"] = r1(r2["ttft_ms"] - r2["prompt_ms"])
            say(f"{shape} proxy ({mode}) N={n} request 2 (after restart): {r2}; metrics {run[key]['metrics']}")
            save_results()
        res[f"metrics_end_{mode}"] = metrics(server)
    except Exception as exc:
        error(f"{shape} proxy run 2 ({mode})", exc)
    finally:
        keep_proxy_logs(log)
        res[f"stop2_{mode}_s"] = round(stop(proc, 120, "proxy"), 1)
        say(f"{shape} proxy ({mode}) stopped in {res[f'stop2_{mode}_s']} s")
        res["log_warnings"] = grep(log, r"WARNING|warning|Traceback|Error|error", 20)


def proxy_warmup(server: Server, prompts: Prompts, seed: int) -> dict:
    """A first request (WARMUP tokens, a text of its own) through a freshly started proxy, stored."""
    before = metrics(server)
    r = server.stream(prompts.make(WARMUP, seed)[0])
    r.update(wait_saved(server, before, 60))
    say(f"proxy warm-up, the new process's first request ({WARMUP} tokens): {r}")
    return r


def wait_saved(server: Server, before: dict[str, float], seconds: float) -> dict:
    """Poll /metrics until one more state is stored (saves_total grows), at most `seconds`."""
    started = now()
    deadline = min(now() + seconds, DEADLINE - 5)
    while now() < deadline:
        m = metrics(server)
        if m.get("saves_total", 0) > before.get("saves_total", 0):
            return {"stored_after_s": round(now() - started, 2)}
        if m.get("store_errors", 0) > before.get("store_errors", 0):
            return {"stored_after_s": None, "store_error": True}
        time.sleep(0.1)
    return {"stored_after_s": None, "store_timeout": True}


def wait_warmed(server: Server, seconds: float) -> dict:
    """Poll /metrics until the proxy has made its ready files after the start (--warm-ready): at
    least one made and none being made, at most `seconds`; the files, their bytes and the wait."""
    started = now()
    deadline = min(now() + seconds, DEADLINE - 5)
    while now() < deadline:
        m = metrics(server)
        if m.get("ready_warmed_total", 0) >= 1 and not m.get("ready_warming", 0):
            made = {"warmed": m["ready_warmed_total"], "ready_bytes": m.get("ready_bytes")}
            return {**made, "waited_s": round(now() - started, 2)}
        time.sleep(0.1)
    return {"warm_timeout": True, "waited_s": round(now() - started, 2)}


def huge_pages(folder: str) -> bool | str | None:
    """Whether files in `folder` get huge pages (`sippcache.engine.directory.huge_pages`); a failed
    import is said, not raised: the raw phase runs without sippcache."""
    try:
        from sippcache.engine.directory import huge_pages as told
    except Exception as exc:
        return repr(exc)
    return told(folder)


def keep_proxy_logs(log: str) -> None:
    """Copy the proxy's llama-server log out of its staging directory (removed when it stops)."""
    with contextlib.suppress(OSError):
        bases = ["/dev/shm", "/tmp", *([STAGING_DIR] if STAGING_DIR else [])]
        dirs = [os.path.join(b, d) for b in bases for d in os.listdir(b) if d.startswith("sippcache-proxy-")]
        for d in sorted(dirs, key=os.path.getmtime)[-1:]:
            src = os.path.join(d, "llama-server.log")
            if os.path.exists(src):
                with open(src, "rb") as f, open(log + ".llama-server", "ab") as g:
                    g.write(f.read())


def micro_phase(shape: str) -> None:
    """sippcache's own part of a save and a restore on this host, stage by stage, as ratios to a memory copy
    of the same bytes in the same run: benchmarks/state_path.py (RAM and LMDB stores, whole and in chunks)."""
    script = os.path.join(HERE, "state_path.py")  # .gpu/'s copy; in the repository: benchmarks/state_path.py
    if not os.path.exists(script):
        script = os.path.join(os.path.dirname(HERE), "state_path.py")
    sizes = STATE_PATH_SIZES
    need = 20 + 40 * sum(1 if s.upper().endswith("G") else 0.3 for s in sizes.split(","))
    if skip(f"{shape} state_path", need):
        return
    # /dev/shm, then (HUGE_TMPFS=1) the tmpfs with huge pages: the two side by side in one run
    for where in ["/dev/shm", *([STAGING_DIR] if STAGING_DIR else [])]:
        if where != "/dev/shm" and skip(f"{shape} state_path in {where}", need):
            return
        name = "" if where == "/dev/shm" else "-staging-dir"
        argv = [sys.executable, script, "--sizes", sizes, "--repeat", "3", "--backends", "ram,lmdb", "--no-goals"]
        argv += ["--dir", where, "--json", os.path.join(OUT, f"state_path{name}.json")]
        say("start: " + " ".join(argv))
        started = now()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=max(10.0, left() - 60))
            RESULTS["micro"][shape + name] = {
                "rc": done.returncode,
                "dir": where,
                "s": round(now() - started, 1),
                "stdout": done.stdout[-12000:],
                "stderr": done.stderr[-3000:],
            }
            print(done.stdout, done.stderr[-3000:], flush=True)
        except subprocess.TimeoutExpired as exc:
            RESULTS["micro"][shape + name] = {"timeout": True, "dir": where, "stdout": (exc.stdout or b"")[-12000:]}
            say("state_path: timed out")
        save_results()


def summary() -> None:
    lines = ["", "=== summary ==="]
    for shape, res in RESULTS["shapes"].items():
        lines.append(
            f"{shape}: {res.get('model', {}).get('file_bytes', 0) / 1e9:.2f} GB model, "
            f"KV {res.get('model', {}).get('kv_bytes_per_token')} B/token, build {res.get('build_info')}"
        )
        lines.append(
            f"{'N':>6} {'cold ms':>9} {'cold1':>9} {'save ms':>8} {'restore':>8} {'suffix':>7} {'r+s ms':>8} "
            f"{'MB':>8} {'saveGB/s':>8} {'rstGB/s':>8} {'cold/(r+s)':>10} {'TTFTcold':>9} {'TTFTr+s':>8}"
        )
        for n, r in (res.get("raw") or {}).items():
            rs = (r["restore"]["restore_ms"] or 0) + (r["suffix"]["prompt_ms"] or 0)
            lines.append(
                f"{n:>6} {r['cold2']['prompt_ms']!s:>9} {r['cold1']['prompt_ms']!s:>9} {r['save']['save_ms']!s:>8} "
                f"{r['restore']['restore_ms']!s:>8} {r['suffix']['prompt_ms']!s:>7} {rs:>8.1f} "
                f"{r['save']['file_bytes'] / 1e6:>8.1f} {r['save']['gbps']!s:>8} {r['restore']['gbps']!s:>8} "
                f"{r['cold_over_restore_plus_suffix']!s:>10} {r['cold_req2_stream']['ttft_ms']!s:>9} "
                f"{r['restore_req2_stream']['restore_plus_ttft_ms']!s:>8}"
            )
    for shape, res in RESULTS["proxy"].items():
        lines.append(
            f"proxy {shape} (store {res.get('store')}), first request after each start ({WARMUP} tokens): "
            f"TTFT {res.get('warmup1', {}).get('ttft_ms')} ms"
        )
        for n, run in res.get("runs", {}).items():
            q1 = run.get("request1", {})
            m1 = q1.get("metrics", {})
            lines.append(
                f"  N={n}: req1 TTFT {q1.get('ttft_ms')} ms (its text's /tokenize alone {q1.get('tokenize_ms')} ms), "
                f"save+store {m1.get('save_seconds_sum')} s "
                f"(llama-server's part {m1.get('save_part_seconds_sum.llama_server')} s), "
                f"{m1.get('stored_bytes_total', 0) / 1e6:.1f} MB stored | "
                f"raw: cold TTFT {run.get('raw_cold_req2_ttft_ms')} ms, "
                f"restore+TTFT {run.get('raw_restore_plus_req2_ttft_ms')} ms, restore {run.get('raw_restore_ms')} ms, "
                f"save {run.get('raw_save_ms')} ms"
            )
            for mode in PROXY_MODES:
                q2 = run.get(f"request2_{mode}", {})
                m2 = q2.get("metrics", {})
                skipped = {k: v for k, v in m2.items() if k.startswith("restores_skipped")}
                lines.append(
                    f"     {mode:>6}: req2 TTFT {q2.get('ttft_ms')} ms (reused {q2.get('reused_header')}, "
                    f"prompt_n {q2.get('prompt_n')}, cache_n {q2.get('cache_n')}), "
                    f"restore {m2.get('restore_seconds_sum')} s, "
                    f"skipped {skipped} | x{run.get(f'speedup_vs_raw_cold_{mode}')} vs cold, "
                    f"sippcache adds {run.get(f'sippcache_restore_overhead_ms_{mode}')} ms to the restore "
                    f"(its staging {m2.get('restore_part_seconds_sum.sippcache')} s, llama-server's load "
                    f"{m2.get('restore_part_seconds_sum.llama_server')} s), "
                    f"TTFT over the raw floor {run.get(f'proxy_over_raw_floor_ms_{mode}')} ms; beside "
                    f"llama-server's compute of the new tokens {run.get(f'beside_compute_ms_{mode}')} ms "
                    f"(raw: {run.get('raw_beside_compute_ms')} ms)"
                )
    for shape, m in RESULTS["micro"].items():
        lines.append(f"state_path on this host (after {shape}): rc {m.get('rc')}, {m.get('s')} s (see state_path.json)")
    lines += goals()
    if RESULTS["skipped"]:
        lines.append("skipped: " + "; ".join(RESULTS["skipped"]))
    if RESULTS["errors"]:
        lines.append("errors: " + "; ".join(RESULTS["errors"]))
    print("\n".join(lines), flush=True)


#: How the goal lines name each mode run with `--restore auto`.
GOAL_LABELS = {"auto": "auto, through the store", "warm": "auto, --warm-ready", "ready": "auto, --keep-ready"}
#: The issue's goals for the proxy's follow-up after a restart, as users run it (`--restore auto`):
#: never slower than cold, and within 15% of llama-server's own restore wherever restoring wins.
COLD_GOAL, FLOOR_GOAL = 1.0, 1.15


def goals() -> list[str]:
    """Judge each proxy row run with `--restore auto` (`GOAL_LABELS`: through the store, from ready files) against
    the raw phase's same prompt: its time to first token at least COLD_GOAL times faster than
    cold, and, where llama-server's own restore beat cold, at most FLOOR_GOAL times that restore +
    first token. "PASS"/"MISS" lines, also kept in RESULTS["goals"]."""
    lines = []
    for shape, res in RESULTS["proxy"].items():
        for n, run in res.get("runs", {}).items():
            for mode, label in GOAL_LABELS.items():
                ttft = run.get(f"request2_{mode}", {}).get("ttft_ms")
                cold, floor = run.get("raw_cold_req2_ttft_ms"), run.get("raw_restore_plus_req2_ttft_ms")
                if not (ttft and cold and floor):
                    continue
                checks = [(f"{cold / ttft:.2f}x cold >= {COLD_GOAL}x", cold / ttft >= COLD_GOAL)]
                if floor < cold:
                    checks.append(
                        (
                            f"{ttft / floor:.2f}x llama-server's own restore <= {FLOOR_GOAL}x",
                            ttft / floor <= FLOOR_GOAL,
                        )
                    )
                for what, ok in checks:
                    lines.append(f"{'PASS' if ok else 'MISS'}: proxy ({label}) {shape} N={n}: {what}")
    RESULTS["goals"] = lines
    return lines


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(f"signal {signum}")


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminated)
    for key in ("BUILD_S", "CONFIGURE_S", "BUILD_FLAGS", "CUBLAS", "NVSMI"):
        if os.environ.get(key):
            RESULTS["build"][key.lower()] = os.environ[key]
    RESULTS["env"] = {
        "python": sys.version.split()[0],
        "model_dir": os.environ.get("MODEL_DIR", "/dev/shm"),
        "slot_dir": os.environ.get("SLOT_DIR", "/dev/shm/gpubench-slots"),
        "staging_dir": STAGING_DIR or "the proxy's default (/dev/shm)",
        "huge_pages": {d: huge_pages(d) for d in ("/dev/shm", *([STAGING_DIR] if STAGING_DIR else []))},
        "store_dir": os.environ.get("STORE_DIR", "/tmp/sippstore"),
        "deadline_in_s": round(left()),
    }
    save_results()
    say(f"bench: shapes {SHAPES}, N {NS}, proxy N {PROXY_NS} on {PROXY_SHAPES}, {left():.0f} s left")
    try:
        for i, shape in enumerate(SHAPES):
            model = make_model(base_shape(shape))
            if model is None:
                continue
            try:
                raw_phase(shape, model)
            except Exception as exc:
                error(f"{shape} raw", exc)
            save_results()
            if shape in PROXY_SHAPES and not skip(f"{shape} proxy", 45 + (0 if GPU else 10)):
                try:
                    proxy_phase(shape, model)
                except Exception as exc:
                    error(f"{shape} proxy", exc)
            if i == 0:
                try:
                    micro_phase(shape)
                except Exception as exc:
                    error(f"{shape} micro", exc)
            later = [base_shape(s) for s in SHAPES[i + 1 :]]
            if os.environ.get("KEEP") != "1" and base_shape(shape) not in later:
                with contextlib.suppress(OSError):
                    os.unlink(model["path"])
            save_results()
    finally:
        for proc in list(LIVE):
            with contextlib.suppress(Exception):
                stop(proc, 20, f"pid {proc.pid}")
        summary()
        save_results()
    missed = any(line.startswith("MISS") for line in RESULTS["goals"]) and os.environ.get("NO_GOALS") != "1"
    return 0 if not RESULTS["errors"] and not missed else 1


if __name__ == "__main__":
    sys.exit(main())

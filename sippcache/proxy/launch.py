"""The llama-servers the proxy fronts: one it starts (managed), or running ones it checks (attached).

A managed llama-server gets every flag the proxy needs (`MANAGED_FLAGS`) on a
free loopback port and stops with the proxy. An attached one is checked at
start, and the proxy refuses to start with one line naming what is missing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import xxhash

from ..state.modelfile import ModelFacts
from .upstream import Upstream, UpstreamError, UpstreamInfo

__all__ = [
    "MANAGED_FLAGS",
    "Managed",
    "ProxyError",
    "check_extends_restores",
    "check_upstream",
    "connect",
    "fingerprint",
    "start_llama_server",
    "stop_llama_server",
]

log = logging.getLogger("sippcache.proxy")

#: Flags the managed llama-server always gets: slots that stay as the proxy left them
#: (no idle-slot clearing behind its back), full-size sliding-window caches so a
#: restored Gemma 3 state can be extended (llama-server ignores it for other models), and
#: no prompt cache of its own in RAM: the store is the cache, and llama-server's copies
#: each displaced slot state into new memory on the next request's path (on an H200,
#: 200 ms of a 32K-token request's time to first token). A user's flags come after these.
MANAGED_FLAGS = ("--no-cache-idle-slots", "--swa-full", "--cache-ram", "0")
#: How long a starting llama-server may take to load its model.
START_SECONDS = 300.0


class ProxyError(Exception):
    """A start-up problem, said in one line."""


@dataclass
class Managed:
    """A llama-server the proxy started: its process and URL."""

    process: subprocess.Popen[bytes]
    url: str


def free_port(avoid: int) -> int:
    """A loopback port free now, other than `avoid`: the proxy's own, not yet listened on while its
    llama-server starts (given it, llama-server answered the proxy's clients, and the proxy
    could not listen: a test caught it, one start in many)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port != avoid:
            return port


def start_llama_server(
    binary: str, model: str, parallel: int, staging: str, extra: Sequence[str], proxy_port: int
) -> Managed:
    """Start llama-server on a free loopback port (not `proxy_port`) with the flags the proxy needs;
    wait until it is ready."""
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)) and shutil.which(binary) is None:
        raise ProxyError(f"--llama-server {binary}: no such executable")
    if not os.path.isfile(model):
        raise ProxyError(f"--model {model}: no such file")
    port = free_port(proxy_port)
    argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--slot-save-path", staging + os.sep]
    argv += ["--parallel", str(parallel), *MANAGED_FLAGS, *extra]
    log_path = os.path.join(staging, "llama-server.log")
    with open(log_path, "wb") as log_file:
        # Its own session: a Ctrl+C (SIGINT to the terminal's process group) stops the proxy, which
        # finishes its slot saves and then stops llama-server; if the proxy dies, so does it.
        process = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            with open(log_path, "rb") as f:
                tail = f.read().decode("utf-8", "replace").strip().splitlines()[-3:]
            raise ProxyError(f"llama-server exited ({process.returncode}): {' | '.join(tail)}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return Managed(process, url)
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.kill()
    process.wait(timeout=30)
    raise ProxyError(f"llama-server did not become ready in {START_SECONDS:.0f} s (log: {log_path})")


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the proxy's process ends, however it ends (Linux)."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop_llama_server(managed: Managed) -> None:
    managed.process.terminate()
    try:
        managed.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        managed.process.kill()
        managed.process.wait(timeout=30)


async def check_upstream(upstream: Upstream, slot_dir: str) -> UpstreamInfo:
    """What the proxy needs of a server: reachable, its props, and slot saves landing in `slot_dir`.
    Raises `ProxyError` naming the missing flag."""
    try:
        info = await upstream.info()
    except UpstreamError as exc:
        raise ProxyError(f"{upstream.url} does not answer /props and /v1/models ({exc})") from None
    probe = f"sippcache-probe-{uuid.uuid4().hex}.slot"
    try:
        await upstream.slot_action(0, "save", probe)
    except UpstreamError as exc:
        raise ProxyError(
            f"{upstream.url} cannot save slots: start llama-server with --slot-save-path {slot_dir} ({exc})"
        ) from None
    path = os.path.join(slot_dir, probe)
    if not os.path.exists(path):
        raise ProxyError(f"{upstream.url} saves slots elsewhere: start it with --slot-save-path {slot_dir}")
    try:
        os.unlink(path)
    except OSError as exc:
        raise ProxyError(
            f"this proxy cannot remove the slot files {upstream.url} writes in {slot_dir} ({exc.strerror}): run both "
            "as one user, or give both a group that may write the folder, without the sticky bit"
        ) from None
    return info


async def check_extends_restores(upstream: Upstream, slot_dir: str, n_swa: int, n_ctx: int) -> None:
    """A sliding-window model: check that the server extends a restored state (it runs with
    --swa-full), by asking it to. A prompt longer than the window is evaluated in slot 0, saved,
    restored and asked again with a few more tokens; `timings.cache_n` says what it reused. Slot 0
    is erased afterwards. Raises `ProxyError` naming the flag."""
    probe = f"sippcache-probe-{uuid.uuid4().hex}.slot"
    tokens = (await upstream.tokenize("the harbour " * (n_swa // 2 + 64)))[: (n_ctx or 1 << 30) - 16]
    body = {"n_predict": 1, "temperature": 0, "id_slot": 0, "cache_prompt": True}
    try:
        await upstream.call("POST", "/completion", {**body, "prompt": tokens}, timeout=600.0)
        await upstream.slot_action(0, "save", probe)
        await upstream.slot_action(0, "erase")
        await upstream.slot_action(0, "restore", probe)
        answer = await upstream.call("POST", "/completion", {**body, "prompt": tokens + tokens[-8:]}, timeout=600.0)
        await upstream.slot_action(0, "erase")
    except UpstreamError as exc:
        raise ProxyError(f"{upstream.url}: the check that it extends a restored state failed ({exc})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(slot_dir, probe))
    reused = int(((answer or {}).get("timings") or {}).get("cache_n", 0))
    if reused < n_swa:
        raise ProxyError(
            f"{upstream.url} recomputes every restored state of this sliding-window model (it reused {reused} of "
            f"{len(tokens)} restored tokens): start llama-server with --swa-full"
        )


def fingerprint(info: UpstreamInfo, facts: ModelFacts | None) -> tuple[str, dict[str, str]]:
    """What makes a slot state loadable by a server: the model file (its digest when the proxy can
    read it, else what llama-server says of it), the llama-server build and the slot layout.
    K/V types and the V layout are checked by llama.cpp itself when it reads a state."""
    model = (
        f"file:{facts.digest}"
        if facts
        else "server:" + ",".join(f"{k}={v}" for k, v in sorted(info.model_meta.items()))
    )
    described = {
        "model": model,
        "build_info": info.build_info,
        "slots": str(info.slots),
        "memory": facts.kind if facts else "unknown",
        "format": "1",
    }
    digest = xxhash.xxh3_128_hexdigest("\n".join(f"{k}={v}" for k, v in sorted(described.items())).encode())
    return digest, described


async def connect(
    urls: Sequence[str], slot_dir: str, api_key: str | None, client: httpx.AsyncClient
) -> tuple[list[Upstream], list[UpstreamInfo]]:
    """The upstreams at `urls`, each checked (`check_upstream`); they must run one model and build."""
    upstreams = [Upstream(url, client, api_key) for url in urls]
    infos = [await check_upstream(u, slot_dir) for u in upstreams]
    for upstream, info in zip(upstreams, infos, strict=True):
        upstream.multimodal = info.multimodal
    if len({(i.model_path, i.build_info) for i in infos}) > 1:
        raise ProxyError("the upstreams serve different models or builds: one proxy fronts one model")
    return upstreams, infos

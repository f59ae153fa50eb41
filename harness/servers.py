"""Helpers for the tests and benchmarks that run `sippcache serve` as a real process on 127.0.0.1 and talk
to it over real HTTP with the official `openai` client: `Server` (one server process),
conversations, metrics parsing. The `servers` fixture (tests/conftest.py) starts them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
N_CTX = 4096
#: A system prompt of about 190 tokens: long enough that reuse shows, short enough for 2 shared cores.
SYSTEM = (
    "You are the archivist of a lighthouse on the northern cape. You keep the keeper's log: every ship that "
    "passed, its flag, the hour, the weather and the state of the sea. Answer questions about the log briefly "
    "and plainly, in one or two sentences, and say so when the log does not tell. "
) * 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """One `python -m sippcache.server` process (or any command) on a free loopback port.

    Started in its own session so that `stop()` reaches its children too; stopped
    with SIGINT (uvicorn's graceful shutdown, after which pending cache writes are
    flushed), then SIGKILL if it does not exit.
    """

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        *,
        module: str = "sippcache.server",
        program: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # `program` runs it as a user types it (e.g. the `sippcache proxy` entry point) instead of `-m module`.
        command = [*(program or (sys.executable, "-m", module)), *self.arguments(args)]
        # HOST and PORT win over settings, with or without a config file (as upstream).
        env = {"HOST": "127.0.0.1", "PORT": str(self.port), **(env or {})}
        self._log = open(log_path, "ab")  # noqa: SIM115  # the server's log for its whole life: closed in stop()
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
            preexec_fn=preexec_fn,
        )

    #: What answers once the server is ready.
    ready_path = "/v1/models"

    def arguments(self, args: Sequence[str]) -> list[str]:
        """The command-line arguments the server process gets."""
        if "--verbose" not in args and "--config_file" not in args:
            return [*args, "--verbose", "false"]
        return list(args)

    def wait_ready(self, timeout: float = 300) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.get(self.ready_path, timeout=5)
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.2)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")

    def get(self, path: str, timeout: float = 60) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return response.read()

    def client(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def stats(self) -> dict[str, Any]:
        """This server's /v1/cache/stats."""
        return json.loads(self.get("/v1/cache/stats"))

    def model_stats(self, alias: str | None = None) -> dict[str, Any]:
        models = self.stats()["models"]
        return models[alias] if alias is not None else next(iter(models.values()))

    def metrics(self) -> dict[str, float]:
        """This server's /metrics, as {'name{labels}': value}."""
        return parse_metrics(self.get("/metrics").decode())

    def settle(self, timeout: float = 60) -> None:
        """Wait until the background writes of the last request reached the store
        (entries_written stops moving; a write of a few MB takes milliseconds)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            now = sum(m["entries_written"] + m["write_failures"] for m in self.stats()["models"].values())
            if now == last:
                return
            last = now
            time.sleep(0.5)

    def stop(self) -> int:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self._log.close()
        return self.process.returncode


def gemma_args(gemma: Path, cache: str, *extra: str, parallel: int = 1) -> list[str]:
    """A gemma server on `cache`; `parallel` 1 (upstream's code path, one request at a time)
    unless a test is about batching."""
    return served_args(gemma, "gemma", cache, *extra, parallel=parallel)


def served_args(model: Path, alias: str, cache: str, *extra: str, parallel: int = 1) -> list[str]:
    """A server of `model` as `alias` on `cache` (`N_CTX` tokens a slot), `parallel` slots."""
    return [
        "--model",
        str(model),
        "--model_alias",
        alias,
        "--n_ctx",
        str(N_CTX),
        "--cache",
        cache,
        "--parallel",
        str(parallel),
        *extra,
    ]


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def delta(before: dict[str, Any], after: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {key: after[key] - before[key] for key in keys}


def briefed(question: str, system: str = SYSTEM) -> dict[str, str]:
    """A user message carrying the long instructions: the prompt Gemma 3's template (and the
    format the server picks for the gemma-3-270m file) makes of a system message and a question."""
    return {"role": "user", "content": f"{system}\n\n{question}"}


def assert_the_system_message_reaches_gemma(server: Server) -> None:
    """A chat's system message is in the prompt the served gemma evaluates: the prompt is
    longer than the question's alone, and it is `briefed`'s, the system text and a blank line
    at the start of the first user turn (llama-cpp-python's ``gemma`` format drops it)."""
    client = server.client()

    def prompt_tokens(messages: list[dict[str, str]]) -> int:
        reply = client.chat.completions.create(model="gemma", messages=messages, max_tokens=1, temperature=0)
        return int(reply.usage.prompt_tokens)

    question = {"role": "user", "content": QUESTIONS[0]}
    alone = prompt_tokens([question])
    with_system = prompt_tokens([{"role": "system", "content": SYSTEM}, question])
    assert with_system > alone and with_system == prompt_tokens([briefed(QUESTIONS[0])]), (alone, with_system)


class Conversation:
    """A chat whose turns go to whichever server is given (greedy, short answers); its
    first question carries `system` (see `briefed`)."""

    def __init__(self, name: str, system: str = SYSTEM) -> None:
        self.preamble = f"{system}This is conversation {name}."
        self.messages: list[dict[str, str]] = []
        self.prompt_tokens: list[int] = []
        self.answers: list[str] = []

    def turn(self, server: Server, question: str, *, max_tokens: int = 12) -> tuple[str, dict[str, Any]]:
        """Ask `question`; (the answer, what the cache did for it: deltas of the model's counters)."""
        before = server.model_stats()
        first = not self.messages
        self.messages.append(briefed(question, self.preamble) if first else {"role": "user", "content": question})
        reply = server.client().chat.completions.create(
            model="gemma", messages=self.messages, temperature=0, max_tokens=max_tokens
        )
        answer = reply.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": answer})
        self.prompt_tokens.append(reply.usage.prompt_tokens)
        self.answers.append(answer)
        counted = ("tokens_reused", "context_tokens_reused", "tokens_evaluated", "hits")
        return answer, delta(before, server.model_stats(), *counted)


QUESTIONS = [
    "Which ship passed first on the morning of the storm?",
    "What flag did she fly?",
    "How high was the sea that hour?",
    "Did the keeper note the wind?",
]


def assert_warm(conversation: Conversation, did: dict[str, Any], *, slack: int = 8) -> None:
    """The last turn reused everything the previous turn's prompt held, and evaluated
    only what is new: the previous answer and the new question."""
    previous, now = conversation.prompt_tokens[-2], conversation.prompt_tokens[-1]
    reused = did["tokens_reused"] + did["context_tokens_reused"]
    assert did["tokens_reused"] > 0, did
    assert reused >= previous - slack, (did, previous, now)
    assert did["tokens_evaluated"] <= now - previous + slack, (did, previous, now)

"""The door every request comes in by: admission, its context, and its client going away.

`Door` is an ASGI middleware in front of upstream's app. For each API request
(``POST /v1/...`` and ``/extras/...``) it:

- reads the body, to learn the model the request names (upstream's endpoints
  read it again from the same bytes);
- admits it or not: each model lets ``parallel + max_queue`` requests in at
  once; past that, a completion request gets 503 with ``Retry-After`` before
  anything starts (a streamed response cannot change its status once begun);
- sets `CURRENT` (a `RequestContext`: the model, when it arrived, and an event
  set when the client disconnects), which the code below reads on the
  request's task and on the worker thread that runs the model (anyio carries
  context variables into worker threads);
- listens for the client hanging up while the request runs, so a request that
  is not streamed (upstream never notices those) gives its slot back too.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CURRENT", "Admission", "Door", "RequestContext"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The paths whose requests run the model to completion, bounded by max_queue.
COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/engines/copilot-codex/completions"})


@dataclass(eq=False)
class RequestContext:
    """One request, as the code under upstream's endpoints sees it (equal only to itself)."""

    model: str | None  # the "model" the body names (None: the default model)
    arrived: float = field(default_factory=time.perf_counter)
    disconnected: threading.Event = field(default_factory=threading.Event)


#: The request being served on this task or worker thread (None outside a request).
CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("sippcache_request", default=None)


class Admission:
    """How many requests each model has in, against what it lets in: running
    (`parallel`) plus waiting (`max_queue`). Thread-safe; the counts feed the
    metrics and the interruption of streams (`sippcache.server.upstream`)."""

    def __init__(self, limits: dict[str, tuple[int, int]], default: str) -> None:
        self._limits = dict(limits)  # alias -> (parallel, max_queue)
        self.default = default
        self._inside: dict[str, int] = dict.fromkeys(self._limits, 0)
        self.rejected: dict[str, int] = dict.fromkeys(self._limits, 0)
        self._lock = threading.Lock()
        self._seconds = 0.0  # a moving average of how long a completion takes, for Retry-After

    def resolve(self, model: str | None) -> str:
        """The alias a request naming `model` is served by (upstream: unknown names get the default)."""
        return model if model is not None and model in self._limits else self.default

    def limit(self, alias: str) -> tuple[int, int]:
        return self._limits.get(alias, (1, 0))

    def enter(self, alias: str) -> bool:
        """Let one more request of `alias` in, unless it is full."""
        parallel, max_queue = self.limit(alias)
        with self._lock:
            if self._inside.get(alias, 0) >= parallel + max_queue:
                self.rejected[alias] = self.rejected.get(alias, 0) + 1
                return False
            self._inside[alias] = self._inside.get(alias, 0) + 1
            return True

    def leave(self, alias: str, seconds: float) -> None:
        with self._lock:
            self._inside[alias] -= 1
            self._seconds = seconds if not self._seconds else 0.8 * self._seconds + 0.2 * seconds

    def inside(self, alias: str) -> int:
        """Requests of `alias` admitted and not finished: running or waiting."""
        with self._lock:
            return self._inside.get(alias, 0)

    def retry_after(self, alias: str) -> int:
        """Seconds a turned-away client should wait: about when a place frees up."""
        parallel, _ = self.limit(alias)
        with self._lock:
            return max(1, math.ceil(self._seconds / max(parallel, 1)))


class Door:
    """The ASGI middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or not path.startswith(("/v1/", "/extras/")):
            await self.app(scope, receive, send)
            return
        messages, body, gone = await _read_body(receive)
        if gone:
            return  # the client left before its request was read
        context = RequestContext(_model_named(body))
        alias = self.admission.resolve(context.model)
        bounded = path in COMPLETION_PATHS
        if bounded and not self.admission.enter(alias):
            await _busy(send, alias, self.admission.retry_after(alias))
            return
        token = CURRENT.set(context)
        hung_up = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(receive, context, hung_up))
        try:
            await self.app(scope, _replay(messages, hung_up), send)
        finally:
            watcher.cancel()
            CURRENT.reset(token)
            if bounded:
                self.admission.leave(alias, time.perf_counter() - context.arrived)


async def _read_body(receive: Receive) -> tuple[list[Message], bytes, bool]:
    """The request's body messages, its bytes, and whether the client left first."""
    messages: list[Message] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return messages, b"", True
        messages.append(message)
        if not message.get("more_body", False):
            return messages, b"".join(m.get("body", b"") for m in messages), False


def _model_named(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None  # upstream answers a body it cannot read with its own error
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _replay(messages: list[Message], hung_up: asyncio.Event) -> Receive:
    """A `receive` for the app: the body already read, then a disconnect once the client hangs up."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await hung_up.wait()
        return {"type": "http.disconnect"}

    return receive


async def _watch(receive: Receive, context: RequestContext, hung_up: asyncio.Event) -> None:
    """Wait for the client to hang up while the app runs."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            context.disconnected.set()
            hung_up.set()
            return


async def _busy(send: Send, alias: str, retry_after: int) -> None:
    body = json.dumps(
        {
            "error": {
                "message": f"model {alias} is busy: every slot is running and its queue is full; retry after "
                f"{retry_after} s",
                "type": "server_busy",
                "param": None,
                "code": "queue_full",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(retry_after).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})

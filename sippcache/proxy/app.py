"""The proxy's ASGI app: routes each request to what handles it.

- a completion (`COMPLETION_PATHS`), and an agentic client's request converted to
  a chat (`CONVERTED_PATHS`, `sippcache.proxy.apis`): run in a slot with the best
  stored prefix (`sippcache.proxy.completion`);
- a request llama-server runs in a slot of its own choosing, unread
  (`UNREAD_PATHS`), and a client's erase or restore of a slot: passed through,
  the slot table kept true around them (`sippcache.proxy.passthrough`);
- ``GET /metrics``: the proxy's Prometheus metrics;
- everything else: passed to llama-server as it is.

The ideas behind it each have their module: waiting for a prefix in flight
(`flights`), whether and what to restore (`restoring`), when slots are saved
(`saving`), down servers (`health`), ready files made after a start
(`warming`), the streaming relay (`relay`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..state.rates import RestoreRates
from .apis import Translator, Unconvertible, anthropic, responses, responses_answer
from .completion import Completions
from .flights import Flights
from .health import Health
from .metrics import ProxyMetrics
from .passthrough import Passthrough
from .relay import REUSED_HEADER
from .restoring import Restorer
from .saving import SAVE_EVERY, SAVE_IDLE, SavePolicy, Saver
from .slots import SlotTable
from .store import SlotStore
from .upstream import Upstream
from .warming import Warmer

__all__ = ["COMPLETION_PATHS", "CONVERTED_PATHS", "REUSED_HEADER", "UNREAD_PATHS", "Proxy"]

log = logging.getLogger("sippcache.proxy")

#: The paths whose requests run in a slot: path -> how the prompt is read.
COMPLETION_PATHS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completion",
    "/completions": "completion",
    "/completion": "completion",
}
#: The agentic clients' APIs, run as the chat llama-server converts them to (`sippcache.proxy.apis`):
#: path -> (the conversion of a request, the translator of the chat's answer back).
CONVERTED_PATHS: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[str], Translator]]] = {
    "/v1/messages": (anthropic.to_chat, anthropic.AnthropicTranslator),
    "/v1/responses": (responses.to_chat, responses_answer.ResponsesTranslator),
    "/responses": (responses.to_chat, responses_answer.ResponsesTranslator),
}
#: The chat path a converted request goes to.
CHAT_PATH = "/v1/chat/completions"
#: The paths whose requests llama-server runs in a slot of its own choosing while the proxy does not
#: read their prompt (infill, embeddings, reranking, audio, and the converted APIs' requests the proxy
#: cannot convert): passed through, not cached (`Passthrough.unread`).
UNREAD_PATHS = frozenset(
    {
        "/infill",
        "/embedding",
        "/embeddings",
        "/v1/embeddings",
        "/rerank",
        "/reranking",
        "/v1/rerank",
        "/v1/reranking",
        "/v1/audio/transcriptions",
        "/audio/transcriptions",
    }
)
#: llama-server's slot actions (``POST /slots/{id}?action=...``) that change what a slot holds.
SLOT_PATH = re.compile(r"/slots/(\d+)")
CHANGING_ACTIONS = frozenset({"erase", "restore"})


class Proxy:
    """The proxy for a set of llama-servers of one model sharing one `SlotStore`.

    `flight_wait`: how long a request waits for another's state over a long shared prefix
    (`Flights`; 0: never). `rates` decides per upstream whether a restore beats computing
    (default: ``auto``, measured; the command line's ``--restore``). A slot left unsaved is saved
    once it has grown `save_every` tokens beyond the store, or sat `save_idle` seconds idle
    (`SavePolicy`).
    """

    def __init__(
        self,
        upstreams: list[Upstream],
        slots: SlotTable,
        store: SlotStore,
        metrics: ProxyMetrics,
        client: httpx.AsyncClient,
        scope: str = "",
        flight_wait: float = 60.0,
        rates: RestoreRates | None = None,
        *,
        save_every: int = SAVE_EVERY,
        save_idle: float = SAVE_IDLE,
    ) -> None:
        self.metrics = metrics
        self.rates = rates if rates is not None else RestoreRates()
        self.health = Health(upstreams, slots, metrics)
        policy = SavePolicy(save_every, save_idle, store.min_tokens, store.can_cut)
        self.saver = Saver(upstreams, slots, store, metrics, self.rates, self.health, policy)
        self.restorer = Restorer(store, self.rates, metrics)
        self.flights = Flights(flight_wait)
        self.passthrough = Passthrough(upstreams, slots, metrics, client, self.saver, self.health)
        self.completions = Completions(
            upstreams,
            slots,
            store,
            metrics,
            client,
            scope,
            flights=self.flights,
            restorer=self.restorer,
            saver=self.saver,
            health=self.health,
            passthrough=self.passthrough,
        )
        self.warmer = Warmer(store, slots, metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send, self.drain)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        path, post = request.url.path, request.method == "POST"
        if path == "/metrics" and request.method == "GET":
            response: Response = Response(self.metrics.render(), media_type=self.metrics.content_type)
        elif post and path in COMPLETION_PATHS:
            response = await self.complete(request, COMPLETION_PATHS[path])
        elif post and path in CONVERTED_PATHS:
            response = await self.converted(request)
        elif post and path in UNREAD_PATHS:
            response = await self.passthrough.unread(request)
        elif post and (slot := SLOT_PATH.fullmatch(path)) and request.query_params.get("action") in CHANGING_ACTIONS:
            response = await self.passthrough.slot_action(request, int(slot[1]))
        else:
            response = await self.passthrough.forward(request)
        await response(scope, receive, send)

    async def complete(self, request: Request, how: str) -> Response:
        """A completion; a body that is not a JSON object gets llama-server's own 400."""
        body = await request.body()
        payload = _json_object(body)
        if payload is None:
            return await self.passthrough.forward(request, body)
        return await self.completions.run(request, body, payload, request.url.path, how)

    async def converted(self, request: Request) -> Response:
        """An Anthropic messages or OpenAI responses request (`CONVERTED_PATHS`): converted to the chat
        llama-server would make of it, run as a chat (a slot, the best stored prefix, ``id_slot``),
        and its answer turned back into the API's. One the proxy cannot convert exactly passes through
        uncached (`Passthrough.unread`), counted with the reason."""
        body = await request.body()
        path, payload = request.url.path, _json_object(body)
        convert, translator = CONVERTED_PATHS[path]
        try:
            if payload is None:
                raise Unconvertible("invalid", "not a JSON object")
            chat = convert(payload)
        except Unconvertible as exc:
            self.metrics.unconverted.labels(path, exc.reason).inc()
            log.debug("sippcache proxy: a %s request passes through uncached: %s", path, exc)
            return await self.passthrough.unread(request, body)
        model = str(payload.get("model") or "")
        return await self.completions.run(request, body, chat, CHAT_PATH, "chat", translator(model))

    async def drain(self) -> None:
        """On shutdown: make no more ready files, stop watching down servers, save every slot left
        unsaved and wait for the store writes still running; keep the rates."""
        self.warmer.stop()
        self.health.stop()
        await self.saver.drain()
        self.rates.flush(force=True)


def _json_object(body: bytes) -> dict[str, Any] | None:
    """A request body's JSON object, or None (not JSON, or not an object)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None


async def _lifespan(receive: Receive, send: Send, drain: Callable[[], Awaitable[None]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await drain()
            await send({"type": "lifespan.shutdown.complete"})
            return

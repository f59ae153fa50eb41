"""What the proxy passes to llama-server as it is, and what that does to the slots it believes in.

Every path but the completions, and a request the proxy cannot read, goes to
llama-server unchanged (headers, ``Authorization`` included), so its own errors
(a malformed request's 400) reach the client as they are. Two kinds change
slots behind the proxy's back, so the proxy saves and forgets around them: a
request llama-server runs in a slot of its own choosing (`unread`), and a
client's erase or restore of a slot (`slot_action`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .health import Health
from .metrics import ProxyMetrics
from .relay import HOP, Relay, RelayResponse, forwarded
from .saving import Saver
from .slots import NoServer, SlotTable
from .upstream import Upstream, UpstreamDown

__all__ = ["RETRY_AFTER", "Passthrough", "unavailable"]

log = logging.getLogger("sippcache.proxy")

#: The ``Retry-After`` of a 503 (seconds): every slot busy and the queue full, or no server reachable.
RETRY_AFTER = "2"


class Passthrough:
    """Forwards requests as they are, keeping the slot table true around those that change slots."""

    def __init__(
        self,
        upstreams: list[Upstream],
        slots: SlotTable,
        metrics: ProxyMetrics,
        client: httpx.AsyncClient,
        saver: Saver,
        health: Health,
    ) -> None:
        self.upstreams, self.slots, self.metrics, self.client = upstreams, slots, metrics, client
        self.saver, self.health = saver, health
        self._said_uncached: set[str] = set()  # paths already logged as passed through uncached

    async def forward(
        self,
        request: Request,
        body: bytes | None = None,
        *,
        upstream: Upstream | None = None,
        done: Callable[[Relay], Awaitable[None]] | None = None,
    ) -> Response:
        """Forward a request as it is to a reachable llama-server (`upstream`, if given) and relay its
        answer as it is; then `done`, if given, however the relay ends."""
        if upstream is None:
            try:
                upstream = self.health.any_upstream()
            except NoServer:
                return unavailable("no llama-server is reachable")
        url = upstream.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        content = body if body is not None else await request.body()
        outgoing = self.client.build_request(
            request.method, url, headers=forwarded(request.headers), content=content, timeout=None
        )
        try:
            answer = await self.client.send(outgoing, stream=True)
        except httpx.TransportError:
            return unavailable(f"llama-server at {upstream.url} is not reachable")
        return RelayResponse(answer, stream=True, strip=False, done=done, as_is=True)

    async def unread(self, request: Request, body: bytes | None = None) -> Response:
        """A request llama-server runs in a slot of its own choosing, whose prompt the proxy does not
        read, passed through and not cached. It may take any idle slot of that llama-server, so the
        idle slots there holding a state not stored yet are saved first, and afterwards every idle
        slot there is believed to hold a state the proxy does not know: a conversation's next turn
        is restored, not sent as if its state were still in the slot (a whole recompute), and
        another tenant's request erases the slot first."""
        try:
            upstream = self.health.any_upstream()
        except NoServer:
            return unavailable("no llama-server is reachable")
        server, path = self.upstreams.index(upstream), request.url.path
        self.metrics.uncached.labels(upstream.url, path).inc()
        if path not in self._said_uncached:  # once a path: a client of these APIs gains nothing from the proxy
            self._said_uncached.add(path)
            log.warning(
                "sippcache proxy: %s requests pass through to llama-server uncached (the proxy does not read "
                "their prompts; docs/proxy.md)",
                path,
            )
        await self.saver.save_idle_slots(server)

        async def done(_: Relay) -> None:
            await self.slots.forget_idle(server)

        return await self.forward(request, body, upstream=upstream, done=done)

    async def slot_action(self, request: Request, slot_id: int) -> Response:
        """A client's erase or restore of a slot, sent to the llama-server a passthrough would reach.
        The proxy takes the slot as a request would (waiting while one has it), saves what it holds
        unsaved (its conversation leaves it), lets llama-server act, and then believes the slot holds
        nothing: its next request is restored as after a restart, not sent to llama-server as if the
        state it believed were still there (a whole recompute)."""
        try:
            upstream = self.health.any_upstream()
        except NoServer:
            return unavailable("no llama-server is reachable")
        slot = self.slots.find(self.upstreams.index(upstream), slot_id)
        if slot is None:
            return await self.forward(request)  # llama-server's own answer to a slot it has not
        body = await request.body()
        if not await self.slots.take(slot, wait=True):
            return unavailable(f"llama-server at {upstream.url} is not reachable")
        url = f"{upstream.url}{request.url.path}?{request.url.query}"
        try:
            if slot.unsaved is not None:
                await self.saver.save(slot, slot.unsaved, "leave")
            answer = await self.client.post(url, headers=forwarded(request.headers), content=body, timeout=None)
        except (UpstreamDown, httpx.TransportError) as exc:
            await self.health.lost(slot, exc)
            return unavailable(f"llama-server at {upstream.url} is not reachable")
        except BaseException:
            slot.forget()
            await self.slots.release(slot)
            raise
        slot.forget(empty=answer.is_success and request.query_params["action"] == "erase")
        await self.slots.release(slot)
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP | {"content-encoding"}}
        return Response(answer.content, answer.status_code, headers=headers)


def unavailable(message: str) -> Response:
    """A 503 with ``Retry-After``, in llama-server's error shape."""
    return JSONResponse(
        {"error": {"code": 503, "message": message, "type": "unavailable_error"}},
        status_code=503,
        headers={"Retry-After": RETRY_AFTER},
    )

"""Relaying llama-server's answer to a client: streamed as it comes, read for its timings, and, for a
request the proxy converted (`sippcache.proxy.apis`), turned into its API's answer on the way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .apis import Translator, dumps

__all__ = ["HOP", "REUSED_HEADER", "Relay", "RelayResponse", "forwarded"]

#: The response header with llama-server's own count of prompt tokens it did not evaluate.
REUSED_HEADER = "X-Sippcache-Prompt-Reused"
#: Headers not forwarded either way (hop-by-hop, or recomputed by the HTTP libraries).
HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}
_LOST = b'{"error":{"code":502,"message":"llama-server closed the connection","type":"unavailable_error"}}'


@dataclass
class Relay:
    """What one relayed completion reported: llama-server's timings, and whether it ran to the end."""

    timings: dict[str, Any]
    complete: bool = False
    lost: bool = False  # the upstream connection broke: the server may be down


class RelayResponse(Response):
    """Relays an upstream response (streamed as it comes) and calls `done` however it ends: a client
    that hangs up, an upstream that dies mid-stream, or the last byte sent. A completion's is read
    for its timings (and the reuse header), and a converted request's turned into its API's answer
    (`translator`); one relayed `as_is` (a passthrough), byte for byte."""

    def __init__(
        self,
        answer: httpx.Response,
        stream: bool,
        strip: bool,
        done: Callable[[Relay], Awaitable[None]] | None,
        *,
        as_is: bool = False,
        translator: Translator | None = None,
    ) -> None:
        self.answer, self.stream, self.strip, self.done, self.as_is = answer, stream, strip, done, as_is
        self.translator = translator  # a converted request's: the answer goes out in its API's form
        self.relay = Relay({})
        self._ended = False  # the translator's last events are out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._send(receive, send)
        finally:
            await self.answer.aclose()
            if self.done is not None:
                await self.done(self.relay)

    async def _send(self, receive: Receive, send: Send) -> None:
        answer = self.answer
        headers = [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items() if k.lower() not in HOP
        ]
        if self.as_is or answer.status_code >= 400:  # passthrough, or llama-server's own error
            await _start(send, answer.status_code, headers)
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        # Completions are read decoded (aread, aiter_bytes): their body goes out as plain bytes.
        headers = [(k, v) for k, v in headers if k.lower() != b"content-encoding"]
        if not self.stream:
            try:
                data = await _unless_disconnected(answer.aread(), receive)
            except httpx.TransportError:
                self.relay.lost = True
                await _start(send, 502, [(b"content-type", b"application/json")])
                await send({"type": "http.response.body", "body": _LOST, "more_body": False})
                return
            if data is None:
                return  # the client hung up: llama-server stops when its connection closes
            try:
                decoded = json.loads(data)
                self.relay.timings = dict(decoded.get("timings") or {})
            except (ValueError, AttributeError, TypeError):
                decoded = None
            if self.translator is not None and isinstance(decoded, dict):
                data = dumps(self.translator.body(decoded))
            headers.append((b"content-length", str(len(data)).encode()))
            await self._start_with_reuse(send, headers)
            await send({"type": "http.response.body", "body": data, "more_body": False})
            self.relay.complete = True
            return
        events = _events(answer.aiter_bytes())
        disconnected = asyncio.ensure_future(_disconnect(receive))
        held: list[bytes] | None = []  # events before the first with timings: the header waits for cache_n
        try:
            async for event in events:
                event = self._read(event)
                if disconnected.done():
                    return  # the client left mid-answer: llama-server stops when its connection closes
                if held is not None:
                    held.append(event)
                    if not self.relay.timings:
                        continue
                    await self._start_with_reuse(send, headers)
                    event, held = b"".join(held), None
                if event:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            # llama-server's answer ran to its end, so the slot holds all of it: complete, even if the
            # client leaves now, having read the last event (a short-lived client closes at [DONE]).
            self.relay.complete = True
            if self.translator is not None and not self._ended:  # a stream that ended with no [DONE]
                last = b"".join(self.translator.end())
                if held is not None:
                    held.append(last)
                else:
                    await send({"type": "http.response.body", "body": last, "more_body": True})
            if held is not None:
                await self._start_with_reuse(send, headers)
                await send({"type": "http.response.body", "body": b"".join(held), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.TransportError:
            self.relay.lost = True  # the upstream died mid-stream: the client's stream ends here
        finally:
            disconnected.cancel()

    async def _start_with_reuse(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """Start the response with the header carrying llama-server's cache_n (once its timings are known)."""
        reused = str(self.relay.timings.get("cache_n", "")).encode()
        await _start(send, self.answer.status_code, [*headers, (REUSED_HEADER.lower().encode(), reused)])

    def _read(self, event: bytes) -> bytes:
        """Note an SSE event's timings; drop the per-token timings the proxy asked for itself; a
        converted request's events become its API's (`Translator.events`, and `Translator.end` for
        the chat's ``[DONE]``)."""
        if event.startswith(b"data: [DONE]") and self.translator is not None:
            self._ended = True
            return b"".join(self.translator.end())
        if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
            return event
        try:
            data = json.loads(event[6:])
        except ValueError:
            return event
        if not isinstance(data, dict):
            return event
        if isinstance(data.get("timings"), dict):
            self.relay.timings = data["timings"]
        if self.translator is not None:
            return b"".join(self.translator.events(data))
        if not isinstance(data.get("timings"), dict):
            return event
        final = _is_final(data)
        if self.strip and not final:
            del data["timings"]
            return b"data: " + dumps(data) + b"\n\n"
        return event


def _is_final(data: dict[str, Any]) -> bool:
    if data.get("stop") is True:  # /completion
        return True
    choices = data.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and c.get("finish_reason") for c in choices) or not choices
    return False


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Split a byte stream into SSE events (each with its blank-line terminator)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            yield buffer[: end + 2]
            buffer = buffer[end + 2 :]
    if buffer:
        yield buffer


async def _unless_disconnected(reading: Awaitable[bytes], receive: Receive) -> bytes | None:
    """The body being read, or None if the client hangs up first (then the read is cancelled)."""
    read, gone = asyncio.ensure_future(reading), asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((read, gone), return_when=asyncio.FIRST_COMPLETED)
        return read.result() if read.done() else None
    finally:
        read.cancel()
        gone.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _start(send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})


def forwarded(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP}

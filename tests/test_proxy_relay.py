"""The proxy's relay of a streamed completion (sippcache/proxy/app.py): whether the slot's state is
complete (and so stored) depends on llama-server's answer, not on when the client hangs up. The
moment the client leaves is set exactly here (an ASGI receive that answers ``http.disconnect``
when told), which a real client on a socket hits only by chance."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from sippcache.proxy.relay import REUSED_HEADER, Relay, RelayResponse

TIMINGS = {"cache_n": 40, "prompt_n": 10}


def sse(*events: dict[str, Any] | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n" for e in events
    )


STREAM = sse(
    {"choices": [{"delta": {"content": "Hel"}, "finish_reason": None}], "timings": TIMINGS},
    {"choices": [{"delta": {"content": "lo"}, "finish_reason": None}], "timings": TIMINGS},
    {"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": TIMINGS},
    "[DONE]",
)


def relay(leave_after: bytes | None) -> tuple[Relay, list[dict[str, Any]]]:
    """Relay `STREAM` to a client that hangs up as soon as it has been sent the event holding
    `leave_after` (never, if None); what the relay concluded, and what the client was sent."""
    sent: list[dict[str, Any]] = []
    outcome: list[Relay] = []

    async def scenario() -> None:
        gone = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if leave_after is not None and leave_after in message.get("body", b""):
                gone.set()
                await asyncio.sleep(0)  # the server notices the hang-up before it sends again
                await asyncio.sleep(0)

        async def done(result: Relay) -> None:
            outcome.append(result)

        answer = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(STREAM))
        await RelayResponse(answer, stream=True, strip=False, done=done)({"type": "http"}, receive, send)

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert len(outcome) == 1, "done is called once, however the relay ends"
    return outcome[0], sent


def test_a_stream_relayed_to_its_end_is_complete() -> None:
    result, sent = relay(None)
    assert result.complete and not result.lost
    assert result.timings == TIMINGS
    assert (REUSED_HEADER.lower().encode(), b"40") in sent[0]["headers"]
    assert b"".join(m.get("body", b"") for m in sent[1:]) == STREAM
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_client_that_leaves_once_it_has_read_done_got_a_complete_answer() -> None:
    """A short-lived client closes its connection at [DONE]: llama-server's answer ran to its end,
    so the slot holds all of it and is stored."""
    result, _ = relay(b"[DONE]")
    assert result.complete


def test_a_client_that_leaves_mid_answer_leaves_it_incomplete() -> None:
    """Gone before the last event: the relay stops (llama-server stops when its connection closes),
    and the slot, holding part of an answer nobody asked for, is not stored."""
    result, sent = relay(b'"Hel"')
    assert not result.complete
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)

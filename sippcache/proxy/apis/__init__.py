"""The agentic clients' APIs, read as the chats llama-server makes of them.

llama-server converts an Anthropic ``/v1/messages`` request and an OpenAI
``/v1/responses`` request to a chat completion inside itself, and for the
Anthropic one drops ``id_slot``, so the proxy could neither know such a
prompt's tokens nor make the slot it restored into the one that computes it.
So the proxy makes the same conversion itself (`anthropic.to_chat`,
`responses.to_chat`), sends llama-server the chat, pinned to its slot like any
chat, and turns the chat's answer back into the API's own (`Translator`):
a whole body, or streamed events.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

__all__ = ["Translator", "Unconvertible", "dumps", "sse_event"]


class Unconvertible(ValueError):
    """A request the proxy cannot convert as llama-server would (a shape it does not know):
    it passes through to llama-server uncached. `reason` is a short label for the metrics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Translator(Protocol):
    """Turns llama-server's answer to the converted chat back into the API's answer."""

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion (``stream`` false) as the API's response body."""
        ...

    def events(self, chunk: dict[str, Any]) -> list[bytes]:
        """One streamed chat completion chunk as the API's server-sent events (whole
        ``event: ...\\ndata: ...\\n\\n`` frames; none is fine)."""
        ...

    def end(self) -> list[bytes]:
        """The API's last events, after the chat stream's ``[DONE]``."""
        ...


def dumps(data: Any) -> bytes:
    """JSON as llama-server writes it (nlohmann's ``dump()``): compact, UTF-8, nothing escaped."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(kind: str, data: Any) -> bytes:
    """One server-sent event as llama-server frames its Anthropic and Responses events:
    ``event: <kind>``, then ``data: <json>`` and a blank line."""
    return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"

"""One llama-server over HTTP: what the proxy asks of it, and what it checks at start.

Every call carries the operator's API key (``--api-key`` upstream protects the
slot and tokenizer endpoints too). Errors are two kinds: `UpstreamDown` (the
server cannot be reached: a 502/503 for the client, and the slots it held are
forgotten) and `UpstreamRefused` (it answered with an error: for a restore,
a miss).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["Upstream", "UpstreamDown", "UpstreamError", "UpstreamInfo", "UpstreamRefused"]


class UpstreamError(Exception):
    """A llama-server call that did not do what was asked."""


class UpstreamDown(UpstreamError):
    """The server could not be reached, or dropped the connection."""


class UpstreamRefused(UpstreamError):
    """The server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


@dataclass(frozen=True)
class UpstreamInfo:
    """What `/props` and `/v1/models` say about a server: enough to key entries and pick slots."""

    slots: int
    n_ctx: int  # per slot
    model_path: str
    build_info: str
    model_meta: dict[str, Any]
    multimodal: bool = False  # a projector is loaded (--mmproj): /v1/completions reads its prompt as text


class Upstream:
    """A llama-server at `url`; `client` is shared by every upstream of a proxy."""

    def __init__(self, url: str, client: httpx.AsyncClient, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.client = client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.multimodal = False  # from its /props (`UpstreamInfo`), once connected

    def __repr__(self) -> str:
        return f"Upstream({self.url!r})"

    async def call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """One JSON call; raise `UpstreamDown` or `UpstreamRefused` (with llama-server's message)."""
        try:
            response = await self.client.request(
                method, self.url + path, json=body, headers=self.headers, timeout=timeout or self.client.timeout
            )
        except httpx.TransportError as exc:
            raise UpstreamDown(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise UpstreamRefused(response.status_code, _error_message(response))
        return response.json() if response.content else None

    async def info(self) -> UpstreamInfo:
        props = await self.call("GET", "/props")
        models = await self.call("GET", "/v1/models")
        meta = ((models or {}).get("data") or [{}])[0].get("meta") or {}
        return UpstreamInfo(
            slots=int(props.get("total_slots") or 1),
            n_ctx=int((props.get("default_generation_settings") or {}).get("n_ctx") or 0),
            model_path=str(props.get("model_path") or ""),
            build_info=str(props.get("build_info") or ""),
            model_meta={k: v for k, v in meta.items() if isinstance(v, (int, float, str))},
            multimodal=any(bool(v) for v in (props.get("modalities") or {}).values()),
        )

    async def healthy(self) -> bool:
        try:
            await self.call("GET", "/health", timeout=5.0)
        except UpstreamError:
            return False
        return True

    async def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """`text` as llama-server tokenizes a prompt (special tokens parsed, BOS added as it adds it;
        with `special` False, as the text after a prompt's start: no BOS)."""
        answer = await self.call("POST", "/tokenize", {"content": text, "add_special": special, "parse_special": True})
        return [int(t) for t in answer["tokens"]]

    async def detokenize(self, tokens: list[int]) -> str:
        """The text of `tokens`, each token's piece (special tokens' too) back to back."""
        answer = await self.call("POST", "/detokenize", {"tokens": tokens})
        return str(answer["content"])

    async def apply_template(self, request: dict[str, Any]) -> str:
        """The prompt text llama-server makes of a chat request (its template, tools and options)."""
        answer = await self.call("POST", "/apply-template", request)
        return str(answer["prompt"])

    async def slot_action(self, slot: int, action: str, filename: str | None = None) -> dict[str, Any]:
        body = {"filename": filename} if filename is not None else {}
        answer = await self.call("POST", f"/slots/{slot}?action={action}", body, timeout=600.0)
        return answer if isinstance(answer, dict) else {}


def _error_message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return response.text[:300]
    if isinstance(error, dict):
        return str(error.get("message", error))
    return json.dumps(error)[:300]

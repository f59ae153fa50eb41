"""llama-server's answers to a converted OpenAI Responses request (`sippcache.proxy.apis.responses`), as
its own ``/v1/responses`` endpoint gives them (``to_json_oaicompat_resp*`` in ``server-task.cpp``): the
Responses object, or its event stream, with the few fields the official ``openai`` SDK needs to parse a
stream (``sequence_number``, ``output_index``, ``content_index``, ``logprobs``) added.
"""

from __future__ import annotations

import secrets
import string
import time
from dataclasses import dataclass
from typing import Any

from . import dumps, sse_event
from .responses import _JSON, _array, _string

__all__ = ["ResponsesTranslator"]


def _random() -> str:
    """32 random letters and digits, as llama-server's ``random_string`` makes its ids of."""
    alphabet = string.digits + string.ascii_letters
    return "".join(secrets.choice(alphabet) for _ in range(32))


def _int(obj: Any, key: str) -> int | None:
    """``obj[key]`` where `obj` is an object whose `key` holds an integer, else None."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage(usage: Any, timings: Any) -> _JSON:
    """The Responses usage of a chat's usage and llama-server's timings, as llama-server counts it:
    ``input_tokens_details.cached_tokens`` is the prompt tokens it reused (``timings.cache_n``, which
    its chat usage also gives as ``prompt_tokens_details.cached_tokens``). Without a usage (a stream
    without ``include_usage``), the counts are the timings' (prompt tokens computed plus reused). No
    ``output_tokens_details``: llama-server does not count reasoning tokens apart."""
    cached = _int(timings, "cache_n")
    if cached is None:
        cached = _int(usage.get("prompt_tokens_details") if isinstance(usage, dict) else None, "cached_tokens")
    cached = cached or 0
    prompt = _int(usage, "prompt_tokens")
    if prompt is None:
        prompt = cached + (_int(timings, "prompt_n") or 0)
    completion = _int(usage, "completion_tokens")
    if completion is None:
        completion = _int(timings, "predicted_n") or 0
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens_details": {"cached_tokens": cached},
    }


def _text_part(text: str) -> _JSON:
    """A message's output text content part."""
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


@dataclass
class _Call:
    """A streamed tool call: its id (llama-server's, without the ``fc_``/``call_`` prefixes), name,
    arguments so far and output index."""

    id: str
    name: str
    arguments: str
    index: int


class ResponsesTranslator:
    """llama-server's answers to the chat `to_chat` made, as its own ``/v1/responses`` would give them:
    `body` is ``to_json_oaicompat_resp``, `events` and `end` the events of the partial results'
    ``to_json_oaicompat_resp`` and the final ``to_json_oaicompat_resp_stream``, framed as
    ``format_oai_resp_sse`` frames them. `model` is the model named in the answer: llama-server names
    its own model (its ``model_name``, as its chat answers do), whatever the request named: the chat
    answer's own ``model`` is taken where it has one, `model` is the fallback.

    One translator serves one request (it holds the stream's state and the response's ids)."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._id = "resp_" + _random()
        self._reasoning_id = "rs_" + _random()
        self._message_id = "msg_" + _random()
        self._created_at = int(time.time())
        self._sequence = 0
        self._started = False
        self._outputs = 0
        self._reasoning = ""
        self._reasoning_index: int | None = None
        self._text = ""
        self._text_index: int | None = None
        self._calls: dict[Any, _Call] = {}
        self._usage: Any = None
        self._timings: Any = None

    def _reasoning_item(self, text: str) -> _JSON:
        return {
            "id": self._reasoning_id,
            "summary": [],
            "type": "reasoning",
            "content": [{"text": text, "type": "reasoning_text"}],
            "encrypted_content": "",
            "status": "completed",
        }

    def _message_item(self, text: str) -> _JSON:
        return {
            "content": [_text_part(text)],
            "id": self._message_id,
            "role": "assistant",
            "status": "completed",
            "type": "message",
        }

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str) -> _JSON:
        return {
            "id": "fc_" + call_id,
            "type": "function_call",
            "status": "completed",
            "arguments": arguments,
            "call_id": "call_" + call_id,
            "name": name,
        }

    def _response(self, status: str, output: list[_JSON], usage: _JSON | None) -> _JSON:
        response: _JSON = {
            "id": self._id,
            "object": "response",
            "created_at": self._created_at,
            "status": status,
            "model": self._model,
            "output": output,
        }
        if usage is not None:
            response["completed_at"] = int(time.time())
            response["usage"] = usage
        return response

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as llama-server's Responses object: a reasoning item, a message
        item and the function call items, in that order, each only when there is one."""
        self._model = str(chat.get("model") or self._model)
        choices = chat.get("choices") or [{}]
        message = choices[0].get("message") or {}
        output: list[_JSON] = []
        if message.get("reasoning_content"):
            output.append(self._reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            output.append(self._message_item(message["content"]))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            output.append(self._call_item(call.get("id", ""), function.get("name", ""), function.get("arguments", "")))
        return self._response("completed", output, _usage(chat.get("usage"), chat.get("timings")))

    def _event(self, kind: str, data: _JSON) -> _JSON:
        event = {"type": kind, "sequence_number": self._sequence, **data}
        self._sequence += 1
        return event

    def _lifecycle(self, kind: str) -> _JSON:
        return self._event(kind, {"response": self._response("in_progress", [], None)})

    def _added(self, item: _JSON) -> tuple[int, _JSON]:
        index = self._outputs
        self._outputs += 1
        return index, self._event("response.output_item.added", {"output_index": index, "item": item})

    def _delta_events(self, delta: Any) -> list[_JSON]:
        events: list[_JSON] = []
        reasoning = _string(delta, "reasoning_content")
        if reasoning:
            if self._reasoning_index is None:
                item = {**self._reasoning_item(""), "content": [], "status": "in_progress"}
                self._reasoning_index, added = self._added(item)
                events.append(added)
            self._reasoning += reasoning
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    {
                        "item_id": self._reasoning_id,
                        "output_index": self._reasoning_index,
                        "content_index": 0,
                        "delta": reasoning,
                    },
                )
            )
        content = _string(delta, "content")
        if content:
            if self._text_index is None:
                item = {**self._message_item(""), "content": [], "status": "in_progress"}
                self._text_index, added = self._added(item)
                events.append(added)
                part = {"item_id": self._message_id, "output_index": self._text_index, "content_index": 0}
                events.append(self._event("response.content_part.added", {**part, "part": _text_part("")}))
            self._text += content
            events.append(
                self._event(
                    "response.output_text.delta",
                    {
                        "item_id": self._message_id,
                        "output_index": self._text_index,
                        "content_index": 0,
                        "delta": content,
                        "logprobs": [],
                    },
                )
            )
        for piece in _array(delta, "tool_calls") or []:
            function = piece.get("function") if isinstance(piece, dict) else None
            key = piece.get("index") if isinstance(piece, dict) else None
            call = self._calls.get(key)
            if call is None:
                call_id, name = _string(piece, "id") or "", _string(function, "name") or ""
                index, added = self._added({**self._call_item(call_id, name, ""), "status": "in_progress"})
                call = self._calls[key] = _Call(call_id, name, "", index)
                events.append(added)
            arguments = _string(function, "arguments")
            if arguments:
                call.arguments += arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        {"item_id": "fc_" + call.id, "output_index": call.index, "delta": arguments},
                    )
                )
        return events

    def events(self, chunk: dict[str, Any]) -> list[bytes]:
        """One chat completion chunk as llama-server's Responses events: ``response.created`` and
        ``response.in_progress`` first, then per delta an ``output_item.added`` (and
        ``content_part.added``) when an item starts, and its ``reasoning_text``, ``output_text`` or
        ``function_call_arguments`` delta. A chunk's ``usage`` and ``timings`` are kept for the end;
        an error chunk passes as llama-server passes it (a bare ``data:`` frame)."""
        if "error" in chunk:
            return [b"data: " + dumps({"error": chunk["error"]}) + b"\n\n"]
        events: list[_JSON] = []
        if not self._started:
            self._model = str(chunk.get("model") or self._model)
            self._started = True
            events += [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]
        elif "prompt_progress" in chunk:
            events.append(self._lifecycle("response.in_progress"))
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        if chunk.get("timings") is not None:
            self._timings = chunk["timings"]
        choices = chunk.get("choices") or []
        if choices and isinstance(choices[0], dict):
            events += self._delta_events(choices[0].get("delta"))
        if events and "prompt_progress" in chunk:
            events[-1]["prompt_progress"] = chunk["prompt_progress"]
        return [sse_event(event["type"], event) for event in events]

    def end(self) -> list[bytes]:
        """The stream's last events: each item's ``done`` events (reasoning, message, function calls,
        in llama-server's order) and ``response.completed`` with the whole response, its usage, and
        llama-server's ``timings``."""
        events: list[_JSON] = []
        if not self._started:
            self._started = True
            events += [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]
        output: list[_JSON] = []
        if self._reasoning_index is not None:
            item = self._reasoning_item(self._reasoning)
            events.append(
                self._event("response.output_item.done", {"output_index": self._reasoning_index, "item": item})
            )
            output.append(item)
        if self._text_index is not None:
            part = {"item_id": self._message_id, "output_index": self._text_index, "content_index": 0}
            item = self._message_item(self._text)
            events += [
                self._event("response.output_text.done", {**part, "text": self._text, "logprobs": []}),
                self._event("response.content_part.done", {**part, "part": _text_part(self._text)}),
                self._event("response.output_item.done", {"output_index": self._text_index, "item": item}),
            ]
            output.append(item)
        for call in self._calls.values():
            item = self._call_item(call.id, call.name, call.arguments)
            events += [
                self._event(
                    "response.function_call_arguments.done",
                    {"item_id": item["id"], "output_index": call.index, "name": call.name, "arguments": call.arguments},
                ),
                self._event("response.output_item.done", {"output_index": call.index, "item": item}),
            ]
            output.append(item)
        response = self._response("completed", output, _usage(self._usage, self._timings))
        completed = self._event("response.completed", {"response": response})
        if self._timings is not None:
            completed["timings"] = self._timings
        events.append(completed)
        return [sse_event(event["type"], event) for event in events]

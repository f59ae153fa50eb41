"""OpenAI's Responses API (``POST /v1/responses``, Codex CLI's only API) as the chat llama-server makes of it.

llama-server answers ``/v1/responses`` by converting the request to a chat completion inside itself
(``server_chat_convert_responses_to_chatcmpl`` in its ``server-chat.cpp``) and the chat's answer back
(``to_json_oaicompat_resp*`` in ``server-task.cpp``). The proxy makes the same conversion here, field
for field, so the chat it sends to ``/v1/chat/completions`` renders to the very prompt tokens llama-server
would have computed, and the request is pinned to the proxy's slot like any chat (`to_chat`). The chat's
answer becomes the Responses object or event stream llama-server's own endpoint gives
(`ResponsesTranslator`), with the few fields the official ``openai`` SDK needs to parse a stream
(``sequence_number``, ``output_index``, ``content_index``, ``logprobs``) added.
"""

from __future__ import annotations

import json
import secrets
import string
import time
from dataclasses import dataclass
from typing import Any

from sippcache.proxy.apis import Unconvertible

__all__ = ["ResponsesTranslator", "to_chat"]

_JSON = dict[str, Any]


def _string(obj: Any, key: str) -> Any:
    """``obj[key]`` where `obj` is an object whose `key` holds a string, else None (llama-server's
    ``exists_and_is_string``)."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None


def _array(obj: Any, key: str) -> list[Any] | None:
    """``obj[key]`` where `obj` is an object whose `key` holds an array, else None."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, list) else None


def _invalid(detail: str) -> Unconvertible:
    """A request llama-server refuses itself: passed through, it answers its own error."""
    return Unconvertible("invalid", detail)


def _input_message(item: _JSON, content: list[Any]) -> _JSON:
    """A user, system or developer message item as the chat's message (its other fields kept)."""
    parts: list[_JSON] = []
    for part in content:
        kind = _string(part, "type")
        if kind == "input_text":
            if "text" not in part:
                raise _invalid("'Input text' requires 'text'")
            parts.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            raise Unconvertible("image")
        elif kind == "input_file":
            raise Unconvertible("file")
        else:
            raise _invalid("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    item.pop("type", None)
    item.pop("status", None)
    item["content"] = parts
    return item


def _output_parts(item: _JSON) -> list[_JSON]:
    """An assistant message item's content as the chat's content parts."""
    parts: list[_JSON] = []
    for part in _array(item, "content") or []:
        kind = _string(part, "type")
        if kind in ("output_text", "input_text"):
            if _string(part, "text") is None:
                raise _invalid("'Output text' requires 'text'")
            parts.append({"text": part["text"], "type": "text"})
        elif kind == "refusal":
            if _string(part, "refusal") is None:
                raise _invalid("'Refusal' requires 'refusal'")
            parts.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise _invalid("'type' must be one of 'output_text' or 'refusal'")
    return parts


def _tool_output(output: list[Any]) -> list[Any]:
    """A function call's output given as content parts, as the tool message's content."""
    parts: list[Any] = []
    for part in output:
        if not isinstance(part, dict) or "type" not in part:
            raise _invalid("Output of tool call missing 'type' field")
        if part["type"] == "input_image":
            raise Unconvertible("image")
        if part["type"] != "input_text":
            raise _invalid("Output of tool call should be 'Input text' or 'Input image'")
        parts.append({**part, "type": "text"})
    return parts


def _messages(items: list[Any], messages: list[_JSON]) -> None:
    """Appends the chat messages of a Responses input item list, merging each assistant item
    (output message, function call, reasoning) into an assistant message right before it."""
    for raw in items:
        item = dict(raw) if isinstance(raw, dict) else {}
        merge = bool(messages) and messages[-1].get("role") == "assistant"
        if _string(item, "content") is not None:
            item["content"] = [{"text": item["content"], "type": "input_text"}]
        content = _array(item, "content")
        role = _string(item, "role")
        kind = _string(item, "type")
        if content is not None and role in ("user", "system", "developer"):
            messages.append(_input_message(item, content))
        elif role == "assistant" and kind == "message":
            parts = _output_parts(item)
            if merge:
                previous = messages[-1]
                before = previous.get("content")
                previous["content"] = (before if isinstance(before, list) else []) + parts
            else:
                item.pop("status", None)
                item.pop("type", None)
                item["content"] = parts
                messages.append(item)
        elif (
            kind == "function_call"
            and _string(item, "arguments") is not None
            and _string(item, "call_id") is not None
            and _string(item, "name") is not None
        ):
            call = {
                "function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"],
                "type": "function",
            }
            if merge:
                previous = messages[-1]
                calls = previous.get("tool_calls")
                previous["tool_calls"] = (calls if isinstance(calls, list) else []) + [call]
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output" and _string(item, "call_id") is not None:
            output = item.get("output")
            if isinstance(output, str):
                messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
            elif isinstance(output, list):
                messages.append({"content": _tool_output(output), "role": "tool", "tool_call_id": item["call_id"]})
            else:
                raise _invalid("Cannot determine type of 'item'")
        elif kind == "reasoning" and _array(item, "summary") is not None:
            if not content:
                raise _invalid("item['content'] is not a non-empty array")
            text = _string(content[0], "text")
            if text is None:
                raise _invalid("item['content']['text'] is not a string")
            if merge:
                messages[-1]["reasoning_content"] = text
            else:
                messages.append({"role": "assistant", "content": [], "reasoning_content": text})
        else:
            raise _invalid("Cannot determine type of 'item'")


def _tools(tools: list[Any]) -> list[_JSON]:
    """Responses' flat function tools as chat tools (``strict`` true unless given); llama-server
    skips every other kind of tool (no chat equivalent), and so does this."""
    converted: list[_JSON] = []
    for tool in tools:
        if _string(tool, "type") != "function":
            continue
        function = {key: value for key, value in tool.items() if key != "type"}
        function.setdefault("strict", True)
        converted.append({"type": "function", "function": function})
    return converted


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion body llama-server's ``server_chat_convert_responses_to_chatcmpl`` makes of
    the Responses request `body`: the whole body copied (``stream``, ``id_slot``, ``cache_prompt``,
    ``tool_choice``, ``parallel_tool_calls``, ``store``, ``include``... pass unchanged), ``input`` and
    ``instructions`` made ``messages``, ``tools`` flattened to chat tools, ``max_output_tokens`` renamed
    ``max_tokens`` and ``reasoning.effort`` made ``reasoning_effort``.

    Raises `Unconvertible`: ``"invalid"`` for what llama-server refuses itself, ``"previous_response_id"``,
    ``"image"`` and ``"file"`` for what it would not convert as a plain chat."""
    if not isinstance(body, dict) or "input" not in body:
        raise _invalid("'input' is required")
    if _string(body, "previous_response_id"):
        raise Unconvertible("previous_response_id")
    chat = dict(body)
    del chat["input"]
    messages: list[_JSON] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _string(body, "instructions") or ""})
        del chat["instructions"]
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        _messages(items, messages)
    else:
        raise _invalid("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise _invalid("'tools' must be an array of objects")
        del chat["tools"]
        tools = _tools(body["tools"])
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        del chat["max_output_tokens"]
        chat["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
        del chat["reasoning"]
    return chat


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
            return [b"data: " + _dumps({"error": chunk["error"]}) + b"\n\n"]
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
        return [_frame(event) for event in events]

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
        return [_frame(event) for event in events]


def _dumps(data: Any) -> bytes:
    """JSON as llama-server writes it into an event: compact, UTF-8."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _frame(event: _JSON) -> bytes:
    """One server-sent event as llama-server's ``format_oai_resp_sse`` frames it."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + _dumps(event) + b"\n\n"

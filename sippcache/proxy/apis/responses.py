"""OpenAI's Responses API (``POST /v1/responses``, Codex CLI's only API) as the chat llama-server makes of it.

llama-server answers ``/v1/responses`` by converting the request to a chat completion inside itself
(``server_chat_convert_responses_to_chatcmpl`` in its ``server-chat.cpp``) and the chat's answer back
(``to_json_oaicompat_resp*`` in ``server-task.cpp``). The proxy makes the same conversion here, field
for field, so the chat it sends to ``/v1/chat/completions`` renders to the very prompt tokens llama-server
would have computed, and the request is pinned to the proxy's slot like any chat (`to_chat`). The chat's
answer becomes the Responses object or event stream llama-server's own endpoint gives in
`sippcache.proxy.apis.responses_answer`.
"""

from __future__ import annotations

from typing import Any

from sippcache.proxy.apis import Unconvertible

__all__ = ["to_chat"]

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

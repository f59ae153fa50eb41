"""Anthropic ``/v1/messages`` requests as the chats llama-server makes of them, and its answers back.

llama-server serves ``/v1/messages`` by converting the request to a chat completion inside itself
(``server_chat_convert_anthropic_to_oai`` in ``server-chat.cpp``) and drops ``id_slot`` on the
way, so a proxy that passed such a request on could neither know its prompt's tokens nor pin the
slot it restored for it. So the proxy converts the request here exactly as llama-server does
(`to_chat`): the chat it sends ``/v1/chat/completions``, pinned to its slot, renders through the
same chat template into the same prompt tokens. `AnthropicTranslator` turns the chat's answer back
into what llama-server's ``/v1/messages`` would have answered (``to_json_anthropic`` and
``to_json_anthropic_stream`` in ``server-task.cpp``): a whole Message, or its server-sent events.

A request whose conversion is not certain to be llama-server's (media, a block type it does not
read or reads in a way not reproduced here, input it rejects) raises `Unconvertible`, and passes
through to llama-server uncached.
"""

from __future__ import annotations

import json
import math
from typing import Any

from . import Unconvertible, dumps, sse_event

__all__ = ["AnthropicTranslator", "to_chat"]

#: Claude Code's first system line; its ``cch=`` stamp changes every request, so llama-server
#: overwrites the stamp's 5 characters with ``f`` (``normalize_anthropic_billing_header``).
_BILLING_HEADER = "x-anthropic-billing-header:"
_CCH = b"cch="
_CCH_LENGTH = 5
#: llama-server's ``max_tokens`` where the request has none, and ``thinking.budget_tokens``'s default.
_MAX_TOKENS = 4096
_THINKING_BUDGET = 10000
#: Top-level fields llama-server copies unchanged, in its order.
_COPIED = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
#: Block types llama-server skips in a message: converted by leaving them out.
_SKIPPED = frozenset({"redacted_thinking"})
#: Types raised with their own name (the rest as ``block:<type>``).
_NAMED = frozenset({"image", "document"})


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion body llama-server makes of the Anthropic request `body`
    (``server_chat_convert_anthropic_to_oai``): its fields, values and message order.

    Raises `Unconvertible` for a request whose conversion this does not reproduce (an image or
    document, a block type it does not know, a tool input whose numbers llama-server would print
    otherwise) and for one llama-server rejects (reason ``"invalid"``)."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        raise Unconvertible("invalid", "'messages' must be a list")
    chat_messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        chat_messages.append({"role": "system", "content": _system_text(body["system"])})
    for message in messages:
        chat_messages.extend(_chat_messages(message))
    chat: dict[str, Any] = {"messages": chat_messages}
    if isinstance(body.get("tools"), list):
        chat["tools"] = [_tool(tool) for tool in body["tools"]]
    if isinstance(body.get("tool_choice"), dict):
        choice = _string(body["tool_choice"], "type")
        if choice == "auto":
            chat["tool_choice"] = "auto"
        elif choice in ("any", "tool"):  # llama-server cannot force one named tool: any tool
            chat["tool_choice"] = "required"
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body.get("max_tokens", _MAX_TOKENS)
    chat.update((key, body[key]) for key in _COPIED if key in body)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and _string(thinking, "type") == "enabled":
        chat["thinking_budget_tokens"] = _thinking_budget(thinking.get("budget_tokens"))
    user_id = _string(body.get("metadata"), "user_id")
    if user_id:  # llama-server keeps it under this name, and reads it nowhere
        chat["__metadata_user_id"] = user_id
    return chat


class AnthropicTranslator:
    """llama-server's answer to a converted chat as its ``/v1/messages`` answer would have been.

    ``model`` is the answer's model where a chat answer has none: llama-server names its own
    model (``meta->model_name``) in both APIs, not the request's, so the chat's is echoed.

    Usage is llama-server's: ``cache_read_input_tokens`` the prompt tokens it reused
    (``n_prompt_tokens_cache``: the chat's ``usage.prompt_tokens_details.cached_tokens``, its
    ``timings.cache_n``), ``input_tokens`` the ones it computed (all prompt tokens less those, as
    Anthropic counts them: ``timings.prompt_n``) and ``output_tokens``; no
    ``cache_creation_input_tokens``, which llama-server does not give. A stream's
    ``message_start`` takes its counts from the chunks' ``timings`` (the proxy asks for
    ``timings_per_token``); without them they are 0. ``stop_sequence`` is always null: a chat
    answer does not say which stop word ended it (llama-server's own says, with
    ``stop_reason`` ``end_turn`` all the same)."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._id = ""
        self._started = False
        self._ended = False
        self._blocks: dict[str | int, int] = {}  # "thinking", "text" or a tool call's index: its block's index
        self._finish: Any = None
        self._usage: dict[str, Any] = {}
        self._timings: dict[str, Any] = {}

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as llama-server's Anthropic Message (``to_json_anthropic``)."""
        choice = (chat.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        for call in calls:
            function = call.get("function") or {}
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id", ""),
                    "name": function.get("name", ""),
                    "input": _tool_input(function.get("arguments")),
                }
            )
        return {
            "id": chat.get("id", ""),
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": chat.get("model", self._model),
            "stop_reason": _stop_reason(choice.get("finish_reason"), bool(calls)),
            "stop_sequence": None,
            "usage": _usage(chat.get("usage") or {}, chat.get("timings") or {}),
        }

    def events(self, chunk: dict[str, Any]) -> list[bytes]:
        """One streamed chat chunk as llama-server's Anthropic events (its partial results'
        ``to_json_anthropic``): ``message_start`` before the first one with anything to say,
        then each block's ``content_block_start`` as it opens and its deltas. The blocks close
        in `end`, as llama-server closes them with its final result."""
        self._id = chunk.get("id", self._id)
        self._model = chunk.get("model", self._model)
        if isinstance(chunk.get("timings"), dict):
            self._timings = chunk["timings"]
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices") or []
        delta = (choices[0].get("delta") if choices else None) or {}
        finish = choices[0].get("finish_reason") if choices else None
        said = delta.get("reasoning_content") or delta.get("content") or delta.get("tool_calls")
        out = [] if self._started or not (said or finish or not choices) else [self._message_start()]
        if delta.get("reasoning_content"):
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            out += self._block("thinking", {"type": "thinking", "thinking": ""}, thinking)
        if delta.get("content"):
            out += self._block("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            start = {"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", "")}
            pieces = function.get("arguments")
            arguments = {"type": "input_json_delta", "partial_json": pieces} if pieces else None
            out += self._block(int(call.get("index", 0)), start, arguments)
        if finish:
            self._finish = finish
        return out

    def end(self) -> list[bytes]:
        """The events after the chat stream's end (llama-server's final ``to_json_anthropic_stream``):
        each block's ``content_block_stop`` (a thinking block's empty ``signature_delta`` first),
        ``message_delta`` with the stop reason and output tokens, ``message_stop``."""
        if self._ended:
            return []
        self._ended = True
        out = [] if self._started else [self._message_start()]
        for key, index in self._blocks.items():
            if key == "thinking":
                signature = {"type": "signature_delta", "signature": ""}
                out.append(_event("content_block_delta", {"index": index, "delta": signature}))
            out.append(_event("content_block_stop", {"index": index}))
        tools = any(isinstance(key, int) for key in self._blocks)
        stop = {"stop_reason": _stop_reason(self._finish, tools), "stop_sequence": None}
        output = _usage(self._usage, self._timings)["output_tokens"]
        out.append(_event("message_delta", {"delta": stop, "usage": {"output_tokens": output}}))
        out.append(_event("message_stop", {}))
        return out

    def _message_start(self) -> bytes:
        self._started = True
        usage = {**_usage(self._usage, self._timings), "output_tokens": 0}
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self._model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return _event("message_start", {"message": message})

    def _block(self, key: str | int, start: dict[str, Any], delta: dict[str, Any] | None) -> list[bytes]:
        out = []
        if key not in self._blocks:
            self._blocks[key] = len(self._blocks)
            out.append(_event("content_block_start", {"index": self._blocks[key], "content_block": start}))
        if delta:
            out.append(_event("content_block_delta", {"index": self._blocks[key], "delta": delta}))
        return out


def _string(obj: Any, key: str) -> str:
    """llama-server's ``json_value(obj, key, std::string())``: the string there, else ``""``."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else ""


def _system_text(system: Any) -> str:
    """The system message's text: the string, or its text blocks' texts joined (others left out)."""
    if isinstance(system, str):
        return _without_stamp(system)
    if isinstance(system, list):
        return "".join(_without_stamp(_string(block, "text")) for block in system if _string(block, "type") == "text")
    return ""


def _without_stamp(text: str) -> str:
    """`text` with a billing header's ``cch=`` stamp as llama-server rewrites it: its 5 bytes
    made ``fffff`` where a ``;`` follows them."""
    if not text.startswith(_BILLING_HEADER):
        return text
    try:
        raw = text.encode()
        at = raw.find(_CCH, len(_BILLING_HEADER))
        start = at + len(_CCH)
        if at < 0 or start + _CCH_LENGTH >= len(raw) or raw[start + _CCH_LENGTH] != ord(";"):
            return text
        return (raw[:start] + b"f" * _CCH_LENGTH + raw[start + _CCH_LENGTH :]).decode()
    except UnicodeError:
        raise Unconvertible("invalid", "a billing header llama-server would not rewrite as text") from None


def _chat_messages(message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as llama-server's chat messages: the message (its text blocks, tool
    calls and reasoning), then one ``tool`` message per tool result; none for an assistant
    message without content or a message of no blocks it keeps."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise Unconvertible("invalid", "a message must be an object with a role")
    role = message["role"]
    if "content" not in message:
        if role == "assistant":
            return []
        raise Unconvertible("invalid", "a message has no content")
    content = message["content"]
    if isinstance(content, str):
        return [dict(message)]
    if not isinstance(content, list):
        raise Unconvertible("invalid", "a message's content must be a string or a list")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _string(block, "type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise Unconvertible("invalid", "a text block without text")
            parts.append(block)  # whole, cache_control and all, as llama-server passes it
        elif kind == "thinking":
            reasoning += _string(block, "thinking")
        elif kind == "tool_use":
            arguments = _dumped({} if block.get("input") is None else block["input"])
            function = {"name": _string(block, "name"), "arguments": arguments}
            calls.append({"id": _string(block, "id"), "type": "function", "function": function})
        elif kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": _string(block, "tool_use_id"), "content": _result(block)})
        elif kind not in _SKIPPED:
            raise _unknown(kind)
    out = []
    if parts or calls or reasoning:
        chat_message: dict[str, Any] = {"role": role, "content": parts or ""}
        if calls:
            chat_message["tool_calls"] = calls
        if reasoning:
            chat_message["reasoning_content"] = reasoning
        out.append(chat_message)
    return out + results


def _result(block: dict[str, Any]) -> str:
    """A tool result's content as llama-server's text: the string, or its text blocks' texts joined."""
    content = block.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    texts = []
    for part in content:
        kind = _string(part, "type")
        if kind != "text":
            raise _unknown(kind)
        texts.append(_string(part, "text"))
    return "".join(texts)


def _unknown(kind: str) -> Unconvertible:
    return Unconvertible(kind if kind in _NAMED else f"block:{kind}", "not converted as llama-server would")


def _tool(tool: Any) -> dict[str, Any]:
    """An Anthropic tool as llama-server's function tool (any tool: its name, description, input schema)."""
    schema = tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool else {}
    function = {"name": _string(tool, "name"), "description": _string(tool, "description"), "parameters": schema}
    return {"type": "function", "function": function}


def _thinking_budget(budget: Any) -> int:
    if budget is None:
        return _THINKING_BUDGET
    if isinstance(budget, int) and not isinstance(budget, bool) and -(2**31) <= budget < 2**31:
        return budget
    raise Unconvertible("thinking", "budget_tokens is not an int")


def _dumped(value: Any) -> str:
    """`value` as llama-server's JSON library writes it (compact, UTF-8 unescaped): a tool call's
    arguments, which the chat template prints. Python writes numbers the same way except floats
    from 1e15 to 1e16 (it writes no exponent there) and integers past 64 bits; those raise."""
    _check_numbers(value)
    return dumps(value).decode()


def _check_numbers(value: Any) -> None:
    if isinstance(value, dict):
        for item in value.values():
            _check_numbers(item)
    elif isinstance(value, list):
        for item in value:
            _check_numbers(item)
    elif isinstance(value, float) and (not math.isfinite(value) or 1e15 <= abs(value) < 1e16):
        raise Unconvertible("number", repr(value))
    elif isinstance(value, int) and not -(2**63) <= value < 2**64:
        raise Unconvertible("number", str(value))


def _tool_input(arguments: Any) -> Any:
    """A tool call's arguments parsed, ``{}`` where they do not parse (as llama-server does)."""
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return {}


def _stop_reason(finish: Any, tool_calls: bool) -> str:
    """llama-server's: ``max_tokens`` unless stopped by an end token or stop word."""
    if finish in ("stop", "tool_calls"):
        return "tool_use" if tool_calls else "end_turn"
    return "max_tokens"


def _usage(usage: dict[str, Any], timings: dict[str, Any]) -> dict[str, int]:
    """llama-server's Anthropic usage from a chat's ``usage`` where it has one, else its ``timings``."""
    if "prompt_tokens" in usage:
        reused = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        computed = int(usage["prompt_tokens"]) - reused
    else:
        reused, computed = int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))
    output = int(usage.get("completion_tokens", timings.get("predicted_n", 0)))
    return {"cache_read_input_tokens": reused, "input_tokens": computed, "output_tokens": output}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    """One Anthropic event (``format_anthropic_sse``): its type is in its data too."""
    return sse_event(kind, {"type": kind, **data})

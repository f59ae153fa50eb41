"""`sippcache.proxy.apis.responses`: Responses API requests made the chat llama-server's
``server_chat_convert_responses_to_chatcmpl`` makes of them, and chat answers made the Responses
objects and events its ``/v1/responses`` gives; the events parse with the official ``openai`` SDK
into the same response as the whole answer. No server, no model."""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from typing import Any

import openai
import pytest

from sippcache.proxy.apis import Unconvertible
from sippcache.proxy.apis.responses import to_chat
from sippcache.proxy.apis.responses_answer import ResponsesTranslator

#: The HTTP library the installed SDK is built on (``httpx``, or ``httpx2`` in its later releases).
_http = sys.modules[openai.DefaultHttpxClient.__mro__[1].__module__]

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}},
}
READ = {"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}


def test_instructions_and_an_input_string_are_a_system_and_a_user_message_and_the_rest_is_copied() -> None:
    body = {"model": "any", "instructions": "Be brief.", "input": "Hello", "stream": False, "id_slot": 1}
    chat = to_chat(body)
    assert chat == {
        "model": "any",
        "stream": False,
        "id_slot": 1,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    }
    assert list(chat) == ["model", "stream", "id_slot", "messages"]  # llama-server's object keeps key order


def test_an_agent_turn_with_reasoning_a_call_and_its_output_becomes_one_assistant_message() -> None:
    body: dict[str, Any] = {
        "model": "gpt-5-codex",
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "List the files."},
                    {"type": "input_text", "text": "Then stop."},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "I should run ls."}],
                "encrypted_content": "",
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
            },
            {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_7"},
            {"type": "function_call_output", "call_id": "call_7", "output": "a.py\nb.py"},
            {"type": "message", "role": "user", "content": "Thanks."},
        ],
        "tools": [SHELL, READ, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "high", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "3f1c",
        "max_output_tokens": 512,
    }
    original = copy.deepcopy(body)
    chat = to_chat(body)
    assert body == original  # the request is not changed
    assert chat == {
        "model": "gpt-5-codex",
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "3f1c",
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "developer", "content": [{"text": "Sandbox: none.", "type": "text"}]},
            {
                "role": "user",
                "content": [{"text": "List the files.", "type": "text"}, {"text": "Then stop.", "type": "text"}],
            },
            {
                "role": "assistant",
                "content": [{"text": "Listing.", "type": "text"}],
                "reasoning_content": "I should run ls.",
                "tool_calls": [
                    {
                        "function": {"arguments": '{"command":["ls"]}', "name": "shell"},
                        "id": "call_7",
                        "type": "function",
                    }
                ],
            },
            {"content": "a.py\nb.py", "role": "tool", "tool_call_id": "call_7"},
            {"role": "user", "content": [{"text": "Thanks.", "type": "text"}]},
        ],
        "tools": [  # the flat function tools nested, strict true unless given; other kinds dropped
            {
                "type": "function",
                "function": {
                    "name": "shell",
                    "description": "Runs a command.",
                    "strict": False,
                    "parameters": SHELL["parameters"],
                },
            },
            {
                "type": "function",
                "function": {"name": "read", "parameters": READ["parameters"], "strict": True},
            },
        ],
        "max_tokens": 512,
        "reasoning_effort": "high",
    }
    assert list(chat)[-4:] == ["messages", "tools", "max_tokens", "reasoning_effort"]


def test_parallel_calls_merge_and_an_assistant_message_keeps_its_other_fields() -> None:
    chat = to_chat(
        {
            "input": [
                {"role": "user", "content": "Read both."},
                {"type": "function_call", "name": "read", "arguments": "{}", "call_id": "c1", "id": "fc_1"},
                {"type": "function_call", "name": "read", "arguments": "{}", "call_id": "c2"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
                {"type": "function_call_output", "call_id": "c2", "output": "two"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_9",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Both read."}, {"type": "refusal", "refusal": "No."}],
                },
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "later"}]},
            ]
        }
    )
    call = {"function": {"arguments": "{}", "name": "read"}, "type": "function"}
    assert chat["messages"] == [
        {"role": "user", "content": [{"text": "Read both.", "type": "text"}]},
        {"role": "assistant", "tool_calls": [{**call, "id": "c1"}, {**call, "id": "c2"}]},
        {"content": [{"type": "text", "text": "one"}], "role": "tool", "tool_call_id": "c1"},
        {"content": "two", "role": "tool", "tool_call_id": "c2"},
        {
            "role": "assistant",
            "id": "msg_9",  # llama-server drops only an item's type and status
            "content": [{"text": "Both read.", "type": "text"}, {"refusal": "No.", "type": "refusal"}],
            "reasoning_content": "later",  # a reasoning item after an assistant message is set on it
        },
    ]
    assert list(chat) == ["messages"]


def test_reasoning_and_the_other_fields_as_llama_server_treats_them() -> None:
    assert to_chat({"input": "x", "instructions": None, "reasoning": None, "max_output_tokens": None}) == {
        "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
        "max_tokens": None,
    }
    assert to_chat({"input": "x", "reasoning": {"summary": "auto"}, "tools": [{"type": "web_search"}]}) == {
        "messages": [{"role": "user", "content": "x"}]  # no effort, no function tool: both fields dropped
    }
    # an empty or null previous_response_id is no reference; store and include pass unread
    assert to_chat({"input": "x", "previous_response_id": "", "store": True, "include": []}) == {
        "previous_response_id": "",
        "store": True,
        "include": [],
        "messages": [{"role": "user", "content": "x"}],
    }


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,"}]}]},
            "image",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "file"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
            "image",
        ),
        ({"model": "m"}, "invalid"),  # no input
        ({"input": 3}, "invalid"),
        ({"input": ["text"]}, "invalid"),  # an item that is no object
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "invalid"),
        ({"input": [{"role": "assistant", "content": "no type"}]}, "invalid"),
        ({"input": [{"role": "user", "content": [{"type": "text", "text": "chat-style part"}]}]}, "invalid"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "invalid"),
        ({"input": [{"type": "message", "role": "assistant", "content": [{"type": "output_text"}]}]}, "invalid"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]}, "invalid"),
        ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "invalid"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"text": "no type"}]}]}, "invalid"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": None}]}, "invalid"),
        ({"input": [{"type": "function_call", "name": "f", "call_id": "c"}]}, "invalid"),  # no arguments
        ({"input": "x", "tools": None}, "invalid"),
    ],
)
def test_what_llama_server_would_not_convert_as_a_plain_chat_is_unconvertible(body: Any, reason: str) -> None:
    with pytest.raises(Unconvertible) as refused:
        to_chat(body)
    assert refused.value.reason == reason


def _chat(message: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as llama-server answers one: 20 prompt tokens, 16 of them reused."""
    return {
        "choices": [{"finish_reason": "stop", "index": 0, "message": {"role": "assistant", **message}}],
        "created": 1,
        "model": "gemma",
        "object": "chat.completion",
        "usage": {
            "completion_tokens": 9,
            "prompt_tokens": 20,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
        "id": "chatcmpl-1",
        "timings": {"cache_n": 16, "prompt_n": 4, "predicted_n": 9},
    }


USAGE = {"input_tokens": 20, "output_tokens": 9, "total_tokens": 29, "input_tokens_details": {"cached_tokens": 16}}


def test_a_whole_text_answer_is_a_message_item() -> None:
    translator = ResponsesTranslator("gemma")
    response = translator.body(_chat({"content": "Hello there."}))
    assert response["id"].startswith("resp_") and len(response["id"]) == 37
    assert response["object"] == "response" and response["status"] == "completed" and response["model"] == "gemma"
    assert response["usage"] == USAGE
    [message] = response["output"]
    assert message["id"].startswith("msg_")
    assert {key: value for key, value in message.items() if key != "id"} == {
        "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Hello there."}],
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }


def test_a_whole_answer_with_reasoning_and_calls_is_reasoning_then_function_call_items() -> None:
    calls = [
        {"type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}, "id": "X1"},
        {"type": "function", "function": {"name": "read", "arguments": "{}"}, "id": "X2"},
    ]
    response = ResponsesTranslator("gemma").body(
        _chat({"content": "", "reasoning_content": "Run ls.", "tool_calls": calls})
    )
    reasoning, *function_calls = response["output"]
    assert reasoning["id"].startswith("rs_")
    assert {key: value for key, value in reasoning.items() if key != "id"} == {
        "summary": [],
        "type": "reasoning",
        "content": [{"text": "Run ls.", "type": "reasoning_text"}],
        "encrypted_content": "",
        "status": "completed",
    }
    assert function_calls == [  # no message item: the content is empty
        {
            "id": "fc_X1",
            "type": "function_call",
            "status": "completed",
            "arguments": '{"command":["ls"]}',
            "call_id": "call_X1",
            "name": "shell",
        },
        {
            "id": "fc_X2",
            "type": "function_call",
            "status": "completed",
            "arguments": "{}",
            "call_id": "call_X2",
            "name": "read",
        },
    ]
    # the call ids come back as the next request's function_call items, and go on as the chat's tool call ids
    assert to_chat({"input": [function_calls[0]]})["messages"][0]["tool_calls"][0]["id"] == "call_X1"


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"finish_reason": finish, "index": 0, "delta": delta}]
    return {
        "choices": choices,
        "created": 1,
        "id": "chatcmpl-1",
        "model": "gemma",
        "object": "chat.completion.chunk",
        **extra,
    }


#: llama-server's chat stream of an answer that reasons, says something and calls two tools.
CHUNKS = [
    _chunk({"role": "assistant", "content": None}),
    _chunk({"reasoning_content": "Run "}, timings={"cache_n": 16, "prompt_n": 4, "predicted_n": 1}),
    _chunk({"reasoning_content": "ls."}),
    _chunk({"content": "Listing"}),
    _chunk({"content": " now."}),
    _chunk({"tool_calls": [{"index": 0, "id": "X1", "type": "function", "function": {"name": "shell"}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command":'}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '["ls"]}'}}]}),
    _chunk(
        {"tool_calls": [{"index": 1, "id": "X2", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}
    ),
    _chunk({}, "tool_calls"),
    _chunk(
        None,
        usage={
            "completion_tokens": 9,
            "prompt_tokens": 20,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 16},
        },
        timings={"cache_n": 16, "prompt_n": 4, "predicted_n": 9},
    ),
]
#: The same answer whole.
WHOLE = {
    "content": "Listing now.",
    "reasoning_content": "Run ls.",
    "tool_calls": [
        {"type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}, "id": "X1"},
        {"type": "function", "function": {"name": "read", "arguments": "{}"}, "id": "X2"},
    ],
}


def _stream(translator: ResponsesTranslator) -> bytes:
    frames = [frame for chunk in CHUNKS for frame in translator.events(chunk)] + translator.end()
    return b"".join(frames)


def _events(sse: bytes) -> list[dict[str, Any]]:
    """The events' data, each checked to be framed as ``event: <type>\\ndata: <json>``."""
    events = []
    for frame in sse.split(b"\n\n")[:-1]:
        head, data = frame.split(b"\n")
        event = json.loads(data.removeprefix(b"data: "))
        assert head == b"event: " + event["type"].encode()
        events.append(event)
    assert sse.endswith(b"\n\n")
    return events


def test_a_chat_stream_is_llama_servers_event_sequence() -> None:
    translator = ResponsesTranslator("gemma")
    events = _events(_stream(translator))
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3),
        ("response.output_item.done", 0),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3),
        ("response.completed", None),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == [
        "Run ",
        "ls.",
        "Listing",
        " now.",
        '{"command":',
        '["ls"]}',
        "{}",
    ]
    assert events[9]["item"] == {
        "id": "fc_X1",
        "type": "function_call",
        "status": "in_progress",
        "arguments": "",
        "call_id": "call_X1",
        "name": "shell",
    }
    completed = events[-1]
    assert completed["timings"] == {"cache_n": 16, "prompt_n": 4, "predicted_n": 9}  # as llama-server adds them
    whole = translator.body(_chat(WHOLE))  # the same translator: the same ids
    assert completed["response"]["output"] == whole["output"]
    assert completed["response"]["usage"] == whole["usage"] == USAGE


def test_a_stream_without_a_usage_chunk_counts_from_the_timings() -> None:
    translator = ResponsesTranslator("gemma")
    translator.events(_chunk({"role": "assistant", "content": None}))
    translator.events(_chunk({"content": "Hi"}, timings={"cache_n": 30, "prompt_n": 2, "predicted_n": 1}))
    translator.events(_chunk({}, "stop", timings={"cache_n": 30, "prompt_n": 2, "predicted_n": 3}))
    completed = _events(b"".join(translator.end()))[-1]
    assert completed["response"]["usage"] == {
        "input_tokens": 32,
        "output_tokens": 3,
        "total_tokens": 35,
        "input_tokens_details": {"cached_tokens": 30},
    }


def test_an_error_chunk_passes_as_llama_server_passes_it() -> None:
    error = {"code": 500, "message": "ctx full", "type": "server_error"}
    assert ResponsesTranslator("gemma").events({"error": error}) == [
        b'data: {"error":{"code":500,"message":"ctx full","type":"server_error"}}\n\n'
    ]


def _client(sse: bytes) -> openai.OpenAI:
    def handler(request: Any) -> Any:
        assert request.url.path == "/v1/responses"
        return _http.Response(200, headers={"content-type": "text/event-stream"}, content=sse)

    return openai.OpenAI(
        base_url="http://llama.test/v1", api_key="x", http_client=_http.Client(transport=_http.MockTransport(handler))
    )


def _final(translator: ResponsesTranslator, parse: Callable[[openai.OpenAI], Any]) -> Any:
    return parse(_client(_stream(translator)))


def _created(client: openai.OpenAI) -> Any:
    events = list(client.responses.create(model="gemma", input="List the files.", stream=True))
    assert events[-1].type == "response.completed"
    return events[-1].response


def _streamed(client: openai.OpenAI) -> Any:
    with client.responses.stream(model="gemma", input="List the files.") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        assert deltas == ["Listing", " now."]
        return stream.get_final_response()


@pytest.mark.parametrize("parse", [_created, _streamed], ids=["create-stream", "stream-manager"])
def test_the_official_sdk_parses_the_events_into_the_whole_answers_response(
    parse: Callable[[openai.OpenAI], Any],
) -> None:
    translator = ResponsesTranslator("gemma")
    final = _final(translator, parse)
    whole = translator.body(_chat(WHOLE))
    assert final.id == whole["id"] and final.status == "completed" and final.model == "gemma"
    assert final.output_text == "Listing now."
    calls = [(item.call_id, item.name, item.arguments) for item in final.output if item.type == "function_call"]
    assert calls == [("call_X1", "shell", '{"command":["ls"]}'), ("call_X2", "read", "{}")]
    assert final.usage.input_tokens_details.cached_tokens == 16
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (20, 9, 29)
    dumped = [{k: v for k, v in item.to_dict().items() if k not in ("parsed_arguments",)} for item in final.output]
    for item in dumped:
        for part in item.get("content") or []:
            part.pop("parsed", None)
    assert dumped == whole["output"]

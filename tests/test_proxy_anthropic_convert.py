"""`sippcache.proxy.apis.anthropic`: Anthropic ``/v1/messages`` requests converted to the chat
llama-server makes of them (``server_chat_convert_anthropic_to_oai``), and llama-server's chat
answers, whole and streamed, converted back to the Message and events its ``/v1/messages`` gives;
the events read by the official ``anthropic`` SDK come to the same message as the whole answer."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest

from sippcache.proxy.apis import Unconvertible
from sippcache.proxy.apis.anthropic import AnthropicTranslator, to_chat

STAMPED = "x-anthropic-billing-header: cc_version=9.9.9.z1; cc_entrypoint=cli; cch=3c0de;"
UNSTAMPED = "x-anthropic-billing-header: cc_version=9.9.9.z1; cc_entrypoint=cli; cch=fffff;"
READ_FILE = {
    "name": "read_file",
    "description": "Reads a file of the working tree.",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"],
    },
}
READ_FILE_FUNCTION = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Reads a file of the working tree.",
        "parameters": READ_FILE["input_schema"],
    },
}


# --- requests -------------------------------------------------------------------------------


def test_a_coding_session_converts_as_llama_server_does() -> None:
    body = {
        "model": "claude-sonnet-x",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": STAMPED + "\nYou help with code."},
            {"type": "text", "text": "\nBe brief.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is in notes.txt?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read it.", "signature": "c2ln"},
                    {"type": "text", "text": "Reading it."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "notes.txt"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "buy milk"},
                    {"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "redacted_thinking", "data": "b3BhcXVl"},
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "read_file",
                        "input": {"path": "ünï.txt", "limit": 2},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no such "}, {"type": "text", "text": "file"}],
                    }
                ],
            },
        ],
        "tools": [READ_FILE],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "metadata": {"user_id": "user_abc"},
        "temperature": 1,
        "stream": True,
    }
    assert to_chat(body) == {
        "messages": [
            {"role": "system", "content": UNSTAMPED + "\nYou help with code.\nBe brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is in notes.txt?"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Reading it."}],
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path":"notes.txt"}'},
                    }
                ],
                "reasoning_content": "I should read it.",
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "buy milk"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "toolu_2",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path":"ünï.txt","limit":2}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_2", "content": "no such file"},
        ],
        "tools": [READ_FILE_FUNCTION],
        "tool_choice": "auto",
        "max_tokens": 32000,
        "temperature": 1,
        "stream": True,
        "thinking_budget_tokens": 2048,
        "__metadata_user_id": "user_abc",
    }


def test_plain_fields() -> None:
    body = {
        "model": "m",
        "system": "Be terse.",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "stop_sequences": ["END", "\n\n"],
        "top_p": 0.9,
        "top_k": 40,
        "stream": False,
        "chat_template_kwargs": {"enable_thinking": False},
        "thinking": {"type": "disabled"},
        "metadata": {},
        "service_tier": "auto",
        "context_management": {"edits": []},
    }
    assert to_chat(body) == {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
        "stop": ["END", "\n\n"],
        "max_tokens": 4096,
        "top_p": 0.9,
        "top_k": 40,
        "stream": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "tool", "name": "read_file"}, "required")],
)
def test_tool_choice(choice: dict[str, str], expected: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [READ_FILE], "tool_choice": choice}
    assert to_chat(body)["tool_choice"] == expected


def test_tool_choice_none_is_left_out_as_llama_server_leaves_it() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [READ_FILE], "tool_choice": {"type": "none"}}
    assert to_chat(body) == {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [READ_FILE_FUNCTION],
        "max_tokens": 4096,
    }


def test_a_tool_without_schema_gets_an_empty_one() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "now"}]}
    assert to_chat(body)["tools"] == [
        {"type": "function", "function": {"name": "now", "description": "", "parameters": {}}}
    ]


def test_thinking_without_budget_gets_llama_servers_default() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}
    assert to_chat(body)["thinking_budget_tokens"] == 10000


@pytest.mark.parametrize(
    ("system", "expected"),
    [
        (STAMPED + "You are a CLI.", UNSTAMPED + "You are a CLI."),
        # not followed by ';' five characters on, or not at the start: left alone, as llama-server leaves it
        ("x-anthropic-billing-header: cch=3c0de7;rest", "x-anthropic-billing-header: cch=3c0de7;rest"),
        ("x-anthropic-billing-header: cch=3c0de", "x-anthropic-billing-header: cch=3c0de"),
        ("x-anthropic-billing-header: cch=3c0de;", "x-anthropic-billing-header: cch=fffff;"),
        (" " + STAMPED + "x", " " + STAMPED + "x"),
        ([{"type": "text", "text": "A. "}, {"type": "text", "text": STAMPED + "B"}], "A. " + UNSTAMPED + "B"),
        ([{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"}], "AB"),
        ([], ""),
    ],
)
def test_system_prompt(system: Any, expected: str) -> None:
    chat = to_chat({"system": system, "messages": [{"role": "user", "content": "x"}]})
    assert chat["messages"][0] == {"role": "system", "content": expected}


def test_messages_llama_server_drops() -> None:
    body = {
        "messages": [
            {"role": "user", "content": []},
            {"role": "assistant"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": None}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "u", "name": "now"}]},
        ]
    }
    assert to_chat(body)["messages"] == [
        {"role": "tool", "tool_call_id": "t", "content": ""},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "u", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
    ]


def test_tool_input_is_written_as_llama_servers_json_library_writes_it() -> None:
    tool_input = {"s": 'a "q" \\ \n\t\x01 é 😀 /', "f": [1.5, -0.0, 1e-05, 0.0001, 123456789012345.6, 1e16], "b": True}
    message = {"role": "assistant", "content": [{"type": "tool_use", "id": "u", "name": "f", "input": tool_input}]}
    arguments = to_chat({"messages": [message]})["messages"][0]["tool_calls"][0]["function"]["arguments"]
    assert arguments == (
        '{"s":"a \\"q\\" \\\\ \\n\\t\\u0001 é 😀 /","f":[1.5,-0.0,1e-05,0.0001,123456789012345.6,1e+16],"b":true}'
    )


def _user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (_user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}), "image"),
        (_user({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}), "document"),
        (
            _user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}),
            "image",
        ),
        (
            _user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "search_result"}]}),
            "block:search_result",
        ),
        (_user({"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}), "block:server_tool_use"),
        (_user({"text": "no type"}), "block:"),
        (_user({"type": "text"}), "invalid"),
        (_user({"type": "tool_use", "id": "u", "name": "f", "input": {"n": 1e15}}), "number"),
        (_user({"type": "tool_use", "id": "u", "name": "f", "input": {"n": 2**64}}), "number"),
        (
            {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": "2k"}},
            "thinking",
        ),
        ({"system": "x"}, "invalid"),
        ({"messages": {"role": "user", "content": "x"}}, "invalid"),
        ({"messages": ["x"]}, "invalid"),
        ({"messages": [{"content": "x"}]}, "invalid"),
        ({"messages": [{"role": "user"}]}, "invalid"),
        ({"messages": [{"role": "user", "content": {"type": "text", "text": "x"}}]}, "invalid"),
        ({"messages": [{"role": "user", "content": None}]}, "invalid"),
        ({"system": "x-anthropic-billing-header: cch=\udc80abcd;", "messages": []}, "invalid"),
    ],
)
def test_unconvertible(body: Any, reason: str) -> None:
    with pytest.raises(Unconvertible) as raised:
        to_chat(body)
    assert raised.value.reason == reason


def test_a_body_that_is_no_object_is_unconvertible() -> None:
    with pytest.raises(Unconvertible) as raised:
        to_chat([])  # type: ignore[arg-type]
    assert raised.value.reason == "invalid"


# --- answers --------------------------------------------------------------------------------

TIMINGS = {"cache_n": 900, "prompt_n": 24, "predicted_n": 7, "prompt_ms": 12.5, "predicted_ms": 70.0}


def _chat(message: dict[str, Any], finish: str, completion: int = 7) -> dict[str, Any]:
    """A whole chat completion as llama-server's /v1/chat/completions answers."""
    return {
        "choices": [{"finish_reason": finish, "index": 0, "message": {"role": "assistant", **message}}],
        "created": 1700000000,
        "model": "gemma-3-270m",
        "system_fingerprint": "b1-abc",
        "object": "chat.completion",
        "usage": {
            "completion_tokens": completion,
            "prompt_tokens": 924,
            "total_tokens": 924 + completion,
            "prompt_tokens_details": {"cached_tokens": 900},
        },
        "id": "chatcmpl-xyz",
        "timings": {**TIMINGS, "predicted_n": completion},
    }


USAGE = {"cache_read_input_tokens": 900, "input_tokens": 24, "output_tokens": 7}


def test_a_text_answer() -> None:
    answer = AnthropicTranslator("claude-x").body(_chat({"content": "Buy milk."}, "stop"))
    assert answer == {
        "id": "chatcmpl-xyz",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": "Buy milk."}],
        "model": "gemma-3-270m",
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": USAGE,
    }


def test_an_answer_with_reasoning_and_tool_calls() -> None:
    message = {
        "content": "Reading both.",
        "reasoning_content": "Two files.",
        "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.txt"}'}, "id": "c1"},
            {"type": "function", "function": {"name": "read_file", "arguments": "{not json"}, "id": "c2"},
        ],
    }
    answer = AnthropicTranslator("claude-x").body(_chat(message, "tool_calls"))
    assert answer["content"] == [
        {"type": "thinking", "thinking": "Two files.", "signature": ""},
        {"type": "text", "text": "Reading both."},
        {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a.txt"}},
        {"type": "tool_use", "id": "c2", "name": "read_file", "input": {}},
    ]
    assert (answer["stop_reason"], answer["usage"]) == ("tool_use", USAGE)


def test_an_answer_cut_at_max_tokens() -> None:
    answer = AnthropicTranslator("claude-x").body(_chat({"content": ""}, "length", completion=0))
    assert (answer["content"], answer["stop_reason"]) == ([], "max_tokens")
    assert answer["usage"] == {"cache_read_input_tokens": 900, "input_tokens": 24, "output_tokens": 0}


def _chunks(
    deltas: list[dict[str, Any]], finish: str, include_usage: bool = True, completion: int = 7
) -> list[dict[str, Any]]:
    """A chat stream as llama-server sends it with ``timings_per_token``: the role first, one
    delta a chunk, a finish chunk, and a usage chunk (empty choices) carrying the last timings."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        base = {"choices": choices, "created": 1700000000, "id": "chatcmpl-xyz", "model": "gemma-3-270m"}
        return {**base, "system_fingerprint": "b1-abc", "object": "chat.completion.chunk", **extra}

    def choice(delta: dict[str, Any], finish_reason: str | None = None) -> list[dict[str, Any]]:
        return [{"finish_reason": finish_reason, "index": 0, "delta": delta}]

    out = [chunk(choice({"role": "assistant", "content": None}))]
    for n, delta in enumerate(deltas, 1):
        out.append(chunk(choice(delta), timings={**TIMINGS, "predicted_n": n}))
    if include_usage:
        out.append(chunk(choice({}, finish)))
        usage = {"completion_tokens": completion, "prompt_tokens": 924, "prompt_tokens_details": {"cached_tokens": 900}}
        out.append(chunk([], usage={**usage, "total_tokens": 924 + completion}, timings=TIMINGS))
    else:
        out.append(chunk(choice({}, finish), timings={**TIMINGS, "predicted_n": completion}))
    return out


def _sse(translator: AnthropicTranslator, chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(event for chunk in chunks for event in translator.events(chunk)) + b"".join(translator.end())


def _parsed(sse: bytes) -> list[tuple[str, dict[str, Any]]]:
    frames = sse.decode().split("\n\n")
    assert frames[-1] == ""
    out = []
    for frame in frames[:-1]:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        out.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


REASONED_TOOL_DELTAS: list[dict[str, Any]] = [
    {"reasoning_content": "Two "},
    {"reasoning_content": "files."},
    {"content": "Reading"},
    {"content": " both."},
    {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "read_file"}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"path":'}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '"a.txt"}'}}]},
    {"tool_calls": [{"index": 1, "id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
]


def test_the_events_of_a_stream() -> None:
    sse = _sse(AnthropicTranslator("claude-x"), _chunks(REASONED_TOOL_DELTAS, "tool_calls"))
    assert _parsed(sse) == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "chatcmpl-xyz",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": "gemma-3-270m",
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"cache_read_input_tokens": 900, "input_tokens": 24, "output_tokens": 0},
                },
            },
        ),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Two "}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "files."}},
        ),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Reading"}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " both."}},
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 2,
                "content_block": {"type": "tool_use", "id": "c1", "name": "read_file"},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 2,
                "delta": {"type": "input_json_delta", "partial_json": '{"path":'},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 2,
                "delta": {"type": "input_json_delta", "partial_json": '"a.txt"}'},
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 3,
                "content_block": {"type": "tool_use", "id": "c2", "name": "now"},
            },
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 3, "delta": {"type": "input_json_delta", "partial_json": "{}"}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": ""}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("content_block_stop", {"type": "content_block_stop", "index": 3}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {"output_tokens": 7},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_message_start_waits_for_the_first_chunk_with_something_to_say() -> None:
    translator = AnthropicTranslator("claude-x")
    first, *rest = _chunks([{"content": "Hi"}], "stop")
    assert translator.events(first) == []
    events = translator.events(rest[0])
    assert [event.split(b"\n")[0] for event in events] == [
        b"event: message_start",
        b"event: content_block_start",
        b"event: content_block_delta",
    ]


def test_an_empty_stream_still_makes_a_whole_message() -> None:
    translator = AnthropicTranslator("claude-x")
    events = _parsed(b"".join(translator.end()))
    assert [name for name, _ in events] == ["message_start", "message_delta", "message_stop"]
    assert events[0][1]["message"]["model"] == "claude-x"
    assert events[1][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert translator.end() == []


# --- the official SDK reads the events as the whole answer ----------------------------------


def _client(sse: bytes, whole: dict[str, Any]) -> Any:
    """The official SDK's client, answered by `sse` when it streams, else by `whole`."""
    anthropic = pytest.importorskip("anthropic")
    # the HTTP library the SDK is built on (httpx, or httpx2 in its later releases): its client's base
    http = importlib.import_module(anthropic.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0])

    def answer(request: Any) -> Any:
        if json.loads(request.content).get("stream"):
            return http.Response(200, headers={"content-type": "text/event-stream"}, content=sse)
        return http.Response(200, json=whole)

    client = anthropic.DefaultHttpxClient(transport=http.MockTransport(answer))
    return anthropic.Anthropic(api_key="unused", base_url="http://llama.test", max_retries=0, http_client=client)


WHOLE_TOOL_MESSAGE: dict[str, Any] = {
    "content": "Reading both.",
    "reasoning_content": "Two files.",
    "tool_calls": [
        {"type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.txt"}'}, "id": "c1"},
        {"type": "function", "function": {"name": "now", "arguments": "{}"}, "id": "c2"},
    ],
}


@pytest.mark.parametrize(
    ("deltas", "message", "finish", "include_usage"),
    [
        ([{"content": "Buy "}, {"content": "milk."}], {"content": "Buy milk."}, "stop", True),
        ([{"content": "Buy "}, {"content": "milk."}], {"content": "Buy milk."}, "length", False),
        (REASONED_TOOL_DELTAS, WHOLE_TOOL_MESSAGE, "tool_calls", True),
        (REASONED_TOOL_DELTAS, WHOLE_TOOL_MESSAGE, "tool_calls", False),
    ],
)
def test_the_sdk_reads_the_stream_as_the_whole_answer(
    deltas: list[dict[str, Any]], message: dict[str, Any], finish: str, include_usage: bool
) -> None:
    whole = AnthropicTranslator("claude-x").body(_chat(message, finish))
    sse = _sse(AnthropicTranslator("claude-x"), _chunks(deltas, finish, include_usage))
    client = _client(sse, whole)
    request: dict[str, Any] = {"model": "claude-x", "max_tokens": 64, "messages": [{"role": "user", "content": "?"}]}

    created = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()

    expected = {key: value for key, value in whole.items() if value is not None}  # stop_sequence: null
    assert created.model_dump(exclude_none=True) == expected
    assert streamed.model_dump(exclude_none=True) == expected
    assert (streamed.stop_sequence, created.stop_sequence) == (None, None)
    assert streamed.usage.cache_read_input_tokens == 900
    assert streamed.usage.input_tokens == 24
    assert streamed.stop_reason == whole["stop_reason"]

"""The agentic clients' APIs through `sippcache proxy`: Anthropic's ``/v1/messages`` (Claude Code)
and OpenAI's ``/v1/responses`` (Codex CLI), with their official SDKs (`anthropic`, `openai`),
against real llama-servers on the tiny generated model.

The proxy runs such a request as the chat llama-server converts it to (`sippcache.proxy.apis`), in
its own slot, so it is cached like a chat: every answer must equal plain llama-server's (greedy),
and after a restart of everything a conversation's next turn computes at most 2% of its prompt,
read from llama-server's own counters (its ``/metrics``), not from the proxy's belief. A request
shape the proxy cannot convert passes through unchanged and answers as llama-server alone does.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from harness.proxy_tools import LlamaServer, ProxyServer, metric, settle
from harness.servers import parse_metrics

#: A long system prompt per conversation (about 4,800 tokens on the tiny model's byte vocabulary,
#: where the chat template's tags are a token a character too), so that 2% of a follow-up's prompt,
#: about a hundred tokens, holds what a turn adds: the last answer, the new question, their tags.
LOG = (
    "You are the archivist of a lighthouse on the northern cape. You keep the keeper's log: every ship that "
    "passed, its flag, the hour, the weather and the state of the sea. Answer briefly and plainly. "
) * 20
TOOLS = [
    {
        "name": "read_log",
        "description": "Read the keeper's log of one day.",
        "input_schema": {"type": "object", "properties": {"day": {"type": "string"}}, "required": ["day"]},
    }
]
MAX_TOKENS = 8
#: Greedy: the Anthropic SDK has no sampling arguments any more; llama-server reads them from the body.
GREEDY = {"temperature": 0}
#: Attach mode: llama-servers this test starts (two slots, its counters on), the proxy in front.
SLOT_CTX = 8192


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("agents-model") / "tiny.gguf", n_ctx_train=16384)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Any]]:
    """Processes a test starts (llama-servers and proxies): stopped at teardown, last first."""
    procs: list[Any] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


class Stack:
    """A llama-server with two slots (``--metrics``) and a proxy attached to it, on one store and slot
    folder; `restart` stops both and starts new ones (empty slots, a new process)."""

    def __init__(self, model: Path, tmp_path: Path, started: list[Any], *extra: str) -> None:
        self.model, self.tmp_path, self.started, self.extra = model, tmp_path, started, extra
        self.slots = tmp_path / "slots"
        self.slots.mkdir(exist_ok=True)
        self.generation = 0
        self.start()

    def start(self) -> None:
        self.generation += 1
        log = self.tmp_path / f"llama-{self.generation}.log"
        args = ["-c", str(2 * SLOT_CTX), "-np", "2", "--slot-save-path", str(self.slots), "--metrics", *self.extra]
        self.llama = LlamaServer(self.model, log, *args)
        self.started.append(self.llama)
        self.llama.start()
        attach = ["--upstream", self.llama.url, "--slot-dir", str(self.slots), "--cache", f"lmdb://{self.tmp_path}/s"]
        self.proxy = ProxyServer(attach, self.tmp_path / f"proxy-{self.generation}.log")
        self.started.append(self.proxy)
        self.proxy.wait_ready()

    def restart(self) -> None:
        settle(self.proxy)
        assert self.proxy.stop() == 0
        self.llama.stop()
        self.start()

    def computed(self) -> int:
        """The prompt tokens llama-server has computed since it started (its own counter)."""
        with urllib.request.urlopen(self.llama.url + "/metrics", timeout=60) as response:
            values = parse_metrics(response.read().decode())
        return int(values["llamacpp:prompt_tokens_total"])


@pytest.fixture
def reference(model: Path, tmp_path: Path, started: list[Any]) -> LlamaServer:
    """Plain llama-server, one slot: the answers to match."""
    server = LlamaServer(model, tmp_path / "reference.log", "-c", str(SLOT_CTX), "-np", "1")
    started.append(server)
    return server.start()


# -- the clients ---------------------------------------------------------------------------------


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)


def codex(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)


class AnthropicTalk:
    """A Claude Code-like conversation: a system prompt (text, or blocks with a billing line that
    changes every request), a tool, and a first turn that called it and got its result."""

    def __init__(self, name: str, blocks: bool, stream: bool, log: str = LOG) -> None:
        self.name, self.blocks, self.stream, self.log = name, blocks, stream, log
        self.calls = 0
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"{name}: what did the log say yesterday?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me read it."},
                    {"type": "tool_use", "id": f"toolu_{name}", "name": "read_log", "input": {"day": "yesterday"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{name}", "content": "Two ships, both Danish."},
                    {"type": "text", "text": "Summarize it."},
                ],
            },
        ]

    def system(self) -> Any:
        self.calls += 1
        text = f"Conversation {self.name}. {self.log}"
        if not self.blocks:
            return text
        billing = f"x-anthropic-billing-header: cc_version=1.0; cch={self.calls:05d};"  # as llama-server rewrites
        return [{"type": "text", "text": billing}, {"type": "text", "text": text, "cache_control": {"type": "x"}}]

    def ask(self, url: str) -> tuple[str, dict[str, int]]:
        """One request as the client sends it: (the answer's text and tool calls, its usage)."""
        body = dict(model="tiny", max_tokens=MAX_TOKENS, system=self.system(), messages=self.messages, tools=TOOLS)
        body["extra_body"] = GREEDY
        client = claude(url)
        if self.stream:
            with client.messages.stream(**body) as events:  # type: ignore[arg-type]
                message = events.get_final_message()
        else:
            message = client.messages.create(**body)  # type: ignore[arg-type]
        said = json.dumps([block.model_dump() for block in message.content], sort_keys=True)
        usage = message.usage
        return said, {"input": usage.input_tokens, "cached": usage.cache_read_input_tokens or 0}

    def answered(self, said: str, question: str) -> None:
        content = [block for block in json.loads(said) if block["type"] in ("text", "tool_use")]
        content = [{k: v for k, v in b.items() if v is not None and k != "citations"} for b in content]
        self.messages += [
            {"role": "assistant", "content": content or "..."},
            {"role": "user", "content": f"{self.name}: {question}"},
        ]


class ResponsesTalk:
    """A Codex-like conversation: instructions, a function tool, and input items holding a call of it
    and its output."""

    def __init__(self, name: str, stream: bool, log: str = LOG) -> None:
        self.name, self.stream, self.log = name, stream, log
        self.input: list[dict[str, Any]] = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{name}: list the log"}]},
            {"type": "function_call", "call_id": f"call_{name}", "name": "read_log", "arguments": '{"day":"today"}'},
            {"type": "function_call_output", "call_id": f"call_{name}", "output": "Two ships, both Danish."},
        ]

    def ask(self, url: str) -> tuple[str, dict[str, int]]:
        tool = {"type": "function", "name": "read_log", "parameters": TOOLS[0]["input_schema"]}
        body = dict(
            model="tiny",
            instructions=f"Conversation {self.name}. {self.log}",
            input=self.input,
            tools=[tool],
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        client = codex(url)
        if self.stream:  # read as events: llama-server's own lack what `responses.stream()` needs (output_index)
            done = [e for e in client.responses.create(stream=True, **body) if e.type == "response.completed"]  # type: ignore[arg-type]
            response = done[0].response
        else:
            response = client.responses.create(**body)  # type: ignore[arg-type]
        said = json.dumps([_item(item.model_dump()) for item in response.output], sort_keys=True)
        usage = response.usage
        assert usage is not None
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        return said, {"input": usage.input_tokens - cached, "cached": cached}

    def answered(self, said: str, question: str) -> None:
        for item in json.loads(said):
            if item["type"] == "message":
                text = "".join(part.get("text", "") for part in item["content"])
                self.input.append({"type": "message", "role": "assistant", "content": text or "..."})
            elif item["type"] == "function_call":
                self.input.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
                self.input.append({"type": "function_call_output", "call_id": item["call_id"], "output": "none"})
        self.input.append({"type": "message", "role": "user", "content": f"{self.name}: {question}"})


def _item(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the conversation goes on with it: its ids aside (new every answer)."""
    return {k: v for k, v in item.items() if k not in ("id",)}


Talk = AnthropicTalk | ResponsesTalk


def talks(api: str, stream: bool) -> list[Talk]:
    """Four conversations (more than the two slots), each over its own system prompt."""
    if api == "anthropic":
        return [AnthropicTalk(name, blocks=i % 2 == 1, stream=stream) for i, name in enumerate("ABCD")]
    return [ResponsesTalk(name, stream=stream) for name in "ABCD"]


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", ["anthropic", "responses"])
def test_agent_turns_answer_as_llama_server_and_a_restart_computes_at_most_two_percent(
    model: Path, tmp_path: Path, started: list[Any], reference: LlamaServer, api: str, stream: bool
) -> None:
    """Four conversations interleaved on two slots, two turns each, a restart of the proxy and
    llama-server, then a third turn each: every answer is plain llama-server's, and each third
    turn computes at most 2% of its prompt (llama-server's ``prompt_tokens_total``); the usage the
    client reads says the same (``cache_read_input_tokens`` / ``cached_tokens`` = its ``cache_n``)."""
    stack = Stack(model, tmp_path, started)
    conversations = talks(api, stream)

    def turn(talk: Talk, question: str) -> tuple[int, int, dict[str, int]]:
        """(tokens computed, the prompt's length, the usage the client read) of one turn."""
        before = stack.computed()
        said, usage = talk.ask(stack.proxy.url)
        computed = stack.computed() - before
        expected, _ = talk.ask(reference.url)
        assert said == expected, (talk.name, said, expected)
        assert usage["input"] == computed, (usage, computed)  # the client's figure is llama-server's own
        talk.answered(said, question)
        return computed, usage["input"] + usage["cached"], usage

    for question in ("and the day before?", "which flag?"):
        for talk in conversations:
            turn(talk, question)
    assert metric(stack.proxy, "sippcache_proxy_restores_total", outcome="ok") >= 2  # slots changed hands

    stack.restart()
    for talk in conversations:
        computed, prompt, usage = turn(talk, "and the hour?")
        assert computed <= 0.02 * prompt, (talk.name, computed, prompt, usage)
        assert usage["cached"] >= 0.98 * prompt, usage
    assert metric(stack.proxy, "sippcache_proxy_unconverted_requests_total") == 0


@pytest.mark.gemma
def test_gemma_agent_sessions_answer_as_llama_server_across_a_restart(
    gemma_model: Path, tmp_path: Path, started: list[Any]
) -> None:
    """On a real model (gemma-3-270m, whose answers are text, not the tiny model's noise): a Claude
    Code-like session (streamed, system blocks) and a Codex-like one (whole), each over a long system
    prompt, answer as plain llama-server does turn by turn, and after a restart of everything their
    next turns compute at most 2% of their prompts (llama-server's own counter). llama-server runs
    with --swa-full, as the managed one does: gemma's sliding-window layers are restored whole."""
    log = " ".join(f"Day {d}: the brig Eider passed at {d % 12 + 1} o'clock under a grey sky." for d in range(150))
    flags = ("--swa-full", "--cache-ram", "0")  # the managed llama-server's (sippcache.proxy.launch.MANAGED_FLAGS)
    stack = Stack(gemma_model, tmp_path, started, *flags)
    reference = LlamaServer(gemma_model, tmp_path / "reference.log", "-c", str(2 * SLOT_CTX), "-np", "2", *flags)
    started.append(reference.start())
    sessions: list[Talk] = [AnthropicTalk("A", blocks=True, stream=True, log=log), ResponsesTalk("B", False, log)]
    for question in ("Which ship passed on day 7?", "And on day 9?", "At what hour?"):
        if question == "At what hour?":
            stack.restart()
        for talk in sessions:
            before = stack.computed()
            said, usage = talk.ask(stack.proxy.url)
            computed = stack.computed() - before
            assert said == talk.ask(reference.url)[0], (talk.name, question, said)
            assert usage["input"] == computed and '"text": ""' not in said, (usage, said)
            if question == "At what hour?":
                assert computed <= 0.02 * (usage["input"] + usage["cached"]), (talk.name, usage)
            talk.answered(said, question)


def test_claude_codes_side_requests_keep_the_conversations_slot_and_state(
    model: Path, tmp_path: Path, started: list[Any], reference: LlamaServer
) -> None:
    """Claude Code asks for a title beside its turns (another system prompt, a short request): on two
    slots the conversation keeps its own, so its next turn computes only what is new."""
    stack = Stack(model, tmp_path, started)
    talk = AnthropicTalk("A", blocks=True, stream=True)
    said, _ = talk.ask(stack.proxy.url)
    talk.answered(said, "and the day before?")
    title = claude(stack.proxy.url).messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        extra_body=GREEDY,
        system="Write a 3-word title for the conversation.",
        messages=[{"role": "user", "content": "A: what did the log say yesterday?"}],
    )
    expected = claude(reference.url).messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        extra_body=GREEDY,
        system="Write a 3-word title for the conversation.",
        messages=[{"role": "user", "content": "A: what did the log say yesterday?"}],
    )
    assert title.content == expected.content
    before = stack.computed()
    said, usage = talk.ask(stack.proxy.url)
    assert said == talk.ask(reference.url)[0]
    assert stack.computed() - before == usage["input"] <= 0.02 * (usage["input"] + usage["cached"]), usage


#: Request shapes Claude Code sends (written from Anthropic's documented format): the oracle's corpus.
_CALL = {"type": "tool_use", "id": "toolu_1", "name": "read_log", "input": {"day": "monday", "lines": [1, 2.5]}}
_SYSTEM_BLOCKS = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch=a1b2c;"},
    {"type": "text", "text": "You are the keeper's clerk.", "cache_control": {"type": "ephemeral"}},
]
ANTHROPIC_SHAPES: dict[str, dict[str, Any]] = {
    "text": {"system": "Be brief.", "messages": [{"role": "user", "content": "Which ship passed?"}]},
    "no-system": {"messages": [{"role": "user", "content": "Which ship passed?"}]},
    "system-blocks-and-tools": {
        "system": _SYSTEM_BLOCKS,
        "tools": TOOLS,
        "tool_choice": {"type": "auto"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Read Monday's log."}]}],
    },
    "tool-call-and-results": {
        "system": _SYSTEM_BLOCKS,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Read Monday's log."},
            {"role": "assistant", "content": [{"type": "text", "text": "Reading it."}, _CALL]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "3 ships"}]},
                    {"type": "text", "text": "And Tuesday?", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "assistant", "content": [{**_CALL, "id": "toolu_2", "input": {"day": "tuesday"}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "no log", "is_error": True}],
            },
        ],
    },
    "thinking": {
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "Think, then answer."},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "The log says two.", "signature": "c2ln"},
                    {"type": "text", "text": "Two."},
                ],
            },
            {"role": "user", "content": "Why?"},
        ],
    },
    "sampling-and-stops": {
        "system": "Be brief.",
        "stop_sequences": ["\n\nQ:"],
        "metadata": {"user_id": "user_42"},
        "top_k": 5,
        "top_p": 0.9,
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Which ship?"}, {"role": "assistant", "content": "The Eider."}],
    },
}
#: Request shapes Codex CLI sends (written from OpenAI's documented Responses format).
_FUNCTION = {"type": "function", "name": "read_log", "parameters": TOOLS[0]["input_schema"], "strict": False}
RESPONSES_SHAPES: dict[str, dict[str, Any]] = {
    "text": {"input": "Which ship passed?"},
    "instructions-and-messages": {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer in English."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Which ship passed?"}]},
        ],
    },
    "function-call-and-output": {
        "instructions": "You are a coding agent.",
        "tools": [_FUNCTION],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read the log."}]},
            {"type": "function_call", "call_id": "call_1", "name": "read_log", "arguments": '{"day":"monday"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "3 ships"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Three ships."}]},
            {"type": "message", "role": "user", "content": "And Tuesday?"},
        ],
    },
}


def test_count_tokens_is_the_proxys_own_count_of_the_prompt(model: Path, tmp_path: Path, started: list[Any]) -> None:
    """The oracle of the Anthropic conversion: for each request shape Claude Code sends, llama-server's
    own ``/v1/messages/count_tokens`` (passed through the proxy as it is: llama-server's conversion)
    equals the prompt llama-server computed for the chat the proxy converted the request to (cached
    and computed, as the answer's usage reports them); and the same request sent to llama-server
    itself then reuses all of that chat's tokens but the last: the two prompts are the same tokens."""
    stack = Stack(model, tmp_path, started)
    client = claude(stack.proxy.url)
    for talk in (AnthropicTalk("A", blocks=False, stream=False), AnthropicTalk("B", blocks=True, stream=False)):
        body: dict[str, Any] = dict(model="tiny", system=talk.system(), messages=talk.messages, tools=TOOLS)
        counted = client.messages.count_tokens(**body).input_tokens  # type: ignore[arg-type]
        answer = client.messages.create(max_tokens=1, extra_body=GREEDY, **body)  # type: ignore[arg-type]
        assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == counted
    for name, shape in ANTHROPIC_SHAPES.items():
        status, counted = _post(stack.proxy.url + "/v1/messages/count_tokens", {"model": "tiny", **shape})
        assert status == 200, (name, counted)
        status, answer = _post(stack.proxy.url + "/v1/messages", {"model": "tiny", "max_tokens": 1, **GREEDY, **shape})
        assert status == 200, (name, answer)
        usage = answer["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted["input_tokens"], (name, usage)
        # Token for token: the same request sent to llama-server itself (its own conversion) finds all
        # of its prompt but the last token in the slot the proxy's chat left (llama-server evaluates one).
        status, own = _post(stack.llama.url + "/v1/messages", {"model": "tiny", "max_tokens": 1, **GREEDY, **shape})
        assert status == 200 and own["usage"]["cache_read_input_tokens"] == counted["input_tokens"] - 1, (name, own)
    assert metric(stack.proxy, "sippcache_proxy_unconverted_requests_total") == 0


def test_the_responses_conversion_gives_llama_servers_own_prompt(
    model: Path, tmp_path: Path, started: list[Any], reference: LlamaServer
) -> None:
    """The oracle of the Responses conversion: for each request shape Codex sends, the prompt length
    llama-server reports for the request sent to it directly equals the one it reports through the
    proxy (the chat the proxy converted the request to), and llama-server's own conversion then
    reuses all of that chat's tokens but the last."""
    stack = Stack(model, tmp_path, started)
    talk = ResponsesTalk("A", stream=False)
    direct, through = codex(reference.url), codex(stack.proxy.url)
    for instructions in ("Be brief.", None):
        body: dict[str, Any] = dict(model="tiny", input=talk.input, max_output_tokens=1, temperature=0)
        if instructions:
            body["instructions"] = instructions
        own = direct.responses.create(**body).usage
        ours = through.responses.create(**body).usage
        assert own is not None and ours is not None and own.input_tokens == ours.input_tokens
    for name, shape in RESPONSES_SHAPES.items():
        request = {"model": "tiny", "max_output_tokens": 1, **GREEDY, **shape}
        (status, own), (got, ours) = (
            _post(reference.url + "/v1/responses", request),
            _post(stack.proxy.url + "/v1/responses", request),
        )
        assert status == got == 200, (name, own, ours)
        assert own["usage"]["input_tokens"] == ours["usage"]["input_tokens"], (name, own["usage"], ours["usage"])
        status, again = _post(stack.llama.url + "/v1/responses", request)  # token for token, as above
        cached = again["usage"]["input_tokens_details"]["cached_tokens"]
        assert status == 200 and cached == own["usage"]["input_tokens"] - 1, (name, again["usage"])
    assert metric(stack.proxy, "sippcache_proxy_unconverted_requests_total") == 0


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "x-new"}]}],
            },
            "block:x-new",
        ),
        ("/v1/responses", {"model": "m", "input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ],
    ids=["anthropic-unknown-block", "responses-previous-id"],
)
def test_a_shape_the_proxy_cannot_convert_passes_through_unchanged(
    model: Path, tmp_path: Path, started: list[Any], reference: LlamaServer, path: str, body: Any, reason: str
) -> None:
    stack = Stack(model, tmp_path, started)
    got = stack.proxy.post(path, body)
    own = _post(reference.url + path, body)
    assert (got[0], _without_ids(got[2])) == (own[0], _without_ids(own[1]))
    assert metric(stack.proxy, "sippcache_proxy_unconverted_requests_total", path=path, reason=reason) == 1
    assert metric(stack.proxy, "sippcache_proxy_uncached_requests_total", path=path) == 1


def _post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _without_ids(answer: Any) -> Any:
    """An answer less what differs between any two (ids, times, timings)."""
    if isinstance(answer, dict):
        drop = {"id", "created", "created_at", "completed_at", "timings", "system_fingerprint"}
        return {k: _without_ids(v) for k, v in answer.items() if k not in drop}
    if isinstance(answer, list):
        return [_without_ids(v) for v in answer]
    return answer


Ask = Callable[[str], tuple[str, dict[str, int]]]

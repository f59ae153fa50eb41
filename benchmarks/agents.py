"""An agent session as Claude Code and Codex send it, through `sippcache proxy` and straight to llama-server.

The shape (issue 54): a system prompt with tool definitions of at least 8K tokens, 8 turns, each
holding a tool call and its result, with everything restarted after turn 4 (a model swap, a
crash, an upgrade). Each API as its client speaks it, with its official SDK: Anthropic's
``/v1/messages`` (``anthropic``: Claude Code) and OpenAI's ``/v1/responses`` (``openai``: Codex
CLI), streamed. Both paths get the same requests turn by turn (the history holds fixed assistant
turns, so that the prompts are the same whatever either answered).

- plain: llama-server as a user runs it, one slot (plus ``--swa-full`` on a sliding-window model,
  so that its answers are computed as the proxy's llama-server computes them and can be compared
  token for token: without it llama-server's own rounding differs, and a near tie can flip);
- sippcache: ``sippcache proxy`` attached to a llama-server started with the flags a managed one
  gets (`sippcache.proxy.launch.MANAGED_FLAGS`, ``--slot-save-path``), so that this script can read
  that llama-server's own counters too.

Per turn: the prompt tokens llama-server computed (its own ``/metrics``,
``llamacpp:prompt_tokens_total``, both paths started with ``--metrics``), the prompt's length
(llama-server's ``count_tokens`` for Anthropic, the usage's ``input_tokens`` for OpenAI) and the
time to the first streamed event of the answer. Goals, PASS/FAIL (exit code 1 if one fails):
after the restart, sippcache's turns compute at most 2% of their prompts (plain: all of the
first one); its first turn after the restart reaches its first event at least 10x sooner than
plain's; every answer is plain's.

    python -m benchmarks.agents [--model gemma|tiny] [--apis anthropic,responses] [--tool-tokens 8000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.proxy_tools import LlamaServer, ProxyServer, settle
from harness.servers import parse_metrics
from sippcache.demo.model import gemma_model_path
from sippcache.proxy.launch import MANAGED_FLAGS

TURNS, RESTART_AFTER = 8, 4
MAX_TOKENS = 16
CTX = 32768
GREEDY = {"temperature": 0}


def tools(tokens: int) -> list[dict[str, Any]]:
    """Tool definitions whose descriptions take about `tokens` tokens in all (long, as coding agents give)."""
    described = (
        "Reads, edits or lists files of the project; paths are relative to the working directory. Use it "
        "before any change, and prefer small edits; report what changed. "
    )
    count = max(1, tokens // 100)  # a description is about 100 tokens of gemma-3's (550 characters)
    return [
        {
            "name": f"tool_{i}",
            "description": f"Tool {i}. {described * 3}",
            "input_schema": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "a file path"}, "text": {"type": "string"}},
                "required": ["path"],
            },
        }
        for i in range(count)
    ]


SYSTEM = "You are a coding agent working in a repository. Follow the user's instructions; use the tools. "


def system(defs: list[dict[str, Any]]) -> str:
    """The system prompt: the agent's instructions and each tool described in text (a chat template that
    renders no tools still gets them: their size is in the prompt whatever the model's template)."""
    return SYSTEM + "\n".join(f"- {d['name']}: {d['description']}" for d in defs)


def history(turn: int) -> list[tuple[str, str, str]]:
    """(question, the tool call's arguments, its result) of turns 1..`turn`."""
    return [
        (f"Step {t}: fix the test in module_{t}.py", f'{{"path": "module_{t}.py"}}', f"line {t}: ok")
        for t in range(1, turn + 1)
    ]


@dataclass
class Turn:
    computed: int
    prompt: int
    ttft: float
    answer: str


def anthropic_turn(url: str, turn: int, tool_defs: list[dict[str, Any]]) -> tuple[int, float, str]:
    """One turn: (the prompt's length, seconds to the first event, the answer)."""
    import anthropic

    messages: list[dict[str, Any]] = []
    for t, (question, arguments, result) in enumerate(history(turn), 1):
        messages.append({"role": "user", "content": question})
        if t < turn:  # the earlier turns' tool call and result; the last question is asked now
            call = {"type": "tool_use", "id": f"toolu_{t}", "name": "tool_0", "input": json.loads(arguments)}
            messages.append({"role": "assistant", "content": [{"type": "text", "text": "Reading it."}, call]})
            messages.append(
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": result}]}
            )
            messages.append({"role": "assistant", "content": "Done."})
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=1800)
    body: dict[str, Any] = dict(model="m", system=system(tool_defs), messages=messages, tools=tool_defs)
    prompt = client.messages.count_tokens(**body).input_tokens
    started, first, text = time.perf_counter(), None, []
    for event in client.messages.create(max_tokens=MAX_TOKENS, stream=True, extra_body=GREEDY, **body):
        if first is None and event.type in ("content_block_start", "content_block_delta"):
            first = time.perf_counter() - started
        if event.type == "content_block_delta":
            text.append(json.dumps(event.delta.model_dump(), sort_keys=True))
    return prompt, first or time.perf_counter() - started, "".join(text)


def responses_turn(url: str, turn: int, tool_defs: list[dict[str, Any]]) -> tuple[int, float, str]:
    """One turn: (the prompt's length, seconds to the first event, the answer)."""
    import openai

    items: list[dict[str, Any]] = []
    for t, (question, arguments, result) in enumerate(history(turn), 1):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]})
        if t < turn:
            items.append({"type": "function_call", "call_id": f"call_{t}", "name": "tool_0", "arguments": arguments})
            items.append({"type": "function_call_output", "call_id": f"call_{t}", "output": result})
            items.append({"type": "message", "role": "assistant", "content": "Done."})
    functions = [
        {"type": "function", "name": d["name"], "description": d["description"], "parameters": d["input_schema"]}
        for d in tool_defs
    ]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=1800)
    started, first, text = time.perf_counter(), None, []
    usage: Any = None
    for event in client.responses.create(
        model="m",
        instructions=system(tool_defs),
        input=items,
        tools=functions,
        max_output_tokens=MAX_TOKENS,
        stream=True,
        **GREEDY,
    ):  # type: ignore[arg-type]
        if first is None and event.type in ("response.output_item.added", "response.output_text.delta"):
            first = time.perf_counter() - started
        if event.type.endswith(".delta"):
            text.append(f"{event.type}:{getattr(event, 'delta', '')}")
        if event.type == "response.completed":
            usage = event.response.usage
    return (usage.input_tokens if usage else 0), first or time.perf_counter() - started, "".join(text)


@dataclass
class Serving:
    """One way to serve the session: its llama-server (with ``--metrics``) and where clients go."""

    name: str
    start: Callable[[], tuple[LlamaServer, ProxyServer | None]]
    turns: list[Turn] = field(default_factory=list)

    def run(
        self, ask: Callable[[str, int, list[dict[str, Any]]], tuple[int, float, str]], defs: list[dict[str, Any]]
    ) -> None:
        llama, proxy = self.start()
        try:
            for turn in range(1, TURNS + 1):
                if turn == RESTART_AFTER + 1:  # everything stops and starts again: a model swap, a crash
                    stop(llama, proxy)
                    llama, proxy = self.start()
                before = computed(llama)
                prompt, ttft, answer = ask(proxy.url if proxy else llama.url, turn, defs)
                self.turns.append(Turn(computed(llama) - before, prompt, ttft, answer))
                t = self.turns[-1]
                print(
                    f"  {self.name:9s} turn {turn}: computed {t.computed:6d} of {t.prompt:6d} prompt tokens, "
                    f"first event {t.ttft * 1000:9.1f} ms",
                    flush=True,
                )
        finally:
            stop(llama, proxy)


def computed(llama: LlamaServer) -> int:
    """The prompt tokens `llama` computed since it started (its own counter)."""
    with urllib.request.urlopen(llama.url + "/metrics", timeout=60) as response:
        return int(parse_metrics(response.read().decode())["llamacpp:prompt_tokens_total"])


def stop(llama: LlamaServer, proxy: ProxyServer | None) -> None:
    if proxy is not None:
        settle(proxy, 600)
        proxy.stop()
    llama.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma", help="gemma (gemma-3-270m) or tiny (the generated test model)")
    parser.add_argument("--apis", default="anthropic,responses")
    parser.add_argument("--tool-tokens", type=int, default=8000, help="about how many tokens the tool definitions take")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sipp-agents-"))
    if args.model == "tiny":
        from harness.tinymodel import write_tiny_model

        model, swa = write_tiny_model(tmp / "tiny.gguf", n_ctx_train=CTX), []
    else:
        model, swa = gemma_model_path(), ["--swa-full"]
    defs = tools(args.tool_tokens)
    failed = []
    for api in args.apis.split(","):
        ask = {"anthropic": anthropic_turn, "responses": responses_turn}[api]
        print(f"{api}: {TURNS} turns, a restart after turn {RESTART_AFTER}, model {args.model}", flush=True)
        slots = tmp / f"slots-{api}"
        slots.mkdir()

        def plain(api: str = api) -> tuple[LlamaServer, ProxyServer | None]:
            argv = ["-c", str(CTX), "-np", "1", "--metrics", *swa]
            return LlamaServer(model, tmp / f"plain-{api}.log", *argv).start(), None

        def proxied(api: str = api, slots: Path = slots) -> tuple[LlamaServer, ProxyServer | None]:
            argv = ["-c", str(CTX), "-np", "1", "--metrics", "--slot-save-path", str(slots), *MANAGED_FLAGS]
            llama = LlamaServer(model, tmp / f"upstream-{api}.log", *argv).start()
            attach = ["--upstream", llama.url, "--slot-dir", str(slots), "--cache", f"lmdb://{tmp}/store-{api}"]
            return llama, ProxyServer(attach, tmp / f"proxy-{api}.log").wait_ready(600)

        before, after = Serving("plain", plain), Serving("sippcache", proxied)
        for serving in (before, after):
            serving.run(ask, defs)
        resumed = after.turns[RESTART_AFTER:]
        share = max(t.computed / t.prompt for t in resumed)
        plain_share = before.turns[RESTART_AFTER].computed / before.turns[RESTART_AFTER].prompt
        speedup = before.turns[RESTART_AFTER].ttft / after.turns[RESTART_AFTER].ttft
        differ = [i + 1 for i, (a, b) in enumerate(zip(before.turns, after.turns, strict=True)) if a.answer != b.answer]
        totals = [sum(t.computed for t in s.turns) for s in (before, after)]
        print(f"  prompt tokens computed in all: plain {totals[0]}, sippcache {totals[1]}")
        print(f"  the first prompt: {before.turns[0].prompt} tokens (system prompt and tools, and the first question)")
        goals = [
            (
                f"after the restart at most 2% of each prompt computed (worst {share:.2%}; plain {plain_share:.0%})",
                share <= 0.02,
            ),
            (f"first turn after the restart 10x sooner to its first event than plain ({speedup:.1f}x)", speedup >= 10),
            (f"every answer plain's ({'all equal' if not differ else f'differ at turns {differ}'})", not differ),
        ]
        for text, ok in goals:
            print(f"  {'PASS' if ok else 'FAIL'} {api}: {text}")
            failed += [] if ok else [text]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

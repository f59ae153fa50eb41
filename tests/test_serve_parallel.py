"""`sippcache serve --parallel N` end to end: real server processes on 127.0.0.1, real
HTTP, the official `openai` client from many threads at once, the real gemma-3-270m.

Results: each request sent together with others gives what it gives sent alone,
but where llama.cpp's batched arithmetic flips a near-tie: at the first token
that differs, the solo run's log-probability margin between the token it took
and the one the batched run took (for greedy requests: its top-2 margin; where
the batched token is not among the solo run's top five candidates, the solo
run's top-2 margin there: `margin_at_divergence`) must be under `NEAR_TIE` (a
batch of several sequences moves gemma-3-270m's logits by up to 2.79 against a
batch of one: docs/pool.md, docs/serve.md). "Alone" means alone: each solo
request is sent when no other runs. No request sees another's tokens. Faults:
a stream cancelled mid-way gives its slot back; a full queue answers 503 with
Retry-After; a prompt longer than a slot's context is a 400 while the others
finish; SIGTERM lets a running stream finish and stores it; a restart, and a
second server once the first has stored its idle slots, continue conversations
warm (when states are stored: tests/test_serve_saves.py). No timed assertions:
waits have generous bounds and only say "it happened".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from harness.servers import (
    QUESTIONS,
    Conversation,
    Server,
    assert_the_system_message_reaches_gemma,
    assert_warm,
    gemma_args,
)
from sippcache.testing.bounded import join_all

pytestmark = pytest.mark.gemma

#: The largest log-probability margin a batched run may flip (see the module docstring): a
#: token whose lead over the one taken together is this or more must be the solo run's.
NEAR_TIE = 8.0
SLOT_CTX = "1024"
#: Bans gemma's <eos> and <end_of_turn>: the answer runs to max_tokens.
NO_END = {"1": -100.0, "106": -100.0}
SYSTEM = "You are the archivist of a lighthouse on the northern cape. Answer briefly. " * 4


def parallel_args(gemma: Path, cache: str, n: int, *extra: str) -> list[str]:
    return [*gemma_args(gemma, cache, parallel=n), "--n_ctx", SLOT_CTX, *extra]


def turn(text: str) -> str:
    """A prompt in gemma's turn format, for the completions endpoint."""
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


# -- the requests: every field that changes what the model computes ----------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip


def chat(question: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return "chat", {
        "messages": [{"role": "user", "content": SYSTEM + question}],
        "max_tokens": 16,
        "temperature": 0,
        **fields,
    }


def completion(question: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return "completion", {"prompt": turn(SYSTEM + question), "max_tokens": 16, "temperature": 0, **fields}


MIXED = [
    chat("Which ship passed first?"),
    chat("What flag did she fly?", stream=True),
    chat("Tell me about the keeper.", temperature=0.9, top_p=0.9, seed=1234),
    chat("Give the first ship as JSON.", response_format={"type": "json_object", "schema": SCHEMA}, max_tokens=32),
    chat("Which flags are in the log?", logprobs=True, top_logprobs=2),
    chat("List three ships.", stop=["\n", "."]),
    chat("Describe the sea.", presence_penalty=0.8, frequency_penalty=0.5, stream=True),
    chat("Describe the wind.", logit_bias={"818": -100.0}),
    completion("How high was the sea?"),
    completion("Did the keeper note the wind?", stream=True),
    completion("Name a ship.", temperature=0.7, top_k=20, min_p=0.1, seed=99),
    completion("What is the hour?", stop=["\n"]),
    completion("What was the weather?", logprobs=2),
    completion("Which ship came last?", stream=True, logprobs=2),
    completion("Count the ships.", temperature=1.1, typical_p=0.9, repeat_penalty=1.3, seed=7, stream=True),
    ("completion", {"prompt": "The keeper's log, day 12: the schooner Eider passed the cape and", "max_tokens": 4,
                    "temperature": 0, "echo": True, "logprobs": 2}),  # prompt logprobs: the serialized path
]  # fmt: skip


#: Fields llama-cpp-python's server takes that the openai client sends only in `extra_body`.
UPSTREAM_ONLY = ("top_k", "min_p", "typical_p", "repeat_penalty", "grammar")


def send(client: Any, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """One request; what came back, normalized: text, finish reason, usage, and with logprobs
    the tokens and their top candidates ({text: logprob})."""
    fields = dict(fields)
    extra = {name: fields.pop(name) for name in UPSTREAM_ONLY if name in fields}
    fields = {"model": "gemma", **fields, **({"extra_body": extra} if extra else {})}
    stream = fields.get("stream", False)
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    reply = create(**fields)
    chunks = list(reply) if stream else [reply]
    out: dict[str, Any] = {"text": "", "finish": None, "tokens": [], "top": []}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if kind == "chat":
            out["text"] += (choice.delta.content or "") if stream else (choice.message.content or "")
            content = choice.logprobs.content if choice.logprobs is not None and choice.logprobs.content else []
            out["tokens"] += [t.token for t in content]
            out["top"] += [{a.token: a.logprob for a in t.top_logprobs} for t in content]
        else:
            out["text"] += choice.text
            if choice.logprobs is not None:
                out["tokens"] += choice.logprobs.tokens or []
                out["top"] += [dict(d or {}) for d in choice.logprobs.top_logprobs or []]
        out["finish"] = choice.finish_reason or out["finish"]
    if not stream:
        out["usage"] = (reply.usage.prompt_tokens, reply.usage.completion_tokens)
    return out


def idle(server: Server) -> None:
    """Wait until no request runs: a request sent then is alone in its batches."""
    wait_for(lambda: gauge(server, "sippcache_slots_busy") == 0, "the server idle")


def alone(server: Server, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    idle(server)
    return send(server.client(), kind, fields)


def traced(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The same request, not streamed and with the top 5 logprobs of every token (neither
    changes what is computed: it is the reference a request sent together is held to)."""
    if fields.get("echo"):
        return fields
    more = {"logprobs": True, "top_logprobs": 5} if kind == "chat" else {"logprobs": 5}
    return {**fields, "stream": False, **more}


def margin_at_divergence(solo: dict[str, Any], together: str) -> float:
    """Where `together` leaves the `solo` run's text: how much likelier, in the solo run,
    the token it took there was than the one the together run took (a log-probability
    margin; for a greedy request, the solo run's top-2 margin). The logprobs are the raw
    logits', and a request's chain reorders them (penalties, a grammar, a bias; a seeded
    draw falls between neighbours of any rank), so the together run's token may lie
    outside the solo run's top five: then the solo run's top-2 margin there, which says
    whether the solo run was as good as certain of its token (a certain token cannot flip)."""
    text = solo["text"]
    at = next((i for i, (a, b) in enumerate(zip(text, together, strict=False)) if a != b), len(text))
    start = 0
    for token, candidates in zip(solo["tokens"], solo["top"], strict=True):
        if start + len(token) > at:
            rest = together[start:]
            taken = [logprob for cand, logprob in candidates.items() if cand != token and rest.startswith(cand)]
            if taken:
                return candidates[token] - max(taken)
            best, second = (sorted(candidates.values(), reverse=True) + [float("-inf")])[:2]
            return best - second
        start += len(token)
    return float("inf")


def test_requests_together_equal_requests_alone(gemma_model: Path, servers, tmp_path: Path) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 8))
    solo = [alone(server, kind, traced(kind, fields)) for kind, fields in MIXED]
    idle(server)
    before = server.metrics()
    together: list[dict[str, Any] | None] = [None] * len(MIXED)

    def run(i: int) -> None:
        together[i] = send(server.client(), *MIXED[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(MIXED))]
    for thread in threads:
        thread.start()
    join_all(threads, "the mixed requests sent together", seconds=900)
    after = server.metrics()
    steps = 'sippcache_batched_steps_total{model="gemma"}'
    tokens = 'sippcache_batched_generated_tokens_total{model="gemma"}'
    assert after[steps] - before[steps] < (after[tokens] - before[tokens]) / 2  # tokens were decoded together
    flips = []
    for (_, fields), mine, got in zip(MIXED, solo, together, strict=True):
        assert got is not None and mine["text"], (fields, mine)
        if got["text"] == mine["text"]:
            assert got["finish"] == mine["finish"], (fields, mine, got)
            assert "usage" not in got or got["usage"] == mine["usage"], (fields, mine, got)
            continue
        margin = margin_at_divergence(mine, got["text"])
        assert margin < NEAR_TIE, (fields, mine["text"], got["text"], margin)  # only a near-tie may flip
        flips.append(margin)
    assert len(flips) <= 3, flips
    schema_bound = solo[3]  # the JSON schema holds: a JSON object, whole unless cut by max_tokens
    assert schema_bound["text"].lstrip().startswith("{"), schema_bound
    if schema_bound["finish"] == "stop":
        assert set(json.loads(schema_bound["text"])) == {"name", "age"}, schema_bound
    assert after['sippcache_requests_serialized_total{model="gemma",reason="prompt_logprobs"}'] == 2
    # Each request's TTFT is observed when the scheduler lets its job go, which may come just after the
    # client has read the last token.
    ttft = 'sippcache_time_to_first_token_seconds_count{model="gemma",path="batched"}'
    wait_for(lambda: server.metrics()[ttft] >= 2 * 15, "a TTFT observed for each of the 30 batched requests")


def test_no_request_sees_another_s_tokens(gemma_model: Path, servers, tmp_path: Path) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 4))
    words = ("ZEBRA", "MANGO", "ORBIT", "CEDAR", "FJORD", "LUPIN", "TANGO", "VIOLA")
    secrets = [f"{word}-{311 + 83 * i}" for i, word in enumerate(words)]
    prompts = [turn(f"The secret code is {secret}. What is the secret code?") for secret in secrets]
    client = server.client()
    alone = [
        client.completions.create(model="gemma", prompt=p, max_tokens=16, temperature=0).choices[0].text
        for p in prompts
    ]
    together: dict[int, str] = {}

    def run(i: int) -> None:
        stream = server.client().completions.create(
            model="gemma", prompt=prompts[i], max_tokens=16, temperature=0, stream=True
        )
        together[i] = "".join(chunk.choices[0].text for chunk in stream)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    join_all(threads, "the secret-code requests sent together", seconds=900)
    for i, secret in enumerate(secrets):
        others = [s for s in secrets if s != secret]
        assert not any(other in together[i] for other in others), (secret, together[i])
        assert together[i] == alone[i], (secret, together[i], alone[i])
    assert sum(secret in together[i] for i, secret in enumerate(secrets)) >= len(secrets) // 2


# -- faults and limits ---------------------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], what: str, bound: float = 120) -> None:
    """Wait until `condition()` holds (a liveness bound, not a speed assertion)."""
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


def gauge(server: Server, name: str) -> float:
    return server.metrics()[f'{name}{{model="gemma"}}']


def test_a_cancelled_stream_gives_its_slot_back(gemma_model: Path, servers, tmp_path: Path) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 2))
    client = server.client()
    long = turn(SYSTEM + "Write the whole log of day 40, hour by hour.")
    kept = client.completions.create(
        model="gemma", prompt=long, max_tokens=300, temperature=0, stream=True, logit_bias=NO_END
    )
    next(iter(kept))
    gone = client.completions.create(
        model="gemma", prompt=long + "Day 41.", max_tokens=300, temperature=0, stream=True, logit_bias=NO_END
    )
    for received, _ in enumerate(gone, start=1):
        if received == 3:
            break
    gone.close()  # the client hangs up
    wait_for(lambda: gauge(server, "sippcache_slots_busy") == 1, "the cancelled request's slot freed")
    text = "".join(chunk.choices[0].text for chunk in kept)
    assert text
    wait_for(lambda: gauge(server, "sippcache_slots_busy") == 0, "the other request finished")
    generated = gauge(server, "sippcache_batched_generated_tokens_total")
    assert 300 <= generated < 300 + 100, generated  # the cancelled one stopped early


def test_a_full_queue_answers_503_with_retry_after(gemma_model: Path, servers, tmp_path: Path) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 2, "--max_queue", "1"))
    client = server.client()
    long = turn(SYSTEM + "Write the whole log of day 40, hour by hour.")
    streams = [
        client.completions.create(model="gemma", prompt=long, max_tokens=200, temperature=0, stream=True)
        for _ in range(3)
    ]  # two run, one waits: the door is full
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="gemma", prompt=turn("Hello."), max_tokens=4)
    assert refused.value.status_code == 503
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body["code"] == "queue_full"  # type: ignore[index]
    for stream in streams:
        assert "".join(chunk.choices[0].text for chunk in stream)
    assert gauge(server, "sippcache_requests_rejected_total") == 1
    reply = client.completions.create(model="gemma", prompt=turn("Hello."), max_tokens=4)  # room again
    assert reply.choices[0].text


def test_a_prompt_too_long_for_a_slot_is_a_400_and_the_others_finish(
    gemma_model: Path, servers, tmp_path: Path
) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 2))
    client = server.client()
    running = client.completions.create(
        model="gemma",
        prompt=turn(SYSTEM + "Describe the sea."),
        max_tokens=64,
        temperature=0,
        stream=True,
        logit_bias=NO_END,
    )
    first = next(iter(running))
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="gemma", prompt="ship " * 1500, max_tokens=8)
    assert f"maximum context length is {SLOT_CTX} tokens" in str(refused.value)
    rest = list(running)
    assert rest[-1].choices[0].finish_reason == "length"
    assert first.choices[0].text + "".join(c.choices[0].text for c in rest)


def test_sigterm_lets_a_stream_finish_and_stores_it(gemma_model: Path, servers, tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/store"
    server = servers(parallel_args(gemma_model, url, 4))
    client = server.client()
    prompt = turn(SYSTEM + "Write the log of day 7.")
    stream = client.completions.create(
        model="gemma", prompt=prompt, max_tokens=48, temperature=0, stream=True, logit_bias=NO_END
    )
    chunks = [next(iter(stream))]
    os.killpg(server.process.pid, signal.SIGTERM)
    chunks += list(stream)
    answer = "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length" and answer
    assert server.process.wait(120) == 0
    again = servers(parallel_args(gemma_model, url, 4))
    before = again.model_stats()
    reply = again.client().completions.create(
        model="gemma", prompt=prompt + answer + "\nGo on.", max_tokens=4, temperature=0
    )
    after = again.model_stats()
    assert reply.choices[0].text
    assert after["tokens_reused"] - before["tokens_reused"] >= reply.usage.prompt_tokens - 16, (before, after)
    # ... and llama.cpp evaluated only what the stored stream did not hold.
    evaluated = after["prompt_tokens_evaluated"] - before["prompt_tokens_evaluated"]
    assert evaluated <= 16, (before, after)


def test_conversations_continue_warm_after_a_restart_and_on_a_second_server(
    gemma_model: Path, servers, tmp_path: Path
) -> None:
    url = f"lmdb://{tmp_path}/store"
    # A conversation keeping its slot is stored when the slot goes to another, on shutdown, and once the
    # server is idle: here at once, so that a second server sharing the store finds the first turns whole.
    first = servers(parallel_args(gemma_model, url, 4, "--save_idle", "0"))
    conversations = [Conversation(name) for name in "ABC"]
    threads = [threading.Thread(target=c.turn, args=(first, QUESTIONS[0]), daemon=True) for c in conversations]
    for thread in threads:
        thread.start()
    join_all(threads, "the first turns of three conversations", seconds=900)
    wait_for(lambda: first.model_stats()["stored_idle"] >= 3, "the three slots stored, idle")
    second = servers(parallel_args(gemma_model, url, 4))
    for conversation in conversations:
        first.settle()
        _, did = conversation.turn(second, QUESTIONS[1])
        assert_warm(conversation, did)
    first.stop()
    second.stop()
    third = servers(parallel_args(gemma_model, url, 4))
    for conversation in conversations:
        _, did = conversation.turn(third, QUESTIONS[2])
        assert_warm(conversation, did)


def test_streams_are_not_cut_unless_asked(gemma_model: Path, servers, tmp_path: Path) -> None:
    """Upstream's default (interrupt_requests on) ends a stream when another request
    comes, with no error and no finish reason; sippcache serve leaves it off unless set."""
    for parallel in ("1", "2"):
        server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store-{parallel}", int(parallel)))
        client = server.client()
        streams = [
            client.completions.create(
                model="gemma",
                prompt=turn(f"Count to {n}."),
                max_tokens=24,
                temperature=0,
                stream=True,
                logit_bias=NO_END,
            )
            for n in (10, 20, 30)
        ]
        for stream in streams:
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length", parallel
        server.stop()


def test_metrics_of_the_scheduler(gemma_model: Path, servers, tmp_path: Path) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 3))
    client = server.client()
    client.completions.create(model="gemma", prompt=turn(SYSTEM + "Hello."), max_tokens=8, temperature=0)
    idle(server)  # the request's job has left the engine: it is counted
    metrics = server.metrics()
    for name in (
        "sippcache_slots",
        "sippcache_requests_running",
        "sippcache_requests_queued",
        "sippcache_slots_busy",
        "sippcache_prompt_tokens_per_second",
        "sippcache_generated_tokens_per_second",
        "sippcache_requests_rejected_total",
        "sippcache_batched_prompt_tokens_total",
        "sippcache_batched_generated_tokens_total",
        "sippcache_batch_tokens_count",
    ):
        assert f'{name}{{model="gemma"}}' in metrics, name
    assert metrics['sippcache_slots{model="gemma"}'] == 3
    assert metrics['sippcache_batched_generated_tokens_total{model="gemma"}'] >= 8
    assert metrics['sippcache_time_per_output_token_seconds_count{model="gemma",path="batched"}'] == 1
    steps = metrics['sippcache_batch_tokens_count{model="gemma"}']
    for phase in ("decode", "sample"):  # every step's time, split where it goes
        assert metrics[f'sippcache_step_seconds_count{{model="gemma",phase="{phase}"}}'] == steps
        assert metrics[f'sippcache_step_seconds_sum{{model="gemma",phase="{phase}"}}'] > 0
    stats = server.model_stats()
    assert stats["parallel"] == 3 and stats["running"] == 0


def test_a_model_without_a_chat_template_gets_its_architecture_s_format(
    gemma_model: Path, servers, tmp_path: Path
) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 2))
    assert "using chat_format 'sippcache-gemma' for its architecture 'gemma3'" in server.log_tail()
    reply = server.client().chat.completions.create(
        model="gemma", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content  # llama-2's format (upstream's fallback) gets "" here
    assert_the_system_message_reaches_gemma(server)  # on the batched path (see test_serve.py for --parallel 1)


def test_a_client_gone_before_its_answer_gives_its_slot_back(gemma_model: Path, servers, tmp_path: Path) -> None:
    """Upstream never notices a client of a request that is not streamed hanging up: the
    answer is computed for nobody. Here the slot is freed at the next step."""
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 2))
    body = json.dumps(
        {
            "model": "gemma",
            "prompt": turn(SYSTEM + "Write the log of day 9."),
            "max_tokens": 400,
            "temperature": 0,
            "logit_bias": NO_END,
        }
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as connection:
        connection.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: gauge(server, "sippcache_batched_generated_tokens_total") >= 5, "the request generating")
    wait_for(lambda: gauge(server, "sippcache_slots_busy") == 0, "the slot freed")
    assert gauge(server, "sippcache_batched_generated_tokens_total") < 400 - 100


def test_interrupt_requests_when_asked_ends_the_oldest_stream_for_a_waiting_one(
    gemma_model: Path, servers, tmp_path: Path
) -> None:
    server = servers(parallel_args(gemma_model, f"lmdb://{tmp_path}/store", 2, "--interrupt_requests", "true"))
    client = server.client()

    def stream(n: int, max_tokens: int = 120) -> Any:
        return client.completions.create(
            model="gemma",
            prompt=turn(f"Count to {n}."),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            logit_bias=NO_END,
        )

    # The oldest may run far longer than the others: cut, it ends long before that, however slow
    # the machine is in sending the waiting request (with 120 tokens, it once ended first). It is
    # the oldest job once its first token is out: a response's headers come before its job is
    # submitted, so two requests sent back to back may start in either order (the other one was
    # then cut, and this one ran to its end: twice in full runs under load).
    oldest = stream(100, max_tokens=800)
    oldest_chunks = [next(iter(oldest))]
    other = stream(200)
    other_chunks = [next(iter(other))]
    waiting = stream(300)  # no slot: it waits, and the oldest stream is ended for it
    oldest_chunks += list(oldest)
    other_chunks += list(other)
    waiting_chunks = list(waiting)
    assert oldest_chunks[-1].choices[0].finish_reason is None  # cut, as upstream cuts (no finish reason)
    assert other_chunks[-1].choices[0].finish_reason == "length"
    assert waiting_chunks[-1].choices[0].finish_reason == "length"

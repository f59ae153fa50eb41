"""`sippcache serve` end to end: a real server process on 127.0.0.1, real HTTP, the
official `openai` client, the real gemma-3-270m model, real stores.

What is checked: answers from a warm cache are token-for-token those from an
empty one (greedy, seeded sampling, streaming, completions, prompt logprobs);
interleaved conversations reuse their earlier turns (read from /metrics);
a restarted server and a second server on the same store (LMDB, and Redis)
continue old conversations warm; a client hanging up mid-stream leaves the
server serving; a chat's system message reaches gemma (whose file has no chat
template: the server picks the format).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.servers import (
    QUESTIONS,
    SYSTEM,
    Conversation,
    Server,
    assert_the_system_message_reaches_gemma,
    assert_warm,
    briefed,
    delta,
    gemma_args,
)

pytestmark = pytest.mark.gemma

# -- the tests ------------------------------------------------------------------------------


def requests_of_every_kind(server: Server) -> dict[str, Any]:
    """Chat (plain, streamed, seeded sampling), completion, and prompt logprobs; what each answered."""
    client = server.client()
    out: dict[str, Any] = {}
    chat = [briefed("Name the first ship in the log.")]
    reply = client.chat.completions.create(model="gemma", messages=chat, temperature=0, max_tokens=16)
    out["chat"] = reply.choices[0].message.content
    streamed = [briefed("What was the weather on day 3?")]
    chunks = client.chat.completions.create(model="gemma", messages=streamed, temperature=0, max_tokens=16, stream=True)
    out["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    sampled = [briefed("Tell me about the keeper.")]
    reply = client.chat.completions.create(
        model="gemma", messages=sampled, temperature=0.9, top_p=0.95, seed=1234, max_tokens=16
    )
    out["chat_seeded"] = reply.choices[0].message.content
    asked = [briefed("Which flags are in the log?")]
    reply = client.chat.completions.create(
        model="gemma", messages=asked, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )
    out["chat_logprobs"] = [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in reply.choices[0].logprobs.content
    ]
    # Short: upstream computes prompt logprobs in pure Python (a sort of the vocabulary per token).
    prompt = "The keeper's log, day 12, at dawn: the schooner Eider passed the cape under a grey sky, and"
    completion = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=16)
    out["completion"] = completion.choices[0].text
    streamed_text = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=16, stream=True)
    out["completion_stream"] = "".join(c.choices[0].text for c in streamed_text)
    # The prompt's own logprobs (echo): same prompt as above, so a warm server has it cached.
    reply = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=4, echo=True, logprobs=2)
    out["echo_logprobs"] = reply.choices[0].logprobs.token_logprobs
    out["echo_text"] = reply.choices[0].text
    return out


def test_warm_answers_equal_empty_cache_answers(gemma_model: Path, servers, tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/store"
    cold_server = servers(gemma_args(gemma_model, url))
    cold = requests_of_every_kind(cold_server)
    cold_stats = cold_server.model_stats()
    assert all(cold[k] for k in ("chat", "chat_stream", "completion")), cold  # the model said something
    assert cold["completion_stream"] == cold["completion"]
    cold_server.stop()

    warm_server = servers(gemma_args(gemma_model, url))
    warm = requests_of_every_kind(warm_server)
    stats = warm_server.model_stats()
    assert warm == cold  # token for token, logprobs bit for bit
    assert stats["hits"] >= 5 and stats["tokens_reused"] > cold_stats["tokens_reused"] + 3 * 150, (cold_stats, stats)
    # Each repeated prompt was answered from its stored logits, evaluating nothing,
    # except the prompt-logprobs request, which is evaluated in full on purpose.
    echo_prompt_tokens = len(cold["echo_logprobs"]) - 4
    assert stats["logits_hits"] >= 5 and stats["tokens_evaluated"] <= echo_prompt_tokens + 4, stats
    assert "/v1/cache/stats" in json.loads(warm_server.get("/openapi.json"))["paths"]  # /docs keeps working


def test_interleaved_conversations_reuse_earlier_turns_and_survive_a_restart(
    gemma_model: Path, servers, tmp_path: Path
) -> None:
    url = f"lmdb://{tmp_path}/store"
    server = servers(gemma_args(gemma_model, url))
    conversations = [Conversation(name) for name in "ABC"]
    for round_, question in enumerate(QUESTIONS[:3]):
        for conversation in conversations:
            _, did = conversation.turn(server, question)
            if round_ > 0:
                assert_warm(conversation, did)
    metrics = server.metrics()
    assert metrics['sippcache_hits_total{model="gemma"}'] >= 6
    assert metrics['sippcache_tokens_reused_total{model="gemma"}'] > 6 * 150
    assert metrics['sippcache_restore_seconds_count{model="gemma"}'] >= 6
    # A's next turn, before the restart: the reference for the same turn after it.
    a, b = conversations[0], conversations[1]
    a.turn(server, QUESTIONS[3])
    server.stop()

    server = servers(gemma_args(gemma_model, url))
    # B's next turn was never asked: served warm from what the first server stored.
    _, did = b.turn(server, QUESTIONS[3])
    assert_warm(b, did)
    # A's fourth turn again on the new server: the answer given before the restart,
    # with everything but the prompt's last token restored.
    before = server.model_stats()
    reply = server.client().chat.completions.create(
        model="gemma", messages=a.messages[:-1], temperature=0, max_tokens=12
    )
    did = delta(before, server.model_stats(), "tokens_reused", "tokens_evaluated")
    assert reply.choices[0].message.content == a.answers[-1]
    assert did["tokens_reused"] >= a.prompt_tokens[-1] - 2 and did["tokens_evaluated"] <= 2, did


def test_two_servers_share_one_lmdb_store(gemma_model: Path, servers, tmp_path: Path) -> None:
    url = f"lmdb://{tmp_path}/store"
    first, second = servers(gemma_args(gemma_model, url)), servers(gemma_args(gemma_model, url))
    continue_across(first, second)


def test_two_servers_share_one_redis(gemma_model: Path, servers, tmp_path: Path) -> None:
    import sippcache

    info = sippcache.backends().get("redis")
    assert info is not None and info.usable, (
        "the sippcache-redis plugin is not installed (the test command installs it)"
    )
    from sippcache_redis.servers import ValkeyServer

    with ValkeyServer(tmp_path / "valkey") as valkey:
        url = valkey.url + "?prefix=serve-test"
        first, second = servers(gemma_args(gemma_model, url)), servers(gemma_args(gemma_model, url))
        continue_across(first, second)


def continue_across(first: Server, second: Server) -> None:
    """A conversation started on one server continues warm on the other, and back."""
    conversation = Conversation("shared")
    conversation.turn(first, QUESTIONS[0])
    conversation.turn(first, QUESTIONS[1])
    first.settle()
    _, did = conversation.turn(second, QUESTIONS[2])
    assert_warm(conversation, did)
    second.settle()
    _, did = conversation.turn(first, QUESTIONS[3])
    assert_warm(conversation, did)


def test_client_hanging_up_mid_stream_leaves_the_server_serving(gemma_model: Path, servers, tmp_path: Path) -> None:
    server = servers(gemma_args(gemma_model, f"lmdb://{tmp_path}/store"))
    client = server.client()
    prompt = SYSTEM + "\nWrite the whole log of day 40, hour by hour:"
    stream = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=400, stream=True)
    for received, _ in enumerate(stream, start=1):
        if received == 3:
            break
    stream.close()  # hang up
    reply = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=8)
    assert reply.choices[0].text
    reference = client.completions.create(model="gemma", prompt=prompt, temperature=0, max_tokens=8)
    assert reply.choices[0].text == reference.choices[0].text
    assert server.process.poll() is None
    assert server.metrics()  # and /metrics still answers


def test_a_system_message_reaches_gemma(gemma_model: Path, servers, tmp_path: Path) -> None:
    """The gemma file has no chat template: the format the server picks keeps a system
    message, one request at a time (``--parallel 1``, upstream's code path) as batched
    (tests/test_serve_parallel.py)."""
    server = servers(gemma_args(gemma_model, f"lmdb://{tmp_path}/store"))
    assert "using chat_format 'sippcache-gemma' for its architecture 'gemma3'" in server.log_tail()
    assert_the_system_message_reaches_gemma(server)

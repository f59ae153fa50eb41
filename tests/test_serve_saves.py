"""When `sippcache serve --parallel N` stores states: by `SessionPool`'s rule, not after
every request. Real server processes on the tiny generated model, real HTTP.

A conversation that keeps its slot writes one entry for its first turn (a prompt the
store held nothing of: other processes want it now) and nothing for its later turns;
a clean stop (SIGINT, SIGTERM) stores what its slot holds, so a new process continues
it evaluating only the new question; an idle server stores its slots after
``--save_idle`` seconds, so a process killed outright after that loses nothing. Reuse
is read from what llama.cpp evaluated (the engine's ``prompt_tokens_evaluated``), not
from what the cache handed over. Every answer is that of a plain `llama_cpp.Llama`
evaluating the whole prompt (the never-cached path; the tiny model's weights are
float32, so batching changes no token). Waits are bounded polls, never timed
assertions.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest

import sippcache
from harness.servers import Server
from sippcache.llama import CacheOptions
from sippcache.llama.batch import BatchEngine, Job
from sippcache.llama.fingerprint import llama_fingerprint
from sippcache.llama.pool import Sampling
from sippcache.llama.seqcache import SequenceCache
from sippcache.llama.states import MemoryKind
from sippcache.server.settings import ModelOptions, ServeError
from sippcache.state import chunkentries

SLOT_CTX = 512
MAX_TOKENS = 16
#: Greedy answers of lower-case letters (one byte token each, so an answer's text is its
#: tokens and a next turn's prompt extends the slot's sequence), never an end of generation.
LETTERS = {3 + ord(letter): 50.0 for letter in "abcdefghijklmnopqrstuvwxyz"}
BIAS = {2: -100.0, **LETTERS}
#: Every field that changes what is sampled, the same for the server and the reference.
SAMPLING = {"temperature": 0, "repeat_penalty": 1.1, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
SYSTEM = "The keeper writes the log of the lighthouse on the northern cape every hour. " * 3


def serve(servers: Callable[..., Server], model: Path, store: str, *extra: str) -> Server:
    """A tiny-model server with two slots on `store` (`--save_idle` as `extra` says, else
    600 s: never during a test)."""
    idle = [] if "--save_idle" in extra else ["--save_idle", "600"]
    args = ["--model", str(model), "--model_alias", "tiny", "--n_ctx", str(SLOT_CTX), "--cache", store]
    return servers([*args, "--parallel", "2", *idle, *extra])


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Iterator[Callable[[str], str]]:
    """The never-cached answer to a prompt: a plain `llama_cpp.Llama` (flash attention on,
    as the server runs ``--parallel``), no cache, the whole prompt evaluated."""
    llm = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=SLOT_CTX, flash_attn=True, verbose=False)

    def answer(prompt: str) -> str:
        llm.reset()
        reply: Any = llm.create_completion(prompt, max_tokens=MAX_TOKENS, logit_bias=BIAS, **SAMPLING)
        return str(reply["choices"][0]["text"])

    yield answer
    llm.close()


class Chat:
    """A conversation on the completions endpoint: each turn's prompt is the last one,
    its answer and a new question."""

    def __init__(self, name: str) -> None:
        self.prompt = f"{SYSTEM}This is conversation {name}. Question 1:"
        self.turns = 0
        self.usage: list[tuple[int, int]] = []  # (prompt tokens, completion tokens) per turn

    def ask(self, server: Server, reference: Callable[[str], str]) -> dict[str, float]:
        """One turn; what the server did for it (deltas of its counters). Its answer must be
        the never-cached one."""
        if self.turns:
            self.prompt += f" Question {self.turns + 1}:"
        before = server.model_stats()
        reply = server.client().completions.create(
            model="tiny",
            prompt=self.prompt,
            max_tokens=MAX_TOKENS,
            logit_bias={str(token): bias for token, bias in BIAS.items()},
            temperature=SAMPLING["temperature"],
            top_p=SAMPLING["top_p"],
            extra_body={name: SAMPLING[name] for name in ("repeat_penalty", "top_k", "min_p")},
        )
        answer = reply.choices[0].text
        assert answer == reference(self.prompt), (self.turns, answer)
        assert reply.choices[0].finish_reason == "length" and len(answer) == MAX_TOKENS, answer
        self.usage.append((reply.usage.prompt_tokens, reply.usage.completion_tokens))
        self.prompt += answer
        self.turns += 1
        server.settle()
        after = server.model_stats()
        return {key: after[key] - before[key] for key in ("entries_written", "prompt_tokens_evaluated", "hits")}

    def new_tokens(self) -> int:
        """Prompt tokens of the last turn that the turn before it did not hold (its prompt
        and answer): the question added."""
        (previous, answered), (now, _) = self.usage[-2], self.usage[-1]
        return now - previous - answered


def wait_for(condition: Callable[[], bool], what: str, bound: float = 120) -> None:
    """Wait until `condition()` holds (a liveness bound, not a speed assertion)."""
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_conversation_keeping_its_slot_is_stored_once_and_on_a_clean_stop(
    tiny_model: Path, servers, tmp_path: Path, reference: Callable[[str], str], stop: str
) -> None:
    store = f"lmdb://{tmp_path}/store"
    server = serve(servers, tiny_model, store)
    chat = Chat("A")
    first = chat.ask(server, reference)
    assert first["entries_written"] == 1, first  # the new prompt's end, with its logits: others may want it
    for _ in range(3):
        later = chat.ask(server, reference)
        assert later["entries_written"] == 0, later  # nothing per turn while the conversation keeps its slot
        assert later["prompt_tokens_evaluated"] <= chat.new_tokens() + 1, (later, chat.usage)
    stats = server.model_stats()
    assert stats["entries_written"] == 1 and stats["parked"] == 0 and stats["stored_idle"] == 0, stats

    if stop == "SIGINT":
        assert server.stop() == 0  # as `Server.stop()` always stops them: SIGINT, uvicorn's graceful shutdown
    else:
        os.killpg(server.process.pid, signal.SIGTERM)
        assert server.process.wait(120) == 0

    again = serve(servers, tiny_model, store)
    did = chat.ask(again, reference)
    # The last turn's state came from the store: llama.cpp evaluated only the new question (and the
    # last answer token, sampled but never evaluated), not the three turns since the first was stored.
    assert did["hits"] == 1 and did["prompt_tokens_evaluated"] <= chat.new_tokens() + 1, (did, chat.usage)


def test_an_idle_server_stores_its_slots_so_a_crash_after_loses_nothing(
    tiny_model: Path, servers, tmp_path: Path, reference: Callable[[str], str]
) -> None:
    store = f"lmdb://{tmp_path}/store"
    server = serve(servers, tiny_model, store, "--save_idle", "1")
    chat = Chat("B")
    chat.ask(server, reference)
    wait_for(lambda: server.model_stats()["stored_idle"] >= 1, "the idle slot stored")
    server.settle()
    stats = server.model_stats()
    # The prompt's end at once (a new prompt), then, idle, the sequence its answer extends.
    assert stats["stored_idle"] == 1 and stats["entries_written"] == 2, stats

    did = chat.ask(server, reference)  # the slot goes on from its prompt end and the stored answer
    assert did["prompt_tokens_evaluated"] <= chat.new_tokens() + 1, (did, chat.usage)
    wait_for(lambda: server.model_stats()["stored_idle"] >= 2, "the idle slot stored again")
    server.settle()
    os.killpg(server.process.pid, signal.SIGKILL)  # no shutdown: only what the idle store left
    server.process.wait(60)

    again = serve(servers, tiny_model, store)
    did = chat.ask(again, reference)
    assert did["hits"] == 1 and did["prompt_tokens_evaluated"] <= chat.new_tokens() + 1, (did, chat.usage)


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_chunk_tokens_sets_how_the_server_stores_states(
    tiny_model: Path, servers, tmp_path: Path, reference: Callable[[str], str], chunk_tokens: int
) -> None:
    """``--chunk_tokens C``: states stored in chunks of C tokens (0: whole), and a restarted
    server continues from them either way."""
    store = f"lmdb://{tmp_path}/store"
    server = serve(servers, tiny_model, store, "--chunk_tokens", str(chunk_tokens))
    chat = Chat("C")
    chat.ask(server, reference)
    assert server.stop() == 0
    with sippcache.open(store) as cache:
        spaces = {e.namespace for e in cache.entries()}
    sizes = {parts[1] for ns in spaces if (parts := chunkentries.chunk_namespace_parts(ns)) is not None}
    assert sizes == ({chunk_tokens} if chunk_tokens else set()) and len(spaces) == len(sizes) + 1, spaces

    again = serve(servers, tiny_model, store, "--chunk_tokens", str(chunk_tokens))
    did = chat.ask(again, reference)
    assert did["hits"] == 1 and did["prompt_tokens_evaluated"] <= chat.new_tokens() + 1, (did, chat.usage)


@pytest.mark.parametrize(
    ("name", "value"),
    [("chunk_tokens", -1), ("chunk_tokens", 1.5), ("chunk_tokens", True), ("prefill_chunk", 48), ("parallel", 0)],
)
def test_model_options_refuse_what_they_cannot_use(name: str, value: object) -> None:
    with pytest.raises(ServeError, match=name):
        ModelOptions(**{name: value})  # type: ignore[arg-type]


# -- the engine's side: `BatchEngine.store_unsaved` ------------------------------------------------


def test_store_unsaved_stores_a_slot_once_and_keeps_its_conversation(tiny_model: Path, tmp_path: Path) -> None:
    """What the scheduler calls once idle: the slot's sequence and its unsaved prompt end
    (with logits) go to the store; the slot keeps its conversation, whose next turn gives
    the tokens it gives alone; a second call has nothing to store."""
    llm = llama_cpp.Llama(model_path=str(tiny_model), n_ctx=256, n_batch=512, verbose=False)
    made: list[tuple[BatchEngine, SequenceCache]] = []
    chains: list[Any] = []

    def engine_on(url: str, slots: int) -> BatchEngine:
        cache = SequenceCache(
            url,
            fingerprint=llama_fingerprint(llm),
            kind=MemoryKind(),
            n_vocab=llm.n_vocab(),
            options=CacheOptions(scope="test"),
        )
        made.append((BatchEngine(llm, cache, slots=slots, n_ctx=slots * 1024), cache))
        return made[-1][0]

    def run(engine: BatchEngine, tokens: list[int], max_new: int = 6) -> Job:
        chains.append(Sampling().chain(llm.n_vocab()))
        job = Job(tokens, chains[-1], max_new)
        engine.submit(job)
        while engine.busy:
            engine.step()
        return job

    try:
        engine = engine_on(f"lmdb://{tmp_path}/store", 1)  # one slot: every turn in it
        rng = np.random.default_rng(3)
        first = run(engine, [1, *rng.integers(3, 259, 120).tolist()])
        assert engine.unstored == 1  # its answer: the prompt's end was stored at once (a new prompt)
        second = run(engine, first.prompt + first.generated + rng.integers(3, 259, 20).tolist())
        # The conversation kept its slot (nothing parked, nothing restored); its new prompt end waits there.
        assert second.reused == len(first.prompt) + len(first.generated) - 1 and not second.logits_from_store
        assert engine.counters["parked"] == 0 and engine.counters["admitted_warm"] == 0 and engine.unstored == 1
        assert engine.store_unsaved() == 1 and engine.unstored == 0 and engine.store_unsaved() == 0
        engine.cache.flush()
        whole = second.prompt + second.generated[:-1]  # the last token is sampled, not evaluated
        for key in (whole, second.prompt):
            found = engine.cache.peek(key, partial=False)
            assert found is not None and found.length == len(key)
        third = run(engine, whole + second.generated[-1:] + rng.integers(3, 259, 20).tolist())
        assert third.reused >= len(whole)
        assert run(engine_on("ram://", 1), third.prompt).generated == third.generated  # as alone
    finally:
        for engine, cache in made:
            engine.free()
            cache.close()
        for chain in chains:
            llama_cpp.llama_sampler_free(chain)
        llm.close()


def test_a_completion_ends_its_job_with_its_answer_however_late_its_reader(tiny_model: Path, tmp_path: Path) -> None:
    """A `--parallel` request's job ends where upstream's completion stops reading (its
    ``max_tokens``), not when the request's thread closes the token stream: a reader late by any
    amount leaves its slot, and what a stop stores of it, holding the prompt and the answer only.

    Before, the engine went on sampling tokens nobody read until the thread came round, as many as
    its lateness allowed (a loaded machine), and the slot held them: what a clean stop or an idle
    store kept, and where the next turn's computation started after a restart, depended on timing.
    Once, in the full suite, the first answer after a SIGTERM restart parted from the never-cached
    one (llama.cpp's logits move by a few thousandths with where a prompt's evaluation is split:
    a near tie flipped). Here the reader sleeps after every token, so the old engine ran far ahead."""
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from sippcache.server.settings import Settings
    from sippcache.server.stores import CachePool
    from sippcache.server.upstream import CachingLlamaProxy, LlamaProxy, install

    store = f"lmdb://{tmp_path}/store"
    settings = ModelSettings(model=str(tiny_model), model_alias="t", n_ctx=SLOT_CTX, verbose=False)
    pool = CachePool.open(Settings(ServerSettings(), [settings], {"t": ModelOptions(parallel=2)}), store)
    install(pool)
    proxy = CachingLlamaProxy([settings])
    prompt = f"{SYSTEM}This is conversation L. Question 1:"
    try:
        pieces = []
        stream = proxy("t").create_completion(prompt, stream=True, max_tokens=MAX_TOKENS, logit_bias=BIAS, **SAMPLING)
        for chunk in stream:
            pieces.append(chunk["choices"][0]["text"])
            time.sleep(0.05)  # the engine's own step takes about a millisecond here
        heard = proxy("t").tokenize((prompt + "".join(pieces)).encode())
    finally:
        import llama_cpp.server.app as app

        app.LlamaProxy = LlamaProxy
        proxy.free()  # its scheduler parks both slots in the store, as a stop does
        pool.close()
    with sippcache.open(store) as cache:
        keys = [e.key for e in cache.entries() if chunkentries.chunk_namespace_parts(e.namespace) is None]
    # Stored: the prompt's end (a new prompt) and, parked, the slot: the prompt and the answer but
    # its last token (sampled, never evaluated). Nothing beyond what the reader heard.
    assert sorted(map(len, keys)) == [len(heard) - MAX_TOKENS, len(heard) - 1], (len(heard), keys)
    assert all(tuple(heard[: len(key)]) == key for key in keys)

"""Every memory kind, exactly, with real reuse: full attention, sliding window (iSWA),
recurrent (Mamba) and hybrid (Jamba: Mamba + attention layers).

Each kind gets a tiny generated model (harness/tinymodel.py). A recurrent state is one
cell at the sequence's last position: llama.cpp cannot cut it back, so a state is
used only at exactly the length it was stored, and shared between sequences only
whole (`sippcache.llama.states.MemoryKind`). For each kind: an exact repeat in a new
process, an extension, a divergence, the drop-in `LlamaCache` on a plain
`llama_cpp.Llama` (bound and unbound), `SessionPool` (a parked session back, a turn
continued, a shared prefix borrowed between slots). Logits are compared with a
never-cached `Llama` evaluating the same batch split, and reuse is counted from what
llama.cpp evaluated (`llama_perf_context`), not from what was handed over.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sippcache
from harness.llama_tools import last_logits, prefill_in_new_process, reference_logits, start_counting, tokens_evaluated
from harness.tinymodel import ARCHITECTURES, N_SWA, write_tiny_model
from sippcache.llama import Llama, LlamaCache, PrefixCache, SessionPool, states

KINDS = tuple(ARCHITECTURES)
#: Logits of a batched step against a sequence alone: float32 rounding of other batch shapes.
TINY_TOLERANCE = 1e-3
#: The same in a pool that loads the model (flash attention on, its default), where two
#: sessions batched together are compared with one alone (measured: at most 6.7e-3, under
#: 1e-3 with flash attention off).
POOL_BATCHED_TOLERANCE = 2e-2
#: A restored sliding-window state against a live one: the window's cells land elsewhere
#: in the KV buffer, so attention sums in another order (measured: at most 1.5e-6).
SWA_RESTORE_TOLERANCE = 1e-5


def assert_same_logits(
    kind: str, actual: np.ndarray, expected: np.ndarray, swa_atol: float = SWA_RESTORE_TOLERANCE
) -> None:
    """Bit for bit; for a restored sliding-window state, within float summation noise
    (`swa_atol`: it grows with each token generated after the restore) and the same argmax."""
    if kind == "swa":
        np.testing.assert_allclose(actual, expected, rtol=0, atol=swa_atol)
        assert int(np.argmax(actual)) == int(np.argmax(expected))
    else:
        np.testing.assert_array_equal(actual, expected)


@pytest.fixture(scope="session", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def model(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model of `kind`, written once per test session."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / f"{kind}.gguf", kind=kind)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path}/cache"


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def prefill(llm: Any, cache: PrefixCache, tokens: list[int]) -> tuple[int, int]:
    """(tokens the prefill says it reused, tokens llama.cpp evaluated for it)."""
    start_counting(llm.ctx)
    reused = int(cache.prefill(tokens))
    return reused, tokens_evaluated(llm.ctx)


def test_each_model_is_the_kind_it_says(make_llama, kind, model) -> None:
    memory = states.MemoryKind.of(make_llama(model).model)
    assert memory.name == kind
    assert memory.exact_length_only is (kind in ("recurrent", "hybrid"))
    assert memory.n_swa == (N_SWA if kind == "swa" else 0)


def test_exact_repeat_in_a_new_process(make_llama, kind, model, url) -> None:
    """The second process restores the prompt minus its last token (a plain `Llama`
    evaluates that one), on every kind: 299 tokens reused, 1 evaluated, the entry
    neither refused nor written again, and the logits of a never-cached context
    split the same way, bit for bit."""
    tokens = prompt(300)
    _, split = reference_logits(make_llama, model, tokens)
    first = prefill_in_new_process(model, url, tokens)
    entries = sorted((e.namespace, e.key, e.created) for e in sippcache.open(url).entries())
    reused, logits, evaluated = prefill_in_new_process(model, url, tokens)
    assert (first[0], first[2]) == (0, 300)
    assert (reused, evaluated) == (299, 1)
    assert_same_logits(kind, logits, split)
    # No refusal, no churn (the same entries, none written again; a restore reorders their recency).
    assert sorted((e.namespace, e.key, e.created) for e in sippcache.open(url).entries()) == entries


def test_exact_repeat_with_stored_logits_evaluates_nothing(make_llama, model, url) -> None:
    """`sippcache.llama.Llama` stores the whole prompt with its logits: a repeat in a fresh
    context restores it at exactly its length and evaluates nothing."""
    tokens = prompt(300)
    with PrefixCache(make_llama(model, cls=Llama), url) as pc:
        pc.prefill(tokens)
        expected = pc.llm.current_logits()
    llm = make_llama(model, cls=Llama)
    with PrefixCache(llm, url) as pc:
        assert prefill(llm, pc, tokens) == (300, 0)
        assert pc.stats()["logits_hits"] == 1 and pc.stats()["rejected_entries"] == 0
        np.testing.assert_array_equal(llm.current_logits(), expected)


def test_extension_restores_the_stored_prompt_and_evaluates_the_rest(make_llama, kind, model, url) -> None:
    tokens = prompt(300)
    longer = tokens + prompt(100, seed=1)
    with PrefixCache(make_llama(model), url) as pc:
        pc.prefill(tokens)  # stores tokens[:-1]
    llm = make_llama(model)
    with PrefixCache(llm, url) as pc:
        assert prefill(llm, pc, longer) == (299, 101)
        assert pc.stats()["tokens_reused"] == 299 and pc.stats()["tokens_evaluated"] == 101
    _, split = reference_logits(make_llama, model, longer, splits=(299,))
    assert_same_logits(kind, last_logits(llm), split)


def test_divergence(make_llama, kind, model, url) -> None:
    """B shares 150 tokens with A, then C shares the same 150. Full attention cuts A's
    restored state back to 150 at once. A sliding window (after a restore), a recurrent
    or a hybrid state cannot be cut there: B is a miss that says why (`refused_cut`)
    and stores a checkpoint where it leaves A (rounded down to 128). C follows B in the
    same context: full attention and a live (never restored) sliding-window context
    keep the 150 tokens they share; a recurrent or hybrid context cannot go back, and
    restores the checkpoint at exactly its length."""
    shared = prompt(150)
    a, b, c = (shared + prompt(150, seed=seed) for seed in (1, 2, 3))
    llm = make_llama(model)
    exact_length_only = kind in ("recurrent", "hybrid")
    with PrefixCache(make_llama(model), url) as pc:
        pc.prefill(a)
    with PrefixCache(llm, url) as pc:
        assert prefill(llm, pc, b) == ((150, 150) if kind == "attention" else (0, 300))
        assert pc.stats()["refused_cut"] == (0 if kind == "attention" else 1)
        pc.flush()
        reused = 128 if exact_length_only else 150
        assert prefill(llm, pc, c) == (reused, 300 - reused)
        assert pc.stats()["tokens_reused"] == (150 if kind == "attention" else 128 if exact_length_only else 0)
        assert pc.stats()["refused_positions"] == pc.stats()["refused_load"] == 0
    _, split = reference_logits(make_llama, model, c, splits=(reused,))
    assert_same_logits(kind, last_logits(llm), split)


def complete(llm: Any, tokens: list[int]) -> dict[str, Any]:
    """A greedy completion: its text, the prompt tokens llama.cpp evaluated for it (all it
    evaluated but the generated tokens the context holds), its last logits and what the
    context holds afterwards."""
    start_counting(llm.ctx)
    out = llm.create_completion(tokens, max_tokens=6, temperature=0.0)
    held = [int(t) for t in llm.input_ids[: llm.n_tokens]]
    return {
        "text": out["choices"][0]["text"],
        "prompt_evaluated": tokens_evaluated(llm.ctx) - (len(held) - len(tokens)),
        "logits": last_logits(llm),
        "held": held,
    }


def test_bound_drop_in_on_a_plain_llama(make_llama, kind, model, url) -> None:
    """`LlamaCache(url).bind(llm)` on a plain `llama_cpp.Llama`: a repeat in a fresh model
    restores the prompt minus one token and evaluates that token and the answer, and
    answers as the first (uncached) run did; the stats count what was not evaluated."""
    tokens = prompt(300)
    first_llm = make_llama(model)
    first_llm.set_cache(LlamaCache(url).bind(first_llm))
    first = complete(first_llm, tokens)
    first_llm.cache.flush()
    never = complete(make_llama(model), tokens)
    llm = make_llama(model)
    cache = LlamaCache(url).bind(llm)
    llm.set_cache(cache)
    again = complete(llm, tokens)
    assert again["text"] == first["text"] == never["text"]
    assert_same_logits(kind, again["logits"], first["logits"], swa_atol=TINY_TOLERANCE)  # after 10 tokens generated
    np.testing.assert_allclose(again["logits"], never["logits"], atol=TINY_TOLERANCE)
    assert (first["prompt_evaluated"], again["prompt_evaluated"]) == (300, 1)
    stats = cache.stats()
    assert (stats["tokens_reused"], stats["tokens_evaluated"]) == (299, 1)
    cache.close()


def test_unbound_drop_in_counts_only_what_llama_cpp_python_keeps(make_llama, kind, model, url) -> None:
    """Unbound, the cache hands llama-cpp-python whole-context states, as `LlamaRAMCache`
    does. A prompt that extends the stored state needs no cut: every kind keeps it, and
    it counts as reused. An exact repeat needs a cut: full attention and a sliding
    window (whose whole state holds every cell) keep the prompt minus one token, a
    recurrent or hybrid model cannot and evaluates it all; either way it counts as
    `tokens_offered`, never as reused. The text is the never-cached run's every time."""
    tokens = prompt(300)
    llm = make_llama(model)
    cache = LlamaCache(url)
    llm.set_cache(cache)  # llama_cpp.Llama.set_cache only assigns it: unbound
    first = complete(llm, tokens)
    held = first["held"]
    for text, expect_evaluated in (
        (tokens, 300 if kind in ("recurrent", "hybrid") else 1),
        (held + prompt(50, seed=4), 50),
    ):
        before = cache.stats()
        fresh = make_llama(model)
        fresh.set_cache(cache)
        done = complete(fresh, text)
        assert done["text"] == complete(make_llama(model), text)["text"]
        prompt_evaluated = done["prompt_evaluated"]
        assert prompt_evaluated == expect_evaluated
        reused = cache.stats()["tokens_reused"] - before["tokens_reused"]
        assert reused <= len(text) - prompt_evaluated  # never more than llama.cpp skipped
    assert cache.stats()["tokens_reused"] == len(held)  # the extension
    assert cache.stats()["tokens_offered"] == 299  # the repeat
    cache.close()


def pool(model: Path, url: str, **kwargs: Any) -> SessionPool:
    return SessionPool(model, url, slots=2, n_ctx=2048, **kwargs)


def test_session_pool_repeat_extension_and_reuse(model, url) -> None:
    """A session parked by one pool comes back warm in a new one with its logits (nothing
    evaluated); its next turn continues its live sequence (the slot holds exactly the
    turn so far, which even a recurrent state can extend); each answer is the one a
    fresh pool with an empty cache gives."""
    tokens = prompt(300)
    with pool(model, url) as first:
        cold = first.generate({"a": tokens}, max_tokens=4)["a"]
    with pool(model, url) as second:
        engine_ctx = second._engine.ctx  # type: ignore[union-attr]
        start_counting(engine_ctx)
        warm = second.generate({"a": tokens}, max_tokens=4)["a"]
        assert (warm.admitted, warm.reused, warm.evaluated, warm.logits_from_store) == ("warm", 300, 0, True)
        assert warm.tokens == cold.tokens
        assert tokens_evaluated(engine_ctx) == 3  # the answer's tokens but the last: no prompt token
        turn = tokens + warm.tokens + prompt(40, seed=5)
        start_counting(engine_ctx)
        live = second.generate({"a": turn}, max_tokens=4)["a"]
        assert (live.admitted, live.reused) == ("live", 303)
        assert tokens_evaluated(engine_ctx) == len(turn) - 303 + 3
        assert second.stats()["rejected_entries"] == 0
    with pool(model, "ram://") as fresh:
        assert fresh.generate({"a": turn}, max_tokens=4)["a"].tokens == live.tokens


def test_session_pool_shares_a_prefix_between_slots(kind, model) -> None:
    """Two sessions starting with the same 200 tokens, in one call on an empty cache: the
    second borrows the first's evaluation of them (`llama_memory_seq_cp`). A recurrent
    or hybrid state is shared only whole, so the first stops at 192 (a multiple of 32)
    for the second to take; the answers and logits are each session's alone."""
    system = prompt(200)
    x, y = system + prompt(60, seed=6), system + prompt(60, seed=7)
    with pool(model, "ram://") as together:
        both = together.generate({"x": x, "y": y}, max_tokens=4, logits=True)
        borrowed = together.stats()["borrowed_tokens"]
    assert borrowed == (192 if kind in ("recurrent", "hybrid") else 200)
    assert both["y"].admitted == "shared"
    for session, tokens in (("x", x), ("y", y)):
        with pool(model, "ram://") as solo:
            alone = solo.generate({session: tokens}, max_tokens=4, logits=True)[session]
        assert both[session].tokens == alone.tokens
        for row, expected in zip(both[session].logits, alone.logits, strict=True):  # type: ignore[arg-type]
            np.testing.assert_allclose(row, expected, atol=POOL_BATCHED_TOLERANCE)


def test_serve_parallel_repeats_in_a_new_server(servers, kind, model, tmp_path) -> None:
    """`sippcache serve --parallel 2` on each kind: the same two completions, sent together
    to one server and then to a new one on the same store, answer the same, and the new
    server evaluates no prompt token (both come back with their stored logits); /metrics
    shows the refusals by reason (none here)."""
    url = f"lmdb://{tmp_path}/store"
    args = ["--model", str(model), "--model_alias", "tiny", "--n_ctx", "1024", "--cache", url, "--parallel", "2"]
    texts = [" ".join(f"line {i} of the log, word {seed}" for i in range(12)) for seed in (1, 2)]

    def run(server: Any) -> list[str]:
        client = server.client()
        answers: list[str] = [""] * len(texts)

        def one(i: int) -> None:
            answers[i] = (
                client.completions.create(model="tiny", prompt=texts[i], max_tokens=6, temperature=0).choices[0].text
            )

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        return answers

    first = servers(args)
    cold = run(first)
    first.stop()
    second = servers(args)
    warm = run(second)
    stats = second.model_stats()
    assert warm == cold
    assert (stats["logits_hits"], stats["tokens_evaluated"], stats["rejected_entries"]) == (2, 0, 0), stats
    metrics = second.metrics()
    assert all(
        metrics[f'sippcache_refused_entries_total{{model="tiny",reason="{r}"}}'] == 0 for r in states.REFUSAL_REASONS
    )

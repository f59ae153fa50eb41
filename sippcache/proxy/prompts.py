"""A chat's prompt tokens, tokenized only past the prompt text the proxy tokenized last time.

The proxy needs a chat's tokens to pick a slot and a stored state; llama-server tokenizes the
chat's text again as it runs it (a chat request has no token-id form). At 30K tokens of gemma-3
the proxy's two token calls added 87 ms to a chat's next turn, outside llama-server's prompt
processing (`python -m benchmarks.probes.prompt_ids`). A conversation's next prompt text begins with its last
one (the template renders the earlier turns the same way, then the answer and the new
message), so that prompt's tokens are kept and only the new text is tokenized, with the last
few tokens before it (a merge across the seam: a turn's closing "\n" and an answer's "\n\n").

Two tokenizations joined are not always the one llama-server makes of the whole: a tokenizer
may add a space before a text it starts (SentencePiece's space prefix) or a token after it
(an EOS). A probe finds those at the first chat; where it fails, every prompt is tokenized
whole. A difference left is harmless: these tokens never reach llama-server, which compares
its own with what a slot holds, so a different token costs reuse past it, never a wrong answer.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from .upstream import Upstream

__all__ = ["KNOWN_PROMPTS", "MIN_KNOWN_CHARS", "RETOKENIZED", "KnownPrompts"]

#: Prompt texts kept with their tokens (each up to a slot's context: 32K tokens are about
#: 150 KB of text and 128 KB of tokens).
KNOWN_PROMPTS = 32
#: A text shorter than this is tokenized whole, and not kept: tokenizing it costs little.
MIN_KNOWN_CHARS = 2048
#: The last tokens of a known text tokenized again with the text after it: a tokenizer may merge
#: the end of one turn with the start of the next ("\n" then "\n\n" as one token), not tokens
#: this far back, which the turn's end marker parts from what follows.
RETOKENIZED = 4
#: The probe: a turn's end, then the answer and the next turn, as a chat template joins them.
_PROBE = ("<|user|>\nWhich ship passed the cape first?\n<|assistant|>\n", "The Eider, at dawn.\n<|user|>\nHer flag?\n")


class KnownPrompts:
    """The tokens of the prompt texts tokenized lately (`tokens`)."""

    def __init__(self, capacity: int = KNOWN_PROMPTS) -> None:
        self.capacity = capacity
        self._texts: OrderedDict[str, array[int]] = OrderedDict()
        self._joins: bool | None = None  # whether `_join` gives what tokenizing the whole gives (the probe)

    async def tokens(self, upstream: Upstream, text: str) -> tuple[list[int], int]:
        """`text`'s tokens as llama-server makes them (`Upstream.tokenize`): those of the longest
        known text it begins with but its last `RETOKENIZED` tokens, then the rest tokenized,
        where the probe passed. With how many of them were known (not tokenized now)."""
        if len(text) < MIN_KNOWN_CHARS:
            return await upstream.tokenize(text), 0
        start, known = self._longest_start(text)
        joined = None
        if known is not None and await self._joined_as_whole(upstream):
            joined = await _join(upstream, start, known, text)
        tokens = joined or await upstream.tokenize(text)
        self._keep(text, tokens)
        return tokens, len(known) - RETOKENIZED if joined and known is not None else 0

    def _longest_start(self, text: str) -> tuple[str, array[int] | None]:
        best, tokens = "", None
        for known, ids in self._texts.items():
            if len(known) > len(best) and text.startswith(known):
                best, tokens = known, ids
        if tokens is not None:
            self._texts.move_to_end(best)
        return best, tokens

    def _keep(self, text: str, tokens: list[int]) -> None:
        self._texts[text] = array("i", tokens)
        self._texts.move_to_end(text)
        while len(self._texts) > self.capacity:
            self._texts.popitem(last=False)

    async def _joined_as_whole(self, upstream: Upstream) -> bool:
        if self._joins is None:
            head, rest = _PROBE
            known = array("i", await upstream.tokenize(head))
            self._joins = await _join(upstream, head, known, head + rest) == await upstream.tokenize(head + rest)
        return self._joins


async def _join(upstream: Upstream, start: str, known: array[int], text: str) -> list[int] | None:
    """`text`'s tokens from `known`, the tokens of `start` (where `text` begins), but its last
    `RETOKENIZED`, and the text from theirs on tokenized; None where those last tokens do not
    read back as the end of `start` (a piece that is not whole UTF-8, a tokenizer's space)."""
    if len(known) <= RETOKENIZED:
        return None
    again = await upstream.detokenize(list(known[-RETOKENIZED:]))
    if not again or not start.endswith(again):
        return None
    return [*known[:-RETOKENIZED], *await upstream.tokenize(text[len(start) - len(again) :], special=False)]

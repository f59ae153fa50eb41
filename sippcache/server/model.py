"""The class of every model the server loads (`ServedLlama`), and what is decided per model.

Upstream's loader makes a plain `llama_cpp.Llama`; `sippcache.server.stores`
turns it into a `ServedLlama` (a ``__class__`` assignment: this class adds no
state a constructor would set up) and gives it its cache (with ``--parallel``,
a scheduler the pool keeps runs its requests). `use_chat_format` picks a chat format for a
model file that carries no template (`chat_format_for`) and gives the model
sippcache's own formats (`CHAT_HANDLERS`); `batching_obstacle` says why a
model cannot run batched.

It relies on `llama_cpp.Llama`'s use of ``logits_all`` and ``scores`` (tests
compare logprobs with a plain `llama_cpp.Llama`'s).
"""

from __future__ import annotations

import ctypes
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import llama_chat_format, llama_types
from llama_cpp.server.settings import ModelSettings

from ..llama import Llama, LlamaCache
from .door import CURRENT

__all__ = [
    "ARCHITECTURE_CHAT_FORMATS",
    "CHAT_HANDLERS",
    "ServedLlama",
    "batching_obstacle",
    "chat_format_for",
    "format_gemma",
    "use_chat_format",
]


def _text(content: object) -> str:
    """A message's text: its string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""


def format_gemma(
    messages: list[llama_types.ChatCompletionRequestMessage], **kwargs: Any
) -> llama_chat_format.ChatFormatterResponse:
    r"""Gemma's turns with the system message kept: its text opens the next user turn.

    Gemma has no system role. Its own template (Gemma 3's, shipped in the model
    files that carry one) puts the system text, then a blank line, at the start
    of the first user turn: ``<start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n``.
    llama-cpp-python's ``gemma`` format drops every system message instead (it
    only logs that at debug level), so a served model without a template never
    saw the instructions, and a long shared system prompt, the prefix a cache
    exists for, was not even in the prompt. Everything else is as upstream's
    format: turns are not trimmed, other roles (tools, functions) are left out,
    and BOS is added by the tokenizer. A system message later in a chat opens
    the user turn after it (nothing is dropped, and the earlier turns, a cached
    prefix, stay as they were).
    """
    prompt, system = "", ""
    for message in messages:
        role, text = message["role"], _text(message.get("content"))
        if role == "system":
            system += text + "\n\n"
        elif role == "user":
            prompt += f"<start_of_turn>user\n{system}{text}<end_of_turn>\n"
            system = ""
        elif role == "assistant":
            prompt += f"<start_of_turn>model\n{text}<end_of_turn>\n"
    if system:  # no user turn after it: a user turn of its own
        prompt += "<start_of_turn>user\n" + system.removesuffix("\n\n") + "<end_of_turn>\n"
    return llama_chat_format.ChatFormatterResponse(prompt=prompt + "<start_of_turn>model\n", stop="<end_of_turn>\n")


#: sippcache's own chat formats, by name. A served model whose ``chat_format`` names one
#: gets its handler in its own ``_chat_handlers`` (where llama-cpp-python keeps the formats
#: of a model file's templates), never in llama-cpp-python's global registry: a plain
#: `llama_cpp.Llama` in the same process keeps upstream's formats.
CHAT_HANDLERS: dict[str, llama_chat_format.LlamaChatCompletionHandler] = {
    "sippcache-gemma": llama_chat_format.chat_formatter_to_chat_completion_handler(format_gemma),
}

#: The chat format for a model architecture (GGUF ``general.architecture``), for files that
#: carry no chat template: upstream would fall back to llama-2's format. llama-cpp-python's
#: own, except gemma's, which drops system messages (see `format_gemma`).
ARCHITECTURE_CHAT_FORMATS = {
    "gemma": "sippcache-gemma", "gemma2": "sippcache-gemma", "gemma3": "sippcache-gemma",
    "gemma3n": "sippcache-gemma",
    "qwen": "qwen", "qwen2": "qwen", "chatglm": "chatglm3", "baichuan": "baichuan-2",
}  # fmt: skip

_COMPLETION_SIGNATURE = inspect.signature(llama_cpp.Llama.create_completion)


class ServedLlama(Llama):
    """`sippcache.llama.Llama` as the server runs it.

    On top of stored logits and no scores copies:

    - `close()` first calls `on_close` (set by whoever attached the cache: it
      writes the model's pending cache entries and stops its writer); the
      proxy closes a model when a request names another alias;
    - with ``logits_all`` (upstream's server default, for ``logprobs``), the
      prompt the cache prefills is evaluated with logits for its last position
      only, which is the only prompt position anything reads (the first
      generated token's logprobs), copied into ``scores`` (from the store, on
      an exact repeat answered with stored logits). Computing logits for
      every prompt position costs more than the rest of gemma-3-270m's forward
      pass (a 262k vocabulary), and the rows of positions restored from the
      cache would hold none anyway. Upstream's own evaluation (generation)
      keeps every row;
    - a completion asking for the prompt's own logprobs (``echo`` with
      ``logprobs``) reads those rows: it is evaluated from scratch, uncached,
      by upstream's code alone.
    """

    #: The model's sippcache cache (None: served uncached).
    sippcache_cache: LlamaCache | None = None
    #: Called once by `close()` before the model is freed.
    on_close: Callable[[ServedLlama], None] | None = None
    #: Called when a completion generated here ends: (time to first token, time per output token).
    on_generated: Callable[[float, float | None], None] | None = None
    #: True from the start of a completion until upstream's generate() runs: the cache's prefill.
    _sippcache_prefill: bool = False

    def create_completion(self, *args: Any, **kwargs: Any) -> Any:
        arguments = _COMPLETION_SIGNATURE.bind(self, *args, **kwargs).arguments
        if arguments.get("echo") and arguments.get("logprobs") is not None:
            self.cache, self._sippcache_prefill = None, False
            self.reset()  # generate() then evaluates every prompt position, filling its scores
        else:
            self.cache, self._sippcache_prefill = self.sippcache_cache, self.sippcache_cache is not None
        return super().create_completion(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        # Runs at the first next(), after the cache's prefill: from here on, upstream's evaluation.
        self._sippcache_prefill = False
        stored = self._stored_logits
        if self._logits_all and stored is not None and stored[0] == self.n_tokens:
            self.scores[self.n_tokens - 1, :] = stored[1]  # an exact repeat: its logits came from the store
        request = CURRENT.get()
        started = request.arrived if request is not None else time.perf_counter()
        first = last = None
        count = 0
        try:
            for token in super().generate(*args, **kwargs):
                last = time.perf_counter()
                first = first or last
                count += 1
                yield token
        finally:
            if first is not None and last is not None and self.on_generated is not None:
                self.on_generated(first - started, (last - first) / (count - 1) if count > 1 else None)

    def eval(self, tokens: Sequence[int]) -> None:
        if not (self._sippcache_prefill and self._logits_all and len(tokens)):
            return super().eval(tokens)
        self._logits_all = False  # upstream's eval then asks llama.cpp for the last position's logits only
        try:
            super().eval(tokens)
        finally:
            self._logits_all = True
        last = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        self.scores[self.n_tokens - 1, :] = np.ctypeslib.as_array(
            ctypes.cast(last, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,)
        )

    def close(self) -> None:
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close(self)
        super().close()


def chat_format_for(model: llama_cpp.Llama, settings: ModelSettings) -> str | None:
    """The chat format to use for a model file with no chat template, from its
    architecture, when none was asked for and llama-cpp-python has one (upstream
    falls back to llama-2's, which Gemma answers with nothing); else None."""
    if settings.chat_format is not None or model.chat_handler is not None:
        return None
    if "tokenizer.chat_template" in model.metadata:
        return None
    chosen = ARCHITECTURE_CHAT_FORMATS.get(model.metadata.get("general.architecture", ""))
    return chosen if chosen is not None and chosen != model.chat_format else None


def use_chat_format(model: llama_cpp.Llama, settings: ModelSettings) -> str | None:
    """Set `model`'s chat format as the server serves it: the one `chat_format_for` picks
    (returned; None if it picks none), and the handler of a format of sippcache's own
    (`CHAT_HANDLERS`), picked here or named with ``--chat_format``."""
    chosen = chat_format_for(model, settings)
    if chosen is not None:
        model.chat_format = chosen
    name = model.chat_format
    if name in CHAT_HANDLERS and model.chat_handler is None:
        model._chat_handlers[name] = CHAT_HANDLERS[name]
    return chosen


def batching_obstacle(model: llama_cpp.Llama) -> str | None:
    """Why `model` cannot run batched, or None: a chat handler that drives the context
    itself (multimodal) or a draft model (speculative decoding) need the model's own
    context, one request at a time."""
    handler = model.chat_handler
    if isinstance(handler, (llama_chat_format.Llava15ChatHandler, llama_chat_format.MTMDChatHandler)):
        return f"its chat handler ({type(handler).__name__}) evaluates images in the model's own context"
    if model.draft_model is not None:
        return "speculative decoding (a draft model) runs in the model's own context"
    return None

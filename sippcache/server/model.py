"""The class of every model the server loads: `ServedLlama`.

Upstream's loader makes a plain `llama_cpp.Llama`; `sippcache.server.stores`
turns it into a `ServedLlama` (a ``__class__`` assignment: this class adds no
state a constructor would set up) and gives it its cache.

It relies on `llama_cpp.Llama`'s use of ``logits_all`` and ``scores`` (tests
compare logprobs with a plain `llama_cpp.Llama`'s).
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import llama_cpp
import numpy as np

from ..llama import Llama, LlamaCache

__all__ = ["ServedLlama"]

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
        return (yield from super().generate(*args, **kwargs))

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

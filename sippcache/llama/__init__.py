"""The llama.cpp layer: llama-cpp-python's `Llama` with sippcache's prefix cache.

- `PrefixCache` (adapter): restore the best cached prefix of a prompt into a
  `Llama`'s context and evaluate only the rest;
- `LlamaCache` (adapter): the same behind llama-cpp-python's own cache hook
  (``llm.set_cache(...)``), and `Llama`, the `llama_cpp.Llama` that samples
  from stored logits and copies no scores;
- `SessionPool` (pool): many conversations in one context, decoded together;
- `CacheOptions` (options): the scope, `min_tokens`, `checkpoint_interval`,
  `max_pending_writes` and secret all of them take, as one checked value;
- underneath, shared by all of them: `seqcache.SequenceCache` (where states are
  found and left), `states` (copying, restoring and framing sequence states),
  `fingerprint` (what makes a state loadable) and `writer` (the background
  writer).

Importing this package imports llama_cpp; the core (`import sippcache`) does not.
"""

from __future__ import annotations

from .adapter import KIND, Llama, LlamaCache, PrefillResult, PrefixCache
from .checkpoints import CHECKPOINT_ALIGNMENT
from .options import CacheOptions
from .pool import Completion, Sampling, SessionPool
from .seqcache import PrefixStats

__all__ = [
    "CHECKPOINT_ALIGNMENT",
    "KIND",
    "CacheOptions",
    "Completion",
    "Llama",
    "LlamaCache",
    "PrefillResult",
    "PrefixCache",
    "PrefixStats",
    "Sampling",
    "SessionPool",
]

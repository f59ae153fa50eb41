"""The one place that relies on llama-cpp-python's server internals.

`CachingLlamaProxy` and `install` use: ``LlamaProxy.load_llama_from_model_settings``
(a static method, called through ``self``, the only place upstream creates
caches), ``llama_cpp.server.app.LlamaProxy`` (the name `create_app`
instantiates), and the settings fields ``cache``, ``model_alias`` and
``vocab_only``. `tests/test_serve_upstream.py` fails, naming the symbol, if a
llama-cpp-python upgrade moves any of them.
"""

from __future__ import annotations

from typing import ClassVar

import llama_cpp
import llama_cpp.server.app as upstream_app
from llama_cpp.server.model import LlamaProxy
from llama_cpp.server.settings import ModelSettings

from .stores import CachePool

__all__ = ["CachingLlamaProxy", "LlamaProxy", "install", "upstream_app"]


class CachingLlamaProxy(LlamaProxy):
    """Upstream's `LlamaProxy` (one model loaded at a time, swapped by alias) whose
    loader attaches sippcache: it calls upstream's with ``cache=False`` (so no
    LlamaRAMCache/LlamaDiskCache is made), then gives the model its sippcache cache."""

    pool: ClassVar[CachePool | None] = None  # set by `install`

    @classmethod
    def load_llama_from_model_settings(cls, settings: ModelSettings) -> llama_cpp.Llama:
        model = LlamaProxy.load_llama_from_model_settings(settings.model_copy(update={"cache": False}))
        if cls.pool is None:
            return model
        return cls.pool.attach(model, settings)


def install(pool: CachePool) -> None:
    """Make `llama_cpp.server.app.create_app` build a `CachingLlamaProxy` using `pool`."""
    CachingLlamaProxy.pool = pool
    upstream_app.LlamaProxy = CachingLlamaProxy  # type: ignore[attr-defined]  # app.py imports it, not re-exported

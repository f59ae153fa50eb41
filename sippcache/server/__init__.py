"""`sippcache serve`: llama-cpp-python's OpenAI-compatible server, with sippcache's cache.

This runs llama-cpp-python's own server (``llama_cpp.server``: its FastAPI app,
endpoints, settings, config file and chat formats, unchanged) with every
model's cache replaced by sippcache's, picked by URL, plus ``GET /metrics``
and ``GET /v1/cache/stats``.

    sippcache serve --model model.gguf --cache lmdb:///var/cache/sipp
    python -m sippcache.server --config_file models.yaml     # each model may name its own cache_url

Split as llama-cpp-python splits ``llama_cpp.server``:

- `settings`: the command line and config file (upstream's, plus ``--cache``);
- `model`: `ServedLlama`, the class of every model the server loads;
- `stores`: the open stores and each model's cache and counters (`CachePool`);
- `upstream`: the one module that relies on upstream's server internals;
- `app`: the FastAPI app; `metrics`: ``/metrics`` and ``/v1/cache/stats``;
- `cli`: ``main``.
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]

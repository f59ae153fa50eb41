"""Prefill prompt files into a cache so the first real request is warm (`sippcache warm`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .loading import load_llama, require_llama
from .progress import prefill_with_bar, progress_bars, step


@dataclass(frozen=True)
class WarmedPrompt:
    """One prompt file: its tokens, how many were already cached, and the seconds it took."""

    file: str
    tokens: int
    reused: int
    seconds: float


@dataclass(frozen=True)
class WarmReport:
    """Where the prompts went (the fields are the keys of ``sippcache warm --json``)."""

    cache: str
    namespace: str
    prompts: list[WarmedPrompt]


def warm(
    model_path: str,
    prompt_files: Sequence[str],
    cache_url: str | None = None,
    *,
    scope: str = "default",
    pin: bool = False,
) -> WarmReport:
    """Prefill each prompt file into the cache (and, with `pin`, pin their entries).

    The model is loaded with llama-cpp-python's default cache settings; a
    server must use the same settings (K/V types, flash attention) to hit.
    """
    require_llama("sippcache warm", extra="llama")
    from ..llama import PrefixCache

    if not prompt_files:
        raise ValueError("give at least one --prompt-file")
    texts = [Path(f).read_text(encoding="utf-8") for f in prompt_files]
    if not Path(model_path).is_file():
        raise ValueError(f"no model file at {model_path}")
    rows = []
    with progress_bars() as progress:
        with step(progress, "Loading the model"):
            vocab = load_llama(model_path, n_ctx=512, vocab_only=True)
            prompts = [vocab.tokenize(text.encode()) for text in texts]
            vocab.close()
            llm = load_llama(model_path, n_ctx=max(len(p) for p in prompts) + 1)
        with PrefixCache(llm, cache_url, scope=scope) as cache:
            for name, tokens in zip(prompt_files, prompts, strict=True):
                started = time.perf_counter()
                reused = prefill_with_bar(progress, f"Prefilling {name}", cache, tokens, pin=pin)
                rows.append(WarmedPrompt(name, len(tokens), reused, round(time.perf_counter() - started, 3)))
            cache.flush()
            report = WarmReport(cache.cache.stats().location, cache.namespace, rows)
        llm.close()
    return report

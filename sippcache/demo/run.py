"""The demo: what a new user runs first (`sippcache demo`).

gemma-3-270m (assembled once into the user cache folder), the default cache,
and a long built-in prompt (a document and a question), run cold and then
warm. Run it twice: the second run's warm prefill is served by the entry the
first run stored.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from datetime import datetime

from .. import frame
from ..registry import default_url
from .loading import load_llama, require_llama
from .model import gemma_model_path
from .progress import prefill_with_bar, progress_bars, step

DEMO_SCOPE = "demo"
N_CTX = 4096
#: Tokens generated after the first one, for the answer shown.
ANSWER_TOKENS = 23

_SHIPS = ["Aurora", "Brightwater", "Cormorant", "Dunlin", "Eider", "Fulmar", "Gannet", "Heron", "Ibis", "Jaeger"]
_FLAGS = ["Norway", "Scotland", "Iceland", "Denmark", "the Faroes", "Ireland", "Brittany"]
_WEATHER = ["clear", "fog banks from the east", "a hard westerly gale", "drizzle", "snow squalls", "flat calm"]
_CARGO = ["salt cod", "timber", "coal", "wool", "barley", "whale oil", "slate", "mail and passengers"]


@dataclass(frozen=True)
class DemoReport:
    """What the demo measured (its fields are the keys of ``sippcache demo --json``)."""

    cold_ttft_s: float
    warm_ttft_s: float
    speedup: float
    prompt_tokens: int
    reused_tokens: int
    entry_bytes: int
    cache_url: str
    restored_from_previous_run: bool
    entry_written_at: str | None
    same_first_token: bool
    answer: str

    @property
    def ok(self) -> bool:
        """The cache served the warm run, and it began as the cold one did."""
        return self.same_first_token and self.reused_tokens > 0


def demo_prompt() -> str:
    """A few thousand tokens: a keeper's log of ships (a made-up document), then a question."""
    lines = [
        "The Northern Cape Light: extracts from the keeper's log, 1871.",
        "Each entry gives the day, the vessel, her flag, her cargo, the weather and the sea.",
        "",
    ]
    for day in range(1, 101):
        ship = _SHIPS[(day * 7) % len(_SHIPS)]
        lines.append(
            f"Day {day}. The {ship} (flag of {_FLAGS[(day * 3) % len(_FLAGS)]}) passed at "
            f"{(day * 5) % 12 + 1} o'clock carrying {_CARGO[(day * 11) % len(_CARGO)]}; weather "
            f"{_WEATHER[(day * 13) % len(_WEATHER)]}, sea state {(day * 17) % 9}."
        )
    lines += ["", "Question: which vessel passed on day 97, and what was she carrying? Answer:"]
    return "\n".join(lines)


def run_demo(cache_url: str | None = None) -> DemoReport:
    """Run the demo on `cache_url` (default: `sippcache.default_url()`), with progress on stderr."""
    require_llama("sippcache demo", extra="demo")
    import llama_cpp

    from ..llama import PrefixCache

    url = cache_url or default_url()
    with progress_bars() as progress:
        with step(progress, "Assembling gemma-3-270m into the user cache folder (first run only)"):
            model_path = gemma_model_path()
        with step(progress, "Loading the model"):
            llm = load_llama(str(model_path), n_ctx=N_CTX)
        tokens = llm.tokenize(demo_prompt().encode())
        with PrefixCache(llm, url, scope=DEMO_SCOPE) as cache:
            # Cold: evaluate everything (storing the snapshot if no earlier run did).
            started = time.perf_counter()
            prefill_with_bar(progress, "Cold prefill (no cache)", cache, tokens, restore=False)
            cold_token = llm.sample(temp=0.0)
            cold_ttft = time.perf_counter() - started
            cache.flush()
            # Warm: an empty context, so every reused token comes from the store.
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            llm.reset()
            started = time.perf_counter()
            reused = prefill_with_bar(progress, "Warm prefill (from the cache)", cache, tokens)
            warm_token = llm.sample(temp=0.0)
            warm_ttft = time.perf_counter() - started
            generated = llm.generate([warm_token], temp=0.0, reset=False)
            answer = llm.detokenize([warm_token, *itertools.islice(generated, ANSWER_TOKENS)])
            match = cache.cache.lookup(tokens, namespace=cache.namespace, touch=False)
            entry_bytes, writer_pid, written_at = 0, None, None
            if match is not None:
                with match:
                    entry = frame.decode(match.blob)
                    entry_bytes, writer_pid, written_at = len(match.blob), entry.meta.get("pid"), entry.created
                    del entry  # its sections are views of the blob
    llm.close()
    return DemoReport(
        cold_ttft_s=round(cold_ttft, 4),
        warm_ttft_s=round(warm_ttft, 4),
        speedup=round(cold_ttft / warm_ttft, 1),
        prompt_tokens=len(tokens),
        reused_tokens=reused,
        entry_bytes=entry_bytes,
        cache_url=url,
        restored_from_previous_run=writer_pid is not None and writer_pid != os.getpid(),
        entry_written_at=datetime.fromtimestamp(written_at).isoformat(timespec="seconds") if written_at else None,
        same_first_token=cold_token == warm_token,
        answer=answer.decode("utf-8", "replace").strip(),
    )

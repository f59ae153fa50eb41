"""The `sippcache demo`, `warm` and `bench` commands.

The demo is what a new user runs first: gemma-3-270m (assembled once into the
user cache folder), the default cache, and a long built-in prompt (a document
and a question), run cold and then warm, with a short report. Run it twice:
the second run's warm prefill is served by the entry the first run stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

DEMO_SCOPE = "demo"
N_CTX = 4096

_SHIPS = ["Aurora", "Brightwater", "Cormorant", "Dunlin", "Eider", "Fulmar", "Gannet", "Heron", "Ibis", "Jaeger"]
_FLAGS = ["Norway", "Scotland", "Iceland", "Denmark", "the Faroes", "Ireland", "Brittany"]
_WEATHER = ["clear", "fog banks from the east", "a hard westerly gale", "drizzle", "snow squalls", "flat calm"]
_CARGO = ["salt cod", "timber", "coal", "wool", "barley", "whale oil", "slate", "mail and passengers"]


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


def _progress(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console, transient=True,
    )  # fmt: skip


@contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """llama.cpp writes some notices straight to file descriptor 2, whatever `verbose` says."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _load_llama(model_path: str, **kwargs: Any) -> Any:
    """A `sippcache.llama.Llama`: its entries keep the prompt's logits (what a server using
    sippcache looks for), and an exact repeat samples from them."""
    from sippcache.llama import Llama

    with _native_stderr_silenced():
        return Llama(model_path=model_path, verbose=False, **kwargs)


@contextmanager
def _step(progress: Progress, description: str) -> Iterator[None]:
    """A spinner for a step with no measurable progress (e.g. assembling the model)."""
    task = progress.add_task(description, total=None)
    try:
        yield
    finally:
        progress.remove_task(task)


def _prefill_with_bar(progress: Progress, description: str, cache: Any, tokens: list[int], **kwargs: Any) -> int:
    task = progress.add_task(description, total=len(tokens))
    try:
        return cache.prefill(tokens, progress=lambda done, total: progress.update(task, completed=done, total=total), **kwargs)
    finally:
        progress.remove_task(task)


def run_demo(cache_url: str | None = None, *, as_json: bool = False) -> int:
    """Run the demo; print a report (or one JSON line). Returns the exit code."""
    import llama_cpp

    import sippcache
    from sippcache import frame
    from sippcache.llama import PrefixCache
    from sippcache.models import gemma_model_path

    console = Console(stderr=True)
    url = cache_url or sippcache.default_url()
    with _progress(console) as progress:
        with _step(progress, "Assembling gemma-3-270m into the user cache folder (first run only)"):
            model_path = gemma_model_path()
        with _step(progress, "Loading the model"):
            llm = _load_llama(str(model_path), n_ctx=N_CTX, n_batch=512)
        tokens = llm.tokenize(demo_prompt().encode())
        with PrefixCache(llm, url, scope=DEMO_SCOPE) as cache:
            # Cold: evaluate everything (storing the snapshot if no earlier run did).
            started = time.perf_counter()
            _prefill_with_bar(progress, "Cold prefill (no cache)", cache, tokens, restore=False)
            cold_token = llm.sample(temp=0.0)
            cold_ttft = time.perf_counter() - started
            cache.flush()
            # Warm: an empty context, so every reused token comes from the store.
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            llm.reset()
            started = time.perf_counter()
            reused = _prefill_with_bar(progress, "Warm prefill (from the cache)", cache, tokens)
            warm_token = llm.sample(temp=0.0)
            warm_ttft = time.perf_counter() - started
            answer = llm.detokenize([warm_token] + [t for _, t in zip(range(23), llm.generate([warm_token], temp=0.0, reset=False))])
            match = cache.cache.lookup(tokens, namespace=cache.namespace, touch=False)
            entry_bytes, writer_pid, written_at = 0, None, None
            if match is not None:
                with match:
                    entry = frame.decode(match.blob)
                    entry_bytes, writer_pid, written_at = len(match.blob), entry.meta.get("pid"), entry.created
                    del entry
    llm.close()
    report = {
        "cold_ttft_s": round(cold_ttft, 4),
        "warm_ttft_s": round(warm_ttft, 4),
        "speedup": round(cold_ttft / warm_ttft, 1),
        "prompt_tokens": len(tokens),
        "reused_tokens": reused,
        "entry_bytes": entry_bytes,
        "cache_url": url,
        "restored_from_previous_run": writer_pid is not None and writer_pid != os.getpid(),
        "entry_written_at": datetime.fromtimestamp(written_at).isoformat(timespec="seconds") if written_at else None,
        "same_first_token": cold_token == warm_token,
        "answer": answer.decode("utf-8", "replace").strip(),
    }
    if as_json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0 if report["same_first_token"] and reused > 0 else 1


def _print_report(r: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(show_header=False, title="sippcache demo: gemma-3-270m, one long prompt")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("prompt", f"{r['prompt_tokens']:,} tokens (a ship log and a question)")
    table.add_row("cold time to first token", f"{r['cold_ttft_s'] * 1000:,.0f} ms")
    table.add_row("warm time to first token", f"{r['warm_ttft_s'] * 1000:,.1f} ms")
    table.add_row("speedup", f"{r['speedup']:,.0f}x")
    table.add_row("tokens reused", f"{r['reused_tokens']:,} of {r['prompt_tokens']:,}")
    table.add_row("cache entry", f"{r['entry_bytes'] / 1e6:.1f} MB")
    table.add_row("cache", r["cache_url"])
    previous = "yes" if r["restored_from_previous_run"] else "no (run the demo again to see a restart hit)"
    table.add_row("served by an earlier process", f"{previous}; entry written {r['entry_written_at']}")
    table.add_row("same first token cold and warm", "yes" if r["same_first_token"] else "NO")
    table.add_row("answer", repr(r["answer"]))
    Console().print(table)


def warm(
    model_path: str,
    prompt_files: Sequence[str],
    cache_url: str | None = None,
    *,
    scope: str = "default",
    pin: bool = False,
    as_json: bool = False,
) -> int:
    """Prefill each prompt file into the cache so the first real request is warm
    (and, with `pin`, pin their entries).

    The model is loaded with llama-cpp-python's default cache settings; a
    server must use the same settings (K/V types, flash attention) to hit.
    """
    from sippcache.llama import PrefixCache

    if not prompt_files:
        raise ValueError("give at least one --prompt-file")
    texts = [Path(f).read_text(encoding="utf-8") for f in prompt_files]
    if not Path(model_path).is_file():
        raise ValueError(f"no model file at {model_path}")
    console = Console(stderr=True)
    rows = []
    with _progress(console) as progress:
        with _step(progress, "Loading the model"):
            vocab = _load_llama(model_path, vocab_only=True)
            prompts = [vocab.tokenize(text.encode()) for text in texts]
            vocab.close()
            n_ctx = max(len(p) for p in prompts) + 1
            llm = _load_llama(model_path, n_ctx=n_ctx)
        with PrefixCache(llm, cache_url, scope=scope) as cache:
            for name, tokens in zip(prompt_files, prompts):
                started = time.perf_counter()
                reused = _prefill_with_bar(progress, f"Prefilling {name}", cache, tokens, pin=pin)
                rows.append({"file": name, "tokens": len(tokens), "reused": reused,
                             "seconds": round(time.perf_counter() - started, 3)})  # fmt: skip
            cache.flush()
            namespace, url = cache.namespace, cache.cache.stats().location
        llm.close()
    if as_json:
        print(json.dumps({"cache": url, "namespace": namespace, "prompts": rows}))
    else:
        for row in rows:
            print(f"{row['file']}: {row['tokens']} tokens, {row['reused']} already cached, {row['seconds']} s")
        print(f"cache: {url}  namespace: {namespace}")
    return 0


def bench(*, quick: bool = False, as_json: bool = False) -> int:
    """Run the benchmarks in the source checkout's benchmarks/ folder, one after the other."""
    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = [folder / "lookup.py", folder / "ttft.py"]
    if not all(script.is_file() for script in scripts):
        raise ValueError(f"the benchmarks are not installed with the package; run this from a source checkout ({folder})")
    flags = [*(["--quick"] if quick else []), *(["--json"] if as_json else [])]
    status = 0
    for script in scripts:
        status |= subprocess.run([sys.executable, str(script), *flags]).returncode
    return status

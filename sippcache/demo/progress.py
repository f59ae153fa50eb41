"""Progress on stderr while a model loads and prompts are evaluated (stdout stays for the report).

Descriptions can hold data (a prompt file's name), so they are escaped: rich
would read ``[...]`` in them as markup.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from ..llama import PrefixCache


def progress_bars() -> Progress:
    """Spinners and bars on stderr, gone when done."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


@contextmanager
def step(progress: Progress, description: str) -> Iterator[None]:
    """A spinner for a step with no measurable progress (e.g. assembling the model)."""
    task = progress.add_task(escape(description), total=None)
    try:
        yield
    finally:
        progress.remove_task(task)


def prefill_with_bar(
    progress: Progress,
    description: str,
    cache: PrefixCache,
    tokens: list[int],
    *,
    restore: bool = True,
    pin: bool = False,
) -> int:
    """`cache.prefill(tokens)` with a bar of the tokens evaluated; the tokens reused."""
    task = progress.add_task(escape(description), total=len(tokens))

    def advance(done: int, total: int) -> None:
        progress.update(task, completed=done, total=total)

    try:
        return int(cache.prefill(tokens, restore=restore, progress=advance, pin=pin))
    finally:
        progress.remove_task(task)

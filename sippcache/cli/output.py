"""How the commands print: JSON lines, sizes and times, and tables that show data literally.

Rich reads ``[...]`` in a string as markup, so a namespace ``[/]`` would
crash a table and ``team[red]/a`` would print as ``team/a``. Every table
cell and caption goes through `literal`: a `rich.text.Text`, which is never
parsed, with control characters (a terminal escape in a namespace) shown as
``\\x1b`` rather than sent to the terminal.

Tables fit an 80-column terminal (or a pipe, which rich treats as 80 columns):
a command builds its table in a few layouts, roomiest first, and prints the
first that fits (`first_that_fits`). Text that can be long (namespaces,
paths, reasons) folds onto more lines rather than being cut; numbers and ids
never wrap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TypedDict

import click
from rich.cells import cell_len
from rich.console import Console
from rich.filesize import decimal as human_size
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from .. import tokens as _tokens
from ..engine import entry_id as _entry_id_bytes
from ..protocol import EntryInfo

#: Namespaces made by the llama adapter: llama:<model fingerprint>/<scope>.
_LLAMA_NAMESPACE = re.compile(r"llama:([0-9a-f]{32})/(.*)", re.DOTALL)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: Hex digits of an entry id as `ls` shows it.
ID_LENGTH = 12
#: The width a folding column (a namespace) is given when choosing a table's layout.
FOLDED_WIDTH = 20


class EntryRow(TypedDict):
    """One entry in ``ls --json``."""

    id: str
    namespace: str
    tokens: int
    bytes: int
    created: str
    last_used: str
    pinned: bool
    priority: float


def literal(value: str) -> Text:
    """`value` as it is: no markup, control characters escaped (``\\x1b``)."""
    return Text(_CONTROL.sub(lambda char: repr(char.group())[1:-1], value))


def add_row(table: Table, *cells: str) -> None:
    """Add a row of data to `table`, every cell literal."""
    table.add_row(*(literal(cell) for cell in cells))


def print_table(table: Table, caption: str | None = None) -> None:
    """Print `table` to stdout, with a literal caption."""
    if caption is not None:
        table.caption = literal(caption)
    Console().print(table)


def first_that_fits(layouts: Sequence[tuple[Table, Sequence[Sequence[str]]]]) -> Table:
    """The first of `layouts` that fits the terminal, else the last one (the narrowest).

    Each layout is a table and the cells of each of its folding columns: a
    layout fits if it does with those columns folded to `FOLDED_WIDTH` (a long
    namespace takes more lines, not the room of the numbers).
    """
    console = Console()
    unbounded = console.options.update_width(1 << 16)  # the table's natural width, not clipped to the terminal
    for table, folding in layouts:
        foldable = sum(max(0, max(map(_width, cells), default=0) - FOLDED_WIDTH) for cells in folding)
        if console.measure(table, options=unbounded).maximum - foldable <= console.width:
            return table
    return layouts[-1][0]


def _width(cell: str) -> int:
    return cell_len(literal(cell).plain)


def echo_json(data: object) -> None:
    """`data` as one JSON line on stdout."""
    click.echo(json.dumps(data, indent=None))


def iso_time(seconds: float) -> str:
    """A UTC timestamp in ISO 8601 (for JSON)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def local_time(seconds: float) -> str:
    """A local timestamp to read (for tables)."""
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def short_size(n: int) -> str:
    """``14.4 MB``, ``276 B``: a size for a table column."""
    return human_size(n) if n >= 1000 else f"{n} B"


def size_and_bytes(n: int | None) -> str:
    """``2.1 GB (2,147,483,648 B)``; "unlimited" for None."""
    return "unlimited" if n is None else f"{human_size(n)} ({n:,} B)" if n >= 1000 else f"{n} B"


def entries(n: int) -> str:
    """``1 entry``, ``1,024 entries``."""
    return f"{n:,} entry" if n == 1 else f"{n:,} entries"


def namespace_label(namespace: str) -> str:
    """The namespace, with the default one shown as ``""``."""
    return namespace if namespace else '""'


def split_namespace(namespace: str) -> tuple[str | None, str | None]:
    """(model fingerprint, scope) of a llama adapter namespace, else (None, None)."""
    match = _LLAMA_NAMESPACE.fullmatch(namespace)
    return (match.group(1), match.group(2)) if match else (None, None)


def entry_id(entry: EntryInfo) -> str:
    """A short id naming an entry on the command line (hex of its namespace and key hash)."""
    return _entry_id_bytes(entry.namespace, _tokens.encode(entry.key)).hex()[:ID_LENGTH]


def entry_row(entry: EntryInfo) -> EntryRow:
    """An entry as ``ls --json`` prints it."""
    return {
        "id": entry_id(entry),
        "namespace": entry.namespace,
        "tokens": len(entry.key),
        "bytes": entry.size,
        "created": iso_time(entry.created),
        "last_used": iso_time(entry.last_used),
        "pinned": entry.pinned,
        "priority": entry.priority,
    }


def byte_progress(what: str) -> Progress:
    """A progress bar in bytes on stderr (stdout stays clean for --json); silent when stderr is not a terminal."""
    console = Console(stderr=True)
    return Progress(
        TextColumn(what),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )

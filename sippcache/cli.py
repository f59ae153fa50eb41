"""The `sippcache` command."""

from __future__ import annotations

import json
from dataclasses import asdict

import click
from rich.console import Console
from rich.table import Table

from .registry import backends as list_backends


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sippcache")
def main() -> None:
    """Persistent prefix-state cache for llama.cpp."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def backends(as_json: bool) -> None:
    """List every backend, where it comes from, and whether it is usable here (and why not)."""
    info = list_backends()
    if as_json:
        click.echo(json.dumps({name: asdict(item) for name, item in info.items()}))
        return
    table = Table("backend", "from", "usable", "problem")
    for item in info.values():
        table.add_row(item.name, item.origin, "yes" if item.usable else "no", item.problem or "")
    Console().print(table)
if __name__ == "__main__":
    main()

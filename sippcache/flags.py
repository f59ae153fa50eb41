"""Command-line options declared once, as a table: the parser, the checks and the docs' table come from it.

A command's options are a sequence of `Flag` records. `add_flags` puts them on
an `argparse` parser in their groups (an old spelling parses but is not
listed in ``--help``), `check_flags` refuses a value under its lowest in one
line that names the flag, and `markdown_table` writes the table the docs
show, which a test compares with the page: a flag, its default or its help
cannot change in one place and not the others.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Flag", "add_flags", "check_flags", "markdown_table"]


@dataclass(frozen=True)
class Flag:
    """One option: `name` (``--max-queue``), older spellings that still parse (`aliases`, hidden
    from ``--help``), the `group` it is listed under, its `help` (the docs' wording too), and how
    it parses: `parse` (argparse's ``type``), `default` (what the code gets), `shown` (the default as the docs and
    ``--help`` say it, where `default` alone would not say it: a value read at start), `metavar`,
    `choices`, `action` (``store_true``, ``append``, a boolean pair: `argparse.BooleanOptionalAction`),
    `lowest` (the smallest value `check_flags` lets through, with `unit` for its message), `see`
    (an anchor in the docs page for more), and `dest` (the attribute it parses to; by default its
    name's, ``--max-queue``: ``max_queue``)."""

    name: str
    group: str
    help: str
    parse: Callable[[str], Any] | None = None
    default: Any = None
    shown: str | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    action: str | type[argparse.Action] | None = None
    aliases: tuple[str, ...] = ()
    short: tuple[str, ...] = ()
    lowest: float | None = None
    unit: str = ""
    see: str = ""
    dest: str = ""

    def __post_init__(self) -> None:
        if not self.dest:  # --max-queue: args.max_queue
            object.__setattr__(self, "dest", self.name.lstrip("-").replace("-", "_"))

    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.action is argparse.BooleanOptionalAction:
            return "on" if self.default else "off"
        if self.action == "store_true":
            return "off"
        if self.default is None or self.default == "" or self.default == []:
            return "none"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    """Add `flags` to `parser`, each in its group (groups made in the order they first appear)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags:
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": flag.default}
        if flag.action is not None:
            kwargs["action"] = flag.action
        if flag.parse is not None:
            kwargs["type"] = flag.parse
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        if flag.choices is not None:
            kwargs["choices"] = flag.choices
        default = flag.default_text()
        shown = "" if default == "none" else f" (default: {default})"
        group = groups[flag.group]
        group.add_argument(flag.name, *flag.short, help=flag.help + shown, **kwargs)
        for alias in flag.aliases:  # the old spelling: parsed, not listed
            group.add_argument(alias, **{**kwargs, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS})


def check_flags(args: argparse.Namespace, flags: Iterable[Flag]) -> str | None:
    """The first flag whose value is under its `lowest`, said in one line; None when all are fine."""
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if flag.lowest is None or value is None:
            continue
        if not value >= flag.lowest:  # NaN fails too
            lowest = f"{flag.lowest:g}"
            return f"{flag.name} must be at least {lowest}{f' {flag.unit}' if flag.unit else ''}, not {value!r}"
    return None


def markdown_table(flags: Iterable[Flag]) -> str:
    """The docs' table of `flags`: option, default, what it does (with a link to `see`)."""
    rows = ["| option | default | |", "|---|---|---|"]
    for flag in flags:
        spelled = f"{flag.name} {flag.metavar}" if flag.metavar else flag.name
        if flag.action is argparse.BooleanOptionalAction:
            spelled = f"{flag.name}` / `--no-{flag.name[2:]}"
        more = f" ([more](#{flag.see}))" if flag.see else ""
        rows.append(f"| `{spelled}` | {flag.default_text()} | {flag.help}{more} |")
    return "\n".join(rows) + "\n"

"""Options declared once (`sippcache.flags`): the docs' tables are the declarations', the old spellings
still parse, the checks name the flag, ``--help`` is grouped."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sippcache.flags import Flag, add_flags, check_flags, markdown_table
from sippcache.proxy.settings import build_parser as proxy_parser
from sippcache.proxy.settings import proxy_flags
from sippcache.server.settings import OPTION_KEYS, SERVE_FLAGS
from sippcache.server.settings import build_parser as serve_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize(("page", "flags"), [("proxy.md", proxy_flags()), ("serve.md", list(SERVE_FLAGS))])
def test_the_docs_table_is_made_from_the_declarations(page: str, flags: list[Flag]) -> None:
    """A default or a help text changed in the code and not in the docs (or the reverse) fails here;
    the table is written by `markdown_table(flags)`."""
    assert markdown_table(flags) in (DOCS / page).read_text()


def test_every_link_of_a_table_reaches_a_heading() -> None:
    for page, flags in (("proxy.md", proxy_flags()), ("serve.md", SERVE_FLAGS)):
        text = (DOCS / page).read_text()
        headings = {
            "".join(c for c in line.lstrip("#").strip().lower() if c.isalnum() or c in " -").replace(" ", "-")
            for line in text.splitlines()
            if line.startswith("#")
        }
        assert {f.see for f in flags if f.see} <= headings


@pytest.mark.parametrize(
    ("old", "new", "dest", "value"),
    [
        (["--max_queue", "3"], ["--max-queue", "3"], "max_queue", 3),
        (["--save_idle", "2.5"], ["--save-idle", "2.5"], "save_idle", 2.5),
        (["--chunk_tokens", "0"], ["--chunk-tokens", "0"], "chunk_tokens", 0),
        (["--keep-ready"], ["--ready-keep"], "ready_keep", True),
        (["--no-warm-ready"], ["--no-ready-warm"], "ready_warm", False),
    ],
)
def test_the_proxy_takes_its_old_spellings(old: list[str], new: list[str], dest: str, value: object) -> None:
    assert getattr(proxy_parser().parse_args(old), dest) == getattr(proxy_parser().parse_args(new), dest) == value


@pytest.mark.parametrize("name", ["max_queue", "prefill_chunk", "save_idle", "chunk_tokens"])
def test_serve_takes_one_spelling_with_the_proxy_and_its_old_one(name: str) -> None:
    value = "64" if name != "save_idle" else "1.5"
    dashed = serve_parser().parse_args([f"--{name.replace('_', '-')}", value])
    underscored = serve_parser().parse_args([f"--{name}", value])
    assert getattr(dashed, name) == getattr(underscored, name) == float(value)
    assert name in OPTION_KEYS


def test_help_lists_groups_and_hides_old_spellings() -> None:
    text = proxy_parser("sippcache proxy").format_help()
    groups = ["start: a llama-server the proxy runs (managed)", "start: llama-servers you run (attach)"]
    groups += ["the store", "the proxy's server", "tuning (measured defaults: none needs setting)"]
    assert [text.index(f"\n{g}:") for g in groups] == sorted(text.index(f"\n{g}:") for g in groups)
    assert "--max-queue" in text and "--max_queue" not in text and "--keep-ready" not in text
    assert "(default: 2048)" in text  # --save-every's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--save-idle", "-1"], "--save-idle must be at least 0 seconds, not -1.0"),
        (["--flight-wait", "nan"], "--flight-wait must be at least 0 seconds, not nan"),
        (["--parallel", "0"], "--parallel must be at least 1, not 0"),
        (["--save-every", "0"], "--save-every must be at least 1 token, not 0"),
        (["--chunk-tokens", "-64"], "--chunk-tokens must be at least 0, not -64"),
        (["--max-queue", "5"], None),
    ],
)
def test_a_value_under_its_lowest_is_refused_in_one_line_naming_the_flag(argv: list[str], message: str | None) -> None:
    assert check_flags(proxy_parser().parse_args(argv), proxy_flags()) == message


def test_a_flag_table_builds_a_parser_of_its_own() -> None:
    """Nothing in `add_flags` is the proxy's: a table of two makes a parser of two groups."""
    flags = [Flag("--size-of-it", "one", "how big", int, 3, lowest=1), Flag("--on", "two", "on or off", default=False)]
    parser = argparse.ArgumentParser()
    add_flags(parser, flags)
    args = parser.parse_args(["--size-of-it", "0"])
    assert args.size_of_it == 0 and args.on is False
    assert check_flags(args, flags) == "--size-of-it must be at least 1, not 0"
    assert markdown_table(flags).splitlines()[2] == "| `--size-of-it` | 3 | how big |"

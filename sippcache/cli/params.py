"""The options and arguments several commands share, and the value types they parse.

Sizes and ages are parsed by callbacks rather than `click.ParamType`
subclasses: their message is the same (``Invalid value for '--max-bytes'``),
and a callback types the same on every click version the package accepts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import TypeVar

import click

from ..options import Size
from ..registry import URL_ENVIRONMENT_VARIABLE, default_url

F = TypeVar("F", bound=Callable[..., object])

#: A file that must exist (`--model`, `--prompt-file`).
EXISTING_FILE = click.Path(exists=True, dir_okay=False)

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", re.IGNORECASE)


def url_argument(fn: F) -> F:
    """The cache URL, as an optional argument or ``--cache URL`` (resolved by `resolve_url`)."""
    fn = click.option("--cache", "cache_option", metavar="URL", help="The cache URL (same as the URL argument).")(fn)
    return click.argument("url", required=False, metavar="[URL]")(fn)


def resolve_url(url: str | None, cache_option: str | None) -> str:
    """The URL given as argument or option (not two different ones), else `default_url()`."""
    if url is not None and cache_option is not None and url != cache_option:
        raise click.UsageError("give the cache URL as an argument or with --cache, not both")
    return url or cache_option or default_url()


def is_default_store(url: str | None, cache_option: str | None) -> bool:
    """Whether the user named no store (no URL argument, no --cache, no SIPPCACHE_URL), so
    `resolve_url` gives the default one in the user cache folder. The reporting commands
    show that store as empty until it exists (`errors.open_store(default=True)`); a store
    the user named that does not exist stays an error."""
    return not (url or cache_option or os.environ.get(URL_ENVIRONMENT_VARIABLE, "").strip())


def parse_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A byte count: 1048576, 512MiB, 2GiB, 1.5GB."""
    if value is None:
        return None
    try:
        return Size.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


def parse_age(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """A duration: a number and a unit, s, m, h, d or w (30s, 15m, 12h, 7d, 2w)."""
    if value is None:
        return None
    match = _AGE.fullmatch(value)
    if match is None:
        raise click.BadParameter(f"{value!r} is not an age (examples: 30s, 15m, 12h, 7d, 2w)", ctx, param)
    return float(match.group(1)) * _AGE_UNITS[match.group(2).lower()]

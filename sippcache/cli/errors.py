"""One-line errors: what bad input or an unusable store causes is reported as
``error: <message>`` on stderr with exit code 2, never as a traceback.

Opening a store lives here too, because most of what can go wrong with a
command's input goes wrong there: a store that is not where the URL says.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, ParamSpec, TypeVar

import click

from ..errors import NoStore, SippcacheError
from ..protocol import CacheBackend
from ..registry import open as open_cache
from ..registry import parse_url
from .absent import absent_store

P = ParamSpec("P")
R = TypeVar("R")


class CLIError(click.ClickException):
    """A failure reported as one ``error: ...`` line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        """Print ``error: <message>`` in one line."""
        click.echo(f"error: {one_line(self.format_message())}", err=True)


def one_line(text: str) -> str:
    """`text` with its whitespace runs (newlines too) made single spaces."""
    return " ".join(text.split()) or "unknown error"


#: What bad input or an unusable store raises (backends translate their
#: libraries' errors into `SippcacheError`s): one line, not a traceback.
EXPECTED_ERRORS = (SippcacheError, ValueError, OSError)


def one_line_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn the errors bad input causes into `CLIError` (``error: <message>``, exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except Exception as exc:
            if not isinstance(exc, EXPECTED_ERRORS):
                raise
            raise CLIError(str(exc) or type(exc).__name__) from None

    return wrapper


class OneLineUsageErrors(click.Group):
    """A group whose usage errors (unknown option, bad value, ...) are one line too."""

    def make_context(
        self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any
    ) -> click.Context:
        with _usage_errors_in_one_line():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_errors_in_one_line():
            return super().invoke(ctx)


_NoArgsIsHelp: tuple[type[BaseException], ...] = tuple(
    cls for cls in [getattr(click.exceptions, "NoArgsIsHelpError", None)] if cls is not None
)


@contextmanager
def _usage_errors_in_one_line() -> Iterator[None]:
    try:
        yield
    except _NoArgsIsHelp:  # `sippcache` alone prints the help
        raise
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        raise CLIError(one_line(exc.format_message()) + hint) from None


def same_store(a: str, b: str) -> bool:
    """Whether two URLs name one store: same backend, same location (paths
    compared absolute). A backend without a location (``ram://``) has no
    store to share."""
    name_a, location_a, _ = parse_url(a)
    name_b, location_b, _ = parse_url(b)
    if name_a != name_b or not location_a:
        return False
    return os.path.realpath(os.path.expanduser(location_a)) == os.path.realpath(os.path.expanduser(location_b))


def open_store(url: str, *, read_only: bool, must_exist: bool = True, default: bool = False) -> CacheBackend:
    """Open the store `url` names; with `must_exist`, never create one where
    there is none. `read_only`: the command only reads (stats, ls, verify
    without --delete, copy's source), so a store this user may not write can
    still be inspected. `default`: `url` is the default store, which the user
    did not name (see `params.is_default_store`); if it does not exist yet, an
    empty read-only `AbsentStore` stands in for it instead of `NoStore`."""
    try:
        return open_cache(url, read_only=read_only, must_exist=must_exist)
    except NoStore:
        absent = absent_store(url) if default else None
        if not isinstance(absent, CacheBackend):  # None: not the default, or not merely absent
            raise
        return absent

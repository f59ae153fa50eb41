"""One-line errors: what bad input or an unusable store causes is reported as
``error: <message>`` on stderr with exit code 2, never as a traceback.

Opening a store lives here too, because most of what can go wrong with a
command's input goes wrong there: a store that is not where the URL says.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, ParamSpec, TypeVar

import click

from ..errors import SippcacheError
from ..protocol import CacheBackend
from ..registry import open as open_cache
from ..registry import parse_url

P = ParamSpec("P")
R = TypeVar("R")

#: The file each built-in persistent backend keeps in its directory: without it there is no store.
_STORE_FILES = {"lmdb": "data.mdb", "diskcache": "cache.db"}


class CLIError(click.ClickException):
    """A failure reported as one ``error: ...`` line on stderr, exit code 2."""

    exit_code = 2

    def show(self, file: IO[Any] | None = None) -> None:
        """Print ``error: <message>`` in one line."""
        click.echo(f"error: {one_line(self.format_message())}", err=True)


def one_line(text: str) -> str:
    """`text` with its whitespace runs (newlines too) made single spaces."""
    return " ".join(text.split()) or "unknown error"


def _expected_errors() -> tuple[type[BaseException], ...]:
    """What bad input or an unusable store raises: reported in one line, not as a traceback."""
    errors: list[type[BaseException]] = [SippcacheError, ValueError, OSError, sqlite3.Error]
    lmdb = sys.modules.get("lmdb")  # only if a store used it: the package is optional
    if lmdb is not None:
        errors.append(lmdb.Error)
    return tuple(errors)


def one_line_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn the errors bad input causes into `CLIError` (``error: <message>``, exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except Exception as exc:
            if not isinstance(exc, _expected_errors()):
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


def store_path(url: str) -> tuple[str, str] | None:
    """(backend, absolute directory) for the built-in persistent backends; None otherwise."""
    name, location, _ = parse_url(url)
    if name not in _STORE_FILES or not location:
        return None
    return name, os.path.abspath(os.path.expanduser(location))


def open_store(url: str, *, read_only: bool, must_exist: bool = True) -> CacheBackend:
    """Open the store `url` names; with `must_exist`, never create one where there is none.

    `read_only` says the command only reads (stats, ls, verify without
    --delete, copy's source): `sippcache.open` has no read-only mode yet, so
    such a store is still opened for writing.
    """
    where = store_path(url)
    if must_exist and where is not None:
        name, path = where
        if not os.path.isdir(path):
            raise CLIError(f"no cache at {url} (directory {path} does not exist)")
        if not os.path.exists(os.path.join(path, _STORE_FILES[name])):
            raise CLIError(f"no cache at {url} ({path} holds no {name} store)")
    try:
        return open_cache(url)
    except sqlite3.Error as exc:  # its messages do not say which file
        raise CLIError(f"cannot open {url}: {exc}") from None

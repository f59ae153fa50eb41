"""The `sippcache` command: inspect, check, trim and copy cache stores; run the demo.

Every command that works on a store takes its URL as an argument or with
``--cache URL`` (default: `sippcache.default_url()`). Errors are one line on
stderr (``error: ...``), never a traceback: exit code 2 for bad input, a
store that cannot be used or a missing optional package, 1 for an aborted
confirmation or (verify) bad entries left in place.

- `errors`: one-line errors, and opening a command's store;
- `params`: the shared options and the values they parse;
- `output`: JSON, sizes, times, and tables that print data literally;
- `inspect_commands`, `maintain_commands`, `model_commands`: the commands.
"""

from __future__ import annotations

import click

from .errors import OneLineUsageErrors
from .inspect_commands import backends, ls, stats, verify
from .maintain_commands import clear, copy, pin, prune
from .model_commands import demo, proxy, serve, warm

__all__ = ["main"]


@click.group(cls=OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sippcache")
def main() -> None:
    """Persistent prefix-state cache for llama.cpp.

    Commands that work on a store take its URL as an argument or with --cache
    (default: $SIPPCACHE_URL, else an LMDB store in the user cache folder).
    """


for _command in (demo, backends, stats, ls, verify, prune, clear, pin, copy, warm, serve, proxy):
    main.add_command(_command)

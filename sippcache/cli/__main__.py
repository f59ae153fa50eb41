"""``python -m sippcache.cli``: the same as the `sippcache` command."""

from __future__ import annotations

from . import main

main()

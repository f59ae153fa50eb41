"""``python -m sippcache.server``: the same as ``sippcache serve``."""

import sys

from .cli import main

sys.exit(main(prog="python -m sippcache.server"))

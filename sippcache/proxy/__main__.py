"""``python -m sippcache.proxy``: the same as ``sippcache proxy``."""

import sys

from .cli import main

sys.exit(main(prog="python -m sippcache.proxy"))

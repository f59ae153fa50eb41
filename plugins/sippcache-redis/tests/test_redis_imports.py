"""The plugin is a separate distribution: it uses sippcache's public names only, and its
own modules (testing.py for one) use each other's public names only."""

from __future__ import annotations

import ast
from pathlib import Path

import sippcache_redis

PACKAGE = Path(sippcache_redis.__file__).parent


def test_no_private_names_are_imported() -> None:
    private = []
    for source in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            module = "." * node.level + (node.module or "")
            third_party = node.level == 0 and module.split(".")[0] not in ("sippcache", "sippcache_redis")
            if third_party:
                continue
            parts = [part for part in module.split(".") if part]
            names = [alias.name for alias in node.names]
            if any(part.startswith("_") for part in parts) or any(name.startswith("_") for name in names):
                private.append(f"{source.name}:{node.lineno}: from {module} import {', '.join(names)}")
    assert not private, "\n".join(private)

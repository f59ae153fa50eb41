"""The plugin is a separate distribution: it builds on sippcache's backend API only
(`sippcache.plugin`, with its promise), and its own modules (testing.py for one) use each
other's public names only."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import sippcache_redis

import sippcache

PACKAGE = Path(sippcache_redis.__file__).parent
TESTS = Path(__file__).parent
#: What the plugin may import of sippcache: the backend API, the conformance suite (with its
#: bounded waits) and the package's own names.
API = ("sippcache.plugin", "sippcache.testing")
#: And its tests: they also run the backend under the llama-cpp-python layer, as a user does.
TESTS_ALSO = ("sippcache.llama",)


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


def _sippcache_imports(source: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of sippcache in `source`, at any depth (functions
    and `TYPE_CHECKING` blocks too); names are empty for a plain ``import``."""
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "sippcache":
                    yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "sippcache":
            yield node.lineno, node.module or "", [alias.name for alias in node.names]


def _outside(sources: list[Path], allowed: tuple[str, ...]) -> list[str]:
    """The imports of sippcache in `sources` beyond its own names and the `allowed` modules."""
    found = []
    for source in sources:
        for line, module, names in _sippcache_imports(source):
            within = any(module == a or module.startswith(a + ".") for a in allowed)
            # ``from sippcache import X``: a name of the package's own, or one of the allowed modules
            own = module == "sippcache" and all(
                name in sippcache.__all__ or f"sippcache.{name}" in allowed for name in names
            )
            if not (within or own):
                found.append(f"{source.relative_to(TESTS.parent)}:{line}: {module} {names}")
    return found


def test_sippcache_is_imported_through_its_backend_api_only() -> None:
    """The package imports of sippcache only `sippcache`'s names and `sippcache.plugin`; its tests
    the conformance suite and the llama layer too. Nothing of sippcache's own modules
    (`sippcache.catalog`, `sippcache.engine`, ...), which change without notice."""
    package = _outside(sorted(PACKAGE.glob("*.py")), API)
    assert not package, "\n".join(package)
    tests = sorted(TESTS.glob("*.py"))
    outside = _outside(tests, API + TESTS_ALSO)
    assert not outside, "\n".join(outside)

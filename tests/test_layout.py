"""The package's shape: no import cycle between its modules, and no module too long to read whole.

A cycle, even one only the type checker follows (`if TYPE_CHECKING:`), means two modules
that cannot be understood, tested or moved one without the other; at run time it is an
import that works or fails by which module happens to be imported first. So the graph is
built from the source (every import at any depth: in functions and under
`TYPE_CHECKING` too), not from what Python happens to load.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sippcache"
#: A module longer than this holds more than one idea: split it along them.
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _packages_above(name: str) -> Iterator[str]:
    """The packages `name` lies in: importing it runs each one's ``__init__`` first."""
    parts = name.split(".")
    for end in range(1, len(parts)):
        yield ".".join(parts[:end])


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that module `name` imports, type-only imports included.

    ``import a.b`` and ``from a import b`` (b a module) depend on a.b; ``from a import x`` (x
    a name a's ``__init__`` re-exports) depends on a itself. Either also runs the packages
    above, except the importer's own: those are being imported already when it is, whatever
    it imports, so a package that imports its own modules is no cycle."""
    own = set(_packages_above(name)) | ({name} if path.name == "__init__.py" else set())
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, one level up per dot past the first
                parts = here.split(".")
                above = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{above}.{base}" if base else above
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    edges = set()
    for target in targets:
        if target in modules:
            edges.add(target)
        edges.update(p for p in _packages_above(target) if p in modules and p not in own)
    edges.discard(name)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for child in sorted(graph[node]):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def test_no_module_imports_one_that_imports_it_back() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_graph_sees_type_only_and_function_level_imports() -> None:
    """The checks above see what they claim to: a module's imports under `TYPE_CHECKING` and
    inside functions, and a re-export of a package's ``__init__``."""
    graph = _graph()
    assert "sippcache.blob" in graph["sippcache.tokens"]  # at module level
    assert "numpy" not in graph["sippcache.tokens"]  # (the package's modules only)
    assert "sippcache.state.buffers" in graph["sippcache.frame"]  # under TYPE_CHECKING
    assert "sippcache.demo.run" in graph["sippcache.cli.model_commands"]  # inside a function
    assert "sippcache.state" in graph["sippcache.cli.inspect_commands"]  # runs sippcache.state's __init__
    assert "sippcache" not in graph["sippcache.base"]  # its own package: imported already
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_800_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"

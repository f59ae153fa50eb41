"""Shared fixtures: real llama.cpp models (a generated tiny one, gemma-3-270m and SmolLM2-135M)."""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

# tests/plugins holds third-party distributions; their own tests run through test_plugins.py
# after the distributions are installed.
collect_ignore = ["plugins"]

# Whether a restore beats computing is measured (sippcache.state.rates), and on the tiny test model a
# short gain is cheaper to compute than to load: a test of what a restore gives would depend on
# the machine's speed. So every cache and proxy here restores what gains tokens, unless a test
# names its mode; the "auto" rule has tests of its own (test_proxy_rates.py, test_llama_rates.py).
os.environ["SIPPCACHE_RESTORE"] = "always"
# Rates a test measured are never kept for another (the tests of keeping them name a folder).
os.environ["SIPPCACHE_RATES_DIR"] = ""
# Under pytest-xdist every worker's llama.cpp (in process, and in the servers it starts, which inherit
# this) gets its share of the cores: llama.cpp's OpenMP threads spin at every operation's barrier, and
# two workers each running threads for every core took 344 s for six gemma tests that take 71 s with
# a thread a worker (2 cores, 2 workers). A worker's environment is set before it loads llama.cpp.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_THREAD_LIMIT", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_model_other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-other.gguf", seed=1)


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    from sippcache.demo.model import gemma_model_path

    return gemma_model_path()


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    from sippcache.demo.model import smollm2_model_path

    return smollm2_model_path()


@pytest.fixture
def ram_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder where the proxy would stage slot files: in /dev/shm where it has 2 GiB free (a
    container's is often 64 MB), else the test's own folder on disk. Removed at teardown."""
    import shutil
    import tempfile

    shm = Path("/dev/shm")
    room = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize if shm.is_dir() else 0
    folder = Path(tempfile.mkdtemp(dir=shm if room >= 2 << 30 else tmp_path))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def opened() -> Iterator[list[object]]:
    """Caches a test opens (append them); closed at teardown."""
    handles: list[object] = []
    yield handles
    for cache in handles:
        cache.close()  # type: ignore[attr-defined]


@pytest.fixture
def make_llama() -> Iterator[Callable[..., object]]:
    """Build `llama_cpp.Llama` (or a subclass) instances, closed at teardown."""
    import llama_cpp

    made = []

    def make(model_path: Path, cls: type = llama_cpp.Llama, **kwargs: object) -> object:
        options: dict[str, object] = {"n_ctx": 2048, "n_batch": 512, "verbose": False}
        options.update(kwargs)
        llm = cls(model_path=str(model_path), **options)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start `sippcache serve` processes (`start(args)`, see harness/servers.py); every one is
    stopped at teardown."""
    from harness.servers import Server

    started: list[Server] = []

    def start(args: Sequence[str], **kwargs: Any) -> Server:
        server = Server(args, tmp_path / f"server-{len(started)}.log", **kwargs)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


# -- test tiers ---------------------------------------------------------------------------------
#
# Every test is marked by what it needs (see CONTRIBUTING.md, "Running the tests"): nobody marks a
# test by hand. What a test needs is read from the fixtures it uses (directly or through other
# fixtures) and the names that its code, its fixtures' code and the helpers of ours they call
# (in tests/, harness/, plugins/*/tests/, followed as far as they go) refer to. A test that needs
# none of them and is not `slow` is `core`.

#: marker: the fixture names, names referred to in code, or string constants that mean the need.
NEEDS: dict[str, frozenset[str]] = {
    "model": frozenset(
        {"tiny_model", "tiny_model_other_weights", "write_tiny_model", "gemma_model", "gemma_model_path"}
        | {"smollm2_model", "smollm2_model_path", "make_llama"}
    ),
    "gemma": frozenset({"gemma_model", "gemma_model_path"}),
    "smollm2": frozenset({"smollm2_model", "smollm2_model_path"}),
    "llama_server": frozenset({"llama_server_binary", "LlamaServer", "ProxyServer"}),
    "redis": frozenset({"valkey_server", "valkey_cluster", "ValkeyServer", "ValkeyCluster"}),
    "lint": frozenset({"mypy", "ruff"}),  # run as commands: `python -m mypy`, `python -m ruff`
    "build": frozenset({"pip", "bdist_wheel", "sdist"}),  # `python -m pip install`, `setup.py sdist`
    # Not a need but a cost: a test that starts processes of its own (the `sippcache` command, writers
    # killed or forked) pays about a second for each Python that imports sippcache on 2 cores.
    "slow": frozenset({"subprocess", "Popen", "multiprocessing", "get_context", "fork", "spawn"}),
}
#: Markers that imply a model (set by hand on tests that reach a model some other way, e.g. the demo).
MODEL_MARKERS = ("gemma", "smollm2")
_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def _ours(filename: str) -> bool:
    """Code of the tests and their helpers: in this checkout, not in a package under test, not in
    a virtual environment kept in it (.venv)."""
    try:
        parts = Path(filename).resolve().relative_to(_ROOT).parts
    except ValueError:
        return False
    if not parts or parts[0] == "sippcache" or any(p.startswith(("sippcache_", ".")) for p in parts):
        return False
    return "site-packages" not in parts


#: id of a function or class: its words (every one lives as long as the session).
_WORDS: dict[int, frozenset[str]] = {}


def _words(obj: Any) -> frozenset[str]:
    """The names and string constants in `obj`'s code (a function, or a class's methods), and in
    the code of our helpers it refers to by name."""
    if id(obj) in _WORDS:
        return _WORDS[id(obj)]
    _WORDS[id(obj)] = frozenset()  # while being read: for a helper that refers back to it
    found: set[str] = set()
    if isinstance(obj, type):
        for member in list(vars(obj).values()):  # a copy: looking a member up may add to the class
            for func in (member, getattr(member, "__func__", None), getattr(member, "fget", None)):
                if isinstance(func, types.FunctionType):
                    found |= _words(func)
    else:
        func = inspect.unwrap(getattr(obj, "__func__", obj))
        code = getattr(func, "__code__", None)
        if code is not None and _ours(code.co_filename):
            codes = [code]
            while codes:
                current = codes.pop()
                found.update(current.co_names)
                for const in current.co_consts:
                    if isinstance(const, str):
                        found.add(const)
                    elif isinstance(const, types.CodeType):
                        codes.append(const)
            # Where a name may be defined: the function's module, and modules of ours it imports
            # inside a function (`from harness.servers import Server`).
            spaces = [func.__globals__]
            spaces += [
                vars(m) for n in found if (m := sys.modules.get(n)) and _ours(getattr(m, "__file__", None) or "")
            ]
            for name in sorted(n for n in found if n.isidentifier()):
                for space in spaces:
                    target = space.get(name)
                    if isinstance(target, type | types.FunctionType):
                        found |= _words(target)
    _WORDS[id(obj)] = frozenset(found)
    return _WORDS[id(obj)]


def needs(item: pytest.Item) -> set[str]:
    """The markers of what `item` needs (empty: a core test)."""
    words = set(getattr(item, "fixturenames", ()))
    # A fixture asked for by name (`request.getfixturevalue(request.param)`) is a parameter's value.
    callspec = getattr(item, "callspec", None)
    words |= {v for v in getattr(callspec, "params", {}).values() if isinstance(v, str)}
    words |= _words(getattr(item, "obj", None))
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    for defs in getattr(fixtureinfo, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            words |= _words(fixturedef.func)
    found = {marker for marker, signs in NEEDS.items() if words & signs}
    found |= {m for m in MODEL_MARKERS if item.get_closest_marker(m) is not None}
    if found & set(MODEL_MARKERS):
        found.add("model")
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker in sorted(needs(item)) or ["core"]:
            item.add_marker(marker)
        group = xdist_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


# -- running in parallel (pytest-xdist: `-n auto --dist loadgroup` in pyproject.toml's addopts) -----


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto`: one worker a core (xdist's own count), but none for the tests of a single file."""
    files = {str(arg).split("::")[0] for arg in config.args}
    if len(files) == 1 and Path(files.pop()).is_file():
        return 0
    return None


def xdist_group(item: pytest.Item) -> str | None:
    """The tests that must run on one worker, one after another: those sharing a module-scoped
    fixture of their own module (built once, not once a worker: tests/test_large_states.py's
    1 GiB runs, tests/test_plugins.py's installs)."""
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    module = getattr(getattr(item, "module", None), "__file__", None)
    for defs in getattr(fixtureinfo, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            if fixturedef.scope in ("module", "class", "package") and fixturedef.func.__code__.co_filename == module:
                return item.nodeid.split("::")[0]
    return None

"""Security: a cache directory is data that other users or processes may be able to
write, and KV state holds users' prompts.

- no code-execution primitives in the package (pickle, eval, exec, marshal, ...);
- crafted headers and records cannot make msgpack allocate gigabytes;
- store directories are 0700 and their files 0600, and hold no freed memory of the process;
- tenants (scopes, namespaces) never see each other's entries;
- nothing is read, written or deleted outside the store directory, whatever
  symbolic links or file names were planted in it;
- a tampered diskcache row is never unpickled, and does not take the store down.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import random
import sqlite3
import stat
import struct
import subprocess
import sys
import textwrap
import tokenize
import tracemalloc
from pathlib import Path

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import sippcache
from harness.llama_tools import last_logits, reference_logits
from sippcache import CorruptEntry, SippcacheError, frame
from sippcache.state.chunkentries import is_chunk_namespace
from tests.reliability_tools import SLOW

SCRIPT = Path(sys.executable).with_name("sippcache")
PACKAGE = Path(sippcache.__file__).parent


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"the sippcache console script is not installed at {SCRIPT}"
    result = subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"}
    )
    assert result.returncode >= 0, f"sippcache {args[0]} was killed by signal {-result.returncode}: {result.stderr}"
    return result


def big_frame(key: list[int], byte: int = 0x43, size: int = 60_000) -> bytes:
    """A frame large enough (>= 32 KiB) for diskcache to keep it in a value file of its own."""
    return frame.encode(key, [bytes([byte]) * size], fingerprint="fp", kind="test", created=1.0)


# -- 1. no code-execution primitives in the package source ---------------------------------------

#: Modules whose loaders run code found in data.
FORBIDDEN_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "pickletools",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "jsonpickle",
    "joblib",
    "copyreg",
}
#: Builtins that run or import code given as data.
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__", "breakpoint"}
#: Where dynamic imports are allowed, and why: backends are imported by the dotted
#: target named in BUILTINS or in an installed distribution's entry point
#: (docs/plugins.md), never by a name taken from a URL.
IMPORT_MODULE_ALLOWED = {"registry.py"}


def _package_sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 10, files
    return files


def _code_names(source: str) -> set[str]:
    """Every NAME token of the code itself (comments and strings, docstrings included, left out)."""
    return {tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.NAME}


def _scan(source: str, where: str, filename: str) -> list[str]:
    """What in `source` could run code found in data."""
    problems = []
    for name in sorted(_code_names(source) & (FORBIDDEN_MODULES | {"unpickle", "Unpickler"})):
        problems.append(f"{where}: uses the name {name!r}")
    for node in ast.walk(ast.parse(source, filename=where)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        for module in modules:
            if module.split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"{where}:{node.lineno}: imports {module}")
        # eval(...), exec(...), __import__(...), also when only referenced (f = eval) or
        # reached through builtins (builtins.eval, __builtins__["eval"], getattr(builtins, "eval")).
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_BUILTINS:
            problems.append(f"{where}:{node.lineno}: uses the builtin {node.id}")
        if (
            isinstance(node, ast.Attribute)
            and node.attr in FORBIDDEN_BUILTINS
            and isinstance(node.value, ast.Name)
            and node.value.id in ("builtins", "__builtins__")
        ):
            problems.append(f"{where}:{node.lineno}: uses builtins.{node.attr}")
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and node.slice.value in FORBIDDEN_BUILTINS
        ):
            problems.append(f"{where}:{node.lineno}: looks up {node.slice.value!r}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and any(isinstance(a, ast.Constant) and a.value in FORBIDDEN_BUILTINS for a in node.args)
        ):
            problems.append(f"{where}:{node.lineno}: getattr of a code-running builtin")
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("import_module", "__import__")
            and filename not in IMPORT_MODULE_ALLOWED
        ):
            problems.append(f"{where}:{node.lineno}: importlib.{node.attr} outside registry.py")
        if (
            isinstance(node, ast.keyword)
            and node.arg in ("allow_pickle", "shell")
            and not (isinstance(node.value, ast.Constant) and node.value.value is False)
        ):
            problems.append(f"{where}:{node.lineno}: {node.arg}={ast.unparse(node.value)}")
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("system", "popen")
            and isinstance(node.value, ast.Name)
            and node.value.id == "os"
        ):
            problems.append(f"{where}:{node.lineno}: os.{node.attr}")
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("load", "unsafe_load", "full_load")
            and isinstance(node.value, ast.Name)
            and node.value.id == "yaml"
        ):
            problems.append(f"{where}:{node.lineno}: yaml.{node.attr}")
    return problems


def test_package_source_has_no_code_execution_primitives() -> None:
    problems = []
    for path in _package_sources():
        problems += _scan(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)), path.name)
    assert problems == [], "\n".join(problems)


def test_dynamic_imports_are_confined_to_the_documented_entry_point_loader() -> None:
    """registry.py may import a backend's module, by the target BUILTINS or an
    installed distribution's entry point names (docs/plugins.md), nowhere else."""
    registry = (PACKAGE / "registry.py").read_text(encoding="utf-8")
    calls = [n for n in ast.walk(ast.parse(registry)) if isinstance(n, ast.Attribute) and n.attr == "import_module"]
    assert len(calls) == 1, "one dynamic import, in the backend loader"
    assert "entry_points(group=ENTRY_POINT_GROUP)" in registry


@pytest.mark.parametrize(
    "sample, found",
    [
        ("import pickle\n", "imports pickle"),
        ("from marshal import loads\n", "imports marshal"),
        ("import shelve as s\n", "imports shelve"),
        ("x = eval('1')\n", "builtin eval"),
        ("f = exec\n", "builtin exec"),
        ("m = __import__('os')\n", "builtin __import__"),
        ("import builtins\nbuiltins.eval('1')\n", "builtins.eval"),
        ("g = __builtins__['exec']\n", "looks up 'exec'"),
        ("g = getattr(b, 'eval')\n", "getattr"),
        ("import importlib\nimportlib.import_module(name)\n", "import_module outside"),
        ("np.load(f, allow_pickle=True)\n", "allow_pickle=True"),
        ("subprocess.run(cmd, shell=True)\n", "shell=True"),
        ("os.system(cmd)\n", "os.system"),
        ("x = cloudpickle.loads(b)\n", "'cloudpickle'"),
    ],
)
def test_the_scan_is_not_blind(sample: str, found: str) -> None:
    problems = _scan(sample, "sample.py", "sample.py")
    assert any(found in problem for problem in problems), problems


def test_the_scan_ignores_words_in_comments_and_strings() -> None:
    sample = '"""never pickle, never eval"""\n# no marshal here\nx = "exec"\nllm.eval(tokens)\n'
    assert _scan(sample, "sample.py", "sample.py") == []


_IMPORT_PROBE = textwrap.dedent(
    """
    import json, sys
    import sippcache
    names = json.loads(sys.argv[1])
    before = set(sys.modules)
    results = {}
    for name in names:
        try:
            sippcache.open(name + "://somewhere")
            results[name] = "opened"
        except sippcache.UnknownBackend:
            results[name] = "UnknownBackend"
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
    imported = sorted(name for name in set(sys.modules) - before if name.split(".")[0] in names)
    print(json.dumps({"results": results, "imported": imported}))
    """
)


def test_url_schemes_never_import_modules_by_name() -> None:
    """The scheme picks a registered backend; it is never imported as a module name
    (``this`` would print the Zen of Python, ``antigravity`` open a browser)."""
    names = ["this", "antigravity", "os", "subprocess", "sippcache.cli", "sippcache.backends.ram", "http.server"]
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, json.dumps(names)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report["results"].values()) == {"UnknownBackend"}, report
    assert report["imported"] == [], report
    assert "Zen of Python" not in result.stdout


# -- 2. msgpack decoding with size limits ---------------------------------------------------------


def _reframe(raw_header: bytes, payload: bytes = b"") -> bytes:
    prefix = struct.pack(
        "<8sHIQ", frame.MAGIC, frame.FORMAT_VERSION, len(raw_header), xxhash.xxh3_64_intdigest(raw_header)
    )
    return prefix + raw_header + payload


def _in_map(name: str, raw_value: bytes) -> bytes:
    return b"\x81" + msgpack.packb(name) + raw_value


CRAFTED_HEADERS = {
    "array32 of 2**31": b"\xdd\x80\x00\x00\x00",
    "array32 of 2**32-1": b"\xdd\xff\xff\xff\xff",
    "map32 of 2**31": b"\xdf\x80\x00\x00\x00",
    "bin32 of 2**31": b"\xc6\x80\x00\x00\x00",
    "str32 of 2**31": b"\xdb\x80\x00\x00\x00",
    "ext32 of 2**31": b"\xc9\x80\x00\x00\x00\x01",
    "tokens: bin32 of 2**32-1": _in_map("tokens", b"\xc6\xff\xff\xff\xff"),
    "sizes: array32 of 2**31": _in_map("sizes", b"\xdd\x80\x00\x00\x00"),
    "versions: map32 of 2**31": _in_map("versions", b"\xdf\x80\x00\x00\x00"),
    "meta: map32 of 2**31": _in_map("meta", b"\xdf\x80\x00\x00\x00"),
    "100k nested arrays": b"\x91" * 100_000 + b"\xc0",
    "50k nested maps": b"\x81\xa1k" * 50_000 + b"\xc0",
    "nested then 2**32-1": b"\x91" * 500 + b"\xdd\xff\xff\xff\xff",
    "65535 empty arrays": b"\xdc\xff\xff" + b"\x90" * 65_535,
    "ext type (timestamp)": _in_map("created", b"\xd6\xff\x00\x00\x00\x01"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED_HEADERS))
def test_crafted_header_is_corrupt_without_allocating(name: str) -> None:
    """A header whose hash is right but that declares huge or deep structures is refused
    with CorruptEntry, and decoding it allocates no more than a few MB."""
    data = _reframe(CRAFTED_HEADERS[name])
    tracemalloc.start()
    try:
        with pytest.raises(CorruptEntry):
            frame.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"decoding a {len(data)}-byte crafted frame allocated {peak} bytes"


def test_header_length_field_cannot_claim_gigabytes() -> None:
    data = bytearray(_reframe(msgpack.packb({"tokens": b""})))
    for declared in (2**31, 2**32 - 1, frame.MAX_HEADER_BYTES + 1):
        struct.pack_into("<I", data, 10, declared)
        with pytest.raises(CorruptEntry):
            frame.decode(bytes(data))


def _lmdb_raw_put(path: Path, records: dict[bytes, bytes]) -> None:
    import lmdb

    env = lmdb.open(str(path), subdir=True, max_dbs=0, map_size=2**30)
    try:
        with env.begin(write=True) as txn:
            for key, value in records.items():
                txn.put(key, value)
    finally:
        env.close()


def _lmdb_keys(path: Path, prefix: bytes) -> list[bytes]:
    import lmdb

    env = lmdb.open(str(path), subdir=True, max_dbs=0, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return [bytes(k) for k, _ in txn.cursor() if bytes(k).startswith(prefix)]
    finally:
        env.close()


@pytest.mark.parametrize(
    "crafted",
    [b"\xdd\x80\x00\x00\x00", b"\xdf\xff\xff\xff\xff", b"\x94\xc6\xff\xff\xff\xff", b"\x91" * 100_000],
    ids=["array 2**31", "map 2**32-1", "bin 2**32-1 inside", "deeply nested"],
)
def test_crafted_store_records_cannot_allocate_or_break_the_store(tmp_path: Path, crafted: bytes) -> None:
    """The engine's own records (M: entry metadata) are msgpack too: a crafted one is
    skipped as damaged, with bounded memory, and every other entry stays readable."""
    store = tmp_path / "store"
    url = f"lmdb://{store}?max_bytes=256MiB&map_size=1GiB"
    with sippcache.open(url) as cache:
        for i in range(3):
            cache.store([5, i], frame.encode([5, i], [bytes([i]) * 100], fingerprint="f", kind="k"), namespace="n")
    victim = _lmdb_keys(store, b"M")[0]
    _lmdb_raw_put(store, {victim: crafted})
    tracemalloc.start()
    try:
        with sippcache.open(url) as cache:
            assert len(cache) == 2
            found = [cache.lookup([5, i], namespace="n") for i in range(3)]
            assert sum(m is not None and m.length == 2 for m in found) == 2
            for m in found:
                if m is not None:
                    m.release()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak


_LOG_WRITER = textwrap.dedent(
    """
    import struct, sys, lmdb
    env = lmdb.open(sys.argv[1], subdir=True, max_dbs=0, map_size=2**30)  # the map size the store was opened with
    with env.begin(write=True) as txn:
        seq = struct.unpack("<Q", txn.get(b"S"))[0] + 1
        txn.put(b"L" + struct.pack(">Q", seq), bytes.fromhex(sys.argv[2]))
        txn.put(b"S", struct.pack("<Q", seq))
    env.close()
    """
)


@pytest.mark.parametrize(
    "crafted",
    [b"\xdd\x80\x00\x00\x00", b"\x92\xa1p\xc6\xff\xff\xff\xff", b"\xc1"],
    ids=["array 2**31", "put with bin 2**32-1", "invalid"],
)
def test_crafted_log_record_from_another_process_is_survived(tmp_path: Path, crafted: bytes) -> None:
    """Another process appends a crafted change-log record while this one has the
    store open: this handle's next operation neither fails nor allocates much."""
    store = tmp_path / "store"
    with sippcache.open(f"lmdb://{store}?max_bytes=256MiB&map_size=1GiB") as cache:
        cache.store([1, 2], b"one", namespace="n")
        cache.store([1, 2, 3], b"two", namespace="n")
        result = subprocess.run(
            [sys.executable, "-c", _LOG_WRITER, str(store), crafted.hex()], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        tracemalloc.start()
        try:
            assert len(cache) == 2
            with cache.lookup([1, 2, 3, 4], namespace="n") as match:
                assert bytes(match.blob) == b"two"
            cache.store([1, 2, 3, 4], b"three", namespace="n")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * 2**20, peak
        assert len(cache) == 3


# -- 3. modes: 0700 directories, 0600 files ---------------------------------------------------------


def _modes(root: Path) -> list[tuple[str, str]]:
    """Every path under `root` (itself included) whose mode is not 0700 (directory) / 0600 (file)."""
    wrong = []
    for path in [root, *sorted(root.rglob("*"))]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            wrong.append((str(path), "symlink"))
        elif (path.is_dir() and mode != 0o700) or (path.is_file() and mode != 0o600):
            wrong.append((str(path), oct(mode)))
    return wrong


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o000], ids=["umask022", "umask002", "umask000"])
@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
def test_store_directories_are_private(tmp_path: Path, backend: str, umask: int) -> None:
    store = tmp_path / "parent" / "store"
    old = os.umask(umask)
    try:
        cache = sippcache.open(f"{backend}://{store}")
        try:
            for i in range(6):  # small entries (inline in SQLite) and large ones (diskcache value files)
                cache.store([9, i], big_frame([9, i], size=100 if i % 2 else 60_000), namespace="private")
            names = {p.name for p in store.iterdir()}
            expected = {"data.mdb", "lock.mdb"} if backend == "lmdb" else {"cache.db"}
            assert expected <= names, names
            if backend == "diskcache":
                assert len(list(store.glob("*/*/*.val"))) == 3
            assert _modes(store) == [], "while open"
        finally:
            cache.close()
        assert _modes(store) == [], "after close"
        # Another process opening (and writing to) the store keeps it private too.
        code = f"import sippcache\nwith sippcache.open({f'{backend}://{store}'!r}) as c: c.store([8], b'x' * 40000)"
        assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
        assert _modes(store) == [], "after another process wrote"
    finally:
        os.umask(old)


def test_lmdb_pages_never_carry_the_processs_freed_memory_to_disk(tmp_path: Path) -> None:
    """LMDB builds each page it writes in memory from malloc; with its `meminit`
    off, a page's unused bytes are whatever that memory last held (another
    tenant's prompt, a secret) and go into the store file, which may be copied
    or shared."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    marker = b"sippcache-freed-secret!"
    filler = (marker * (4096 // len(marker) + 1))[:4096]
    with sippcache.open(f"lmdb://{tmp_path / 'store'}") as cache:
        for i in range(40):
            freed = [libc.malloc(4096) for _ in range(64)]
            for address in freed:
                ctypes.memmove(address, filler, 4096)
            for address in freed:
                libc.free(address)
            cache.store([i, 1, 2], b"v" * 100)
    assert (tmp_path / "store" / "data.mdb").read_bytes().count(marker) == 0


# -- 4. tenants never see each other's entries ----------------------------------------------------


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 260) for _ in range(n - 1)]


def test_scopes_never_share_entries_and_the_cli_lists_them_apart(make_llama, tiny_model, tmp_path: Path) -> None:
    from sippcache.llama import PrefixCache

    url = f"lmdb://{tmp_path / 'store'}"
    tokens = _prompt(100)
    _, never_cached = reference_logits(make_llama, tiny_model, tokens, n_ctx=256)
    with PrefixCache(make_llama(tiny_model, n_ctx=256), url, scope="tenant-a") as a:
        assert a.prefill(tokens) == 0
    llm = make_llama(tiny_model, n_ctx=256)
    with PrefixCache(llm, url, scope="tenant-b") as b:
        assert b.prefill(tokens) == 0  # the identical prompt of tenant-a is not visible
        assert (b.stats()["hits"], b.stats()["corrupt_entries"]) == (0, 0)
        np.testing.assert_array_equal(last_logits(llm), never_cached)
    assert a.namespace != b.namespace
    with PrefixCache(make_llama(tiny_model, n_ctx=256), url, scope="tenant-a") as again:
        assert again.prefill(tokens) == 99

    with sippcache.open(url) as cache:
        for pc, scope in ((a, "tenant-a"), (b, "tenant-b")):
            with cache.lookup(tokens, namespace=pc.namespace) as match:
                assert frame.decode(match.blob).meta["scope"] == scope
            assert [e.namespace for e in cache.entries(pc.namespace)] == [pc.namespace]

    listed_a = json.loads(run_cli("ls", url, "--namespace", a.namespace, "--json").stdout)
    listed_b = json.loads(run_cli("ls", url, "--namespace", b.namespace, "--json").stdout)
    assert [row["namespace"] for row in listed_a] == [a.namespace]
    assert [row["namespace"] for row in listed_b] == [b.namespace]
    other = a.namespace.rsplit("/", 1)[0] + "/tenant-c"
    assert json.loads(run_cli("ls", url, "--namespace", other, "--json").stdout) == []
    stats = json.loads(run_cli("stats", url, "--json").stdout)
    rows = sorted((row["scope"], row["entries"]) for row in stats["namespaces"])
    # Each tenant's 99-token state: its tail, and its first 64 tokens' chunk in a namespace of its own.
    assert [row for row in rows if not is_chunk_namespace(row[0])] == [("tenant-a", 1), ("tenant-b", 1)]
    chunk_rows = [row for row in rows if is_chunk_namespace(row[0])]
    assert [(scope.split("\u2022")[0], n) for scope, n in chunk_rows] == [("tenant-a", 1), ("tenant-b", 1)]
    assert sorted(row["namespace"] for row in stats["chunked"]) == sorted([a.namespace, b.namespace])


namespace_st = st.text(max_size=12)
tokens_st = st.lists(st.integers(0, 20), min_size=1, max_size=8)


@settings(max_examples=3000 if SLOW else 400, deadline=None, derandomize=True, database=None)
@given(a=namespace_st, b=namespace_st, tokens=tokens_st, query_tail=st.lists(st.integers(0, 20), max_size=4))
def test_namespaces_never_see_each_other(a: str, b: str, tokens: list[int], query_tail: list[int]) -> None:
    if a == b:
        return
    with sippcache.open("ram://") as cache:
        cache.store(tokens, b"A:" + a.encode("utf-8", "surrogatepass"), namespace=a)
        cache.store(tokens[:1], b"B:" + b.encode("utf-8", "surrogatepass"), namespace=b)
        query = tokens + query_tail
        for partial in (False, True):
            with cache.lookup(query, namespace=a, partial=partial) as match:
                assert bytes(match.blob).startswith(b"A:") and match.namespace == a
            with cache.lookup(query, namespace=b, partial=partial) as match:
                assert bytes(match.blob).startswith(b"B:") and match.namespace == b
        assert [e.namespace for e in cache.entries(a)] == [a]
        assert cache.delete(tokens, namespace=b) is (len(tokens) == 1)
        with cache.lookup(tokens, namespace=a) as match:
            assert bytes(match.blob).startswith(b"A:")


# -- 5. nothing outside the store directory is followed, read, written or deleted -----------------

STORE_FILES = {"lmdb": ["data.mdb", "lock.mdb"], "diskcache": ["cache.db", "cache.db-wal", "cache.db-shm"]}


@pytest.mark.parametrize("target_exists", [True, False], ids=["to-a-file", "dangling"])
@pytest.mark.parametrize("backend, name", [(backend, name) for backend, names in STORE_FILES.items() for name in names])
def test_planted_symlink_store_file_is_refused(tmp_path: Path, backend: str, name: str, target_exists: bool) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    target = tmp_path / "elsewhere" / "victim"
    target.parent.mkdir()
    if target_exists:
        target.write_bytes(b"someone else's file\n")
    (store / name).symlink_to(target)
    with pytest.raises(SippcacheError, match="is not a regular file"), sippcache.open(f"{backend}://{store}") as cache:
        cache.store([1, 2, 3], b"secret prompt state")
    if target_exists:
        assert target.read_bytes() == b"someone else's file\n"
    else:
        assert not target.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == (["victim"] if target_exists else [])


def test_planted_symlinked_value_folders_are_not_written_through(tmp_path: Path) -> None:
    """diskcache keeps value files in <store>/xx/yy/: folders planted there as links to
    another directory must not receive users' entries."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir(mode=0o700)
    outside.mkdir()
    for i in range(256):
        (store / f"{i:02x}").symlink_to(outside, target_is_directory=True)
    try:
        with sippcache.open(f"diskcache://{store}") as cache:
            cache.store([1, 2, 3], big_frame([1, 2, 3]), namespace="n")
            with cache.lookup([1, 2, 3], namespace="n") as match:
                assert bytes(match.blob) == big_frame([1, 2, 3])
    except SippcacheError:
        pass  # refusing the store is fine too
    leaked = sorted(str(p.relative_to(outside)) for p in outside.rglob("*"))
    assert leaked == [], f"a user's entry was written outside the store: {leaked}"


def _diskcache_with_tampered_value_file(tmp_path: Path, how: str) -> tuple[str, Path, bytes]:
    """A diskcache store whose row for [1, 2, 3] names a value file outside the store (set
    with sqlite3, as anyone able to write cache.db could); the outside file holds a valid
    frame for the same key, so reading it would be visible. (url, outside file, its bytes)."""
    store = tmp_path / "a" / "store"
    url = f"diskcache://{store}"
    with sippcache.open(url) as cache:
        cache.store([1, 2, 3], big_frame([1, 2, 3]), namespace="n")
        cache.store([4, 5], big_frame([4, 5], byte=0x44), namespace="n")
    outside = tmp_path / "outside.val"
    content = big_frame([1, 2, 3], byte=0x58)
    outside.write_bytes(content)
    db = sqlite3.connect(store / "cache.db")
    try:
        rows = db.execute("SELECT rowid, filename FROM Cache WHERE filename IS NOT NULL").fetchall()
        assert len(rows) == 2, rows
        ((rowid, original),) = [(r, f) for r, f in rows if (store / f).read_bytes() == big_frame([1, 2, 3])]
        if how == "symlinked file":
            (store / original).unlink()
            (store / original).symlink_to(outside)
        else:
            name = "../../outside.val" if how == "relative" else str(outside)
            db.execute("UPDATE Cache SET filename = ? WHERE rowid = ?", (name, rowid))
            db.commit()
    finally:
        db.close()
    return url, outside, content


TAMPERINGS = ["relative", "absolute", "symlinked file"]


@pytest.mark.parametrize("how", TAMPERINGS)
def test_value_file_outside_the_store_is_never_read_or_deleted(tmp_path: Path, how: str) -> None:
    url, outside, content = _diskcache_with_tampered_value_file(tmp_path, how)

    def intact() -> None:
        assert outside.exists() and outside.read_bytes() == content

    with sippcache.open(url + "?max_entries=2") as cache:
        assert cache.lookup([1, 2, 3], namespace="n") is None  # never the outside bytes
        intact()
        with cache.lookup([4, 5], namespace="n") as match:
            assert bytes(match.blob) == big_frame([4, 5], byte=0x44)
        for action in (
            lambda: cache.delete([1, 2, 3], namespace="n"),
            lambda: cache.store([6], b"evicts the oldest", namespace="n"),
            lambda: cache.store([7], b"and the next", namespace="n"),
            cache.clear,
        ):
            try:
                action()
            except SippcacheError:
                pass  # refusing is acceptable here; touching the outside file is not
            intact()
    for flags in ((), ("--delete",)):
        run_cli("verify", url, "--json", *flags)
        intact()


@pytest.mark.parametrize("how", TAMPERINGS)
def test_store_with_a_tampered_value_row_stays_usable_and_repairable(tmp_path: Path, how: str) -> None:
    """The tampered row must not wedge the store: deleting it, evicting it, clearing
    the store and `sippcache verify --delete` all work (without touching the file)."""
    url, outside, content = _diskcache_with_tampered_value_file(tmp_path, how)
    failures = []
    with sippcache.open(url + "?max_entries=2") as cache:
        for name, action in (
            (
                "store (evicting the tampered entry)",
                lambda: (cache.store([6], b"x", namespace="n"), cache.store([7], b"y", namespace="n")),
            ),
            ("clear", cache.clear),
        ):
            try:
                action()
            except SippcacheError as exc:
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
    assert outside.read_bytes() == content
    assert failures == []

    url, outside, content = _diskcache_with_tampered_value_file(tmp_path / "again", how)
    repaired = run_cli("verify", url, "--delete", "--json")
    assert repaired.returncode == 0, f"verify --delete could not remove the tampered entry: {repaired.stderr.strip()}"
    assert json.loads(run_cli("verify", url, "--json").stdout) == {"checked": 1, "bad": [], "deleted": 0}
    assert outside.read_bytes() == content


class _Planted:
    """Unpickling this creates a directory: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("row", ["entry value", "index record value", "key"])
def test_tampered_diskcache_row_is_never_unpickled_and_does_not_break_the_store(tmp_path: Path, row: str) -> None:
    """diskcache can store pickles (mode 4, or keys with raw = 0). A row tampered to
    hold one is never unpickled; it is a miss and every other entry stays usable."""
    store = tmp_path / "store"
    url = f"diskcache://{store}"
    marker = tmp_path / "code-ran"
    planted = pickle.dumps(_Planted(str(marker)))
    victim, bystander = [1, 2, 3], [4, 5]
    with sippcache.open(url) as cache:
        cache.store(victim, b"victim", namespace="n")
        cache.store(bystander, b"bystander", namespace="n")
    from sippcache.engine import entry_id

    eid = entry_id("n", struct.pack("<3I", *victim))
    db = sqlite3.connect(store / "cache.db")
    try:
        if row == "key":
            db.execute(
                "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, "
                "filename, value) VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
                (planted, b"x"),
            )
        else:
            record = (b"B" if row == "entry value" else b"M") + eid
            assert db.execute("UPDATE Cache SET mode = 4, value = ? WHERE key = ?", (planted, record)).rowcount == 1
        db.commit()
    finally:
        db.close()

    outcome: dict[str, object] = {}
    try:
        with sippcache.open(url) as cache:
            match = cache.lookup(victim, namespace="n")
            outcome["victim"] = None if match is None else bytes(match.blob)
            with cache.lookup(bystander, namespace="n") as match:
                outcome["bystander"] = bytes(match.blob)
            cache.store([6], b"new", namespace="n")
            with cache.lookup([6], namespace="n") as match:
                outcome["new"] = bytes(match.blob)
            cache.clear()
            outcome["cleared"] = len(cache)
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    assert not marker.exists(), "a pickle planted in the store was unpickled"
    # The tampered entry is a miss; a planted key row touches no entry of ours.
    expected_victim = b"victim" if row == "key" else None
    assert outcome == {"victim": expected_victim, "bystander": b"bystander", "new": b"new", "cleared": 0}, outcome

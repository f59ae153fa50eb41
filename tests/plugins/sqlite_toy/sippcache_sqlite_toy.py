"""A third-party backend: sippcache's engine over a SQLite table.

It exists to prove that a backend living in another distribution, found
through the `sippcache.backends` entry point, passes the conformance suite
unchanged. It implements only the transactional byte map that
`sippcache.KVBackend` needs.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import ClassVar

from sippcache import KVBackend
from sippcache.plugin import Size


class _Txn:
    """The engine's `KVTxn` on one connection, inside the transaction it began."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self._con = con

    def get(self, key: bytes) -> bytes | None:
        row = self._con.execute("SELECT v FROM kv WHERE k = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        self._con.execute("INSERT OR REPLACE INTO kv (k, v) VALUES (?, ?)", (key, bytes(value)))

    def delete(self, key: bytes) -> None:
        self._con.execute("DELETE FROM kv WHERE k = ?", (key,))

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes | memoryview]]:
        rows = self._con.execute("SELECT k, v FROM kv WHERE substr(k, 1, ?) = ?", (len(prefix), prefix))
        return iter(rows.fetchall())


class SQLiteBackend(KVBackend):
    """One SQLite file per store directory, one connection per thread and process."""

    persistent = True
    options: ClassVar[Mapping[str, type]] = {"max_bytes": Size, "max_entries": int}

    def __init__(self, location: str, *, max_bytes: int | None = None, max_entries: int | None = None) -> None:
        path = os.path.abspath(location)
        super().__init__(max_bytes=max_bytes, max_entries=max_entries, location=f"sqlitetoy://{path}")
        os.makedirs(path, exist_ok=True)
        self._file = os.path.join(path, "kv.sqlite")
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()

    def _con(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None or getattr(self._local, "pid", None) != os.getpid():
            con = sqlite3.connect(self._file, timeout=60, isolation_level=None, check_same_thread=False)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY, v BLOB NOT NULL)")
            self._local.con, self._local.pid = con, os.getpid()
            with self._all_lock:
                self._all.append(con)
        return con

    @contextmanager
    def _transaction(self) -> Iterator[_Txn]:
        con = self._con()
        con.execute("BEGIN IMMEDIATE")
        try:
            yield _Txn(con)
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")

    def _reader(self) -> tuple[_Txn, Callable[[], None]]:
        con = self._con()
        con.execute("BEGIN")

        def end() -> None:
            con.execute("COMMIT")

        return _Txn(con), end

    def _close_store(self) -> None:
        with self._all_lock:
            for con in self._all:
                con.close()
            self._all.clear()

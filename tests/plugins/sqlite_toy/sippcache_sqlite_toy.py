"""A third-party backend: sippcache's engine over a SQLite table.

It exists to prove that a backend living in another distribution, found
through the `sippcache.backends` entry point, passes the conformance suite
unchanged. It implements only the transactional byte map that
`sippcache.engine.KVBackend` needs.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import contextmanager

from sippcache.engine import KVBackend
from sippcache.options import Size


class _Txn:
    def __init__(self, con: sqlite3.Connection) -> None:
        self._con = con

    def get(self, key):
        row = self._con.execute("SELECT v FROM kv WHERE k = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key, value):
        self._con.execute("INSERT OR REPLACE INTO kv (k, v) VALUES (?, ?)", (key, bytes(value)))

    def delete(self, key):
        self._con.execute("DELETE FROM kv WHERE k = ?", (key,))

    def scan(self, prefix):
        rows = self._con.execute("SELECT k, v FROM kv WHERE substr(k, 1, ?) = ?", (len(prefix), prefix))
        return iter(rows.fetchall())


class SQLiteBackend(KVBackend):
    persistent = True
    options = {"max_bytes": Size, "max_entries": int}

    def __init__(self, location: str, *, max_bytes=None, max_entries=None) -> None:
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
    def _transaction(self):
        con = self._con()
        con.execute("BEGIN IMMEDIATE")
        try:
            yield _Txn(con)
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")

    def _reader(self):
        con = self._con()
        con.execute("BEGIN")
        return _Txn(con), lambda: con.execute("COMMIT")

    def _close_store(self) -> None:
        with self._all_lock:
            for con in self._all:
                con.close()
            self._all.clear()

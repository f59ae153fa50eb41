"""Where the server is: the location part of a ``redis://`` or ``rediss://`` URL.

`sippcache.open` hands a backend the URL's location already percent-decoded
(``unquote(netloc + path)``), so a password may now hold ``@``, ``:`` or ``/``.
Parsing therefore splits from the right at the last ``@`` (a host never
contains one) and at the first ``:`` of what is left of it (a user name never
contains one), which reads every password redis-py's own ``from_url`` reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_PORT = 6379
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}")


@dataclass(frozen=True)
class RedisAddress:
    """One server (or one cluster node) and the credentials to use on it."""

    host: str = "localhost"
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never printed
    tls: bool = False

    def display(self) -> str:
        """The URL without the password: what logs, errors and `Stats.location` show."""
        scheme = "rediss" if self.tls else "redis"
        user = ""
        if self.username or self.password is not None:
            user = (self.username or "") + (":***" if self.password is not None else "") + "@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{user}{host}:{self.port}/{self.db}"


def parse_location(location: str, *, tls: bool) -> RedisAddress:
    """`[user[:password]@]host[:port][/db]` (already percent-decoded) as a `RedisAddress`.

    Raises ValueError (reported by `sippcache.open` as `BadOption`) for a bad
    host, port or database number.
    """
    userinfo, at, hostpart = location.rpartition("@")
    username: str | None = None
    password: str | None = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = user or None
        password = secret if colon else None
    hostport, _slash, db_text = hostpart.partition("/")
    db_text = db_text.rstrip("/")
    if hostport.startswith("["):  # IPv6: [::1]:6379
        end = hostport.find("]")
        if end < 0:
            raise ValueError(f"unclosed '[' in the host of {_masked(location)!r}")
        host, rest = hostport[1:end], hostport[end + 1 :]
        if not host or not re.fullmatch(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9]+)?", host):
            raise ValueError(f"{host!r} is not an IPv6 address")
        if rest and not rest.startswith(":"):
            raise ValueError(f"unexpected {rest!r} after the IPv6 address")
        port_text = rest[1:]
    else:
        host, _, port_text = hostport.partition(":")
        if ":" in port_text:
            raise ValueError(f"write an IPv6 host in brackets, e.g. redis://[::1]:6379/0 (got {hostport!r})")
        host = host or "localhost"
        if not _HOST.fullmatch(host):
            raise ValueError(f"{host!r} is not a host name or address")
    port = DEFAULT_PORT
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"port must be a number in 1..65535, got {port_text!r}")
        port = int(port_text)
    db = 0
    if db_text:
        if not db_text.isdigit() or int(db_text) > 1_000_000:
            raise ValueError(f"the database must be a number, e.g. redis://host:6379/0 (got {db_text!r})")
        db = int(db_text)
    return RedisAddress(host, port, db, username, password, tls)


def _masked(location: str) -> str:
    _userinfo, at, hostpart = location.rpartition("@")
    return ("***@" if at else "") + hostpart

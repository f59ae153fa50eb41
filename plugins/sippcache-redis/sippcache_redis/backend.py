"""`redis://` and `rediss://`: one sippcache store on a Redis or Valkey server or cluster.

Every client process mirrors the store's catalog in memory (a
`sippcache.catalog.Catalog`: the radix index and the eviction order, the same
policy as every other backend) and keeps it in step through a change log on
the server. So a lookup is decided locally after ONE round trip (the "sync"
script, which returns the log records this client has not seen and, when due,
saves its batched recency updates), whatever the number of entries and the
length of the prompt; a hit then fetches its blob in chunks, pipelined in
16 MiB windows, so a 100 MB state never holds the server for one long command.

A store plans locally (eviction victims, supersession, generations: all in
the catalog) on a mirror that is exact at log position `seq`, uploads its
chunks, then commits with a script that applies the plan only if the store is
still at `seq`; otherwise the script returns the records in between and the
client plans again. Chunks are uploaded with a short time-to-live and given a
ten-year one after the commit, so a client that dies mid-store leaves nothing
behind, and a server with ``maxmemory-policy volatile-lru`` evicts only blobs.

Faults are misses: a server that is down, restarting, read-only, out of memory
or too slow makes lookups miss and stores drop (counted in `Stats.errors`,
warned about once per outage), and the handle skips the server for a short
backoff so a dead server costs each request at most `timeout`. Everything read
from the server is validated; what does not parse is a miss or triggers a
rebuild, never an exception. See docs/redis.md.
"""

from __future__ import annotations

import logging
import math
import random
import re
import secrets
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, NamedTuple

import xxhash

from sippcache import BadOption, BaseBackend, EntryInfo, Match, MissingDependency, Peek, Stats, StoreOptions
from sippcache.plugin import (
    UNSET,
    Budget,
    Change,
    Clear,
    Limit,
    Mark,
    Mirror,
    OutOfStep,
    Put,
    Remove,
    Size,
    StorePlan,
    check_limits,
    coerce_options,
    entry_id,
    hold_across_forks,
)

try:
    import redis
    import redis.exceptions as rexc
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # reported by `sippcache backends` as unusable, with the fix
    raise MissingDependency('the "redis" backend needs the redis package: pip install sippcache-redis') from exc

from .records import (
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    BadRecord,
    BlobRef,
    blob_of,
    pack_limit,
    pack_meta,
    pack_uses,
    pack_values,
    read_budget,
    read_clock,
    read_entry,
    read_record,
)
from .scripts import SCRIPTS
from .url import RedisAddress, parse_location

log = logging.getLogger("sippcache")

DEFAULT_MAX_BYTES = 1024**3
DEFAULT_TIMEOUT = 2.0
DEFAULT_CHUNK_SIZE = 1024**2
DEFAULT_PREFIX = "sippcache"
#: Bytes of chunks requested per round trip when fetching or uploading a blob.
WINDOW_BYTES = 16 * 1024**2
#: Chunks live this long until their entry is committed (a client that dies mid-store leaves nothing).
UPLOAD_TTL_MS = 15 * 60 * 1000
#: A committed entry's chunks get this (ten years) instead: long enough never to matter, and a TTL
#: makes them "volatile", so a server with maxmemory-policy volatile-lru evicts blobs, never the
#: metadata (which has none).
KEEP_TTL_MS = 10 * 365 * 86400 * 1000
#: Log records returned by one script call; a client further behind pages or rebuilds.
MAX_RECORDS = 256
#: Times a store (or pin, or clear) plans again after another client changed the store first,
#: waiting a random while (up to COMMIT_BACKOFF times the attempt, in seconds) before each: with
#: several writers in a loop and no wait, one lost 8 attempts in a row now and then (a store dropped).
COMMIT_ATTEMPTS, COMMIT_BACKOFF = 32, 0.002
#: After a failure the server is left alone this long (doubling up to the maximum).
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 5.0
#: Entries read per HSCAN call while rebuilding.
SCAN_COUNT = 1000

_PREFIX = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_TLS_OPTIONS: dict[str, type] = {
    "ssl_ca_certs": str, "ssl_ca_path": str, "ssl_certfile": str, "ssl_keyfile": str, "ssl_password": str,
    "ssl_cert_reqs": str, "ssl_check_hostname": bool, "ssl_ciphers": str,
}  # fmt: skip

#: Errors that mean the server cannot be used right now: back off, then try again. (A MOVED,
#: ASK or TRYAGAIN reply is not one: the cluster client has updated its slot map, so the
#: operation is a miss and the next one goes to the right node.)
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ReadOnlyError,
    rexc.ClusterError,
    rexc.RedisClusterException,
    OSError,
)


def _tls_failure(exc: BaseException) -> bool:
    """Whether a connection failed in the TLS handshake (an untrusted certificate, a wrong host
    name, TLS spoken to a plain server): a configuration problem, not an outage."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        if isinstance(seen, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class AccessDenied(BadOption):
    """The server refused the URL's credentials, or its ACL denies a command or key the
    backend needs. Raised at open (a `BadOption`: the URL must change); later, the same
    problem is an outage (misses, `Stats.errors`, a warning)."""


class _ServerError(Exception):
    """A server call failed; the operation becomes a miss or is dropped."""


class _Unavailable(_ServerError):
    """The server is down, unreachable, loading, read-only or too slow (or we are backing off)."""


class _Rebuild(Exception):
    """What the server returned cannot be applied to the mirror: rebuild it."""


class Chunks(NamedTuple):
    """The chunks of one entry: its id (their hash tag) and where its bytes are."""

    eid: bytes
    ref: BlobRef


class RedisBackend(BaseBackend):
    """A sippcache store on a Redis or Valkey server (or cluster), shared by every process
    that opens the same URL and prefix. See the module docstring and docs/redis.md."""

    persistent: ClassVar[bool] = True
    options: ClassVar[Mapping[str, type]] = {
        "max_bytes": Size, "max_entries": int, "prefix": str, "timeout": float, "cluster": bool,
        "chunk_size": Size, **_TLS_OPTIONS,
    }  # fmt: skip

    def __init__(
        self,
        location: str = "",
        *,
        max_bytes: Limit = UNSET,
        max_entries: Limit = UNSET,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT,
        cluster: bool | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        tls: bool = False,
        clock: Callable[[], float] = time.monotonic,
        **tls_options: Any,
    ) -> None:
        super().__init__()
        check_limits(max_bytes, max_entries)
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            raise ValueError(f"prefix must be 1 to 64 of A-Z a-z 0-9 . _ : - (got {prefix!r})")
        if not (math.isfinite(timeout) and 0 < timeout <= 3600):
            raise ValueError(f"timeout must be a number of seconds in (0, 3600], got {timeout}")
        if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be in {MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE} bytes, got {chunk_size}")
        unknown = set(tls_options) - set(_TLS_OPTIONS)
        if unknown:
            raise TypeError(f"unexpected options: {', '.join(sorted(unknown))}")
        if tls_options and not tls:
            raise ValueError(f"{', '.join(sorted(tls_options))}: TLS options need a rediss:// URL")
        reqs = tls_options.get("ssl_cert_reqs")
        if reqs is not None and reqs not in ("none", "optional", "required"):
            raise ValueError(f"ssl_cert_reqs must be none, optional or required, got {reqs!r}")
        self.address: RedisAddress = parse_location(location, tls=tls)
        if cluster and self.address.db != 0:
            raise ValueError("a Redis Cluster has only database 0")
        self.prefix = prefix
        self.timeout = float(timeout)
        self.chunk_size = int(chunk_size)
        self.location = self.address.display() + f"?prefix={prefix}"
        self._cluster_option = cluster
        self._tls_options = tls_options
        tag = "{" + prefix + "}"
        self._keys = [f"{tag}:state", f"{tag}:cat", f"{tag}:val", f"{tag}:log"]
        self._chunk_prefix = f"{prefix}:b:"

        self._lock = threading.RLock()
        self._connect_lock = threading.Lock()
        self._opening = True  # credentials and ACL problems raise AccessDenied only while opening
        self._redis: Any = None  # redis.Redis or redis.RedisCluster, made on first use
        self.cluster: bool | None = None  # known once connected
        #: The catalog as of the server's log record `seq` (-1: rebuild before use), with
        #: pending uses, damaged entries to delete, the budget and the counters.
        self._mirror = Mirror(
            self.location, max_bytes=max_bytes, max_entries=max_entries, default=Budget(DEFAULT_MAX_BYTES)
        )
        self._mirror.counters["errors"] = 0
        self._refs: dict[bytes, BlobRef] = {}  # where each entry of the mirror keeps its bytes
        self._epoch: bytes | None = None
        self._unsure: list[Chunks] = []  # uploads whose commit outcome is unknown
        #: Network exchanges made (a script call, a pipeline, a scan page): a diagnostic.
        self.round_trips = 0
        #: Uses of the server the backoff let through, whether it answered or not (a use
        #: skipped while backing off is not counted): a diagnostic.
        self.attempts = 0
        #: The clock the backoff runs on (seconds; `time.monotonic` unless the constructor's
        #: `clock` says otherwise). The seam for tests, which pass a clock they move by hand;
        #: redis-py's own timeouts do not read it. Not a URL option.
        self.clock = clock
        # Outage state: warn once per outage, skip the server while backing off.
        self._outage: str | None = None
        self._failed_operations = 0
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST
        self._warned: set[str] = set()
        hold_across_forks(self)
        try:
            self._open()
        except BaseException:
            if self._redis is not None:
                self._redis.close()
            raise
        finally:
            self._opening = False

    # -- fork handlers (`sippcache.engine.hold_across_forks`) ----------------------------

    def _hold_for_fork(self) -> None:  # never copy a handle in the middle of an operation
        self._lock.acquire()

    def _resume_after_fork(self) -> None:
        self._lock.release()

    def _renew_after_fork(self) -> None:  # the mirror stays valid; redis-py reconnects in the child by itself
        self._lock = threading.RLock()

    @property
    def max_bytes(self) -> int | None:
        """The byte budget this handle enforces (as of its last use of the server)."""
        return self._mirror.budget.max_bytes

    @property
    def max_entries(self) -> int | None:
        """The entry limit this handle enforces (as of its last use of the server)."""
        return self._mirror.budget.max_entries

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> RedisBackend:
        """Like `BaseBackend.from_url`, but `AccessDenied` reaches the caller as itself.

        The scheme is not part of `location`; `sippcache.open` gives it to no backend,
        so TLS is chosen by the class the entry point names (see `RedisTLSBackend`)."""
        kwargs = coerce_options(cls.__name__, options, cls.options)
        try:
            return cls(location, **kwargs)
        except BadOption:
            raise
        except ValueError as exc:
            raise BadOption(f"{cls.__name__}: {exc}") from exc

    # -- connecting ----------------------------------------------------------------

    def _open(self) -> None:
        """Connect and check permissions now, so a wrong password or a missing ACL
        permission is a clear error at open. A server that is down is not an error."""
        try:
            with self._server() as client:
                self._probe(client)
        except _Unavailable:
            pass  # already warned: outage mode until the server answers
        except _ServerError:
            pass

    def _connect(self) -> Any:
        """A client for the server, or for the cluster it belongs to (detected unless forced)."""
        address = self.address
        common: dict[str, Any] = dict(
            username=address.username,
            password=address.password,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            driver_info=None,
        )
        if address.tls:
            common["ssl"] = True
            common.update(self._tls_options)
        cluster = self._cluster_option
        if cluster is None:
            probe = redis.Redis(host=address.host, port=address.port, db=address.db, **common)
            try:
                try:
                    info = probe.info("cluster")
                    cluster = bool(info.get("cluster_enabled"))
                except rexc.NoPermissionError:  # INFO denied: a single server unless cluster=1 says otherwise
                    cluster = False
            finally:
                probe.close()
            if cluster and address.db != 0:
                raise BadOption(f"{address.display()} is a cluster node: a Redis Cluster has only database 0")
        client: redis.Redis | redis.RedisCluster
        if cluster:
            client = redis.RedisCluster(host=address.host, port=address.port, require_full_coverage=False, **common)
        else:
            client = redis.Redis(host=address.host, port=address.port, db=address.db, **common)
        self.cluster = cluster
        return client

    def _probe(self, client: Any) -> None:
        """Run every command this backend uses, on scratch keys under the prefix."""
        tag = "{" + self.prefix + "}"
        chunk = f"{self._chunk_prefix}{{probe}}:{secrets.token_hex(4)}:0"
        try:
            self._eval(client, "probe", [f"{tag}:probe", f"{tag}:probe:log"], [])
            pipe = client.pipeline(transaction=False)
            pipe.execute_command("SET", chunk, b"x", "PX", 10_000)
            pipe.execute_command("GET", chunk)
            pipe.execute_command("PEXPIRE", chunk, KEEP_TTL_MS)
            pipe.execute_command("UNLINK", chunk)
            pipe.execute()
            client.execute_command("HSCAN", self._keys[1], 0, "COUNT", 1)
            self.round_trips += 2
        except rexc.ResponseError as exc:
            text = str(exc)
            if (
                not isinstance(exc, rexc.NoPermissionError)
                and "no permissions" not in text.lower()
                and "acl failure" not in text.lower()
            ):
                raise
            user = self.address.username or "default"
            text = " ".join(text.split())  # one line
            raise AccessDenied(
                f"{self.address.display()}: the ACL of user {user!r} denies what sippcache needs: {text}"
            ) from None

    def _client(self) -> Any:
        if self._redis is None:
            with self._connect_lock:
                if self._redis is None:
                    self._redis = self._connect()
        return self._redis

    @contextmanager
    def _server(self) -> Iterator[Any]:
        """Around every use of the server: fail fast while backing off; turn the
        client's errors into `_Unavailable` / `_ServerError`; note outages and recoveries."""
        if self._outage is not None and self.clock() < self._retry_at:
            raise _Unavailable(self._outage)
        self.attempts += 1
        try:
            yield self._client()
        except BadOption as exc:  # AccessDenied, or a URL that does not fit the server
            if self._opening:
                raise
            self._went_down(exc)
            raise _Unavailable(str(exc)) from exc
        except rexc.AuthenticationError as exc:
            if self._opening:
                user = self.address.username or "default"
                raise AccessDenied(
                    f"{self.address.display()}: the server refused the credentials of user {user!r}: {exc}"
                ) from None
            self._went_down(exc)
            raise _Unavailable(str(exc)) from exc
        except _UNAVAILABLE as exc:
            if self._opening and _tls_failure(exc):
                text = " ".join(str(exc).split())
                raise AccessDenied(f"{self.address.display()}: TLS with the server failed: {text}") from None
            self._went_down(exc)
            raise _Unavailable(str(exc)) from exc
        except rexc.RedisError as exc:  # refused by the server: OOM, NOPERM, WRONGTYPE, a script error
            text = f"{type(exc).__name__}: {exc}"
            kind = text.split(" ", 2)[:2]
            if " ".join(kind) not in self._warned and len(self._warned) < 100:
                self._warned.add(" ".join(kind))
                log.warning("sippcache: %s refused an operation (%s); it is a miss or is dropped", self.location, text)
            raise _ServerError(text) from exc
        else:
            if self._outage is not None:
                log.info("sippcache: %s is back after %d failed operations", self.location, self._failed_operations)
                self._outage = None
                self._backoff = BACKOFF_FIRST
                self._failed_operations = 0

    def _went_down(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if self._outage is None:
            self._outage = text
            log.warning(
                "sippcache: %s is unavailable (%s); lookups miss and stores are dropped until it answers again",
                self.location,
                text,
            )
        else:
            self._backoff = min(BACKOFF_MAX, self._backoff * 2)
        self._retry_at = self.clock() + self._backoff

    def _failed(self) -> None:
        self._mirror.counters["errors"] += 1
        if self._outage is not None:
            self._failed_operations += 1

    def _eval(self, client: Any, name: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run a script by its SHA; load it once if the server does not know it (new or restarted)."""
        script = SCRIPTS[name]
        try:
            return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except rexc.NoScriptError:
            self.round_trips += 1
            return client.execute_command("EVAL", script.source, len(keys), *keys, *args)
        finally:
            self.round_trips += 1

    # -- keeping the mirror in step --------------------------------------------------

    def _script(self, name: str, args: Sequence[Any], *, expected: int | None = None) -> list[Any]:
        """Call a store script with the common leading arguments; return its reply."""
        seq = self._mirror.seq if expected is None else expected
        head = [self._epoch or b"", seq, secrets.token_hex(8), MAX_RECORDS]
        with self._server() as client:
            reply = self._eval(client, name, self._keys, [*head, *args])
        if not (isinstance(reply, list) and len(reply) == 7):
            raise _Rebuild(f"unexpected reply from the {name} script")
        return reply

    def _absorb(self, reply: list[Any]) -> str:
        """Apply a script's records (and the store's budget) to the mirror. Returns "ok"
        (the mirror is at the server's seq), "more" (call again), or "rebuild"."""
        epoch, seq, clock, status, records = reply[:5]
        if not isinstance(epoch, bytes) or type(seq) is not int or seq < 0:
            return "rebuild"
        status = status.decode() if isinstance(status, bytes) else str(status)
        mirror = self._mirror
        if status == "rebuild" or epoch != self._epoch or mirror.seq < 0:
            return "rebuild"
        if status not in ("ok", "more") or not isinstance(records, list):
            return "rebuild"
        self._take_budget(reply)
        try:
            for record in records:
                logged = read_record(record)
                mirror.follow(logged.seq, logged.change)
                self._track(logged.change, logged.ref)
                if logged.damaged and isinstance(logged.change, Remove):
                    mirror.damaged.add(logged.change.eid)
        except (BadRecord, OutOfStep):
            return "rebuild"
        if status == "ok":
            if mirror.seq != seq:
                return "rebuild"
            mirror.catalog.clock = read_clock(clock)
        return status

    def _take_budget(self, reply: list[Any]) -> None:
        """The budget saved with the store, as every script reply brings it."""
        budget = read_budget(reply[6])
        if budget is not None and budget != self._mirror.catalog.budget:
            self._mirror.apply(budget)

    def _track(self, change: Change | None, ref: BlobRef | None) -> BlobRef | None:
        """Keep `_refs` in step with a change the mirror applied; returns the chunks it
        made obsolete (an entry's that was removed or replaced)."""
        if isinstance(change, Clear):
            self._refs.clear()
            return None
        if not isinstance(change, (Put, Remove)):
            return None
        old = self._refs.pop(change.eid, None)
        if isinstance(change, Put) and ref is not None:
            self._refs[change.eid] = ref
        return old

    def _catch_up(self, reply: list[Any]) -> None:
        """Apply what a refused script returned, and what followed it."""
        status = self._absorb(reply)
        while status == "more":
            status = self._absorb(self._script("sync", []))
        if status == "rebuild":
            self._rebuild()

    def _sync(self) -> None:
        """Bring the mirror up to the server's newest record (one round trip when
        nothing is far behind), saving pending recency updates if they are due."""
        if self._mirror.seq < 0:
            self._rebuild()
            return
        touches: list[bytes] = []
        if self._mirror.uses.due():
            touches = self._touch_args()
        for _ in range(64):
            reply = self._script("sync", touches)
            touches = []
            status = self._absorb(reply)
            if status == "ok" and self._lost_metadata(reply):
                status = "rebuild"
            if status == "ok":
                self._after_sync()
                return
            if status == "rebuild":
                self._rebuild()
                return
        self._rebuild()

    def _after_sync(self) -> None:
        """Work that waits for a mirror in step: delete damaged entries, settle uploads
        whose commit reply was lost, save this handle's budget (at its first use)."""
        self._purge_damaged()
        self._settle_uploads()
        claim = self._mirror.budget_claim()
        if claim is not None:
            reply = self._script("budget", [pack_limit(claim.max_bytes), pack_limit(claim.max_entries)])
            if self._absorb(reply) == "rebuild":
                self._mirror.invalidate()
            self._mirror.committed([claim])

    def _lost_metadata(self, reply: list[Any]) -> bool:
        """Whether `cat` holds fewer entries than the mirror (at the same log position): the
        server lost metadata without a log record (evicted `cat`, or someone deleted fields)."""
        count = reply[5]
        return type(count) is int and count < len(self._mirror.catalog)

    def _touch_args(self) -> list[bytes]:
        uses = self._mirror.uses.batch()
        self._mirror.uses.items.clear()
        return [] if uses is None else pack_uses(uses)

    def _flush_touches(self) -> None:
        if self._mirror.uses.items and self._mirror.seq >= 0:
            reply = self._script("sync", self._touch_args())
            if self._absorb(reply) == "rebuild":
                self._mirror.invalidate()

    def _rebuild(self) -> None:
        """Read the whole catalog again (HSCAN, a page per round trip), then catch up
        through the log from where the scan began."""
        mirror = self._mirror
        for _ in range(3):
            mirror.invalidate()
            reply = self._script("sync", [], expected=-1)
            epoch, seq = reply[0], reply[1]
            if not isinstance(epoch, bytes) or type(seq) is not int or seq < 0:
                raise _ServerError("the store's state is unreadable")
            metas = self._scan(self._keys[1])
            values = self._scan(self._keys[2])
            entries = {eid: read_entry(eid, raw, values.get(eid)) for eid, raw in metas.items()}
            found = [entry for entry in entries.values() if entry is not None]
            mirror.reload([entry.put for entry in found], seq, read_clock(reply[2]))
            damaged = mirror.damaged = {eid for eid, entry in entries.items() if entry is None}
            self._take_budget(reply)
            self._refs, self._epoch = {entry.put.eid: entry.ref for entry in found}, epoch
            if damaged:
                log.warning(
                    "sippcache: %s has %d damaged entries; they are invisible and removed now",
                    self.location,
                    len(damaged),
                )
            for _ in range(64):
                reply = self._script("sync", [])
                status = self._absorb(reply)
                if status != "more":
                    break
            if status == "ok" and not self._lost_metadata(reply):
                self._after_sync()
                return
        mirror.invalidate()
        raise _ServerError("the store changed too fast to be read")

    def _scan(self, key: str) -> dict[bytes, Any]:
        found: dict[bytes, Any] = {}
        cursor: Any = 0
        while True:
            with self._server() as client:
                reply = client.execute_command("HSCAN", key, cursor, "COUNT", SCAN_COUNT)
            self.round_trips += 1
            if not (isinstance(reply, (list, tuple)) and len(reply) == 2):
                return found
            cursor, items = reply
            if isinstance(items, dict):
                items = [x for pair in items.items() for x in pair]
            for i in range(0, len(items) - 1, 2):
                field = items[i]
                if isinstance(field, bytes) and len(field) == 16:
                    found[field] = items[i + 1]
            if cursor in (0, b"0", "0"):
                return found

    def _purge_damaged(self) -> None:
        """Delete entries whose metadata does not parse (their chunks are unknown: left to expire or be evicted)."""
        if not self._mirror.damaged:
            return
        args: list[bytes] = []
        for eid in list(self._mirror.damaged)[:1000]:
            args += [eid, b""]
        reply = self._script("delete", args)
        self._mirror.damaged.clear()
        if self._absorb(reply) == "rebuild":
            self._mirror.invalidate()

    def _settle_uploads(self) -> None:
        """Uploads whose commit reply was lost: keep the chunks if the entry is ours, else unlink them."""
        if not self._unsure:
            return
        unsure, self._unsure = self._unsure, []
        keep = [chunks for chunks in unsure if self._refs.get(chunks.eid) == chunks.ref]
        try:
            self._chunk_commands(keep=keep, unlink=[chunks for chunks in unsure if chunks not in keep])
        except _ServerError:
            pass  # they expire by themselves

    # -- chunks --------------------------------------------------------------------------

    def _chunk_keys(self, eid: bytes, ref: BlobRef) -> list[str]:
        base = f"{self._chunk_prefix}{{{eid.hex()}}}:{ref.blob_id.hex()}:"
        return [base + str(i) for i in range(ref.count)]

    def _chunk_commands(self, *, keep: Iterable[Chunks] = (), unlink: Iterable[Chunks] = ()) -> None:
        """Give committed chunks their long TTL (`keep`) and unlink obsolete ones, for
        several entries, pipelined (each command stays in one slot)."""
        keep, unlink = list(keep), list(unlink)
        if not keep and not unlink:
            return
        with self._server() as client:
            pipe = client.pipeline(transaction=False)
            for eid, ref in keep:
                for key in self._chunk_keys(eid, ref):
                    pipe.execute_command("PEXPIRE", key, KEEP_TTL_MS)
            for eid, ref in unlink:
                pipe.execute_command("UNLINK", *self._chunk_keys(eid, ref))
            pipe.execute(raise_on_error=False)
        self.round_trips += 1

    def _upload(self, eid: bytes, ref: BlobRef, blob: memoryview) -> None:
        keys = self._chunk_keys(eid, ref)
        per_trip = max(1, WINDOW_BYTES // ref.chunk_size)
        for first in range(0, len(keys), per_trip):
            with self._server() as client:
                pipe = client.pipeline(transaction=False)
                for i in range(first, min(len(keys), first + per_trip)):
                    piece = blob[i * ref.chunk_size : (i + 1) * ref.chunk_size]
                    pipe.execute_command("SET", keys[i], piece, "PX", UPLOAD_TTL_MS)
                pipe.execute()
            self.round_trips += 1

    def _fetch(self, eid: bytes, ref: BlobRef) -> bytes | bytearray | None:
        """The blob, or None if a chunk is missing, the wrong length, or the checksum fails (torn).
        Fetched a window of chunks a round trip, each copied into one buffer as its window arrives:
        a state is held once (the chunks of one window beside it), not once in its chunks and
        again joined."""
        return self._fetch_many([(eid, ref)], WINDOW_BYTES)[0]

    def _fetch_many(self, items: Sequence[tuple[bytes, BlobRef]], window: int | None) -> list[bytes | bytearray | None]:
        """The blobs of several entries (as `_fetch`), their chunks requested `window` bytes a
        round trip, or all in one (None: a chain of small entries, `lookup_prefixes`)."""
        wanted = [
            (n, i, key, size)
            for n, (eid, ref) in enumerate(items)
            for i, (key, size) in enumerate(zip(self._chunk_keys(eid, ref), ref.sizes(), strict=True))
        ]
        per_trip = len(wanted) if window is None else max(1, window // max(ref.chunk_size for _, ref in items))
        blobs: list[bytes | bytearray | None] = [None] * len(items)
        torn = [False] * len(items)
        for first in range(0, len(wanted), per_trip):
            batch = wanted[first : first + per_trip]
            with self._server() as client:
                pipe = client.pipeline(transaction=False)
                for _, _, key, _ in batch:
                    pipe.execute_command("GET", key)
                got = pipe.execute(raise_on_error=False)
            self.round_trips += 1
            for (n, i, _, size), part in zip(batch, got, strict=True):
                if isinstance(part, Exception) and not str(part).startswith("WRONGTYPE"):
                    raise _Unavailable(f"{type(part).__name__}: {part}")  # moved, loading...: not torn
                if torn[n] or not isinstance(part, bytes) or len(part) != size:
                    torn[n] = True
                    continue
                ref = items[n][1]
                if ref.count == 1:
                    blobs[n] = part
                    continue
                joined = blobs[n]
                if not isinstance(joined, bytearray):
                    joined = blobs[n] = bytearray(ref.length)
                joined[i * ref.chunk_size : i * ref.chunk_size + size] = part
            del got
        return [
            None if torn[n] or blob is None or xxhash.xxh3_64_intdigest(blob) != ref.checksum else blob
            for n, (blob, (_, ref)) in enumerate(zip(blobs, items, strict=True))
        ]

    # -- BaseBackend hooks -----------------------------------------------------------------

    def _store(self, key: bytes, blob: memoryview, namespace: str, options: StoreOptions) -> bool:
        size = blob.nbytes + len(key)
        eid = entry_id(namespace, key)
        mirror = self._mirror
        tokens = len(key) // 4
        with self._lock:
            limit = mirror.budget.max_bytes
            if mirror.seq >= 0 and limit is not None and size > limit:  # no round trip for what cannot fit
                return mirror.settle_store(StorePlan(None, "larger than max_bytes"), size, tokens, options.pinned)
        ref = BlobRef(secrets.token_bytes(8), blob.nbytes, self.chunk_size, xxhash.xxh3_64_intdigest(blob))
        phase = "plan"
        try:
            with self._lock:
                self._sync()
                plan = mirror.plan_store(eid, key, namespace, size, options)
            if plan.state is not None:
                phase = "upload"
                self._upload(eid, ref, blob)
                phase = "commit"
                with self._lock:
                    plan, obsolete = self._commit_store(eid, key, namespace, size, options, plan, ref)
                if obsolete is not None:
                    self._finish_store(Chunks(eid, ref), obsolete)
                    with self._lock:
                        return mirror.settle_store(plan, size, tokens, options.pinned)
                if plan.state is not None:  # never committed: the store kept changing
                    log.warning(
                        "sippcache: %s changed %d times while storing; store dropped", self.location, COMMIT_ATTEMPTS
                    )
                    self._discard(Chunks(eid, ref))
                    with self._lock:
                        self._failed()
                    return False
                self._discard(Chunks(eid, ref))
        except (_ServerError, _Rebuild) as exc:
            with self._lock:
                self._failed()
                if phase == "commit" and isinstance(exc, _Unavailable):
                    self._unsure.append(Chunks(eid, ref))  # the commit may have happened: settle at the next sync
            if phase != "plan" and not isinstance(exc, _Unavailable):
                self._discard(Chunks(eid, ref))  # refused (out of memory, say): free what was uploaded now
            return False
        with self._lock:  # refused by the plan
            return mirror.settle_store(plan, size, tokens, options.pinned)

    def _commit_store(
        self, eid: bytes, key: bytes, namespace: str, size: int, options: StoreOptions, plan: StorePlan, ref: BlobRef
    ) -> tuple[StorePlan, list[Chunks] | None]:
        """Commit `plan` (planning again while other clients get there first). Returns the
        final plan and, if committed, the chunks the store made obsolete."""
        for attempt in range(COMMIT_ATTEMPTS):
            if attempt:
                time.sleep(random.uniform(0, COMMIT_BACKOFF * attempt))
                plan = self._mirror.plan_store(eid, key, namespace, size, options)
            if plan.state is None:
                return plan, None
            obsolete = self._commit(plan.changes, ref)
            if obsolete is not None:
                return plan, obsolete
        return plan, None

    def _commit(self, changes: Sequence[Change], ref: BlobRef | None) -> list[Chunks] | None:
        """Apply `changes` (planned on the mirror as it is: evictions, marks, puts; `ref`
        holds the put entry's chunks) on the server, if it is still where the mirror is,
        then to the mirror. Returns the chunks the changes made obsolete, or None if
        another client changed the store first (the mirror has caught up: plan again)."""
        mirror = self._mirror
        catalog = mirror.catalog
        deletes = [change.eid for change in changes if isinstance(change, Remove)]
        marks: list[bytes] = []
        puts: list[bytes] = []
        for change in changes:
            if isinstance(change, Mark):
                marked = catalog.get(change.eid)  # planned on this mirror: there
                used = marked.used if marked is not None else 0
                marks += [change.eid, pack_values(used, change.value, change.pinned, change.superseded)]
            elif isinstance(change, Put) and ref is not None:
                state = change.state
                puts += [
                    change.eid,
                    pack_meta(change.key, state, ref),
                    pack_values(state.used, state.value, state.pinned, state.superseded),
                ]
        args = [
            repr(catalog.clock_after(changes)),
            len(deletes),
            *deletes,
            len(marks) // 2,
            *marks,
            len(puts) // 3,
            *puts,
        ]
        reply = self._script("commit", args)
        if reply[5] != 1:
            self._catch_up(reply)
            return None
        self._take_budget(reply)
        if reply[0] != self._epoch or reply[1] != mirror.seq + len(changes):
            mirror.invalidate()  # not what was planned: read everything again
            return []
        mirror.committed(changes, reply[1])
        obsolete = []
        for change in changes:
            old = self._track(change, ref)
            if old is not None and isinstance(change, (Put, Remove)):
                obsolete.append(Chunks(change.eid, old))
        return obsolete

    def _finish_store(self, chunks: Chunks, obsolete: list[Chunks]) -> None:
        """Keep the new chunks and unlink the ones the store replaced or evicted (one round trip)."""
        try:
            self._chunk_commands(keep=[chunks], unlink=obsolete)
        except _ServerError:
            with self._lock:
                self._failed()  # the entry stays until its chunks expire; then it is a miss and goes

    def _discard(self, chunks: Chunks) -> None:
        try:
            self._chunk_commands(unlink=[chunks])
        except _ServerError:
            pass  # they expire

    def _lookup(self, key: bytes, namespace: str, partial: bool, touch: bool) -> Match | None:
        mirror = self._mirror
        try:
            with self._lock:
                self._sync()
                index = mirror.catalog.index
                hit = index.longest_common(namespace, key) if partial else index.longest_prefix(namespace, key)
                if hit is None:
                    mirror.counters["misses"] += 1
                    return None
                ref = self._refs.get(hit.entry_id)
                stored_key = index.key_of(hit.entry_id)
                if ref is None:  # cannot happen: the index and the blob table change together
                    mirror.counters["misses"] += 1
                    return None
            blob = self._fetch(hit.entry_id, ref)
            if blob is None:  # torn (server eviction, a lost chunk, a race with a replace): a miss, cleaned up
                self._remove_torn(Chunks(hit.entry_id, ref))
                with self._lock:
                    mirror.counters["misses"] += 1
                return None
        except (_ServerError, _Rebuild):
            with self._lock:
                self._failed()
                mirror.counters["misses"] += 1
            return None
        with self._lock:
            if touch:
                mirror.uses.record(mirror.catalog, hit.entry_id)
            mirror.counters["hits"] += 1
        return Match(hit.length, stored_key, blob, namespace)

    def _lookup_prefixes(self, key: bytes, lengths: list[int], namespace: str, touch: bool) -> list[Match]:
        """Two round trips for the whole chain: the sync, and one pipeline of every GET."""
        mirror = self._mirror
        try:
            with self._lock:
                self._sync()
                items: list[tuple[bytes, BlobRef]] = []
                for eid in mirror.catalog.index.entries_along(namespace, key, [4 * n for n in lengths]):
                    ref = self._refs.get(eid)
                    if ref is None:  # cannot happen: the index and the blob table change together
                        break
                    items.append((eid, ref))
            blobs = self._fetch_many(items, None) if items else []
        except (_ServerError, _Rebuild):
            with self._lock:
                self._failed()
                mirror.counters["misses"] += 1
            return []
        matches: list[Match] = []
        for n, (eid, ref), blob in zip(lengths, items, blobs, strict=False):
            if blob is None:  # torn: the chain ends here, and the entry is cleaned up
                self._remove_torn(Chunks(eid, ref))
                break
            matches.append(Match(n, key[: 4 * n], blob, namespace))
        with self._lock:
            if touch:
                mirror.uses.record(mirror.catalog, *(eid for eid, _ in items[: len(matches)]))
            mirror.counters["hits"] += len(matches)
            mirror.counters["misses"] += len(matches) < len(lengths)
        return matches

    def _remove_torn(self, chunks: Chunks) -> None:
        with self._lock:
            reply = self._script("delete", [chunks.eid, chunks.ref.blob_id])
            if self._absorb(reply) == "rebuild" or (
                self._refs.get(chunks.eid) == chunks.ref and reply[4] == [] and reply[3] == b"ok"
            ):
                # Nothing to delete, yet the mirror (up to date) still holds it: the metadata
                # was lost without a log record. Read everything again.
                self._mirror.invalidate()
        self._discard(chunks)

    def _peek(self, key: bytes, namespace: str, partial: bool) -> Peek | None:
        """From the mirror after one sync round trip; no blob is read."""
        with self._lock:
            try:
                self._sync()
            except (_ServerError, _Rebuild):
                self._failed()
                return None
            return self._mirror.catalog.peek(namespace, key, partial)

    def _touch_entry(self, key: bytes, namespace: str) -> bool:
        """Record a use from the mirror, saved with a later sync: no round trip of its own."""
        return self._record_uses(namespace, key, None) == 1

    def _touch_prefixes(self, key: bytes, lengths: list[int], namespace: str) -> int:
        """The chain's uses from the mirror (one walk down its index), saved with a later sync."""
        return self._record_uses(namespace, key, [4 * n for n in lengths])

    def _record_uses(self, namespace: str, key: bytes, ends: list[int] | None) -> int:
        """Record a use of the entry under `key` (`ends` None) or of those under its prefixes
        ending at `ends` up to the first not stored; how many there were."""
        mirror = self._mirror
        with self._lock:
            if mirror.seq < 0:
                try:
                    self._sync()
                except (_ServerError, _Rebuild):
                    self._failed()
                    return 0
            if ends is None:
                eid = entry_id(namespace, key)
                eids = [eid] if eid in mirror.catalog else []
            else:
                eids = mirror.catalog.index.entries_along(namespace, key, ends)
            if eids:
                mirror.uses.record(mirror.catalog, *eids)
            return len(eids)

    def _delete(self, key: bytes, namespace: str) -> bool:
        eid = entry_id(namespace, key)
        try:
            with self._lock:
                reply = self._script("delete", [eid, b""])
                deleted = reply[5]
                meta = deleted[0] if isinstance(deleted, list) and deleted else None
                if self._absorb(reply) == "rebuild":
                    self._mirror.invalidate()
                if not meta:
                    return False
                self._mirror.apply(Remove(eid))
                self._track(Remove(eid), None)
            ref = blob_of(eid, meta)
            if ref is not None:
                self._discard(Chunks(eid, ref))
            return True
        except (_ServerError, _Rebuild):
            with self._lock:
                self._failed()
            return False

    def _set_pinned(self, key: bytes, namespace: str, pinned: bool) -> bool:
        eid = entry_id(namespace, key)
        mirror = self._mirror
        try:
            with self._lock:
                self._sync()
                for _ in range(COMMIT_ATTEMPTS):
                    if eid not in mirror.catalog:
                        return False
                    mark = mirror.plan_pin(eid, pinned, len(key) // 4)
                    if mark is None or self._commit([mark], None) is not None:
                        return True
                self._failed()
                return False
        except (_ServerError, _Rebuild):
            with self._lock:
                self._failed()
            return False

    def _clear(self) -> None:
        obsolete: list[Chunks] = []
        mirror = self._mirror
        try:
            with self._lock:
                self._sync()
                for attempt in range(COMMIT_ATTEMPTS + 1):
                    force = attempt == COMMIT_ATTEMPTS  # the store kept changing: clear what we cannot list
                    reply = self._script("clear", ["1" if force else "0"])
                    if reply[5] == 1:
                        obsolete = [Chunks(eid, ref) for eid, ref in self._refs.items()]
                        self._take_budget(reply)
                        if force or reply[0] != self._epoch or reply[1] != mirror.seq + 1:
                            mirror.apply(Clear())
                            mirror.invalidate()
                        else:
                            mirror.committed([Clear()], reply[1])
                        self._track(Clear(), None)
                        break
                    self._catch_up(reply)
            for first in range(0, len(obsolete), 1000):
                self._chunk_commands(unlink=obsolete[first : first + 1000])
        except (_ServerError, _Rebuild):
            with self._lock:
                self._failed()

    def _refresh(self) -> None:
        """Sync for a listing; on failure the listing shows the last known state."""
        try:
            self._sync()
        except (_ServerError, _Rebuild):
            self._failed()

    def _stats(self) -> Stats:
        with self._lock:
            self._refresh()
            mirror = self._mirror
            return mirror.catalog.stats(
                backend=type(self).__name__,
                location=self.location,
                budget=mirror.budget,
                damaged=len(mirror.damaged),
                **mirror.counters,
            )

    def _len(self) -> int:
        with self._lock:
            self._refresh()
            return len(self._mirror.catalog)

    def _entries(self, namespace: str | None) -> list[EntryInfo]:
        with self._lock:
            self._refresh()
            return self._mirror.catalog.entries(namespace)

    def _namespaces(self) -> list[str]:
        with self._lock:
            self._refresh()
            return self._mirror.catalog.namespaces()

    def _close(self) -> None:
        with self._lock:
            try:
                self._flush_touches()
            except (_ServerError, _Rebuild) as exc:
                log.warning("sippcache: could not save recency updates of %s on close: %s", self.location, exc)
            if self._redis is not None:
                try:
                    self._redis.close()
                except Exception:  # closing must not fail
                    pass
                self._redis = None


class RedisTLSBackend(RedisBackend):
    """`rediss://`: the same backend over TLS (redis-py's ``ssl_*`` options pass through)."""

    def __init__(self, location: str = "", **options: Any) -> None:
        super().__init__(location, tls=True, **options)

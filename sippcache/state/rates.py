"""Whether restoring a stored state beats computing its tokens again, from measured rates.

A restore is not free. On a CPU, loading a llama.cpp state is three orders of
magnitude faster than computing it, and restoring always wins. On a fast GPU
the two are close: on an H200, a 32,768-token state of 1,074 MB took
llama-server 538 ms to load from its own slot file, and computing the prompt
from scratch 685 ms (see the design notes, "On a GPU: bytes are the cost"); a
store read and a staging copy on top of that make the restore the slower way.
So whoever restores (the proxy, for each llama-server behind it) asks
`RestoreRates` first, which compares what was measured at that place:

- the prefill rate: tokens computed per second, from the server's own report
  of each request (llama-server's ``timings.prompt_n`` tokens in
  ``timings.prompt_ms``); samples under `MIN_PREFILL_TOKENS` tokens are
  dropped, they measure a request's fixed costs more than the rate;
- the restore rate: bytes per second over a whole restore (store read,
  staging, the server's load), each restore's bytes weighted by the share of
  what it promised that the server then reused: a restore the server threw
  away (it recomputed the prompt anyway) counts its seconds against no bytes,
  so a place that wastes restores looks too slow to get any, and after
  `WASTED_IN_A_ROW` wasted restores in a row it gets none at all;
- the load rate: bytes per second of the server's own part of each restore
  (llama-server's ``timings.restore_ms``), which prices a restore of a file
  the server loads as it is (the proxy's ready files: nothing read or
  staged), measured by those restores themselves too; until one is measured,
  the server's own part of its saves (``timings.save_ms``) prices them;
- the save rate: bytes per second of the saves done (the server's save and
  the store write): until a restore has been measured at a place, a restore
  is expected to cost what a save of as many bytes did. A save moves the same
  bytes, once more than a restore does, so this errs on the side of
  computing: a new place does not restore blindly where restoring loses (on
  an H200 a proxy restarted with no restore measured restored every
  follow-up, up to 5x slower than computing). Where the caller knows the
  server's own part of a save (llama-server's ``timings.save_ms``), a restore
  is priced at `RESTORE_PER_SERVER_SAVE` times that part instead: the whole
  save also counts framing and a store write, which a restore does not do,
  and priced by it, restores that won were declined;
- the state size per token, from restores and saves, for a caller that knows
  how many tokens a stored state holds but not its bytes.

A rate depends on the size of the work: attention costs more per token the
longer the prompt (on the H200, 8,192 tokens in 112 ms, 32,768 in 617 ms: 37%
more a token), a batch too small to fill a GPU computes fewer tokens a second,
and a small restore is mostly the fixed cost of its calls. So samples are
kept by size, in buckets of a power of two (`WINDOW` recent samples each),
and the rate for a given size is the ratio of sums (seconds over tokens,
seconds over useful bytes) in the bucket of that size: one odd sample moves it
by its share only. A size with no samples of its own is priced on the line
through the two nearest buckets' means (a fixed cost plus a cost a unit), so
that the fixed cost of small restores is not charged again a byte on a large
one; where that line does not rise, at the nearest bucket's rate.

The rule: restore when the expected restore seconds are at most `margin`
times the expected seconds to compute the tokens it saves (`margin` 1: a
restore must be expected no slower than computing). With nothing measured yet
(no restore, no save) it restores: a cache exists to restore, and the first
restores and requests teach it the rates. Once it declines, no restore is measured any more, so
after `PROBE_EVERY` declines in a row at a place it restores once anyway,
to measure again (a page cache that warmed up, a server that was fixed).

The mode: ``auto`` (the rule), ``always`` (restore whatever the rates say,
the behaviour before the rule), ``never`` (never restore; states are still
stored, for the places where restores win). Where the caller gives none,
``SIPPCACHE_RESTORE`` names it (default ``auto``).

Rates outlive a process where the caller keeps them (`RestoreRates.keep`): a
proxy restarted on the same host and model starts from what the last one
measured, instead of restoring blindly until it has measured again (on an
H200, a proxy that forgot its rates at each restart restored every
follow-up, up to 5x slower than computing it). A kept place's samples are
written back to its small JSON file by `RestoreRates.flush`, at most every
`KEEP_EVERY` seconds; nothing else here does I/O. Threads may share an
instance (the llama-cpp-python layer learns its saves on its writer thread):
each call holds its lock for a few dictionary operations, a file write not.
Kept files live in `rates_dir()` (``rates/`` in the user cache, or
``SIPPCACHE_RATES_DIR``), named by `rates_file` after what sets the speed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import platformdirs
import xxhash

__all__ = [
    "ALWAYS",
    "DEFAULT_MODE",
    "FASTER",
    "INEFFECTIVE",
    "INEFFECTIVE_SHARE",
    "MODES",
    "MODE_ENVIRONMENT_VARIABLE",
    "NEVER",
    "PROBE",
    "RATES_DIR_ENVIRONMENT_VARIABLE",
    "SLOWER",
    "UNMEASURED",
    "Decision",
    "Measured",
    "Mode",
    "RestoreRates",
    "mode_from_environment",
    "rates_dir",
    "rates_file",
]

log = logging.getLogger(__name__)

Mode = Literal["auto", "always", "never"]
#: The modes, for a command line's choices.
MODES: Final[tuple[Mode, ...]] = ("auto", "always", "never")
DEFAULT_MODE: Final[Mode] = "auto"
#: Environment variable naming the mode where none is given (a proxy's --restore, CacheOptions.restore).
MODE_ENVIRONMENT_VARIABLE = "SIPPCACHE_RESTORE"
#: Environment variable naming the folder of kept rates where none is given ('' keeps none).
RATES_DIR_ENVIRONMENT_VARIABLE = "SIPPCACHE_RATES_DIR"

#: Prefill samples of fewer tokens are dropped: HTTP, template and sampling costs dominate them.
MIN_PREFILL_TOKENS = 64
#: How many recent samples a place keeps of each kind and size (a power of two).
WINDOW = 8
#: After this many declined restores in a row at a place, one restore is done anyway, to measure
#: the restore rate again: a declined restore is never measured.
PROBE_EVERY = 32
#: A restore is chosen when its expected seconds are at most this many times the prefill's.
MARGIN = 1.0
#: A restore is wasted when the server reused less than this share of what it promised.
INEFFECTIVE_SHARE = 0.5
#: After this many wasted restores in a row at a place, its restores are declined (until a probe).
WASTED_IN_A_ROW = 2
#: A kept place's file is written at most this often (seconds) by `RestoreRates.flush`.
KEEP_EVERY = 10.0
#: An unmeasured restore is priced at this many times the server's own part of a save of as many
#: bytes, where the caller knows that part. On an H200 (2026-11-28, docs/proxy.md) the proxy's
#: whole restores (store read, staging, llama-server's load, the calls around them) took 1.3-1.9x
#: llama-server's save of the same state, and a restarted proxy's first one 4.5-6.9x; the whole
#: save (with framing and the LMDB write) took 3-6x the server's part, and priced so, the one
#: restore that won clearly (1.18x, 32K tokens) was declined. 2.2 is chosen on that one run's nine
#: rows: priced so, restoring is chosen exactly where it won by more than 5%
#: (`test_restores_priced_from_the_servers_save_part_follow_the_h200_run`).
RESTORE_PER_SERVER_SAVE = 2.2
#: The version of a kept place's file; a file of another version is not read.
KEPT_VERSION = 1

# Why a restore is done.
ALWAYS: Final = "always"
UNMEASURED: Final = "unmeasured"
FASTER: Final = "faster_than_prefill"
PROBE: Final = "probe"
# Why a restore is declined.
NEVER: Final = "never"
SLOWER: Final = "slower_than_prefill"
INEFFECTIVE: Final = "ineffective"


@dataclass(frozen=True)
class Decision:
    """Whether to restore, why, and the two expectations it compared (None where not measured).

    `reason` names the rule that decided: for a restore ``always``, ``unmeasured``,
    ``faster_than_prefill`` or ``probe``; for a declined one ``never``,
    ``slower_than_prefill`` or ``ineffective`` (the place's recent restores bought nothing).
    `from_saves`: the restore was priced from the place's saves (no restore measured yet)."""

    restore: bool
    reason: str
    restore_seconds: float | None = None
    prefill_seconds: float | None = None
    from_saves: bool = False  # restore_seconds priced from saves: no restore measured there yet

    def __bool__(self) -> bool:
        return self.restore


@dataclass(frozen=True)
class Measured:
    """What a place's samples say; None where it has none of that kind."""

    prefill_tokens_per_second: float | None
    restore_bytes_per_second: float | None  # per useful byte: 0.0 when no restore bought anything
    bytes_per_token: float | None
    prefill_samples: int
    restore_samples: int
    save_bytes_per_second: float | None = None  # as the saves price a restore (`record_save`)
    save_samples: int = 0


class _Samples:
    """Recent (work, cost) samples by the size of the work, in buckets of a power of two; the cost
    per unit of work of a given size. Work: tokens or bytes; cost: seconds or bytes. A sample may
    count less work than its size (a restore's useful bytes): `size` picks its bucket."""

    def __init__(self) -> None:
        self._buckets: dict[int, deque[tuple[float, float]]] = {}

    def add(self, size: float, work: float, cost: float) -> None:
        bucket = self._buckets.get(_bucket(size))
        if bucket is None:
            bucket = self._buckets[_bucket(size)] = deque(maxlen=WINDOW)
        bucket.append((work, cost))

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def largest_cost(self) -> int | None:
        """The largest cost of one sample (a state's bytes, for sizes), None with no samples."""
        return max((round(c) for b in self._buckets.values() for _, c in b), default=None)

    def dump(self) -> dict[str, list[list[float]]]:
        """The samples as JSON data: {bucket: [[work, cost], ...]}, oldest first."""
        return {str(b): [[w, c] for w, c in samples] for b, samples in sorted(self._buckets.items())}

    def load(self, data: dict[str, list[list[float]]]) -> int:
        """Add samples `dump` wrote (checked by `_kept_samples`), older than any added since; how many."""
        for key, pairs in data.items():
            bucket = int(key)
            newer = list(self._buckets.get(bucket, ()))
            samples = self._buckets[bucket] = deque(maxlen=WINDOW)
            samples.extend((float(w), float(c)) for w, c in pairs)
            samples.extend(newer)
        return sum(len(pairs) for pairs in data.values())

    def per_unit(self, size: float | None = None) -> float | None:
        """Cost per unit of work for work of `size` (None: over every sample): from the bucket of
        that size, else the nearest one with samples (the larger of two as near: its fixed costs
        weigh less). None with no samples; infinite where the samples did no work."""
        if not self._buckets:
            return None
        if size is None:
            samples = [s for b in self._buckets.values() for s in b]
        else:
            want = _bucket(size)
            samples = list(self._buckets[min(self._buckets, key=lambda b: (abs(b - want), -b))])
        work = sum(w for w, _ in samples)
        cost = sum(c for _, c in samples)
        if work <= 0:
            return math.inf
        return cost / work

    def expected(self, size: float) -> float | None:
        """The expected cost of work of `size`. From the samples of that size where there are
        some: `per_unit` times `size`. Else from the two nearest sizes that have samples, on the
        line through their means (a fixed cost per call plus a cost per unit: a 2K-token
        restore's rate, its fixed cost spread over few bytes, would price a 32K one too high),
        where that line rises and gives a positive cost; else `per_unit` of the nearest. None with
        no samples; infinite where the samples did no work."""
        rate = self.per_unit(size)
        if rate is None:
            return None
        want = _bucket(size)
        nearest = sorted(self._buckets, key=lambda b: (abs(b - want), -b))
        if want in self._buckets or len(nearest) == 1:
            return rate * size
        (w1, c1), (w2, c2) = (_mean(self._buckets[b]) for b in nearest[:2])
        if w1 > 0 and w2 > 0 and w1 != w2:
            slope = (c2 - c1) / (w2 - w1)
            cost = c1 + slope * (size - w1)
            if slope > 0 and cost > 0:
                return cost
        return rate * size


def _mean(samples: deque[tuple[float, float]]) -> tuple[float, float]:
    """The mean work and the mean cost of a bucket's samples."""
    return sum(w for w, _ in samples) / len(samples), sum(c for _, c in samples) / len(samples)


def _bucket(size: float) -> int:
    """The power of two `size` falls in: 1 for 1, 2 for 2-3, 3 for 4-7 and so on."""
    return int(max(size, 1.0)).bit_length()


@dataclass
class _Place:
    prefill: _Samples = field(default_factory=_Samples)  # by tokens: tokens, seconds
    restore: _Samples = field(default_factory=_Samples)  # by bytes: useful bytes, seconds
    sizes: _Samples = field(default_factory=_Samples)  # by tokens: tokens, bytes
    saves: _Samples = field(default_factory=_Samples)  # by bytes: bytes, seconds
    loads: _Samples = field(default_factory=_Samples)  # by bytes: useful bytes, the server's own load's seconds
    server_saves: _Samples = field(default_factory=_Samples)  # by bytes: bytes, the server's own save's seconds
    declined: int = 0  # declined restores in a row
    wasted: int = 0  # wasted restores in a row


#: The sample sets a kept file may lack: kept since a later version of this module.
_KEPT_LATER = ("saves", "loads", "server_saves")


def _kinds(entry: _Place) -> list[tuple[str, _Samples]]:
    """A place's sample sets by the names a kept file gives them."""
    return [
        ("prefill", entry.prefill),
        ("restore", entry.restore),
        ("sizes", entry.sizes),
        ("saves", entry.saves),
        ("loads", entry.loads),
        ("server_saves", entry.server_saves),
    ]


def mode_from_environment() -> Mode:
    """The mode `SIPPCACHE_RESTORE` names, else `DEFAULT_MODE`; ValueError naming the variable for
    another value."""
    value = os.environ.get(MODE_ENVIRONMENT_VARIABLE, "") or DEFAULT_MODE
    for mode in MODES:
        if value == mode:
            return mode
    raise ValueError(f"{MODE_ENVIRONMENT_VARIABLE}={value!r}: the restore mode must be one of {', '.join(MODES)}")


def rates_dir() -> str:
    """Where kept rates live unless the caller names a folder: ``SIPPCACHE_RATES_DIR`` where it is
    set ('' keeps none), else ``rates/`` in the user cache folder (measured rates belong to this
    host)."""
    return os.environ.get(
        RATES_DIR_ENVIRONMENT_VARIABLE, os.path.join(platformdirs.user_cache_dir("sippcache"), "rates")
    )


def rates_file(directory: str, digest: str, place: str) -> str:
    """The file in `directory` keeping one place's rates: named by the states' fingerprint
    `digest` (model, K/V types, build) and `place`, the text of what else sets the speed (a
    proxy's upstream, a Llama's threads and GPU layers, the store)."""
    return os.path.join(directory, xxhash.xxh3_128_hexdigest(f"{digest}\n{place}".encode()) + ".json")


def _kept_samples(data: Any) -> dict[str, dict[str, list[list[float]]]] | None:
    """The sample sets of a kept place's file, checked; None where anything is off. Saves may be
    missing, and loads and the server's saves (a file written before they were kept)."""
    if not isinstance(data, dict) or data.get("version") != KEPT_VERSION:
        return None
    kept = {}
    for kind, _ in _kinds(_Place()):
        buckets = data.get(kind, {} if kind in _KEPT_LATER else None)
        if not isinstance(buckets, dict):
            return None
        for key, pairs in buckets.items():
            if not (isinstance(key, str) and key.isdigit() and 1 <= int(key) <= 128 and isinstance(pairs, list)):
                return None
            for pair in pairs:
                if not (
                    isinstance(pair, list)
                    and len(pair) == 2
                    and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in pair)
                ):
                    return None
        kept[kind] = buckets
    return kept


class RestoreRates:
    """Measured prefill and restore rates per place (for the proxy: per upstream URL), and the
    decision whether a restore beats computing its tokens again (see the module's docstring)."""

    def __init__(self, mode: Mode = DEFAULT_MODE, *, margin: float = MARGIN, probe_every: int = PROBE_EVERY) -> None:
        if mode not in MODES:
            raise ValueError(f"restore mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not (math.isfinite(margin) and margin > 0):
            raise ValueError(f"margin must be a finite number > 0, got {margin}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be at least 1, got {probe_every}")
        self.mode: Mode = mode
        self.margin = margin
        self.probe_every = probe_every
        self._places: dict[str, _Place] = {}
        self._kept: dict[str, str] = {}  # place: its file
        self._changed: set[str] = set()  # kept places with samples not yet written
        self._flushed = time.monotonic()
        self._lock = threading.RLock()

    def _place(self, place: str) -> _Place:
        found = self._places.get(place)
        if found is None:
            found = self._places[place] = _Place()
        return found

    def _sampled(self, place: str) -> None:
        if place in self._kept:
            self._changed.add(place)

    # -- kept across processes ------------------------------------------------------------

    def keep(self, place: str, path: str | os.PathLike[str]) -> int:
        """Keep `place`'s samples in the JSON file `path`, for the next process at the same place
        (the same host, server and model: the caller names the file so). The samples a former
        process wrote there are loaded now, as older than any taken since; `flush` writes them
        back. Returns how many were loaded: 0 for a missing file, and for one that cannot be read
        or is not such a file (logged: rates are measured again, nothing fails)."""
        path = os.fspath(path)
        with self._lock:
            self._kept[place] = path
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("sippcache: the restore rates kept in %s cannot be read (%s): measured again", path, exc)
            return 0
        kept = _kept_samples(data)
        if kept is None:
            log.warning("sippcache: %s is not a restore-rates file of version %d: measured again", path, KEPT_VERSION)
            return 0
        with self._lock:
            entry = self._place(place)
            return sum(samples.load(kept[kind]) for kind, samples in _kinds(entry))

    def flush(self, *, force: bool = False) -> None:
        """Write each kept place whose samples changed to its file, if `KEEP_EVERY` seconds have
        passed since the last write (`force`: now; at shutdown). A write that fails is logged, not
        raised: the rates stay in memory and are written at the next flush."""
        with self._lock:
            if not self._changed or (not force and time.monotonic() - self._flushed < KEEP_EVERY):
                return
            self._flushed = time.monotonic()
            due = [
                (
                    place,
                    self._kept[place],
                    {"version": KEPT_VERSION} | {k: s.dump() for k, s in _kinds(self._places[place])},
                )
                for place in sorted(self._changed)
            ]
            self._changed.clear()
        for place, path, data in due:
            try:
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".rates-", suffix=".tmp")
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump(data, f)
                    os.replace(tmp, path)  # whole or not at all: a reader never sees half a file
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            except OSError as exc:
                log.warning("sippcache: cannot write the restore rates to %s: %s", path, exc)
                with self._lock:
                    self._changed.add(place)  # written at the next flush

    # -- samples -------------------------------------------------------------------

    def record_prefill(self, place: str, tokens: int, seconds: float) -> bool:
        """`tokens` prompt tokens computed in `seconds` at `place` (the server's own timing). False
        when the sample is dropped: under `MIN_PREFILL_TOKENS` tokens, or a time that is no time."""
        if tokens < MIN_PREFILL_TOKENS or not (math.isfinite(seconds) and seconds > 0):
            return False
        with self._lock:
            self._place(place).prefill.add(tokens, tokens, seconds)
            self._sampled(place)
        return True

    def record_restore(
        self,
        place: str,
        *,
        nbytes: int,
        seconds: float,
        tokens: int,
        useful: float = 1.0,
        loaded: float | None = None,
        ready: bool = False,
    ) -> bool:
        """A whole restore at `place`: a state of `tokens` tokens and `nbytes` bytes, read, staged
        and loaded in `seconds`, of which the server's own load took `loaded` (None: not known).
        `useful`: the share (0 to 1) of the tokens it promised that the server then reused; 0 for
        a restore it threw away, whose seconds then buy no bytes. `ready`: a restore of a file
        the server loads as it is, nothing read or staged (the proxy's ready files): all of it
        prices such restores, none of it the others. False when the sample is dropped (no bytes,
        or a time that is no time)."""
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return False
        useful = min(1.0, max(0.0, useful)) if math.isfinite(useful) else 0.0
        if ready:
            loaded = seconds
        with self._lock:
            entry = self._place(place)
            if not ready:
                entry.restore.add(nbytes, nbytes * useful, max(seconds, 1e-9))  # timed at 0 s: fast, not free
            if loaded is not None and math.isfinite(loaded) and loaded >= 0:
                entry.loads.add(nbytes, nbytes * useful, max(loaded, 1e-9))
            entry.wasted = entry.wasted + 1 if useful < INEFFECTIVE_SHARE else 0
            if tokens > 0:
                entry.sizes.add(tokens, tokens, nbytes)
            self._sampled(place)
        return True

    def record_save(
        self,
        place: str,
        *,
        nbytes: int,
        seconds: float,
        tokens: int = 0,
        written: int | None = None,
        server_seconds: float | None = None,
    ) -> bool:
        """A whole save at `place`: a state of `nbytes` bytes, taken from the server and stored in
        `seconds` (what prices a restore until one is measured there), of which the store lacked
        `written` bytes (None: all); `server_seconds`, where known, the server's own part of it
        (a restore is then priced at `RESTORE_PER_SERVER_SAVE` times that part). With its
        `tokens`, its size is counted too (`record_size`; a caller that counted it when the state
        was taken gives none), even where the sample is dropped: no bytes, a time that is no time,
        or a save that wrote less than half its state (a chat's next turn, its chunks stored
        before: its time is not that of moving the state). False when it is."""
        self.record_size(place, tokens, nbytes)
        if server_seconds is not None and math.isfinite(server_seconds) and server_seconds > 0:
            seconds = RESTORE_PER_SERVER_SAVE * server_seconds
            if nbytes > 0:
                with self._lock:
                    self._place(place).server_saves.add(nbytes, nbytes, server_seconds)
                    self._sampled(place)
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return False
        if written is not None and written < nbytes / 2:
            return False
        with self._lock:
            self._place(place).saves.add(nbytes, nbytes, seconds)
            self._sampled(place)
        return True

    def record_size(self, place: str, tokens: int, nbytes: int) -> None:
        """A state of `tokens` tokens took `nbytes` bytes at `place` (a save, say)."""
        if tokens > 0 and nbytes > 0:
            with self._lock:
                self._place(place).sizes.add(tokens, tokens, nbytes)
                self._sampled(place)

    # -- what the samples say -----------------------------------------------------------

    def size_of(self, place: str, tokens: int) -> int | None:
        """The expected bytes of a state of `tokens` tokens at `place`; None before any size is known."""
        with self._lock:
            entry = self._places.get(place)
            expected = None if entry is None else entry.sizes.expected(tokens)
        return None if expected is None else round(expected)

    def largest_state(self, place: str) -> int | None:
        """The bytes of the largest state among `place`'s recent samples (saves and restores; kept
        ones too), None before any: what a restore there should expect to write."""
        with self._lock:
            entry = self._places.get(place)
            return None if entry is None else entry.sizes.largest_cost()

    def measured(self, place: str) -> Measured:
        """The rates over every sample of `place`, whatever their size (for logs and tests)."""
        with self._lock:
            entry = self._places.get(place) or _Place()
            per_token = entry.prefill.per_unit()
            per_byte = entry.restore.per_unit()
            per_saved = entry.saves.per_unit()
            return Measured(
                prefill_tokens_per_second=None if per_token is None else 1.0 / per_token,
                restore_bytes_per_second=None
                if per_byte is None
                else (0.0 if math.isinf(per_byte) else 1.0 / per_byte),
                bytes_per_token=entry.sizes.per_unit(),
                prefill_samples=len(entry.prefill),
                restore_samples=len(entry.restore),
                save_bytes_per_second=None if per_saved is None else 1.0 / per_saved,
                save_samples=len(entry.saves),
            )

    # -- the decision ---------------------------------------------------------------------

    def estimate(self, place: str, *, tokens: int, nbytes: int | None, ready: bool = False) -> Decision:
        """What the mode and the measurements say of restoring `nbytes` bytes (None: not known)
        that save computing `tokens` tokens at `place`; `ready`: from a file the server loads as
        it is, priced at the server's own loads where any were measured, else at its own saves
        of as many bytes (it writes what it would read: on the H200, a 1,074 MB state's save took
        llama-server 670 ms, its load 534 ms), else as a whole restore. No side effects (no
        probe: see `decide`)."""
        if self.mode == "always":
            return Decision(True, ALWAYS)
        if self.mode == "never":
            return Decision(False, NEVER)
        with self._lock:
            entry = self._places.get(place)
            if entry is None:
                return Decision(True, UNMEASURED)
            if entry.wasted >= WASTED_IN_A_ROW:
                return Decision(False, INEFFECTIVE)
            prefill = entry.prefill.expected(tokens)
            from_saves = not entry.restore  # no restore measured here yet: priced as a save of those bytes
            samples = entry.saves if from_saves else entry.restore
            if ready and (entry.loads or entry.server_saves):  # the server's own load, or its save
                samples, from_saves = (entry.loads, False) if entry.loads else (entry.server_saves, True)
            restore = None if nbytes is None else samples.expected(nbytes)
        if restore is not None and math.isinf(restore):
            return Decision(False, INEFFECTIVE, restore, prefill)
        if restore is None or prefill is None:
            return Decision(True, UNMEASURED, restore, prefill, from_saves)
        if restore <= self.margin * prefill:
            return Decision(True, FASTER, restore, prefill, from_saves)
        return Decision(False, SLOWER, restore, prefill, from_saves)

    def decide(self, place: str, *, tokens: int, nbytes: int | None, ready: bool = False) -> Decision:
        """`estimate`, and the probe: in ``auto`` mode, after `probe_every` declines in a row at
        `place`, one restore is done anyway (reason ``probe``) so that its rate is measured again."""
        decision = self.estimate(place, tokens=tokens, nbytes=nbytes, ready=ready)
        if self.mode != "auto":
            return decision
        with self._lock:
            entry = self._place(place)
            if decision.restore:
                entry.declined = 0
                return decision
            entry.declined += 1
            if entry.declined < self.probe_every:
                return decision
            entry.declined = 0
        return Decision(True, PROBE, decision.restore_seconds, decision.prefill_seconds, decision.from_saves)

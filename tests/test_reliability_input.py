"""Bad input everywhere in the public API: a clear exception, and nothing written.

Fuzzers (hypothesis, thousands of cases; ``SIPPCACHE_SLOW_TESTS=1`` runs ten
times more) for the URL parser, `sippcache.open` options, `Size.parse` and
the frame decoder, then table-driven checks of every public entry point with
wrong types, out-of-range ids, huge keys, empty blobs, unknown options and
impossible paths. After every refused call the store is exactly as it was:
same length, same counters, same files.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgpack
import numpy as np
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sippcache
from harness.llama_tools import last_logits, reference_logits
from sippcache import BadOption, CorruptEntry, SippcacheError, UnknownBackend, frame
from sippcache.options import Size
from sippcache.registry import parse_url
from tests.reliability_tools import SLOW

FUZZ = settings(max_examples=20_000 if SLOW else 2_000, deadline=None, derandomize=True, database=None)
ALLOWED = (BadOption, UnknownBackend, ValueError, TypeError)

# -- fuzzing the URL parser and the options ----------------------------------------------------------

_scheme_st = st.one_of(
    st.sampled_from(["ram", "RAM", "lmdb", "diskcache", "x", "", "ram+x", "r.a-m"]), st.text(max_size=8)
)
_text_st = st.text(max_size=40)
_url_st = st.one_of(
    _text_st,
    st.builds(
        lambda s, sep, loc, q: f"{s}{sep}{loc}{q}",
        _scheme_st,
        st.sampled_from(["://", ":", ":///", "//"]),
        _text_st,
        st.one_of(st.just(""), _text_st.map(lambda q: "?" + q), _text_st.map(lambda q: "#" + q)),
    ),
)


@FUZZ
@given(url=_url_st)
@example(url="ram://[::1")
@example(url="ram://\uff03")
@example(url="ram://?a=1&a=2")
@example(url="ram://?=")
@example(url="ram://?&&")
@example(url="lmdb://%00")
def test_parse_url_raises_only_documented_errors(url: str) -> None:
    try:
        name, location, options = parse_url(url)
    except ALLOWED:
        return
    assert isinstance(name, str) and name == name.lower() and name
    assert isinstance(location, str)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in options.items())


@pytest.mark.parametrize("url", [None, 1, b"ram://", ["ram://"], object()])
def test_parse_url_wrong_types(url: Any) -> None:
    with pytest.raises(TypeError, match="str"):
        parse_url(url)


_option_name_st = st.one_of(st.sampled_from(["max_bytes", "max_entries"]), st.text(max_size=10))
_digits_st = st.integers(1, 6000).map(lambda n: "9" * n)
_option_value_st = st.one_of(
    st.text(max_size=30),
    _digits_st,
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.builds(
        lambda n, u: f"{n}{u}",
        st.one_of(st.integers(-5, 10**30), st.floats(0, 1e30)),
        st.sampled_from(["", "b", "k", "KiB", "MiB", "GiB", "TiB", "GB", "tb", "PiB", " x", "%"]),
    ),
)


@FUZZ
@given(options=st.lists(st.tuples(_option_name_st, _option_value_st), max_size=4), raw=st.booleans())
@example(options=[("max_bytes", "9" * 400)], raw=False)
@example(options=[("max_bytes", "1" + "0" * 310 + "TiB")], raw=False)
@example(options=[("max_entries", "9" * 5000)], raw=False)
@example(options=[("max_bytes", "0.5")], raw=False)
def test_open_ram_with_any_options_raises_only_documented_errors(options: list[tuple[str, str]], raw: bool) -> None:
    if raw:  # unescaped: whatever the text makes of the query string
        query = "&".join(f"{k}={v}" for k, v in options)
    else:
        query = "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in options)
    try:
        cache = sippcache.open("ram://?" + query if query else "ram://")
    except ALLOWED:
        return
    try:
        assert isinstance(cache.max_bytes, int) and cache.max_bytes > 0  # type: ignore[attr-defined]
        assert cache.max_entries is None or cache.max_entries > 0  # type: ignore[attr-defined]
        cache.store([1], b"x")
        assert len(cache) <= 1
    finally:
        cache.close()


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


@FUZZ
@given(text=st.one_of(st.text(max_size=30), _digits_st, _option_value_st))
@example(text="9" * 400)
@example(text="9" * 309 + "TiB")
@example(text="1e400")
@example(text="nan")
@example(text="-1")
def test_size_parse_returns_a_size_or_raises_value_error(text: str) -> None:
    try:
        size = Size.parse(text)
    except ValueError:
        return
    assert isinstance(size, int) and size >= 0


@FUZZ
@given(
    number=st.one_of(
        st.integers(0, 10**15), st.decimals(0, 10**9, allow_nan=False, allow_infinity=False, places=3).map(str)
    ),
    unit=st.sampled_from(sorted(_UNITS)),
    upper=st.booleans(),
    space=st.sampled_from(["", " "]),
)
def test_size_parse_well_formed_sizes(number: Any, unit: str, upper: bool, space: str) -> None:
    text = f"{number}{space}{unit.upper() if upper else unit}"
    assert Size.parse(text) == int(float(str(number)) * _UNITS[unit])


@pytest.mark.parametrize("value", [None, 5, 5.0, b"5MiB", ["5"]])
def test_size_parse_wrong_types(value: Any) -> None:
    with pytest.raises(TypeError):
        Size.parse(value)


# -- fuzzing the frame decoder with crafted, correctly hashed headers --------------------------------

_FIELDS = ["tokens", "fingerprint", "kind", "versions", "created", "sizes", "checksum", "meta"]
_scalar_st = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8), st.binary(max_size=16)
)
_value_st = st.recursive(
    _scalar_st,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def _crafted_header(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A header close to a valid one, with some fields replaced, dropped or added, and a payload."""
    payload = draw(st.binary(max_size=64))
    cut = draw(st.integers(0, len(payload)))
    header: dict[str, Any] = {
        "tokens": draw(st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=6)
                                 .map(lambda t: struct.pack(f"<{len(t)}I", *t)),
                                 st.binary(max_size=10))),
        "fingerprint": "fp",
        "kind": "llama.seq",
        "versions": {"llama_cpp_python": "0.3"},
        "created": 1.5,
        "sizes": [cut, len(payload) - cut],
        "checksum": xxhash.xxh3_64_intdigest(payload),
        "meta": {"n_swa": 0},
    }  # fmt: skip
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=3, unique=True)):
        action = draw(st.sampled_from(["replace", "drop"]))
        if action == "drop":
            del header[name]
        else:
            header[name] = draw(_value_st)
    for name, value in draw(st.dictionaries(st.text(max_size=6), _value_st, max_size=2)).items():
        header.setdefault(name, value)
    return header, payload


def _reframe(raw_header: bytes, payload: bytes = b"") -> bytes:
    prefix = struct.pack(
        "<8sHIQ", frame.MAGIC, frame.FORMAT_VERSION, len(raw_header), xxhash.xxh3_64_intdigest(raw_header)
    )
    return prefix + raw_header + payload


def _check_decoded(decoded: frame.Frame, payload: bytes) -> None:
    """A frame decode accepted must be self-consistent and hold valid llama_token ids."""
    assert isinstance(decoded.tokens, tuple)
    assert all(isinstance(t, int) and 0 <= t <= 2**31 - 1 for t in decoded.tokens), (
        f"decode accepted out-of-range token ids {decoded.tokens}"
    )
    assert isinstance(decoded.fingerprint, str) and isinstance(decoded.kind, str)
    assert isinstance(decoded.created, float) and not isinstance(decoded.created, bool)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in decoded.versions.items())
    assert b"".join(bytes(s) for s in decoded.sections) == payload


@FUZZ
@given(crafted=_crafted_header())
def test_decoding_crafted_headers_gives_a_valid_frame_or_corrupt_entry(crafted: tuple[dict[str, Any], bytes]) -> None:
    header, payload = crafted
    try:
        raw = msgpack.packb(header, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return  # not representable in msgpack
    try:
        decoded = frame.decode(_reframe(raw, payload))
    except CorruptEntry:
        return
    _check_decoded(decoded, payload)


@FUZZ
@given(raw=st.binary(max_size=200), payload=st.binary(max_size=32))
@example(raw=b"\xdd\x80\x00\x00\x00", payload=b"")
@example(raw=b"\x91" * 150, payload=b"")
def test_decoding_any_correctly_hashed_header_bytes_gives_a_valid_frame_or_corrupt_entry(
    raw: bytes, payload: bytes
) -> None:
    try:
        decoded = frame.decode(_reframe(raw, payload))
    except CorruptEntry:
        return
    _check_decoded(decoded, payload)


def test_decode_rejects_a_header_with_out_of_range_token_ids() -> None:
    """Token ids are llama_token (int32): a stored header holding 2**31 or more is damaged."""
    payload = b"state"
    header = {"tokens": struct.pack("<2I", 5, 2**32 - 1), "fingerprint": "f", "kind": "k", "versions": {},
              "created": 0.0, "sizes": [5], "checksum": xxhash.xxh3_64_intdigest(payload), "meta": {}}  # fmt: skip
    with pytest.raises(CorruptEntry):
        frame.decode(_reframe(msgpack.packb(header, use_bin_type=True), payload))


@pytest.mark.parametrize("buf", [None, 5, "SIPPKV\r\n", [1, 2, 3], object()])
def test_decode_wrong_types(buf: Any) -> None:
    with pytest.raises(TypeError):
        frame.decode(buf)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(fingerprint=123, kind="k"), TypeError),
        (dict(fingerprint="f", kind=None), TypeError),
        (dict(fingerprint=b"f", kind="k"), TypeError),
        (dict(fingerprint="f", kind="k", created="yesterday"), (TypeError, ValueError)),
        (dict(fingerprint="f", kind="k", versions={"a": 1}), TypeError),
        (dict(fingerprint="f", kind="k", meta={"a": [1]}), TypeError),
    ],
)
def test_encode_refuses_what_decode_would_refuse(kwargs: dict[str, Any], error: Any) -> None:
    """An entry encode accepts must decode: otherwise a writer stores entries nobody can read."""
    with pytest.raises(error):
        frame.encode([1, 2], [b"state"], **kwargs)


@pytest.mark.parametrize(
    "sections, error",
    [(["text"], TypeError), ([5], TypeError), ([None], TypeError), (b"not a list of sections", TypeError)],
)
def test_encode_bad_sections(sections: Any, error: type) -> None:
    with pytest.raises(error):
        frame.encode([1], sections, fingerprint="f", kind="k")


# -- the backends: every bad call refused, nothing written --------------------------------------------

BACKENDS = ["ram", "lmdb", "diskcache"]


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "ram://" if request.param == "ram" else f"{request.param}://{tmp_path / 'store'}"


@pytest.fixture
def cache(url: str) -> Iterator[sippcache.CacheBackend]:
    with sippcache.open(url) as opened:
        opened.store([1, 2, 3], b"existing", namespace="n")
        yield opened


def _snapshot(cache: sippcache.CacheBackend) -> tuple[Any, ...]:
    """What must not change: entries, counters, and the store's files (names and contents;
    LMDB's reader table and SQLite's shared-memory index change on reads and are left out)."""
    stats = cache.stats()
    files = {}
    path = getattr(cache, "path", None)
    if path is not None:
        for file in sorted(Path(path).rglob("*")):
            if file.is_file() and file.name not in ("lock.mdb", "cache.db-shm"):
                files[str(file.relative_to(path))] = hashlib.sha256(file.read_bytes()).hexdigest()
    entries = [(e.namespace, e.key, e.size) for e in cache.entries()]
    return len(cache), entries, (stats.entries, stats.bytes, stats.stores), files


def _generator(values: list[Any]) -> Iterator[Any]:
    yield from values


BLOB = b"some state"
#: (call, exception, message pattern)
BAD_CALLS: dict[str, tuple[Callable[[sippcache.CacheBackend], Any], Any, str]] = {
    "tokens None": (lambda c: c.store(None, BLOB), TypeError, "tokens"),
    "tokens str": (lambda c: c.store("1 2 3", BLOB), TypeError, "tokens"),
    "tokens bytes": (lambda c: c.store(b"\x01\x02", BLOB), TypeError, "tokens"),
    "tokens int": (lambda c: c.store(7, BLOB), TypeError, ""),
    "tokens float": (lambda c: c.store([1, 2.5], BLOB), TypeError, "position 1"),
    "tokens numeric str": (lambda c: c.store([1, "2"], BLOB), TypeError, "position 1"),
    "tokens None inside": (lambda c: c.store([1, 2, None], BLOB), TypeError, "position 2"),
    "tokens nested list": (lambda c: c.store([[1, 2]], BLOB), TypeError, "position 0"),
    "token -1": (lambda c: c.store([-1], BLOB), ValueError, "position 0"),
    "token 2**31": (lambda c: c.store([1, 2**31], BLOB), ValueError, "position 1"),
    "token 2**32": (lambda c: c.store([1, 2, 2**32], BLOB), ValueError, "position 2"),
    "token 2**64": (lambda c: c.store([2**64], BLOB), ValueError, "position 0"),
    "token -2**63": (lambda c: c.store([5, -(2**63)], BLOB), ValueError, "position 1"),
    "generator with a bad id": (lambda c: c.store(_generator([1, 2, -3]), BLOB), ValueError, "position 2"),
    "numpy float array": (lambda c: c.store(np.array([1.0, 2.0]), BLOB), TypeError, ""),
    "numpy 2-d array": (lambda c: c.store(np.array([[1, 2], [3, 4]]), BLOB), TypeError, ""),
    "numpy bool array": (lambda c: c.store(np.array([True, False]), BLOB), TypeError, ""),
    "numpy int64 -1": (lambda c: c.store(np.array([1, -1], dtype=np.int64), BLOB), ValueError, "position 1"),
    "numpy uint32 2**31": (lambda c: c.store(np.array([2**31], dtype=np.uint32), BLOB), ValueError, "position 0"),
    "numpy big-endian 2**31": (lambda c: c.store(np.array([7, 2**31], dtype=">i8"), BLOB), ValueError, "position 1"),
    "empty tokens": (lambda c: c.store([], BLOB), ValueError, "empty"),
    "empty blob": (lambda c: c.store([4, 5], b""), ValueError, "empty"),
    "empty bytearray": (lambda c: c.store([4, 5], bytearray()), ValueError, "empty"),
    "empty memoryview": (lambda c: c.store([4, 5], memoryview(b"")), ValueError, "empty"),
    "blob str": (lambda c: c.store([4, 5], "state"), TypeError, "bytes"),
    "blob int": (lambda c: c.store([4, 5], 5), TypeError, "bytes"),
    "blob None": (lambda c: c.store([4, 5], None), TypeError, "bytes"),
    "blob list": (lambda c: c.store([4, 5], [1, 2]), TypeError, "bytes"),
    "namespace int": (lambda c: c.store([4, 5], BLOB, namespace=5), TypeError, "namespace"),
    "namespace None": (lambda c: c.store([4, 5], BLOB, namespace=None), TypeError, "namespace"),
    "namespace bytes": (lambda c: c.store([4, 5], BLOB, namespace=b"n"), TypeError, "namespace"),
    "namespace too long": (lambda c: c.store([4, 5], BLOB, namespace="x" * 1025), ValueError, "1024"),
    "namespace too long in bytes": (lambda c: c.store([4, 5], BLOB, namespace="é" * 513), ValueError, "1024"),
    "namespace lone surrogate": (lambda c: c.store([4, 5], BLOB, namespace="\ud800"), ValueError, ""),
    "lookup tokens None": (lambda c: c.lookup(None), TypeError, "tokens"),
    "lookup token -1": (lambda c: c.lookup([1, 2, -1], namespace="n"), ValueError, "position 2"),
    "lookup namespace int": (lambda c: c.lookup([1, 2, 3], namespace=1), TypeError, "namespace"),
    "delete tokens str": (lambda c: c.delete("1 2 3", namespace="n"), TypeError, "tokens"),
    "delete token 2**31": (lambda c: c.delete([1, 2, 2**31], namespace="n"), ValueError, "position 2"),
    "delete namespace None": (lambda c: c.delete([1, 2, 3], namespace=None), TypeError, "namespace"),
    "entries namespace int": (lambda c: c.entries(namespace=3), TypeError, "namespace"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_are_refused_and_write_nothing(cache: sippcache.CacheBackend, case: str) -> None:
    call, error, message = BAD_CALLS[case]
    before = _snapshot(cache)
    with pytest.raises(error, match=message or None):
        call(cache)
    assert _snapshot(cache) == before
    with cache.lookup([1, 2, 3], namespace="n") as match:
        assert bytes(match.blob) == b"existing"


def test_ten_million_token_key(url: str) -> None:
    """A huge key is stored and found again (also after reopening), or refused clearly."""
    tokens = np.arange(10_000_000, dtype=np.int32) % 50_000
    with sippcache.open(url) as cache:
        try:
            cache.store(tokens, b"huge prompt state", namespace="n")
        except SippcacheError as exc:  # a clear refusal is acceptable; a crash or another error is not
            assert len(cache) == 0, exc
            return
        with cache.lookup(np.concatenate([tokens, [7]]), namespace="n") as match:
            assert match.length == 10_000_000 and bytes(match.blob) == b"huge prompt state"
        with cache.lookup(tokens[:-1], namespace="n", partial=True) as match:
            assert match.length == 9_999_999
        assert cache.lookup(tokens[:-1], namespace="n") is None
        if not type(cache).persistent:
            return
    with sippcache.open(url) as cache:
        assert len(cache) == 1 and cache.stats().bytes == 40_000_000 + len(b"huge prompt state")
        with cache.lookup(tokens, namespace="n") as match:
            assert match.length == 10_000_000
        assert cache.delete(tokens, namespace="n") is True and len(cache) == 0


# -- options and paths: BadOption or a clear OSError, and nothing created -------------------------------

BAD_OPTIONS = {
    "ram": ["bogus=1", "max_bytes=-1", "max_bytes=0", "max_bytes=lots", "max_bytes=1PiB", "max_entries=0",
            "max_entries=1.5", "max_entries=-3", "max_bytes=1&max_bytes=2", "max_bytes", "max_bytes=" + "9" * 400],
    "lmdb": ["bogus=1", "max_bytes=0", "max_bytes=1e9", "max_entries=0", "sync=maybe", "max_readers=0",
             "max_readers=-1", "max_readers=99999999999", "map_size=-1", "map_size=1000000TiB",
             "max_bytes=1000000TiB", "max_bytes=" + "9" * 400],
    "diskcache": ["bogus=1", "max_bytes=0", "max_entries=0", "timeout=soon", "timeout=nan", "timeout=-1",
                  "max_bytes=" + "9" * 400],
}  # fmt: skip


@pytest.mark.parametrize(
    "backend, query",
    [pytest.param(b, q, id=f"{b}-{q if len(q) < 40 else q[:20] + '...'}") for b, qs in BAD_OPTIONS.items() for q in qs],
)
def test_bad_options_are_refused_before_anything_is_created(tmp_path: Path, backend: str, query: str) -> None:
    store = tmp_path / "store"
    url = ("ram://" if backend == "ram" else f"{backend}://{store}") + "?" + query
    with pytest.raises(SippcacheError) as raised:
        sippcache.open(url).close()
    assert isinstance(raised.value, BadOption) or "TiB" in query, f"{type(raised.value).__name__}: {raised.value}"
    assert str(raised.value).strip()
    assert list(tmp_path.iterdir()) == [], "a refused URL created files"


def _impossible_paths(tmp_path: Path) -> dict[str, str]:
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"not a directory\n")
    return {
        "through a regular file": f"{a_file}/sub",
        "through /etc/hostname": "/etc/hostname/sub",
        "through /dev/null": "/dev/null/sub",
        "a regular file": str(a_file),
        "/dev/null itself": "/dev/null",
        "a name longer than NAME_MAX": str(tmp_path / ("n" * 300)),
        "a path longer than PATH_MAX": str(tmp_path / "/".join(["d" * 200] * 30)),
        "3000 levels deep": str(tmp_path / "/".join(["d"] * 3000)),
        "an embedded NUL": str(tmp_path / "a%00b"),
        "under /proc": "/proc/self/sippcache-store",
    }


@pytest.mark.parametrize("backend", ["lmdb", "diskcache"])
@pytest.mark.parametrize(
    "what",
    [
        "through a regular file",
        "through /etc/hostname",
        "through /dev/null",
        "a regular file",
        "/dev/null itself",
        "a name longer than NAME_MAX",
        "a path longer than PATH_MAX",
        "3000 levels deep",
        "an embedded NUL",
        "under /proc",
    ],
)
def test_impossible_paths_are_refused_clearly_and_create_nothing(tmp_path: Path, backend: str, what: str) -> None:
    location = _impossible_paths(tmp_path)[what]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").exists() else None
    with pytest.raises(Exception) as raised:
        sippcache.open(f"{backend}://{location}").close()
    exc = raised.value
    assert isinstance(exc, (OSError, SippcacheError)), f"unclear error: {type(exc).__name__}: {exc}"
    assert str(exc).strip()
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before, "a refused path created files"
    assert (tmp_path / "a-file").read_bytes() == b"not a directory\n"
    if hostname is not None:
        assert Path("/etc/hostname").read_bytes() == hostname


@pytest.mark.parametrize("bad", [5, b"ram://", Path("/tmp"), ["ram://"]])  # (None means the default URL)
def test_open_wrong_url_types(bad: Any) -> None:
    with pytest.raises(TypeError):
        sippcache.open(bad)


# -- the llama adapter ----------------------------------------------------------------------------------


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 260) for _ in range(n - 1)]


@pytest.mark.parametrize("position", [10, 59], ids=["inside", "last"])
@pytest.mark.parametrize("bad_id", [260, 100_000, 2**31 - 1], ids=["n_vocab", "1e5", "int32-max"])
def test_prefill_refuses_token_ids_outside_the_vocabulary(make_llama, tiny_model, position, bad_id) -> None:
    """A token id in 0..2**31-1 but >= n_vocab: a ValueError naming it, nothing
    evaluated or stored, and the context still works for the next prompt."""
    from sippcache.llama import PrefixCache

    llm = make_llama(tiny_model, n_ctx=256)
    tokens = _prompt(60)
    bad = list(tokens)
    bad[position] = bad_id
    cache = sippcache.open("ram://")
    with PrefixCache(llm, cache) as pc:
        with pytest.raises(ValueError, match=f"position {position}"):
            pc.prefill(bad)
        pc.flush()
        assert len(cache) == 0 and pc.stats()["entries_written"] == 0
        assert pc.prefill(tokens) == 0
        _, never_cached = reference_logits(make_llama, tiny_model, tokens, n_ctx=256)
        np.testing.assert_array_equal(last_logits(llm), never_cached)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(max_pending_writes=0), ValueError),
        (dict(scope=5), TypeError),
        (dict(min_tokens=0), ValueError),
        (dict(checkpoint_interval=0), ValueError),
        (dict(min_tokens="16"), TypeError),
    ],
)
def test_prefix_cache_bad_arguments_create_no_store(make_llama, tiny_model, tmp_path, kwargs, error) -> None:
    from sippcache.llama import PrefixCache

    llm = make_llama(tiny_model, n_ctx=256)
    with pytest.raises(error):
        PrefixCache(llm, f"lmdb://{tmp_path / 'store'}", **kwargs)
    assert list(tmp_path.iterdir()) == [], "a refused PrefixCache created its store"


def test_prefix_cache_wrong_model_type_creates_no_store(tmp_path: Path) -> None:
    from sippcache.llama import PrefixCache

    with pytest.raises(TypeError, match="Llama"):
        PrefixCache("model.gguf", f"lmdb://{tmp_path / 'store'}")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs, error",
    [(dict(scope=5), TypeError), (dict(min_tokens=0), ValueError), (dict(checkpoint_interval=-1), ValueError)],
)
def test_llama_cache_bad_arguments_are_refused_at_construction(tmp_path: Path, kwargs, error) -> None:
    """Not at the first completion, inside llama-cpp-python's call."""
    from sippcache.llama import LlamaCache

    with pytest.raises(error):
        LlamaCache(f"lmdb://{tmp_path / 'store'}", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_prefill_wrong_token_types(make_llama, tiny_model) -> None:
    from sippcache.llama import PrefixCache

    with PrefixCache(make_llama(tiny_model, n_ctx=256), "ram://") as pc:
        for bad, error in (
            ("hello", TypeError),
            ([1, 2.5], TypeError),
            (None, TypeError),
            ([1, -1], ValueError),
            (np.array([1.0]), TypeError),
            ([1] * 300, ValueError),
        ):
            with pytest.raises(error):
                pc.prefill(bad)
        assert len(pc.cache) == 0
        assert pc.prefill(_prompt(20)) == 0

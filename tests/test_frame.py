"""The entry format: round trips, and damage always detected (hypothesis)."""

from __future__ import annotations

import struct

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from sippcache import CorruptEntry, frame

FIELDS = dict(fingerprint="model-abc", kind="llama.seq", versions={"llama_cpp": "0.3.36"}, meta={"n_ctx": 2048})


def make(tokens=(1, 2, 3), sections=(b"payload-one", b"two")) -> bytes:
    return frame.encode(list(tokens), list(sections), created=1700000000.5, **FIELDS)


def test_round_trip() -> None:
    decoded = frame.decode(make())
    assert decoded.tokens == (1, 2, 3)
    assert [bytes(s) for s in decoded.sections] == [b"payload-one", b"two"]
    assert decoded.fingerprint == "model-abc" and decoded.kind == "llama.seq"
    assert decoded.versions == {"llama_cpp": "0.3.36"} and decoded.meta == {"n_ctx": 2048}
    assert decoded.created == 1700000000.5 and decoded.payload_size == 14


def test_sections_are_zero_copy_views() -> None:
    buf = bytearray(make())
    decoded = frame.decode(memoryview(buf))
    assert isinstance(decoded.sections[0], memoryview)
    assert decoded.sections[0].obj is buf  # a view of the caller's buffer, not a copy


def test_payload_is_last_and_raw() -> None:
    data = make(sections=[b"A" * 100])
    assert data.endswith(b"A" * 100) and data.startswith(frame.MAGIC)


def test_empty_and_large_payloads() -> None:
    assert frame.decode(make(sections=[])).sections == ()
    big = bytes(range(256)) * 40_000
    assert bytes(frame.decode(make(sections=[big])).sections[0]) == big


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d[:10], "shorter"),
        (lambda d: b"XXXXXXXX" + d[8:], "magic"),
        (lambda d: d[:8] + struct.pack("<H", 99) + d[10:], "version 99"),
        (lambda d: d[:-1], "payload"),
        (lambda d: d + b"!", "payload"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
        (lambda d: d[:30] + bytes([d[30] ^ 0x40]) + d[31:], "header"),
    ],
)
def test_damage_is_detected(damage, message) -> None:
    with pytest.raises(CorruptEntry, match=message):
        frame.decode(damage(make()))


def _reframe(header: object) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return struct.pack("<8sHIQ", frame.MAGIC, frame.FORMAT_VERSION, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw


@pytest.mark.parametrize(
    "header",
    [
        [1, 2, 3],
        {"tokens": "not bytes"},
        {**msgpack.unpackb(msgpack.packb({}))},
        {"tokens": b"\x01\x00\x00", "fingerprint": "", "kind": "", "versions": {}, "created": 0.0,
         "sizes": [], "checksum": xxhash.xxh3_64_intdigest(b""), "meta": {}},
        {"tokens": b"", "fingerprint": "", "kind": "", "versions": {}, "created": 0.0,
         "sizes": [-1], "checksum": 0, "meta": {}},
        {"tokens": b"", "fingerprint": "", "kind": "", "versions": {"a": 1}, "created": 0.0,
         "sizes": [], "checksum": xxhash.xxh3_64_intdigest(b""), "meta": {}},
    ],
)  # fmt: skip
def test_well_hashed_but_invalid_headers_are_corrupt(header) -> None:
    """A header with a valid hash but wrong fields (a crafted file) is still refused."""
    with pytest.raises(CorruptEntry):
        frame.decode(_reframe(header))


@pytest.mark.parametrize("extra", [dict(meta={1: "x"}), dict(meta={"k": [1]}), dict(versions={"a": 1})])
def test_encode_refuses_fields_decode_would_refuse(extra) -> None:
    with pytest.raises(TypeError):
        frame.encode([1], [b"x"], fingerprint="f", kind="k", **extra)


def test_header_cannot_claim_more_than_the_buffer() -> None:
    data = bytearray(make())
    struct.pack_into("<I", data, 10, 2**31)
    with pytest.raises(CorruptEntry, match="exceeds"):
        frame.decode(bytes(data))


tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=50)
sections_st = st.lists(st.binary(max_size=200), max_size=4)


@settings(max_examples=300, deadline=None)
@given(tokens=tokens_st, sections=sections_st)
def test_encode_decode_round_trip(tokens, sections) -> None:
    decoded = frame.decode(frame.encode(tokens, sections, **FIELDS))
    assert list(decoded.tokens) == tokens
    assert [bytes(s) for s in decoded.sections] == sections


def _same(a: frame.Frame, b: frame.Frame) -> bool:
    return (a.tokens, a.fingerprint, a.kind, dict(a.versions), a.created, dict(a.meta)) == (
        b.tokens, b.fingerprint, b.kind, dict(b.versions), b.created, dict(b.meta)
    ) and [bytes(s) for s in a.sections] == [bytes(s) for s in b.sections]  # fmt: skip


@settings(max_examples=2000, deadline=None)
@given(tokens=tokens_st, sections=sections_st, data=st.data())
def test_any_byte_flip_or_truncation_is_corrupt_or_identical(tokens, sections, data) -> None:
    original = frame.encode(tokens, sections, **FIELDS)
    buf = bytearray(original)
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(buf)))
        del buf[cut:]
    else:
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] ^= data.draw(st.integers(1, 255))
    try:
        decoded = frame.decode(bytes(buf))
    except CorruptEntry:
        return
    assert _same(decoded, frame.decode(original))


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_corrupt_entry(data) -> None:
    for candidate in (data, frame.MAGIC + data):
        try:
            frame.decode(candidate)
        except CorruptEntry:
            pass

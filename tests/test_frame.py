"""The entry format: round trips, and damage always detected (hypothesis)."""

from __future__ import annotations

import random
import struct
from array import array

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from sippcache import CorruptEntry, frame
from sippcache.state.buffers import StateBuffers

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


@pytest.mark.parametrize("secret", [None, b"k" * 16])
def test_a_section_given_in_pieces_is_the_same_frame(secret: bytes | None) -> None:
    """A section may come as a list of buffers (a state's chunk, from views of it): the frame is
    byte for byte the one of the joined section."""
    state = bytes(range(256)) * 4
    pieces = [memoryview(state)[:100], state[100:612], bytearray(state[612:])]
    whole = frame.encode([1, 2], [state, b"tail"], created=1.0, secret=secret, **FIELDS)
    assert frame.encode([1, 2], [pieces, b"tail"], created=1.0, secret=secret, **FIELDS) == whole
    assert frame.encode([1, 2], [(), b"tail"], created=1.0, **FIELDS) == frame.encode(
        [1, 2], [b"", b"tail"], created=1.0, **FIELDS
    )
    assert [bytes(s) for s in frame.decode(whole, secret=secret).sections] == [state, b"tail"]


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
        {
            "tokens": b"\x01\x00\x00",
            "fingerprint": "",
            "kind": "",
            "versions": {},
            "created": 0.0,
            "sizes": [],
            "checksum": xxhash.xxh3_64_intdigest(b""),
            "meta": {},
        },
        {
            "tokens": b"",
            "fingerprint": "",
            "kind": "",
            "versions": {},
            "created": 0.0,
            "sizes": [-1],
            "checksum": 0,
            "meta": {},
        },
        {
            "tokens": b"",
            "fingerprint": "",
            "kind": "",
            "versions": {"a": 1},
            "created": 0.0,
            "sizes": [],
            "checksum": xxhash.xxh3_64_intdigest(b""),
            "meta": {},
        },
    ],
)
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
        b.tokens,
        b.fingerprint,
        b.kind,
        dict(b.versions),
        b.created,
        dict(b.meta),
    ) and [bytes(s) for s in a.sections] == [bytes(s) for s in b.sections]


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


# -- version 2: roles and MACs; version 1 still read ---------------------------------------------

#: A frame written by sippcache 0.1.0 (format version 1): tokens 1 2 3, one section b"state-bytes".
V1_FRAME = bytes.fromhex(
    "534950504b560d0a01008e000000af29d1c7b9df025588a6746f6b656e73c40c010000000200000003000000ab66696e676572"
    "7072696e74a26670a46b696e64a96c6c616d612e736571a876657273696f6e7381b06c6c616d615f6370705f707974686f6ea6"
    "302e332e3336a763726561746564cb41d954fc40000000a573697a6573910ba8636865636b73756dcf75300648b4a5478ba46d"
    "65746181a56e5f7377610073746174652d6279746573"
)


def test_version_1_frames_still_load() -> None:
    decoded = frame.decode(V1_FRAME)
    assert decoded.tokens == (1, 2, 3) and [bytes(s) for s in decoded.sections] == [b"state-bytes"]
    assert decoded.roles == ("",) and decoded.section("logits") is None and not decoded.authenticated
    assert decoded.meta == {"n_swa": 0}
    with pytest.raises(CorruptEntry, match="no MAC"):  # with a secret set, unauthenticated entries are refused
        frame.decode(V1_FRAME, secret="s3cret")


def test_new_frames_are_version_2() -> None:
    # sippcache 0.1.0 reads version 1 only, so it refuses these with "unsupported entry format version 2".
    assert struct.unpack_from("<H", make(), 8)[0] == 2 == frame.FORMAT_VERSION


def test_a_newer_version_is_unsupported_not_damaged() -> None:
    data = make()
    with pytest.raises(frame.UnsupportedEntry, match="version 3"):
        frame.decode(data[:8] + struct.pack("<H", 3) + data[10:])
    assert issubclass(frame.UnsupportedEntry, CorruptEntry)


def test_roles_name_sections() -> None:
    data = frame.encode([1], [b"kv", b"\x00" * 8], roles=["state", "logits"], **FIELDS)
    decoded = frame.decode(data)
    assert decoded.roles == ("state", "logits")
    assert bytes(decoded.section("logits")) == b"\x00" * 8 and bytes(decoded.section("state")) == b"kv"
    assert decoded.section("other") is None
    with pytest.raises(TypeError, match="roles"):
        frame.encode([1], [b"kv"], roles=["state", "logits"], **FIELDS)


def test_mac_round_trip_and_refusals() -> None:
    data = frame.encode([1, 2], [b"state"], secret="s3cret", **FIELDS)
    assert frame.decode(data, secret="s3cret").authenticated
    assert frame.decode(data, secret=b"s3cret").authenticated  # str and its utf-8 bytes are one secret
    assert not frame.decode(data).authenticated  # no secret: checksums only
    with pytest.raises(CorruptEntry, match="MAC"):
        frame.decode(data, secret="other")
    with pytest.raises(CorruptEntry, match="no MAC"):
        frame.decode(make(), secret="s3cret")
    with pytest.raises(CorruptEntry):
        frame.decode(data[:-1], secret="s3cret")
    with pytest.raises(TypeError):
        frame.encode([1], [b"x"], secret="", **FIELDS)


def test_a_planted_entry_with_valid_checksums_is_refused_with_a_secret() -> None:
    """Anyone can compute xxh3 checksums; only the secret's holders can make a MAC."""
    planted = frame.encode([1, 2], [b"evil state"], **FIELDS)  # perfectly formed, no MAC
    assert bytes(frame.decode(planted).sections[0]) == b"evil state"
    with pytest.raises(CorruptEntry):
        frame.decode(planted, secret="s3cret")
    forged = planted[:-10] + b"evil!state"[:10]  # edited payload, recomputed nothing
    with pytest.raises(CorruptEntry):
        frame.decode(forged, secret="s3cret")


@settings(max_examples=300, deadline=None)
@given(position=st.integers(min_value=0), mask=st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_of_an_authenticated_frame_is_refused(position: int, mask: int) -> None:
    data = bytearray(
        frame.encode([5, 6, 7], [b"state" * 20, b"logits" * 4], roles=["state", "logits"], secret="k", **FIELDS)
    )
    data[position % len(data)] ^= mask
    with pytest.raises(CorruptEntry):
        frame.decode(bytes(data), secret="k")


def test_secret_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIPPCACHE_SECRET", raising=False)
    assert frame.secret_from_environment() is None
    monkeypatch.setenv("SIPPCACHE_SECRET", "")
    assert frame.secret_from_environment() is None
    monkeypatch.setenv("SIPPCACHE_SECRET", "päss")
    assert frame.secret_from_environment() == "päss".encode()


#: A frame as sippcache wrote it until 2026-11-27 (commit 7c23fba): the payload's checksum in the middle of the
#: header's map (now its last field, always 9 bytes: `encode_into` needs the header's length first).
V2_FRAME_BEFORE_FIXED_CHECKSUM = bytes.fromhex(
    "534950504b560d0a020083000000e621270b125f65be89a6746f6b656e73c40c010000000200000003000000ab66696e"
    "6765727072696e74a26670a46b696e64a96c6c616d612e736571a876657273696f6e7380a763726561746564cb3ff000"
    "0000000000a573697a6573910ba8636865636b73756dcf75300648b4a5478ba46d65746181a56e5f73776100a5726f6c"
    "657391a5737461746573746174652d6279746573"
)


def test_frames_written_before_the_checksum_moved_still_load() -> None:
    decoded = frame.decode(V2_FRAME_BEFORE_FIXED_CHECKSUM)
    assert decoded.tokens == (1, 2, 3) and [bytes(s) for s in decoded.sections] == [b"state-bytes"]
    assert (decoded.roles, decoded.meta, decoded.created) == (("state",), {"n_swa": 0}, 1.0)


@pytest.mark.parametrize("secret", [None, b"k" * 16])
def test_a_frame_written_into_a_buffer_is_encodes_frame(secret: bytes | None) -> None:
    """`encode_into` writes `encode`'s bytes into a buffer of a `StateBuffers`, whatever the
    sections' pieces (more than one copy-and-hash block, pieces across blocks, empty ones), and
    the next frame goes into the same buffer."""
    rng = random.Random(7)
    big = rng.randbytes(frame._BLOCK * 2 + 12345)
    sections = [
        [memoryview(big)[:1000], big[1000 : frame._BLOCK + 3], bytearray(big[frame._BLOCK + 3 :])],
        b"",
        array("f", [0.5, -1.0, 2.25]),  # a non-byte format (logits) is taken as its bytes
    ]
    buffers = StateBuffers()
    expected = frame.encode([9, 8, 7], sections, created=2.0, roles=["state", "x", "logits"], secret=secret, **FIELDS)
    written = frame.encode_into(
        buffers, [9, 8, 7], sections, created=2.0, roles=["state", "x", "logits"], secret=secret, **FIELDS
    )
    assert bytes(written) == expected
    decoded = frame.decode(written, secret=secret)
    assert [bytes(s) for s in decoded.sections] == [big, b"", array("f", [0.5, -1.0, 2.25]).tobytes()]
    buffer = written.obj
    del decoded
    buffers.give_back(written)
    small = frame.encode_into(buffers, [1], [b"tiny"], created=3.0, **FIELDS)
    assert small.obj is buffer and bytes(small) == frame.encode([1], [b"tiny"], created=3.0, **FIELDS)


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50),
    sections=st.lists(st.lists(st.binary(max_size=300), max_size=4), max_size=4),
    meta=st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5), max_size=3),
)
def test_encode_into_and_encode_agree(tokens: list[int], sections: list[list[bytes]], meta: dict) -> None:
    buffers = StateBuffers()
    fields = {**FIELDS, "meta": meta}
    written = frame.encode_into(buffers, tokens, sections, created=5.0, **fields)
    assert bytes(written) == frame.encode(tokens, sections, created=5.0, **fields)
    assert frame.decode(written).sections == tuple(b"".join(s) for s in sections)


def test_a_frame_is_made_as_its_store_is_best_given_it() -> None:
    """New bytes for a store that keeps the bytes it is given (RAM), a buffer used again, given
    back after the block, for one that copies them (LMDB, and any store that does not say)."""

    class Keeps:
        keeps_bytes = True

    buffers = StateBuffers()
    expected = frame.encode([4, 5], [b"kv" * 1000], created=1.0, **FIELDS)
    with frame.framed_for(Keeps(), buffers, [4, 5], [b"kv" * 1000], created=1.0, **FIELDS) as kept:
        assert type(kept) is bytes and kept == expected
    assert buffers.free_bytes == 0
    with frame.framed_for(object(), buffers, [4, 5], [b"kv" * 1000], created=1.0, **FIELDS) as copied:
        assert isinstance(copied, memoryview) and bytes(copied) == expected
        assert buffers.free_bytes == 0  # taken
    assert buffers.free_bytes == len(expected)  # given back, kept for the next frame

"""Token validation and the radix prefix index against a brute-force model."""

from __future__ import annotations

from array import array

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sippcache import tokens
from sippcache.index import PrefixIndex, common_prefix_bytes


def test_encode_is_little_endian_uint32() -> None:
    assert tokens.encode([1, 2**31 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\x7f"
    assert tokens.decode(tokens.encode([5, 0, 7])) == (5, 0, 7)


@pytest.mark.parametrize(
    "value",
    [
        numpy.array([3, 4], dtype=numpy.int16),
        numpy.array([3, 4], dtype=numpy.uint64),
        array("b", [3, 4]),
        numpy.array([3, 4], dtype=">i4"),
        numpy.arange(10)[3:5],
    ],
)
def test_integer_buffers_accepted(value) -> None:
    assert tokens.encode(value) == tokens.encode([3, 4])


@pytest.mark.parametrize(
    "value, error",
    [
        (numpy.array([1.0, 2.0]), TypeError),
        (numpy.zeros((2, 2), dtype=numpy.int32), TypeError),
        (numpy.array([1, -3], dtype=numpy.int32), ValueError),
        (numpy.array([1, 2**32], dtype=numpy.int64), ValueError),
        (None, TypeError),
        (5, TypeError),
        ([True, 2**31], ValueError),
    ],
)
def test_bad_token_inputs(value, error) -> None:
    with pytest.raises(error):
        tokens.encode(value)


def test_iterators_are_read_once() -> None:
    assert tokens.encode(iter([4, 5])) == tokens.encode([4, 5])
    with pytest.raises(ValueError, match="position 1"):
        tokens.encode(iter([1, 2**70]))


def test_error_names_the_position() -> None:
    with pytest.raises(ValueError, match="token id -3 at position 1"):
        tokens.encode(numpy.array([1, -3], dtype=numpy.int32))


@given(st.lists(st.integers(0, 3), max_size=300), st.lists(st.integers(0, 3), max_size=300), st.integers(0, 300))
def test_common_prefix_of_token_sequences(a: list[int], rest: list[int], shared: int) -> None:
    """Against a step per token, for sequences sharing any length (past the halving's window of
    32 too), of the kinds the callers pass: lists, tuples, arrays and numpy arrays, mixed."""
    b = a[:shared] + rest
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    for x, y in ((a, b), (tuple(a), b), (array("i", a), tuple(b)), (numpy.array(a, dtype=numpy.int32), b)):
        assert tokens.common_prefix(x, y) == tokens.common_prefix(y, x) == n


@given(st.binary(max_size=64), st.binary(max_size=64))
def test_common_prefix_bytes(a: bytes, b: bytes) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_bytes(a, b) == n


@given(st.binary(min_size=1, max_size=5000), st.integers(min_value=0), st.integers(0, 7), st.integers(0, 5000))
def test_common_prefix_bytes_of_long_keys(a: bytes, at: int, bit: int, cut: int) -> None:
    """Long keys (past the halving's 64-byte window), one bit apart anywhere or not at all, one
    cut shorter, given as bytes or as memoryviews (how the index passes the rest of a key)."""
    at %= len(a)
    other = bytearray(a)
    other[at] ^= 1 << bit
    for b, expected in ((bytes(other), at), (a, len(a)), (bytes(other)[:cut], min(at, cut))):
        assert common_prefix_bytes(a, b) == expected
        assert common_prefix_bytes(memoryview(b), memoryview(a)) == expected


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


key_st = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)
ops_st = st.lists(
    st.tuples(
        st.sampled_from(["insert", "remove", "touch"]), key_st, st.lists(st.integers(0, 3), max_size=10).map(tuple)
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops_st)
def test_index_matches_brute_force(ops) -> None:
    index = PrefixIndex()
    model: dict[tuple[int, ...], int] = {}  # key -> rank
    for rank, (op, key, query) in enumerate(ops):
        eid = bytes(key)
        if op == "insert":
            index.insert("ns", tokens.encode(key), eid, rank)
            model[key] = rank
        elif op == "remove":
            assert index.remove(eid) == (model.pop(key, None) is not None)
        elif key in model:
            index.touch(eid, rank)
            model[key] = rank
        q = tokens.encode(query)
        prefixes = [k for k in model if query[: len(k)] == k]
        hit = index.longest_prefix("ns", q)
        expected = max(prefixes, key=len) if prefixes else None
        assert (hit.entry_id, hit.length) == (bytes(expected), len(expected)) if expected else hit is None
        hit = index.longest_common("ns", q)
        best = max((_lcp(k, query) for k in model), default=0)
        if best == 0:
            assert hit is None
        else:
            ties = [k for k in model if _lcp(k, query) == best]
            assert hit is not None and hit.length == best
            assert hit.entry_id == bytes(max(ties, key=lambda k: model[k]))  # most recently used
        assert len(index) == len(model)
        for k in model:
            assert index.key_of(bytes(k)) == tokens.encode(k)
    assert index.longest_prefix("other", tokens.encode([0, 1, 2, 3])) is None

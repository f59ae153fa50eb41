"""Token sequences: validation and their canonical byte form.

Every key is stored and indexed as little-endian uint32 bytes. Bytes compare,
hash and slice in C, which is what makes prefix matching cheap in Python.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, Union

#: Largest token id accepted (llama.cpp's ``llama_token`` is an int32).
MAX_TOKEN_ID = 2**31 - 1

#: What the public API accepts as a token sequence: a list, tuple,
#: ``array.array`` or 1-d numpy integer array.
Tokens = Union[Sequence[int], Any]

_BUFFER_FORMATS = {"b", "B", "h", "H", "i", "I", "l", "L", "q", "Q"}


def _as_int_array(tokens: Tokens) -> array:
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or tokens is None:
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    try:
        view = memoryview(tokens)  # numpy arrays and array.array: no per-item Python objects
    except TypeError:
        view = None
    if view is not None:
        fmt = view.format.lstrip("@=<>!")
        if view.ndim != 1 or fmt not in _BUFFER_FORMATS:
            raise TypeError(f"tokens must be a 1-d integer array, got format {view.format!r} with {view.ndim} dims")
        out = array(fmt)
        if out.itemsize != view.itemsize:
            raise TypeError(f"tokens: unsupported integer buffer format {view.format!r}")
        out.frombytes(view.tobytes())
        if view.format[:1] in "<>!" and (view.format[0] == "<") != (sys.byteorder == "little"):
            out.byteswap()
        return out
    if not isinstance(tokens, Sequence):
        tokens = list(tokens)  # an iterator is read once; errors below iterate again
    try:
        return array("q", tokens)
    except OverflowError:
        pass  # an id beyond int64: report its position below
    except TypeError as exc:
        for i, t in enumerate(tokens):
            if not isinstance(t, int) and not hasattr(t, "__index__"):
                raise TypeError(f"token at position {i} is {type(t).__name__}, not int") from exc
        raise TypeError(f"tokens must be a sequence of ints: {exc}") from exc
    for i, t in enumerate(tokens):
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"token id {t} at position {i} is outside 0..{MAX_TOKEN_ID}")
    raise AssertionError("unreachable")  # pragma: no cover


def encode(tokens: Tokens) -> bytes:
    """Validate `tokens` and return them as little-endian uint32 bytes.

    Raises TypeError for non-integer input and ValueError naming the first
    position whose id is outside 0..2**31-1.
    """
    ids = _as_int_array(tokens)
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        for i, t in enumerate(ids):
            if not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"token id {t} at position {i} is outside 0..{MAX_TOKEN_ID}")
    out = array("I", ids) if ids.typecode != "I" else ids
    if out.itemsize != 4:  # pragma: no cover - platforms with 8-byte 'I'
        raise RuntimeError("unsupported platform: array('I') is not 32-bit")
    if sys.byteorder != "little":  # pragma: no cover
        out.byteswap()
    return out.tobytes()


def decode(data: bytes | memoryview) -> tuple[int, ...]:
    """The token ids of a byte form made by `encode`."""
    ids = array("I")
    ids.frombytes(bytes(data))
    if sys.byteorder != "little":  # pragma: no cover
        ids.byteswap()
    return tuple(ids)

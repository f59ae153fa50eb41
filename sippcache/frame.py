"""The entry format: a self-checking envelope around llama.cpp state bytes.

Backends store opaque bytes; this module alone gives them meaning. Layout
(all integers little-endian)::

    magic        8 bytes   b"SIPPKV\\r\\n"
    version      u16       FORMAT_VERSION
    header_len   u32       length of the msgpack header
    header_hash  u64       xxh3_64 of the header bytes
    header       msgpack   a map, see `Frame`
    payload      raw       the sections, back to back (sizes in the header)

The payload comes last and raw so a reader can hand a view of it (an LMDB
page, an mmap) straight to llama.cpp without a copy. The header carries an
xxh3_64 of the payload; `decode` checks both hashes, every size and every
header field's type, and raises `CorruptEntry` on any mismatch. No pickle:
a cache file can only ever be data.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import xxhash

from . import tokens as _tokens
from .errors import CorruptEntry

MAGIC = b"SIPPKV\r\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHIQ")
#: Upper bound on a header (token list included: 100k tokens are 400 KB).
MAX_HEADER_BYTES = 64 * 1024 * 1024

Buffer = Union[bytes, bytearray, memoryview]
_META_TYPES = (str, int, float, bool, bytes)


@dataclass(frozen=True)
class Frame:
    """A decoded entry. `sections` are zero-copy views into the buffer given to `decode`."""

    tokens: tuple[int, ...]
    fingerprint: str
    kind: str
    sections: tuple[memoryview, ...]
    versions: Mapping[str, str] = field(default_factory=dict)
    created: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def payload_size(self) -> int:
        return sum(len(s) for s in self.sections)


def encode(
    tokens: _tokens.Tokens,
    sections: Sequence[Buffer],
    *,
    fingerprint: str,
    kind: str,
    versions: Mapping[str, str] | None = None,
    created: float | None = None,
    meta: Mapping[str, Any] | None = None,
) -> bytes:
    """Frame payload `sections` (e.g. one llama.cpp sequence state) for storage.

    `fingerprint` names what the state belongs to (model, cache types, library
    versions); `kind` what the payload is (e.g. ``"llama.seq"``); `meta` holds
    small extra fields (str/int/float/bool/bytes values only).
    """
    if not isinstance(fingerprint, str) or not isinstance(kind, str):
        raise TypeError("fingerprint and kind must be str")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (versions or {}).items()):
        raise TypeError("versions must map str to str")
    if not all(isinstance(k, str) and isinstance(v, _META_TYPES) for k, v in (meta or {}).items()):
        raise TypeError("meta must map str to str, int, float, bool or bytes")
    payload_hash = xxhash.xxh3_64()
    sizes = []
    for section in sections:
        payload_hash.update(section)
        sizes.append(memoryview(section).nbytes)
    header = msgpack.packb(
        {
            "tokens": _tokens.encode(tokens),
            "fingerprint": fingerprint,
            "kind": kind,
            "versions": dict(versions or {}),
            "created": time.time() if created is None else float(created),
            "sizes": sizes,
            "checksum": payload_hash.intdigest(),
            "meta": dict(meta or {}),
        },
        use_bin_type=True,
    )
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), xxhash.xxh3_64_intdigest(header))
    return b"".join([prefix, header, *sections])


# name -> type every header field must have
_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "tokens": bytes,
    "fingerprint": str,
    "kind": str,
    "versions": dict,
    "created": float,
    "sizes": list,
    "checksum": int,
    "meta": dict,
}


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    limit = len(raw)
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=limit,
            max_str_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types for bad input
        raise CorruptEntry(f"unreadable entry header: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptEntry("entry header is not a map")
    for name, kind in _SCHEMA.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise CorruptEntry(f"entry header field {name!r} is missing or has the wrong type")
    if len(header["tokens"]) % 4:
        raise CorruptEntry("entry header token list is not a whole number of tokens")
    if header["tokens"][3::4].translate(None, bytes(range(0x80))):
        raise CorruptEntry("entry header has a token id outside 0..2**31-1")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in header["sizes"]):
        raise CorruptEntry("entry header has an invalid section size")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in header["versions"].items()):
        raise CorruptEntry("entry header versions must map str to str")
    return header


def decode(buf: Buffer) -> Frame:
    """Parse and verify a framed entry; raise `CorruptEntry` on any damage.

    The returned sections are views of `buf`: keep `buf` alive (and, for an
    LMDB match, the match unreleased) while you use them.
    """
    view = memoryview(buf).cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptEntry(f"entry is {len(view)} bytes, shorter than the {_PREFIX.size}-byte frame prefix")
    magic, version, header_len, header_hash = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("not a sippcache entry (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"unsupported entry format version {version} (this sippcache reads {FORMAT_VERSION})")
    start, end = _PREFIX.size, _PREFIX.size + header_len
    if header_len > MAX_HEADER_BYTES or end > len(view):
        raise CorruptEntry(f"entry header length {header_len} exceeds the entry")
    raw_header = view[start:end]
    if xxhash.xxh3_64_intdigest(raw_header) != header_hash:
        raise CorruptEntry("entry header checksum mismatch")
    header = _unpack_header(raw_header)
    payload = view[end:]
    if sum(header["sizes"]) != len(payload):
        raise CorruptEntry(f"entry payload is {len(payload)} bytes, header says {sum(header['sizes'])}")
    if xxhash.xxh3_64_intdigest(payload) != header["checksum"]:
        raise CorruptEntry("entry payload checksum mismatch")
    sections = []
    offset = 0
    for size in header["sizes"]:
        sections.append(payload[offset : offset + size])
        offset += size
    return Frame(
        tokens=_tokens.decode(header["tokens"]),
        fingerprint=header["fingerprint"],
        kind=header["kind"],
        sections=tuple(sections),
        versions=header["versions"],
        created=header["created"],
        meta=header["meta"],
    )

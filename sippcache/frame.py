"""The entry format: a self-checking envelope around llama.cpp state bytes.

Backends store opaque bytes; this module alone gives them meaning. Layout
(all integers little-endian)::

    magic        8 bytes   b"SIPPKV\\r\\n"
    version      u16       FORMAT_VERSION (2; version 1 frames are still read)
    header_len   u32       length of the msgpack header
    header_hash  u64       xxh3_64 of the header bytes
    header       msgpack   a map, see `Frame`
    payload      raw       the sections, back to back (sizes in the header)
    mac          32 bytes  only if the header says so: keyed BLAKE2b of all the above

The payload is raw so a reader can hand a view of it (an LMDB page, an mmap)
straight to llama.cpp without a copy. The header carries an xxh3_64 of the
payload; `decode` checks both hashes, every size and every header field's
type, and raises `CorruptEntry` on any mismatch. With a secret, `encode`
appends a MAC and `decode` refuses any frame without a valid one, so whoever
can write to a shared store cannot plant a state. No pickle: a cache file can
only ever be data.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgpack  # type: ignore[import-untyped]  # msgpack ships no type information
import xxhash

from . import tokens as _tokens
from .errors import CorruptEntry, UnsupportedEntry
from .protocol import Blob

if TYPE_CHECKING:
    from .state.buffers import StateBuffers

MAGIC = b"SIPPKV\r\n"
FORMAT_VERSION = 2
#: Versions `decode` reads: 1 (no roles, no MAC) and 2.
READABLE_VERSIONS = (1, 2)
MAC_BYTES = 32
#: Environment variable holding the secret that keys entry MACs (see `secret_from_environment`).
SECRET_ENVIRONMENT_VARIABLE = "SIPPCACHE_SECRET"
_PREFIX = struct.Struct("<8sHIQ")
#: Upper bound on a header (token list included: 100k tokens are 400 KB).
MAX_HEADER_BYTES = 64 * 1024 * 1024

_META_TYPES = (str, int, float, bool, bytes)


@dataclass(frozen=True)
class Frame:
    """A decoded entry. `sections` are zero-copy views into the buffer given to `decode`."""

    #: The key's tokens as `sippcache.tokens.encode` bytes: compared as they are (a chunk's key
    #: holds every token before it), decoded into `tokens` only when asked for.
    token_bytes: bytes
    fingerprint: str
    kind: str
    sections: tuple[memoryview, ...]
    versions: Mapping[str, str] = field(default_factory=dict)
    created: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ()  # one name per section ("" where the writer gave none)
    authenticated: bool = False  # its MAC was checked against a secret
    #: The payload's (the sections' bytes back to back) xxh3_64, as the header gives it: what
    #: `decode` checks, and a caller of `decode(check_payload=False)` may check later.
    checksum: int = 0

    @property
    def tokens(self) -> tuple[int, ...]:
        """The key's token ids (decoded once). Not a `functools.cached_property`: before Python
        3.12 that holds one lock for every instance, and a child forked while another thread
        held it would wait for it forever."""
        ids: tuple[int, ...] | None = self.__dict__.get("_token_ids")
        if ids is None:
            ids = _tokens.decode(self.token_bytes)
            object.__setattr__(self, "_token_ids", ids)  # a frozen dataclass: its own cache
        return ids

    @property
    def payload_size(self) -> int:
        return sum(len(s) for s in self.sections)

    def section(self, role: str) -> memoryview | None:
        """The section named `role`, or None."""
        return self.sections[self.roles.index(role)] if role in self.roles else None


Secret = str | bytes


def secret_from_environment() -> bytes | None:
    """The secret in `SIPPCACHE_SECRET`, if it is set and not empty."""
    value = os.environ.get(SECRET_ENVIRONMENT_VARIABLE, "")
    return value.encode("utf-8") if value else None


def _mac(secret: Secret, parts: Sequence[Blob]) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes) or not secret:
        raise TypeError("a secret must be a non-empty str or bytes")
    key = hashlib.blake2b(secret, digest_size=32, person=b"sippcache.key").digest()
    digest = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=b"sippcache.mac")
    for part in parts:
        digest.update(part)
    return digest.digest()


def encode(
    tokens: _tokens.Tokens,
    sections: Sequence[Blob | Sequence[Blob]],
    *,
    fingerprint: str,
    kind: str,
    versions: Mapping[str, str] | None = None,
    created: float | None = None,
    meta: Mapping[str, Any] | None = None,
    roles: Sequence[str] | None = None,
    secret: Secret | None = None,
) -> bytes:
    """Frame payload `sections` (e.g. one llama.cpp sequence state) for storage.

    `fingerprint` names what the state belongs to (model, cache types, library
    versions); `kind` what the payload is (e.g. ``"llama.seq"``); `meta` holds
    small extra fields (str/int/float/bool/bytes values only); `roles` names
    each section (e.g. ``["state", "logits"]``). A section may be given as a
    list (or tuple) of buffers, one after the other: the frame is then the only
    copy made of them (a chunk of a state, from views of it). With a `secret`,
    a MAC over the whole frame is appended (keyed BLAKE2b; about 1 GB/s).
    """
    _check_fields(fingerprint, kind, versions, meta, roles, len(sections))
    payload_hash = xxhash.xxh3_64()
    sizes = []
    flat: list[Blob] = []
    for section in sections:
        size = 0
        for piece in _pieces(section):
            payload_hash.update(piece)
            size += memoryview(piece).nbytes
            flat.append(piece)
        sizes.append(size)
    head = _head(tokens, sizes, fingerprint, kind, versions, created, meta, roles, secret)
    parts = [_with_checksum(head, payload_hash.intdigest()), *flat]
    if secret is not None:
        parts.append(_mac(secret, parts))
    return b"".join(parts)


def encode_into(
    buffers: StateBuffers,
    tokens: _tokens.Tokens,
    sections: Sequence[Blob | Sequence[Blob]],
    *,
    fingerprint: str,
    kind: str,
    versions: Mapping[str, str] | None = None,
    created: float | None = None,
    meta: Mapping[str, Any] | None = None,
    roles: Sequence[str] | None = None,
    secret: Secret | None = None,
) -> memoryview:
    """`encode`'s frame, byte for byte, written into a buffer taken from `buffers`: a view of
    it, to be given back (`buffers.give_back`) once stored. For a store that copies the frame
    into storage of its own (every backend does: `CacheBackend.store`), this spares the new
    memory `encode` returns, whose pages cost several times the copy. The payload is read
    once: copied a block at a time, each block hashed where the copy left it, in the cache."""
    _check_fields(fingerprint, kind, versions, meta, roles, len(sections))
    by_section = [[memoryview(p).cast("B") for p in _pieces(section)] for section in sections]
    sizes = [sum(p.nbytes for p in pieces) for pieces in by_section]
    head = _head(tokens, sizes, fingerprint, kind, versions, created, meta, roles, secret)
    start = len(head) + 8  # the checksum's value ends the header
    end = start + sum(sizes)
    out = memoryview(buffers.take(end + (MAC_BYTES if secret is not None else 0)))
    payload_hash = xxhash.xxh3_64()
    at = hashed = start
    for piece in (p for pieces in by_section for p in pieces):
        for offset in range(0, piece.nbytes, _BLOCK):
            block = piece[offset : offset + _BLOCK]
            out[at : at + block.nbytes] = block
            at += block.nbytes
            if at - hashed >= _BLOCK:
                payload_hash.update(out[hashed:at])
                hashed = at
    payload_hash.update(out[hashed:at])
    out[:start] = _with_checksum(head, payload_hash.intdigest())
    if secret is not None:
        out[end : end + MAC_BYTES] = _mac(secret, [out[:end]])
        end += MAC_BYTES
    return out[:end]


@contextmanager
def framed_for(
    store: object,
    buffers: StateBuffers,
    tokens: _tokens.Tokens,
    sections: Sequence[Blob | Sequence[Blob]],
    **fields: Any,
) -> Iterator[Blob]:
    """The frame of `sections` (`encode`'s arguments in `fields`) as `store` is best given it:
    new bytes for a store that keeps the bytes it is given (`keeps_bytes`: RAM, tiered), else
    written into a buffer of `buffers` (`encode_into`), given back as the block ends: every other
    store copies a frame into storage of its own. Store it within the block."""
    if getattr(store, "keeps_bytes", False):
        yield encode(tokens, sections, **fields)
        return
    blob = encode_into(buffers, tokens, sections, **fields)
    try:
        yield blob
    finally:
        buffers.give_back(blob)


#: `encode_into` copies and hashes this many bytes at a time (within a core's cache).
_BLOCK = 1 << 20
#: The header's last field: the payload's checksum as a uint64 of fixed width (0xcf and 8 bytes),
#: so that the header's length is known before the payload is hashed (`encode_into`).
_CHECKSUM_KEY: bytes = msgpack.packb("checksum")


def _pieces(section: Blob | Sequence[Blob]) -> Sequence[Blob]:
    return section if isinstance(section, (list, tuple)) else (cast(Blob, section),)


def _check_fields(
    fingerprint: str,
    kind: str,
    versions: Mapping[str, str] | None,
    meta: Mapping[str, Any] | None,
    roles: Sequence[str] | None,
    n_sections: int,
) -> None:
    if not isinstance(fingerprint, str) or not isinstance(kind, str):
        raise TypeError("fingerprint and kind must be str")
    if roles is not None and (len(roles) != n_sections or not all(isinstance(r, str) for r in roles)):
        raise TypeError("roles must be one str per section")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in (versions or {}).items()):
        raise TypeError("versions must map str to str")
    if not all(isinstance(k, str) and isinstance(v, _META_TYPES) for k, v in (meta or {}).items()):
        raise TypeError("meta must map str to str, int, float, bool or bytes")


def _head(
    tokens: _tokens.Tokens,
    sizes: list[int],
    fingerprint: str,
    kind: str,
    versions: Mapping[str, str] | None,
    created: float | None,
    meta: Mapping[str, Any] | None,
    roles: Sequence[str] | None,
    secret: Secret | None,
) -> bytes:
    """The frame's prefix and header, all but the checksum's field at its end (`_with_checksum`)."""
    fields: dict[str, Any] = {
        "tokens": _tokens.encode(tokens),
        "fingerprint": fingerprint,
        "kind": kind,
        "versions": dict(versions or {}),
        "created": time.time() if created is None else float(created),
        "sizes": sizes,
        "meta": dict(meta or {}),
    }
    if roles is not None:
        fields["roles"] = list(roles)
    if secret is not None:
        fields["mac"] = MAC_BYTES
    body: bytes = msgpack.packb(fields, use_bin_type=True)  # a fixmap of at most 9 fields: one byte says how many
    header = bytes([body[0] + 1]) + body[1:] + _CHECKSUM_KEY + b"\xcf"  # the checksum's value follows
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header) + 8, 0) + header


def _with_checksum(head: bytes, checksum: int) -> bytes:
    """`_head`'s bytes completed: the payload's checksum appended, the header's own hash set."""
    header = head[_PREFIX.size :] + checksum.to_bytes(8, "big")
    return head[: _PREFIX.size - 8] + xxhash.xxh3_64_intdigest(header).to_bytes(8, "little") + header


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
    roles = header.get("roles")
    if roles is not None and not (
        isinstance(roles, list) and len(roles) == len(header["sizes"]) and all(isinstance(r, str) for r in roles)
    ):
        raise CorruptEntry("entry header roles must be one str per section")
    if header.get("mac", MAC_BYTES) != MAC_BYTES:
        raise CorruptEntry("entry header has an invalid MAC length")
    return header


def decode(buf: Blob, *, secret: Secret | None = None, check_payload: bool = True) -> Frame:
    """Parse and verify a framed entry; raise `CorruptEntry` on any damage
    (`UnsupportedEntry` for a format version this sippcache does not read).

    With a `secret`, a frame without a valid MAC made with it is refused. The
    returned sections are views of `buf`: keep `buf` alive (and, for an LMDB
    match, the match unreleased) while you use them. `check_payload` False
    leaves the payload's checksum (or MAC) unchecked, the header's checked: for
    a caller that checks it later with a full `decode` (on another thread, while
    it writes the sections out) and uses nothing before.
    """
    view = memoryview(buf).cast("B")
    if len(view) < _PREFIX.size:
        raise CorruptEntry(f"entry is {len(view)} bytes, shorter than the {_PREFIX.size}-byte frame prefix")
    magic, version, header_len, header_hash = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry("not a sippcache entry (bad magic bytes)")
    if version not in READABLE_VERSIONS:
        raise UnsupportedEntry(
            f"unsupported entry format version {version}"
            f" (this sippcache reads {', '.join(map(str, READABLE_VERSIONS))})"
        )
    start, end = _PREFIX.size, _PREFIX.size + header_len
    if header_len > MAX_HEADER_BYTES or end > len(view):
        raise CorruptEntry(f"entry header length {header_len} exceeds the entry")
    raw_header = view[start:end]
    if xxhash.xxh3_64_intdigest(raw_header) != header_hash:
        raise CorruptEntry("entry header checksum mismatch")
    header = _unpack_header(raw_header)
    if version == 1:  # written before roles and MACs: never trust such fields in it
        header.pop("roles", None)
        header.pop("mac", None)
    trailer = MAC_BYTES if "mac" in header else 0
    if len(view) - end < trailer:
        raise CorruptEntry("entry is shorter than its MAC")
    payload = view[end : len(view) - trailer]
    if sum(header["sizes"]) != len(payload):
        raise CorruptEntry(f"entry payload is {len(payload)} bytes, header says {sum(header['sizes'])}")
    authenticated = False
    if check_payload and secret is not None:
        if not trailer:
            raise CorruptEntry("entry has no MAC, and a secret is set")
        if not hmac.compare_digest(_mac(secret, [view[: len(view) - trailer]]), view[len(view) - trailer :]):
            raise CorruptEntry("entry MAC does not match the secret")
        authenticated = True  # the MAC covers the payload: its xxh3 checksum adds nothing
    elif check_payload and xxhash.xxh3_64_intdigest(payload) != header["checksum"]:
        raise CorruptEntry("entry payload checksum mismatch")
    sections = []
    offset = 0
    for size in header["sizes"]:
        sections.append(payload[offset : offset + size])
        offset += size
    return Frame(
        token_bytes=header["tokens"],
        fingerprint=header["fingerprint"],
        kind=header["kind"],
        sections=tuple(sections),
        versions=header["versions"],
        created=header["created"],
        meta=header["meta"],
        roles=tuple(header.get("roles") or [""] * len(sections)),
        authenticated=authenticated,
        checksum=header["checksum"],
    )

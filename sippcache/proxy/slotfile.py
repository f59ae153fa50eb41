"""llama-server slot files, and the sequence states sippcache stores.

``POST /slots/{id}?action=save`` writes ``llama_state_seq_save_file``'s format
(all little-endian)::

    magic     u32   "ggsq" (LLAMA_STATE_SEQ_MAGIC, 0x67677371)
    version   u32   LLAMA_STATE_SEQ_VERSION (4 in the llama.cpp this was read from)
    n_words   u32
    words     n_words x i32    the slot's prompt: the tokens the state holds (see below)
    state     the bytes llama.cpp's memory writes for one sequence

llama-server writes its prompt packed (server_tokens::serialize): the word -1
(LLAMA_TOKEN_NULL), a u32 format version (1), a u32 count and the tokens, a
u32 count of media chunks (images, audio) and the chunks. A restore also
accepts a plain token list (what older builds wrote), which is what `build`
writes. A prompt with media chunks is not read (`SlotFileError`): its tokens
alone do not say what the state holds.

``llama_state_seq_get_data`` (what sippcache's llama-cpp-python layer stores)
puts its own 8-byte header before the same state bytes: u32 0xaf143cd8 and the
i32 sequence id. An entry holds that form, so an entry is the same kind of
thing whichever side wrote it; the slot-file version is kept beside it, since
llama.cpp loads only a file of its own version.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass

from ..protocol import Blob

__all__ = [
    "LONGER_FILE_VERSION",
    "SEQ_HEADER_BYTES",
    "SEQ_STATE_MAGIC",
    "SLOT_FILE_MAGIC",
    "SlotFile",
    "SlotFileError",
    "build",
    "parse",
    "read_tokens",
    "remove",
    "seq_state_in_place",
    "state_of",
]

log = logging.getLogger("sippcache.proxy")

#: "ggsq" read as a little-endian u32 (llama.h: LLAMA_FILE_MAGIC_GGSQ).
SLOT_FILE_MAGIC = 0x67677371
#: The first u32 of `llama_state_seq_get_data`'s output (llama-context.cpp: io_magic).
SEQ_STATE_MAGIC = 0xAF143CD8
#: The first word of a packed prompt (LLAMA_TOKEN_NULL), and the packing's version.
PACKED_MARKER, PACKED_VERSION = -1, 1
_HEAD = struct.Struct("<III")
_SEQ_HEAD = struct.Struct("<Ii")
#: The size of `llama_state_seq_get_data`'s own header (u32 magic, i32 sequence id).
SEQ_HEADER_BYTES = _SEQ_HEAD.size
#: The first slot-file version that every llama.cpp writing it loads from a file longer than its
#: state: it reads the state as far as the state says, then checks that it stopped there
#: (llama_state_seq_load_file, a stream since llama.cpp PR #8699, July 2024; version 2 came in
#: 2025). Before that PR it read the whole rest of the file, and a longer one failed an assert
#: that aborts llama-server; version 1 files are written by both, so they are made exact.
LONGER_FILE_VERSION = 2


class SlotFileError(ValueError):
    """Bytes that are not a slot file (or a sequence state) of the expected form."""


@dataclass(frozen=True)
class SlotFile:
    """A parsed slot file: its version, the tokens its state holds, and a view of the state bytes."""

    version: int
    tokens: tuple[int, ...]
    state: memoryview


def parse(data: Blob) -> SlotFile:
    """Read a slot file written by llama-server; raise `SlotFileError` saying what is wrong."""
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise SlotFileError(f"{len(view)} bytes is too short for a slot file")
    magic, version, n_tokens = _HEAD.unpack_from(view)
    if magic != SLOT_FILE_MAGIC:
        raise SlotFileError(f"magic {magic:#010x} is not a slot file's ({SLOT_FILE_MAGIC:#010x})")
    end = _HEAD.size + 4 * n_tokens
    if end > len(view):
        raise SlotFileError(f"it says {n_tokens} tokens but has {len(view)} bytes")
    return SlotFile(version, prompt_tokens(struct.unpack_from(f"<{n_tokens}i", view, _HEAD.size)), view[end:])


def prompt_tokens(words: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens of a slot file's prompt words: packed (llama-server's server_tokens) or plain."""
    if not words or words[0] != PACKED_MARKER:
        return words
    if len(words) < 3 or words[1] != PACKED_VERSION:
        raise SlotFileError(f"packed prompt of an unknown version {words[1:2]}")
    n = words[2] & 0xFFFFFFFF
    if 3 + n >= len(words) or any(t < 0 for t in words[3 : 3 + n]):
        raise SlotFileError(f"packed prompt says {n} tokens but has {len(words) - 4}")
    if words[3 + n] != 0:
        raise SlotFileError(f"the prompt has {words[3 + n] & 0xFFFFFFFF} media chunks (images or audio)")
    return words[3 : 3 + n]


def read_tokens(path: str) -> tuple[int, ...]:
    """The tokens a slot file lists, read from its header alone."""
    with open(path, "rb") as f:
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise SlotFileError(f"{len(head)} bytes is too short for a slot file")
        magic, _version, n_tokens = _HEAD.unpack(head)
        if magic != SLOT_FILE_MAGIC:
            raise SlotFileError(f"magic {magic:#010x} is not a slot file's ({SLOT_FILE_MAGIC:#010x})")
        body = f.read(4 * n_tokens)
    if len(body) < 4 * n_tokens:
        raise SlotFileError(f"it says {n_tokens} tokens but ends before them")
    return prompt_tokens(struct.unpack(f"<{n_tokens}i", body))


def build(version: int, tokens: tuple[int, ...] | list[int], *state: Blob) -> list[Blob]:
    """The parts of a slot file with a plain token list, in order, the state given whole or as
    the parts it is made of (write them back to back: the state is not copied)."""
    return [_HEAD.pack(SLOT_FILE_MAGIC, version, len(tokens)), struct.pack(f"<{len(tokens)}i", *tokens), *state]


def seq_state_in_place(data: memoryview, parsed: SlotFile, seq_id: int = 0) -> memoryview:
    """The state bytes of a parsed slot file as `llama_state_seq_get_data` frames them (its 8-byte
    header first), without copying the state: the header is written over the last 8 bytes
    before the state in `data` (a writable buffer `parsed` was read from: a private mapping of the
    slot file, say; there are always at least 12 bytes of slot-file header before the state).
    The slot file's own header in `data` is spoiled, and `parsed.tokens` is what it said."""
    view = memoryview(data).cast("B")
    end = len(view) - len(parsed.state)
    if end < _SEQ_HEAD.size:
        raise SlotFileError("no room for the sequence header before the state")
    _SEQ_HEAD.pack_into(view, end - _SEQ_HEAD.size, SEQ_STATE_MAGIC, seq_id)
    return view[end - _SEQ_HEAD.size :]


def state_of(seq: Blob) -> memoryview:
    """The state bytes inside a `llama_state_seq_get_data` blob (its 8-byte header checked and dropped)."""
    view = memoryview(seq).cast("B")
    if len(view) < _SEQ_HEAD.size or _SEQ_HEAD.unpack_from(view)[0] != SEQ_STATE_MAGIC:
        raise SlotFileError("not a llama.cpp sequence state (bad header)")
    return view[_SEQ_HEAD.size :]


def remove(path: str) -> None:
    """Remove a slot file; one that cannot be (this user may not: a folder llama-server, run as
    another user, owns, or one with the sticky bit) is logged, never raised: the state was stored
    or the request answered either way."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("sippcache proxy: cannot remove the slot file %s (it stays): %s", path, exc)

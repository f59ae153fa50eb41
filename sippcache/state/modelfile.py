"""What a GGUF model file is, read without llama.cpp: its identity and its memory kind.

Both the llama-cpp-python layer and the llama-server proxy key entries by the
model file, and the proxy, which never imports llama_cpp, must also know how
llama.cpp keeps the model's memory, because that decides which stored states
llama-server can extend:

- ``full``: attention over every position; a state can be cut anywhere;
- ``swa``: sliding-window attention layers (Gemma 3 and other iSWA models):
  llama-server extends a restored state only with ``--swa-full``;
- ``recurrent``: recurrent or convolution layers (Mamba, RWKV, LFM2, and the
  hybrids that mix them with attention): a state is one cell at its last
  position and can only be extended at exactly its length.

The file is identified without reading a multi-GB file: its size, its first
32 MiB (the GGUF header: all metadata and the tensor layout table, then the
first tensors' data) and its last 4 MiB (the last tensors' data).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

__all__ = ["MemoryKind", "ModelFacts", "file_digest", "read_model_facts"]

HEAD_BYTES = 32 * 1024 * 1024
TAIL_BYTES = 4 * 1024 * 1024

MemoryKind = Literal["full", "swa", "recurrent"]

_file_cache: dict[tuple[str, int, int, int], str] = {}


def file_digest(path: str | os.PathLike[str]) -> str:
    """A 128-bit digest of a model file's size, head and tail (cached per path, size and mtime)."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    cache_key = (real, stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if cache_key not in _file_cache:
        digest = xxhash.xxh3_128()
        digest.update(str(stat.st_size).encode())
        with open(real, "rb") as f:
            digest.update(f.read(HEAD_BYTES))
            if stat.st_size > HEAD_BYTES:
                f.seek(max(HEAD_BYTES, stat.st_size - TAIL_BYTES))
                digest.update(f.read(TAIL_BYTES))
        _file_cache[cache_key] = digest.hexdigest()
    return _file_cache[cache_key]


@dataclass(frozen=True)
class ModelFacts:
    """A model file's digest, architecture, sliding window (0: none) and memory kind."""

    digest: str
    architecture: str
    n_swa: int
    kind: MemoryKind


# GGUF value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
#: Key families that only recurrent / convolution layers have (Mamba, Mamba-2, RWKV, LFM2 and hybrids).
_RECURRENT_KEYS = (".ssm.", ".wkv.", ".shortconv.", ".rwkv.")


class _Reader:
    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("Q")
        value = bytes(self.buf[self.pos : self.pos + size]).decode("utf-8", "replace")
        self.pos += size
        return value

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("I"), self.unpack("Q")
            if item_kind in _SCALARS:  # skipped whole: arrays are only tokenizer tables here
                self.pos += count * struct.calcsize(_SCALARS[item_kind])
            else:
                for _ in range(count):
                    self.value(item_kind)
            return None
        raise ValueError(f"unknown GGUF value type {kind}")


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (arrays are skipped). Raises `ValueError`
    for a file that is not GGUF."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        reader = _Reader(buf)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError(f"{os.fspath(path)} is not a GGUF file")
            reader.pos = 4
            version, _n_tensors, n_kv = reader.unpack("I"), reader.unpack("Q"), reader.unpack("Q")
            if version < 2:
                raise ValueError(f"{os.fspath(path)}: GGUF version {version} is not supported")
            metadata = {}
            for _ in range(n_kv):
                key = reader.string()
                metadata[key] = reader.value(reader.unpack("I"))
            return metadata
        except struct.error as exc:
            raise ValueError(f"{os.fspath(path)}: truncated GGUF metadata") from exc


def read_model_facts(path: str | os.PathLike[str]) -> ModelFacts:
    """Identify a GGUF model file and tell how llama.cpp keeps its memory."""
    metadata = read_metadata(path)
    arch = str(metadata.get("general.architecture", ""))
    n_swa = int(metadata.get(f"{arch}.attention.sliding_window") or 0)
    recurrent = any(key.startswith(arch) and any(part in key for part in _RECURRENT_KEYS) for key in metadata)
    kind: MemoryKind = "recurrent" if recurrent else "swa" if n_swa > 0 else "full"
    return ModelFacts(file_digest(path), arch, n_swa, kind)

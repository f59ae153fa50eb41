"""Model fingerprints: what makes a llama.cpp state loadable and meaningful.

A state saved by one model must never be loaded into another, nor into the
same model with another K/V cache type, attention kernel, LoRA adapter or
library version. The fingerprint is a hash over all of those, and it is part
of every cache namespace, so a mismatch is a plain miss.

The model file is identified without reading a multi-GB file: its size, its
first 32 MiB (the GGUF header: all metadata and the tensor layout table,
then the first tensors' data) and its last 4 MiB (the last tensors' data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import xxhash

HEAD_BYTES = 32 * 1024 * 1024
TAIL_BYTES = 4 * 1024 * 1024

#: The version of what a namespace's entries mean. Bump it only when entries
#: written before must become invisible; a new frame format that still reads the
#: old one (frame.READABLE_VERSIONS) keeps it, so an upgrade keeps the cache warm.
NAMESPACE_VERSION = "1"

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
class Fingerprint:
    """`digest` goes into namespaces; `facts` says what it covers (stored in every entry's header)."""

    digest: str
    facts: dict[str, str]


def llama_fingerprint(llm: Any) -> Fingerprint:
    """The fingerprint of a `llama_cpp.Llama` instance."""
    import llama_cpp

    params = llm.context_params
    desc = ctypes_string(lambda buf, n: llama_cpp.llama_model_desc(llm.model, buf, n))
    facts = {
        "model_file": file_digest(llm.model_path),
        "model_desc": desc,
        "model_params": str(llama_cpp.llama_model_n_params(llm.model)),
        "lora": file_digest(llm.lora_path) if getattr(llm, "lora_path", None) else "",
        "lora_scale": repr(float(getattr(llm, "lora_scale", 1.0))) if getattr(llm, "lora_path", None) else "",
        "type_k": str(params.type_k),
        "type_v": str(params.type_v),
        "flash_attn": str(getattr(params, "flash_attn_type", getattr(params, "flash_attn", ""))),
        "swa_full": str(getattr(params, "swa_full", "")),
        "llama_cpp_python": llama_cpp.__version__,
        "sippcache_format": NAMESPACE_VERSION,
    }
    digest = xxhash.xxh3_128_hexdigest("\n".join(f"{k}={v}" for k, v in sorted(facts.items())).encode())
    return Fingerprint(digest, facts)


def ctypes_string(fill: Any, size: int = 512) -> str:
    """Call a llama.cpp `(char *buf, size_t n)` getter and decode the result."""
    import ctypes

    buf = ctypes.create_string_buffer(size)
    fill(buf, size)
    return buf.value.decode("utf-8", "replace")

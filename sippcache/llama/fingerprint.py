"""Model fingerprints: what makes a llama.cpp state loadable and meaningful.

A state saved by one model must never be loaded into another, nor into the
same model with another K/V cache type, attention kernel, LoRA adapter or
library version. The fingerprint is a hash over all of those, and it is part
of every cache namespace, so a mismatch is a plain miss.

The model file is identified by `sippcache.state.modelfile.file_digest` (its size,
head and tail), without reading a multi-GB file.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import xxhash

from ..state.modelfile import file_digest

#: The version of what a namespace's entries mean. Bump it only when entries
#: written before must become invisible; a new frame format that still reads the
#: old one (frame.READABLE_VERSIONS) keeps it, so an upgrade keeps the cache warm.
NAMESPACE_VERSION = "1"


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


def speed_facts(llm: Any) -> str:
    """What, beside the fingerprint, sets how fast a `llama_cpp.Llama` computes a prompt and loads
    a state: the host, where its layers and K/V run, its threads and batch sizes. Rates measured
    under other facts (`sippcache.state.rates`) are not this one's."""
    model, context = llm.model_params, llm.context_params
    facts = {
        "host": socket.gethostname(),
        "n_gpu_layers": model.n_gpu_layers,
        "split_mode": model.split_mode,
        "main_gpu": model.main_gpu,
        "offload_kqv": context.offload_kqv,
        "n_threads": context.n_threads,
        "n_threads_batch": context.n_threads_batch,
        "n_batch": context.n_batch,
        "n_ubatch": context.n_ubatch,
    }
    return "\n".join(f"{k}={v}" for k, v in facts.items())


def ctypes_string(fill: Any, size: int = 512) -> str:
    """Call a llama.cpp `(char *buf, size_t n)` getter and decode the result."""
    import ctypes

    buf = ctypes.create_string_buffer(size)
    fill(buf, size)
    return buf.value.decode("utf-8", "replace")

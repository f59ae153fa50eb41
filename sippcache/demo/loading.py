"""Loading a model with llama-cpp-python, which is an optional dependency.

The commands that run a model import the llama adapter through
`require_llama`: without llama-cpp-python (or numpy) that is one
`MissingDependency` naming the extra to install, not an import traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING

from ..errors import MissingDependency

if TYPE_CHECKING:
    from ..llama import Llama

#: The packages of the ``llama`` extra: the adapter imports both.
_LLAMA_PACKAGES = frozenset({"llama_cpp", "numpy"})


def require_llama(command: str, extra: str) -> ModuleType:
    """The `sippcache.llama` module, or `MissingDependency` saying that `command`
    needs llama-cpp-python from the extra `extra`."""
    try:
        from .. import llama
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in _LLAMA_PACKAGES:
            raise
        raise MissingDependency(
            f'{command} needs llama-cpp-python ({exc.name} is not installed): pip install "sippcache[{extra}]"'
        ) from exc
    return llama


@contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """llama.cpp writes some notices straight to file descriptor 2, whatever `verbose` says."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def load_llama(model_path: str, *, n_ctx: int, vocab_only: bool = False) -> Llama:
    """A `sippcache.llama.Llama`: its entries keep the prompt's logits (what a server using
    sippcache looks for), and an exact repeat samples from them."""
    from ..llama import Llama

    with native_stderr_silenced():
        return Llama(model_path=model_path, verbose=False, n_ctx=n_ctx, vocab_only=vocab_only)

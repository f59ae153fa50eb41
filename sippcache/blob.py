"""`Blob`: the bytes sippcache stores and hands back, as whichever buffer holds them.

A module of its own because the protocol (`sippcache.protocol`: a stored value is a blob) and
the token encoding it builds on (`sippcache.tokens`: a key is decoded from one) both name it;
here it sits below both.
"""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["Blob"]

#: A stored value: any bytes-like object on the way in; bytes, or a zero-copy
#: view of the store's memory (LMDB), on the way out.
Blob: TypeAlias = bytes | bytearray | memoryview

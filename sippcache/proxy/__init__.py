"""`sippcache proxy`: the cache in front of llama.cpp's own C++ `llama-server`.

llama-server keeps its prompt cache in its process: lost on restart, never
shared between servers. The proxy restores the best stored prefix of each
request's prompt into a llama-server slot (its slot save/restore API), pins the
request to that slot, and stores the slot's state afterwards, in any sippcache
store. It imports nothing from llama_cpp: a llama-server user installs
``sippcache[proxy]`` only.

- `slotfile`: llama-server slot files <-> llama.cpp sequence states;
- `upstream`: one llama-server over HTTP;
- `slots`: which slot of which server a request runs in;
- `store`: slot states in a sippcache store (restore, save, what to keep);
- `app`: the ASGI app (the request flow); `metrics`: Prometheus;
- `cli`: ``sippcache proxy``: managed or attached llama-servers.
"""

from __future__ import annotations

from .app import Proxy
from .cli import main

__all__ = ["Proxy", "main"]

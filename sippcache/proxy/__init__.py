"""`sippcache proxy`: the cache in front of llama.cpp's own C++ `llama-server`.

llama-server keeps its prompt cache in its process: lost on restart, never
shared between servers. The proxy restores the best stored prefix of each
request's prompt into a llama-server slot (its slot save/restore API), pins the
request to that slot, and stores the slot's state afterwards, in any sippcache
store. It imports nothing from llama_cpp: a llama-server user installs
``sippcache[proxy]`` only.

The request's path through it, one idea a module:

- `app`: the ASGI app, which only routes; `completion`: a completion run in a
  slot; `apis`: the Anthropic and Responses APIs converted to chats and back;
  `relay`: llama-server's answer relayed, streamed or whole;
- `flights`: requests that wait for another's state over a shared prefix;
  `restoring`: whether a restore beats computing, and doing it; `saving`: when
  a slot's state is saved (`SavePolicy`), and saving it; `passthrough`: what
  goes to llama-server as it is; `health`: servers that are down;
- `slots`: which slot of which server a request runs in; `prompts`: a chat's
  tokens, the known part not tokenized again;
- `store`: slot states in a sippcache store; `staging`: the folder slot files
  go through; `ready`: slot files kept to be loaded as they are; `warming`:
  ready files made after a start; `slotfile`: llama-server slot files <->
  llama.cpp sequence states;
- `upstream`: one llama-server over HTTP; `launch`: a managed llama-server
  started, attached ones checked; `cli`: ``sippcache proxy``; `metrics`:
  Prometheus.
"""

from __future__ import annotations

from .app import Proxy
from .cli import main

__all__ = ["Proxy", "main"]

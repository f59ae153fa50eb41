"""llama.cpp's sequence states, handled by sippcache itself: read, cut, joined, copied, stored as chunks.

llama.cpp can save and load one whole sequence (`llama_state_seq_get_data` /
`llama_state_seq_set_data`, and llama-server's slot files, which hold the same bytes
after their own header), but has no call for a range of a sequence. To store a long
state as chunks of tokens and to assemble the state of a prefix from them, sippcache
reads and writes those bytes itself, without importing `llama_cpp` (the proxy, which
never loads llama.cpp, uses them for slot files). docs/stateformat.md has the byte
table and the llama.cpp versions it was read from and checked against.

One idea a module:

- `seqstate`: the parts of a state (`SeqState`, its caches, streams and layers) and the
  layout's constants;
- `parsing`: `parse`, a state's bytes as zero-copy views;
- `cutting`: `prefix` (the state of the first n positions) and `split` / `cut` (a
  state's chunks of positions, a meta part and a tail);
- `meta`: the meta part's layout, written by `cut`, read by `joined`;
- `joining`: `join` / `joined` (the chunks put back together: `join(*split(x, cuts)) ==
  x`, and `join(meta, chunks[:k])` is the state of the first k chunks' tokens);
- `copier`: the threaded copy of a joined state into one buffer;
- `chunks`: `ChunkedStates`, states kept in a store as shared chunks of tokens;
  `chunkentries`: the chunk entries' namespaces, keys and usage;
- `buffers`: memory that states are copied into, used again;
- `rates`: whether restoring a state beats computing its tokens again;
- `modelfile`: what a GGUF model file is, read without llama.cpp.

The state format's functions and types are named here too (`sippcache.state.parse`, ...).
Names a module leaves out of its `__all__` are this package's own, shared between its
modules, with no promise to anyone else.
"""

from __future__ import annotations

from .copier import gather_workers
from .cutting import Cut, Split, chunkable_caches, cut, prefix, split
from .joining import Joined, join, joined
from .parsing import parse
from .seqstate import KV_TYPES, SEQ_STATE_MAGIC, VERSIONS, Cache, Layer, SeqState, Stream, UnsupportedState

__all__ = [
    "KV_TYPES",
    "SEQ_STATE_MAGIC",
    "VERSIONS",
    "Cache",
    "Cut",
    "Joined",
    "Layer",
    "SeqState",
    "Split",
    "Stream",
    "UnsupportedState",
    "chunkable_caches",
    "cut",
    "gather_workers",
    "join",
    "joined",
    "parse",
    "prefix",
    "split",
]

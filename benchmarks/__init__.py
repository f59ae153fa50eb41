"""Benchmarks: sippcache against what a user has without it, each held to a goal (the figures the
README and docs/benchmarks.md quote). `benchmarks.probes` holds the measurements that each settled
one design choice. Every one runs as a module from the repository root, ``python -m benchmarks.ttft``,
so that it imports sippcache, the shared `harness` and its siblings the same way (benchmarks/README.md).
`gpu/` is the exception: copied alone to a GPU machine and run there by path (gpu/README.md)."""

from pathlib import Path

#: The repository root: where ``python -m benchmarks....`` runs, and the working folder of a child
#: process that runs a benchmark's module again (``[sys.executable, "-m", __spec__.name, ...]``).
ROOT = Path(__file__).resolve().parent.parent

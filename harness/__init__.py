"""What the tests and the benchmarks both need to run sippcache for real: a tiny generated model
(`tinymodel`), `sippcache serve` and `sippcache proxy` processes and a plain llama-server on
loopback ports (`servers`, `proxy_tools`), and llama.cpp's own counts and logits (`llama_tools`).

One copy for both, at the repository root, so that a benchmark measures with the helpers the
tests check, and neither reaches into the other's folder. Not shipped: the wheel packages only
``sippcache*``; tests and ``python -m benchmarks....`` find it from the repository root.
"""

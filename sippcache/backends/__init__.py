"""The built-in backends: `ram`, `lmdb` and `diskcache`.

Each is imported on first use through `sippcache.registry`, so a missing
optional library only matters to the backend that needs it.
"""

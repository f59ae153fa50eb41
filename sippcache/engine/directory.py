"""Where persistent stores live: resolving a URL's location to a directory, and
checking that directory before a backend opens its files in it."""

from __future__ import annotations

import os
import stat

from ..errors import CorruptStore


def directory_path(scheme: str, location: str) -> str:
    """The absolute directory a persistent store at `scheme://location` lives in (`~` expanded)."""
    if not location:
        raise ValueError(f"{scheme}:// needs a directory, e.g. {scheme}:///var/cache/sipp")
    path = os.path.abspath(os.path.expanduser(location))
    if len(path) > 4000 or any(len(part) > 255 for part in path.split(os.sep)):
        raise ValueError(f"{scheme}:// path is too long: {path[:80]}...")
    return path


def prepare_directory(path: str, files: tuple[str, ...]) -> None:
    """Create the store directory (0700: entries hold users' prompts) and refuse
    store files that are symbolic links, so nothing is written through them."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{path} is not a directory")
    for name in files:
        try:
            mode = os.lstat(os.path.join(path, name)).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise CorruptStore(f"{os.path.join(path, name)} is not a regular file (a link or a folder?); refusing it")

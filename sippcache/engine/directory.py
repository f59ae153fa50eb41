"""Where persistent stores live: resolving a URL's location to a directory, and
checking that directory before a backend opens its files in it."""

from __future__ import annotations

import os
import stat

from ..errors import CorruptStore, NoStore, ReadOnlyStore


def directory_path(scheme: str, location: str) -> str:
    """The absolute directory a persistent store at `scheme://location` lives in (`~` expanded)."""
    if not location:
        raise ValueError(f"{scheme}:// needs a directory, e.g. {scheme}:///var/cache/sipp")
    path = os.path.abspath(os.path.expanduser(location))
    if len(path) > 4000 or any(len(part) > 255 for part in path.split(os.sep)):
        raise ValueError(f"{scheme}:// path is too long: {path[:80]}...")
    return path


def missing_store(path: str, store_file: str, kind: str) -> str | None:
    """Why the directory `path` holds no `kind` store (whose data is in
    `store_file`), or None if it holds one."""
    if not os.path.lexists(path):
        return f"directory {path} does not exist"
    if not os.path.isdir(path):
        return f"{path} is a file, not a cache directory"
    if not os.path.lexists(os.path.join(path, store_file)):
        return f"{path} holds no {kind} store"
    return None


def prepare_directory(path: str, files: tuple[str, ...]) -> None:
    """Create the store directory (0700: entries hold users' prompts) and refuse
    store files that are symbolic links, so nothing is written through them."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NoStore(f"{path} is a file, not a cache directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except PermissionError as exc:
        raise ReadOnlyStore(f"cannot create the cache directory {path}: {exc.strerror}") from exc
    check_store_files(path, files)


def check_store_files(path: str, files: tuple[str, ...]) -> None:
    """Refuse store files in `path` that are symbolic links or folders."""
    for name in files:
        try:
            mode = os.lstat(os.path.join(path, name)).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise CorruptStore(f"{os.path.join(path, name)} is not a regular file (a link or a folder?); refusing it")

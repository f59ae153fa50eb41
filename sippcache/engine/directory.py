"""Where persistent stores live: resolving a URL's location to a directory, and
checking that directory before a backend opens its files in it."""

from __future__ import annotations

import logging
import os
import re
import stat
from typing import NamedTuple

from ..errors import CorruptStore, NoStore, ReadOnlyStore

log = logging.getLogger(__name__)

#: File systems a store's files must not be on: LMDB's documentation says not to use it on a
#: remote file system at all (its locks and memory map are not shared there, even between two
#: processes of one machine in some cases), and SQLite's locking is unreliable on them. A home
#: folder on NFS, where the default store lives, is common on clusters.
NETWORK_FILE_SYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "fuse.glusterfs", "lustre", "gpfs", "beegfs"}
    | {"fuse.sshfs", "afs", "9p"}
)
_warned: set[str] = set()


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
    kind = network_file_system(path)
    if kind is not None and path not in _warned:
        _warned.add(path)
        log.warning(
            "sippcache: the store at %s is on a network file system (%s), where its locks and memory map are not "
            "safe: keep it on a local disk (SIPPCACHE_URL, or the URL's path) or use Redis",
            path,
            kind,
        )


class Mount(NamedTuple):
    """The mount a path is on: its file system type and its options (the file system's own)."""

    kind: str
    options: frozenset[str]


def mount_of(path: str, mountinfo: str | None = None) -> Mount | None:
    """The mount `path` is on (the last one at the longest mount point above it), read from
    `mountinfo` (/proc/self/mountinfo's text: Linux); None where it cannot be told."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
                mountinfo = f.read()
        except OSError:
            return None
    real, longest, found = os.path.realpath(path), -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # "\040" is a space
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= longest:  # a later mount at the same point hides the earlier one
            after = fields[fields.index("-", 6) + 1 :]
            longest, found = len(point), Mount(after[0], frozenset(after[2].split(",") if len(after) > 2 else ()))
    return found


def network_file_system(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the file system `path` is on where it is a network one (`NETWORK_FILE_SYSTEMS`),
    else None (`mount_of`'s `mountinfo`)."""
    mount = mount_of(path, mountinfo)
    return mount.kind if mount is not None and mount.kind in NETWORK_FILE_SYSTEMS else None


#: Where Linux says whether files on a tmpfs may get huge pages whatever its mount says.
SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def huge_pages(path: str, mountinfo: str | None = None, shmem_enabled: str | None = None) -> bool | None:
    """Whether a file written in `path` is kept in huge pages (2 MiB): on a tmpfs mounted with
    ``huge=always`` or ``huge=within_size``, or on any tmpfs where the kernel forces them
    (`SHMEM_ENABLED`: "force"; "deny" refuses them). A tmpfs with 4 KiB pages allocates, maps
    and frees a page per 4 KiB of a file (docs/proxy.md weighs the two kinds for slot files).
    None where `path` is not on a tmpfs, or it cannot be told."""
    mount = mount_of(path, mountinfo)
    if mount is None or mount.kind != "tmpfs":
        return None
    if shmem_enabled is None:
        try:
            with open(SHMEM_ENABLED, encoding="ascii") as f:
                shmem_enabled = f.read()
        except OSError:
            shmem_enabled = ""
    chosen = re.search(r"\[(\w+)\]", shmem_enabled)
    if chosen is not None and chosen.group(1) in ("force", "deny"):
        return chosen.group(1) == "force"
    return bool(mount.options & {"huge=always", "huge=within_size"})


def free_bytes(folder: str) -> int | None:
    """Bytes free for this user in the file system of `folder`; None where it cannot be told."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def check_store_files(path: str, files: tuple[str, ...]) -> None:
    """Refuse store files in `path` that are symbolic links or folders."""
    for name in files:
        try:
            mode = os.lstat(os.path.join(path, name)).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise CorruptStore(f"{os.path.join(path, name)} is not a regular file (a link or a folder?); refusing it")

"""A small file system for tests of a full one: a tmpfs of a given size, mounted in a private
mount namespace for one command, so that this machine's own mounts stay as they are."""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest


def in_small_tmpfs(folder: str, size: str, options: str = "") -> list[str]:
    """A command prefix that runs a command in a private mount namespace where `folder` is a tmpfs
    of `size` ("256k"): a folder that runs out of room, as a container's /dev/shm of 64 MB does,
    while this machine's own mounts stay as they are; `options` are more mount options
    ("huge=within_size"). Skips the test where no such namespace can be made here (no `unshare`;
    neither root nor user namespaces)."""
    prefix = _namespace_prefix()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (unshare, as root or in a user namespace)")
    mount = 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"'
    return [*prefix, "sh", "-c", mount, "sh", ",".join(filter(None, (f"size={size}", options))), folder]


@functools.cache
def _namespace_prefix() -> tuple[str, ...] | None:
    """The `unshare` command that gives a private mount namespace on this machine, if one does."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (("unshare", "--mount"), ("unshare", "--mount", "--map-root-user")):
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None

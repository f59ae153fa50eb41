"""Where a persistent store's files are. One on a network file system is named in a warning at
open: LMDB's locks and memory map, and SQLite's locking, are not safe there, and a home folder on
NFS, where the default store lives, is common on clusters. The file system is found by the mount
the store's directory is under (Linux's /proc/self/mountinfo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sippcache
from sippcache.engine.directory import network_file_system

#: A cluster node's mounts: the root on a local disk, home folders over NFS, a local scratch disk
#: mounted inside one of them (its name with a space, which mountinfo writes as "\040"), and sshfs.
MOUNTINFO = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:35 / /home rw,relatime shared:20 - nfs4 filer:/home rw,vers=4.2,addr=10.0.0.2
41 40 8:17 / /home/ada/local\040scratch rw,relatime shared:21 - xfs /dev/sdb1 rw
42 22 0:40 / /mnt/remote rw,nosuid shared:22 master:3 - fuse.sshfs ada@host:/ rw,user_id=1000
43 22 0:41 / /homework rw,relatime - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/home/ada/.cache/sippcache/lmdb", "nfs4"),
        ("/home", "nfs4"),
        ("/home/ada/local scratch/store", None),  # the local disk mounted inside the NFS one
        ("/mnt/remote/store", "fuse.sshfs"),
        ("/homework/store", None),  # not under /home
        ("/var/cache/sipp", None),
    ],
)
def test_a_network_file_system_is_found_by_the_mount_a_store_is_under(path: str, kind: str | None) -> None:
    assert network_file_system(path, MOUNTINFO) == kind


def test_a_store_on_this_machines_own_disk_is_not_warned_of(tmp_path: Path, caplog: Any) -> None:
    for url in (f"lmdb://{tmp_path}/lmdb", f"diskcache://{tmp_path}/diskcache"):
        with sippcache.open(url) as cache:
            cache.store([1, 2, 3], b"state")
    assert network_file_system(str(tmp_path)) is None
    assert "network file system" not in caplog.text

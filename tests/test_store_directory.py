"""Where a persistent store's files are. One on a network file system is named in a warning at
open: LMDB's locks and memory map, and SQLite's locking, are not safe there, and a home folder on
NFS, where the default store lives, is common on clusters. The file system is found by the mount
the store's directory is under (Linux's /proc/self/mountinfo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sippcache
from sippcache.engine.directory import Mount, huge_pages, mount_of, network_file_system

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


#: A GPU host's RAM disks: /dev/shm as systemd mounts it (4 KiB pages), a tmpfs mounted with
#: huge pages for slot files, one mounted twice at one point (the later mount is the one seen),
#: and one that takes huge pages only where a program asks for them (madvise).
RAM_DISKS = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:23 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw,size=65536k
50 22 0:45 / /srv/slots rw,relatime shared:30 - tmpfs tmpfs rw,size=67108864k,huge=within_size
51 22 0:46 / /srv/stacked rw,relatime shared:31 - tmpfs tmpfs rw,size=1024k
52 22 0:47 / /srv/stacked rw,relatime shared:32 - tmpfs tmpfs rw,size=8388608k,huge=always
53 22 0:48 / /srv/advised rw,relatime shared:33 - tmpfs tmpfs rw,huge=advise
"""


@pytest.mark.parametrize(
    ("path", "shmem_enabled", "huge"),
    [
        ("/dev/shm/sippcache-proxy-1", "always within_size advise [never] deny force", False),
        ("/srv/slots/a", "always within_size advise [never] deny force", True),
        ("/srv/stacked/a", "[never]", True),
        ("/srv/advised/a", "[never]", False),  # llama-server writes with fwrite: it asks for nothing
        ("/var/tmp/slots", "[force]", None),  # not a tmpfs: a disk's page cache
        ("/dev/shm/a", "always within_size advise never deny [force]", True),  # the kernel forces them
        ("/srv/slots/a", "always within_size advise never [deny] force", False),  # the kernel refuses them
        ("/srv/slots/a", "", True),  # no THP control file: the mount says
    ],
)
def test_huge_pages_are_told_by_the_tmpfs_mount_and_the_kernels_setting(
    path: str, shmem_enabled: str, huge: bool | None
) -> None:
    assert huge_pages(path, RAM_DISKS, shmem_enabled) is huge


def test_the_mount_a_path_is_on_is_the_last_at_the_longest_point() -> None:
    assert mount_of("/srv/stacked/x", RAM_DISKS) == Mount("tmpfs", frozenset({"rw", "size=8388608k", "huge=always"}))
    assert mount_of("/srv/slotsmore", RAM_DISKS) == Mount("ext4", frozenset({"rw"}))  # not under /srv/slots
    assert mount_of("/x", "") is None

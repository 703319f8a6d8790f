"""What a data server reports of its space: each data directory's size, free bytes and
the filesystem it lives on, so that the metaserver counts a disk shared by several
directories or several servers once (like ``lfs df``).

A filesystem is named by the host's boot id and the directory's ``st_dev``: the same for
every server on this host whose directories share a filesystem, different across hosts.
(``st_dev`` numbers may change at a reboot, and so does the boot id.)
"""
from __future__ import annotations

import logging
import os
import socket
from functools import cache

from pfs.core.messages.records import Volume

log = logging.getLogger(__name__)

_HOST_ID_FILES = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id")


@cache
def host_id() -> str:
    """This host (and boot): the boot id, else the machine id, else the host name."""
    for path in _HOST_ID_FILES:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return text
    return socket.gethostname()


def volumes(dirs: list[str], free_override: int = -1) -> list[Volume]:
    """Each directory's filesystem: its identity, size and the bytes free to us.
    ``free_override`` >= 0 reports that many bytes free instead (a test knob that
    fakes a full or nearly full disk)."""
    out = []
    for d in dirs:
        st = os.statvfs(d)
        total = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize if free_override < 0 else min(free_override, total)
        out.append(Volume(d, f"{host_id()}:{os.stat(d).st_dev}", total, free))
    return out


def space(vols: list[Volume]) -> tuple[int, int]:
    """Total and free bytes of ``vols``, each filesystem counted once."""
    seen = {v.fs: v for v in vols}
    return sum(v.total for v in seen.values()), sum(v.free for v in seen.values())


def with_reclaimable(vols: list[Volume], held: dict[str, int]) -> list[Volume]:
    """``vols`` with the bytes a cache holds in each directory (``held``: the KV store's
    slabs, given back to file writes) counted as free, per filesystem."""
    if not held:
        return vols
    by_fs: dict[str, int] = {}
    for v in vols:
        by_fs[v.fs] = by_fs.get(v.fs, 0) + held.get(v.path, 0)
    return [v._replace(free=min(v.total, v.free + by_fs[v.fs])) for v in vols]

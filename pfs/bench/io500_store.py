"""Where ``pfs bench io500`` puts its files: a POSIX directory (a pfs FUSE mount, local
disk) or pfs through the native client. The phases use only these few operations."""
from __future__ import annotations

import errno
import os
import stat as statmod
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pfs
from pfs.bench.common import fs_of


class Store(ABC):
    """The few operations the phases need, on a POSIX directory or through pfs."""

    kind = "?"
    DIFFERENCES: tuple[str, ...] = ()  # what this store does unlike the harness, said in the output

    @abstractmethod
    def path(self, *parts: str) -> str: ...
    @abstractmethod
    def mkdir(self, p: str) -> None: ...
    @abstractmethod
    def makedirs(self, p: str) -> None: ...
    @abstractmethod
    def rmdir(self, p: str) -> None: ...
    @abstractmethod
    def unlink(self, p: str) -> None: ...
    @abstractmethod
    def stat(self, p: str) -> tuple[int, int]:
        """(size, ctime_ns)."""
    @abstractmethod
    def scan(self, p: str) -> list[tuple[str, bool]]:
        """(name, is_dir) of each entry."""
    @abstractmethod
    def scan_stat(self, p: str, name: str, hint: Any) -> tuple[int, int, bool]:
        """(size, ctime_ns, is_regular_file) of an entry from :meth:`scan` (an lstat)."""
    @abstractmethod
    def create_empty(self, p: str) -> None: ...
    @abstractmethod
    def write_new(self, p: str, data: memoryview) -> None:
        """Create ``p`` (new: mdtest's names are not reused), write ``data``, close."""
    @abstractmethod
    def read_whole(self, p: str, buf: memoryview) -> int:
        """Open (read-write, as mdtest), read up to ``len(buf)`` bytes, close."""
    @abstractmethod
    def open(self, p: str, create: bool, write: bool) -> Any: ...
    @abstractmethod
    def pwrite(self, h: Any, data: memoryview, off: int) -> None: ...
    @abstractmethod
    def pread_into(self, h: Any, buf: memoryview, off: int) -> int: ...
    @abstractmethod
    def fsync(self, h: Any) -> None: ...
    @abstractmethod
    def close_file(self, h: Any) -> None: ...
    @abstractmethod
    def free_bytes(self) -> int: ...

    @abstractmethod
    def sync(self) -> None:
        """What mdtest's ``-Y`` does after a create phase (IOR's POSIX_Sync:
        ``system("sync")``)."""

    def close(self) -> None:  # noqa: B027 - most stores hold nothing to release
        return None

    def scan_with_hints(self, p: str) -> list[tuple[str, bool, Any]]:
        return [(n, d, None) for n, d in self.scan(p)]


class PosixStore(Store):
    kind = "posix"
    DIFFERENCES = (
        "each call costs a few microseconds of Python on top of the kernel's: where the "
        "kernel answers from its caches in about one (stat, find, small reads on a local "
        "filesystem) the rate is CPU bound and below the C tools'; on a network or FUSE "
        "filesystem the call's round trip dominates and the rates agree",
    )
    # with the C loops (io500_loops.py) only IOR's write loop is Python's
    IOR_IN_PYTHON = ("IOR's write loop runs in Python: a few microseconds a transfer "
                     "on top of the kernel's, small beside a 2 MiB or 47,008-byte copy")

    def __init__(self, root: str) -> None:
        self.root = str(root)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def mkdir(self, p: str) -> None:
        os.mkdir(p)

    def makedirs(self, p: str) -> None:
        os.makedirs(p, exist_ok=True)

    def rmdir(self, p: str) -> None:
        os.rmdir(p)

    def unlink(self, p: str) -> None:
        os.unlink(p)

    def stat(self, p: str) -> tuple[int, int]:
        st = os.stat(p)
        return st.st_size, st.st_ctime_ns

    def scan(self, p: str) -> list[tuple[str, bool]]:
        return [(n, d) for n, d, _ in self.scan_with_hints(p)]

    def scan_with_hints(self, p: str) -> list[tuple[str, bool, Any]]:
        with os.scandir(p) as it:
            return [(e.name, e.is_dir(follow_symlinks=False), e) for e in it]

    def scan_stat(self, p: str, name: str, hint: Any) -> tuple[int, int, bool]:
        st = hint.stat(follow_symlinks=False) if hint is not None else \
            os.lstat(os.path.join(p, name))
        return st.st_size, st.st_ctime_ns, statmod.S_ISREG(st.st_mode)

    # the open flags are IOR's and mdtest's (as strace shows them): files are created
    # and written O_RDWR|O_CREAT, mdtest opens even the files it only reads O_RDWR, IOR
    # reads O_RDONLY; on a FUSE mount a writable handle can cost more to open and close
    def create_empty(self, p: str) -> None:
        os.close(os.open(p, os.O_CREAT | os.O_RDWR, 0o664))

    def write_new(self, p: str, data: memoryview) -> None:
        fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o664)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        finally:
            os.close(fd)

    def read_whole(self, p: str, buf: memoryview) -> int:
        fd = os.open(p, os.O_RDWR)
        try:
            return os.readv(fd, [buf])
        finally:
            os.close(fd)

    def open(self, p: str, create: bool, write: bool) -> int:
        flags = os.O_RDWR if write else os.O_RDONLY
        if create:
            flags |= os.O_CREAT  # no O_TRUNC: IOR removes the file first, untimed
        return os.open(p, flags, 0o664)

    def pwrite(self, h: int, data: memoryview, off: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwritev(h, [data[done:]], off + done)

    def pread_into(self, h: int, buf: memoryview, off: int) -> int:
        got = 0
        while got < len(buf):
            n = os.preadv(h, [buf[got:]], off + got)
            if n == 0:
                break
            got += n
        return got

    def fsync(self, h: int) -> None:
        os.fsync(h)

    def close_file(self, h: int) -> None:
        os.close(h)

    def sync(self) -> None:
        # IOR's POSIX_Sync, which mdtest -Y calls on every rank: system("sync"), a shell
        # forked and the sync command run, not the bare system call
        rc = os.system("sync")
        if rc != 0:
            raise OSError(errno.EIO, f"sync: the sync command failed ({rc}) for {self.root}")

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


class PfsStore(Store):
    """pfs through the native client (one connection per rank)."""

    kind = "pfs"
    # where this store cannot do what IOR, mdtest and pfind do through the kernel
    DIFFERENCES = (
        "no kernel: no page cache, dentry or attribute cache between the phases, so "
        "reads and stats always reach the servers",
        "mdtest -Y (sync() after a create phase) has nothing to flush: a closed file is "
        "already on the data servers",
        "find lists directories with the client's scandir (names, types and attributes "
        "in one reply) instead of readdir + lstat",
    )

    def __init__(self, client_toml: str, root: str) -> None:
        self.client = pfs.connect(config=client_toml)
        self.root = "/" + root.strip("/")

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) or "/"

    def mkdir(self, p: str) -> None:
        self.client.mkdir(p)

    def makedirs(self, p: str) -> None:
        self.client.makedirs(p, exist_ok=True)

    def rmdir(self, p: str) -> None:
        self.client.rmdir(p)

    def unlink(self, p: str) -> None:
        self.client.remove(p)

    def stat(self, p: str) -> tuple[int, int]:
        st = self.client.stat(p)
        return st.st_size, st.st_ctime_ns

    def scan(self, p: str) -> list[tuple[str, bool]]:
        return [(n, d) for n, d, _ in self.scan_with_hints(p)]

    def scan_with_hints(self, p: str) -> list[tuple[str, bool, Any]]:
        return [(e.name, e.is_dir(), e) for e in self.client.scandir(p)]

    def scan_stat(self, p: str, name: str, hint: Any) -> tuple[int, int, bool]:
        st = hint.attr if hint is not None and hint.attr is not None else \
            self.client.lstat(f"{p}/{name}")
        return st.st_size, st.st_ctime_ns, statmod.S_ISREG(st.st_mode)

    def create_empty(self, p: str) -> None:
        self.client.open(p, "xb").close()

    def write_new(self, p: str, data: memoryview) -> None:
        f = self.client.open(p, "xb")
        try:
            f.pwrite(data, 0)
        finally:
            f.close()

    def read_whole(self, p: str, buf: memoryview) -> int:
        f = self.client.open(p, "r+b")  # read-write, as mdtest opens it
        try:
            return f.preadinto(buf, 0)
        finally:
            f.close()

    def open(self, p: str, create: bool, write: bool) -> Any:
        return self.client.open(p, ("wb" if create else "r+b") if write else "rb")

    def pwrite(self, h: Any, data: memoryview, off: int) -> None:
        h.pwrite(data, off)

    def pread_into(self, h: Any, buf: memoryview, off: int) -> int:
        return h.preadinto(buf, off)

    def fsync(self, h: Any) -> None:
        h.fsync()

    def close_file(self, h: Any) -> None:
        h.close()

    def sync(self) -> None:
        # the native client keeps no dirty pages: a closed file is on the data servers
        return None

    def free_bytes(self) -> int:
        st = self.client.statvfs("/")
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        self.client.close()


@dataclass(frozen=True)
class Target:
    """Where a run goes: ``posix`` + a directory, or ``pfs`` + client.toml + a pfs dir."""

    kind: str
    path: str
    client_toml: str = ""

    def open(self) -> Store:
        if self.kind == "pfs":
            return PfsStore(self.client_toml, self.path)
        return PosixStore(self.path)

    def describe(self) -> str:
        if self.kind == "pfs":
            return f"pfs native client ({self.client_toml}) {self.path}"
        return f"{self.path} ({fs_of(Path(self.path))})"

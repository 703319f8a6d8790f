"""Records the client hands to its callers: credentials, attributes, directory entries."""
from __future__ import annotations

import os
import stat as statmod
from dataclasses import dataclass
from typing import Any

_new = object.__new__
_set = object.__setattr__


def fsname(name: str | bytes) -> bytes:
    """A name or path as the metaserver takes it: bytes (a str through ``os.fsencode``)."""
    return os.fsencode(name) if isinstance(name, str) else bytes(name)


@dataclass(frozen=True, slots=True)
class Cred:
    """Who a request acts for; the metaserver checks permissions with it."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @classmethod
    def current(cls) -> Cred:
        return cls(os.geteuid(), os.getegid(), tuple(os.getgroups()))

    def to_wire(self) -> list[Any]:
        return [self.uid, self.gid, list(self.groups)]


@dataclass(frozen=True, slots=True)
class StatResult:
    """What ``os.stat`` returns, for a pfs file."""

    st_mode: int
    st_ino: int
    st_nlink: int
    st_uid: int
    st_gid: int
    st_size: int
    st_atime_ns: int
    st_mtime_ns: int
    st_ctime_ns: int
    st_rdev: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0
    st_dev: int = 0

    @property
    def st_atime(self) -> float:
        return self.st_atime_ns / 1e9

    @property
    def st_mtime(self) -> float:
        return self.st_mtime_ns / 1e9

    @property
    def st_ctime(self) -> float:
        return self.st_ctime_ns / 1e9

    @classmethod
    def from_wire(cls, a: dict[str, Any]) -> StatResult:
        # every stat builds one: the slots set directly, without the frozen
        # dataclass's keyword __init__ (a third of the cost)
        o = _new(cls)
        _set(o, "st_mode", a["mode"])
        _set(o, "st_ino", a["ino"])
        _set(o, "st_nlink", a["nlink"])
        _set(o, "st_uid", a["uid"])
        _set(o, "st_gid", a["gid"])
        _set(o, "st_size", a["size"])
        _set(o, "st_atime_ns", a["atime"])
        _set(o, "st_mtime_ns", a["mtime"])
        _set(o, "st_ctime_ns", a["ctime"])
        _set(o, "st_rdev", a.get("rdev", 0))
        _set(o, "st_blksize", a.get("blksize", 4096))
        _set(o, "st_blocks", a.get("blocks", 0))
        _set(o, "st_dev", 0)
        return o  # type: ignore[no-any-return]

    def with_size(self, size: int) -> StatResult:
        from dataclasses import replace

        return replace(self, st_size=size, st_blocks=(size + 511) // 512)

    def is_dir(self) -> bool:
        return statmod.S_ISDIR(self.st_mode)

    def is_file(self) -> bool:
        return statmod.S_ISREG(self.st_mode)

    def is_symlink(self) -> bool:
        return statmod.S_ISLNK(self.st_mode)


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of a directory listing, as ``os.scandir`` yields (plus the cookie)."""

    name: str
    path: str
    inode_number: int
    mode: int
    cookie: int
    attr: StatResult | None = None

    def inode(self) -> int:
        return self.inode_number

    def is_dir(self, *, follow_symlinks: bool = False) -> bool:
        return statmod.S_ISDIR(self.mode)

    def is_file(self, *, follow_symlinks: bool = False) -> bool:
        return statmod.S_ISREG(self.mode)

    def is_symlink(self) -> bool:
        return statmod.S_ISLNK(self.mode)

    def stat(self) -> StatResult | None:
        return self.attr

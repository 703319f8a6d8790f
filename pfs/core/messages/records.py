"""Shared records and field types: credentials, object ids, times, where an entry is
(``At``), and the attribute/layout maps. Defined once, used by both services' messages.

Credentials and object ids are tuples in Python; msgpack sends a tuple as an array, so
they go on the wire as they are (``[uid, gid, [gids]]``, ``[ino, stripe]``).

The POSIX limits here are the ones the metaserver enforces (``metaserver/namespace.py``
checks them again, with the same errnos, for callers that do not come over the wire).
"""
from __future__ import annotations

import errno
from typing import Any, NamedTuple

from pfs.core.messages.base import (
    MISSING,
    REQUIRED,
    BytesField,
    Composite,
    Field,
    IntField,
    ListField,
    MapField,
    violation,
)

NAME_MAX = 255
PATH_MAX = 4096
SYMLINK_MAX = 4095
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536
MAX_GROUPS = 65536
MAX_ID = 1 << 63  # object ids, offsets and sizes on a data server are below it
NOW = "now"

WireCred = tuple[int, int, tuple[int, ...]]
ObjId = tuple[int, int]


def _ints(v: Any) -> bool:
    return all(type(x) is int or (isinstance(x, int) and not isinstance(x, bool)) for x in v)


class CredField(Field):
    """``[uid, gid, [gids]]`` (the groups may be left out) -> ``(uid, gid, (gids...))``."""

    type_doc = "cred"

    def quick(self, v: str) -> str:
        return (f"type({v}) is list and len({v}) == 3 and type({v}[0]) is int and "
                f"type({v}[1]) is int and type({v}[2]) is list and len({v}[2]) <= "
                f"{MAX_GROUPS} and all(type(g) is int for g in {v}[2])")

    def build(self, v: str) -> str:
        return f"({v}[0], {v}[1], tuple({v}[2]))"

    def check(self, v: Any, method: str) -> Any:
        if not isinstance(v, (list, tuple)) or len(v) not in (2, 3) or not _ints(v[:2]):
            raise violation(errno.EINVAL, "cred must be [uid, gid, [gids]]")
        groups: tuple[int, ...] = ()
        if len(v) == 3:
            g = v[2]
            if not isinstance(g, (list, tuple)) or len(g) > MAX_GROUPS or not _ints(g):
                raise violation(errno.EINVAL, "cred groups must be a list of integers")
            groups = tuple(g)
        return (v[0], v[1], groups)

    def describe(self) -> str:
        return "`cred`"


class ObjIdField(Field):
    """``[ino, stripe]``, two integers in ``[0, 2**63)`` -> a tuple."""

    type_doc = "object id"

    def quick(self, v: str) -> str:
        return (f"type({v}) is list and len({v}) == 2 and type({v}[0]) is int and "
                f"type({v}[1]) is int and 0 <= {v}[0] < {MAX_ID} and 0 <= {v}[1] < {MAX_ID}")

    def build(self, v: str) -> str:
        return f"({v}[0], {v}[1])"

    def check(self, v: Any, method: str) -> Any:
        if (isinstance(v, (list, tuple)) and len(v) == 2
                and all(type(x) is int and 0 <= x < MAX_ID for x in v)):
            return (v[0], v[1])
        raise violation(errno.EINVAL, f"bad object id {v!r}: want [ino, stripe], "
                                 f"two integers in [0, 2**63)")


class TimeField(Field):
    """A time: integer nanoseconds since the epoch, or ``"now"``."""

    type_doc = 'int, or `"now"`'

    def quick(self, v: str) -> str:
        return f"type({v}) is int"

    def check(self, v: Any, method: str) -> Any:
        if v == NOW or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        raise violation(errno.EINVAL, f"{method}: field '{self.key}' must be an integer or 'now'")


class Volume(NamedTuple):
    """One data directory of a data server, as it reports it: ``fs`` names the
    filesystem it lives on, the same for every directory on that filesystem of that
    host ("" when unknown: counted on its own), so the cluster counts a disk once."""

    path: str
    fs: str
    total: int
    free: int


MAX_VOLUMES = 1024  # data directories one data server may report


class VolumeField(Field):
    """``[path, fs, total, free]`` -> a ``Volume``."""

    type_doc = "volume"

    def check(self, v: Any, method: str) -> Any:
        if (isinstance(v, (list, tuple)) and len(v) == 4
                and isinstance(v[0], str) and len(v[0]) <= PATH_MAX
                and isinstance(v[1], str) and len(v[1]) <= NAME_MAX
                and all(type(x) is int and 0 <= x < MAX_ID for x in v[2:])):
            return Volume(v[0], v[1], v[2], v[3])
        raise violation(errno.EINVAL, f"{method}: bad volume {v!r}: want [path, fs, total, "
                                      f"free]")


class At(NamedTuple):
    """Where an entry is: ``parent`` + ``name``, or an absolute ``path`` the metaserver
    resolves (the last component not followed)."""

    parent: int | None = None
    name: bytes | None = None
    path: bytes | None = None

    @classmethod
    def of(cls, parent: int, name: bytes) -> At:
        return cls(parent, name)

    @classmethod
    def by_path(cls, path: bytes) -> At:
        return cls(None, None, path)


class AtField(Composite):
    """``At`` on the wire: ``{prefix}path``, or ``{prefix}parent`` + ``{prefix}name``."""

    type_doc = "entry"

    def __init__(self, prefix: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.prefix = prefix
        self.path = BytesField(max_len=PATH_MAX - 1, len_code=errno.ENAMETOOLONG,
                               key=prefix + "path")
        self.parent = IntField(key=prefix + "parent")
        self.name_ = BytesField(max_len=NAME_MAX, len_code=errno.ENAMETOOLONG,
                                key=prefix + "name")

    def decode(self, m: dict[str, Any], method: str) -> At:
        path = m.get(self.path.key, MISSING)
        if path is not MISSING:
            return At(path=self.path.convert(path, method))
        parent = m.get(self.parent.key, MISSING)
        if type(parent) is not int:
            parent = self.parent.convert(parent, method)
        name = m.get(self.name_.key, MISSING)
        if type(name) is not bytes or len(name) > NAME_MAX:
            name = self.name_.convert(name, method)
        return At(parent, name)

    def put(self, value: At, out: dict[str, Any]) -> None:
        if value.path is not None:
            out[self.path.key] = value.path
        else:
            out[self.parent.key] = value.parent
            out[self.name_.key] = value.name

    def describe(self) -> str:
        p = self.prefix
        return (f"`{p}parent`, `{p}name` ({self.name_.limits()}), or `{p}path` "
                f"({self.path.limits()})")


def Cred(*, default: Any = REQUIRED) -> Any:  # noqa: N802
    return CredField(default=default)


def Obj(*, doc: str = "") -> Any:  # noqa: N802
    return ObjIdField(doc=doc, key="obj")


def Volumes() -> Any:  # noqa: N802
    return ListField(VolumeField(), max_len=MAX_VOLUMES, default=None,
                     doc=f"[[path, fs, total, free], ...], at most {MAX_VOLUMES}: each data "
                         "directory and the filesystem it is on (absent: one unique one)")


def Time(*, default: Any = None, doc: str = "") -> Any:  # noqa: N802
    return TimeField(default=default, doc=doc)


def Entry(*, prefix: str = "") -> Any:  # noqa: N802
    return AtField(prefix)


def Attr(*, default: Any = REQUIRED, key: str = "") -> Any:  # noqa: N802
    return MapField("attr", default=default, key=key,
                    doc="attr")


def Layout(*, default: Any = REQUIRED, doc: str = "layout") -> Any:  # noqa: N802
    return MapField("layout", default=default, doc=doc)

"""What ``pfs fsck`` concludes, without I/O: the files of the metaserver and the objects
of each data server, both in inode order, merged one inode at a time (memory: one
inode's objects and the problems found), and each inode's objects classified.

Classes (``Problem.kind``):

- ``orphan``: an object no file's layout references (its inode is gone or is not a
  file, or the layout names another server or no such stripe), not queued for deletion.
- ``missing``: the layout names a server for a stripe that should hold data given the
  file size, and the object is absent.
- ``short``: the object is shorter than the file size implies for its stripe.
- ``hole?``: absent or short where a hole would look the same: the file is sparse
  (one of its objects holds unallocated ranges), or a server of the file could not be
  listed, and no replica holds the data. Not
  counted as a problem; a block map (written blocks per object) will tell them apart.
- ``checksum``: blocks whose checksum fails (the data server's ``verify``).

Evidence that an absent or short object lost data rather than being a hole: a replica
of the same stripe that holds more, or a file that is dense (every object of it fully
allocated: a file written from start to end). Without either the object is ``hole?``.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pfs.core.layout import object_size

SPARSE_SLACK = 4096  # an object with this many bytes unallocated (or more) has holes
PROBLEMS = ("orphan", "missing", "short", "checksum")  # the kinds that fail a check


@dataclass(frozen=True, slots=True)
class FileRec:
    ino: int
    size: int
    layout: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class ObjRec:
    ino: int
    stripe: int
    size: int  # -1: the object file is gone, its block map remains (``lost``)
    allocated: int
    written: int = -1  # the block map's data end in the object; -1: no block map
    holes: int = 0  # blocks before ``written`` never written

    @property
    def sparse(self) -> bool:
        if self.written >= 0:
            return self.holes > 0
        return self.allocated + SPARSE_SLACK <= self.size

    @property
    def lost(self) -> bool:
        return self.size < 0

    @property
    def mapped(self) -> bool:
        return self.written >= 0


@dataclass(slots=True)
class Problem:
    kind: str
    ino: int
    stripe: int
    sid: str
    detail: str
    path: str | None = None
    bad: list[int] = field(default_factory=list)  # checksum: block offsets
    no_file: bool = False  # orphan: no file has its inode (its removal is tombstoned)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "ino": self.ino, "stripe": self.stripe,
                               "server": self.sid, "path": self.path, "detail": self.detail}
        if self.bad:
            out["bad_blocks"] = self.bad
        return out


def classify(f: FileRec, objs: dict[str, dict[int, ObjRec]], down: set[str]
             ) -> tuple[list[Problem], list[tuple[str, ObjRec]]]:
    """The problems of file ``f`` given its objects found on each server (``{sid:
    {stripe: obj}}``; servers in ``down`` were not listed), and the objects it
    references (what ``verify`` checks). Objects it does not reference are orphans."""
    layout = f.layout or {}
    servers: list[list[str]] = layout.get("servers") or []
    unit, count = layout.get("unit", 0), layout.get("count", 0)
    left = {sid: dict(by_stripe) for sid, by_stripe in objs.items()}
    referenced: list[tuple[str, ObjRec]] = []
    found: list[tuple[int, str, int, ObjRec | None]] = []  # stripe, sid, expected, object
    for stripe, sids in enumerate(servers):
        expect = object_size(unit, count, stripe, f.size) if unit and count else 0
        for sid in sids:
            if sid in down:
                continue
            obj = left.get(sid, {}).pop(stripe, None)
            if obj is not None and not obj.lost:
                referenced.append((sid, obj))
            found.append((stripe, sid, expect, obj))
    present = [o for _, o in referenced]
    sparse = any(o.sparse for o in present)
    # an object on a server not listed may be the one that shows the file sparse
    unknown = any(sid in down for sids in servers for sid in sids)
    # with every object's block map: how far into the file data was ever written
    mapped = bool(present) and all(o.mapped for o in present)
    reach = max((_file_off(unit, count, o.stripe, o.written) for o in present
                 if o.mapped and o.written > 0), default=0) if mapped else 0
    problems: list[Problem] = []
    for stripe, sid, expect, obj in found:
        if obj is not None and obj.lost:
            problems.append(Problem("missing", f.ino, stripe, sid,
                                    f"the object file is gone; its block map says data "
                                    f"was written up to {obj.written}"))
            continue
        if obj is not None and obj.mapped:  # the map tells a cut from a hole exactly
            if obj.size < obj.written:
                problems.append(Problem("short", f.ino, stripe, sid,
                                        f"{obj.size} of {expect} bytes; its block map "
                                        f"says data was written up to {obj.written}"))
            continue
        have = 0 if obj is None else obj.size
        if have >= expect:
            continue
        replica = max((o.written if o.lost else o.size  # a lost replica's map counts
                       for s, _sid, _e, o in found if s == stripe and o is not None),
                      default=0)
        what = (f"absent, {expect} bytes expected" if obj is None
                else f"{have} of {expect} bytes")
        if obj is None and mapped and replica <= 0:
            # gone with its block map: lost if the file was written past it without a
            # hole (its other objects' maps say so), else it may never have been written
            if not sparse and not unknown and stripe * unit < reach:
                problems.append(Problem("missing", f.ino, stripe, sid,
                                        f"{what}; the file's other objects hold data "
                                        f"written past it, without holes"))
            else:
                problems.append(Problem("hole?", f.ino, stripe, sid,
                                        f"{what}; no block map and no replica: may be a "
                                        "hole (never written) or lost with its block map"))
            continue
        lost = replica > have or not (sparse or unknown)
        if not lost:
            why = ("the file is sparse" if sparse
                   else "a server of the file could not be listed")
            problems.append(Problem("hole?", f.ino, stripe, sid, f"{what}; {why} and no "
                                    "replica holds more: may be a hole"))
        else:
            problems.append(Problem("missing" if obj is None else "short", f.ino, stripe,
                                    sid, what))
    for sid, by_stripe in left.items():
        for stripe, obj in by_stripe.items():
            problems.append(Problem("orphan", f.ino, stripe, sid,
                                    f"{_held(obj)}; file {f.ino}'s layout does not "
                                    f"place stripe {stripe} there"))
    return problems, referenced


def _file_off(unit: int, count: int, stripe: int, obj_off: int) -> int:
    """The file offset just past object byte ``obj_off - 1`` of ``stripe``."""
    if not unit or not count:
        return 0
    last = obj_off - 1
    return (last // unit) * unit * count + stripe * unit + last % unit + 1


def _held(obj: ObjRec) -> str:
    return "only a block map (the object file is gone)" if obj.lost else f"{obj.size} bytes"


def orphan(sid: str, obj: ObjRec) -> Problem:
    return Problem("orphan", obj.ino, obj.stripe, sid,
                   f"{_held(obj)}; no file has inode {obj.ino}", no_file=True)


class Peek:
    """An async iterator one item ahead."""

    def __init__(self, it: AsyncIterator[ObjRec]) -> None:
        self._it = it
        self._next: ObjRec | None = None
        self._done = False

    async def peek(self) -> ObjRec | None:
        if self._next is None and not self._done:
            try:
                self._next = await anext(self._it)
            except StopAsyncIteration:
                self._done = True
        return self._next

    def pop(self) -> None:
        self._next = None


@dataclass(slots=True)
class Tally:
    files: int = 0
    objects: int = 0
    problems: list[Problem] = field(default_factory=list)


async def merge(files: AsyncIterator[FileRec], streams: dict[str, Peek], down: set[str],
                tally: Tally) -> AsyncIterator[tuple[FileRec, list[tuple[str, ObjRec]]]]:
    """Walk ``files`` and every server's objects together, by inode; append what is
    wrong to ``tally.problems`` and yield each file with the objects it references.
    A server whose stream fails is added to ``down`` by its stream (what is after is
    then not judged on it)."""
    async def upto(ino: int) -> dict[str, dict[int, ObjRec]]:
        mine: dict[str, dict[int, ObjRec]] = {}
        for sid, st in streams.items():
            while (o := await st.peek()) is not None and o.ino <= ino:
                st.pop()
                tally.objects += 1
                if o.ino < ino:
                    tally.problems.append(orphan(sid, o))
                else:
                    mine.setdefault(sid, {})[o.stripe] = o
        return mine

    async for f in files:
        tally.files += 1
        mine = await upto(f.ino)
        problems, referenced = classify(f, mine, down)
        tally.problems.extend(problems)
        yield f, referenced
    await upto(1 << 64)

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
    size: int
    allocated: int

    @property
    def sparse(self) -> bool:
        return self.allocated + SPARSE_SLACK <= self.size


@dataclass(slots=True)
class Problem:
    kind: str
    ino: int
    stripe: int
    sid: str
    detail: str
    path: str | None = None
    bad: list[int] = field(default_factory=list)  # checksum: block offsets

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
            if obj is not None:
                referenced.append((sid, obj))
            found.append((stripe, sid, expect, obj))
    sparse = any(o.sparse for _, o in referenced)
    # an object on a server not listed may be the one that shows the file sparse
    unknown = any(sid in down for sids in servers for sid in sids)
    problems: list[Problem] = []
    for stripe, sid, expect, obj in found:
        have = 0 if obj is None else obj.size
        if have >= expect:
            continue
        replica = max((o.size for s, _sid, _e, o in found if s == stripe and o is not None),
                      default=0)
        lost = replica > have or not (sparse or unknown)
        what = (f"absent, {expect} bytes expected" if obj is None
                else f"{have} of {expect} bytes")
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
                                    f"{obj.size} bytes; file {f.ino}'s layout does not "
                                    f"place stripe {stripe} there"))
    return problems, referenced


def orphan(sid: str, obj: ObjRec) -> Problem:
    return Problem("orphan", obj.ino, obj.stripe, sid,
                   f"{obj.size} bytes; no file has inode {obj.ino}")


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

"""``pfs fsck``: a read-only check of a running cluster (docs/architecture.md, "Checking:
pfs fsck").

It pages through the metaserver's files (``scan_inodes``, root only) and each data
server's objects (``list_objects``, with the read-only capability of ``scan_cap``),
merges them by inode (:mod:`pfs.tools.fsck_check`), asks each data server to ``verify``
the checksums of the objects files reference (at ``rate`` bytes/s at most), drops
orphans that are queued for deletion, and finds the paths of the files with problems
with a walk of the namespace. Nothing is changed anywhere, unless ``repair``: then each
missing, short or corrupt replica of a replicated stripe is replaced by a verified copy
from another member of its chain (``repair_object`` on the server holding it), orphans
are deleted only with ``remove_orphans``, and the whole check runs again: its report is
the one returned, with what was repaired and what could not be.

Exit status: 0 clean, 1 problems found, 2 the check was incomplete (a data server
unreachable or an error; problems found in the part checked are listed too). After a
repair, the status of the check that followed it.
"""
from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import trio

from pfs.client.aio import AsyncClient
from pfs.client.types import Cred
from pfs.core.messages import data as D
from pfs.core.messages import meta as M
from pfs.core.messages.base import RequestMessage, parse_reply
from pfs.tools.fsck_check import (
    PROBLEMS,
    FileRec,
    ObjRec,
    Peek,
    Problem,
    Tally,
    classify,
    merge,
    orphan,
)

log = logging.getLogger(__name__)

ROOT = Cred(0, 0, ())
PAGE = 1024  # inodes / objects per request
VERIFY_AT_ONCE = 4  # verify requests in flight
RECHECK = ("orphan", "missing", "short", "hole?")  # looked at again before reporting
MAX_RECHECK = 10000  # inodes looked at again, at most
RECHECK_PAGE = 4096  # objects of one inode on one server, at most (256 stripes x replicas)
MAX_STRIPE = (1 << 63) - 1
REPAIRABLE = ("missing", "short", "checksum")  # fixed from a good replica by --repair
NO_VERIFY = "checksums not verified (server does not support verify)"


@dataclass(slots=True)
class Report:
    files: int = 0
    objects: int = 0
    verified: int = 0
    problems: list[Problem] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # sid -> why
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)  # what --repair fixed
    not_repaired: list[str] = field(default_factory=list)  # and what it could not

    @property
    def counted(self) -> list[Problem]:
        return [p for p in self.problems if p.kind in PROBLEMS]

    @property
    def exit_code(self) -> int:
        if self.unreachable or self.errors:
            return 2
        return 1 if self.counted else 0

    def to_json(self) -> dict[str, Any]:
        return {"exit": self.exit_code, "files": self.files, "objects": self.objects,
                "verified": self.verified, "problems": [p.to_json() for p in self.problems],
                "unreachable": self.unreachable, "errors": self.errors, "notes": self.notes,
                "repaired": self.repaired, "not_repaired": self.not_repaired}

    def text(self) -> str:
        lines = []
        for p in sorted(self.problems, key=lambda p: (p.kind, p.ino, p.stripe, p.sid)):
            where = p.path or f"inode {p.ino}"
            lines.append(f"{p.kind:<9} {where} stripe {p.stripe} on {p.sid}: {p.detail}")
        for sid, why in sorted(self.unreachable.items()):
            lines.append(f"unreachable data server {sid}: {why}")
        lines += [f"error: {e}" for e in self.errors]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"repaired: {r}" for r in self.repaired]
        lines += [f"not repaired: {r}" for r in self.not_repaired]
        verdict = {0: "clean", 1: f"{len(self.counted)} problem(s)",
                   2: "INCOMPLETE (could not check everything)"}[self.exit_code]
        lines.append(f"{self.files} files, {self.objects} objects, {self.verified} verified: "
                     f"{verdict}")
        return "\n".join(lines)


class Rate:
    """At most ``rate`` bytes a second (0: no limit), over the whole run."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.t0 = time.monotonic()
        self.done = 0

    async def take(self, n: int) -> None:
        self.done += n
        if self.rate > 0:
            await trio.sleep(max(0.0, self.t0 + self.done / self.rate - time.monotonic()))


def _obj(row: list[Any]) -> ObjRec:
    """A ``list_objects`` row: ``[ino, stripe, size, allocated]``, and from servers that
    keep block maps ``written, holes`` (an older server's rows have four)."""
    return ObjRec(*row[:6])


class Fsck:
    def __init__(self, client: AsyncClient, *, verify: bool = True, rate: float = 0,
                 paths: bool = True) -> None:
        self.client = client
        self.verify, self.paths = verify, paths
        self.rate = Rate(rate)
        self.report = Report()
        self.down: set[str] = set()
        self.no_verify: set[str] = set()
        self._cap: tuple[bytes, float] = (b"", 0.0)
        self._wire = (0, 0, ())
        self.servers: dict[str, Any] = {}

    async def cap(self) -> bytes:
        cap, renew_at = self._cap
        if time.monotonic() >= renew_at:
            r: M.CapReply = await self.client.meta.request(M.ScanCap(cred=self._wire))
            self._cap = (r.cap, time.monotonic() + float(r.cap_ttl) / 2)
            cap = r.cap
        return cap

    async def data(self, sid: str, msg: RequestMessage) -> Any:
        return parse_reply(msg, (await self.client.data.send(sid, msg)).fields)

    # -- the two sides ---------------------------------------------------------
    async def files(self) -> AsyncIterator[FileRec]:
        after = 0
        while True:
            r: M.ScanInodesReply = await self.client.meta.request(
                M.ScanInodes(after=after, limit=PAGE, cred=self._wire))
            for ino, size, layout in r.inodes:
                for sid in {s for ss in (layout or {}).get("servers", []) for s in ss}:
                    if sid not in self.servers and sid not in self.down:
                        # before the file is judged: not its objects' absence, the server's
                        self.report.unreachable[sid] = "named by a layout but not registered"
                        self.down.add(sid)
                yield FileRec(ino, size, layout)
            if r.end:
                return
            after = r.next

    async def objects(self, sid: str) -> AsyncIterator[ObjRec]:
        after: tuple[int, int] | None = None
        while True:
            try:
                r: D.ListObjectsReply = await self.data(
                    sid, D.ListObjects(after=after, limit=PAGE, cap=await self.cap()))
            except OSError as exc:
                self.report.unreachable[sid] = f"listing its objects failed: {exc}"
                self.down.add(sid)
                return
            for row in r.objects:
                yield _obj(row)
            if r.end or not r.objects:
                return
            after = (r.objects[-1][0], r.objects[-1][1])

    # -- checks ----------------------------------------------------------------
    async def verify_one(self, sid: str, obj: ObjRec, limiter: trio.Semaphore) -> None:
        try:
            if sid in self.no_verify:
                return
            await self.rate.take(obj.size)
            try:
                r: D.VerifyReply = await self.data(
                    sid, D.Verify(obj=(obj.ino, obj.stripe), cap=await self.cap()))
            except OSError as exc:
                if exc.errno == errno.ENOSYS:
                    if sid not in self.no_verify:
                        self.no_verify.add(sid)
                        self.report.notes.append(f"data server {sid}: {NO_VERIFY}")
                    return
                self.report.errors.append(f"verify of object {[obj.ino, obj.stripe]} on "
                                          f"data server {sid}: {exc}")
                return
            self.report.verified += 1
            if r.bad:
                self.report.problems.append(Problem(
                    "checksum", obj.ino, obj.stripe, sid,
                    f"{len(r.bad)} of {r.blocks} blocks fail their checksum", bad=r.bad))
            elif r.unchecked:
                self.report.problems.append(Problem(
                    "unchecked", obj.ino, obj.stripe, sid,
                    "no checksums (written before checksums)"))
        finally:
            limiter.release()

    async def run(self) -> Report:
        rep = self.report
        self.servers = servers = await self.client.meta.servers()
        streams: dict[str, Peek] = {}
        for sid, srv in sorted(servers.items()):
            if not srv.get("alive"):
                rep.unreachable[sid] = f"down ({srv.get('host')}:{srv.get('port')}, no heartbeat)"
                self.down.add(sid)
            else:
                streams[sid] = Peek(self.objects(sid))
        tally = Tally()
        limiter = trio.Semaphore(VERIFY_AT_ONCE)
        async with trio.open_nursery() as nursery:
            async for _f, referenced in merge(self.files(), streams, self.down, tally):
                if not self.verify:
                    continue
                for sid, obj in referenced:
                    await limiter.acquire()
                    nursery.start_soon(self.verify_one, sid, obj, limiter)
        rep.files, rep.objects = tally.files, tally.objects
        rep.problems.extend(tally.problems)
        if not self.verify:
            rep.notes.append("checksums not verified (--no-verify)")
        await self._confirm()
        await self._drop_queued()
        if self.paths:
            await self._find_paths()
        return rep

    async def _confirm(self) -> None:
        """Look again at each inode with damage, now: a file created or deleted while
        the scan ran was seen by one side only. What is not found again is dropped."""
        suspects = sorted({p.ino for p in self.report.problems if p.kind in RECHECK})
        if len(suspects) > MAX_RECHECK:
            self.report.notes.append(f"{len(suspects)} inodes with damage: the first "
                                     f"{MAX_RECHECK} were checked twice, the rest once")
        for ino in suspects[:MAX_RECHECK]:
            fresh = await self._recheck(ino)
            if fresh is None:
                continue  # could not look again: keep what the scan found
            again = {(p.kind, p.stripe, p.sid) for p in fresh}
            self.report.problems = [
                p for p in self.report.problems
                if p.ino != ino or p.kind not in RECHECK or (p.kind, p.stripe, p.sid) in again]

    async def _recheck(self, ino: int) -> list[Problem] | None:
        r: M.ScanInodesReply = await self.client.meta.request(
            M.ScanInodes(after=ino - 1, limit=1, cred=self._wire))
        f = next((FileRec(*row) for row in r.inodes if row[0] == ino), None)
        objs: dict[str, dict[int, ObjRec]] = {}
        for sid in (s for s in self.servers if s not in self.down):
            try:
                lr: D.ListObjectsReply = await self.data(sid, D.ListObjects(
                    after=(ino - 1, MAX_STRIPE), limit=RECHECK_PAGE, cap=await self.cap()))
            except OSError:
                return None
            for row in lr.objects:
                if row[0] == ino:
                    objs.setdefault(sid, {})[row[1]] = _obj(row)
        if f is None:
            return [orphan(sid, o) for sid, by in objs.items() for o in by.values()]
        return classify(f, objs, self.down)[0]

    # -- repair ----------------------------------------------------------------
    async def repair(self, remove_orphans: bool = False) -> tuple[list[str], list[str]]:
        """Fix what this check found: each missing, short or corrupt replica from a good
        one (by the server holding it), orphans removed when asked; (done, not done)."""
        done: list[str] = []
        failed: list[str] = []
        chains: dict[int, list[int]] = {}
        for p in self.report.problems:
            what = f"{p.kind} inode {p.ino} stripe {p.stripe} on {p.sid}"
            if p.kind not in REPAIRABLE:
                continue
            if p.ino not in chains:
                chains[p.ino] = await self._chains(p.ino)
            cids = chains[p.ino]
            cid = cids[p.stripe] if p.stripe < len(cids) else None
            try:
                r: D.CountReply = await self.data(p.sid, D.RepairObject(
                    obj=(p.ino, p.stripe), chain=cid, cap=await self.cap()))
            except OSError as exc:
                failed.append(f"{what}: {exc}")
                continue
            done.append(f"{what}: {r.n} bytes copied from another replica")
        if remove_orphans:
            # those of no file tombstoned on their server (dataserver/tombstones.py: a
            # metadata backup restored later may name them again); those of a live file
            # not (a later layout may place that stripe there again)
            by_sid: dict[tuple[str, bool], list[tuple[int, int]]] = {}
            for p in self.report.problems:
                if p.kind == "orphan":
                    by_sid.setdefault((p.sid, p.no_file), []).append((p.ino, p.stripe))
            for (sid, tomb), objs in sorted(by_sid.items()):
                try:
                    dr: D.DeletedReply = await self.data(sid, D.RemoveOrphans(
                        objs=objs, tomb=tomb, cap=await self.cap()))
                except OSError as exc:
                    failed.append(f"orphans on {sid}: {exc}")
                    continue
                done.append(f"{dr.deleted} orphan object(s) removed on {sid}")
        return done, failed

    async def _chains(self, ino: int) -> list[int]:
        """The chain of each stripe of ``ino``, from its layout ([] when none)."""
        r: M.ScanInodesReply = await self.client.meta.request(
            M.ScanInodes(after=ino - 1, limit=1, cred=self._wire))
        for row in r.inodes:
            if row[0] == ino and row[2]:
                return [int(c) for c in row[2].get("chains") or []]
        return []

    async def _drop_queued(self) -> None:
        """Orphans whose deletion is queued are on their way out: not problems."""
        orphans = {(p.ino, p.stripe, p.sid) for p in self.report.problems if p.kind == "orphan"}
        if not orphans:
            return
        queued: set[tuple[int, int, str]] = set()
        start = 0
        while True:
            r: M.ScanDeletingReply = await self.client.meta.request(
                M.ScanDeleting(start=start, limit=PAGE, cred=self._wire))
            for _seq, ino, layout in r.entries:
                for stripe, sids in enumerate(layout.get("servers") or []):
                    queued.update((ino, stripe, sid) for sid in sids
                                  if (ino, stripe, sid) in orphans)
            if r.end:
                break
            start = r.next
        self.report.problems = [p for p in self.report.problems
                                if p.kind != "orphan" or (p.ino, p.stripe, p.sid) not in queued]

    async def _find_paths(self) -> None:
        """Name the files with problems: a walk of the namespace (as root), only when
        there is something to name, until each is found."""
        want = {p.ino for p in self.report.problems}
        if not want:
            return
        paths: dict[int, str] = {}
        todo = [(1, "")]
        meta = self.client.meta
        while todo and len(paths) < len(want):
            ino, path = todo.pop()
            cookie, eof = 0, False
            while not eof:
                entries, eof = await meta.readdir(ino, cookie, PAGE, cred=ROOT)
                for e in entries:
                    cookie = e.cookie
                    full = f"{path}/{e.name}"
                    if e.is_dir():
                        todo.append((e.inode_number, full))
                    elif e.inode_number in want:
                        paths.setdefault(e.inode_number, full)
                if not entries:
                    break
        for p in self.report.problems:
            p.path = paths.get(p.ino)


async def fsck(config: Any = None, meta: str | None = None, *, verify: bool = True,
               rate: float = 0, paths: bool = True, repair: bool = False,
               remove_orphans: bool = False) -> Report:
    """Check the cluster of ``config`` (a client config, as ``pfs.connect``); with
    ``repair``, fix what can be fixed and check again (module doc)."""
    try:
        async with AsyncClient.connect(config, meta, cred=ROOT) as client:
            check = Fsck(client, verify=verify, rate=rate, paths=paths)
            report = await check.run()
            if not repair or not report.problems:
                return report
            done, failed = await check.repair(remove_orphans)
            again = await Fsck(client, verify=verify, rate=rate, paths=paths).run()
            again.repaired, again.not_repaired = done, failed
            return again
    except BaseExceptionGroup as group:  # a nursery's: the OSError inside is the news
        first = _first_oserror(group)
        if first is None:
            raise
        raise first from group


def _first_oserror(group: BaseExceptionGroup[Any]) -> OSError | None:
    for exc in group.exceptions:
        if isinstance(exc, OSError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            inner = _first_oserror(exc)
            if inner is not None:
                return inner
    return None


def render(report: Report, as_json: bool) -> str:
    return json.dumps(report.to_json(), indent=2) if as_json else report.text()

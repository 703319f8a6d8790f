"""After a metadata restore, every replica answers EIO for data deleted (or cut off by
a truncation) after the backup, including one that was not a member when it was:
catch-up hands on the head's tombstones and truncation records, and object repair
copies a tombstone, never an empty object (docs/architecture.md, "Tombstones")."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

import pfs
from pfs.core.layout import Layout
from pfs.core.messages import data as D
from pfs.core.messages import meta as M
from pfs.tools import cluster
from pfs.tools.admin_repair import call_plan
from tests.integration.test_repair import _settled, _until
from tests.integration.test_replication import _kill, _sids
from tests.restore_fixtures import UNIT, cli, content, delete_and_restore


def _members(c: Any, path: str) -> list[str]:
    return list(Layout.from_wire(c.get_layout(path)).servers[0])


def _read_from(c: Any, sid: str, path: str, off: int, n: int) -> bytes:
    """``n`` bytes of ``path``'s stripe 0 at ``off`` from member ``sid`` alone (what
    the client would fill with zeros past a short reply, filled here too)."""
    lay = Layout.from_wire(c.get_layout(path))
    cid, ver = lay.chain_of(0)
    ino = c.stat(path).st_ino
    with c.open(path, "rb") as f:
        cap = f.handle.cap
    buf = bytearray(n)

    async def read() -> None:
        await c.aio.data.send(
            sid,
            D.Read(obj=(ino, 0), off=off, len=n, cap=cap, chain=cid, ver=ver),
            into=memoryview(buf),
        )

    c._run(read)
    return bytes(buf)


def _deleted_after_backup(d: Path, backup: Path, servers: int) -> tuple[Path, dict[str, str]]:
    """/A, /B and /T (one stripe, two replicas); a backup; /B deleted and reclaimed, /T
    cut to one unit; the backup restored and the cluster up again: its client config
    and its data servers (sid: process name)."""
    toml = cluster.up(d, data_servers=servers)
    with pfs.connect(config=toml) as c:
        c.set_layout("/", count=1, unit=UNIT, replicas=2)
        for name in ("A", "B", "T"):
            c.write_file(f"/{name}", content(name, 3 * UNIT))
    assert cli("admin", "backup", str(backup), "--cluster", str(d)).returncode == 0
    toml = delete_and_restore(d, toml, backup, lambda c: c.truncate("/T", UNIT))[0]
    return toml, _sids(d)


def _settled_read(c: Any, sid: str, path: str, off: int, n: int) -> bytes:
    """:func:`_read_from`, once ``sid`` knows it serves ``path``'s chain: a member that
    caught up learns so at its next heartbeat, after the metaserver already lists it,
    and refuses with CHAIN_STALE until then (waited out, never taken as an answer)."""

    def attempt() -> tuple[bytes] | None:
        try:
            return (_read_from(c, sid, path, off, n),)
        except OSError as e:
            if e.errno == D.CHAIN_STALE:
                return None
            raise

    return _until(f"{sid} serving {path}", attempt)[0]


def _eio_from(c: Any, sid: str, path: str, off: int) -> str:
    """The EIO ``sid`` alone answers for ``path`` at ``off``: its message."""
    with pytest.raises(OSError) as ei:
        _settled_read(c, sid, path, off, 1000)
    assert ei.value.errno == errno.EIO, (path, sid, ei.value)
    return str(ei.value)


def test_a_member_that_joined_after_the_deletion_answers_eio(
    private_cluster: Path, tmp_path: Path
) -> None:
    d = private_cluster
    toml, names = _deleted_after_backup(d, tmp_path / "backup", 3)
    with pfs.connect(config=toml) as c:
        before = {p: _members(c, p) for p in ("/A", "/B", "/T")}
        # a server of both /B's and /T's chains (two of three servers each) is replaced:
        # in each, the server it was not in joins, caught up from the head
        lost = next(s for s in before["/B"] if s in before["/T"])
        _kill(d, names[lost])
        c._drive(call_plan, M.Lost(sid=lost, cred=c.aio.meta.wire_cred(c.aio.cred)))
        _until(
            "the new members caught up",
            lambda: _settled(c) and all(lost not in _members(c, p) for p in before),
        )
        for path, off in (("/B", UNIT), ("/T", 2 * UNIT)):
            joined = [s for s in _members(c, path) if s not in before[path]]
            assert joined, (path, before[path], _members(c, path))
            for sid in _members(c, path):  # each member alone: deleted data, not a hole
                assert "after the metadata backup" in _eio_from(c, sid, path, off)
        for sid in _members(c, "/T"):  # before the cut: its bytes
            assert _settled_read(c, sid, "/T", 0, 1000) == content("T", 1000)
        for sid in _members(c, "/A"):
            assert _settled_read(c, sid, "/A", 0, 1000) == content("A", 1000)


def test_object_repair_copies_a_tombstone_not_an_empty_object(
    private_cluster: Path, tmp_path: Path
) -> None:
    d = private_cluster
    toml, names = _deleted_after_backup(d, tmp_path / "backup", 2)
    with pfs.connect(config=toml) as c:
        head, tail = _members(c, "/B")
    cluster.down(d)  # the tail loses its tombstones (as a server from before them would)
    for f in (d / "data" / f"ds{names[tail][4:]}").glob("tombstones"):
        f.unlink()
    toml = cluster.up(d)
    r = cli("fsck", "--config", str(toml), "--json", "--no-verify", "--repair")
    assert r.returncode in (0, 1), r.stderr
    with pfs.connect(config=toml) as c:
        for sid in (head, tail):
            _eio_from(c, sid, "/B", 0)
        with pytest.raises(OSError) as ei:
            c.read_file("/B")
        assert ei.value.errno == errno.EIO

"""Files no data server saw (metaserver/handles.py): their unlink sends the data servers
nothing, while a file that may hold objects, however it was written, still has them
deleted. The metaserver runs in-process with fake data servers that record deletions
(``test_meta_server.running``); the clients are raw connections, or the sync client."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import pfs
from pfs.metaserver import handles
from tests.integration.test_meta_server import ROOTC, UNIT, Env, running, trio_test

WRONLY = os.O_CREAT | os.O_EXCL | os.O_WRONLY


async def _create(env: Env, name: bytes, client: Any = None) -> tuple[int, int, int]:
    """(ino, fh, number of objects its layout names) of a new file ``name`` in /."""
    c = client or env.client
    r = (
        await c.call(
            "create", {"parent": 1, "name": name, "mode": 0o644, "flags": WRONLY, "cred": ROOTC}
        )
    ).fields
    return r["attr"]["ino"], r["fh"], sum(len(s) for s in r["layout"]["servers"])


def _deleted(env: Env) -> dict[int, int]:
    """Objects each inode had deletions of asked."""
    out: dict[int, int] = {}
    for d in env.data.values():
        for ino, _stripe in d.deleted:
            out[ino] = out.get(ino, 0) + 1
    return out


async def _unlink(env: Env, *names: bytes) -> None:
    for name in names:
        await env.call("unlink", parent=1, name=name, cred=ROOTC)


async def _until_deleted(env: Env, want: dict[int, int]) -> None:
    """Wait until the deletions of ``want`` were asked; then no other inode's."""
    await env.wait_for(lambda: all(_deleted(env).get(i) == n for i, n in want.items()))
    await trio.sleep(0.6)  # a deleter round more (DELETE_COALESCE 0.25 s)
    assert _deleted(env) == want


@trio_test
async def test_an_unlinked_file_no_data_server_saw_costs_them_nothing(tmp_path: Path) -> None:
    async with running(tmp_path) as env:
        # closed with the client's word: a close of its own, a deferred one (``closes``),
        # and one closed after its unlink (the orphan's reclaim)
        a, fa, _ = await _create(env, b"a")
        await env.call("close", fh=fa, written_end=None, mtime=None, unwritten=[fa])
        b, fb, _ = await _create(env, b"b")
        c, fc, _ = await _create(env, b"c")
        await env.call("getattr", ino=b, closes=[fb], unwritten=[fb])
        await _unlink(env, b"c")
        await env.call("close", fh=fc, written_end=None, mtime=None, unwritten=[fc])
        # made with no handle at all: mknod, create_many (unlinked by unlink_many)
        m = (await env.call("mknod", parent=1, name=b"m", mode=0o100644, cred=ROOTC))["attr"]
        r = await env.call("create_many", paths=[b"/n0", b"/n1"], mode=0o644, cred=ROOTC)
        many = [res[1]["ino"] for res in r["results"]]
        await env.call("unlink_many", paths=[b"/n0", b"/n1"], cred=ROOTC)
        # a file that was written: its deletion is the proof the deleter ran
        w, fw, nw = await _create(env, b"w")
        await env.call("close", fh=fw, written_end=UNIT, mtime=None)
        await _unlink(env, b"a", b"b", b"m", b"w")
        await _until_deleted(env, {w: nw})
        for ino in (a, b, c, m["ino"], *many):
            with pytest.raises(OSError) as ei:
                await env.call("getattr", ino=ino)
            assert ei.value.errno == errno.ENOENT


@trio_test
async def test_a_file_that_may_hold_objects_still_has_them_deleted(tmp_path: Path) -> None:
    async with running(tmp_path) as env:
        want: dict[int, int] = {}
        # closed without the client's word (an older client; or it wrote)
        i, fh, n = await _create(env, b"old")
        await env.call("close", fh=fh, written_end=None, mtime=None)
        want[i] = n
        i, fh, n = await _create(env, b"deferred")
        await env.call("getattr", ino=i, closes=[fh])
        want[i] = n
        # the word for another handle says nothing of this one
        i, fh, n = await _create(env, b"other")
        await env.call("getattr", ino=i, closes=[fh], unwritten=[fh + 1000])
        want[i] = n
        # wrote (a size committed) yet closed saying "unwritten": the size speaks
        i, fh, n = await _create(env, b"sized")
        await env.call("close", fh=fh, written_end=UNIT, mtime=None, unwritten=[fh])
        want[i] = n
        # a killed client: its connection ends with the handle open
        killed = await env.connect()
        i, fh, n = await _create(env, b"killed", killed)
        killed.close()
        want[i] = n
        # a second write capability: an open for writing (here O_TRUNC: a rewrite)
        for flags in (os.O_WRONLY, os.O_RDWR | os.O_TRUNC):
            i, fh, n = await _create(env, b"reopened%d" % flags)
            await env.call("close", fh=fh, written_end=None, mtime=None, unwritten=[fh])
            r = await env.call("open", ino=i, flags=flags, cred=ROOTC)
            await env.call("close", fh=r["fh"], written_end=None, mtime=None, unwritten=[r["fh"]])
            want[i] = n
        # made by mknod, then opened for writing
        i = (await env.call("mknod", parent=1, name=b"node", mode=0o100644, cred=ROOTC))["attr"]
        r = await env.call("open", ino=i["ino"], flags=os.O_WRONLY, cred=ROOTC)
        await env.call("close", fh=r["fh"], written_end=None, mtime=None, unwritten=[r["fh"]])
        want[i["ino"]] = 2  # the test metaserver's layout: 2 stripes, 1 replica
        # truncated by the metaserver on the data servers (extended, then cut)
        i, fh, n = await _create(env, b"cut")
        await env.call("close", fh=fh, written_end=None, mtime=None, unwritten=[fh])
        await env.call("setattr", ino=i, size=3 * UNIT, cred=ROOTC)
        await env.call("setattr", ino=i, size=UNIT, cred=ROOTC)
        want[i] = n
        # unlinked while open, its handle then closed without the word
        i, fh, n = await _create(env, b"orphan")
        await _unlink(env, b"orphan")
        await env.call("close", fh=fh, written_end=None, mtime=None)
        want[i] = n
        names = [
            b"old",
            b"deferred",
            b"other",
            b"sized",
            b"killed",
            b"reopened%d" % os.O_WRONLY,
            b"reopened%d" % (os.O_RDWR | os.O_TRUNC),
            b"cut",
            b"node",
        ]
        await _unlink(env, *names)
        await _until_deleted(env, want)


@trio_test
async def test_unwritten_files_beyond_the_bound_count_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handles, "MAX_UNWRITTEN", 2)
    async with running(tmp_path) as env:
        made = [await _create(env, b"f%d" % k) for k in range(3)]
        for _i, fh, _n in made:
            await env.call("close", fh=fh, written_end=None, mtime=None, unwritten=[fh])
        await _unlink(env, b"f0", b"f1", b"f2")
        await _until_deleted(env, {made[0][0]: made[0][2]})  # the oldest was forgotten


@trio_test
async def test_the_sync_client_says_which_handles_wrote(tmp_path: Path) -> None:
    """End to end: a create closed without writing is released saying so (deferred,
    on the next request); one that sent data does not (its writes fail here: the fake
    data servers take none, but the bytes may have reached one)."""
    async with running(tmp_path) as env:

        def client_side() -> tuple[int, int]:
            with pfs.connect(meta=f"127.0.0.1:{env.port}") as c:
                with c.open("/clean", "xb"):
                    pass
                clean = c.stat("/clean").st_ino
                f = c.open("/tried", "xb")
                tried = c.stat("/tried").st_ino
                for step in (lambda: f.write(b"x" * UNIT), f.close):
                    try:
                        step()
                    except OSError:
                        pass
                c.remove("/clean")
                c.remove("/tried")
                return clean, tried

        clean, tried = await trio.to_thread.run_sync(client_side)
        layout_objects = 2  # the test metaserver's layout: 2 stripes, 1 replica
        await _until_deleted(env, {tried: layout_objects})
        assert clean not in _deleted(env)


# -- real data servers: every way of writing a file still has its objects deleted --------
def _on_disk(cluster_dir: Path, ino: int) -> set[tuple[int, str]]:
    from tests.integration.test_client import _objects_on_disk

    return _objects_on_disk(cluster_dir, ino)


def wait_gone(cluster_dir: Path, ino: int, timeout: float = 20.0) -> None:
    """Wait until no data server holds an object of ``ino`` (the deleter's rounds)."""
    deadline = time.monotonic() + timeout
    while (left := _on_disk(cluster_dir, ino)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"objects of inode {ino} never deleted: {sorted(left)}"


def test_files_written_natively_have_their_objects_deleted(client, workdir, cluster_dir) -> None:
    client.set_layout(workdir, count=4, unit=UNIT)
    inos = []
    with client.open(f"{workdir}/written", "xb") as f:  # the create's own handle wrote
        f.write(os.urandom(3 * UNIT))
    client.write_file(f"{workdir}/rewritten", b"")  # created clean, then O_TRUNC rewritten
    client.write_file(f"{workdir}/rewritten", os.urandom(2 * UNIT))
    # extended (no data server sees that), then written through the same handle
    with client.open(f"{workdir}/extended", "xb") as f:
        f.truncate(4 * UNIT)
        f.seek(UNIT)
        f.write(b"y" * UNIT)
    for name in ("written", "rewritten", "extended"):
        ino = client.stat(f"{workdir}/{name}").st_ino
        assert _on_disk(cluster_dir, ino), name
        inos.append(ino)
        client.remove(f"{workdir}/{name}")
    for ino in inos:
        wait_gone(cluster_dir, ino)


_KILLED = """
import os, signal, sys, time
import pfs
c = pfs.connect(config=sys.argv[1])
f = c.open(sys.argv[2], "xb")
f.write(b"z" * 3 * {unit})
print(c.stat(sys.argv[2]).st_ino, flush=True)
time.sleep(60)  # killed here, the handle open and its size never committed
"""


def test_a_client_killed_after_writing_has_its_objects_deleted(
    client, client_toml, workdir, cluster_dir
) -> None:
    client.set_layout(workdir, count=4, unit=UNIT)
    path = f"{workdir}/killed"
    with subprocess.Popen(
        [sys.executable, "-c", _KILLED.format(unit=UNIT), str(client_toml), path],
        stdout=subprocess.PIPE,
        text=True,
    ) as p:
        try:
            assert p.stdout is not None
            ino = int(p.stdout.readline())
            deadline = time.monotonic() + 20
            while not _on_disk(cluster_dir, ino) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _on_disk(cluster_dir, ino)  # the bytes reached the data servers
        finally:
            p.kill()
    client.remove(path)
    wait_gone(cluster_dir, ino)

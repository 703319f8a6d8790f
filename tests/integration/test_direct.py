"""The sync client's small reads and writes in the calling thread (pfs/client/direct.py)
against the shared real cluster; short-circuit off, so every data server is "remote"."""
from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest

import pfs
from pfs.core.config import ClientConfig, load
from tests.conftest import run_threads

UNIT = 64 * 1024
BLOCK = 4096


def _remote_client(client_toml: Path) -> pfs.Client:
    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit = False
    return pfs.connect(config=cfg)


def _count_hops(c: pfs.Client) -> list[object]:
    """Calls that cross into the client's trio thread, from now on."""
    hops: list[object] = []
    real = c._loop.run
    c._loop.run = lambda fn, *a: hops.append(fn) or real(fn, *a)  # type: ignore[method-assign,func-returns-value]
    return hops


def _object_sizes(cluster_dir: Path, ino: int) -> dict[tuple[int, str], int]:
    """{(stripe, server id): bytes} of the object files of ``ino``."""
    out = {}
    for ddir in (cluster_dir / "data").iterdir():
        sid = (ddir / "server.id").read_text().strip()
        for f in ddir.glob(f"objects/*/{ino}.*[!c]"):
            out[(int(f.name.split(".")[1]), sid)] = f.stat().st_size
    return out


def test_small_requests_go_straight_to_the_servers(client_toml, workdir, cluster_dir) -> None:
    data = os.urandom(4 * UNIT)
    with _remote_client(client_toml) as c:
        c.set_layout(workdir, count=2, unit=UNIT, replicas=2)
        path = f"{workdir}/f"
        with c.open(path, "wb") as f:
            f.write(data[:BLOCK])  # through the loop: it learns the servers' addresses
            hops = _count_hops(c)
            for off in range(BLOCK, len(data), BLOCK):
                assert f.write(data[off:off + BLOCK]) == BLOCK
            assert hops == []  # every write in this thread, to both replicas
            assert f.size == len(data)
        assert c.stat(path).st_size == len(data)
        layout = c.get_layout(path)
        sizes = _object_sizes(cluster_dir, c.stat(path).st_ino)
        assert sizes == {(stripe, sid): 2 * UNIT
                         for stripe, sids in enumerate(layout["servers"]) for sid in sids}
        with c.open(path, "rb") as f:
            rng = random.Random(3)
            for _ in range(200):
                off = rng.randrange(0, len(data))
                n = min(rng.choice([1, 100, BLOCK, 10_000]), UNIT - off % UNIT)
                assert f.pread(n, off) == data[off:off + n]
            assert f.pread(100, len(data) - 10) == data[-10:]
            assert hops == []
            # two stripes: one request each, still in this thread (cheaper than the hop)
            assert f.pread(2 * BLOCK, UNIT - BLOCK) == data[UNIT - BLOCK:UNIT + BLOCK]
            assert hops == []
            assert f.pread(2 * UNIT, 0) == data[:2 * UNIT]
            assert len(hops) == 1  # larger than direct_max: the loop, stripes in parallel


def test_holes_read_as_zeros(client_toml, workdir) -> None:
    with _remote_client(client_toml) as c:
        c.set_layout(workdir, count=2, unit=UNIT)
        path = f"{workdir}/h"
        with c.open(path, "wb") as f:
            f.pwrite(b"x" * 10, 3 * UNIT + 5)  # only stripe 1 has an object
        with c.open(path, "rb") as f:
            hops = _count_hops(c)
            assert f.pread(100, 0) == bytes(100)  # stripe 0: no object at all
            assert f.pread(20, UNIT) == bytes(20)  # stripe 1, before its data
            assert f.pread(20, 3 * UNIT) == bytes(5) + b"x" * 10
            assert hops == []


def test_a_refused_capability_hands_the_write_to_the_loop(client_toml, workdir) -> None:
    """A truncation by another client makes this handle's capability stale: the direct
    write is refused, changes nothing, and the trio path renews and writes it."""
    with _remote_client(client_toml) as c, pfs.connect(config=client_toml) as other:
        c.set_layout(workdir, count=1, unit=UNIT)
        path = f"{workdir}/t"
        f = c.open(path, "w+b")
        f.write(b"a" * BLOCK)
        f.flush()
        other.truncate(path, 0)  # fences the inode's earlier capabilities
        hops = _count_hops(c)
        assert f.pwrite(b"b" * BLOCK, 0) == BLOCK
        assert len(hops) == 1
        f.close()
        assert c.read_file(path) == b"b" * BLOCK


def test_threads_writing_one_handle(client_toml, workdir) -> None:
    """The size a handle commits is the furthest any thread wrote."""
    with _remote_client(client_toml) as c:
        c.set_layout(workdir, count=4, unit=UNIT)
        path = f"{workdir}/m"
        blocks = {i: os.urandom(BLOCK) for i in range(256)}
        with c.open(path, "wb") as f:
            f.write(blocks[0])

            def worker(t: int) -> None:
                for i in range(1 + t, 256, 4):
                    f.pwrite(blocks[i], i * BLOCK)

            assert run_threads(worker, 4) == []
        assert c.read_file(path) == b"".join(blocks[i] for i in range(256))


def test_threads_share_a_bounded_pool_of_connections(client_toml, workdir,
                                                     monkeypatch) -> None:
    """More threads than connections wait for one: no connection (and handshake) per
    request, and never more than MAX_PER_SERVER to a server."""
    import pfs.client.direct as direct_mod

    monkeypatch.setattr(direct_mod, "MAX_PER_SERVER", 2)
    data = os.urandom(4 * UNIT)
    with _remote_client(client_toml) as c:
        c.set_layout(workdir, count=4, unit=UNIT)
        c.write_file(f"{workdir}/p", data)
        direct = c.aio.blocking.data
        assert direct is not None
        opened: list[str] = []
        real_open = direct_mod.open_blocking  # the name direct.py imported

        def counting_open(auth, host, port, **kw):
            opened.append(f"{host}:{port}")
            return real_open(auth, host, port, **kw)

        monkeypatch.setattr(direct_mod, "open_blocking", counting_open)
        with c.open(f"{workdir}/p", "rb") as f:
            f.pread(1, 0)  # the addresses of the servers

            def worker(seed: int) -> None:
                rng = random.Random(seed)
                for _ in range(60):
                    off = rng.randrange(0, len(data) - BLOCK) // BLOCK * BLOCK
                    assert f.pread(BLOCK, off) == data[off:off + BLOCK]

            assert run_threads(worker, 8) == []
        assert len(opened) <= 2 * 4  # two per server, opened once
        assert direct is not None and max(direct._count.values()) <= 2


def test_a_closed_file_refuses_reads_at_its_end(client_toml, workdir) -> None:
    """As the trio path does (ValueError), also where nothing is left to read."""
    with _remote_client(client_toml) as c:
        path = f"{workdir}/c"
        c.write_file(path, b"abc")
        f = c.open(path, "rb")
        assert f.read() == b"abc"
        f.close()
        with pytest.raises(ValueError):
            f.read()
        with pytest.raises(ValueError):
            f.pread(10, 3)
        with pytest.raises(ValueError):
            f.pread(10, 0)


def test_a_flush_racing_writes_loses_no_size(client_toml, workdir) -> None:
    """A write that ends while another thread's flush (commit) waits on the metaserver
    must stay to be committed: the flush clearing the handle's dirty mark after its
    reply made the close commit nothing, and the file ended before those bytes."""
    import threading

    with _remote_client(client_toml) as c:
        c.set_layout(workdir, count=2, unit=UNIT)
        for trial in range(10):
            path = f"{workdir}/r{trial}"
            f = c.open(path, "wb")
            stop = threading.Event()

            def flusher(f=f, stop=stop) -> None:  # type: ignore[no-untyped-def]
                while not stop.is_set():
                    f.flush()

            t = threading.Thread(target=flusher)
            t.start()
            try:
                for i in range(200):
                    f.pwrite(b"z" * 100, i * 100)
            finally:
                stop.set()
                t.join()
            f.close()
            assert c.stat(path).st_size == 200 * 100, f"trial {trial}"


def test_a_file_dropped_unclosed_is_closed_later(client, workdir) -> None:
    """Garbage collection may run inside the client's own locked sections (here: in
    this thread, holding the lock of its direct calls): the collected file must not
    close itself there (that deadlocked), but later, and still commit its size."""
    import gc
    import time

    path = f"{workdir}/dropped"
    f = client.open(path, "wb")
    f.write(b"abc")
    f.cycle = f  # only the cycle collector frees it
    del f
    done = threading.Event()

    def collect() -> None:
        with client._meta_lock:
            gc.collect()
        done.set()

    threading.Thread(target=collect, daemon=True).start()
    assert done.wait(10), "garbage collection deadlocked on the client's lock"
    deadline = time.monotonic() + 10
    while client.stat(path).st_size != 3 and time.monotonic() < deadline:
        time.sleep(0.02)  # the close runs in the client's trio thread, soon
    assert client.read_file(path) == b"abc"


def test_a_close_with_nothing_to_commit_rides_on_the_next_call(client_toml, workdir,
                                                               monkeypatch) -> None:
    """The sync client releases such a handle along with its next metadata request, or
    with a ``release`` of its own when none comes soon: one round trip fewer per
    create or read-only open, and the metaserver still learns the handle is gone."""
    import time

    from pfs.core.wire.blocking import BlockingRpcClient

    sent: list[tuple[str, int]] = []
    real = BlockingRpcClient.send

    def recording(self, msg, **kw):  # type: ignore[no-untyped-def]
        sent.append((msg.method, len(kw.get("closes") or [])))
        return real(self, msg, **kw)

    monkeypatch.setattr(BlockingRpcClient, "send", recording)
    import pfs.client.meta as meta_mod

    monkeypatch.setattr(meta_mod, "CLOSE_DELAY", 2.0)  # no release of its own mid-test
    path = f"{workdir}/d"
    with pfs.connect(config=client_toml) as c, pfs.connect(config=client_toml) as other:
        sent.clear()
        with c.open(path, "xb"):
            pass
        assert [m for m, _ in sent] == ["create"]
        c.stat(path)
        assert sent[-1] == ("resolve", 1)
        with c.open(path, "rb"):
            pass
        with pytest.raises(OSError) as err:  # still open as far as the metaserver knows
            other.set_layout(path, count=1, unit=UNIT)
        assert err.value.errno == errno.EBUSY
        deadline = time.monotonic() + 10
        while ("release", 1) not in sent and time.monotonic() < deadline:
            time.sleep(0.02)  # nothing else to carry it: a release of its own, soon
        assert ("release", 1) in sent
        assert other.set_layout(path, count=1, unit=UNIT)["count"] == 1


def test_closes_carried_by_a_loop_of_creates_need_no_release(client_toml, workdir,
                                                             monkeypatch) -> None:
    """While each create carries the close before it, no deferred close is ever
    CLOSE_DELAY old: the client sends no ``release`` of its own meanwhile (it used to,
    every CLOSE_DELAY: a round trip from its trio thread); the last one still goes
    within about CLOSE_DELAY once the loop stops."""
    import time

    import pfs.client.meta as meta_mod
    from pfs.core.wire.blocking import BlockingRpcClient

    sent: list[tuple[str, int, float]] = []
    real = BlockingRpcClient.send

    def recording(self, msg, **kw):  # type: ignore[no-untyped-def]
        sent.append((msg.method, len(kw.get("closes") or []), time.monotonic()))
        return real(self, msg, **kw)

    monkeypatch.setattr(BlockingRpcClient, "send", recording)
    monkeypatch.setattr(meta_mod, "CLOSE_DELAY", 0.05)
    with pfs.connect(config=client_toml) as c:
        c.mkdir(f"{workdir}/loop")
        sent.clear()
        end = time.monotonic() + 0.6  # a dozen CLOSE_DELAYs
        i = 0
        while time.monotonic() < end:
            with c.open(f"{workdir}/loop/f{i}", "xb"):
                pass
            i += 1
            time.sleep(0.005)
        stopped = time.monotonic()
        assert [m for m, _, _ in sent] == ["create"] * i  # every close rode on a create
        deadline = stopped + 10
        while not any(m == "release" for m, _, _ in sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(m, n) for m, n, _ in sent[i:]] == [("release", 1)]
        c.unlink_many([f"{workdir}/loop/f{k}" for k in range(i)])
        c.rmdir(f"{workdir}/loop")

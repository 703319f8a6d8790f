"""Errors a caller can act on (docs/architecture.md, "Errors"): transient outages are
retried within the client's deadline, refusals say which side failed, bad arguments
are refused where they enter."""
from __future__ import annotations

import errno
import functools
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import pfs
from pfs.core.config import LayoutDefaults, MetaConfig
from pfs.core.wire.rpc import RpcClient
from pfs.metaserver.server import serve_meta
from pfs.tools import cluster
from tests.integration.test_cluster import _kill

pytestmark = pytest.mark.integration
UNIT = 64 * 1024
ROOT = [0, 0, []]


class CutProxy:
    """A TCP proxy on loopback in front of ``target``: it passes bytes through, and
    can drop every connection it carries (``drop``) or cut the next ``n`` new ones
    after their first bytes, in the middle of the authentication handshake
    (``cut_handshakes``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.cut = 0
        self.cuts_done = 0
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                cut = self.cut > 0
                self.cut -= cut
                t = threading.Thread(target=self._serve, args=(c, cut), daemon=True)
                self.threads.append(t)
            t.start()

    def _serve(self, c: socket.socket, cut: bool) -> None:
        with c, socket.create_connection(self.target) as u:
            with self.lock:
                self.conns += [c, u]
            if cut:  # the client's auth request reaches the server, then the line is cut
                u.sendall(c.recv(65536))
                u.recv(65536)  # the server's auth reply is lost
                with self.lock:
                    self.cuts_done += 1
                return
            back = threading.Thread(target=self._pump, args=(u, c), daemon=True)
            back.start()
            self._pump(c, u)
            back.join()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 20):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut_handshakes(self, n: int) -> None:
        with self.lock:
            self.cut = n

    def drop(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.lsock.shutdown(socket.SHUT_RDWR)
        self.lsock.close()
        self.drop()
        for t in self.threads:
            t.join(10)


def _meta_addr(toml: Path) -> tuple[str, int]:
    cfg = pfs.core.config.load(pfs.core.config.ClientConfig, toml)  # type: ignore[attr-defined]
    host, port = cfg.meta.rsplit(":", 1)
    return host, int(port)


@contextmanager
def _proxy(toml: Path) -> Iterator[CutProxy]:
    p = CutProxy(_meta_addr(toml))
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_handshake_cut_during_close_still_commits_the_size(cluster_dir: Path,
                                                             direct: bool) -> None:
    """An acknowledged 1 MiB write, then the metaserver connection drops and the next
    handshakes are cut mid-way: close() retries (ECONNRESET, not EACCES) and commits."""
    toml = cluster_dir / "client.toml"
    data = os.urandom(1 << 20)
    with _proxy(toml) as proxy:
        with pfs.connect(config=toml, meta=f"127.0.0.1:{proxy.port}") as c:
            c.aio.meta.direct = direct
            name = f"/cut-{os.getpid()}-{direct}"
            f = c.open(name, "wb")
            f.write(data)
            proxy.cut_handshakes(2)
            proxy.drop()
            f.close()
            assert proxy.cuts_done == 2
    with pfs.connect(config=toml) as c:
        assert c.stat(name).st_size == len(data)
        assert c.read_file(name) == data


def test_a_create_right_after_a_metaserver_restart_succeeds(
        private_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restarted metaserver knows its data servers from their records and answers
    EAGAIN (retried) until they report again, not ENOSPC."""
    toml = cluster.up(private_cluster, data_servers=2)
    with pfs.connect(config=toml) as c:
        c.write_file("/before", b"x")
    _kill(private_cluster, "meta")
    # back, and a create at once: before the data servers' next heartbeat
    monkeypatch.setattr(cluster, "_wait_registered", lambda toml, n: None)
    cluster.up(private_cluster)
    with pfs.connect(config=toml) as c:
        c.write_file("/after", b"y" * 1000)
        assert c.read_file("/after") == b"y" * 1000


def test_a_metaserver_restart_is_waited_for_within_the_timeout(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=1)
    with pfs.connect(config=toml) as c:
        c.write_file("/m", b"abc")
        _kill(private_cluster, "meta")
        back = threading.Timer(1.0, cluster.up, args=(private_cluster,))
        back.start()
        try:
            assert c.stat("/m").st_size == 3  # retried until it is back
        finally:
            back.join()
        _kill(private_cluster, "meta")
        c.aio.meta.timeout = 1.0
        t0 = time.monotonic()
        with pytest.raises(OSError) as ei:
            c.stat("/m")
        assert ei.value.errno == errno.ETIMEDOUT, ei.value
        assert time.monotonic() - t0 < 10


async def _full_metadata_store(tmp_path: Path) -> None:
    cfg = MetaConfig(db=str(tmp_path / "db"), port=0, map_size=1 << 20,
                     layout=LayoutDefaults(unit=4096, count=1, replicas=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_meta, cfg))
        c = await RpcClient.open(nursery, "127.0.0.1", port)

        async def call(method: str, **fields: Any) -> dict[str, Any]:
            return (await c.call(method, fields)).fields

        await call("register", sid="s0", host="127.0.0.1", port=1, total=1 << 30, free=1 << 29)
        made = []
        with pytest.raises(OSError) as full:
            for i in range(10_000):
                name = b"f%05d" % i
                await call("mknod", parent=1, name=name, mode=0o100644, rdev=0, cred=ROOT)
                made.append(name)
                await call("setxattr", ino=i + 2, name=b"user.pad", value=os.urandom(2000),
                           flags=0, cred=ROOT)
        assert full.value.errno == errno.ENOSPC, full.value  # not EIO
        assert len(made) > 50
        for name in made:  # deletions still run: space can be freed
            await call("unlink", parent=1, name=name, cred=ROOT)
        await call("mkdir", parent=1, name=b"again", mode=0o755, cred=ROOT)
        c.close()
        nursery.cancel_scope.cancel()


def test_a_full_metadata_store_is_enospc_and_unlink_frees_it(tmp_path: Path) -> None:
    trio.run(_full_metadata_store, tmp_path)


def test_bad_sizes_are_refused_where_they_enter(client: Any, workdir: str) -> None:
    p = f"{workdir}/f"
    client.write_file(p, b"x" * 100)
    for size, code in ((-1, errno.EINVAL), (1 << 63, errno.EFBIG)):
        with pytest.raises(OSError) as ei:
            client.truncate(p, size)
        assert ei.value.errno == code and p in str(ei.value), ei.value
        with client.open(p, "r+b") as f, pytest.raises(OSError) as ei:
            f.truncate(size)
        assert ei.value.errno == code, ei.value
    assert client.read_file(p) == b"x" * 100


async def _bad_sizes_at_the_metaserver(tmp_path: Path) -> None:
    """The metaserver refuses them too, before any data server is asked to cut."""
    cfg = MetaConfig(db=str(tmp_path / "db"), port=0, map_size=1 << 24,
                     layout=LayoutDefaults(unit=4096, count=1, replicas=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_meta, cfg))
        c = await RpcClient.open(nursery, "127.0.0.1", port)
        # a data server address nothing listens on: a truncate sent there would fail EIO
        await c.call("register", {"sid": "s0", "host": "127.0.0.1", "port": 1,
                                  "total": 1 << 30, "free": 1 << 29})
        r = (await c.call("create", {"parent": 1, "name": b"f", "mode": 0o644,
                                     "flags": os.O_CREAT | os.O_RDWR, "cred": ROOT})).fields
        ino = r["attr"]["ino"]
        await c.call("close", {"fh": r["fh"], "written_end": 100})
        for size, code in ((-1, errno.EINVAL), (1 << 63, errno.EFBIG)):
            with pytest.raises(OSError) as ei:
                await c.call("setattr", {"ino": ino, "cred": ROOT, "size": size})
            assert ei.value.errno == code, ei.value
        r = (await c.call("open", {"ino": ino, "flags": os.O_RDWR, "cred": ROOT})).fields
        with pytest.raises(OSError) as ei:
            await c.call("commit_size", {"fh": r["fh"], "written_end": 1 << 63})
        assert ei.value.errno == errno.EFBIG, ei.value
        c.close()
        nursery.cancel_scope.cancel()


def test_bad_sizes_are_refused_by_the_metaserver(tmp_path: Path) -> None:
    trio.run(_bad_sizes_at_the_metaserver, tmp_path)


def test_a_wrong_client_key_says_the_clients_key_was_refused(cluster_dir: Path,
                                                            tmp_path: Path) -> None:
    toml = cluster_dir / "client.toml"
    text = toml.read_text()
    cfg = pfs.core.config.load(pfs.core.config.ClientConfig, toml)  # type: ignore[attr-defined]
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(os.urandom(32))
    wrong.chmod(0o600)
    bad = tmp_path / "client.toml"
    bad.write_text(text.replace(cfg.key_file, str(wrong)))
    with pytest.raises(OSError) as ei:
        pfs.connect(config=bad)
    assert ei.value.errno == errno.EACCES
    assert "this client's key" in str(ei.value) and "refused" in str(ei.value), ei.value

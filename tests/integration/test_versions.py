"""Versions on the wire and on disk (pfs/core/versions.py): negotiation, format checks, migrate."""
from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import lmdb
import pytest
import trio

from pfs.core import auth, versions
from pfs.core.config import ClientConfig, load
from pfs.core.errors import ProtocolError, RemoteProtocolError
from pfs.core.messages import meta as M
from pfs.core.versions import LEGACY_RANGE, METADATA_FORMAT, OBJECT_FORMAT, FormatError, negotiate
from pfs.core.wire.connect import open_blocking, open_rpc
from pfs.core.wire.protocol import FrameDecoder, Kind, Peer, encode_frame
from pfs.core.wire.rpc import ConnContext, Request, RpcService
from pfs.core.wire.transport import open_connection
from pfs.dataserver.objects import FORMAT_FILE, ObjectStore, dir_format, migrate_dir
from pfs.metaserver import keys as K
from pfs.metaserver.store import LmdbStore, migrate, store_format
from pfs.tools import cluster

TIMEOUT = 30
PY = [sys.executable]


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TIMEOUT):
            await fn()

    trio.run(main)


# ---------------------------------------------------------------------------
# sans-IO: the rule and the decoder
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("ours,theirs,want", [
    ((1, 1), (1, 1), 1), ((1, 3), (2, 5), 3), ((2, 5), (1, 3), 3), ((1, 4), (4, 9), 4),
    ((1, 2), (3, 4), None), ((3, 4), (1, 2), None)])
def test_negotiation_picks_the_highest_common_version(ours: versions.Range,
                                                      theirs: versions.Range,
                                                      want: int | None) -> None:
    assert negotiate(ours, theirs) == want
    assert negotiate(theirs, ours) == want  # both sides reach the same answer


def test_announced_ranges_are_validated() -> None:
    assert versions.parse_versions([1, 3]) == (1, 3)
    assert versions.parse_versions(1) == LEGACY_RANGE  # a peer from before negotiation
    for bad in (None, [3, 1], [0, 2], [1, 256], "1", [1], [1, 2, 3], [1.0, 2], True):
        assert versions.parse_versions(bad) is None, bad
    assert versions.alpn_names((1, 3)) == ["pfs/3", "pfs/2", "pfs/1"]
    assert [versions.parse_alpn(n) for n in ("pfs/2", None, "h2", "pfs/x")] == [2, None, None,
                                                                                 None]


def test_decoder_accepts_the_range_until_pinned_then_only_the_pinned_version() -> None:
    frames = {v: encode_frame(Kind.REQUEST, v, {"m": "x"}, version=v) for v in (1, 2, 3, 4)}
    peer = Peer()
    peer.decoder = FrameDecoder(supported=(1, 3))
    for v in (1, 2, 3):
        [(head, _)] = peer.receive(frames[v])
        assert head.rid == v
    with pytest.raises(RemoteProtocolError, match=r"version 4 \(this side speaks 1-3\)"):
        peer.receive(frames[4])

    dec = FrameDecoder(supported=(1, 3))
    dec.pin(2)
    assert dec.version == 2
    dec.feed(frames[2])
    assert dec.next_head() is not None
    dec.feed(frames[3])
    with pytest.raises(RemoteProtocolError, match="negotiated version 2"):
        dec.next_head()
    with pytest.raises(ProtocolError):
        FrameDecoder().pin(256)


# ---------------------------------------------------------------------------
# the handshake: two peers in this process, over loopback
# ---------------------------------------------------------------------------
class Echo(RpcService):
    name = "echo"

    async def rpc_ping(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        return {"version": ctx.conn.decoder.version}


@dataclasses.dataclass
class Mode:
    server: auth.ServerAuth
    client: auth.ClientAuth


def key_mode(tmp_path: Path, srv: versions.Range, cli: versions.Range) -> Mode:
    path = tmp_path / "k.key"
    auth.create_key(path)
    key = auth.read_secret_file(path)
    return Mode(auth.ServerAuth({"n": (key, auth.Identity("n", "client"))}, versions=srv),
                auth.ClientAuth("n", key, versions=cli))


def tls_mode(tmp_path: Path, srv: versions.Range, cli: versions.Range) -> Mode:
    from pfs.tools.certs import generate

    d = tmp_path / "certs"
    generate(d, clients=["c"])
    s = auth.server_tls(str(d / "server.pem"), str(d / "server.key"), str(d / "ca.pem"), srv)
    c = auth.client_tls(str(d / "c.pem"), str(d / "c.key"), str(d / "ca.pem"), cli)
    return Mode(auth.ServerAuth(tls=s, versions=srv), auth.ClientAuth(tls=c, versions=cli))


@asynccontextmanager
async def echo_server(mode: Mode) -> AsyncIterator[tuple[int, trio.Nursery]]:
    async with trio.open_nursery() as n:
        port = await n.start(Echo(auth=mode.server).serve, "127.0.0.1", 0)
        yield port, n
        n.cancel_scope.cancel()


@pytest.mark.parametrize("make", [key_mode, tls_mode], ids=["key", "tls"])
@pytest.mark.parametrize("srv,cli,want", [((1, 3), (2, 5), 3), ((2, 5), (1, 3), 3),
                                          ((1, 1), (1, 4), 1), ((1, 2), (1, 2), 2)])
def test_handshake_uses_the_highest_common_version(tmp_path: Path, make: Any,
                                                   srv: versions.Range, cli: versions.Range,
                                                   want: int) -> None:
    mode = make(tmp_path, srv, cli)

    async def main() -> None:
        async with echo_server(mode) as (port, n):
            rpc = await open_rpc(mode.client, n, "127.0.0.1", port)
            assert rpc.conn.decoder.version == want and rpc.conn.decoder.pinned
            assert (await rpc.call("ping")).fields["version"] == want  # the server's side
            rpc.close()
            blocking = await trio.to_thread.run_sync(open_blocking, mode.client, "127.0.0.1",
                                                     port)
            try:
                r = await trio.to_thread.run_sync(blocking.call, "ping", {})
                assert r["version"] == want
            finally:
                blocking.close()

    run(main)


def test_open_mode_uses_version_1() -> None:
    """No handshake, no negotiation (docs/architecture.md, "Versions and upgrades"): an
    open connection's frames carry version 1 both ways, whatever the ranges."""
    mode = Mode(auth.ServerAuth(versions=(1, 3)), auth.ClientAuth(versions=(1, 3)))
    assert mode.server.mode == "open"

    async def main() -> None:
        async with echo_server(mode) as (port, n):
            rpc = await open_rpc(mode.client, n, "127.0.0.1", port)
            assert rpc.conn.decoder.version == versions.HANDSHAKE_VERSION == 1
            assert (await rpc.call("ping")).fields["version"] == 1
            rpc.close()
            blocking = await trio.to_thread.run_sync(open_blocking, mode.client, "127.0.0.1",
                                                     port)
            try:
                assert (await trio.to_thread.run_sync(blocking.call, "ping", {}))["version"] == 1
            finally:
                blocking.close()

    run(main)


@pytest.mark.parametrize("make,srv,cli", [
    (key_mode, (3, 4), (1, 2)), (key_mode, (1, 2), (3, 4)),
    (tls_mode, (1, 2), (3, 4)), (tls_mode, (3, 4), (1, 2))],
    ids=["key-old-client", "key-old-server", "tls-old-server", "tls-old-client"])
def test_a_peer_with_no_common_version_gets_a_clear_error(tmp_path: Path, make: Any,
                                                          srv: versions.Range,
                                                          cli: versions.Range) -> None:
    mode = make(tmp_path, srv, cli)

    async def main() -> None:
        async with echo_server(mode) as (port, n):
            async def trio_call() -> None:
                rpc = await open_rpc(mode.client, n, "127.0.0.1", port)
                await rpc.call("ping")  # TLS, client in range 1: refused at its first call

            def blocking_call() -> None:
                rpc = open_blocking(mode.client, "127.0.0.1", port)
                try:
                    rpc.call("ping")
                finally:
                    rpc.close()

            for attempt in (trio_call(), trio.to_thread.run_sync(blocking_call)):
                with pytest.raises(OSError) as info:
                    await attempt
                err = info.value
                assert err.errno == errno.EPROTO, err
                assert "no protocol version in common" in str(err), err
                if make is key_mode:
                    assert f"127.0.0.1:{port}" in str(err), err
                    assert "speaks 3-4" in str(err) and "1-2" in str(err), err
                elif cli == (3, 4):  # the client learns by ALPN that the server offered none
                    assert f"127.0.0.1:{port}" in str(err) and "speaks 3-4" in str(err), err
                else:  # the server refuses the client's first request, naming its range
                    assert f"this server (127.0.0.1:{port}) speaks 3-4" in str(err), err

    run(main)


def test_peers_from_before_negotiation(tmp_path: Path) -> None:
    """An old client sends ``"v": 1`` and expects no ``"v"`` back; an old server sends
    none: both are taken as speaking version 1. (Such a client offers no wire security
    either, so only a server that allows plain frames, ``wire_security = "none"``, serves
    it; a default one refuses it, saying why.)"""
    mode = key_mode(tmp_path, (1, 3), (1, 3))
    key = mode.client.key
    assert key is not None

    async def main() -> None:
        async with echo_server(mode) as (port, n):
            conn = await open_connection("127.0.0.1", port)
            await conn.send_frame(Kind.REQUEST, 0, {"m": "auth", "v": 1, "key": "n",
                                                    "nonce": os.urandom(auth.NONCE_BYTES)})
            head = await conn.recv_head()
            assert head is not None and head.kind == Kind.ERROR
            assert "wire_security" in head.fields["msg"], head.fields
            conn.close()
        mode.server.wire = "none"
        async with echo_server(mode) as (port, n):
            conn = await open_connection("127.0.0.1", port)
            nc = os.urandom(auth.NONCE_BYTES)
            await conn.send_frame(Kind.REQUEST, 0, {"m": "auth", "v": 1, "key": "n", "nonce": nc})
            head = await conn.recv_head()
            assert head is not None and head.fields["v"] == 1 and "s" not in head.fields
            ns = head.fields["nonce"]
            await conn.send_frame(Kind.REQUEST, 0, {
                "m": "auth_proof", "proof": auth._proof(key, b"client", "n", nc, ns)})
            assert (await conn.recv_head()) is not None
            await conn.send_frame(Kind.REQUEST, 1, {"m": "ping"})
            head = await conn.recv_head()
            assert head is not None and head.fields == {"version": 1}
            conn.close()

    run(main)
    client = auth.ClientAuth("n", key, versions=(2, 3))
    with pytest.raises(auth.VersionError, match=r"server speaks 1 \(it predates"):
        client._key_version({"nonce": b"", "proof": b""}, "old:1")
    assert auth.ClientAuth("n", key, versions=(1, 3))._key_version({}, "old:1") == 1


def test_server_refuses_versions_before_anything_else(tmp_path: Path) -> None:
    mode = key_mode(tmp_path, (2, 2), (1, 1))

    async def main() -> None:
        async with echo_server(mode) as (port, _n):
            conn = await open_connection("127.0.0.1", port)
            await conn.send_frame(Kind.REQUEST, 7, {"m": "auth", "v": 1, "key": "n",
                                                    "nonce": os.urandom(auth.NONCE_BYTES)})
            head = await conn.recv_head()
            assert head is not None and head.kind == Kind.ERROR and head.rid == 7
            assert head.fields["errno"] == errno.EPROTO and head.fields["v"] == [2, 2]
            assert await conn.recv_head() is None  # and the connection is closed
            conn.close()

    run(main)


def test_real_metaserver_negotiates_or_refuses(private_cluster: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=1)
    cfg = load(ClientConfig, toml)
    host, _, port_s = cfg.meta.rpartition(":")
    base = auth.client_auth(key_file=cfg.key_file, key_name=cfg.key_name)

    async def main() -> None:
        async with trio.open_nursery() as n:
            newer = dataclasses.replace(base, versions=(1, versions.PROTOCOL_MAX + 3))
            rpc = await open_rpc(newer, n, host, int(port_s))
            assert rpc.conn.decoder.version == versions.PROTOCOL_MAX
            hello = await rpc.request(M.Hello(client="t"))
            assert hello.root == K.ROOT_INO
            assert hello.version == rpc.conn.decoder.version  # as negotiated
            rpc.close()
            future = (versions.PROTOCOL_MAX + 1, versions.PROTOCOL_MAX + 2)
            with pytest.raises(OSError) as info:
                await open_rpc(dataclasses.replace(base, versions=future), n, host,
                               int(port_s))
            assert info.value.errno == errno.EPROTO
            msg = str(info.value)
            assert cfg.meta in msg and versions.fmt_range(future) in msg
            assert f"server speaks {versions.fmt_range(versions.SUPPORTED)}" in msg

    run(main)


# ---------------------------------------------------------------------------
# formats on disk
# ---------------------------------------------------------------------------
def _set_raw_format(db: Path, value: int | None) -> None:
    """Write ``C format`` (None: remove it, as in a store from before formats)."""
    env = lmdb.open(str(db), subdir=True, max_dbs=0)
    with env.begin(write=True) as txn:
        if value is None:
            txn.delete(K.FORMAT)
        else:
            txn.put(K.FORMAT, K.u64(value))
    env.close()


def _format_of(db: Path) -> int | None:
    s = LmdbStore(db, check_format=False)
    try:
        with s.read() as txn:
            return store_format(txn)
    finally:
        s.close()


def test_stores_record_their_format_and_stamp_unversioned_ones(tmp_path: Path) -> None:
    db = tmp_path / "db"
    LmdbStore(db).close()
    assert _format_of(db) == METADATA_FORMAT  # written at creation
    s = LmdbStore(db)
    with s.write() as txn:
        txn.put(K.inode(K.ROOT_INO), b"old data")
    s.close()
    _set_raw_format(db, None)
    assert _format_of(db) == 0
    LmdbStore(db).close()  # format 0 is format 1 minus the key: stamped on open
    assert _format_of(db) == METADATA_FORMAT
    _set_raw_format(db, METADATA_FORMAT + 1)
    with pytest.raises(FormatError, match=f"pfs admin migrate --db {db}"):
        LmdbStore(db)

    d = str(tmp_path / "data")
    ObjectStore([d]).close()
    assert dir_format(d) == OBJECT_FORMAT
    os.unlink(os.path.join(d, FORMAT_FILE))
    assert dir_format(d) == 0  # objects/ is there: made before formats were recorded
    ObjectStore([d]).close()
    assert dir_format(d) == OBJECT_FORMAT
    Path(d, FORMAT_FILE).write_text("x\n")
    with pytest.raises(FormatError, match="not a format number"):
        ObjectStore([d])
    Path(d, FORMAT_FILE).write_text(f"{OBJECT_FORMAT + 1}\n")
    with pytest.raises(FormatError, match=f"pfs admin migrate --data {d}"):
        ObjectStore([d])
    assert dir_format(str(tmp_path / "new")) is None


def test_migrate_is_idempotent_and_refuses_newer_formats(tmp_path: Path) -> None:
    db, d = tmp_path / "db", str(tmp_path / "data")
    with pytest.raises(OSError, match="no metadata store"):
        migrate(db)
    os.mkdir(d)
    with pytest.raises(OSError, match="no data directory"):
        migrate_dir(d)  # an empty directory: not stamped, it may be a typo
    assert not os.path.exists(os.path.join(d, FORMAT_FILE))
    s = LmdbStore(db)
    with s.write() as txn:
        txn.put(K.inode(K.ROOT_INO), b"old data")
    s.close()
    ObjectStore([d]).close()
    _set_raw_format(db, None)
    os.unlink(os.path.join(d, FORMAT_FILE))
    assert migrate(db) == (0, METADATA_FORMAT)
    assert migrate(db) == (METADATA_FORMAT, METADATA_FORMAT)
    assert migrate_dir(d) == (0, OBJECT_FORMAT)
    assert migrate_dir(d) == (OBJECT_FORMAT, OBJECT_FORMAT)
    _set_raw_format(db, METADATA_FORMAT + 1)
    with pytest.raises(FormatError):
        migrate(db)
    assert _format_of(db) == METADATA_FORMAT + 1  # untouched


def test_a_format_that_needs_more_than_a_stamp_waits_for_migrate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later release's format (simulated: metadata 2, data 3): a server refuses the
    format before naming the command, the command upgrades it (running every step from the format found)."""
    import pfs.dataserver.objects as objects
    import pfs.metaserver.store as store

    db, d = tmp_path / "db", str(tmp_path / "data")
    s = LmdbStore(db)
    with s.write() as txn:
        txn.put(K.inode(K.ROOT_INO), b"old data")
    s.close()
    ObjectStore([d]).close()
    _set_raw_format(db, None)  # format 0: steps 0 -> 1 -> 2
    ran: list[str] = []

    def meta_to_2(txn: Any) -> None:
        ran.append("meta")
        txn.put(K.FORMAT, K.u64(2))

    def data_to_3(path: str) -> None:  # data directories are at 2 already: 2 -> 3
        ran.append("data")
        objects._write_format(path, 3)

    monkeypatch.setattr(store, "METADATA_FORMAT", 2)
    monkeypatch.setitem(store._STEPS, 1, meta_to_2)
    monkeypatch.setattr(objects, "OBJECT_FORMAT", 3)
    monkeypatch.setitem(objects._STEPS, 2, data_to_3)
    with pytest.raises(FormatError, match=f"older than this pfs's 2: stop the server and "
                                          f"run `pfs admin migrate --db {db}`"):
        LmdbStore(db)
    with pytest.raises(FormatError, match=f"run `pfs admin migrate --data {d}`"):
        ObjectStore([d])
    assert _format_of(db) == 0 and dir_format(d) == 2  # nothing half-done at open
    assert migrate(db) == (0, 2) and migrate_dir(d) == (2, 3) and ran == ["meta", "data"]
    LmdbStore(db).close()
    ObjectStore([d]).close()
    monkeypatch.delitem(store._STEPS, 1)  # a pfs that cannot step from 1 to 2
    _set_raw_format(db, 1)
    with pytest.raises(FormatError, match="cannot upgrade to 2"):
        migrate(db)


def _pfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PY, "-m", "pfs.tools.cli", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("server", ["pfs.metaserver", "dataserver"])
def test_server_refuses_a_future_format_naming_the_migrate_command(tmp_path: Path,
                                                                   server: str) -> None:
    if server == "metaserver":
        store = tmp_path / "db"
        LmdbStore(store).close()
        _set_raw_format(store, METADATA_FORMAT + 5)
        argv = ["pfs.metaserver", "--db", str(store), "--port", "0"]
        command = f"pfs admin migrate --db {store}"
    else:
        store = tmp_path / "data"
        store.mkdir()
        (store / FORMAT_FILE).write_text(f"{OBJECT_FORMAT + 5}\n")
        argv = ["pfs.dataserver", "--dir", str(store), "--port", "0", "--meta", ""]
        command = f"pfs admin migrate --data {store}"
    proc = subprocess.run([*PY, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and command in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    # the command it names refuses too (it cannot downgrade), with the same message
    what = "--db" if server == "metaserver" else "--data"
    migrated = _pfs("admin", "migrate", what, str(store))
    assert migrated.returncode == 1 and "EPROTO" in migrated.stderr and command in migrated.stderr


def test_migrate_an_unversioned_cluster_then_it_serves_old_data(private_cluster: Path) -> None:
    import pfs

    toml = cluster.up(private_cluster, data_servers=2)
    data = os.urandom(200_000)
    with pfs.connect(config=toml) as c:
        c.write_file("/old", data)
    cluster.down(private_cluster)
    # make it look like the stores of the pfs before formats were recorded
    db = private_cluster / "meta"
    dirs = sorted(str(p) for p in (private_cluster / "data").iterdir())
    _set_raw_format(db, None)
    for d in dirs:
        os.unlink(os.path.join(d, FORMAT_FILE))
    assert _format_of(db) == 0 and {dir_format(d) for d in dirs} == {0}

    args = ["admin", "migrate", "--db", str(db), *[a for d in dirs for a in ("--data", d)]]
    out = _pfs(*args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(f"format 0 -> {METADATA_FORMAT}") == 1, out.stdout
    assert out.stdout.count(f"format 0 -> {OBJECT_FORMAT}") == 2, out.stdout
    again = _pfs(*args)
    assert again.returncode == 0 and again.stdout.count("nothing to do") == 3, again.stdout
    assert _format_of(db) == METADATA_FORMAT
    assert {dir_format(d) for d in dirs} == {OBJECT_FORMAT}

    toml = cluster.up(private_cluster)
    with pfs.connect(config=toml) as c:
        assert c.read_file("/old") == data


def test_format_1_opens_as_2_and_migrate_computes_checksums(tmp_path: Path) -> None:
    """A format-1 directory (objects without checksums) is stamped 2 at open; its old
    objects read unchecked until ``pfs admin migrate --data`` gives each a sidecar."""
    from pfs.core import checksums as ck

    d = str(tmp_path / "data")
    store = ObjectStore([d])
    fd, release = store.acquire((5, 0), create=True)  # type: ignore[misc]
    os.pwrite(fd, b"old" * 40_000, 0)
    release()
    store.close()
    for p in Path(d, "objects").glob("*/*.crc"):
        p.unlink()  # as format 1 wrote it
    Path(d, FORMAT_FILE).write_text("1\n")
    ObjectStore([d]).close()
    assert dir_format(d) == OBJECT_FORMAT == 2
    assert list(Path(d, "objects").glob("*/*.crc")) == []  # unchecked until migrated
    store = ObjectStore([d])
    got = store.acquire_checked((5, 0))  # a read leaves it unchecked
    assert got is not None and got[1] is None
    got[2]()
    store.close()
    assert list(Path(d, "objects").glob("*/*.crc")) == []
    Path(d, FORMAT_FILE).write_text("1\n")
    assert migrate_dir(d) == (1, 2)
    (side,) = Path(d, "objects").glob("*/*.crc")
    obj = side.with_suffix("")
    ofd, cfd = os.open(obj, os.O_RDONLY), os.open(side, os.O_RDONLY)
    try:
        buf = bytearray(120_000)
        assert ck.read_verified((5, 0), ofd, cfd, 0, [memoryview(buf)]) == [120_000]
        assert buf == b"old" * 40_000
    finally:
        os.close(ofd)
        os.close(cfd)
    assert migrate_dir(d) == (2, 2)
    side.unlink()
    store = ObjectStore([d])
    got = store.acquire_checked((5, 0), create=True)  # a write: hashed whole first
    assert got is not None and got[1] is not None and side.exists()
    got[2]()
    store.close()

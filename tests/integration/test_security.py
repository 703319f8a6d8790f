"""Security: capabilities, authentication, permissions, limits (docs/security.md)."""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import random
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from pfs.client.aio import AsyncClient
from pfs.client.plan import write_request
from pfs.core import auth, caps
from pfs.core.config import (
    ClientConfig,
    ConfigError,
    DataConfig,
    LayoutDefaults,
    MetaConfig,
    NodeKey,
)
from pfs.core.engine import PosixEngine
from pfs.core.wire.connect import open_rpc
from pfs.core.wire.protocol import HEADER, MAGIC, VERSION, Kind, encode_frame
from pfs.core.wire.rpc import ConnContext, Request, RpcClient, RpcService
from pfs.core.wire.transport import open_connection
from pfs.dataserver.objects import ObjectStore
from pfs.dataserver.server import DataService, serve_data
from pfs.metaserver.server import serve_meta
from pfs.tools import cluster

ROOTC = [0, 0, []]
TIMEOUT = 30


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TIMEOUT):
            await fn()

    trio.run(main)


async def expect(code: int, aw: Awaitable[Any]) -> OSError:
    with pytest.raises(OSError) as info:
        await aw
    assert info.value.errno == code, info.value
    return info.value


# ---------------------------------------------------------------------------
# capabilities, against a data server in this process
# ---------------------------------------------------------------------------
@asynccontextmanager
async def cap_server(tmp_path: Path) -> AsyncIterator[tuple[caps.CapSigner, DataService, RpcClient]]:
    signer = caps.CapSigner.generate(ttl=60)
    store = ObjectStore([str(tmp_path / "d")])
    svc = DataService(store, PosixEngine(), verify_caps=True)
    svc.sid = "me"
    async with trio.open_nursery() as n:
        port = await n.start(svc.serve, "127.0.0.1", 0)
        c = await RpcClient.open(n, "127.0.0.1", port)
        try:
            yield signer, svc, c
        finally:
            c.close()
            n.cancel_scope.cancel()
            store.close()


def test_capabilities_are_checked(tmp_path: Path) -> None:
    async def main() -> None:
        async with cap_server(tmp_path) as (signer, svc, c):
            # a client's capability: bound to its identity (an open peer here) and to the
            # file's layout (stripes 0 and 1 on this server)
            mine: dict[str, Any] = {"who": "open", "placement": {0: ["me"], 1: ["me"]}}
            rw, _ = signer.issue(7, caps.READ | caps.WRITE, **mine)
            w = {"obj": [7, 0], "off": 0}
            # not registered yet: no key to check with
            await expect(errno.EACCES, c.call("write", {**w, "cap": rw}, payload=b"x"))
            svc.set_security(signer.public_bytes, 0)
            await c.call("write", {**w, "cap": rw}, payload=b"hello")
            r = await c.call("read", {"obj": [7, 0], "off": 0, "len": 5, "cap": rw})
            assert bytes(r.payload or b"") == b"hello"
            ro, _ = signer.issue(7, caps.READ, **mine)
            other = caps.CapSigner.generate()
            forged, _ = other.issue(7, caps.READ | caps.WRITE, **mine)
            expired, _ = signer.issue(7, caps.READ | caps.WRITE, ttl=-5, **mine)
            tampered = bytearray(rw)
            tampered[3] ^= 1
            wrong_ino, _ = signer.issue(8, caps.READ | caps.WRITE, **mine)
            one_stripe, _ = signer.issue(7, caps.READ | caps.WRITE, who="open",
                                         placement={1: ["me"]})
            for bad, why in ((None, "missing"), (b"junk", "bytes long"), (forged, "signature"),
                             (expired, "expired"), (bytes(tampered), "signature"),
                             (wrong_ino, "not for object"), (one_stripe, "not for object"),
                             (ro, "does not allow"), (rw[:-1], "signature")):
                err = await expect(errno.EACCES, c.call("write", {**w, "cap": bad},
                                                        payload=b"evil"))
                assert why in str(err), (why, err)
            for bad in (forged, expired, wrong_ino, None):
                await expect(errno.EACCES, c.call("read", {"obj": [7, 0], "off": 0, "len": 5,
                                                           "cap": bad}))
            await c.call("read", {"obj": [7, 0], "off": 0, "len": 5, "cap": ro})
            await c.call("stat_obj", {"obj": [7, 0], "cap": ro})
            await c.call("fsync", {"obj": [7, 0], "cap": ro})
            await expect(errno.EACCES, c.call("fsync", {"obj": [7, 0], "cap": wrong_ino}))
            # truncate and delete need the metaserver's admin capability, for this server
            await expect(errno.EACCES, c.call("truncate", {"obj": [7, 0], "size": 0, "cap": rw}))
            await expect(errno.EACCES, c.call("delete", {"objs": [[7, 0]], "cap": rw}))
            elsewhere, _ = signer.issue(7, caps.ADMIN, sid="other")
            await expect(errno.EACCES, c.call("truncate", {"obj": [7, 0], "size": 0,
                                                           "cap": elsewhere}))
            r = await c.call("read", {"obj": [7, 0], "off": 0, "len": 5, "cap": ro})
            assert bytes(r.payload or b"") == b"hello"  # nothing refused changed anything
            # a truncation fences the inode: older capabilities cannot write any more
            admin, _ = signer.issue(7, caps.ADMIN, sid="me")
            await c.call("truncate", {"obj": [7, 0], "size": 2, "cap": admin})
            await expect(errno.ESTALE, c.call("write", {**w, "cap": rw}, payload=b"late"))
            await c.call("read", {"obj": [7, 0], "off": 0, "len": 5, "cap": rw})  # reads ok
            fresh, _ = signer.issue(7, caps.READ | caps.WRITE, **mine)
            await c.call("write", {**w, "cap": fresh}, payload=b"new")
            # so does a deletion (an unlinked file's holder cannot resurrect it)
            admin0, _ = signer.issue(0, caps.ADMIN, sid="me")
            assert (await c.call("delete", {"objs": [[7, 0]], "cap": admin0})).fields == {
                "deleted": 1}
            await expect(errno.ESTALE, c.call("write", {**w, "cap": fresh}, payload=b"zombie"))
            assert (await c.call("stat_obj", {"obj": [7, 0], "cap": fresh})).fields["size"] == 0
            # a re-registration (the server may have restarted) raises the floor
            fresh2, _ = signer.issue(9, caps.READ | caps.WRITE, **mine)
            svc.set_security(signer.public_bytes, signer.next_gen())
            await expect(errno.ESTALE, c.call("write", {"obj": [9, 0], "off": 0, "cap": fresh2},
                                              payload=b"x"))

    run(main)


# ---------------------------------------------------------------------------
# a secured cluster in this process: key mode, node keys, the async client
# ---------------------------------------------------------------------------
class Keys:
    def __init__(self, d: Path) -> None:
        d.mkdir(mode=0o700, exist_ok=True)
        self.cluster, self.full, self.limited = d / "cluster.key", d / "full.key", d / "lim.key"
        for p in (self.cluster, self.full, self.limited):
            auth.create_key(p)

    def client(self, meta: str, name: str = "full", **kw: Any) -> ClientConfig:
        path = {"full": self.full, "lim": self.limited, "cluster": self.cluster}[name]
        return ClientConfig(meta=meta, key_file=str(path), key_name=name, **kw)


@asynccontextmanager
async def secure(tmp_path: Path, servers: int = 2, **meta_kw: Any
                 ) -> AsyncIterator[tuple[str, Keys, list[int]]]:
    keys = Keys(tmp_path / "keys")
    mcfg = MetaConfig(db=str(tmp_path / "db"), port=0, map_size=1 << 28,
                      layout=LayoutDefaults(unit=4096, count=2, replicas=1),
                      key_file=str(keys.cluster),
                      node_keys=[NodeKey("full", str(keys.full), allow_root=True),
                                 NodeKey("lim", str(keys.limited), [1000, 1999], [1000, 1999])],
                      **meta_kw)
    async with trio.open_nursery() as n:
        mport = await n.start(functools.partial(serve_meta, mcfg))
        meta = f"127.0.0.1:{mport}"
        dports = []
        for i in range(servers):
            dcfg = DataConfig(dirs=[str(tmp_path / f"ds{i}")], port=0, meta=meta,
                              heartbeat=0.2, key_file=str(keys.cluster))
            dports.append(await n.start(serve_data, dcfg))
        try:
            yield meta, keys, dports
        finally:
            n.cancel_scope.cancel()


def test_client_renews_capabilities_and_survives_truncation(tmp_path: Path) -> None:
    async def main() -> None:
        async with secure(tmp_path, cap_ttl=0.6) as (meta, keys, _):
            async with AsyncClient.connect(keys.client(meta)) as a, \
                    AsyncClient.connect(keys.client(meta)) as b:
                f = await a.open("/f", "w+b")
                await f.pwrite(b"x" * 20000, 0)
                await f.fsync()  # the metaserver knows the size, so b's truncation cuts
                cap0 = f.cap
                await trio.sleep(0.7)  # expired: renewed before the next request
                assert await f.pread(5, 0) == b"xxxxx"
                assert f.cap != cap0
                await b.truncate("/f", 10)  # fences the inode: f's capability is stale
                stale = f.cap
                await f.pwrite(b"yy", 10)  # renewed on ESTALE, without the caller noticing
                assert f.cap != stale
                sid = f.layout.servers[0][0]
                await expect(errno.ESTALE, a.data.send(sid, write_request(f.ino, 0, 0, stale),
                                                       payload=b"z"))
                await f.close()  # commits a's own written end (20000): the cut stays zeros
                assert await b.read_file("/f") == b"x" * 10 + b"yy" + bytes(20000 - 12)

    run(main)


def test_unauthenticated_and_wrong_key_peers_get_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        async with secure(tmp_path) as (meta, keys, dports):
            mport = int(meta.rsplit(":", 1)[1])
            async with trio.open_nursery() as n:
                for port in (mport, *dports):
                    c = await RpcClient.open(n, "127.0.0.1", port)
                    err = await expect(errno.EACCES, c.call("statfs"))
                    assert "authentication required" in str(err)
                    c.close()
                    bad = tmp_path / "bad.key"
                    auth.create_key(bad)
                    for name in ("full", "nobody"):
                        rogue = auth.client_auth(str(bad), name)
                        with pytest.raises(OSError) as info:
                            await open_rpc(rogue, n, "127.0.0.1", port)
                        assert info.value.errno == errno.EACCES
                # a client key cannot register a rogue data server
                good = auth.client_auth(str(keys.full), "full")
                c = await open_rpc(good, n, "127.0.0.1", mport)
                await expect(errno.EACCES, c.call("register", {
                    "sid": None, "host": "127.0.0.1", "port": 9, "total": 1, "free": 1}))
                # and the cluster key (a data server's) gives no namespace access
                srv = auth.client_auth(str(keys.cluster))
                c2 = await open_rpc(srv, n, "127.0.0.1", mport)
                await expect(errno.EACCES, c2.call("mkdir", {"parent": 1, "name": b"x",
                                                             "mode": 0o755, "cred": ROOTC}))
                # a client that holds a key refuses a server that cannot prove it holds it
                fake = RpcService()
                fport = await n.start(fake.serve, "127.0.0.1", 0)
                with pytest.raises(OSError) as info:
                    await open_rpc(good, n, "127.0.0.1", fport)
                assert info.value.errno == errno.EACCES
                for x in (c, c2):
                    x.close()
                n.cancel_scope.cancel()

    run(main)


def test_permissions_uid_ranges_and_root_squash(tmp_path: Path) -> None:
    async def main() -> None:
        async with secure(tmp_path, root_squash=True) as (meta, keys, _):
            async with trio.open_nursery() as n:
                full = await open_rpc(auth.client_auth(str(keys.full), "full"), n, "127.0.0.1",
                                      int(meta.rsplit(":", 1)[1]))
                lim = await open_rpc(auth.client_auth(str(keys.limited), "lim"),
                                     n, "127.0.0.1", int(meta.rsplit(":", 1)[1]))
                # root is squashed to nobody: cannot write in the root-owned 0755 root dir
                await expect(errno.EACCES, full.call("mkdir", {"parent": 1, "name": b"r",
                                                               "mode": 0o755, "cred": ROOTC}))
                # a non-root uid gets the POSIX answer
                await expect(errno.EACCES, full.call("mkdir", {"parent": 1, "name": b"u",
                                                               "mode": 0o755,
                                                               "cred": [1500, 1500, []]}))
                # the limited key may act as 1000-1999 only
                err = await expect(errno.EPERM, lim.call("getxattr", {
                    "ino": 1, "name": b"user.x", "cred": [3000, 1500, []]}))
                assert "3000" in str(err)
                await expect(errno.EPERM, lim.call("getxattr", {
                    "ino": 1, "name": b"user.x", "cred": [1500, 1500, [0]]}))
                await expect(errno.ENODATA, lim.call("getxattr", {
                    "ino": 1, "name": b"user.x", "cred": [1500, 1500, [1501]]}))
                full.close()
                lim.close()
                n.cancel_scope.cancel()

    run(main)


def test_world_readable_key_file_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "k.key"
    auth.create_key(key)
    assert auth.read_secret_file(key)
    os.chmod(key, 0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {key}"):
        auth.read_secret_file(key)
    import pfs

    with pytest.raises(ConfigError, match="accessible by group or others"):
        pfs.connect(config=ClientConfig(meta="127.0.0.1:1", key_file=str(key), key_name="x"))
    r = subprocess.run([sys.executable, "-m", "pfs.dataserver", "--dir", str(tmp_path / "d"),
                        "--meta", "", "--key-file", str(key)], capture_output=True, timeout=60)
    assert r.returncode != 0 and b"chmod 600" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pfs.metaserver", "--db", str(tmp_path / "m"),
                        "--port", "0", "--key-file", str(key)], capture_output=True, timeout=60)
    assert r.returncode != 0 and b"chmod 600" in r.stderr


def test_mutual_tls_cluster(private_cluster: Path) -> None:
    import pfs

    toml = cluster.up(private_cluster, data_servers=2, tls=True)
    assert (private_cluster / "certs" / "ca.pem").exists()
    assert os.stat(private_cluster / "certs" / "client.key").st_mode & 0o077 == 0
    with pfs.connect(config=toml) as c:
        data = os.urandom(300_000)
        c.write_file("/tls", data)
        assert c.read_file("/tls") == data
    # no certificate: the TLS server sees no handshake and closes the connection, which
    # the client cannot tell from an outage: retried for `timeout`, then ETIMEDOUT
    meta = ClientConfig(meta=pfs.core.config.load(ClientConfig, toml).meta, timeout=1.0)
    with pytest.raises(OSError) as info:
        pfs.connect(config=meta)
    assert info.value.errno in (errno.EACCES, errno.ECONNRESET, errno.EPROTO, errno.ETIMEDOUT)


# ---------------------------------------------------------------------------
# limits and hostile input
# ---------------------------------------------------------------------------
class Slow(RpcService):
    name = "slow"

    async def rpc_sleep(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        await trio.sleep(req.any("s", 0.5))
        return {}

    async def rpc_echo(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        return {"n": len(req.payload or b"")}


async def _raw(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def _closed_by_server(s: trio.SocketStream, within: float) -> bool:
    with trio.move_on_after(within):
        while True:
            try:
                if not await s.receive_some(65536):
                    return True
            except trio.BrokenResourceError:
                return True
    return False


def test_stalls_duplicates_and_unauthenticated_idlers_are_dropped(tmp_path: Path) -> None:
    async def main() -> None:
        svc = Slow()
        svc.frame_timeout = 0.5
        keyed = Slow(auth=auth.ServerAuth(keys={"k": (b"k" * 32, auth.Identity("k", "client"))}))
        keyed.auth_timeout = 0.5
        async with trio.open_nursery() as n:
            port = await n.start(svc.serve, "127.0.0.1", 0)
            kport = await n.start(keyed.serve, "127.0.0.1", 0)
            good = await RpcClient.open(n, "127.0.0.1", port)
            # a header, then nothing
            s1 = await _raw(port)
            await s1.send_all(encode_frame(Kind.REQUEST, 1, {"m": "echo"})[:10])
            # a whole header announcing a payload that never comes
            s2 = await _raw(port)
            await s2.send_all(HEADER.pack(MAGIC, VERSION, 1, 0, 1, 1, 1 << 20) + b"\x80")
            # the same request id twice while the first is in flight
            s3 = await _raw(port)
            await s3.send_all(encode_frame(Kind.REQUEST, 5, {"m": "sleep", "s": 2})
                              + encode_frame(Kind.REQUEST, 5, {"m": "sleep", "s": 2}))
            # connected to a keyed server and silent
            s4 = await _raw(kport)
            t0 = trio.current_time()
            for s in (s1, s2, s3, s4):
                assert await _closed_by_server(s, 5)
            assert trio.current_time() - t0 < 5
            for s in (s1, s2, s3, s4):
                await s.aclose()
            # others were served all along
            assert (await good.call("echo", payload=b"abc")).fields == {"n": 3}
            good.close()
            n.cancel_scope.cancel()

    run(main)


def test_hostile_requests_get_errors_and_the_connection_lives(tmp_path: Path) -> None:
    async def main() -> None:
        store = ObjectStore([str(tmp_path / "d")])
        svc = DataService(store, PosixEngine(), verify_caps=True)
        async with trio.open_nursery() as n:
            port = await n.start(svc.serve, "127.0.0.1", 0)
            c = await RpcClient.open(n, "127.0.0.1", port)
            for method, fields in (("nope", {}), ("read", {"obj": "x"}), ("read", {"obj": [1]}),
                                   ("write", {"obj": [1, 2], "off": -1}),
                                   ("delete", {"objs": 5}), ("read", {"obj": [1, 0], "off": 0,
                                                                       "len": 1 << 40})):
                with pytest.raises(OSError) as info:
                    await c.call(method, fields)
                assert info.value.errno in (errno.ENOSYS, errno.EINVAL, errno.EACCES)
            assert (await c.call("statfs")).fields["objects"] == 0
            c.close()
            n.cancel_scope.cancel()
        store.close()

    run(main)


# ---------------------------------------------------------------------------
# a bounded, seeded fuzz run against live server processes
# ---------------------------------------------------------------------------
FUZZ_ITERATIONS = 300
FUZZ_SEED = 20260


def _mutate(rng: Any, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randrange(1, 4)):
        op = rng.random()
        if op < 0.3 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.5:
            del b[rng.randrange(len(b) + 1):]
        elif op < 0.7:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randrange(1, 16))
        elif op < 0.85 and len(b) >= 26:  # a huge or odd declared length
            off = rng.choice((6, 18))
            width = 4 if off == 6 else 8
            b[off:off + width] = rng.randrange(1 << (8 * width)).to_bytes(width, "big")
        else:
            b[4:6] = struct.pack("!H", rng.randrange(65536))
    return bytes(b)


def _templates(rng: Any) -> list[bytes]:
    name = rng.randbytes(8)
    reqs = [{"m": "hello", "client": "fuzz"}, {"m": "statfs"}, {"m": "servers"},
            {"m": "lookup", "parent": 1, "name": name, "cred": [5000, 5000, []]},
            {"m": "mkdir", "parent": 1, "name": name, "mode": 0o777, "cred": [0, 0, []]},
            {"m": "setattr", "ino": rng.randrange(1, 40), "size": 0, "cred": [0, 0, []]},
            {"m": "unlink", "parent": rng.randrange(1, 40), "name": b"f0", "cred": [0, 0]},
            {"m": "read", "obj": [rng.randrange(40), 0], "off": 0, "len": 1 << 20},
            {"m": "write", "obj": [rng.randrange(40), 0], "off": 0, "cap": rng.randbytes(100)},
            {"m": "delete", "objs": [[i, 0] for i in range(40)]},
            {"m": "register", "sid": "evil", "host": "127.0.0.1", "port": 1, "total": 1,
             "free": 1},
            {"m": rng.randbytes(5).hex(), "x": [1, {"a": None}]}]
    out = []
    for r in reqs:
        payload = rng.randbytes(rng.randrange(0, 64)) if r["m"] == "write" else b""
        out.append(encode_frame(Kind.REQUEST, rng.randrange(1 << 64), r, payload))
    return out


def test_seeded_fuzz_against_live_servers(tmp_path: Path) -> None:
    """Unauthenticated, wrong-key and authenticated (uid 5000 only) peers throw
    generated and mutated frames at a live metaserver and data servers; afterwards every
    server is up, a normal client works and the files written before are unchanged."""
    import pfs

    d = tmp_path / "fz"
    toml = cluster.up(d, data_servers=2)
    # a node key that may only act as uid/gid 5000, for the authenticated fuzzing
    fk = d / "keys" / "fuzz.key"
    auth.create_key(fk)
    mcfg = pfs.core.config.load(MetaConfig, d / "meta.toml")
    mcfg.node_keys.append(NodeKey("fuzz", str(fk), [5000, 5000], [5000, 5000]))
    (d / "meta.toml").write_text(pfs.core.config.dump(mcfg))
    cluster.down(d)
    spec = cluster.load_spec(d)
    assert spec is not None
    # start again, keeping our meta.toml (up rewrites it: start the metaserver by hand)
    mport = cluster._start(d, "meta", ["pfs.metaserver", "--config", str(d / "meta.toml"),
                                       "--port", str(spec.meta_port)])
    meta = f"127.0.0.1:{mport}"
    for i in range(2):
        cluster._start(d, f"data{i}", ["pfs.dataserver", "--key-file", str(d / "keys/cluster.key"),
                                       "--dir", str(d / "data" / f"ds{i}"), "--port", "0",
                                       "--meta", meta])
    cluster._wait_registered(toml, 2)
    try:
        files = {f"/keep/f{i}": os.urandom(10_000 * (i + 1)) for i in range(4)}
        with pfs.connect(config=toml) as c:
            c.mkdir("/keep", 0o755)
            for p, b in files.items():
                c.write_file(p, b)
            ports = [mport] + [int(s["port"]) for s in c._run(c.aio.meta.servers).values()]

        rng = random.Random(FUZZ_SEED)
        fuzz_auth = auth.client_auth(str(fk), "fuzz")
        bad = tmp_path / "bad.key"
        auth.create_key(bad)
        wrong = auth.client_auth(str(bad), "fuzz")

        async def one(port: int, how: float, blob: bytes) -> None:
            conn = await open_connection("127.0.0.1", port)
            try:
                if how < 0.5:  # authenticated, as uid 5000 only
                    await (fuzz_auth if port == mport else fuzz_auth.for_data()).hello(conn)
                elif how < 0.6:  # a wrong key's handshake first
                    with contextlib.suppress(OSError):
                        await wrong.hello(conn)
                await conn.sock.send(blob)
                with trio.move_on_after(0.05):
                    await conn.sock.recv(65536)
            finally:
                conn.close()

        async def fuzz() -> None:
            for _ in range(FUZZ_ITERATIONS):
                port = rng.choice(ports)
                how = rng.random()
                frames = _templates(rng)
                blob = b"".join(_mutate(rng, f) if rng.random() < 0.6 else f
                                for f in rng.sample(frames, rng.randrange(1, 4)))
                if rng.random() < 0.1:
                    blob = rng.randbytes(rng.randrange(1, 300))
                with trio.move_on_after(2):
                    with contextlib.suppress(OSError):
                        await one(port, how, blob)

        trio.run(fuzz)
        logs = "".join((d / "logs" / f"{n}.log").read_text() for n in ("meta", "data0", "data1"))
        assert "not authenticated" in logs and "dropping" in logs  # the fuzz got through
        alive = cluster.running(d)
        assert set(alive) == {"meta", "data0", "data1"}, alive
        with pfs.connect(config=toml) as c:
            for p, b in files.items():
                assert c.read_file(p) == b
            c.write_file("/after", b"still works")
            assert c.read_file("/after") == b"still works"
            assert sorted(c.listdir("/keep")) == sorted(p.rsplit("/", 1)[1] for p in files)
    finally:
        cluster.down(d)


def test_bench_caps_runs(tmp_path: Path) -> None:
    import argparse

    from pfs.bench import caps as bench

    out = bench.run(argparse.Namespace(size=4 << 20, seconds=0.2, rounds=1, concurrency=2,
                                       data_servers=1, dir=str(tmp_path / "b"), keep=False))
    for label in ("1MiB", "4KiB"):
        r = out["reads_per_s"][label]
        assert r["caps_on"] > 0 and r["caps_off"] > 0
    assert 0 < out["check_us"]["cached_us"] < out["check_us"]["first_us"]


# ---------------------------------------------------------------------------
# property-based fuzzing of the sans-IO decoder
# ---------------------------------------------------------------------------
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pfs.core.errors import RemoteProtocolError  # noqa: E402
from pfs.core.wire.protocol import FrameDecoder, Limits  # noqa: E402

_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
                       | st.binary(max_size=40) | st.text(max_size=20),
                       lambda c: st.lists(c, max_size=5)
                       | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=20)
_frames = st.builds(lambda k, rid, f, p: encode_frame(k, rid, f, p), st.sampled_from(list(Kind)),
                    st.integers(0, 2**64 - 1), st.dictionaries(st.text(max_size=10), _values,
                                                                max_size=8),
                    st.binary(max_size=64))


def _drain(data: bytes, chunks: list[int], limits: Limits) -> None:
    """Feed ``data`` in ``chunks``; the decoder may only return heads or raise
    RemoteProtocolError, and never buffers beyond one frame's head."""
    dec = FrameDecoder(limits)
    pos = 0
    sizes = chunks or [len(data)]
    i = 0
    while pos < len(data):
        n = max(1, sizes[i % len(sizes)])
        i += 1
        dec.feed(data[pos:pos + n])
        pos += n
        while True:
            if dec.pending_payload:
                dec.take_payload_into(memoryview(bytearray(dec.pending_payload)))
                if dec.pending_payload:
                    break
            head = dec.next_head()
            if head is None:
                break
            assert isinstance(head.fields, dict) and all(isinstance(k, str) for k in head.fields)
            assert 0 <= head.payload_len <= limits.max_payload
        assert dec.buffered <= 26 + limits.max_map + 1024 + len(data)


_small = Limits(max_map=512, max_payload=256, max_map_fields=8, max_container=16, max_str=64,
                max_bin=64)


@given(st.lists(_frames, min_size=1, max_size=4), st.lists(st.integers(1, 64), max_size=6),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
       st.integers(0, 10**6))
def test_decoder_survives_mutated_frames(frames: list[bytes], chunks: list[int],
                                         flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(b"".join(frames))
    for pos, val in flips:
        data[pos % len(data)] = val
    data = data[:max(1, cut % (len(data) + 1))]
    try:
        _drain(bytes(data), chunks, _small)
    except RemoteProtocolError:
        pass


@given(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1), st.integers(0, 255))
def test_decoder_refuses_huge_lengths_before_allocating(map_len: int, payload_len: int,
                                                        kind: int) -> None:
    head = HEADER.pack(MAGIC, VERSION, kind, 0, map_len, 1, payload_len)
    dec = FrameDecoder(_small)
    dec.feed(head)
    try:
        got = dec.next_head()
    except RemoteProtocolError:
        return
    # accepted only when every length is within the limits (then it waits for the map)
    assert got is None and map_len <= _small.max_map and payload_len <= _small.max_payload
    assert kind in (1, 2, 3)

"""The data server's KV block store over real loopback sockets, through
``pfs.kvcache.remote.KvServerClient``: put/get, misses, bad input, restarts, namespace
restriction, and file writes taking back the KV store's space on a full disk."""
from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import pfs
from pfs.core import auth
from pfs.core.config import ClientConfig, DataConfig, load
from pfs.core.engine import PosixEngine
from pfs.core.wire.rpc import RpcClient
from pfs.dataserver import kvslab
from pfs.dataserver.kvstore import KvStore
from pfs.dataserver.objects import ObjectStore
from pfs.dataserver.server import DataService, serve_data
from pfs.kvcache.remote import KvServerClient
from pfs.tools import cluster
from tests.metrics_scrape import free_port, scrape, value

TIMEOUT = 60
NS = "model-a"


def run(fn: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        with trio.fail_after(TIMEOUT):
            await fn()

    trio.run(main)


def config(dirs: list[Path], budget: int = 8 << 20, **kw: object) -> DataConfig:
    return DataConfig(dirs=[str(d) for d in dirs], host="127.0.0.1", port=0, meta="",
                      kv_budget=budget, **kw)  # type: ignore[arg-type]


@asynccontextmanager
async def kv_server(cfg: DataConfig, creds: auth.ClientAuth | None = None
                    ) -> AsyncIterator[KvServerClient]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_data, cfg)
        async with KvServerClient.connect("127.0.0.1", port, creds) as kv:
            yield kv
        nursery.cancel_scope.cancel()


def test_put_get_exists_remove_stats(tmp_path: Path) -> None:
    rng = random.Random(1)
    blocks = {rng.randbytes(32): rng.randbytes(rng.choice([1, 4096, 16 << 10, 300_000,
                                                            2 << 20]))
              for _ in range(12)}

    async def main() -> None:
        async with kv_server(config([tmp_path / "d0"])) as kv:
            for k, v in blocks.items():
                assert await kv.put(NS, k, v) == len(v)
            out = bytearray(4 << 20)
            for k, v in blocks.items():
                n = await kv.get_into(NS, k, memoryview(out))
                assert n == len(v) and out[:n] == v
            keys = list(blocks)
            assert await kv.exists(NS, [keys[0], b"nope", keys[1]]) == [True, False, True]
            assert await kv.exists("model-b", keys[:1]) == [False]  # namespaces apart
            assert await kv.get_into("model-b", keys[0], memoryview(out)) is None
            assert await kv.remove(NS, [keys[0], b"nope"]) == 1
            assert await kv.get_into(NS, keys[0], memoryview(out)) is None
            st = await kv.stats()
            assert st["budget"] == 8 << 20 and st["blocks"] == len(blocks) - 1
            assert st["hits"] == len(blocks) and st["misses"] == 2
            assert st["puts"] == len(blocks) and 0 < st["used"] <= 8 << 20

    run(main)


def test_bad_input_errors(tmp_path: Path) -> None:
    async def main() -> None:
        async with kv_server(config([tmp_path / "d0"])) as kv:
            out = memoryview(bytearray(16))
            for ns, key, code in (("", b"k", errno.EINVAL), ("a b", b"k", errno.EINVAL),
                                  ("x" * 129, b"k", errno.EINVAL), (NS, b"", errno.EINVAL),
                                  (NS, b"k" * 257, errno.EINVAL)):
                with pytest.raises(OSError) as e:
                    await kv.put(ns, key, b"v")
                assert e.value.errno == code
                with pytest.raises(OSError) as e:
                    await kv.get_into(ns, key, out)
                assert e.value.errno == code
            with pytest.raises(OSError) as e:
                await kv.put(NS, b"k", b"")
            assert e.value.errno == errno.EINVAL
            with pytest.raises(OSError) as e:
                await kv.put(NS, b"k", bytes((64 << 20) + 1))
            assert e.value.errno == errno.EMSGSIZE
            await kv.put(NS, b"k", b"0123456789abcdefXYZ")
            with pytest.raises(OSError) as e:  # the buffer is too small for the value
                await kv.get_into(NS, b"k", out)
            assert e.value.errno == errno.ERANGE and "19 bytes" in str(e.value)
            with pytest.raises(OSError) as e:
                await kv.get_into(NS, b"k", memoryview(bytearray(0)))
            assert e.value.errno == errno.EINVAL
            with pytest.raises(OSError) as e:  # not contiguous
                await kv.get_into(NS, b"k", memoryview(bytearray(64))[::2])
            assert e.value.errno == errno.EINVAL
            with pytest.raises(OSError) as e:
                await kv.get_into(NS, b"k", memoryview(bytes(64)))  # read-only
            assert e.value.errno == errno.EINVAL

    run(main)


def test_server_checks_the_crc_on_put(tmp_path: Path) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_data, config([tmp_path / "d0"]))
            c = await RpcClient.open(nursery, "127.0.0.1", port)
            with pytest.raises(OSError) as e:
                await c.call("kv_put", {"ns": NS, "key": b"k", "crc": 12345},
                             payload=b"value")
            assert e.value.errno == errno.EIO and "not stored" in str(e.value)
            r = await c.call("kv_exists", {"ns": NS, "keys": [b"k"]})
            assert r.fields["present"] == [False]
            c.close()
            nursery.cancel_scope.cancel()

    run(main)


def test_no_budget_answers_eopnotsupp(tmp_path: Path) -> None:
    async def main() -> None:
        async with kv_server(config([tmp_path / "d0"], budget=0)) as kv:
            with pytest.raises(OSError) as e:
                await kv.put(NS, b"k", b"v")
            assert e.value.errno == errno.EOPNOTSUPP
            assert await kv.get_into(NS, b"k", memoryview(bytearray(4))) is None
            assert (await kv.stats())["budget"] == 0

    run(main)


def test_restart_rebuilds_the_index(tmp_path: Path) -> None:
    rng = random.Random(2)
    blocks = {rng.randbytes(16): rng.randbytes(rng.randrange(1, 200_000)) for _ in range(40)}
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    gone = list(blocks)[:5]

    async def main() -> None:
        async with kv_server(config(dirs)) as kv:
            for k, v in blocks.items():
                await kv.put(NS, k, v, pin=k[0] < 40)
            await kv.remove(NS, gone)
        # a torn tail: half a record appended to the newest slab
        slabs = sorted((p for d in dirs for p in (d / kvslab.KV_DIR).glob("*.slab")),
                       key=lambda p: p.name)
        newest = slabs[-1]
        size = newest.stat().st_size
        head = kvslab.pack_head(NS.encode(), b"torn", 1000, 1 << 40, 0, 0)
        with newest.open("ab") as f:
            f.write(head + bytes(10))
        async with kv_server(config(dirs)) as kv:
            out = bytearray(200_000)
            for k, v in blocks.items():
                n = await kv.get_into(NS, k, memoryview(out))
                if k in gone:
                    assert n is None
                else:
                    assert n == len(v) and out[:n] == v
            assert await kv.exists(NS, [b"torn"]) == [False]
            assert (await kv.stats())["blocks"] == len(blocks) - len(gone)
        assert newest.stat().st_size == size  # the torn tail was cut off

    run(main)


def test_corrupt_record_is_a_miss(tmp_path: Path) -> None:
    async def main() -> None:
        async with kv_server(config([tmp_path / "d0"])) as kv:
            await kv.put(NS, b"a", b"A" * 5000)
            await kv.put(NS, b"b", b"B" * 5000)
        (slab,) = (tmp_path / "d0" / kvslab.KV_DIR).glob("*.slab")
        data = bytearray(slab.read_bytes())
        at = data.index(b"A" * 100)
        data[at + 10] ^= 0xFF  # rot inside a's value
        slab.write_bytes(bytes(data))
        async with kv_server(config([tmp_path / "d0"])) as kv:
            out = memoryview(bytearray(5000))
            assert await kv.get_into(NS, b"a", out) is None
            assert await kv.get_into(NS, b"b", out) == 5000 and bytes(out) == b"B" * 5000
            st = await kv.stats()
            assert st["corrupt"] == 1 and st["blocks"] == 1

    run(main)


def test_eviction_under_a_small_budget_keeps_hot_and_pinned(tmp_path: Path) -> None:
    rng = random.Random(3)
    budget = 2 << 20

    async def main() -> None:
        async with kv_server(config([tmp_path / "d0"], budget=budget)) as kv:
            pinned = {b"pin%d" % i: rng.randbytes(20_000) for i in range(4)}
            hot = {b"hot%d" % i: rng.randbytes(20_000) for i in range(4)}
            for k, v in pinned.items():
                await kv.put(NS, k, v, pin=True)
            for k, v in hot.items():
                await kv.put(NS, k, v)
            out = memoryview(bytearray(64 << 10))
            cold: dict[bytes, bytes] = {}
            for i in range(600):  # ~30 budgets of cold blocks
                k, v = b"cold%d" % i, rng.randbytes(rng.randrange(1000, 64 << 10))
                cold[k] = v
                await kv.put(NS, k, v)
                if i % 8 == 0:
                    for hk, hv in hot.items():  # keep reading the hot ones
                        assert await kv.get_into(NS, hk, out) == len(hv)
                        assert bytes(out[:len(hv)]) == hv
            st = await kv.stats()
            assert st["used"] <= budget and st["evictions"] > 0
            for k, v in (pinned | hot).items():
                assert await kv.get_into(NS, k, out) == len(v)
                assert bytes(out[:len(v)]) == v
            for k, v in cold.items():  # a miss or the right bytes, nothing else
                n = await kv.get_into(NS, k, out)
                assert n is None or bytes(out[:n]) == v

    run(main)


def test_restricted_namespace_needs_a_listed_node_key(tmp_path: Path) -> None:
    cluster_key, key_a, key_b = os.urandom(32), os.urandom(32), os.urandom(32)
    server_auth = auth.ServerAuth(keys={
        auth.CLUSTER: (cluster_key, auth.Identity(auth.CLUSTER, "server")),
        "node-a": (key_a, auth.Identity("node-a", "client")),
        "node-b": (key_b, auth.Identity("node-b", "client"))})
    store = ObjectStore([str(tmp_path / "d0")])
    engine = PosixEngine()
    kvs = KvStore(store.dirs, 1 << 20)
    service = DataService(store, engine, auth=server_auth, kv=kvs,
                          kv_namespaces={"secret": {"node-a"}})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(service.serve, "127.0.0.1", 0)
            creds = {name: auth.ClientAuth(name=name, key=key) for name, key in
                     (("node-a", key_a), ("node-b", key_b), (auth.CLUSTER, cluster_key))}
            out = memoryview(bytearray(8))
            async with KvServerClient.connect("127.0.0.1", port, creds["node-a"]) as kv:
                await kv.put("secret", b"k", b"v")
                assert await kv.get_into("secret", b"k", out) == 1
            async with KvServerClient.connect("127.0.0.1", port, creds["node-b"]) as kv:
                await kv.put("public", b"k", b"v")  # an unlisted namespace: anyone
                for call in (kv.put("secret", b"k", b"w"),
                             kv.get_into("secret", b"k", out),
                             kv.exists("secret", [b"k"]), kv.remove("secret", [b"k"])):
                    with pytest.raises(OSError) as e:
                        await call
                    assert e.value.errno == errno.EACCES and "node-b" in str(e.value)
            async with KvServerClient.connect("127.0.0.1", port,
                                              creds[auth.CLUSTER]) as kv:
                assert await kv.exists("secret", [b"k"]) == [True]
            nursery.cancel_scope.cancel()

    try:
        run(main)
    finally:
        kvs.close()
        engine.close()
        store.close()


def test_file_write_takes_back_kv_space_on_a_full_disk(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("needs to mount a small tmpfs (root)")
    try:
        async def main() -> None:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_data, config([mnt], budget=6 << 20))
                c = await RpcClient.open(nursery, "127.0.0.1", port)
                async with KvServerClient.connect("127.0.0.1", port) as kv:
                    for i in range(12):
                        await kv.put(NS, b"b%d" % i, os.urandom(256 << 10))
                    used = (await kv.stats())["used"]
                    assert used > 2 << 20
                    data = os.urandom(1 << 20)
                    for i in range(6):  # more file data than the disk has left
                        r = await c.call("write", {"obj": [1, i], "off": 0}, payload=data)
                        assert r.fields["n"] == len(data)
                    assert (await kv.stats())["used"] < used
                    out = memoryview(bytearray(256 << 10))
                    for i in range(12):  # misses or the right bytes
                        await kv.get_into(NS, b"b%d" % i, out)
                c.close()
                nursery.cancel_scope.cancel()

        run(main)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_cluster_shows_kv_capacity_and_a_killed_server_keeps_its_blocks(
        private_cluster: Path) -> None:
    """Real processes: the metaserver lists each server's KV budget and use (``pfs df``,
    ``pfs admin status``), blocks put with a node key come back, and a data server killed
    with SIGKILL still holds them after its restart (the index rebuilt from its slabs)."""
    args = ["--heartbeat", "0.2", "--kv-budget", str(64 << 20)]
    toml = cluster.up(private_cluster, data_servers=2, data_args=args)
    cfg = load(ClientConfig, toml)
    creds = auth.client_auth(cfg.key_file, cfg.key_name, wire=cfg.wire_security)
    blocks = {b"key%d" % i: os.urandom(100_000 + i) for i in range(20)}

    def servers() -> dict[str, dict[str, Any]]:
        with pfs.connect(config=toml) as c:
            out: dict[str, dict[str, Any]] = c._run(c.aio.meta.servers)
            return out

    async def put_all(addrs: list[tuple[str, int]]) -> None:
        for host, port in addrs:
            async with KvServerClient.connect(host, port, creds) as kv:
                for k, v in blocks.items():
                    await kv.put(NS, k, v)
                assert kv.local is False  # no server id given: TCP

    async def local_reads(sids: list[str]) -> None:
        out = memoryview(bytearray(200_000))
        for sid in sids:  # on this host: through the server's local socket
            s = found[sid]
            async with KvServerClient.connect(s["host"], s["port"], creds, sid=sid) as kv:
                for k, v in blocks.items():
                    assert await kv.get_into(NS, k, out) == len(v)
                    assert bytes(out[:len(v)]) == v
                assert kv.local is True
            async with KvServerClient.connect(s["host"], s["port"], creds,
                                              sid="nosuchserver") as kv:
                assert await kv.exists(NS, [b"key0"]) == [True]
                assert kv.local is False  # no such socket: TCP

    async def check_all(addrs: list[tuple[str, int]]) -> None:
        out = memoryview(bytearray(200_000))
        for host, port in addrs:
            async with KvServerClient.connect(host, port, creds) as kv:
                for k, v in blocks.items():
                    assert await kv.get_into(NS, k, out) == len(v)
                    assert bytes(out[:len(v)]) == v

    found = servers()
    assert all(s["kv"]["budget"] == 64 << 20 for s in found.values()), found
    addrs = [(s["host"], s["port"]) for s in found.values()]
    run(lambda: put_all(addrs))
    deadline = time.monotonic() + 20
    while True:
        found = servers()
        if all(s["kv"]["blocks"] == len(blocks) for s in found.values()):
            break
        assert time.monotonic() < deadline, found
        time.sleep(0.1)
    assert all(s["kv"]["used"] > 2_000_000 for s in found.values())
    run(lambda: local_reads(list(found)))
    env = {**os.environ, "PFS_CONFIG": str(toml)}
    df = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "df"], env=env,
                        capture_output=True, timeout=120)
    assert df.returncode == 0 and df.stdout.decode().count("kv cache") == 2, df
    pid = cluster.running(private_cluster)["data0"]
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    cluster.up(private_cluster, data_args=args)
    before = set(addrs)
    while True:  # the restarted server registers anew, on another port
        found = servers()
        addrs = [(s["host"], s["port"]) for s in found.values() if s["state"] == "up"]
        if len(addrs) == 2 and set(addrs) != before:
            break
        assert time.monotonic() < deadline + 30, found
        time.sleep(0.1)
    run(lambda: check_all(addrs))
    status = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "admin", "status"],
                            env=env, capture_output=True, timeout=120)
    assert status.returncode == 0 and "kv cache" in status.stdout.decode(), status
    # the kv report rode on every heartbeat: none refused (each refusal re-registers,
    # which makes every capability stale)
    logs = "".join(p.read_text() for p in (private_cluster / "logs").glob("data*"))
    assert logs and "retrying (serving data meanwhile)" not in logs


def test_metrics_count_kv_hits_misses_and_bytes(private_cluster: Path) -> None:
    port = free_port()
    toml = cluster.up(private_cluster, data_servers=1,
                      data_args=["--metrics-port", str(port), "--kv-budget", str(16 << 20)])
    cfg = load(ClientConfig, toml)
    creds = auth.client_auth(cfg.key_file, cfg.key_name, wire=cfg.wire_security)
    with pfs.connect(config=toml) as c:
        (srv,) = c._run(c.aio.meta.servers).values()

    async def main() -> None:
        async with KvServerClient.connect(srv["host"], srv["port"], creds) as kv:
            await kv.put(NS, b"k", b"v" * 1000)
            out = memoryview(bytearray(1000))
            assert await kv.get_into(NS, b"k", out) == 1000
            assert await kv.get_into(NS, b"absent", out) is None

    run(main)
    text = scrape(port)
    assert value(text, "pfs_kv_events", event="hits") == 1
    assert value(text, "pfs_kv_events", event="misses") == 1
    assert value(text, "pfs_kv_events", event="bytes_out") == 1000
    assert value(text, "pfs_kv_bytes", kind="budget") == 16 << 20
    assert value(text, "pfs_kv_bytes", kind="used") > 1000


def test_many_clients_on_overlapping_keys_get_right_bytes_or_misses(tmp_path: Path) -> None:
    rng = random.Random(5)
    values = {b"k%d" % i: rng.randbytes(rng.choice([100, 16 << 10, 100_000, 300_000]))
              for i in range(60)}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_data, config([tmp_path / "d0"], budget=3 << 20))

            async def client(seed: int) -> None:
                r = random.Random(seed)
                out = memoryview(bytearray(300_000))
                async with KvServerClient.connect("127.0.0.1", port, connections=2) as kv:
                    for _ in range(150):
                        k = r.choice(list(values))
                        if r.random() < 0.4:
                            await kv.put(NS, k, values[k])
                        else:
                            n = await kv.get_into(NS, k, out)
                            assert n is None or bytes(out[:n]) == values[k]

            async with trio.open_nursery() as clients:
                for s in range(6):
                    clients.start_soon(client, s)
            async with KvServerClient.connect("127.0.0.1", port) as kv:
                st = await kv.stats()
                assert st["used"] <= 3 << 20 and st["evictions"] > 0 and st["corrupt"] == 0
            nursery.cancel_scope.cancel()

    run(main)

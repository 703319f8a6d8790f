"""The KV-cache client against real data servers: many processes sharing one node tier
and the servers' block stores, prefix chains, servers killed, restarted, added and
removed, and the operator's view."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pfs.kvcache import KVCache
from pfs.tools import cluster

NS = "it-model:tp2"


def value_of(key: bytes, size: int) -> bytes:
    """The one value of a key: every byte checkable by any process."""
    seed = hashlib.blake2b(key, digest_size=32).digest()
    out = bytearray()
    while len(out) < size:
        seed = hashlib.blake2b(seed, digest_size=64).digest()
        out += seed
    return bytes(out[:size])


WORKER = r"""
import hashlib, json, sys, time
from pfs.kvcache import KVCache
toml, tier, rank, nkeys = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def value_of(key, size):
    seed = hashlib.blake2b(key, digest_size=32).digest()
    out = bytearray()
    while len(out) < size:
        seed = hashlib.blake2b(seed, digest_size=64).digest()
        out += seed
    return bytes(out[:size])
keys = [b"shared-%d" % i for i in range(nkeys)]
size = lambda i: 1000 + 997 * i
bad = []
with KVCache(toml, "it-model:tp2", node_dir=tier, node_tier_bytes=64 << 20) as kv:
    for i, k in enumerate(keys):
        if (i + rank) % 3 != 0:  # overlapping: each key put by two of the three
            kv.put(k, value_of(k, size(i)), sync=(i % 2 == 0))
    kv.flush()
    deadline = time.monotonic() + 60
    todo = set(range(nkeys))
    while todo and time.monotonic() < deadline:
        for i in sorted(todo):
            out = bytearray(size(i))
            if kv.get(keys[i], out):
                if out != value_of(keys[i], size(i)):
                    bad.append(i)
                todo.discard(i)
        time.sleep(0.05)
    print(json.dumps({"bad": bad, "missing": sorted(todo), "stats": kv.stats()}))
"""


def test_many_processes_share_blocks_every_byte_checked(client_toml: Path,
                                                        tmp_path: Path) -> None:
    tier = str(tmp_path / "tier")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(client_toml), tier, str(r),
                               "60"], stdout=subprocess.PIPE, text=True) for r in range(3)]
    results = []
    for p in procs:
        text, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        results.append(json.loads(text.strip().splitlines()[-1]))
    for r in results:
        assert r["bad"] == [] and r["missing"] == []
    # the processes shared one node tier: most gets were served from it
    assert sum(r["stats"]["node_hits"] for r in results) > 60
    # and the homes hold every block (a node with an empty tier reads them all)
    with KVCache(client_toml, NS, node_tier_bytes=0) as kv:
        for i in range(60):
            k = b"shared-%d" % i
            out = bytearray(1000 + 997 * i)
            assert kv.get(k, out) and out == value_of(k, len(out))
        kv.remove([b"shared-%d" % i for i in range(60)])


def test_exists_over_a_chain_with_holes(client_toml: Path, tmp_path: Path) -> None:
    chain = [hashlib.sha256(b"prefix-%d" % i).digest() for i in range(12)]
    with KVCache(client_toml, NS, node_dir=str(tmp_path / "a"), node_tier_bytes=8 << 20) as a, \
            KVCache(client_toml, NS, node_dir=str(tmp_path / "b"),
                    node_tier_bytes=8 << 20) as b:
        for i, k in enumerate(chain):
            if i != 5:
                a.put(k, value_of(k, 4096))
        assert a.exists(chain) == 5
        assert b.exists(chain) == 5  # another node: its tier is empty, the homes answer
        assert b.exists(chain[6:]) == 6
        b.put(chain[5], value_of(chain[5], 4096))
        assert a.exists(chain) == 12
        outs = [bytearray(4096) for _ in chain]
        assert b.get_batch(chain, outs) == [True] * 12
        assert all(o == value_of(k, 4096) for o, k in zip(outs, chain, strict=True))
        assert a.remove(chain) == 12
        assert a.exists(chain) == 0
        # b's gets filled b's tier (read-through): b keeps its copies (the same bytes)
        assert b.exists(chain) == 12
        b.node.clear()  # type: ignore[union-attr]
        assert b.exists(chain) == 0
        # namespaces never mix
        with KVCache(client_toml, "other-model", node_tier_bytes=0) as c:
            a.put(chain[0], b"x" * 100)
            assert c.exists(chain[:1]) == 0
            assert not c.get(chain[0], bytearray(100))


def test_bad_input_errors_from_a_real_cluster(client_toml: Path, tmp_path: Path) -> None:
    with KVCache(client_toml, NS, node_dir=str(tmp_path / "t")) as kv:
        with pytest.raises(OSError) as e:
            kv.put(b"", b"v")
        assert e.value.errno == errno.EINVAL
        kv.put(b"k-bad", b"v" * 100)
        with pytest.raises(OSError) as e:
            kv.get(b"k-bad", bytearray(10))
        assert e.value.errno == errno.ERANGE
        kv.node.clear()  # type: ignore[union-attr]
        with pytest.raises(OSError) as e:  # the server's answer: the same error
            kv.get(b"k-bad", bytearray(10))
        assert e.value.errno == errno.ERANGE
    with pytest.raises(OSError) as e:
        KVCache(client_toml, "no/slash")
    assert e.value.errno == errno.EINVAL


def _pid_of(d: Path, sid: str) -> tuple[str, int]:
    for name, pid in cluster.running(d).items():
        idf = d / "data" / f"ds{name[4:]}" / "server.id"
        if name.startswith("data") and idf.exists() and idf.read_text().strip() == sid:
            return name, pid
    raise AssertionError(f"no process serves {sid}")


def test_server_killed_restarted_added_removed(private_cluster: Path, tmp_path: Path) -> None:
    toml = cluster.up(private_cluster, data_servers=3)
    keys = [b"blk-%d" % i for i in range(60)]
    with KVCache(toml, NS, node_tier_bytes=0, refresh=0.5) as kv:
        for k in keys:
            kv.put(k, value_of(k, 2048))
        before = {k: kv.aio.pool.homes.homes(NS, k)[0] for k in keys}
        victim = before[keys[0]]
        _name, pid = _pid_of(private_cluster, victim)
        os.kill(pid, signal.SIGKILL)
        lost = [k for k in keys if before[k] == victim]
        out = bytearray(2048)
        for k in lost:  # misses, never errors or wrong bytes
            assert not kv.get(k, out)
        for k in keys:
            if before[k] != victim:
                assert kv.get(k, out) and out == value_of(k, 2048)  # the rest kept homes
        for k in lost:
            kv.put(k, value_of(k, 2048))  # refilled at the next home
            assert kv.get(k, out) and out == value_of(k, 2048)
        cluster.up(private_cluster)  # the server comes back (another port), index rebuilt
        deadline = time.monotonic() + 30
        while victim not in kv.aio.pool.homes and time.monotonic() < deadline:
            time.sleep(0.2)
            kv.exists(keys[:1])  # the refresh timer runs meanwhile
        assert victim in kv.aio.pool.homes
        for k in lost:  # at their home again, from its rebuilt index
            assert kv.get(k, out) and out == value_of(k, 2048)
        # a fourth server joins: about a quarter of the keys move to it, no other moves
        cluster.up(private_cluster, data_servers=4)
        deadline = time.monotonic() + 30
        while len(kv.aio.pool.addrs) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        after = {k: kv.aio.pool.homes.homes(NS, k)[0] for k in keys}
        moved = [k for k in keys if after[k] != before[k]]
        new = set(after.values()) - set(before.values())
        assert len(new) == 1 and all(after[k] in new for k in moved)
        assert len(moved) < len(keys) * 0.5
        kept = [k for k in keys if k not in moved]
        for k in kept:
            assert kv.get(k, out) and out == value_of(k, 2048)
        for k in moved:  # misses at the newcomer (not an error)
            assert not kv.get(k, out)


def test_admin_kv_shows_servers_and_this_node(client_toml: Path, tmp_path: Path) -> None:
    tier = str(tmp_path / "tier")
    with KVCache(client_toml, NS, node_dir=tier) as kv:
        kv.put(b"admin-k", b"z" * 5000)
    out = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "admin", "kv", "--config",
                          str(client_toml), "--node-dir", tier, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert rec["node"]["blocks"] == 1 and rec["node"]["bytes"] > 5000
    assert len(rec["servers"]) >= 1
    assert sum(s.get("blocks", 0) for s in rec["servers"].values()) >= 1


def test_bench_kvcache_runs(cluster_dir: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from pfs.bench import main as bench_main

    out = tmp_path / "kv.json"
    assert bench_main(["kvcache", "--dir", str(cluster_dir), "--sizes", "16k,256k",
                       "--procs", "1,2", "--bytes", "1m", "--local-dir", str(tmp_path),
                       "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("node", "local", "server", "file", "get GB/s/core", "get client CPU us"):
        assert word in text
    res = json.loads(out.read_text())
    assert {c["backend"] for c in res["cells"]} >= {"node", "local", "server", "file"}
    assert len(res["cells"]) >= 2 * 2 * 3
    for c in res["cells"]:
        assert c["errors"] == 0, c
        assert c["get"]["ops"] >= 4 and c["get"]["GBps"] > 0
        assert c["get"]["client_cpu_us_per_op"] > 0
    assert any("node tier / local file" in a for a in res["aims"])


def test_a_block_corrupted_on_a_servers_disk_is_a_miss(cluster_dir: Path, client_toml: Path,
                                                       tmp_path: Path) -> None:
    key = b"rot-" + os.urandom(8)
    value = value_of(key, 64 << 10)
    with KVCache(client_toml, NS, node_tier_bytes=0) as kv:
        kv.put(key, value)
        hit = None
        for slab in (cluster_dir / "data").glob("ds*/kv/*.slab"):
            at = slab.read_bytes().find(value[1000:1064])
            if at >= 0:
                hit = (slab, at)
        assert hit is not None, "the block is in no slab"
        slab, at = hit
        with open(slab, "r+b") as f:  # flip one byte of the value
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        out = bytearray(len(value))
        assert not kv.get(key, out)  # a miss: never the damaged bytes
        assert kv.exists([key]) == 0
        kv.put(key, value)  # and a put heals it
        assert kv.get(key, out) and out == value
        kv.remove([key])


def test_get_batch_pipelines_to_the_homes_from_the_callers_thread(
        cluster_dir: Path, client_toml: Path) -> None:
    """A blocking get_batch of blocks at remote homes never hops to the event loop: the
    gets go pipelined on one connection per home; every byte checked, an absent key and a
    block damaged on its server's disk are misses among hits."""
    keys = [b"pipe-%d-" % i + os.urandom(4) for i in range(40)]
    sizes = [(4 << 10, 256 << 10, 100_000)[i % 3] for i in range(40)]
    with KVCache(client_toml, NS, node_tier_bytes=0, short_circuit=False) as kv:
        kv.put_batch(keys, [value_of(k, n) for k, n in zip(keys, sizes, strict=True)])
        bad = keys[7]
        rot = value_of(bad, sizes[7])[5000:5064]
        for slab in (cluster_dir / "data").glob("ds*/kv/*.slab"):
            at = slab.read_bytes().find(rot)
            if at >= 0:
                with open(slab, "r+b") as f:
                    f.seek(at)
                    f.write(bytes([rot[0] ^ 0xFF]))
        outs = [bytearray(n) for n in sizes] + [bytearray(10)]

        def no_loop(*args: object) -> None:
            raise AssertionError("get_batch went through the event loop")

        kv._run = no_loop  # type: ignore[method-assign,assignment]
        before = kv.stats()
        found = kv.get_batch(keys + [b"pipe-absent"], outs)
        assert found == [i != 7 for i in range(40)] + [False]
        for i, k in enumerate(keys):
            if i != 7:
                assert outs[i] == value_of(k, sizes[i])
        after = kv.stats()
        assert after["remote_hits"] - before["remote_hits"] == 39
        assert after["misses"] - before["misses"] == 2
        assert after["gets"] - before["gets"] == 41
        del kv._run
        kv.remove(keys)

"""The node tier's shared arena under stress and faults: processes and threads putting and
getting overlapping keys (a reader gets the key's bytes or a miss, never another key's or
a torn block), a writer killed in the middle of a put, arenas of another budget or
version, and damaged arenas (a miss, never a crash)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from pfs.kvcache import arena as A
from pfs.kvcache import nodetier
from pfs.kvcache.nodetier import NodeTier

NS = "model-a:tp8"

# Values say which key and version they are, and their body is a function of both: a
# reader can tell a whole value of its key from anything else.
VALUES = r"""
import hashlib, struct
def value(key, ver, size):
    head = struct.pack("<32sII", key.ljust(32, b"\0"), ver, size)
    seed = hashlib.blake2b(key + struct.pack("<I", ver), digest_size=64).digest()
    body = seed * ((size - len(head)) // 64 + 1)
    return head + body[:size - len(head)]
def check(key, got):
    k, ver, size = struct.unpack_from("<32sII", got)
    return k == key.ljust(32, b"\0") and size == len(got) and got == value(key, ver, size)
"""

WORKER = (
    VALUES
    + r"""
import json, os, random, sys, threading, time
from pfs.kvcache import nodetier
from pfs.kvcache.nodetier import NodeTier
root, rank, budget, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sizes = json.loads(sys.argv[5]) if len(sys.argv) > 5 else [100, 3000, 9000, 20000, 47000]
if len(sys.argv) > 6:  # copy records from this size on outside the lock (more of them)
    nodetier.COPY_OUTSIDE = int(sys.argv[6])
tier = NodeTier(root, budget)
keys = [b"key-%d" % i for i in range(24)]
res = {"bad": 0, "hits": 0, "misses": 0, "puts": 0}
def run(seed):
    rnd = random.Random(seed)
    out = bytearray(max(sizes))
    end = time.monotonic() + secs
    while time.monotonic() < end:
        k = rnd.choice(keys)
        if rnd.random() < 0.3:
            size = rnd.choice(sizes)
            tier.put("ns", k, memoryview(value(k, rnd.randrange(1 << 30), size)))
            res["puts"] += 1
        else:
            n = tier.get_into("ns", k, memoryview(out))
            if n is None:
                res["misses"] += 1
            elif check(k, bytes(out[:n])):
                res["hits"] += 1
            else:
                res["bad"] += 1
        if rnd.random() < 0.01:
            tier.remove("ns", [rnd.choice(keys)])
        if rnd.random() < 0.01:
            tier.get_into("other-ns", k, memoryview(out)) is None or res.__setitem__(
                "bad", res["bad"] + 1)
threads = [threading.Thread(target=run, args=(rank * 10 + t,)) for t in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
res["corrupt"] = tier.corrupt
print(json.dumps(res))
"""
)


@pytest.mark.parametrize(
    "budget, sizes",
    [
        (256 << 10, [100, 3000, 9000, 20000, 47000]),  # small blocks: written under the lock
        # large ones copied outside it, several at once: a ring this small makes writers
        # wait for each other's copies as the sweep comes round to them
        (3 << 20, [70000, 150000, 300000, 600000]),
    ],
)
def test_processes_and_threads_share_overlapping_keys_every_byte_checked(
    tmp_path: Path, budget: int, sizes: list[int]
) -> None:
    root = str(tmp_path / "tier")  # small budgets: the ring wraps and sweeps all the time
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, root, str(r), str(budget), "3", json.dumps(sizes)]
            + ["65536"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(4)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["bad"] == 0 for r in results), results
    assert all(r["corrupt"] == 0 for r in results), results
    assert sum(r["hits"] for r in results) > 100  # the test tested something
    assert sum(r["puts"] for r in results) > 100
    assert os.path.getsize(Path(root) / A.NAME) <= budget


KILLED = (
    VALUES
    + r"""
import os, signal, sys
from pfs.kvcache import nodetier
root, mode = sys.argv[1], sys.argv[2]
tier = nodetier.NodeTier(root, 1 << 20)
size = 40000
if mode == "reserved":  # a large block: dies copying its value outside the lock
    size = 100000
    nodetier.COPY_OUTSIDE = 65536
    def copy_half(fd, parts, off):
        os.pwrite(fd, bytes(parts[0][:30000]), off)
        os.kill(os.getpid(), signal.SIGKILL)
    nodetier._pwrite_all = copy_half
elif mode == "write":  # dies between the record's head and the end of its value
    def half(fd, parts, off):
        os.pwrite(fd, b"".join(bytes(p) for p in parts)[:6000], off)
        os.kill(os.getpid(), signal.SIGKILL)
    nodetier._pwrite_all = half
else:  # "publish": the record is in the ring, not yet named
    def die(*args):
        os.kill(os.getpid(), signal.SIGKILL)
    nodetier.NodeTier._publish = die
tier.put("ns", b"victim", memoryview(value(b"victim", 2, size)))
"""
)


@pytest.mark.parametrize("mode", ["write", "publish", "reserved"])
def test_a_writer_killed_mid_put_leaves_no_torn_block(tmp_path: Path, mode: str) -> None:
    ns: dict[str, Any] = {}
    exec(VALUES, ns)  # the workers' value functions, shared
    value, check = ns["value"], ns["check"]
    root = tmp_path / "tier"
    tier = NodeTier(root, 1 << 20)
    tier.put("ns", b"victim", memoryview(value(b"victim", 1, 40000)))
    for i in range(10):
        tier.put("ns", b"k%d" % i, memoryview(value(b"k%d" % i, 1, 30000)))
    p = subprocess.run([sys.executable, "-c", KILLED, str(root), mode], timeout=60)
    assert p.returncode == -signal.SIGKILL  # it died holding the lock, or a reservation
    if mode == "reserved":  # its record is in the ring, flagged, its holder gone
        st = tier._arena.state()
        assert st is not None
        flags = [
            tier._arena.mv[tier._arena.data_off + off + A.REC_FLAGS_AT]
            for off in range(0, st.head, A.ALIGN)
            if tier._arena.mv[tier._arena.data_off + off : tier._arena.data_off + off + 4]
            == A.REC_MAGIC
        ]
        assert A.WRITING in flags
    out = bytearray(128 << 10)
    n = tier.get_into("ns", b"victim", memoryview(out))
    assert n is None or check(b"victim", bytes(out[:n]))  # the old value or a miss
    # the lock went with the process; the ring sweeps over the dead record, laps on end
    for lap in range(4):
        for i in range(40):
            k = b"k%d" % i
            assert tier.put("ns", k, memoryview(value(k, lap, 30000)))
            n = tier.get_into("ns", k, memoryview(out))
            assert n == 30000 and check(k, bytes(out[:n]))
        n = tier.get_into("ns", b"victim", memoryview(out))
        assert n is None or check(b"victim", bytes(out[:n]))
    assert tier.corrupt == 0
    assert tier.put("ns", b"victim", memoryview(value(b"victim", 3, 40000)))
    assert tier.get_into("ns", b"victim", memoryview(out)) == 40000
    assert check(b"victim", bytes(out[:40000]))


def test_an_arena_of_another_budget_or_version_is_replaced(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    a = NodeTier(root, 1 << 20)
    a.put(NS, b"k", memoryview(b"v" * 1000))
    out = memoryview(bytearray(1000))
    b = NodeTier(root, 2 << 20)  # another budget: a new arena; the old one is retired
    assert os.path.getsize(root / A.NAME) == A.geometry(2 << 20)[3]
    assert b.get_into(NS, b"k", out) is None
    assert a.get_into(NS, b"k", out) is None  # a maps the new arena, keeps its size
    a.put(NS, b"k2", memoryview(b"w" * 1000))
    assert b.get_into(NS, b"k2", out) == 1000 and bytes(out) == b"w" * 1000
    assert os.path.getsize(root / A.NAME) == A.geometry(2 << 20)[3]
    assert NodeTier(root, 1, adopt=True).exists(NS, b"k2")  # admin: whatever is there
    with open(root / A.NAME, "r+b") as f:  # another format version
        f.seek(8)
        f.write(struct.pack("<I", A.VERSION + 1))
    c = NodeTier(root, 2 << 20)
    assert not c.exists(NS, b"k2")
    assert c.put(NS, b"k3", memoryview(b"x" * 10)) and b.exists(NS, b"k3")


@pytest.mark.parametrize("where", ["header", "state", "index", "data", "truncated"])
def test_a_damaged_arena_is_a_miss_never_a_crash(tmp_path: Path, where: str) -> None:
    root = tmp_path / "tier"
    tier = NodeTier(root, 1 << 20)
    blocks = {b"k%d" % i: os.urandom(20000) for i in range(30)}
    for k, v in blocks.items():
        tier.put(NS, k, memoryview(v))
    a = tier._arena
    path = root / A.NAME
    span = {
        "header": (0, A.HEAD.size),
        "state": (A.STATE_AT, 40),
        "index": (A.PAGE, a.data_off - A.PAGE),
        "data": (a.data_off, a.data_size),
    }
    if where == "truncated":
        tier.close()
        os.truncate(path, 100)
    else:
        off, n = span[where]
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(os.urandom(n))
    t2 = NodeTier(root, 1 << 20)  # a bad header or size: a new arena
    out = memoryview(bytearray(20000))
    for t in [t2] if where == "truncated" else [tier, t2]:
        for k, v in blocks.items():
            got = t.get_into(NS, k, out)
            assert got is None or bytes(out[:got]) == v
        for i in range(60):  # puts mend it (a damaged ring is emptied), laps over it
            k = b"n%d" % i
            assert t.put(NS, k, memoryview(k * 100))
            assert t.get_into(NS, k, out) == len(k) * 100
        t.usage()


def test_blocks_of_the_file_per_block_layout_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    (root / "00").mkdir(parents=True, mode=0o700)
    (root / "ab").mkdir(mode=0o700)
    os.chmod(root, 0o700)
    (root / "ab" / "0123").write_bytes(b"x" * 1000)
    NodeTier(root, 1 << 20)
    assert list((root / "ab").iterdir()) == [] and (root / "ab").is_dir()


def test_the_sweep_waits_for_a_live_writers_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer copying outside the lock keeps its room: another (here another open file
    of the arena, as another process has) laps the ring up to it and waits (its puts give
    up after RESERVE_WAIT) rather than write over the copy."""
    root = tmp_path / "tier"
    slow, other = NodeTier(root, 1 << 20), NodeTier(root, 1 << 20)
    monkeypatch.setattr(nodetier, "RESERVE_WAIT", 0.05)
    monkeypatch.setattr(nodetier, "COPY_OUTSIDE", 65536)
    copying, go = threading.Event(), threading.Event()
    plain = nodetier._pwrite_all

    def paused(fd: int, parts: Any, off: int) -> None:
        if threading.current_thread().name == "slow":
            copying.set()
            go.wait(30)
        plain(fd, parts, off)

    monkeypatch.setattr(nodetier, "_pwrite_all", paused)
    assert other.put(NS, b"first", memoryview(b"f" * 30000))  # (the copy not at the start)
    big = os.urandom(200000)
    t = threading.Thread(target=slow.put, args=(NS, b"slow", memoryview(big)), name="slow")
    t.start()
    assert copying.wait(30)
    refused, put = 0, {}
    for i in range(40):  # 4 laps of the ring (sizes that do not line up with the copy's)
        put[b"o%d" % i] = v = bytes([i]) * (90000 + 4160 * (i % 5))
        if not other.put(NS, b"o%d" % i, memoryview(v)):
            refused += 1
    assert refused >= 30  # once round, the others wait on the copy
    go.set()
    t.join(30)
    out = memoryview(bytearray(200000))
    assert slow.get_into(NS, b"slow", out) == 200000 and bytes(out) == big
    for k, v in put.items():  # what the others hold was not written over
        n = other.get_into(NS, k, out)
        assert n is None or bytes(out[:n]) == v
    assert other.put(NS, b"after", memoryview(b"a" * 100000))
    assert slow.corrupt == other.corrupt == 0


@pytest.mark.parametrize("size", [1 << 10, 16 << 10])
def test_small_blocks_fill_the_budget_and_hot_ones_survive(tmp_path: Path, size: int) -> None:
    """Blocks of 1 KiB: the index has room for as many as the ring holds, so a budget
    keeps about as many blocks as its data area fits (not fewer for want of entries),
    and blocks read as the others stream past survive."""
    budget = 4 << 20
    tier = NodeTier(tmp_path / "tier", budget)
    nsk = len(NS.encode()) + len(b"k-00000")
    fits = tier._arena.data_size // A.record_length(nsk, size)[1]
    hot = [b"k-%05d" % i for i in range(20)]
    out = memoryview(bytearray(size))
    n = 3 * fits
    for i in range(n):
        k = b"k-%05d" % i
        assert tier.put(NS, k, memoryview(k * (size // len(k)) + bytes(size % len(k))))
        if i % 50 == 0:
            for h in hot:
                tier.get_into(NS, h, out)
    held = [i for i in range(n) if tier.exists(NS, b"k-%05d" % i)]
    assert all(tier.exists(NS, h) for h in hot)
    assert len(held) >= 0.9 * fits, (len(held), fits)
    assert tier.usage().blocks == len(held)
    k = b"k-%05d" % (n - 1)
    assert tier.get_into(NS, k, out) == size and bytes(out[: len(k)]) == k

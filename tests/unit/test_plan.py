"""The sans-IO data planner (pfs/client/plan.py), driven in memory: no socket, no trio."""
from __future__ import annotations

import errno
import os
from typing import Any

import pytest

from pfs.client import plan
from pfs.client.plan import (
    MAX_REQUEST,
    Failure,
    LocalFd,
    LocalRead,
    Parallel,
    Renew,
    Send,
    classify,
)
from pfs.core.layout import Layout
from pfs.core.messages import data as D

UNIT = 4096
INO = 7


class FakeCluster:
    """Objects by (server, stripe), failures to inject, and a log of what was done."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.objects: dict[tuple[str, int], bytearray] = {}
        self.fail: dict[tuple[str, str], list[int]] = {}  # (sid, method): errnos, in turn
        self.log: list[tuple[str, str, int]] = []  # (sid, method, stripe)
        self.renewals = 0
        self.reconnects: list[str] = []
        self.reports: list[tuple[str, int]] = []  # (sid, errno) told to the metaserver
        self.local_fds: dict[int, int | None] = {}  # stripe: descriptor a LocalFd gets
        self.local_reads: list[int] = []
        self.syncs: list[tuple[str, list[int]]] = []  # (sid, stripes) per sync request
        self.refreshed: list[Layout] = []  # what each Refresh returns, in turn
        self.write_ver: int | None = None  # a head's reply: the chain changed meanwhile

    def store(self, data: bytes) -> None:
        """Lay ``data`` out as a file on every replica."""
        for p in self.layout.pieces(0, len(data)):
            for sid in self.layout.servers[p.stripe]:
                obj = self.objects.setdefault((sid, p.stripe), bytearray())
                end = p.obj_off + p.length
                if len(obj) < end:
                    obj.extend(bytes(end - len(obj)))
                obj[p.obj_off:end] = data[p.file_off:p.file_off + p.length]

    def run(self, p: plan.Plan[Any]) -> Any:
        value: Any = None
        exc: BaseException | None = None
        while True:
            try:
                eff = p.send(value) if exc is None else p.throw(exc)
            except StopIteration as done:
                return done.value
            value, exc = None, None
            try:
                value = self.do(eff)
            except OSError as e:
                exc = e

    def do(self, eff: Any) -> Any:
        if isinstance(eff, Parallel):
            return [self.run(sub) for sub in eff.plans]
        if isinstance(eff, plan.Reconnect):
            self.reconnects.append(eff.sid)
            return None
        if isinstance(eff, plan.Report):
            self.reports.append((eff.sid, eff.errno))
            return None
        if isinstance(eff, Renew):
            self.renewals += 1
            return b"cap%d" % self.renewals
        if isinstance(eff, plan.Refresh):
            self.layout = self.refreshed.pop(0)
            return self.layout
        if isinstance(eff, LocalFd):
            return self.local_fds.get(eff.stripe)
        if isinstance(eff, LocalRead):
            self.local_reads.append(eff.fd)
            obj = self.objects[(self.layout.servers[eff.fd][0], eff.fd)]  # fd = stripe here
            counts, off = [], eff.obj_off
            for d in eff.dests:
                chunk = obj[off:off + len(d)]
                d[:len(chunk)] = chunk
                d[len(chunk):] = b"\xee" * (len(d) - len(chunk))  # garbage: the plan zeros
                counts.append(len(chunk))
                off += len(d)
            return counts
        assert isinstance(eff, Send)
        msg: Any = eff.msg
        if msg.method == "sync":  # one request lists the server's objects
            self.syncs.append((eff.sid, [o[1] for o in msg.objs]))
            self.log.extend((eff.sid, "sync", o[1]) for o in msg.objs)
            errs = self.fail.get((eff.sid, "sync"))
            if errs:
                raise OSError(errs.pop(0), f"injected on {eff.sid}")
            return 0
        stripe = msg.obj[1]
        self.log.append((eff.sid, eff.msg.method, stripe))
        errs = self.fail.get((eff.sid, eff.msg.method))
        if errs:
            raise OSError(errs.pop(0), f"injected on {eff.sid}")
        obj = self.objects.setdefault((eff.sid, stripe), bytearray())
        if eff.msg.method == "read":
            assert msg.len <= MAX_REQUEST
            chunk = obj[msg.off:msg.off + msg.len]
            dests = eff.into if isinstance(eff.into, list) else [eff.into]
            pos = 0
            for d in dests:
                part = chunk[pos:pos + len(d)]
                d[:len(part)] = part
                d[len(part):] = b"\xee" * (len(d) - len(part))  # a short reply leaves junk
                pos += len(d)
            return len(chunk)
        if eff.msg.method == "write":
            srcs = eff.payload if isinstance(eff.payload, list) else [eff.payload]
            data = b"".join(bytes(s) for s in srcs)
            off = msg.off
            for i, sid in enumerate([eff.sid, *(msg.fwd or ())]):  # the head, down the chain
                if i:
                    self.log.append((sid, "forwarded", stripe))
                    errs = self.fail.get((sid, "forwarded"))
                    if errs:
                        raise OSError(errs.pop(0), f"injected on {sid}")
                obj = self.objects.setdefault((sid, stripe), bytearray())
                if len(obj) < off + len(data):
                    obj.extend(bytes(off + len(data) - len(obj)))
                obj[off:off + len(data)] = data
            return {"n": len(data), "ver": self.write_ver} if eff.reply else 0
        return 0


def _layout(count: int = 3, replicas: int = 1, unit: int = UNIT) -> Layout:
    return Layout(unit, count, replicas,
                  tuple(tuple(f"s{i}r{r}" for r in range(replicas)) for i in range(count)))


def _read(cl: FakeCluster, off: int, n: int, cap: bytes | None = b"c", **kw: Any) -> bytes:
    buf = bytearray(n)
    cl.run(plan.read(None, INO, cl.layout, off, memoryview(buf), cap, **kw))
    return bytes(buf)


def test_runs_are_per_stripe_contiguous_and_cut_at_max_request() -> None:
    lay = _layout(count=2, unit=MAX_REQUEST * 2)
    rs = plan.runs(lay, 100, MAX_REQUEST * 3)
    assert [sum(p.length for p in r) for r in rs] == [MAX_REQUEST, MAX_REQUEST - 100,
                                                      MAX_REQUEST, 100]
    assert all(sum(p.length for p in r) <= MAX_REQUEST for r in plan.runs(
        _layout(count=3, unit=1 << 20), 5, 40 << 20))
    small = plan.runs(_layout(count=4), UNIT + 10, 100)
    assert small == [[plan.Piece(1, 10, UNIT + 10, 100)]]
    # every byte once, in stripe order
    lay = _layout(count=3)
    got = sorted((p.file_off, p.length) for r in plan.runs(lay, 123, 10 * UNIT) for p in r)
    pos = 123
    for off, n in got:
        assert off == pos
        pos += n
    assert pos == 123 + 10 * UNIT


def test_read_assembles_stripes_and_zero_fills_holes_and_short_objects() -> None:
    lay = _layout(count=3)
    cl = FakeCluster(lay)
    data = bytearray(os.urandom(7 * UNIT + 100))
    cl.store(bytes(data))
    # a hole: stripe 1's object is short (its second unit was never written)
    del cl.objects[("s1r0", 1)][UNIT + UNIT // 2:]
    data[4 * UNIT + UNIT // 2:5 * UNIT] = bytes(UNIT // 2)
    data[7 * UNIT:] = bytes(100)
    # and stripe 2 has no object at all
    del cl.objects[("s2r0", 2)]
    data[2 * UNIT:3 * UNIT] = bytes(UNIT)
    data[5 * UNIT:6 * UNIT] = bytes(UNIT)
    for off, n in [(0, len(data)), (10, 3 * UNIT), (4 * UNIT + 1, 2 * UNIT), (2 * UNIT, 5)]:
        assert _read(cl, off, n) == bytes(data[off:off + n]), (off, n)
    # reading past every object's end: all zeros (the caller bounds reads by the size)
    assert _read(cl, 9 * UNIT, 3 * UNIT) == bytes(3 * UNIT)


def test_read_fails_over_replicas_in_order() -> None:
    lay = _layout(count=1, replicas=3)
    cl = FakeCluster(lay)
    cl.store(b"x" * 100)
    cl.fail[("s0r0", "read")] = [errno.ECONNRESET]
    cl.fail[("s0r1", "read")] = [errno.ETIMEDOUT]
    assert _read(cl, 0, 100) == b"x" * 100
    assert [s for s, _, _ in cl.log] == ["s0r0", "s0r1", "s0r2"]
    assert cl.reconnects == ["s0r0", "s0r1"]  # each broken connection renewed for later
    assert cl.reports == [("s0r0", errno.ECONNRESET)]  # gone, not hung: the metaserver hears
    # all fail: the last error
    cl.log.clear()
    for r in range(3):
        cl.fail[(f"s0r{r}", "read")] = [errno.EIO]
    with pytest.raises(OSError) as err:
        _read(cl, 0, 100)
    assert err.value.errno == errno.EIO and "s0r2" in str(err.value)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSPC])
def test_final_errors_end_at_once(code: int) -> None:
    cl = FakeCluster(_layout(count=1, replicas=2))
    cl.store(b"y" * 10)
    cl.fail[("s0r0", "read")] = [code]
    with pytest.raises(OSError) as err:
        _read(cl, 0, 10)
    assert err.value.errno == code
    assert [s for s, _, _ in cl.log] == ["s0r0"]
    assert cl.renewals == 0


@pytest.mark.parametrize("code", [errno.EACCES, errno.ESTALE])
def test_a_refused_capability_is_renewed_and_the_request_retried_here(code: int) -> None:
    cl = FakeCluster(_layout(count=1, replicas=2))
    cl.store(b"z" * 10)
    cl.fail[("s0r0", "read")] = [code]
    assert _read(cl, 0, 10) == b"z" * 10
    assert cl.renewals == 1
    assert [s for s, _, _ in cl.log] == ["s0r0", "s0r0"]  # not the other replica
    # refused twice: the error
    cl.fail[("s0r0", "read")] = [code, code]
    with pytest.raises(OSError) as err:
        _read(cl, 0, 10)
    assert err.value.errno == code and cl.renewals == 2
    # no capability at all (security off): nothing to renew
    cl.fail[("s0r0", "read")] = [code]
    with pytest.raises(OSError):
        _read(cl, 0, 10, cap=None)
    assert cl.renewals == 2


def test_a_capability_due_is_renewed_first() -> None:
    cl = FakeCluster(_layout(count=1))
    cl.store(b"w" * 10)
    caps: list[Any] = []
    real = cl.do

    def do(eff: Any) -> Any:
        if isinstance(eff, Send):
            caps.append(eff.msg.cap)  # type: ignore[attr-defined]
        return real(eff)

    cl.do = do  # type: ignore[method-assign]
    assert _read(cl, 0, 10, cap=b"old", renew_due=True) == b"w" * 10
    assert caps == [b"cap1"]


@pytest.mark.parametrize("classes", [
    (errno.EACCES, Failure.RENEW), (errno.ESTALE, Failure.RENEW),
    (errno.EINVAL, Failure.FINAL), (errno.ENOSPC, Failure.FINAL),
    (errno.ECONNRESET, Failure.RECONNECT), (errno.ETIMEDOUT, Failure.RECONNECT),
    (errno.ECONNREFUSED, Failure.RECONNECT), (errno.ENOTCONN, Failure.RECONNECT),
    (errno.EIO, Failure.ELSEWHERE), (errno.ENOENT, Failure.ELSEWHERE)])
def test_classify(classes: tuple[int, Failure]) -> None:
    code, kind = classes
    assert classify(OSError(code, "x")) is kind


def test_a_write_goes_to_each_chain_head_which_passes_it_down() -> None:
    lay = _layout(count=3, replicas=2)
    cl = FakeCluster(lay)
    data = os.urandom(5 * UNIT + 7)
    cl.run(plan.write(None, INO, lay, 300, memoryview(data), b"c"))
    assert sorted((s, st) for s, m, st in cl.log if m == "write") == sorted(
        (f"s{st}r0", st) for st in range(3))  # the client sends to the heads only
    assert sorted((s, st) for s, m, st in cl.log if m == "forwarded") == sorted(
        (f"s{st}r1", st) for st in range(3))
    for r in range(2):  # each replica alone reads back the data
        solo = Layout(UNIT, 3, 1, tuple((f"s{st}r{r}",) for st in range(3)))
        cl2 = FakeCluster(solo)
        cl2.objects = cl.objects
        assert _read(cl2, 300, len(data)) == data


def test_a_failed_replica_fails_the_write_and_a_refusal_renews() -> None:
    lay = _layout(count=1, replicas=2)
    cl = FakeCluster(lay)
    cl.fail[("s0r1", "forwarded")] = [errno.EIO]
    with pytest.raises(OSError) as err:
        cl.run(plan.write(None, INO, lay, 0, memoryview(b"abc"), b"c"))
    assert err.value.errno == errno.EIO  # not acknowledged down the chain: an error
    cl.fail[("s0r0", "write")] = [errno.EACCES]
    cl.run(plan.write(None, INO, lay, 0, memoryview(b"abc"), b"c"))
    assert cl.renewals == 1
    cl.fail[("s0r0", "write")] = [errno.EPIPE]  # no failover for a write: the error
    with pytest.raises(OSError) as err:
        cl.run(plan.write(None, INO, lay, 0, memoryview(b"abc"), b"c"))
    assert err.value.errno == errno.EPIPE and cl.reconnects == ["s0r0"]


def test_a_driver_that_cannot_reconnect_hands_the_operation_over() -> None:
    """The blocking driver meets Reconnect (and Renew): HandOver, plan closed."""
    from pfs.client.blocking_driver import BlockingDriver

    class Pool:
        def __init__(self, code: int) -> None:
            self.code = code

        def send(self, *a: Any, **k: Any) -> Any:
            raise OSError(self.code, "x")

    lay = _layout(count=1, replicas=2)
    for code in (errno.ECONNREFUSED, errno.EACCES):
        drv = BlockingDriver(Pool(code), None)  # type: ignore[arg-type]
        with pytest.raises(plan.HandOver):
            drv.run(plan.read(None, INO, lay, 0, memoryview(bytearray(10)), b"c"))
    drv = BlockingDriver(Pool(errno.EIO), None)  # type: ignore[arg-type]
    with pytest.raises(OSError) as err:  # the servers' answer: the plan's last word
        drv.run(plan.read(None, INO, lay, 0, memoryview(bytearray(10)), b"c"))
    assert err.value.errno == errno.EIO


def test_writes_are_cut_at_max_request() -> None:
    lay = _layout(count=1, unit=MAX_REQUEST * 4)
    cl = FakeCluster(lay)
    data = memoryview(bytearray(MAX_REQUEST * 2 + 5))
    sizes: list[int] = []
    real = cl.do

    def do(eff: Any) -> Any:
        if isinstance(eff, Send):
            sizes.append(sum(len(p) for p in eff.payload) if isinstance(eff.payload, list)
                         else len(eff.payload))
        return real(eff)

    cl.do = do  # type: ignore[method-assign]
    cl.run(plan.write(None, INO, lay, 0, data, None))
    assert sorted(sizes) == [5, MAX_REQUEST, MAX_REQUEST]


def test_fsync_reaches_every_object_on_every_replica() -> None:
    lay = _layout(count=2, replicas=2)
    cl = FakeCluster(lay)
    cl.run(plan.fsync(None, INO, lay, b"c"))
    assert sorted(cl.log) == sorted((f"s{st}r{r}", "sync", st)
                                    for st in range(2) for r in range(2))


def test_stripes_of_a_write() -> None:
    lay = _layout(count=4)
    assert list(plan.stripes_of(lay, 0, 1)) == [0]
    assert list(plan.stripes_of(lay, UNIT - 1, 2)) == [0, 1]
    assert list(plan.stripes_of(lay, 3 * UNIT, UNIT + 1)) == [3, 0]  # wraps to row 2
    assert list(plan.stripes_of(lay, 5, 4 * UNIT)) == [0, 1, 2, 3]  # all, not walked
    assert list(plan.stripes_of(lay, 5, 0)) == []


def test_sync_is_one_request_per_server_listing_its_objects() -> None:
    # 3 stripes, 2 replicas on 3 servers: each server holds replicas of two stripes
    lay = Layout(UNIT, 3, 2, (("a", "b"), ("b", "c"), ("c", "a")))
    cl = FakeCluster(lay)
    cl.run(plan.sync(None, INO, lay, {0, 1, 2}, b"c"))
    assert sorted(cl.syncs) == [("a", [0, 2]), ("b", [0, 1]), ("c", [1, 2])]
    # only what was written: stripe 1 is on b and c
    cl.syncs.clear()
    cl.run(plan.sync(None, INO, lay, [1, 1], b"c"))
    assert sorted(cl.syncs) == [("b", [1]), ("c", [1])]
    cl.syncs.clear()
    cl.run(plan.sync(None, INO, lay, (), b"c"))  # nothing written: nothing sent
    assert cl.syncs == []


def test_sync_to_a_server_without_it_fsyncs_each_object() -> None:
    lay = Layout(UNIT, 2, 2, (("a", "b"), ("b", "a")))
    cl = FakeCluster(lay)
    cl.fail[("b", "sync")] = [errno.ENOSYS]  # an older data server (rolling upgrade)
    cl.run(plan.sync(None, INO, lay, [0, 1], b"c"))
    assert sorted(e for e in cl.log if e[0] == "b") == [
        ("b", "fsync", 0), ("b", "fsync", 1), ("b", "sync", 0), ("b", "sync", 1)]
    assert sorted(e for e in cl.log if e[0] == "a") == [("a", "sync", 0), ("a", "sync", 1)]


def test_sync_fails_with_a_replicas_errno_and_renews_a_refused_cap() -> None:
    lay = Layout(UNIT, 2, 2, (("a", "b"), ("b", "a")))
    cl = FakeCluster(lay)
    cl.fail[("b", "sync")] = [errno.EIO]
    with pytest.raises(OSError) as info:
        cl.run(plan.sync(None, INO, lay, [0, 1], b"c"))
    assert info.value.errno == errno.EIO
    cl.fail[("a", "sync")] = [errno.EACCES]
    cl.syncs.clear()
    cl.run(plan.sync(None, INO, lay, [0, 1], b"c"))
    assert cl.renewals == 1
    assert sorted(cl.syncs)[-2:] == [("a", [0, 1]), ("b", [0, 1])]
    cl.fail[("a", "sync")] = [errno.ECONNREFUSED]  # every replica must answer
    with pytest.raises(ConnectionRefusedError):
        cl.run(plan.sync(None, INO, lay, [0], b"c"))
    assert cl.reconnects == ["a"]


class _Local:
    def __init__(self, fds: dict[int, int | None]) -> None:
        self.fds = fds

    def tried(self, stripe: int) -> bool:
        return stripe in self.fds

    def known_fd(self, stripe: int) -> int | None:
        return self.fds.get(stripe)


def test_local_descriptors_execute_their_stripes_pieces() -> None:
    lay = _layout(count=3)
    cl = FakeCluster(lay)
    data = os.urandom(6 * UNIT)
    cl.store(data)
    del cl.objects[("s0r0", 0)][UNIT + 5:]  # a short local object: zeros after it
    want = bytearray(data)
    want[3 * UNIT + 5:4 * UNIT] = bytes(UNIT - 5)
    local = _Local({0: 0, 1: None})  # stripe 0 local (fd 0), 1 refused, 2 not asked yet
    cl.local_fds = {2: 2}
    assert _read(cl, 0, len(data), local=local) == bytes(want)
    assert sorted(cl.local_reads) == [0, 2]
    assert [(s, st) for s, _, st in cl.log] == [("s1r0", 1)]  # only stripe 1 went remote


def test_a_small_plan_is_one_effect() -> None:
    lay = _layout(count=4)
    buf = memoryview(bytearray(100))
    p = plan.read(None, INO, lay, UNIT + 10, buf, b"c")
    eff = p.send(None)
    assert isinstance(eff, Send) and eff.msg == D.Read(obj=(INO, 1), off=10, len=100, cap=b"c")
    with pytest.raises(StopIteration):
        p.send(100)


# -- steps: the small requests' plans without a generator ------------------------------
def _step(cl: FakeCluster, step: Any, done: Any, general: plan.Plan[Any]) -> Any:
    """Carry a step out as the blocking driver does: inline, else the general plan
    resumed from the failure."""
    try:
        result = cl.do(step)
    except OSError as exc:
        return cl.run(plan.resume(general, step, exc))
    if done is not None:
        done(step, result)
    return None


def _read_step(cl: FakeCluster, off: int, n: int, cap: bytes | None = b"c",
               local: Any = None) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    step = plan.read_step(INO, cl.layout, off, view, cap, False, local)
    assert step is not None
    _step(cl, step, plan.read_step_done,
          plan.read(None, INO, cl.layout, off, view, cap, local=local))
    return bytes(buf)


def test_a_small_read_is_one_step_built_as_the_plans_first_effect() -> None:
    lay = _layout(count=4, replicas=2)
    view = memoryview(bytearray(100))
    step = plan.read_step(INO, lay, UNIT + 10, view, b"c")
    first = plan.read(None, INO, lay, UNIT + 10, view, b"c").send(None)
    assert isinstance(step, Send) and isinstance(first, Send)
    assert (step.sid, step.msg.to_wire(), step.payload) == \
        (first.sid, first.msg.to_wire(), first.payload)
    assert (step.sid, step.msg.method, step.payload) == ("s1r0", "read", None)
    assert bytes(step.into) == bytes(first.into) and len(step.into) == 100
    # a descriptor held: one local read; refused: the replicas; not asked yet: no step
    local = _Local({1: 5, 2: None})
    assert plan.read_step(INO, lay, UNIT + 10, view, b"c", False, local) == \
        LocalRead(local, 5, 10, [view])
    assert isinstance(plan.read_step(INO, lay, 2 * UNIT, view, b"c", False, local), Send)
    assert plan.read_step(INO, lay, 3 * UNIT, view, b"c", False, local) is None
    # more than one piece, or a capability due: the general plan
    assert plan.read_step(INO, lay, UNIT - 10, view, b"c") is None
    assert plan.read_step(INO, lay, 0, view, b"c", True) is None
    assert plan.read_step(INO, _layout(count=1, unit=4 * MAX_REQUEST), 0,
                          memoryview(bytearray(MAX_REQUEST + 1)), None) is None


# failures injected on the replicas of a 3-replica stripe (sid, errnos in turn)
_SCENARIOS: list[dict[str, list[int]]] = [
    {},
    {"s0r0": [errno.ECONNRESET], "s0r1": [errno.ETIMEDOUT]},  # failover, reconnects
    {"s0r0": [errno.EIO]},  # elsewhere
    {"s0r0": [errno.EIO], "s0r1": [errno.EIO], "s0r2": [errno.EIO]},  # all fail
    {"s0r0": [errno.EINVAL]},  # final
    {"s0r0": [errno.EACCES]},  # renewed, retried here
    {"s0r0": [errno.ESTALE, errno.ESTALE]},  # refused twice
]


def _outcome(cl: FakeCluster, fn: Any, *args: Any) -> tuple[Any, ...]:
    try:
        got: Any = fn(cl, *args)
    except OSError as exc:
        got = (exc.errno, str(exc))
    return got, cl.log, cl.renewals, cl.reconnects


@pytest.mark.parametrize("fail", _SCENARIOS)
@pytest.mark.parametrize("short", [False, True])
def test_a_read_step_fails_over_renews_and_fills_holes_as_the_plan(
        fail: dict[str, list[int]], short: bool) -> None:
    outcomes = []
    for use_step in (False, True):
        cl = FakeCluster(_layout(count=1, replicas=3))
        cl.store(b"q" * (UNIT - 100 if short else 3 * UNIT))
        for sid, codes in fail.items():
            cl.fail[(sid, "read")] = list(codes)
        # UNIT - 300 on: 200 bytes there when short, zeros after them
        outcomes.append(_outcome(cl, _read_step if use_step else _read, UNIT - 300, 300))
    assert outcomes[0] == outcomes[1]
    if not fail:
        assert outcomes[1][0] == (b"q" * 200 + bytes(100) if short else b"q" * 300)


def test_a_local_read_step_zero_fills_past_the_objects_end() -> None:
    cl = FakeCluster(_layout(count=2))
    data = os.urandom(3 * UNIT)
    cl.store(data)
    del cl.objects[("s1r0", 1)][100:]
    local = _Local({0: 0, 1: 1})
    assert _read_step(cl, UNIT + 50, 200, local=local) == data[UNIT + 50:UNIT + 100] + \
        bytes(150)
    assert _read_step(cl, 2 * UNIT, 300, local=local) == data[2 * UNIT:2 * UNIT + 300]
    assert cl.local_reads == [1, 0] and cl.log == []


def test_a_failed_step_resumes_a_plan_that_changed_at_its_first_effect() -> None:
    """The capability fell due between the step and its failure: the resumed plan
    renews first (its first effect is not the step's), then reads."""
    cl = FakeCluster(_layout(count=1, replicas=2))
    cl.store(b"v" * 50)
    cl.fail[("s0r0", "read")] = [errno.EIO]
    view = memoryview(bytearray(50))
    step = plan.read_step(INO, cl.layout, 0, view, b"c")
    _step(cl, step, plan.read_step_done, plan.read(None, INO, cl.layout, 0, view, b"old",
                                                   renew_due=True))
    assert bytes(view) == b"v" * 50 and cl.renewals == 1
    assert [s for s, _, _ in cl.log] == ["s0r0", "s0r0"]  # the step, then the plan


def _write(cl: FakeCluster, off: int, data: bytes) -> None:
    cl.run(plan.write(None, INO, cl.layout, off, memoryview(data), b"c"))


def _write_step(cl: FakeCluster, off: int, data: bytes) -> None:
    view = memoryview(data)
    step = plan.write_step(INO, cl.layout, off, view, b"c")
    assert step is not None
    _step(cl, step, None, plan.write(None, INO, cl.layout, off, view, b"c"))


def test_a_small_write_to_one_replica_is_one_step() -> None:
    lay = _layout(count=2)
    view = memoryview(b"abc")
    step = plan.write_step(INO, lay, UNIT + 1, view, b"c")
    first = plan.write(None, INO, lay, UNIT + 1, view, b"c").send(None)
    assert isinstance(step, Send) and isinstance(first, Send)
    assert (step.sid, step.msg.to_wire(), step.payload) == \
        (first.sid, first.msg.to_wire(), first.payload)
    assert (step.sid, step.msg.method, step.payload) == ("s1r0", "write", view)
    assert plan.write_step(INO, lay, UNIT - 1, view, b"c") is None  # two pieces
    assert plan.write_step(INO, lay, 0, view, b"c", True) is None  # renew first
    chained = plan.write_step(INO, _layout(count=1, replicas=2), 0, view, b"c")
    assert isinstance(chained, Send) and chained.sid == "s0r0"  # the head passes it on
    assert isinstance(chained.msg, D.Write) and chained.msg.fwd == ["s0r1"]


def test_a_stale_chain_version_refreshes_the_layout_and_writes_again() -> None:
    lay = Layout(UNIT, 1, 2, (("a", "b"),), chains=(5,), versions=(1,))
    cl = FakeCluster(lay)
    cl.fail[("a", "write")] = [D.CHAIN_STALE]
    now = Layout(UNIT, 1, 2, (("a", "c"),), chains=(5,), versions=(3,))
    cl.refreshed = [now]
    cl.run(plan.write(None, INO, lay, 0, memoryview(b"abc"), b"c"))
    assert [(s, m) for s, m, _ in cl.log] == [("a", "write"), ("a", "write"),
                                              ("c", "forwarded")]
    assert bytes(cl.objects[("c", 0)]) == b"abc"
    cl.write_ver, cl.refreshed = 4, [now]  # a member taken out during the write
    cl.run(plan.write(object(), INO, now, 0, memoryview(b"abc"), b"c"))
    assert cl.refreshed == []  # the layout was fetched again (the close syncs it)
    first = plan.write(None, INO, now, 0, memoryview(b"abc"), b"c").send(None)
    assert isinstance(first.msg, D.Write)
    assert (first.msg.chain, first.msg.ver, first.msg.fwd) == (5, 3, ["c"])
    read = plan.read_step(INO, now, 0, memoryview(bytearray(3)), b"c")
    assert isinstance(read, Send) and isinstance(read.msg, D.Read)
    assert (read.msg.chain, read.msg.ver) == (5, 3)


@pytest.mark.parametrize("codes", [[], [errno.EIO], [errno.EPIPE], [errno.EACCES],
                                   [errno.EACCES, errno.EACCES], [errno.ENOSPC]])
def test_a_write_step_fails_and_renews_as_the_plan(codes: list[int]) -> None:
    outcomes = []
    for use_step in (False, True):
        cl = FakeCluster(_layout(count=1))
        cl.fail[("s0r0", "write")] = list(codes)
        outcomes.append(_outcome(cl, _write_step if use_step else _write, 10, b"hello")
                        + (bytes(cl.objects.get(("s0r0", 0), b"")),))
    assert outcomes[0] == outcomes[1]


def test_the_blocking_driver_hands_a_failed_step_over_as_the_plan() -> None:
    from pfs.client.blocking_driver import BlockingDriver

    class Pool:
        def __init__(self, code: int) -> None:
            self.code = code
            self.calls: list[str] = []

        def send(self, sid: str, *a: Any, **k: Any) -> Any:
            self.calls.append(sid)
            raise OSError(self.code, f"x on {sid}")

    lay = _layout(count=1, replicas=2)
    view = memoryview(bytearray(10))

    def run(pool: Pool) -> None:
        drv = BlockingDriver(pool, None)  # type: ignore[arg-type]
        step = plan.read_step(INO, lay, 0, view, b"c")
        drv.run_step(step, plan.read_step_done,
                     lambda: plan.read(None, INO, lay, 0, view, b"c"))

    for code in (errno.ECONNREFUSED, errno.EACCES):  # Reconnect, Renew: the trio driver's
        with pytest.raises(plan.HandOver):
            run(Pool(code))
    pool = Pool(errno.EIO)
    with pytest.raises(OSError) as err:  # the next replica, then the last error
        run(pool)
    assert err.value.errno == errno.EIO and pool.calls == ["s0r0", "s0r1"]
    with pytest.raises(plan.HandOver):  # no blocking connections at all
        BlockingDriver(None, None).run_step(  # type: ignore[arg-type]
            plan.read_step(INO, lay, 0, view, b"c"), plan.read_step_done,
            lambda: plan.read(None, INO, lay, 0, view, b"c"))


class _FakeStager:
    """A pinned buffer of two halves; copies land in a bytearray standing for the GPU."""

    def __init__(self, half: int, device: bytearray) -> None:
        self.half = half
        self.view = memoryview(bytearray(2 * half))
        self.device = device
        self.pending = [False, False]
        self.events: list[str] = []

    def copy(self, slot: int, dst: int, src_off: int, n: int) -> None:
        assert not self.pending[slot]
        self.device[dst:dst + n] = self.view[src_off:src_off + n]
        self.pending[slot] = True
        self.events.append(f"copy{slot}")

    def wait(self, slot: int) -> None:
        self.pending[slot] = False
        self.events.append(f"wait{slot}")


def test_a_device_destination_is_staged_in_two_alternating_halves() -> None:
    lay = _layout(count=3)
    cl = FakeCluster(lay)
    data = os.urandom(5 * UNIT + 11)
    cl.store(data)
    device = bytearray(len(data))
    st = _FakeStager(UNIT, device)
    real = cl.do

    def do(eff: Any) -> Any:
        if isinstance(eff, plan.ToDevice):
            return st.copy(eff.slot, eff.dst_ptr, eff.src_off, eff.n)
        if isinstance(eff, plan.DeviceWait):
            return st.wait(eff.slot)
        return real(eff)

    cl.do = do  # type: ignore[method-assign]

    def chunk(view: memoryview, off: int) -> plan.Plan[int]:
        yield from plan.read(None, INO, lay, off, view, b"c")
        return len(view)

    assert cl.run(plan.read_device(st, 0, 7, len(data) - 7, chunk)) == len(data) - 7
    assert bytes(device[:len(data) - 7]) == data[7:]
    assert st.events[:4] == ["wait0", "copy0", "wait1", "copy1"]
    assert st.events[-2:] == ["wait0", "wait1"] and st.pending == [False, False]


def test_local_chunks_regroup_reads_by_object() -> None:
    """Many reads of one file become, per stripe, chunks of consecutive object bytes
    (a piece never split), whose destinations cover every byte read exactly once."""
    lay = Layout(count=3, unit=UNIT, servers=(("a",), ("b",), ("c",)))
    size = 40 * UNIT + 100
    data = os.urandom(size)
    reads = [(0, 7 * UNIT + 5), (7 * UNIT + 5, 20 * UNIT), (30 * UNIT - 3, 10 * UNIT + 103),
             (2 * UNIT + 1, 0)]
    bufs = [bytearray(n) for _o, n in reads]
    chunks = plan.local_chunks(lay, [(o, memoryview(b)) for (o, _n), b in zip(reads, bufs, strict=True)],
                               4 * UNIT)
    for c in chunks:  # as a local reader fills them: one object, consecutive bytes
        assert c.length <= 4 * UNIT
        at = c.obj_off
        for d, fo in zip(c.dests, c.file_offs, strict=True):
            row, within = divmod(at, UNIT)
            assert fo == (row * lay.count + c.stripe) * UNIT + within  # the same place
            d[:] = data[fo:fo + len(d)]
            at += len(d)
    assert [bytes(b) for b in bufs] == [data[o:o + n] for o, n in reads]
    assert sum(c.length for c in chunks) == sum(n for _o, n in reads)
    # the two reads that meet (7 * UNIT + 5) continue each other in the objects: no
    # chunk shorter than needed except at the ends of what each object gives
    per_stripe = {s: [c for c in chunks if c.stripe == s] for s in range(3)}
    assert all(len(cs) <= 4 for cs in per_stripe.values())

"""Failure detection without processes: hedged reads in the sans-IO planner, the client's
latency estimator (pfs/client/health.py), the registry's leases and states, and the
metaserver's probe of a reported server (metaserver/detector.py)."""
from __future__ import annotations

import errno
import math
from typing import Any

import pytest
import trio

from pfs.client import plan
from pfs.client.health import Health
from pfs.client.plan import Hedge, Reconnect, Report, Send
from pfs.core.layout import Layout
from pfs.core.messages.records import Volume
from pfs.metaserver.detector import Detector
from pfs.metaserver.registry import Placeable, Registry, Reserve, State

UNIT = 4096
INO = 9


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _layout(replicas: int = 2, count: int = 1) -> Layout:
    return Layout(UNIT, count, replicas,
                  tuple(tuple(f"s{i}r{r}" for r in range(replicas)) for i in range(count)))


def _health(clock: Clock | None = None) -> Health:
    return Health(hedge_min=0.1, hedge_max=2.0, penalty=5.0, report_gap=1.0,
                  clock=clock or Clock())


def _reader(health: Health | None, replicas: int = 2, n: int = 100,
            count: int = 1) -> tuple[plan.Plan[None], bytearray]:
    buf = bytearray(n)
    return plan.read(None, INO, _layout(replicas, count), 0, memoryview(buf), b"c",
                     health=health), buf


def _answer(eff: Send, fill: int = 0x61) -> int:
    eff.into[:] = bytes([fill]) * len(eff.into)
    return len(eff.into)


# ---------------------------------------------------------------------- the planner
def test_a_replicated_read_is_a_hedge_with_the_first_servers_deadline() -> None:
    h = _health()
    for _ in range(20):
        h.observe("s0r0", 100, 0.3)  # steady 0.3 s: deadline about 0.3 s
    p, buf = _reader(h)
    eff = p.send(None)
    assert isinstance(eff, Hedge)
    assert (eff.first.sid, eff.second.sid) == ("s0r0", "s0r1")
    assert 0.29 < eff.after < 0.5
    # the second replica answered first: the driver copied its bytes over
    _answer(eff.first, 0x62)
    with pytest.raises(StopIteration):
        p.send((100, None))
    assert buf == b"b" * 100


def test_no_estimate_yet_hedges_at_the_upper_bound_and_a_fast_one_at_the_lower() -> None:
    h = _health()
    assert h.deadline("new", 100) == 2.0
    for _ in range(50):
        h.observe("fast", 100, 0.001)
    assert h.deadline("fast", 100) == 0.1
    for _ in range(5):
        h.observe("slow", 100, 30.0)
    assert h.deadline("slow", 100) == 2.0


def test_size_classes_keep_large_reads_from_setting_small_deadlines() -> None:
    h = Health(hedge_min=0.0, hedge_max=100.0)
    for _ in range(20):
        h.observe("s", 8 << 20, 1.0)
        h.observe("s", 4096, 0.01)
    assert h.deadline("s", 4096) < 0.05
    assert h.deadline("s", 8 << 20) > 0.9


def test_estimate_follows_variance_as_tcps_timer() -> None:
    h = Health(hedge_min=0.0, hedge_max=100.0)
    for i in range(200):
        h.observe("s", 100, 0.01 if i % 2 else 0.03)
    d = h.deadline("s", 100)
    assert 0.03 < d < 0.08  # above nearly every answer: srtt 0.02 + 4 * rttvar ~0.01


def test_a_refused_first_replica_moves_to_the_next_at_once_and_is_reported() -> None:
    h = _health()
    p, buf = _reader(h)
    eff = p.send(None)
    assert isinstance(eff, Hedge)
    refused = OSError(errno.ECONNREFUSED, "refused")
    assert p.send((None, [refused, None])) == Report("s0r0", errno.ECONNREFUSED)
    assert p.send(None) == Reconnect("s0r0")
    last = p.send(None)
    assert isinstance(last, Send) and last.sid == "s0r1"  # the last replica: no hedge
    with pytest.raises(StopIteration):
        p.send(_answer(last))
    assert buf == b"a" * 100


def test_a_driver_that_cannot_race_raises_at_the_hedge_and_the_plan_goes_on() -> None:
    p, buf = _reader(_health())
    assert isinstance(p.send(None), Hedge)
    # the blocking driver: the first request alone, its deadline passed
    assert p.throw(OSError(errno.ETIMEDOUT, "no answer")) == Reconnect("s0r0")
    last = p.send(None)
    assert isinstance(last, Send) and last.sid == "s0r1"


def test_both_raced_replicas_failing_goes_to_the_third() -> None:
    p, _ = _reader(_health(), replicas=3)
    eff = p.send(None)
    assert isinstance(eff, Hedge) and (eff.first.sid, eff.second.sid) == ("s0r0", "s0r1")
    eio = OSError(errno.EIO, "bad block")
    nxt = p.send((None, [eio, OSError(errno.EIO, "bad too")]))
    assert isinstance(nxt, Send) and nxt.sid == "s0r2"


def test_every_replica_failing_raises_the_last_error() -> None:
    p, _ = _reader(_health())
    p.send(None)
    with pytest.raises(OSError) as info:
        p.send((None, [OSError(errno.EIO, "one"), OSError(errno.EIO, "two")]))
    assert info.value.errno == errno.EIO and "two" in str(info.value)


def test_a_refused_capability_in_a_race_is_renewed_not_failed_over() -> None:
    p, _ = _reader(_health())
    p.send(None)
    assert isinstance(p.send((None, [OSError(errno.EACCES, "stale cap"), None])), plan.Renew)
    again = p.send(b"cap2")  # the whole read again, with the new capability
    assert isinstance(again, Hedge) and again.first.msg.to_wire()["cap"] == b"cap2"


def test_an_unreplicated_stripe_waits_and_times_out_naming_file_stripe_and_server() -> None:
    p, _ = _reader(_health(), replicas=1, count=2, n=100)
    eff = p.send(None)
    assert isinstance(eff, Send) and eff.sid == "s0r0"  # no hedge: nobody to ask
    eff = p.throw(OSError(errno.ETIMEDOUT, "read to 127.0.0.1:1 got no reply in 60 s"))
    assert eff == Reconnect("s0r0")
    with pytest.raises(OSError) as info:
        p.send(None)
    assert info.value.errno == errno.ETIMEDOUT
    assert "inode 9 stripe 0" in str(info.value) and "s0r0" in str(info.value)


def test_a_server_that_failed_lately_is_read_last() -> None:
    clock = Clock()
    h = _health(clock)
    h.failed("s0r0")
    eff = _reader(h)[0].send(None)
    assert isinstance(eff, Hedge) and eff.first.sid == "s0r1" and eff.second.sid == "s0r0"
    clock.now += 6  # the penalty is over
    eff = _reader(h)[0].send(None)
    assert isinstance(eff, Hedge) and eff.first.sid == "s0r0"
    h.failed("s0r0")  # again: twice as long
    clock.now += 6
    assert h.penalised("s0r0")
    clock.now += 5
    assert not h.penalised("s0r0")
    h.observe("s0r0", 100, 0.01)  # an answer: the next failure starts over
    h.failed("s0r0")
    clock.now += 5.5
    assert not h.penalised("s0r0")


def test_without_health_reads_are_plain_sends_in_order() -> None:
    eff = _reader(None)[0].send(None)
    assert isinstance(eff, Send) and eff.sid == "s0r0"


def test_the_read_step_is_the_plans_first_effect_and_resumes_there() -> None:
    h = _health()
    lay = _layout()
    buf = bytearray(100)
    step = plan.read_step(INO, lay, 0, memoryview(buf), b"c", False, None, h)
    assert isinstance(step, Hedge)
    general = plan.read(None, INO, lay, 0, memoryview(buf), b"c", health=h)
    resumed = plan.resume(general, step, OSError(errno.ETIMEDOUT, "late"))
    assert resumed.send(None) == Reconnect("s0r0")
    last = resumed.send(None)
    assert isinstance(last, Send) and last.sid == "s0r1"
    # a step that answered: holes are filled as by the plan
    plan.read_step_done(step, (40, None))
    assert buf[40:] == bytes(60)


def test_reports_are_rate_limited_per_server() -> None:
    clock = Clock()
    h = _health(clock)
    assert h.report_due("a") and not h.report_due("a") and h.report_due("b")
    clock.now += 1.5
    assert h.report_due("a")


# ---------------------------------------------------------------------- the registry
def _vol(free: int) -> list[Volume]:
    return [Volume("/d", "fs", 100 << 30, free)]


def test_a_lease_runs_out_without_heartbeats_and_comes_back_with_one() -> None:
    clock = Clock()
    reg = Registry(5.0, clock, suspect_after=2.5)
    reg.register("a", "h1", 1, 100 << 30, 50 << 30, _vol(50 << 30))
    reg.register("b", "h2", 2, 100 << 30, 50 << 30, _vol(50 << 30))
    assert reg.state("a") is State.UP
    clock.now += 3
    reg.heartbeat("b", 100 << 30, 50 << 30, _vol(50 << 30))
    assert reg.state("a") is State.SUSPECT and "a" in reg.placeable()  # late: still placed
    clock.now += 2.5
    assert reg.state("a") is State.DOWN and set(reg.placeable()) == {"b"}
    assert reg.address("a") is None
    assert reg.heartbeat("a", 100 << 30, 50 << 30, _vol(50 << 30))
    assert reg.state("a") is State.UP and set(reg.placeable()) == {"a", "b"}


def test_a_refused_server_is_down_at_once_until_its_next_heartbeat() -> None:
    clock = Clock()
    reg = Registry(5.0, clock)
    reg.register("a", "h1", 1, 100 << 30, 50 << 30)
    assert reg.refused("a") and not reg.refused("a")  # the second changes nothing
    assert reg.state("a") is State.DOWN and reg.placeable() == {}
    assert reg.capacity() == (0, 0) and reg.address("a") is None
    assert reg.known_address("a") == ("h1", 1)  # what a probe connects to
    reg.heartbeat("a", 100 << 30, 50 << 30)
    assert reg.state("a") is State.UP


def test_placeable_servers_skip_draining_and_full_and_name_their_domain() -> None:
    reg = Registry(5.0, Clock(), Reserve(1 << 30, 1.0))
    reg.register("a", "h1", 1, 100 << 30, 50 << 30, _vol(50 << 30))
    reg.register("b", "h1", 2, 100 << 30, 40 << 30, _vol(40 << 30), domain="rack7")
    reg.register("c", "h2", 3, 100 << 30, 0, _vol(0))
    reg.draining("a", True)
    assert reg.placeable() == {"b": Placeable(40 << 30, "rack7")}
    assert reg.free_space() == {"b": 40 << 30}
    assert [reg.state(s) for s in "abc"] == [State.DRAINING, State.UP, State.FULL]
    reg.draining("a", False)
    assert reg.placeable()["a"] == Placeable(50 << 30, "h1")  # domain: its host
    reg.set_draining({"b"})
    desc = reg.describe({"a": {}, "b": {}, "c": {}, "gone": {"host": "x", "draining": True}})
    assert desc["b"]["draining"] and desc["b"]["state"] == "draining"
    assert desc["gone"]["state"] == "down" and not desc["gone"]["draining"]


# ---------------------------------------------------------------------- the detector
class FakeRpc:
    def __init__(self, hang: bool) -> None:
        self.hang = hang

    async def request(self, msg: Any, timeout: float | None = None) -> Any:
        if self.hang:
            await trio.sleep_forever()
        return None

    def close(self) -> None:
        pass


def _detector(outcome: str) -> tuple[Detector, Registry, list[tuple[str, int]]]:
    reg = Registry(5.0)
    reg.register("a", "h1", 1, 100, 50)
    probes: list[tuple[str, int]] = []

    async def connect(nursery: trio.Nursery, host: str, port: int) -> Any:
        probes.append((host, port))
        if outcome == "refused":
            raise OSError(errno.ECONNREFUSED, "refused")
        return FakeRpc(hang=outcome == "hang")

    return Detector(reg, connect, probe_timeout=0.2, min_gap=60.0), reg, probes


@pytest.mark.parametrize(("outcome", "state"), [("refused", State.DOWN),
                                                ("hang", State.SUSPECT), ("ok", State.UP)])
def test_a_report_is_checked_by_a_probe_before_anything_changes(outcome: str,
                                                                  state: State) -> None:
    det, reg, probes = _detector(outcome)

    async def main() -> None:
        assert await det.report("a") is state
        assert await det.report("a") is state  # within min_gap: no second probe
        assert await det.report("nobody") is State.DOWN

    trio.run(main)
    assert probes == [("h1", 1)]


# ---------------------------------------------------------------------- the trio driver
class SlowServers:
    """A DataClient stand-in: each server answers a read after its delay, filling the
    buffer with its own byte; ``None``: never (a stopped process)."""

    def __init__(self, delays: dict[str, float | None], slots: int = 64,
                 queued: bool = False) -> None:
        self.delays = delays
        self.sent: list[str] = []
        self.cancelled: list[str] = []
        self.slots = trio.Semaphore(slots)
        # queued: a server answers one request at a time, in order of arrival
        self._serving = {sid: trio.Lock() for sid in delays} if queued else None

    async def send(self, sid: str, msg: Any, payload: Any = None, into: Any = None,
                   on_reply: Any = None, held: bool = False) -> Any:
        from pfs.core.wire.rpc import Result

        assert held  # the driver took a place first
        self.sent.append(sid)
        delay = self.delays[sid]
        try:
            if self._serving is None:
                await trio.sleep(math.inf if delay is None else delay)
            else:
                async with self._serving[sid]:
                    await trio.sleep(math.inf if delay is None else delay)
        except trio.Cancelled:
            self.cancelled.append(sid)
            raise
        into[:] = sid[-1].encode() * len(into)
        return Result({"n": len(into)}, None, len(into))


def _drive(delays: dict[str, float | None], health: Health) -> tuple[bytes, SlowServers, float]:
    from pfs.client.trio_driver import TrioDriver

    servers = SlowServers(delays)
    driver = TrioDriver(servers, health=health)  # type: ignore[arg-type]
    buf = bytearray(64)
    lay = Layout(UNIT, 1, 2, (("sa", "sb"),))

    async def main() -> float:
        t0 = trio.current_time()
        await driver.run(plan.read(None, INO, lay, 0, memoryview(buf), b"c", health=health))
        return trio.current_time() - t0

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return bytes(buf), servers, elapsed


def test_the_trio_driver_takes_the_second_replica_when_the_first_is_stopped() -> None:
    h = Health(hedge_min=0.1, hedge_max=2.0)
    got, servers, elapsed = _drive({"sa": None, "sb": 0.01}, h)
    assert got == b"b" * 64  # copied over from the spare buffer
    assert 2.0 <= elapsed < 2.1  # no estimate of sa yet: hedge_max
    assert sorted(servers.sent) == ["sa", "sa", "sb"] and servers.cancelled == ["sa", "sa"]
    assert h.penalised("sa") and not h.penalised("sb")
    # the next read asks sb first: no deadline to wait
    got, servers, elapsed = _drive({"sa": None, "sb": 0.01}, h)
    assert got == b"b" * 64 and elapsed < 0.1 and servers.sent == ["sb"]


def test_a_first_replica_that_answers_in_time_is_all_it_takes() -> None:
    h = Health(hedge_min=0.1, hedge_max=2.0)
    got, servers, elapsed = _drive({"sa": 0.05, "sb": 0.01}, h)
    assert got == b"a" * 64 and servers.sent == ["sa"] and elapsed < 0.1
    assert h.deadline("sa", 64) == 0.1  # measured: 0.05 s, 4 * 0.025 deviation, bounded


def test_a_slow_first_replica_still_wins_the_race_when_it_answers_first() -> None:
    h = Health(hedge_min=0.1, hedge_max=0.2)
    got, servers, _ = _drive({"sa": 0.3, "sb": 5.0}, h)
    assert got == b"a" * 64 and sorted(servers.cancelled) == ["sa", "sb"]
    assert not h.penalised("sa")


def test_reads_queued_behind_others_are_not_hedged_for_the_wait() -> None:
    """A bulk reader (a checkpoint load) keeps many reads in flight: one waiting for a
    place among them, or for the reads before it at its server, is not late. Hedging
    them by one read's deadline sent duplicates of much of a load."""
    from pfs.client.trio_driver import TrioDriver

    h = Health(hedge_min=0.1, hedge_max=2.0)
    for _ in range(20):
        h.observe("sa", 64, 0.05)  # steady: one read's deadline is 0.1 s
    lay = Layout(UNIT, 1, 2, (("sa", "sb"),))
    for slots in (2, 64):  # waiting for a place; waiting at the server
        servers = SlowServers({"sa": 0.05, "sb": 0.05}, slots=slots, queued=True)
        driver = TrioDriver(servers, health=h)  # type: ignore[arg-type]
        bufs = [bytearray(64) for _ in range(8)]

        async def main(d: TrioDriver = driver, bs: list[bytearray] = bufs) -> None:
            async with trio.open_nursery() as n:
                for b in bs:
                    n.start_soon(d.run, plan.read(None, INO, lay, 0, memoryview(b), b"c",
                                                  health=h))

        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        assert servers.sent == ["sa"] * 8 and not servers.cancelled  # the last took 0.4 s
        assert all(b == b"a" * 64 for b in bufs)
        assert h.deadline("sa", 64) < 0.15  # per read of the queue: about 0.05 s


class StallingServers(SlowServers):
    """Queued servers; ``sa`` stops answering after its first ``answers`` reads."""

    def __init__(self, answers: int) -> None:
        super().__init__({"sa": 0.05, "sb": 0.05}, queued=True)
        self.left = answers

    async def send(self, sid: str, msg: Any, payload: Any = None, into: Any = None,
                   on_reply: Any = None, held: bool = False) -> Any:
        if sid == "sa":
            self.delays["sa"] = 0.05 if self.left > 0 else None
            self.left -= 1
        return await super().send(sid, msg, payload, into, on_reply, held)


def test_reads_queued_at_a_server_that_stalls_are_hedged_a_deadline_after_its_last_answer(
) -> None:
    from pfs.client.trio_driver import TrioDriver

    h = Health(hedge_min=0.1, hedge_max=2.0)
    for _ in range(20):
        h.observe("sa", 64, 0.05)
        h.observe("sb", 64, 0.05)
    lay = Layout(UNIT, 1, 2, (("sa", "sb"),))
    servers = StallingServers(answers=3)
    driver = TrioDriver(servers, health=h)  # type: ignore[arg-type]
    bufs = [bytearray(64) for _ in range(8)]

    async def main() -> float:
        async with trio.open_nursery() as n:
            for b in bufs:
                n.start_soon(driver.run, plan.read(None, INO, lay, 0, memoryview(b), b"c",
                                                   health=h))
        return trio.current_time()

    elapsed = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert sorted(b[:1] for b in bufs) == [b"a"] * 3 + [b"b"] * 5
    # sa's last answer at 0.15 s; the five behind it hedged 0.1 s later, then read
    # from sb one after the other: not one deadline per read queued before them
    assert elapsed < 0.15 + 0.1 + 5 * 0.05 + 0.01

"""Who a server lets in (pfs/core/wire/admission.py) and its accept loop under
descriptor exhaustion (pfs/core/wire/rpc.py), without processes."""
from __future__ import annotations

import errno
import logging
from typing import Any

import pytest
import trio

from pfs.core.daemon import logged_death
from pfs.core.wire.admission import Admission
from pfs.core.wire.rpc import RpcService


def test_a_peer_at_its_limit_is_refused_until_one_leaves() -> None:
    a = Admission(max_per_peer=2)
    assert a.admit("10.0.0.1") and a.admit("10.0.0.1")
    assert not a.admit("10.0.0.1")
    assert a.admit("10.0.0.2")
    a.leave("10.0.0.1")
    assert a.admit("10.0.0.1")
    assert a.refused == 1


def test_a_flooding_peer_evicts_only_its_own_handshakes() -> None:
    a = Admission(max_unauthenticated=8, max_unauthenticated_per_peer=3)
    legit = a.handshake("client")
    flood = [a.handshake("attacker") for _ in range(50)]
    assert not legit.evicted
    assert sum(not t.evicted for t in flood) == 3  # the newest three remain
    assert all(t.evicted for t in flood[:-3])
    assert a.unauthenticated == 4
    a.finish(legit)  # authenticated: out of the pool
    assert a.unauthenticated == 3
    a.finish(legit)  # twice is harmless
    assert a.unauthenticated == 3


def test_a_full_pool_evicts_from_the_peer_holding_the_most() -> None:
    a = Admission(max_unauthenticated=6, max_unauthenticated_per_peer=4)
    legit = a.handshake("client")
    many = [a.handshake("big") for _ in range(4)]
    few = [a.handshake("small")]
    assert a.unauthenticated == 6
    newcomer = a.handshake("other")  # pool full: the oldest of "big" goes
    assert many[0].evicted and not legit.evicted and not few[0].evicted
    assert not newcomer.evicted and a.unauthenticated == 6
    assert a.evict_one() and many[1].evicted
    for t in (legit, *many, *few, newcomer):
        a.finish(t)
    assert a.unauthenticated == 0
    assert not a.evict_one()


class _Exhausted:
    """A listening socket whose accept fails with EMFILE ``fails`` times, then waits."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.calls = 0
        self.waiting = trio.Event()  # set once accept stopped failing

    def __enter__(self) -> _Exhausted:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    async def accept(self) -> Any:
        self.calls += 1
        if self.calls <= self.fails:
            raise OSError(errno.EMFILE, "Too many open files")
        self.waiting.set()
        await trio.sleep_forever()


def test_the_accept_loop_backs_off_on_emfile_and_logs_why(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    async def main() -> None:
        svc = RpcService()
        async with trio.open_nursery() as n:
            n.start_soon(svc._accept_loop, sock, None, False, lambda: None)
            with trio.fail_after(20):
                await sock.waiting.wait()
            n.cancel_scope.cancel()

    sock: Any = None

    async def start() -> None:
        nonlocal sock
        sock = _Exhausted(fails=5)
        await main()

    with caplog.at_level(logging.WARNING, logger="pfs.core.wire.rpc"):
        trio.run(start)
    assert sock.calls == sock.fails + 1  # still accepting after every failure
    assert any("accept failed" in r.getMessage() and "Too many open files" in r.getMessage()
               and "descriptors open" in r.getMessage() for r in caplog.records)


def test_other_accept_errors_still_end_the_loop() -> None:
    class Broken(_Exhausted):
        async def accept(self) -> Any:
            raise OSError(errno.EBADF, "Bad file descriptor")

    async def main() -> None:
        async with trio.open_nursery() as n:
            sock: Any = Broken(0)
            n.start_soon(RpcService()._accept_loop, sock, None, False, lambda: None)

    with pytest.raises(BaseExceptionGroup) as info:
        trio.run(main)
    assert info.group_contains(OSError)


def test_a_server_death_logs_the_real_exception(caplog: pytest.LogCaptureFixture) -> None:
    async def serve() -> None:
        async with trio.open_nursery() as n:
            async def boom() -> None:
                raise OSError(errno.EMFILE, "Too many open files")

            n.start_soon(boom)
            await trio.sleep_forever()

    async def main() -> None:
        with logged_death("test server"):
            await serve()

    with caplog.at_level(logging.CRITICAL, logger="pfs.core.daemon"), \
            pytest.raises(OSError) as info:
        trio.run(main)
    assert info.value.errno == errno.EMFILE  # the exception itself, not a group
    [rec] = [r for r in caplog.records if "died" in r.getMessage()]
    assert "test server died: OSError: [Errno 24] Too many open files" == rec.getMessage()
    assert rec.exc_info is not None and rec.exc_info[1] is info.value

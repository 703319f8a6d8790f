"""RpcClient's reply reading over a real socket pair: a caller alone reads its own reply
(no reader task involved), others in flight are served by whoever reads, and timeouts,
cancellation and a lost peer behave the same whoever was reading."""
from __future__ import annotations

import errno
import logging

import pytest
import trio
import trio.testing

from pfs.core.wire import rpc, transport
from pfs.core.wire.protocol import Kind
from pfs.core.wire.rpc import RpcClient
from pfs.core.wire.transport import Connection


def _run(body) -> None:
    """``body(client, server_conn, nursery)``; the client's reader task runs unless the
    body says otherwise (``body.no_reader``)."""

    async def main() -> None:
        a, b = trio.socket.socketpair()
        cli, srv = RpcClient(Connection(a)), Connection(b)
        try:
            async with trio.open_nursery() as n:
                if not getattr(body, "no_reader", False):
                    n.start_soon(cli.run)
                with trio.fail_after(10):
                    await body(cli, srv, n)
                n.cancel_scope.cancel()
        finally:
            cli.close()
            srv.close()

    trio.run(main)


async def _reply(srv: Connection, rid: int, fields: dict, payload: bytes = b"") -> None:
    await srv.send_frame(Kind.REPLY, rid, fields, payload or None)


def test_a_caller_alone_reads_its_own_reply() -> None:
    """No reader task at all: a call with nothing else in flight still gets its reply,
    payload included, and an error frame as its OSError."""

    async def body(cli, srv, n) -> None:
        async def server() -> None:
            for _ in range(3):
                head = await srv.recv_head()
                if head.fields["m"] == "boom":
                    await srv.send_frame(Kind.ERROR, head.rid, {"errno": 28, "msg": "full"})
                else:
                    await _reply(srv, head.rid, {"ok": head.rid}, b"xyz")

        n.start_soon(server)
        buf = bytearray(8)
        r = await cli.call("read", into=memoryview(buf))
        assert r.fields == {"ok": 1} and bytes(buf[:r.nbytes]) == b"xyz"
        r = await cli.call("read")
        assert r.fields == {"ok": 2} and r.payload == b"xyz"
        with pytest.raises(OSError) as ei:
            await cli.call("boom")
        assert ei.value.errno == 28
        assert cli.alive

    body.no_reader = True  # type: ignore[attr-defined]
    _run(body)


def test_timeout_of_a_caller_alone_keeps_the_connection() -> None:
    """The reply comes after the caller gave up: ETIMEDOUT, and the late reply is skipped
    by whoever reads next; the connection serves the next call."""

    async def body(cli, srv, n) -> None:
        late = trio.Event()

        async def server() -> None:
            first = await srv.recv_head()
            await late.wait()
            await _reply(srv, first.rid, {"late": True}, b"L" * 100)
            second = await srv.recv_head()
            await _reply(srv, second.rid, {"second": True})

        n.start_soon(server)
        buf = bytearray(100)
        with pytest.raises(OSError) as ei:
            await cli.call("slow", into=memoryview(buf), timeout=0.2)
        assert ei.value.errno == errno.ETIMEDOUT and "no reply" in str(ei.value)
        late.set()
        assert (await cli.call("next")).fields == {"second": True}
        assert bytes(buf) == bytes(100)  # the late payload never landed in it
        assert cli.alive

    _run(body)


def test_others_in_flight_get_their_replies_when_the_reading_caller_leaves() -> None:
    """A reads (alone when it called), B waits; A is cancelled before any reply: the
    reader task takes over, and B gets its reply; A's late one is dropped."""

    async def body(cli, srv, n) -> None:
        heads = []
        results: dict[str, object] = {}

        async def server() -> None:
            heads.append(await srv.recv_head())
            heads.append(await srv.recv_head())

        async def call_b() -> None:
            results["b"] = (await cli.call("b")).fields

        n.start_soon(server)
        with trio.CancelScope() as a_scope:
            n.start_soon(call_b)  # starts once A waits

            async def cancel_a() -> None:
                while len(heads) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked()
                a_scope.cancel()

            n.start_soon(cancel_a)
            await cli.call("a")
        assert a_scope.cancelled_caught
        a, b = heads
        await _reply(srv, a.rid, {"a": 1}, b"A" * 10)
        await _reply(srv, b.rid, {"b": 2})
        while "b" not in results:  # noqa: ASYNC110
            await trio.sleep(0.01)
        assert results["b"] == {"b": 2}
        assert cli.alive

    _run(body)


def test_replies_out_of_order_reach_their_callers() -> None:
    """Many calls, answered in reverse order with payloads of several sizes (some too
    big to arrive with their head): each caller gets its own."""

    async def body(cli, srv, n) -> None:
        count = 8
        got: dict[int, bytes] = {}

        async def server() -> None:
            heads = [await srv.recv_head() for _ in range(count)]
            for h in reversed(heads):
                i = h.fields["i"]
                await _reply(srv, h.rid, {"i": i}, bytes([i]) * (i * 40_000 + 1))

        async def one(i: int) -> None:
            buf = bytearray(i * 40_000 + 1)
            r = await cli.call("get", {"i": i}, into=memoryview(buf))
            assert r.fields == {"i": i} and r.nbytes == len(buf)
            got[i] = bytes(buf)

        n.start_soon(server)
        async with trio.open_nursery() as m:
            for i in range(count):
                m.start_soon(one, i)
        assert got == {i: bytes([i]) * (i * 40_000 + 1) for i in range(count)}

    _run(body)


def test_idle_connection_closed_by_the_peer_is_not_alive() -> None:
    """Nobody reads between calls: ``alive`` itself notices the peer went away (the
    owner then reconnects instead of sending into a dead connection)."""

    async def body(cli, srv, n) -> None:
        async def server() -> None:
            head = await srv.recv_head()
            await _reply(srv, head.rid, {})

        n.start_soon(server)
        await cli.call("ping")
        assert cli.alive
        srv.close()
        with trio.fail_after(2):
            while cli.alive:  # noqa: ASYNC110
                await trio.sleep(0.01)
        with pytest.raises(OSError) as ei:
            await cli.call("ping")
        assert ei.value.errno == errno.ECONNRESET

    _run(body)


def test_a_connection_just_used_is_not_probed() -> None:
    """Back-to-back calls cost no liveness system call: ``alive`` asks the socket only
    once the connection was idle for ``PEER_CHECK_IDLE``, and then still sees a peer
    that went away before the next request is sent."""

    async def body(cli, srv, n) -> None:
        probes = []
        real = cli.conn.peer_gone

        def counted() -> bool:
            probes.append(1)
            return real()

        cli.conn.peer_gone = counted

        async def server() -> None:
            for _ in range(3):
                head = await srv.recv_head()
                await _reply(srv, head.rid, {})

        n.start_soon(server)
        for _ in range(3):
            assert cli.alive
            await cli.call("ping")
        assert cli.alive and probes == [1]  # only the first, on a never-used connection
        srv.close()
        await trio.sleep(rpc.PEER_CHECK_IDLE)  # the idle time that makes it look
        assert not cli.alive  # the first look sees it: no request goes out on it
        with pytest.raises(OSError) as ei:
            await cli.call("ping")
        assert ei.value.errno == errno.ECONNRESET

    body.no_reader = True  # type: ignore[attr-defined]
    _run(body)


class _CountingSocket:
    """A plain socket that counts receives failing with EAGAIN."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.eagain = 0

    def recv_into(self, buf) -> int:
        try:
            return self.sock.recv_into(buf)
        except BlockingIOError:
            self.eagain += 1
            raise

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_a_caller_whose_replies_come_late_waits_before_receiving() -> None:
    """Replies that are never there straight after the request (a remote server): after
    LATE_TO_WAIT of them the caller waits for the socket instead of trying a receive
    that fails with EAGAIN first, but for one probe every PROBE_LATE calls; a probe that
    finds its reply there at once (a local server) puts it back to receiving first."""

    async def body(cli, srv, n) -> None:
        counting = _CountingSocket(cli.conn._raw)
        cli.conn._raw = counting
        calls = transport.PROBE_LATE

        async def server() -> None:
            for _ in range(calls):
                head = await srv.recv_head()
                await trio.sleep(0.001)  # the reply comes later, as over a network
                await _reply(srv, head.rid, {"n": head.rid})

        n.start_soon(server)
        for i in range(1, calls + 1):
            assert (await cli.call("ping")).fields == {"n": i}
        assert counting.eagain == transport.LATE_TO_WAIT  # then it waited first
        await _reply(srv, calls + 1, {"n": "early"})  # there before it is asked for
        await trio.testing.wait_all_tasks_blocked()
        assert (await cli.call("ping")).fields == {"n": "early"}  # the probe's call
        assert counting.eagain == transport.LATE_TO_WAIT and cli.conn._late == 0

    body.no_reader = True  # type: ignore[attr-defined]
    _run(body)


def test_a_reply_already_there_costs_no_timeout_scope(monkeypatch) -> None:
    """A small request sent at once whose reply is already there waits for nothing, so
    enters no cancel scope; one whose reply is not yet there still times out."""
    scopes = []
    real = trio.move_on_after

    def counted(*args, **kw):
        scopes.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(trio, "move_on_after", counted)

    async def body(cli, srv, n) -> None:
        await _reply(srv, 1, {"n": "early"})  # there before it is asked for
        await trio.testing.wait_all_tasks_blocked()
        assert (await cli.call("ping")).fields == {"n": "early"}
        assert scopes == []
        with pytest.raises(OSError) as ei:  # nobody answers this one
            await cli.call("ping", timeout=0.2)
        assert ei.value.errno == errno.ETIMEDOUT and scopes == [1]

    body.no_reader = True  # type: ignore[attr-defined]
    _run(body)


def test_a_request_that_does_not_fit_the_socket_goes_out_within_the_timeout() -> None:
    """The socket's buffers are full (a peer that stopped reading): what is left of the
    request waits under the call's timeout: ETIMEDOUT."""

    async def body(cli, srv, n) -> None:
        raw = cli.conn._raw
        try:
            while True:
                raw.send(b"x" * 65536)
        except BlockingIOError:
            pass
        with trio.fail_after(5), pytest.raises(OSError) as ei:
            await cli.call("ping", {"pad": b"p" * 1000}, timeout=0.2)
        assert ei.value.errno == errno.ETIMEDOUT

    body.no_reader = True  # type: ignore[attr-defined]
    _run(body)


def test_peer_lost_while_a_caller_alone_waits() -> None:
    """The peer closes before answering: ECONNRESET at once, not at the timeout."""

    async def body(cli, srv, n) -> None:
        async def server() -> None:
            await srv.recv_head()
            srv.close()

        n.start_soon(server)
        with trio.fail_after(5), pytest.raises(OSError) as ei:
            await cli.call("ping", timeout=30)
        assert ei.value.errno == errno.ECONNRESET
        assert not cli.alive

    _run(body)


class _InlineSvc(rpc.RpcService):
    """Methods answered in the reader task: one that answers, one that fails as asked,
    one with a bug."""

    inline_methods = frozenset({"ok", "boom", "bug"})
    max_in_flight = 1

    async def rpc_ok(self, ctx, req):
        return {"i": req.int("i")}

    async def rpc_boom(self, ctx, req):
        raise OSError(errno.ENOSPC, "disk full, as asked")

    async def rpc_bug(self, ctx, req):
        raise RuntimeError("a handler bug")


def test_inline_requests_answer_errors_and_bugs_and_keep_the_connection(caplog) -> None:
    """A request answered in the server's reader task (no slot, no task of its own)
    answers its handler's OSError as it is and a bug as EIO (logged); the connection
    serves on, and inline requests are answered past ``max_in_flight`` (they hold no
    slot)."""

    async def body(cli, srv, n) -> None:
        n.start_soon(_InlineSvc().serve_connection, srv)
        with pytest.raises(OSError) as ei:
            await cli.call("boom")
        assert ei.value.errno == errno.ENOSPC and "disk full" in str(ei.value)
        with pytest.raises(OSError) as ei:
            await cli.call("bug")
        assert ei.value.errno == errno.EIO and "internal error in bug" in str(ei.value)
        async with trio.open_nursery() as m:  # more at once than max_in_flight
            for i in range(5):
                m.start_soon(cli.call, "ok", {"i": i})
        assert (await cli.call("ok", {"i": 7})).fields == {"i": 7}

    with caplog.at_level(logging.ERROR):
        _run(body)
    assert "bug failed" in caplog.text and "a handler bug" in caplog.text


def test_a_server_waits_for_a_slow_peers_next_request_before_receiving() -> None:
    """After an inline reply a server reads the peer's next request as a client reads
    its reply: from a peer whose requests are never there straight after the reply (a
    client alone, over a network) it waits for the socket after LATE_TO_WAIT of them
    instead of a receive failing with EAGAIN first; every answer still comes."""
    calls = transport.PROBE_LATE - 1

    async def body(cli, srv, n) -> None:
        counting = _CountingSocket(srv._raw)
        srv._raw = counting
        n.start_soon(_InlineSvc().serve_connection, srv)
        for i in range(calls):
            assert (await cli.call("ok", {"i": i})).fields == {"i": i}
            await trio.sleep(0.001)  # the next request comes later
        # LATE_TO_WAIT after replies (and the connection's first read, if it came
        # before the first request); before, one after every reply
        assert transport.LATE_TO_WAIT <= counting.eagain <= transport.LATE_TO_WAIT + 1

    _run(body)


def _held_call(delay: float, hold_s: float) -> tuple[dict, list[str], int]:
    """One call made holding the loop (``rpc.Hold``) to a server in a thread that answers
    after ``delay`` s: the reply's fields, what happened in order ("waits" when the
    caller gave the loop back, "tick" each time another task ran), requests received."""
    import socket
    import threading
    import time

    from pfs.core.wire.blocking import BlockingConnection

    a, b = socket.socketpair()
    seen: list[str] = []
    received: list[int] = []

    def server() -> None:
        conn = BlockingConnection(b, timeout=10)
        head = conn.recv_head()
        assert head is not None
        received.append(head.rid)
        time.sleep(delay)
        conn.send_frame(Kind.REPLY, head.rid, {"ok": head.fields["m"]})
        conn.recv_head()  # until the client closes

    async def main() -> dict:
        t = threading.Thread(target=server, daemon=True)
        t.start()
        cli = RpcClient(Connection(trio.socket.from_stdlib_socket(a)))

        async def ticker() -> None:
            while True:
                await trio.sleep(0.01)
                seen.append("tick")

        try:
            async with trio.open_nursery() as n:
                n.start_soon(cli.run)
                n.start_soon(ticker)
                await trio.sleep(0.05)
                seen.clear()
                r = await cli.call("mkdir", hold=rpc.Hold(hold_s, lambda: seen.append("waits")))
                n.cancel_scope.cancel()
        finally:
            cli.close()
        t.join(5)
        return r.fields

    fields = trio.run(main)
    return fields, seen, len(received)


def test_a_call_holding_the_loop_gets_its_reply_without_giving_it_back() -> None:
    """A reply within the hold is read in place: no other task ran meanwhile and the
    caller never said it waits."""
    fields, seen, sent = _held_call(delay=0.03, hold_s=2.0)
    assert fields == {"ok": "mkdir"} and sent == 1
    assert seen == []


def test_a_call_holding_the_loop_past_its_hold_waits_the_usual_way_sent_once() -> None:
    """A reply later than the hold: the caller says it waits (once), gives the loop back
    (other tasks run), and gets the reply of its one request."""
    fields, seen, sent = _held_call(delay=0.3, hold_s=0.05)
    assert fields == {"ok": "mkdir"} and sent == 1
    assert seen[0] == "waits" and seen.count("waits") == 1
    assert "tick" in seen

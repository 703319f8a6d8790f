"""The sans-IO frame protocol, in memory: round trips, limits, malformed input."""
from __future__ import annotations

import errno
import struct

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from pfs.core.errors import LocalProtocolError, RemoteProtocolError
from pfs.core.wire.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    FrameDecoder,
    Kind,
    Limits,
    Peer,
    encode_frame,
)

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20)
    | st.binary(max_size=50),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)
maps = st.dictionaries(st.text(min_size=1, max_size=10), values, max_size=8)


@given(st.lists(st.tuples(st.sampled_from(list(Kind)), st.integers(0, 2**64 - 1), maps,
                          st.binary(max_size=3000)), max_size=6),
       st.integers(1, 97))
def test_frames_round_trip_in_any_chunking(frames, chunk: int) -> None:
    wire = b"".join(encode_frame(k, rid, f, p) for k, rid, f, p in frames)
    peer = Peer()
    got = []
    for i in range(0, len(wire), chunk):
        got.extend(peer.receive(wire[i:i + chunk]))
    assert [(h.kind, h.rid, h.fields, p) for h, p in got] == frames


def test_payload_is_taken_straight_into_caller_buffer() -> None:
    dec = FrameDecoder()
    frame = encode_frame(Kind.REPLY, 7, {"n": 10}, b"0123456789")
    dec.feed(frame[:HEADER_SIZE + 8])  # header, map and a little payload
    head = dec.next_head()
    assert head is not None and head.payload_len == 10 and dec.pending_payload == 10
    dest = bytearray(10)
    n = dec.take_payload_into(memoryview(dest))
    # the rest would come from the socket: the caller reports it received it itself
    rest = frame[HEADER_SIZE + 8:]
    dest[n:] = rest
    dec.payload_received(len(rest))
    assert bytes(dest) == b"0123456789" and dec.pending_payload == 0


def _raw(kind=1, map_len=None, payload_len=0, body=b"\x80", magic=MAGIC, version=VERSION):
    return HEADER.pack(magic, version, kind, 0, len(body) if map_len is None else map_len,
                       1, payload_len) + body


@pytest.mark.parametrize("data,match", [
    (_raw(magic=b"HT"), "bad magic"),
    (_raw(version=9), "version"),
    (_raw(kind=77), "kind"),
    (_raw(map_len=1 << 30), "exceeds limit"),
    (_raw(payload_len=1 << 40), "exceeds limit"),
    (_raw(body=b"\xc1"), "invalid msgpack"),
    (_raw(body=msgpack.packb([1, 2])), "not a map"),
    (_raw(body=msgpack.packb({1: 2})), "invalid msgpack|keys"),
    (_raw(body=msgpack.packb({str(i): i for i in range(100)})), "fields"),
    (_raw(body=msgpack.packb({"a": "x" * 70000})), "invalid msgpack"),
])
def test_malformed_frames_are_remote_protocol_errors(data: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        Peer().receive(data)


def test_limits_checked_before_the_map_arrives() -> None:
    """A declared oversized map is refused from the header alone: nothing is buffered for it."""
    dec = FrameDecoder(Limits(max_map=100))
    dec.feed(HEADER.pack(MAGIC, VERSION, 1, 0, 101, 1, 0))
    with pytest.raises(RemoteProtocolError):
        dec.next_head()


def test_encoder_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(Kind.REQUEST, 1, {"x": object()})
    with pytest.raises(LocalProtocolError):
        encode_frame(Kind.REQUEST, 1, {}, b"x" * 11, Limits(max_payload=10))
    with pytest.raises(LocalProtocolError):
        encode_frame(Kind.REQUEST, -1, {})


@given(st.binary(max_size=400))
def test_decoder_never_crashes_on_garbage(data: bytes) -> None:
    peer = Peer(Limits(max_map=4096, max_payload=4096))
    try:
        peer.receive(data)
    except RemoteProtocolError:
        pass


@given(st.lists(st.tuples(maps, st.binary(max_size=100)), min_size=1, max_size=3),
       st.data())
def test_mutated_frames_give_frames_or_protocol_errors(frames, data) -> None:
    wire = bytearray(b"".join(encode_frame(Kind.REQUEST, i, f, p) for i, (f, p) in enumerate(frames)))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(wire) - 1))
        wire[pos] = data.draw(st.integers(0, 255))
    try:
        for head, payload in Peer(Limits(max_payload=1 << 16)).receive(bytes(wire)):
            assert isinstance(head.fields, dict) and len(payload) == head.payload_len
    except RemoteProtocolError:
        pass


def test_header_layout_is_stable() -> None:
    frame = encode_frame(Kind.ERROR, 0x0102030405060708, {}, b"")
    assert frame[:2] == b"PF" and frame[2] == 1 and frame[3] == 3
    assert struct.unpack("!Q", frame[10:18])[0] == 0x0102030405060708


# -- the trio layer, over a real socket pair ------------------------------------
def test_rpc_over_socketpair_many_in_flight() -> None:
    from pfs.core.wire.rpc import RpcClient, RpcService
    from pfs.core.wire.transport import Connection

    class Svc(RpcService):
        async def rpc_echo(self, ctx, req):
            await trio.sleep(0.001 * (req.int("i") % 5))  # replies come back out of order
            from pfs.core.wire.rpc import Reply
            return Reply({"i": req.int("i")}, payload=bytes(req.payload or b"")[::-1])

        async def rpc_boom(self, ctx, req):
            raise OSError(28, "disk full, as asked")

    async def main() -> None:
        a, b = trio.socket.socketpair()
        async with trio.open_nursery() as n:
            n.start_soon(Svc().serve_connection, Connection(b))
            cli = RpcClient(Connection(a))
            n.start_soon(cli.run)
            results = {}

            async def one(i: int) -> None:
                buf = bytearray(10)
                r = await cli.call("echo", {"i": i}, payload=str(i).encode(),
                                   into=memoryview(buf))
                results[i] = (r.fields["i"], bytes(buf[:r.nbytes]))

            async with trio.open_nursery() as m:
                for i in range(50):
                    m.start_soon(one, i)
            assert results == {i: (i, str(i).encode()[::-1]) for i in range(50)}
            with pytest.raises(OSError) as ei:
                await cli.call("boom")
            assert ei.value.errno == 28 and "disk full" in str(ei.value)
            with pytest.raises(OSError) as ei:
                await cli.call("nope")
            assert ei.value.errno == 38
            with pytest.raises(OSError) as ei:
                await cli.call("echo", {"i": "not an int"})
            assert ei.value.errno == 22
            cli.close()
            n.cancel_scope.cancel()

    trio.run(main)


def test_requests_that_wait_run_side_by_side_up_to_max_in_flight() -> None:
    """Requests answered outside the reader wait concurrently (one waiting never holds
    up the next), at most ``max_in_flight`` at once; the connection's handlers end with
    it, without waiting out the grace period."""
    from pfs.core.wire.rpc import Reply, RpcClient, RpcService
    from pfs.core.wire.transport import Connection

    class Svc(RpcService):
        max_in_flight = 3

        def __init__(self) -> None:
            super().__init__()
            self.now = self.peak = 0
            self.release, self.full = trio.Event(), trio.Event()

        async def rpc_hold(self, ctx, req):
            self.now += 1
            self.peak = max(self.peak, self.now)
            if self.now == self.max_in_flight:
                self.full.set()
            try:
                await self.release.wait()
            finally:
                self.now -= 1
            return Reply({"i": req.int("i")})

    async def main() -> None:
        svc = Svc()
        a, b = trio.socket.socketpair()
        served = trio.Event()

        async def serve() -> None:
            await svc.serve_connection(Connection(b))
            served.set()

        async with trio.open_nursery() as n:
            n.start_soon(serve)
            cli = RpcClient(Connection(a))
            n.start_soon(cli.run)
            got: list[int] = []

            async def one(i: int) -> None:
                got.append((await cli.call("hold", {"i": i})).fields["i"])

            async with trio.open_nursery() as m:
                for i in range(10):
                    m.start_soon(one, i)
                with trio.fail_after(5):
                    await svc.full.wait()
                await trio.sleep(0.05)
                assert svc.now == 3 and not got  # the 4th is not read until one ends
                svc.release.set()
            assert sorted(got) == list(range(10)) and svc.peak == 3
            cli.close()
            with trio.fail_after(5):
                await served.wait()
            n.cancel_scope.cancel()

    trio.run(main)


def _raw_pair():
    """An ``RpcClient`` over one end of a socket pair; the test plays the server on the
    other end with a bare ``Connection``."""
    from pfs.core.wire.rpc import RpcClient
    from pfs.core.wire.transport import Connection

    a, b = trio.socket.socketpair()
    return RpcClient(Connection(a)), Connection(b)


def _run_pair(body) -> None:
    """Run ``body(client, server_conn)`` on a fresh pair, closing both afterwards."""

    async def main() -> None:
        cli, srv = _raw_pair()
        try:
            await body(cli, srv)
        finally:
            cli.close()
            srv.close()

    trio.run(main)


def test_late_reply_never_lands_in_a_buffer_the_caller_took_back() -> None:
    """A call that timed out while its reply's payload was arriving: the caller owns its
    buffer again, so the rest of that payload must not be written into it."""
    from pfs.core.wire.protocol import encode_head

    async def body(cli, srv) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(cli.run)
            buf = bytearray(1000)
            calling = trio.Event()

            async def server() -> None:
                head = await srv.recv_head()
                await srv._sendall(encode_head(Kind.REPLY, head.rid, {}, 1000) + b"a" * 10)
                await calling.wait()  # the caller gave up and reused its buffer
                try:
                    await srv._sendall(b"y" * 990)
                except OSError:  # the client may have dropped the connection
                    pass

            n.start_soon(server)
            with pytest.raises(OSError) as ei:
                await cli.call("read", into=memoryview(buf), timeout=0.3)
            assert ei.value.errno == errno.ETIMEDOUT
            buf[:] = b"x" * 1000  # reused for something else
            calling.set()
            await trio.sleep(0.3)
            assert bytes(buf) == b"x" * 1000
            n.cancel_scope.cancel()

    _run_pair(body)


def test_giving_up_mid_reply_keeps_the_connection_for_other_calls() -> None:
    """A read cancelled while its payload is arriving: the rest still comes in promptly,
    so the connection stays, and another read sharing it gets its reply."""
    from pfs.core.wire.protocol import encode_head

    async def body(cli, srv) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(cli.run)
            cancelled = trio.Event()
            results: dict[str, object] = {}

            async def server() -> None:
                a = await srv.recv_head()
                b = await srv.recv_head()
                await srv._sendall(encode_head(Kind.REPLY, a.rid, {}, 1000) + b"a" * 10)
                await cancelled.wait()
                await srv._sendall(b"a" * 990)
                await srv._sendall(encode_head(Kind.REPLY, b.rid, {"b": 1}, 3) + b"bbb")

            async def read_a(scope_out: list[trio.CancelScope]) -> None:
                with trio.CancelScope() as cs:
                    scope_out.append(cs)
                    await cli.call("read", into=memoryview(bytearray(1000)))
                results["a_cancelled"] = cs.cancelled_caught

            async def read_b() -> None:
                buf = bytearray(3)
                r = await cli.call("read", into=memoryview(buf))
                results["b"] = (r.fields, bytes(buf))

            n.start_soon(server)
            scopes: list[trio.CancelScope] = []
            n.start_soon(read_a, scopes)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(read_b)
            with trio.fail_after(5):
                while 1 in cli._pending:  # until A's reply is being received  # noqa: ASYNC110
                    await trio.sleep(0.01)
            scopes[0].cancel()
            await trio.testing.wait_all_tasks_blocked()
            cancelled.set()
            with trio.fail_after(5):
                while "b" not in results or "a_cancelled" not in results:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            assert results["a_cancelled"] is True
            assert results["b"] == ({"b": 1}, b"bbb")
            assert cli.alive
            n.cancel_scope.cancel()

    _run_pair(body)


def test_connection_lost_mid_reply_fails_the_call_at_once() -> None:
    """The reply's payload stops half-way because the peer went away: the call fails with
    ECONNRESET now, not with ETIMEDOUT when its (long) timeout runs out."""
    from pfs.core.wire.protocol import encode_head

    async def body(cli, srv) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(cli.run)

            async def server() -> None:
                head = await srv.recv_head()
                await srv._sendall(encode_head(Kind.REPLY, head.rid, {}, 1000) + b"a" * 10)
                srv.close()

            n.start_soon(server)
            with trio.fail_after(5), pytest.raises(OSError) as ei:
                await cli.call("read", into=memoryview(bytearray(1000)), timeout=30)
            assert ei.value.errno == errno.ECONNRESET
            assert not cli.alive
            cli.close()
            n.cancel_scope.cancel()

    _run_pair(body)


def test_request_cut_off_mid_frame_does_not_corrupt_the_stream() -> None:
    """A call that times out (or is cancelled) half-way through sending its payload must
    not leave half a frame on the connection for the next request to be read into."""
    from pfs.core.wire.rpc import RpcService

    got: list[str] = []

    class Svc(RpcService):
        async def rpc_ping(self, ctx, req):
            got.append("ping")
            return {"pong": True}

        async def rpc_put(self, ctx, req):
            got.append("put")
            return {}

    async def body(cli, srv) -> None:
        release = trio.Event()

        async def serve_later() -> None:
            await release.wait()  # a stalled server: nothing is read until then
            await Svc().serve_connection(srv)

        async with trio.open_nursery() as n:
            n.start_soon(cli.run)
            n.start_soon(serve_later)
            with pytest.raises(OSError) as ei:
                await cli.call("put", payload=b"p" * (32 << 20), timeout=0.5)
            assert ei.value.errno == errno.ETIMEDOUT
            release.set()
            # the next call either goes through whole or fails as a broken connection;
            # it must not hang (its frame read as the rest of the cut-off payload)
            with trio.fail_after(5):
                try:
                    r = await cli.call("ping", timeout=3)
                    assert r.fields == {"pong": True}
                except OSError as exc:
                    assert exc.errno in (errno.ECONNRESET, errno.ENOTCONN), exc
            assert "ping" not in got or got[0] == "put"
            cli.close()
            n.cancel_scope.cancel()

    _run_pair(body)

"""Sealed frames in memory (pfs/core/wire/seal.py): round trips in both suites and any
chunking, and every kind of tampering detected before a byte is handed out: a flipped
bit anywhere, a frame replayed, reordered, dropped, injected or reflected, keys from
another negotiation; the suites' negotiation rules."""
from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pfs.core.errors import RemoteProtocolError
from pfs.core.wire import seal
from pfs.core.wire.protocol import HEADER_SIZE, FrameDecoder, Kind, Peer, encode_head
from pfs.core.wire.seal import FrameAuthError, Session

SUITES = [seal.MAC, seal.ENCRYPT]


def pair(suite: str, transcript: bytes = b"t") -> tuple[Session, Session]:
    key, nc, ns = os.urandom(32), os.urandom(32), os.urandom(32)
    c2s, s2c = seal.session_keys(key, nc, ns, transcript)
    return Session(suite, c2s, s2c, "server"), Session(suite, s2c, c2s, "client")


def sealed_frame(s: Session, rid: int, fields: dict, payload: bytes = b"",
                 pieces: int = 1) -> bytes:
    """One frame as the transports send it (a payload gathered from ``pieces`` buffers)."""
    sealer = s.sealer
    head = sealer.head(encode_head(Kind.REQUEST, rid, fields, len(payload)), HEADER_SIZE)
    if not payload:
        return head
    step = max(1, -(-len(payload) // pieces))
    views = [memoryview(payload)[i:i + step] for i in range(0, len(payload), step)]
    if sealer.encrypt:
        if len(payload) <= seal.CHUNK:
            return head + bytes(sealer.encrypt_into(views, memoryview(bytearray(
                len(payload) + seal.TAG))))
        enc = sealer.encrypt_stream()
        out = bytearray()
        for v in views:
            o = bytearray(len(v))
            enc.update_into(v, memoryview(o))
            out += o
        return head + bytes(out) + enc.tag()
    if len(views) == 1:
        return head + payload + sealer.payload_tag(views)
    mac = sealer.mac_stream()
    for v in views:
        mac.update(v)
    return head + payload + mac.tag()


FRAMES: list[tuple[int, dict[str, Any], bytes]] = [
    (1, {"m": "stat", "ino": 1}, b""), (2, {"m": "write"}, b"x" * 5000),
    (3, {"m": "read"}, os.urandom(seal.CHUNK + 1000)), (4, {"m": "ping"}, b"")]


@pytest.mark.parametrize("suite", SUITES)
@given(chunk=st.integers(1, 70000), pieces=st.integers(1, 4))
def test_sealed_frames_round_trip_in_any_chunking(suite: str, chunk: int, pieces: int) -> None:
    cli, srv = pair(suite)
    wire = b"".join(sealed_frame(cli, r, f, p, pieces) for r, f, p in FRAMES)
    peer = Peer(opener=srv.opener)
    got = []
    for i in range(0, len(wire), chunk):
        got.extend(peer.receive(wire[i:i + chunk]))
    assert [(h.rid, h.fields, p) for h, p in got] == FRAMES


@pytest.mark.parametrize("suite", SUITES)
def test_encrypt_hides_map_and_payload_mac_does_not(suite: str) -> None:
    cli, _ = pair(suite)
    wire = sealed_frame(cli, 1, {"cap": "SECRET-CAPABILITY"}, b"PAYLOAD-BYTES" * 10)
    hidden = suite == seal.ENCRYPT
    assert (b"SECRET-CAPABILITY" not in wire) == hidden
    assert (b"PAYLOAD-BYTES" not in wire) == hidden


@pytest.mark.parametrize("suite", SUITES)
def test_every_flipped_byte_is_detected(suite: str) -> None:
    cli, srv = pair(suite)
    frames = [sealed_frame(cli, 1, {"m": "a"}, b""), sealed_frame(cli, 2, {"m": "b"}, b"p" * 300)]
    wire = b"".join(frames)
    for pos in range(len(wire)):
        for bit in (0x01, 0x80):
            bad = bytearray(wire)
            bad[pos] ^= bit
            peer = Peer(opener=Session(suite, srv.sealer.key, cli.sealer.key, "c").opener)
            try:
                got = peer.receive(bytes(bad))
            except RemoteProtocolError as exc:
                assert isinstance(exc, FrameAuthError), (pos, exc)
                assert exc.errno == errno.EBADMSG
                continue
            # a flip in a length may leave the decoder waiting for bytes that never
            # come; what it handed out is never wrong
            assert [(h.rid, h.fields, p) for h, p in got] == \
                [(1, {"m": "a"}, b""), (2, {"m": "b"}, b"p" * 300)][:len(got)], pos
            assert len(got) < 2 or bad == wire, pos


@pytest.mark.parametrize("suite", SUITES)
def test_replay_reorder_drop_inject_reflect_are_detected(suite: str) -> None:
    cli, srv = pair(suite)
    f = [sealed_frame(cli, i, {"m": "x", "i": i}, b"d" * i) for i in range(4)]

    def fresh() -> Session:
        return Session(suite, srv.sealer.key, srv.opener.key, "client")

    assert len(Peer(opener=fresh().opener).receive(b"".join(f))) == 4
    cases = {
        "replay": f[0] + f[1] + f[1],
        "reorder": f[0] + f[2] + f[1],
        "drop": f[0] + f[2],
        "inject unsealed": f[0] + encode_head(Kind.REQUEST, 9, {"m": "x"}) + f[1],
        "inject from another session": f[0] + sealed_frame(pair(suite)[0], 1, {"m": "x"}),
    }
    for what, wire in cases.items():
        with pytest.raises(FrameAuthError):
            Peer(opener=fresh().opener).receive(wire)
            pytest.fail(what)
    # reflected: the client's own frame sent back to it (the other direction's key)
    with pytest.raises(FrameAuthError):
        Peer(opener=cli.opener).receive(f[0])


def test_session_keys_depend_on_everything_negotiated() -> None:
    key, nc, ns = os.urandom(32), os.urandom(32), os.urandom(32)
    base = seal.session_keys(key, nc, ns, b"n\0aes128-gmac")
    assert base[0] != base[1]
    assert seal.session_keys(key, nc, ns, b"n\0aes128-gmac") == base
    for other in [seal.session_keys(key, nc, ns, b"n\0aes128-gcm"),
                  seal.session_keys(os.urandom(32), nc, ns, b"n\0aes128-gmac"),
                  seal.session_keys(key, os.urandom(32), ns, b"n\0aes128-gmac"),
                  seal.session_keys(key, nc, os.urandom(32), b"n\0aes128-gmac")]:
        assert set(other).isdisjoint(base)


@pytest.mark.parametrize("suite", SUITES)
def test_unsent_frame_gives_its_number_back(suite: str) -> None:
    """A send cancelled before its first byte left: the next frame takes its number."""
    cli, srv = pair(suite)
    seq0 = cli.sealer.seq
    sealed_frame(cli, 1, {"m": "never sent"})
    cli.sealer.seq = seq0  # what the transport does when not one byte of it left
    wire = sealed_frame(cli, 2, {"m": "sent"})
    assert [h.rid for h, _ in Peer(opener=srv.opener).receive(wire)] == [2]


@pytest.mark.parametrize("suite", SUITES)
def test_payload_checked_from_buffer_or_after_receive(suite: str) -> None:
    """The decoder's two ways to hand out a sealed payload: all of it buffered (one
    step), or received by the caller then checked; a bad tag fails both."""
    cli, srv = pair(suite)
    payload = os.urandom(10000)
    wire = sealed_frame(cli, 5, {"m": "w"}, payload)
    dec = FrameDecoder()
    dec.seal(srv.opener)
    split = len(wire) - len(payload) - seal.TAG + 100
    dec.feed(wire[:split])
    head = dec.next_head()
    assert head is not None and head.payload_len == len(payload) and dec.tag_due
    dest = bytearray(len(payload))
    assert not dec.take_sealed_payload_into(memoryview(dest))  # not all buffered
    n = dec.take_payload_into(memoryview(dest))
    rest = wire[split:]
    dest[n:] = rest[:len(payload) - n]
    dec.payload_received(len(payload) - n)
    assert dec.tag_missing == seal.TAG
    dec.feed(rest[len(payload) - n:])
    dec.finish_payload([memoryview(dest)])
    assert bytes(dest) == payload and not dec.tag_due

    cli, srv = pair(suite)
    bad = bytearray(sealed_frame(cli, 5, {"m": "w"}, payload))
    bad[-1] ^= 1
    dec = FrameDecoder()
    dec.seal(srv.opener)
    dec.feed(bytes(bad))
    assert dec.next_head() is not None
    with pytest.raises(FrameAuthError):
        dec.take_sealed_payload_into(memoryview(bytearray(len(payload))))


def test_suite_negotiation() -> None:
    assert seal.pick("mac", seal.offer("mac")) == seal.MAC
    assert seal.pick("encrypt", seal.offer("mac")) == seal.ENCRYPT
    assert seal.pick("mac", seal.offer("encrypt")) == seal.ENCRYPT
    assert seal.pick("none", seal.offer("mac")) == seal.MAC  # the stricter side wins
    assert seal.pick("mac", seal.offer("none")) == seal.MAC
    assert seal.pick("none", seal.offer("none")) == seal.PLAIN  # both said so
    assert seal.pick("encrypt", [seal.MAC, seal.PLAIN]) is None
    assert seal.pick("mac", ["something-new"]) is None


@pytest.mark.parametrize("suite", SUITES)
def test_transport_round_trips_sealed_frames(suite: str, tmp_path: Path) -> None:
    """The trio transport over a socket pair: payloads from one buffer, a list of
    buffers and a file (small and larger than a chunk), received into one buffer, a
    scattered list and skipped; every byte as sent, both ends still in step after."""
    import socket

    import trio

    from pfs.core.wire.transport import FILE_CHUNK, Connection

    sizes = [0, 10, 70_000, seal.CHUNK + 12345, 3 * seal.CHUNK, 2 * FILE_CHUNK + 7]
    HOWS = ("one", "list", "file", "stable", "stable_at", "skip", "scatter")
    AT = 4096 * 3 + 17
    data = os.urandom(max(sizes) + AT)
    path = tmp_path / "obj"
    path.write_bytes(data)

    async def main() -> None:
        a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        tx, rx = Connection(a, name="tx"), Connection(b, name="rx")
        cli, srv = pair(suite)
        tx.install(cli)
        rx.install(srv)
        fd = os.open(path, os.O_RDONLY)

        async def send() -> None:
            rid = 0
            for n in sizes:
                view = memoryview(data)[:n]
                for how in HOWS:
                    rid += 1
                    if how == "list":
                        await tx.send_frame(Kind.REPLY, rid, {"n": n}, [view[:n // 3], view[n // 3:]])
                    elif how == "file":
                        await tx.send_frame_from_file(Kind.REPLY, rid, {"n": n}, fd, 0, n)
                    elif how == "stable":  # MAC'd: through a mapping of the file
                        await tx.send_frame_from_file(Kind.REPLY, rid, {"n": n}, fd, 0, n,
                                                      stable=True)
                    elif how == "stable_at":  # from an offset a mapping cannot start at
                        await tx.send_frame_from_file(Kind.REPLY, rid, {"n": n}, fd, AT, n,
                                                      stable=True)
                    else:
                        await tx.send_frame(Kind.REPLY, rid, {"n": n}, view)

        async def recv() -> None:
            for n in sizes:
                for how in HOWS:
                    head = await rx.recv_head()
                    assert head is not None and head.payload_len == n
                    if how == "skip":
                        await rx.skip_payload(n)
                        continue
                    buf = bytearray(n + 5)
                    if how == "scatter":
                        mv = memoryview(buf)
                        i = min(7, n)
                        j = max(i, n // 2)
                        await rx.recv_payload_into_vec([mv[:i], mv[i:j], mv[j:]], n)
                    else:
                        await rx.recv_payload_into(memoryview(buf)[:n])
                    at = AT if how == "stable_at" else 0
                    assert bytes(buf[:n]) == data[at:at + n], (n, how)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                nursery.start_soon(recv)
        finally:
            os.close(fd)
            tx.close()
            rx.close()

    trio.run(main)


def test_wire_security_is_checked_and_none_is_loud(caplog: pytest.LogCaptureFixture) -> None:
    from pfs.core import auth
    from pfs.core.config import ClientConfig, ConfigError, DataConfig, MetaConfig

    for cls in (ClientConfig, MetaConfig, DataConfig):
        assert cls().wire_security == "mac"  # authenticated frames by default
        with pytest.raises(ConfigError, match="wire_security 'macc'"):
            cls(wire_security="macc")
    with pytest.raises(ConfigError):
        auth.client_auth(wire="plain")
    assert auth.check_wire("mac", "client") == "mac" and not caplog.records
    auth.check_wire("none", "data server")
    assert "neither authenticated nor encrypted" in caplog.text
    assert caplog.records[0].levelname == "WARNING"


@pytest.mark.parametrize("suite", SUITES)
def test_blocking_connection_receives_sealed_payloads_into_the_callers_buffer(
        suite: str) -> None:
    """The blocking transport receives a payload straight into the caller's buffer (its
    tag and the next frame in the same receive) and checks it before returning; frames
    back to back stay in step, and a payload altered on the way raises
    ``FrameAuthError`` and closes the connection: what the buffer holds is not data."""
    import socket
    import threading

    from pfs.core.wire.blocking import BlockingConnection

    sizes = [10, 70_000, 3 * seal.CHUNK + 5, 0, seal.CHUNK]
    payloads = [os.urandom(n) for n in sizes]
    cli, srv = pair(suite)
    wire = b"".join(sealed_frame(cli, i + 1, {"n": n}, p)
                    for i, (n, p) in enumerate(zip(sizes, payloads, strict=True)))
    flip = bytearray(sealed_frame(cli, 99, {"n": 1}, bytes(2 * seal.CHUNK)))
    flip[len(flip) - seal.CHUNK] ^= 0x40  # a payload byte, far from the head

    a, b = socket.socketpair()
    rx = BlockingConnection(b, name="rx", timeout=10.0)
    rx.install(srv)
    assert rx.authenticated
    writer = threading.Thread(target=a.sendall, args=(wire + bytes(flip),))
    writer.start()
    try:
        for i, n in enumerate(sizes):
            head = rx.recv_head()
            assert head is not None and head.rid == i + 1 and head.payload_len == n
            if n:
                buf = bytearray(n)
                rx.recv_payload_into(memoryview(buf))
                assert bytes(buf) == payloads[i]
        head = rx.recv_head()
        assert head is not None and head.rid == 99
        with pytest.raises(FrameAuthError):
            rx.recv_payload_into(memoryview(bytearray(head.payload_len)))
        assert rx.closed
    finally:
        writer.join()
        a.close()
        rx.close()


def test_a_plain_blocking_connection_is_not_authenticated() -> None:
    import socket

    from pfs.core.wire.blocking import BlockingConnection

    a, b = socket.socketpair()
    try:
        assert not BlockingConnection(b, name="rx").authenticated
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("suite", SUITES + ["none"])
def test_payload_pieces_are_handed_out_as_they_land(suite: str) -> None:
    """The trio transport's streamed receive (a reply's checksums checked while in
    cache): the sink sees every payload byte once, in order, as the peer sent it (encrypt
    mode: decrypted), into one buffer or scattered; frames back to back stay in step; an
    altered payload raises ``FrameAuthError`` from the receive (whatever the sink saw
    is not data) and closes the connection."""
    import socket

    import trio

    from pfs.core.wire.transport import Connection

    sizes = [10, 70_000, 3 * seal.CHUNK + 5, seal.CHUNK]
    payloads = [os.urandom(n) for n in sizes]

    async def main() -> None:
        a, b = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        rx = Connection(b, name="rx")
        cli = None
        if suite != "none":
            cli, srv = pair(suite)
            rx.install(srv)
        wire = b"".join(
            sealed_frame(cli, i + 1, {"n": n}, p) if cli is not None
            else encode_head(Kind.REQUEST, i + 1, {"n": n}, n) + p
            for i, (n, p) in enumerate(zip(sizes, payloads, strict=True)))
        bad = b""
        if cli is not None:
            flip = bytearray(sealed_frame(cli, 99, {"n": 1}, bytes(2 * seal.CHUNK)))
            flip[len(flip) - seal.CHUNK] ^= 0x40  # a payload byte, far from the head
            bad = bytes(flip)

        async def send() -> None:
            view = memoryview(wire + bad)
            while view:
                view = view[await a.send(view):]

        async def recv() -> None:
            for i, n in enumerate(sizes):
                head = await rx.recv_head()
                assert head is not None and head.rid == i + 1 and head.payload_len == n
                got: list[bytes] = []
                buf = bytearray(n + 3)
                mv = memoryview(buf)

                def sink(v: memoryview, got: list[bytes] = got) -> None:
                    got.append(bytes(v))

                if i % 2:
                    await rx.recv_payload_into(mv[:n], sink)
                else:
                    await rx.recv_payload_into_vec([mv[:5], mv[5:n // 2], mv[n // 2:]], n, sink)
                assert b"".join(got) == payloads[i] == bytes(buf[:n])
            if bad:
                head = await rx.recv_head()
                assert head is not None and head.rid == 99
                with pytest.raises(FrameAuthError):
                    await rx.recv_payload_into(memoryview(bytearray(head.payload_len)),
                                               lambda v: None)
                assert rx.closed

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            try:
                await recv()
            finally:
                a.close()
                rx.close()

    trio.run(main)


def test_map_range_only_maps_what_the_file_holds(tmp_path: Path) -> None:
    """A stable range is mapped (from the page a mapping may start at) only where the
    file covers all of it: a page past its end would raise SIGBUS, not an error."""
    from pfs.core.wire.transport import _map_range

    data = os.urandom(3 * 65536 + 100)
    path = tmp_path / "obj"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n in ((0, len(data)), (4096 * 5 + 3, 70_000), (len(data) - 1, 1)):
            got = _map_range(fd, off, n)
            assert got is not None
            m, pinned = got
            skip = off % mmap.ALLOCATIONGRANULARITY
            assert m[skip:skip + n] == data[off:off + n]
            pinned.release()
            m.close()
        assert _map_range(fd, 0, len(data) + 1) is None
        assert _map_range(fd, len(data) - 10, 11) is None
    finally:
        os.close(fd)

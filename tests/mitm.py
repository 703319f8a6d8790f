"""A man in the middle on loopback: a trio TCP proxy that passes a key handshake through
untouched, then tampers with the frames that follow (tests/integration/test_mitm.py).

It reads each direction frame by frame: the handshake's two frames each way are plain,
every later one is sealed (``header | map | T_h | payload | T_p``: the header stays in
clear, so the proxy can cut the stream into frames). An :class:`Attack` sees each later
frame of one direction, numbered from 0, and says what to forward in its place.
"""
from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgpack
import trio

from pfs.core.wire.protocol import HEADER, HEADER_SIZE, Kind, encode_head
from pfs.core.wire.seal import TAG

HANDSHAKE_FRAMES = 2  # each way: auth request + proof / auth reply + verdict


@dataclass
class Frame:
    header: bytes
    body: bytes  # map, T_h, payload, T_p: everything after the header
    map_len: int
    payload_len: int

    @property
    def raw(self) -> bytes:
        return self.header + self.body

    @property
    def rid(self) -> int:
        return int(HEADER.unpack(self.header)[5])

    def flipped(self, part: str) -> bytes:
        """The frame with one bit flipped in its header (the request id), map or payload."""
        raw = bytearray(self.raw)
        if part == "header":
            pos = 17  # the low byte of the request id
        elif part == "map":
            pos = HEADER_SIZE + self.map_len // 2
        else:
            pos = HEADER_SIZE + self.map_len + TAG + self.payload_len // 2
        raw[pos] ^= 0x04
        return bytes(raw)


def forged(kind: Kind, rid: int, fields: dict, payload: bytes = b"") -> bytes:
    """What an attacker without the key can send: a frame in the right shape with tags
    it had to guess."""
    tags = os.urandom(TAG) + (payload + os.urandom(TAG) if payload else b"")
    head = encode_head(kind, rid, fields, len(payload))
    return head + tags


@dataclass
class Attack:
    """One tampering, on one direction (``c2s`` or ``s2c``) of every connection.

    ``what``: ``flip`` (one bit of ``part``: header, map or payload), ``inject`` (a forged
    frame before the target: ``forge`` builds it from the target), ``replay`` (the first
    sealed frame again, after the target), ``reorder`` (the target and the next frame
    swapped). The target is the first frame numbered ``at`` or later that has a payload
    when ``part`` is payload, else frame ``at``."""

    direction: str
    what: str
    part: str = "map"
    at: int = 1
    forge: object = None  # (Frame) -> bytes, for inject
    # rewrites the map of each handshake frame of this direction (a downgrade attempt)
    handshake: object = None  # (dict) -> dict
    done: bool = False
    seen: list[Frame] = field(default_factory=list)
    held: Frame | None = None

    def target(self, i: int, f: Frame) -> bool:
        if self.done or i < self.at:
            return False
        return f.payload_len > 0 if self.part == "payload" else True

    def apply(self, i: int, f: Frame) -> list[bytes]:
        self.seen.append(f)
        if self.held is not None:  # reorder: the next frame, then the one held back
            held, self.held = self.held, None
            return [f.raw, held.raw]
        if not self.target(i, f):
            return [f.raw]
        self.done = True
        if self.what == "flip":
            return [f.flipped(self.part)]
        if self.what == "inject":
            assert callable(self.forge)
            return [self.forge(f), f.raw]
        if self.what == "replay":
            return [f.raw, self.seen[0].raw]
        if self.what == "reorder":
            self.held = f
            return []
        raise ValueError(self.what)


async def _read_exact(stream: trio.SocketStream, buf: bytearray, n: int) -> bytes | None:
    while len(buf) < n:
        data = await stream.receive_some(1 << 20)
        if not data:
            return None
        buf += data
    out = bytes(buf[:n])
    del buf[:n]
    return out


async def _pump(src: trio.SocketStream, dst: trio.SocketStream, attack: Attack | None) -> None:
    buf = bytearray()
    n = 0
    try:
        while True:
            header = await _read_exact(src, buf, HEADER_SIZE)
            if header is None:
                return
            _, _, _, _, map_len, _, payload_len = HEADER.unpack(header)
            sealed = n >= HANDSHAKE_FRAMES
            size = map_len + payload_len + ((TAG + (TAG if payload_len else 0)) if sealed else 0)
            body = await _read_exact(src, buf, size)
            if body is None:
                return
            frame = Frame(header, body, map_len, payload_len)
            out = [frame.raw]
            if sealed and attack is not None:
                out = attack.apply(n - HANDSHAKE_FRAMES, frame)
            elif attack is not None and callable(attack.handshake):
                _, version, kind, _, _, rid, _ = HEADER.unpack(header)
                fields = attack.handshake(msgpack.unpackb(body[:map_len]))
                out = [encode_head(Kind(kind), rid, fields, payload_len, version=version)
                       + body[map_len:]]
            for chunk in out:
                await dst.send_all(chunk)
            n += 1
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        with trio.CancelScope(shield=True):
            await dst.aclose()


@asynccontextmanager
async def proxy(target_port: int, attack: Attack | None) -> AsyncIterator[int]:
    """A proxy to 127.0.0.1:``target_port`` on a port of its own (yielded); ``attack``
    applies to every connection through it."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handle(client: trio.SocketStream) -> None:
        try:
            server = await trio.open_tcp_stream("127.0.0.1", target_port)
        except OSError:
            await client.aclose()
            return
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c2s = attack if attack is not None and attack.direction == "c2s" else None
        s2c = attack if attack is not None and attack.direction == "s2c" else None
        async with trio.open_nursery() as n:
            n.start_soon(_pump, client, server, c2s)
            n.start_soon(_pump, server, client, s2c)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        try:
            yield port
        finally:
            nursery.cancel_scope.cancel()

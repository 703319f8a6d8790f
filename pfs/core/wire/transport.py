"""A thin trio socket layer around the sans-IO decoder.

Sends are serialised by a lock so frames never interleave; payloads are sent from the
caller's buffer (or an open file, with ``sendfile``) and received straight into the
destination buffer with ``recv_into``.

A sealed connection (key mode after its handshake, :mod:`pfs.core.wire.seal`) adds the
tags (and encrypts, in encrypt mode) on the way out and checks them on the way in: a
payload is checked once it is all in the caller's buffer, before the call that waits for
it returns. A payload from a file is read into user space in chunks to be sealed, since
``sendfile`` would send bytes the tag was not computed over (docs/security.md).
"""
from __future__ import annotations

import array
import contextlib
import errno
import logging
import math
import mmap
import os
import select
import socket
import ssl
from collections.abc import Callable
from typing import Any

import trio

from pfs.core.errors import RemoteProtocolError
from pfs.core.pinning import Pin, pin
from pfs.core.wire.protocol import (
    HEADER_SIZE,
    FrameDecoder,
    FrameHead,
    Kind,
    Limits,
    encode_head,
    packer,
)
from pfs.core.wire.seal import CHUNK, TAG, FrameAuthError, Sealer, Session

log = logging.getLogger(__name__)

RECV_CHUNK = 256 * 1024
# Bytes read while looking for the next header: small, so a large payload that follows
# is received straight into its destination rather than through the decoder's buffer.
HEAD_RECV = 16 * 1024
# A reader that always finds data ready yields to the scheduler this often (frames).
YIELD_EVERY = 16
# A reply read straight after its request was sent: on loopback it is usually there
# already (the send ran the server), over a network never. After this many calls in a
# row whose first receive found nothing, wait for the socket before receiving (no
# receive failing with EAGAIN), trying the receive first again every PROBE_LATE calls.
# A server reads a client's next request after its reply the same way: a busy client
# (several clients, pipelined calls) has it there, one alone never.
LATE_TO_WAIT = 4
PROBE_LATE = 16
# Below this a payload is glued to its header and sent in one syscall.
SMALL_PAYLOAD = 64 * 1024
SOCK_BUF = 4 << 20


IOV_MAX = 1024
# A sealed payload from a file larger than a CHUNK is read, sealed and sent this many
# bytes at a time (a quarter of the reads, sends and calls of 256 KiB pieces: a few per
# cent less CPU per GiB, sender and receiver), through buffers the process's connections
# share: one is held only while a send is under way, so an idle connection keeps none.
FILE_CHUNK = 1 << 20
FILE_BUFS_KEPT = 8
_file_bufs: list[bytearray] = []
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # an int: or-ing the flags costs ~1 us
Payload = bytes | bytearray | memoryview | list[memoryview]
# Handed each piece of a payload as it lands (in order), while the piece is in cache.
Sink = Callable[[memoryview], None]


# ``Connection.recv_head(nowait=True)``: no whole head yet (a sentinel head)
NOT_READY = FrameHead(Kind.REPLY, 0, {}, 0)


def _views(payload: Payload | None) -> list[memoryview]:
    if payload is None:
        return []
    if isinstance(payload, list):
        return [v for v in payload if len(v)]
    v = memoryview(payload).cast("B")
    return [v] if len(v) else []


class ConnectionClosed(OSError):
    def __init__(self, what: str = "connection closed by peer") -> None:
        super().__init__(errno.ECONNRESET, what)


def tune_socket(sock: trio.socket.SocketType) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:  # capped by the kernel; the default still works
            pass


class _SendLock:
    """Frames go out whole, one after another. Uncontended (nearly always) it is a flag:
    no scheduler round trip, no task lookup (``trio.Lock`` does both); a sender that
    finds it taken parks, and ``release`` hands it to the first one parked (fair)."""

    __slots__ = ("busy", "_lot")

    def __init__(self) -> None:
        self.busy = False
        self._lot = trio.lowlevel.ParkingLot()

    async def acquire(self) -> None:
        if not self.busy:
            self.busy = True
            return
        await self._lot.park()  # woken by ``release``, which handed the lock over

    def release(self) -> None:
        if self._lot:
            self._lot.unpark()  # stays busy: the woken sender owns it now
        else:
            self.busy = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Connection:
    """One framed, bidirectional connection."""

    def __init__(self, sock: trio.socket.SocketType, limits: Limits | None = None,
                 name: str = "") -> None:
        self.sock = sock
        self.limits = limits or Limits()
        self.decoder = FrameDecoder(self.limits)
        self.name = name or _peer_name(sock)
        self._send_lock = _SendLock()
        self._pk = packer()  # frame maps encoded with one reused packer
        self._rbuf = bytearray(RECV_CHUNK)  # reused: recv(n) would allocate n bytes per call
        self._head_view = memoryview(self._rbuf)[:HEAD_RECV]
        self.closed = False
        self.local = False  # accepted on a server's local Unix socket
        # The plain-socket fast path: non-blocking syscalls on the stdlib socket, waiting
        # with trio only when they would block. trio's socket methods add two scheduler
        # round trips per call, which is most of a small RPC's cost. (TLS has no ``_sock``.)
        self._raw: socket.socket | None = getattr(sock, "_sock", None)
        self._ready_streak = 0
        self._late = 0  # calls in a row whose reply was not there at once (``recv_head``)
        self._rest_from = (0, 0)  # ``try_send``'s frame: where it started (``_cut_off``)
        self._out = 0  # bytes sent: tells a frame cut off half-way from one never started
        self.session: Session | None = None  # the handshake's session keys, if sealed
        self.sealer: Sealer | None = None  # ... and its sending side
        self._scratch: bytearray | None = None  # sealing's buffer (CHUNK + TAG), lazily
        self._idle_poll: select.poll | None = None  # ``peer_gone``'s, lazily

    def install(self, session: Session) -> None:
        """The handshake's session keys: every frame from now on is sealed both ways."""
        self.session = session
        self.sealer = session.sealer
        self.decoder.seal(session.opener)

    @property
    def authenticated(self) -> bool:
        """Whether every frame's payload is authenticated on its way (a sealed session or
        TLS): bytes received are the bytes the peer sent, or the call fails."""
        return self.session is not None or isinstance(self.sock, TlsSocket)

    @property
    def suite(self) -> str:
        """The sealing suite of this connection (``none``: not sealed)."""
        return "none" if self.session is None else self.session.suite

    def _scratch_view(self) -> memoryview:
        if self._scratch is None:
            self._scratch = bytearray(CHUNK + TAG)
        return memoryview(self._scratch)

    def _auth_failed(self, exc: FrameAuthError) -> FrameAuthError:
        log.warning("%s", exc)
        self.close()
        return exc

    # -- primitive I/O (fast path + trio fallback), errors mapped once -----------
    def _closed_error(self, exc: BaseException | None = None) -> ConnectionClosed:
        self.closed = True
        why = getattr(exc, "strerror", None) or "was closed"
        return ConnectionClosed(f"connection to {self.name} {why}")

    async def _readable(self, raw: socket.socket, deadline: float,
                        stall: float | None) -> None:
        """Wait until ``raw`` has data (until ``deadline``: a frame started must go on
        arriving within ``stall`` seconds)."""
        try:
            if deadline == math.inf:
                await trio.lowlevel.wait_readable(raw)
                return
            with trio.move_on_at(deadline) as scope:
                await trio.lowlevel.wait_readable(raw)
        except trio.ClosedResourceError as exc:
            raise self._closed_error(exc) from None
        if scope.cancelled_caught:
            raise RemoteProtocolError(
                f"{self.name} stalled for {stall:g} s in the middle of a frame")

    async def _recv_into(self, buf: memoryview) -> int:
        return await self._recvmsg_into([buf])

    async def _recvmsg_into(self, bufs: list[memoryview]) -> int:
        """Receive into ``bufs`` in order (one buffer: ``recv_into``); 0 at end of stream."""
        raw = self._raw
        one = bufs[0] if len(bufs) == 1 else None
        try:
            if raw is None:
                if one is not None:
                    return await self.sock.recv_into(one)
                return (await self.sock.recvmsg_into(bufs))[0]
            while True:
                try:
                    return raw.recv_into(one) if one is not None else raw.recvmsg_into(bufs)[0]
                except BlockingIOError:
                    self._ready_streak = 0
                    await trio.lowlevel.wait_readable(raw)
        except ConnectionResetError:
            return 0
        except trio.ClosedResourceError as exc:
            raise self._closed_error(exc) from None
        except OSError as exc:
            if exc.errno == errno.EBADF:
                raise self._closed_error(exc) from None
            raise

    async def _send_some(self, data: Any, vectored: bool | str) -> int:
        raw = self._raw
        try:
            if raw is None:
                return await (self.sock.sendmsg(data) if vectored else self.sock.send(data))
            while True:
                try:
                    if vectored == "fds":
                        return raw.sendmsg(*data)
                    return raw.sendmsg(data) if vectored else raw.send(data)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(raw)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise self._closed_error(exc) from exc
        except trio.ClosedResourceError as exc:
            raise self._closed_error(exc) from None
        except OSError as exc:
            if exc.errno == errno.EBADF:
                raise self._closed_error(exc) from None
            raise

    async def _lock_send(self) -> None:
        await self._send_lock.acquire()

    def pin_version(self, version: int) -> None:
        """The handshake picked ``version``: frames carry it both ways from now on."""
        self.decoder.pin(version)

    # -- sending -------------------------------------------------------------
    def try_send(self, kind: Kind, rid: int, fields: dict[str, Any]) -> memoryview | None:
        """A frame without payload sent now, without waiting (plain sockets, the send lock
        free: the caller checks both): None when it went out whole, else what is left
        of it, to finish with :meth:`send_rest` (the send lock stays taken till then)."""
        head = encode_head(kind, rid, fields, 0, self.limits, self.decoder.version, self._pk)
        self._rest_from = self._out, self._seq()
        data = head if self.sealer is None else self.sealer.head(head, HEADER_SIZE)
        self._send_lock.busy = True
        start = self._out
        try:
            n = self._raw.send(data)  # type: ignore[union-attr]
        except OSError:  # would block, or failed: ``send_rest`` tries again (and raises)
            n = 0
        if n == len(data):
            self._out += n
            self._send_lock.release()
            return None
        self._out = start + n
        return memoryview(data)[n:]

    async def send_rest(self, rest: memoryview) -> None:
        """The rest of :meth:`try_send`'s frame."""
        start, seq0 = self._rest_from
        try:
            await self._sendall(rest)
        except BaseException:
            self._cut_off(start, seq0)
            raise
        finally:
            self._send_lock.release()

    async def send_frame(self, kind: Kind, rid: int, fields: dict[str, Any],
                         payload: Payload | None = None) -> None:
        """Send one frame; ``payload`` may be one buffer or a list of buffers (gathered
        with ``sendmsg``, so the pieces of a stripe are never copied together)."""
        if payload is None:
            views: list[memoryview] = []
            n = 0
        else:
            views = _views(payload)
            n = sum(len(v) for v in views)
        head = encode_head(kind, rid, fields, n, self.limits, self.decoder.version, self._pk)
        lock = self._send_lock
        if lock.busy:
            await lock.acquire()
        else:
            lock.busy = True
        start, seq0 = self._out, self._seq()
        try:
            if self.sealer is not None:
                if n:
                    await self._send_sealed(self.sealer, head, views, n)
                else:  # the common small reply: head and tag, one send
                    await self._sendall(self.sealer.head(head, HEADER_SIZE))
            elif n <= SMALL_PAYLOAD:
                await self._sendall(b"".join([head, *views]) if n else head)
            else:
                await self._sendmsg_all([memoryview(head), *views])
        except BaseException:
            self._cut_off(start, seq0)
            raise
        finally:
            lock.release()

    async def _send_sealed(self, sealer: Sealer, head: bytes, views: list[memoryview],
                           n: int) -> None:
        sealed = sealer.head(head, HEADER_SIZE)
        if not n:
            await self._sendall(sealed)
        elif n > CHUNK and sealer.encrypt:  # through the scratch buffer, a chunk at a time
            await self._sendall(sealed)
            await self._send_pieces(sealer, views)
        elif sealer.encrypt:
            body = sealer.encrypt_into(views, self._scratch_view())
            if n <= SMALL_PAYLOAD:
                await self._sendall(b"".join([sealed, body]))
            else:
                await self._sendmsg_all([memoryview(sealed), body])
        else:
            tag = sealer.payload_tag(views)
            if n <= SMALL_PAYLOAD:
                await self._sendall(b"".join([sealed, *views, tag]))
            else:
                await self._sendmsg_all([memoryview(sealed), *views, memoryview(tag)])

    async def _send_pieces(self, sealer: Sealer, views: list[memoryview]) -> None:
        """An encrypted frame's payload after its head: encrypted into the scratch buffer
        and sent a chunk at a time, then its tag. (A MAC'd one goes out in one ``sendmsg``
        after one tag call: GHASH is bound by the CPU, not by the cache, and one system
        call costs less than five.)"""
        enc = sealer.encrypt_stream()
        out = self._scratch_view()
        for v in views:
            for i in range(0, len(v), CHUNK):
                piece = v[i:i + CHUNK]
                o = out[:len(piece)]
                enc.update_into(piece, o)
                await self._sendall(o)
        await self._sendall(enc.tag())

    async def send_frame_from_file(self, kind: Kind, rid: int, fields: dict[str, Any],
                                   fd: int, offset: int, count: int,
                                   stable: bool = False) -> None:
        """Send ``count`` bytes of ``fd`` at ``offset`` as the payload, with sendfile.

        If the file turns out shorter than ``count`` (truncated meanwhile) the rest is
        sent as zeros so the framing stays intact. ``stable``: the caller guarantees the
        range is neither written nor shortened until this returns (a data server's
        blocks' lock), so a MAC'd payload may be read through a mapping of the file.
        """
        head = encode_head(kind, rid, fields, count, self.limits,
                           self.decoder.version, self._pk)
        await self._lock_send()
        start, seq0 = self._out, self._seq()
        try:
            if self.sealer is not None:
                await self._send_file_sealed(self.sealer, head, fd, offset, count, stable)
            else:
                await self._sendfile(head, fd, offset, count)
        except BaseException:
            self._cut_off(start, seq0)
            raise
        finally:
            self._send_lock.release()

    def _seq(self) -> int:
        return self.sealer.seq if self.sealer is not None else 0

    def _cut_off(self, start: int, seq0: int) -> None:
        """A frame send failed or was cancelled: if part of it went out, the peer would
        read whatever we send next as the rest of it; this connection is done. If none
        did, a sealed frame's number is free again (the peer expects it next; its nonce
        never reached the wire)."""
        if self._out != start:
            self.close()
        elif self.sealer is not None:
            self.sealer.seq = seq0

    async def _send_file_sealed(self, sealer: Sealer, head: bytes, fd: int, offset: int,
                                count: int, stable: bool = False) -> None:
        """The payload read from the file a piece at a time into a buffer (the scratch
        buffer, or a shared FILE_CHUNK one), sealed there and sent from there: the bytes
        tagged are the bytes sent (with ``sendfile`` they could change in the page cache
        after the tag was computed: a concurrent write would then look like an attack)."""
        if count <= CHUNK:  # one read, then as from a buffer: one tag call, one send
            # (encrypt mode: encrypted in place, its tag after it)
            piece = self._scratch_view()[:count]
            k = os.preadv(fd, [piece], offset)
            if k < count:  # the file shrank meanwhile: zeros keep the framing whole
                piece[k:] = bytes(count - k)
            await self._send_sealed(sealer, head, [piece], count)
            return
        got = _map_range(fd, offset, count) if stable and not sealer.encrypt else None
        if got is not None:
            await self._send_mapped(sealer, head, *got, offset, count)
            return
        await self._sendall(sealer.head(head, HEADER_SIZE))
        enc = sealer.encrypt_stream() if sealer.encrypt else None
        mac = None if enc is not None else sealer.mac_stream()
        sent = 0
        pooled = _file_bufs.pop() if _file_bufs else bytearray(FILE_CHUNK)
        buf = memoryview(pooled)
        try:
            while sent < count:
                piece = buf[:min(FILE_CHUNK, count - sent)]
                k = os.preadv(fd, [piece], offset + sent)
                if k < len(piece):  # the file shrank meanwhile: zeros keep the framing whole
                    piece[k:] = bytes(len(piece) - k)
                if enc is not None:
                    enc.update_into(piece, piece)
                else:
                    assert mac is not None
                    mac.update(piece)
                await self._sendall(piece)
                sent += len(piece)
        finally:
            if len(_file_bufs) < FILE_BUFS_KEPT:
                _file_bufs.append(pooled)
        await self._sendall(enc.tag() if enc is not None else mac.tag())  # type: ignore[union-attr]

    async def _send_mapped(self, sealer: Sealer, head: bytes, mapped: mmap.mmap,
                           pinned: Pin, offset: int, count: int) -> None:
        """A MAC'd payload tagged and sent straight from a mapping of a stable file range
        (no copy into a buffer first: the page cache read was a third of a data
        server's CPU per GiB). The bytes tagged are the bytes sent: nothing may write
        them meanwhile (``stable``). Its pages stay locked until the last send returned
        (a plain send has copied them into the socket by then): none is read from the
        disk again while the tag or the send reads it (pfs/core/pinning.py)."""
        view = memoryview(mapped)
        skip = offset % mmap.ALLOCATIONGRANULARITY
        try:
            await self._sendall(sealer.head(head, HEADER_SIZE))
            mac = sealer.mac_stream()
            for i in range(skip, skip + count, FILE_CHUNK):
                piece = view[i:min(i + FILE_CHUNK, skip + count)]
                try:
                    mac.update(piece)
                    await self._sendall(piece)
                finally:
                    piece.release()
            await self._sendall(mac.tag())
        finally:
            view.release()
            pinned.release()
            with contextlib.suppress(BufferError):  # else unmapped once the last view goes
                mapped.close()

    async def _sendfile(self, head: bytes, fd: int, offset: int, count: int) -> None:
        await self._sendall(head)
        sent = 0
        out = self.sock.fileno()
        while sent < count:
            try:
                n = os.sendfile(out, fd, offset + sent, count - sent)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(out)
                except trio.ClosedResourceError as exc:
                    raise self._closed_error(exc) from None
                continue
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise self._closed_error(exc) from exc
            if n == 0:  # the file shrank meanwhile: keep the framing whole
                await self._sendall(bytes(count - sent))
                break
            sent += n
            self._out += n

    async def _sendmsg_all(self, views: list[memoryview]) -> None:
        while views:
            sent = await self._send_some(views[:IOV_MAX], True)
            self._out += sent
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]

    async def _sendall(self, data: bytes | bytearray | memoryview) -> None:
        raw = self._raw
        if raw is not None and type(data) is bytes:
            # a small frame nearly always goes out whole in one send: no views, no loop
            try:
                n = raw.send(data)
            except BlockingIOError:
                n = 0
            except OSError:
                n = -1  # mapped below, by the same call again
            if n == len(data):
                self._out += n
                return
            if n > 0:
                self._out += n
                data = memoryview(data)[n:]
        view = memoryview(data).cast("B")
        while view:
            n = await self._send_some(view, False)
            self._out += n
            view = view[n:]

    # -- receiving -----------------------------------------------------------
    async def recv_head(self, stall: float | None = None, *, fair: bool = True,
                        just_sent: bool = False, nowait: bool = False,
                        wait_first: bool = False) -> FrameHead | None:
        """The next frame's header and map; None on a clean end of stream.

        With ``stall``, once part of a frame has arrived the rest of its header and map
        must arrive within ``stall`` seconds, else ``RemoteProtocolError`` (a peer that
        sends a header and stops is dropped); waiting between frames is not limited.
        ``fair=False``: never yield once a head is decoded (a caller that may be
        cancelled reads its own reply: a cancellation there would lose the head).
        ``just_sent``: a request was just sent and this reads its reply, or a server
        just answered and reads the peer's next request, nothing buffered (plain
        sockets: see LATE_TO_WAIT). ``nowait`` (plain sockets): ``NOT_READY`` instead of waiting
        for more (what did arrive stays buffered); ``wait_first``: wait for the socket
        before the first receive (one just found nothing)."""
        dec = self.decoder
        deadline = math.inf
        chunk = self._head_view
        raw = self._raw
        while True:
            try:
                head = dec.next_head()
            except FrameAuthError as exc:
                raise self._auth_failed(exc) from None
            if head is not None:
                self._ready_streak += 1
                if fair and self._ready_streak >= YIELD_EVERY:  # data kept coming: let others run
                    self._ready_streak = 0
                    await trio.lowlevel.checkpoint()
                return head
            if stall is not None and dec.buffered and deadline == math.inf:
                deadline = trio.current_time() + stall
            if raw is not None:  # the plain socket: straight to the system calls
                probe = just_sent
                if just_sent:
                    just_sent = False
                    late = self._late
                    if late >= LATE_TO_WAIT and late % PROBE_LATE:
                        self._late, probe = late + 1, False
                        if nowait:
                            return NOT_READY
                        wait_first = True
                if wait_first:
                    wait_first = False
                    self._ready_streak = 0
                    try:
                        await trio.lowlevel.wait_readable(raw)
                    except trio.ClosedResourceError as exc:
                        raise self._closed_error(exc) from None
                while True:
                    try:
                        n = raw.recv_into(chunk)
                        if probe:
                            self._late = 0
                        break
                    except BlockingIOError:
                        if probe:
                            self._late += 1
                            probe = False
                        if nowait:
                            return NOT_READY
                        self._ready_streak = 0
                        if deadline != math.inf:
                            await self._readable(raw, deadline, stall)
                            continue
                        try:  # between frames (nearly always): no coroutine of our own
                            await trio.lowlevel.wait_readable(raw)
                        except trio.ClosedResourceError as exc:
                            raise self._closed_error(exc) from None
                    except ConnectionResetError:
                        n = 0
                        break
                    except OSError as exc:
                        if exc.errno == errno.EBADF:
                            raise self._closed_error(exc) from None
                        raise
            elif deadline == math.inf:
                n = await self._recv_into(chunk)
            else:
                n = -1
                with trio.move_on_at(deadline):
                    n = await self._recv_into(chunk)
                if n < 0:
                    raise RemoteProtocolError(
                        f"{self.name} stalled for {stall:g} s in the middle of a frame")
            if not n:
                self.closed = True
                if dec.buffered:
                    raise RemoteProtocolError(f"{self.name} closed the connection mid-frame")
                return None
            dec.feed(chunk[:n])

    async def recv_payload_into(self, dest: memoryview, sink: Sink | None = None) -> None:
        """Receive exactly ``len(dest)`` payload bytes into ``dest`` (of a sealed
        connection: checked, and decrypted, before this returns); ``sink``: see
        :meth:`_recv_streamed`."""
        if sink is not None:
            await self._recv_streamed([dest], sink)
            return
        dec = self.decoder
        if dec.tag_due:
            try:
                if dec.take_sealed_payload_into(dest):
                    return
            except FrameAuthError as exc:
                raise self._auth_failed(exc) from None
        got = dec.take_payload_into(dest)
        total = len(dest)
        if not dec.tag_due:
            while got < total:
                n = await self._recv_into(dest[got:])
                if n == 0:
                    self.closed = True
                    raise ConnectionClosed(f"{self.name} closed the connection mid-payload")
                dec.payload_received(n)
                got += n
            return
        # sealed: what arrives past the payload (its tag, the next frame) lands in the
        # head buffer in the same call, instead of a receive of its own for the tag
        after = memoryview(self._rbuf)[:HEAD_RECV]
        while got < total:
            n = await self._recvmsg_into([dest[got:], after])
            if n == 0:
                self.closed = True
                raise ConnectionClosed(f"{self.name} closed the connection mid-payload")
            k = min(n, total - got)
            dec.payload_received(k)
            got += k
            if n > k:
                dec.feed(after[:n - k])
        await self._finish_sealed([dest])

    async def _recv_tag(self) -> None:
        """Receive until the current payload's tag is buffered (its payload is in)."""
        dec = self.decoder
        chunk = self._head_view
        while dec.tag_missing:
            n = await self._recv_into(chunk)
            if n == 0:
                self.closed = True
                raise ConnectionClosed(f"{self.name} closed the connection mid-frame")
            dec.feed(chunk[:n])

    async def _finish_sealed(self, views: list[memoryview]) -> None:
        """The payload is in ``views``: receive its tag and check it."""
        dec = self.decoder
        await self._recv_tag()
        try:
            dec.finish_payload(views)
        except FrameAuthError as exc:
            raise self._auth_failed(exc) from None

    async def recv_payload_into_vec(self, dests: list[memoryview], n: int,
                                    sink: Sink | None = None) -> None:
        """Receive ``n`` payload bytes scattered over ``dests`` in order (``recvmsg_into``);
        ``n`` may be less than their total (a short read). ``sink``: see
        :meth:`_recv_streamed`."""
        dec = self.decoder
        todo: list[memoryview] = []
        left = n
        for d in dests:
            if left <= 0:
                break
            todo.append(d[:left])
            left -= len(todo[-1])
        if left > 0:
            raise RemoteProtocolError(f"{self.name} sent {n} bytes for a smaller buffer")
        if sink is not None:
            await self._recv_streamed(todo, sink)
            return
        filled = list(todo) if dec.tag_due else None
        while todo and dec.buffered:
            k = dec.take_payload_into(todo[0])
            todo[0] = todo[0][k:]
            if not todo[0]:
                todo.pop(0)
        while todo:
            k = await self._recvmsg_into(todo[:IOV_MAX])
            if k == 0:
                self.closed = True
                raise ConnectionClosed(f"{self.name} closed the connection mid-payload")
            dec.payload_received(k)
            while todo and k >= len(todo[0]):
                k -= len(todo[0])
                todo.pop(0)
            if k:
                todo[0] = todo[0][k:]
        if filled is not None:
            await self._finish_sealed(filled)

    async def _recv_streamed(self, views: list[memoryview], sink: Sink) -> None:
        """Receive the current frame's payload into ``views`` (in order; their total is
        its length) and hand each piece to ``sink`` as it lands, while it is in cache (a
        reply's block checksums: :class:`pfs.core.checksums.StreamCheck`). Of a sealed
        connection each piece is first fed to the payload's check (encrypt mode:
        decrypted in place), and the tag is checked before this returns: until then what
        ``sink`` saw is unproven, and if the tag fails (``FrameAuthError``) it is not
        the peer's."""
        dec = self.decoder
        opener = dec.opener if dec.tag_due else None
        check = opener.stream() if opener is not None else None
        todo = [v for v in views if len(v)]
        while todo:  # first what the decoder holds
            v = todo[0]
            k = dec.take_payload_into(v)
            if not k:
                break
            if check is not None:
                check.update(v[:k])
            sink(v[:k])
            if k < len(v):
                todo[0] = v[k:]
            else:
                todo.pop(0)
        # sealed: what arrives past the payload (its tag, the next frame) lands in the
        # head buffer in the same call
        after = [self._head_view] if check is not None else []
        while todo:
            k = await self._recvmsg_into(todo[:IOV_MAX - 1] + after)
            if k == 0:
                self.closed = True
                raise ConnectionClosed(f"{self.name} closed the connection mid-payload")
            while todo and k:
                v = todo[0]
                m = min(k, len(v))
                dec.payload_received(m)
                if check is not None:
                    check.update(v[:m])
                sink(v[:m])
                k -= m
                if m < len(v):
                    todo[0] = v[m:]
                else:
                    todo.pop(0)
            if k:
                dec.feed(self._head_view[:k])
        if check is None:
            return
        await self._recv_tag()
        try:
            check.finish(dec.take_tag())
        except FrameAuthError as exc:
            raise self._auth_failed(exc) from None

    async def recv_payload(self, n: int) -> bytearray:
        buf = bytearray(n)
        if n:
            await self.recv_payload_into(memoryview(buf))
        return buf

    async def skip_payload(self, n: int) -> None:
        """Receive and drop the current frame's payload (of a sealed connection: checked
        all the same, so a tampered frame is noticed whoever it was for)."""
        if not n:
            if self.decoder.tag_due:  # cannot be: a payload-less frame has no payload tag
                raise RemoteProtocolError("payload tag without a payload")
            return
        opener = self.decoder.opener if self.decoder.tag_due else None
        check = opener.stream() if opener is not None else None
        scratch = memoryview(bytearray(min(n, RECV_CHUNK)))
        dec = self.decoder
        while n:
            k = min(n, len(scratch))
            piece = scratch[:k]
            got = dec.take_payload_into(piece)
            while got < k:
                r = await self._recv_into(piece[got:])
                if r == 0:
                    self.closed = True
                    raise ConnectionClosed(f"{self.name} closed the connection mid-payload")
                dec.payload_received(r)
                got += r
            if check is not None:
                check.update(piece)
            n -= k
        if check is not None:
            await self._recv_tag()
            try:
                check.finish(dec.take_tag())
            except FrameAuthError as exc:
                raise self._auth_failed(exc) from None

    # -- descriptor passing (local Unix-socket connections only) ----------------
    async def send_frame_with_fds(self, kind: Kind, rid: int, fields: dict[str, Any],
                                  fds: list[int]) -> None:
        """A payload-less frame carrying open descriptors (SCM_RIGHTS) with its first
        byte, so the receiver finds them as soon as it reads the frame's header."""
        if self._raw is None or self.sock.family != socket.AF_UNIX:
            raise OSError(errno.EINVAL, "descriptors travel only over local Unix sockets")
        head = encode_head(kind, rid, fields, 0, self.limits, self.decoder.version, self._pk)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        await self._lock_send()
        start, seq0 = self._out, self._seq()
        try:
            # sealed under the lock: frames take their numbers in the order they go out
            data = memoryview(head if self.sealer is None
                              else self.sealer.head(head, HEADER_SIZE))
            sent = await self._send_some(([data], anc), "fds")
            self._out += sent
            if sent < len(data):
                await self._sendall(data[sent:])
        except BaseException:
            self._cut_off(start, seq0)
            raise
        finally:
            self._send_lock.release()

    async def recv_frame_with_fds(self) -> tuple[FrameHead, list[int]]:
        """The next payload-less frame and the descriptors that came with it (the
        caller owns them). For connections that carry nothing else concurrently."""
        raw = self._raw
        if raw is None:
            raise OSError(errno.EINVAL, "descriptors travel only over local Unix sockets")
        fds: list[int] = []
        try:
            while True:
                try:
                    head = self.decoder.next_head()
                except FrameAuthError as exc:
                    raise self._auth_failed(exc) from None
                if head is not None:
                    if head.payload_len:
                        await self.skip_payload(head.payload_len)
                    return head, fds
                try:
                    data, got, _flags, _addr = socket.recv_fds(raw, HEAD_RECV, 8)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(raw)
                    continue
                fds.extend(got)
                if not data:
                    raise self._closed_error()
                self.decoder.feed(data)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    async def wait_peer_gone(self) -> None:
        """Return once the peer closes (or resets) this idle connection; for a client
        between calls, with nobody else waiting on the socket. Never returns on TLS (it
        cannot tell) or when bytes nobody asked for arrive (the next call reads them)."""
        raw = self._raw
        if raw is None:
            await trio.sleep_forever()
        assert raw is not None
        await trio.lowlevel.wait_readable(raw)
        if not self.peer_gone():
            await trio.sleep_forever()

    def peer_gone(self) -> bool:
        """Whether the peer closed (or reset) this idle connection: one non-blocking
        peek, for a client with nobody reading the socket between calls. False when it
        cannot tell (TLS)."""
        raw = self._raw
        if self.closed:
            return True
        if raw is None:
            return False
        if self._idle_poll is None:  # poll(0) costs a quarter of a failing peek
            self._idle_poll = select.poll()
            self._idle_poll.register(raw.fileno(), select.POLLIN | select.POLLRDHUP)
        if not self._idle_poll.poll(0):
            return False
        try:
            return raw.recv(1, _PEEK) == b""
        except BlockingIOError:
            return False  # nothing to read: alive
        except OSError:
            return True

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def _map_range(fd: int, offset: int, count: int) -> tuple[mmap.mmap, Pin] | None:
    """``count`` bytes of ``fd`` at ``offset`` mapped, faulted in and locked (from the
    page before ``offset`` that a mapping may start at), or None where that cannot be
    done safely: the file ends before the range (a page past the end would raise
    SIGBUS), or this process may not lock it: the caller reads it instead. EIO where a
    page could not be read from the disk, before anything of the frame went out (the
    peer gets an error, not a cut connection, and reads another replica)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        if os.fstat(fd).st_size < offset + count:
            return None
        mapped = mmap.mmap(fd, offset + count - start, mmap.MAP_SHARED, mmap.PROT_READ,
                           offset=start)
    except (OSError, ValueError):
        return None
    try:
        pinned = pin(mapped)
    except OSError as exc:
        mapped.close()
        raise OSError(exc.errno, f"reading {count} bytes at offset {offset} to send: "
                                 f"{exc.strerror}") from None
    if pinned is None:
        mapped.close()
        return None
    return mapped, pinned


def _peer_name(sock: trio.socket.SocketType) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return "<unconnected>"
    if isinstance(peer, tuple):
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "<unix>"


def local_socket_name(sid: str) -> str:
    """The abstract Unix socket a data server of id ``sid`` serves local clients on."""
    return "\0pfs-data/" + sid


async def open_unix_connection(name: str, limits: Limits | None = None,
                               timeout: float = 5.0) -> Connection:
    """Connect to a local Unix socket (a leading NUL names an abstract socket)."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with trio.fail_after(timeout):
            await sock.connect(name)
    except trio.TooSlowError:
        sock.close()
        raise OSError(errno.ETIMEDOUT, f"connecting to local socket {name!r} timed out") from None
    except BaseException:
        sock.close()
        raise
    return Connection(sock, limits, name=f"local:{name.lstrip(chr(0))}")


async def open_connection(host: str, port: int, limits: Limits | None = None,
                          timeout: float = 10.0, tls: ssl.SSLContext | None = None) -> Connection:
    """Connect over TCP (and TLS with ``tls``); a refused or unreachable server is an
    OSError naming it."""
    try:
        with trio.fail_after(timeout):
            stream_infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, type_, proto, _, addr = stream_infos[0]
            sock = trio.socket.socket(family, type_, proto)
            try:
                await sock.connect(addr)
            except BaseException:
                sock.close()
                raise
    except trio.TooSlowError:
        raise OSError(errno.ETIMEDOUT, f"connecting to {host}:{port} timed out") from None
    except OSError as exc:
        raise OSError(exc.errno or errno.EIO,
                      f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    tune_socket(sock)
    if tls is None:
        return Connection(sock, limits, name=f"{host}:{port}")
    try:
        return await tls_connection(sock, tls, False, limits, timeout, f"{host}:{port}")
    except OSError as exc:
        raise OSError(exc.errno or errno.EACCES, f"{host}:{port}: {exc.strerror or exc}") from None


class TlsSocket:
    """Just enough of a trio socket over a ``trio.SSLStream`` for :class:`Connection`."""

    def __init__(self, stream: trio.SSLStream, raw: trio.socket.SocketType) -> None:
        self.stream = stream
        self.raw = raw
        self.family = raw.family
        self.peer_cert: dict[str, Any] | None = None

    async def recv_into(self, buf: Any) -> int:
        try:
            data = await self.stream.receive_some(len(buf))
        except trio.BrokenResourceError as exc:
            raise ConnectionResetError(errno.ECONNRESET, f"TLS stream broken: {exc}") from None
        n = len(data)
        if n:
            buf[:n] = data
        return n

    async def send(self, view: Any) -> int:
        try:
            await self.stream.send_all(view)
        except trio.BrokenResourceError as exc:
            raise BrokenPipeError(errno.EPIPE, f"TLS stream broken: {exc}") from None
        return len(view)

    async def sendmsg(self, views: list[Any]) -> int:
        total = 0
        for v in views:
            total += await self.send(v)
        return total

    async def recvmsg_into(self, bufs: list[Any]) -> tuple[int, list[Any], int, Any]:
        n = await self.recv_into(bufs[0])
        return n, [], 0, None

    def getpeername(self) -> Any:
        return self.raw.getpeername()

    def getsockname(self) -> Any:
        return self.raw.getsockname()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()


class TlsConnection(Connection):
    """A :class:`Connection` over TLS: the same framing; payloads from files are read
    and encrypted (no ``sendfile``)."""

    async def send_frame_from_file(self, kind: Kind, rid: int, fields: dict[str, Any],
                                   fd: int, offset: int, count: int,
                                   stable: bool = False) -> None:
        head = encode_head(kind, rid, fields, count, self.limits,
                           self.decoder.version, self._pk)
        async with self._send_lock:
            start, seq0 = self._out, self._seq()
            try:
                await self._sendall(head)
                sent = 0
                while sent < count:
                    chunk = os.pread(fd, min(RECV_CHUNK * 4, count - sent), offset + sent)
                    if not chunk:
                        await self._sendall(bytes(count - sent))
                        break
                    await self._sendall(chunk)
                    sent += len(chunk)
            except BaseException:
                self._cut_off(start, seq0)
                raise


async def tls_connection(sock: trio.socket.SocketType, ctx: ssl.SSLContext, server_side: bool,
                         limits: Limits | None, timeout: float, name: str = "") -> TlsConnection:
    """Run the TLS handshake on a connected socket (closed on failure)."""
    stream = trio.SSLStream(trio.SocketStream(sock), ctx, server_side=server_side,
                            server_hostname=None if server_side else "pfs")
    wrapped = TlsSocket(stream, sock)
    try:
        with trio.fail_after(timeout):
            await stream.do_handshake()
        wrapped.peer_cert = stream.getpeercert()
    except trio.TooSlowError:
        sock.close()
        raise OSError(errno.ETIMEDOUT, "TLS handshake timed out") from None
    except (trio.BrokenResourceError, ssl.SSLError) as exc:
        sock.close()
        cause = exc.__cause__ or exc
        raise OSError(errno.EACCES, f"TLS handshake failed: {cause}") from None
    except BaseException:
        sock.close()
        raise
    return TlsConnection(wrapped, limits, name)  # type: ignore[arg-type]

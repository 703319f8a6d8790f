"""Request/reply over a blocking socket, one call at a time, for callers outside trio.

The synchronous client sends its metadata calls from the calling thread on one of
these instead of hopping into its trio thread and back: the hop (a wake-up through a
socket pair, two thread switches) costs more CPU than the round trip itself (~150 us
against ~40 us per call on the benchmark machine; docs/benchmarks.md). Frames are the
same as everywhere (:mod:`pfs.core.wire.protocol`); only the I/O around them differs from
:class:`pfs.core.wire.rpc.RpcClient`, and so do its limits: no concurrent calls on one
connection, and reply payloads come back as bytes (metadata replies carry none).

Error semantics match ``RpcClient``: a server's error frame is raised as the same
``OSError``; a broken, timed-out or garbled connection fails the call in flight, is
closed, and ``alive`` turns False (the owner reconnects for the next call).
"""
from __future__ import annotations

import errno
import itertools
import logging
import select
import socket
import ssl
import struct
import threading
import time
from typing import Any

from pfs.core.errors import ProtocolError, from_wire
from pfs.core.messages.base import RequestMessage, parse_reply
from pfs.core.wire.protocol import (
    HEADER_SIZE,
    FrameDecoder,
    FrameHead,
    Kind,
    Limits,
    encode_head,
    packer,
)
from pfs.core.wire.seal import TAG, FrameAuthError, Sealer, Session

log = logging.getLogger(__name__)

# Bytes read while looking for the next header: small, so a large payload that follows
# is received straight into the caller's buffer, not copied through the decoder's (a
# 256 KiB read here took most of a 256 KiB reply into the decoder: two more copies, and
# a fresh allocation, page faults included, per reply).
HEAD_RECV = 16 << 10
# ... and the first read of a reply whose payload is expected to be larger than that (a
# KV block): its head (and an error's) fits, and what the head read took of the payload
# (copied into the decoder, then out to the caller) is at most this, not 16 KiB
HEAD_FIRST = 1 << 10
SOCK_BUF = 4 << 20  # as the trio transport's: a large reply in fewer, larger receives
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # an int: or-ing the flags costs ~1 us
_WAITALL = int(socket.MSG_WAITALL)
# seconds a connection must have been idle before ``alive`` asks the socket whether the
# peer went away (as :data:`pfs.core.wire.rpc.PEER_CHECK_IDLE`): back-to-back calls skip
# the system call, and a peer gone within that window shows as the call's error
PEER_CHECK_IDLE = 0.01


class BlockingConnection:
    """Framed send and receive on a connected blocking socket (plain or TLS)."""

    def __init__(self, sock: socket.socket, limits: Limits | None = None,
                 name: str = "", timeout: float = 60.0) -> None:
        self.sock = sock
        self.limits = limits or Limits()
        self.name = name
        self.timeout = timeout  # seconds each send or receive may wait
        self.peer_cert: dict[str, Any] | None = None
        self.closed = False
        self._decoder = FrameDecoder(self.limits)
        # maps encoded with one reused packer (``packb`` builds one per call: half its
        # cost); frames are sent one at a time (the client's lock, or the handshake)
        self._pk = packer()
        self._chunk = bytearray(HEAD_RECV)
        self._chunk_view = memoryview(self._chunk)
        self.session: Session | None = None  # sealed frames (key mode, after the handshake)
        self._sealer: Sealer | None = None
        self._idle_poll: select.poll | None = None  # ``peer_gone``'s, lazily
        self._plain = not isinstance(sock, ssl.SSLSocket)  # recvmsg_into works on it
        self.set_timeout(timeout)

    @classmethod
    def open(cls, host: str, port: int, limits: Limits | None = None, *,
             timeout: float = 60.0, connect_timeout: float = 10.0,
             tls: ssl.SSLContext | None = None) -> BlockingConnection:
        """Connect over TCP (and TLS with ``tls``); failures are OSErrors naming the server."""
        name = f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"connecting to {name} timed out") from None
        except OSError as exc:
            raise OSError(exc.errno or errno.EIO,
                          f"cannot connect to {name}: {exc.strerror or exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
            except OSError:  # capped by the kernel; the default still works
                pass
        if tls is None:
            sock.settimeout(None)
            return cls(sock, limits, name, timeout)
        try:
            wrapped = tls.wrap_socket(sock, server_side=False, server_hostname="pfs")
        except TimeoutError:
            sock.close()
            raise OSError(errno.ETIMEDOUT, f"{name}: TLS handshake timed out") from None
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            raise OSError(errno.EACCES, f"{name}: TLS handshake failed: {exc}") from None
        conn = cls(wrapped, limits, name, timeout)
        conn.peer_cert = wrapped.getpeercert()
        return conn

    def set_timeout(self, timeout: float) -> None:
        self.timeout = timeout
        if isinstance(self.sock, ssl.SSLSocket):
            self.sock.settimeout(timeout if timeout > 0 else None)
            return
        # a blocking socket with kernel timeouts: one syscall per receive, not a
        # poll() before each as socket.settimeout() would do
        self.sock.settimeout(None)
        t = max(timeout, 0.0)
        tv = struct.pack("ll", int(t), int((t - int(t)) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def peer_gone(self) -> bool:
        """Whether the peer closed (or broke) this idle connection. An async client's
        reader notices at once; a blocking one asks before each call, so a call after a
        server restart goes to a new connection instead of failing on the old one."""
        if self.closed:
            return True
        sock = self.sock
        try:
            if not isinstance(sock, ssl.SSLSocket):
                if self._idle_poll is None:  # poll(0) costs a quarter of a failing peek
                    self._idle_poll = select.poll()
                    self._idle_poll.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
                if not self._idle_poll.poll(0):
                    return False
                return sock.recv(1, _PEEK) == b""
            if not select.select([sock], [], [], 0)[0]:
                return False
            # readable while idle: a TLS 1.3 session ticket (consumed, no data), the end
            # of the stream, or bytes nobody asked for
            sock.setblocking(False)
            try:
                sock.recv(1)
            except ssl.SSLWantReadError:
                return False
            finally:
                sock.settimeout(self.timeout if self.timeout > 0 else None)
            return True
        except BlockingIOError:
            return False  # nothing to read: alive
        except OSError:
            return True

    def _io_error(self, exc: OSError, what: str) -> OSError:
        self.close()
        if isinstance(exc, (TimeoutError, BlockingIOError)):  # SO_RCVTIMEO: EAGAIN
            return OSError(errno.ETIMEDOUT, f"{what} {self.name}: no answer in "
                                            f"{self.timeout:g} s")
        return OSError(exc.errno or errno.ECONNRESET,
                       f"connection to {self.name} failed: {exc.strerror or exc}")

    def pin_version(self, version: int) -> None:
        """The handshake picked ``version``: frames carry it both ways from now on."""
        self._decoder.pin(version)

    def install(self, session: Session) -> None:
        """The handshake's session keys: every frame from now on is sealed both ways."""
        self.session = session
        self._sealer = session.sealer
        self._decoder.seal(session.opener)

    def send_frame(self, kind: Kind, rid: int, fields: dict[str, Any],
                   payload: bytes | bytearray | memoryview | None = None) -> None:
        data = encode_head(kind, rid, fields, len(payload) if payload else 0, self.limits,
                           self._decoder.version, self._pk)
        sealer = self._sealer
        if sealer is not None:
            data = sealer.head(data, HEADER_SIZE)
            if payload:
                view = memoryview(payload).cast("B")
                if sealer.encrypt:
                    data = b"".join([data, sealer.encrypt_into(
                        [view], memoryview(bytearray(len(view) + TAG)))])
                else:
                    data = b"".join([data, view, sealer.payload_tag([view])])
        elif payload:
            data += bytes(payload)
        try:
            self.sock.sendall(data)
        except OSError as exc:
            if sealer is not None:
                self.close()  # how much of the frame went out is unknown
            raise self._io_error(exc, "sending to") from None

    def sealed_frame(self, kind: Kind, rid: int, fields: dict[str, Any]) -> bytes:
        """A frame without payload as :meth:`send_frame` would send it, to send with
        :meth:`send_frames` (sealed frames must go out in the order they were made)."""
        data = encode_head(kind, rid, fields, 0, self.limits, self._decoder.version, self._pk)
        return data if self._sealer is None else self._sealer.head(data, HEADER_SIZE)

    def send_frames(self, frames: list[bytes]) -> None:
        """Frames made by :meth:`sealed_frame`, in one send."""
        try:
            self.sock.sendall(b"".join(frames))
        except OSError as exc:
            raise self._io_error(exc, "sending to") from None

    def _fill(self, size: int = 0) -> None:
        try:
            n = self.sock.recv_into(self._chunk, size)
        except OSError as exc:
            raise self._io_error(exc, "waiting for") from None
        if n == 0:
            self.close()
            raise OSError(errno.ECONNRESET, f"{self.name} closed the connection")
        self._decoder.feed(self._chunk_view[:n])

    def recv_head(self, first: int = 0) -> FrameHead | None:
        """The next frame's head (its payload, if any, is read with ``recv_payload``);
        None when the peer closed the connection between frames. ``first``: at most
        this many bytes in the first read when nothing is buffered (0: ``HEAD_RECV``)."""
        dec = self._decoder
        while True:
            # without a whole header buffered (the usual case: the reply is not here
            # yet) the decoder has nothing to look at: receive first
            if dec.buffered >= HEADER_SIZE or dec.pending_payload or dec.tag_due:
                try:
                    head = dec.next_head()
                except ProtocolError as exc:
                    if isinstance(exc, FrameAuthError):
                        log.warning("%s", exc)
                    self.close()
                    raise
                if head is not None:
                    return head
            if self.closed:
                return None
            try:
                self._fill(first if not dec.buffered else 0)
            except OSError as exc:
                if dec.buffered == 0 and exc.errno == errno.ECONNRESET:
                    return None
                raise

    def recv_payload(self, n: int) -> bytes:
        out = bytearray(n)
        self.recv_payload_into(memoryview(out))
        return bytes(out)

    def recv_payload_into(self, view: memoryview) -> None:
        """The current frame's payload (exactly ``len(view)`` bytes) into ``view``: what
        the decoder holds, then straight from the socket. Of a sealed connection: checked
        before this returns; if it fails (``FrameAuthError``), what ``view`` holds is not
        the peer's payload."""
        dec = self._decoder
        try:
            if dec.tag_due and dec.take_sealed_payload_into(view):
                return
            got = dec.take_payload_into(view)
            n = len(view)
            # sealed, plain socket: the payload's tag (all that follows it: nothing of the
            # frame is buffered once ``got < n``) lands in the head buffer in the same
            # receive, not in a receive of its own; and a plain socket's receive waits for
            # all of it (MSG_WAITALL: one system call, not one per piece that arrives)
            after = self._chunk_view[:TAG] if dec.tag_due and self._plain else None
            flags = _WAITALL if self._plain else 0
            while got < n:
                try:
                    if after is None:
                        k = self.sock.recv_into(view[got:], 0, flags)
                    else:
                        k = self.sock.recvmsg_into([view[got:], after], 0, flags)[0]
                except OSError as exc:
                    raise self._io_error(exc, "waiting for") from None
                if k == 0:
                    self.close()
                    raise OSError(errno.ECONNRESET, f"{self.name} closed the connection")
                take = min(k, n - got)
                dec.payload_received(take)
                got += take
                if k > take:
                    assert after is not None
                    dec.feed(after[:k - take])
            if dec.tag_due:
                while dec.tag_missing:
                    self._fill()
                dec.finish_payload([view])
        except FrameAuthError as exc:
            log.warning("%s", exc)
            self.close()
            raise

    @property
    def authenticated(self) -> bool:
        """Whether every frame's payload is authenticated on its way (a sealed session or
        TLS): bytes received are the bytes the peer sent, or the call fails."""
        return self.session is not None or not self._plain

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass


class BlockingRpcClient:
    """Calls over one :class:`BlockingConnection`, one at a time (a lock serializes
    callers from several threads)."""

    def __init__(self, conn: BlockingConnection) -> None:
        self.conn = conn
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._used = -1e18  # time.monotonic() when the last reply came (``alive``)

    @property
    def alive(self) -> bool:
        """Open, and not closed by the peer while idle (checked: one syscall, when idle
        for ``PEER_CHECK_IDLE`` or longer)."""
        if time.monotonic() - self._used < PEER_CHECK_IDLE:
            return not self.conn.closed
        if not self._lock.acquire(blocking=False):
            # a call in flight (another thread) owns the socket: probing it could take
            # bytes of its reply (TLS); that call finds out whether the peer is there
            return not self.conn.closed
        try:
            if self.conn.peer_gone():
                self.conn.close()
                return False
            return True
        finally:
            self._lock.release()

    def request(self, msg: RequestMessage, *, closes: list[int] | None = None,
                unwritten: list[int] | None = None) -> Any:
        """A typed call whose reply carries no payload (metadata): its typed reply
        (``EPROTO`` if the reply does not fit it)."""
        return parse_reply(msg, self.send(msg, closes=closes, unwritten=unwritten)[0])

    def send(self, msg: RequestMessage, *, closes: list[int] | None = None,
             unwritten: list[int] | None = None,
             payload: bytes | bytearray | memoryview | None = None,
             into: memoryview | None = None) -> tuple[dict[str, Any], int]:
        """Request ``msg`` (with handles to release first, ``closes``, and those of them
        that sent no data, ``unwritten``: a metaserver request) and an optional payload;
        a reply payload lands in ``into`` (at most its length). Returns the reply's
        fields and its payload length."""
        wire = msg.to_wire()
        if closes:
            wire["closes"] = closes
            if unwritten:
                wire["unwritten"] = unwritten
        return self._exchange(wire, payload, into)

    def call(self, method: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """An untyped call, for tests that send what no message allows; the library
        sends messages (:meth:`request`, :meth:`send`)."""
        wire = {"m": method}
        if fields:
            wire.update(fields)
        return self._exchange(wire, None, None)[0]

    def _exchange(self, msg: dict[str, Any], payload: bytes | bytearray | memoryview | None,
                  into: memoryview | None) -> tuple[dict[str, Any], int]:
        conn = self.conn
        with self._lock:
            if conn.closed:
                raise OSError(errno.ECONNRESET, f"connection to {conn.name} closed")
            rid = next(self._ids)
            try:
                conn.send_frame(Kind.REQUEST, rid, msg, payload)
                head = conn.recv_head(
                    HEAD_FIRST if into is not None and len(into) > HEAD_RECV else 0)
                if head is not None and head.rid == rid and head.kind == Kind.REPLY \
                        and head.payload_len and into is not None \
                        and head.payload_len <= len(into):
                    conn.recv_payload_into(into[:head.payload_len])
                    self._used = time.monotonic()  # (``alive`` skips its probe after it)
                    return head.fields, head.payload_len
            except ProtocolError as exc:
                conn.close()
                raise OSError(getattr(exc, "errno", None) or errno.EPROTO,
                              f"connection to {conn.name} failed: {exc}") from None
            except BaseException:
                # interrupted (KeyboardInterrupt in a signal handler...) between request
                # and reply: the reply would be taken for the next call's
                conn.close()
                raise
            if head is None:
                raise OSError(errno.ECONNRESET, f"connection to {conn.name} closed")
            if head.rid != rid:
                conn.close()
                raise OSError(errno.EPROTO, f"{conn.name} answered request {head.rid}, "
                                            f"not {rid}")
            if head.payload_len:
                try:
                    conn.recv_payload(head.payload_len)  # not expected: read past it
                except ProtocolError as exc:
                    raise OSError(getattr(exc, "errno", None) or errno.EPROTO,
                                  f"connection to {conn.name} failed: {exc}") from None
            self._used = time.monotonic()
            if head.kind == Kind.ERROR:
                raise from_wire(head.fields.get("errno"), head.fields.get("msg"))
            if head.kind != Kind.REPLY or head.payload_len:
                conn.close()
                raise OSError(errno.EPROTO, f"{conn.name} sent a frame of kind {head.kind} "
                                            f"with {head.payload_len} payload bytes as a reply")
            return head.fields, 0

    def send_batch(self, calls: list[tuple[RequestMessage, memoryview]]
                   ) -> list[tuple[dict[str, Any], int] | OSError]:
        """Requests without payload sent back to back in one send, then their replies
        read in order (a batch costs one round trip, and the server answers the next
        request while the client takes in a reply): per call, the reply's fields and
        payload length (the payload in the call's buffer, at most its length), or the
        server's error for it. A broken or garbled connection fails the whole batch
        (raised, the connection closed)."""
        conn = self.conn
        with self._lock:
            if conn.closed:
                raise OSError(errno.ECONNRESET, f"connection to {conn.name} closed")
            rids = [next(self._ids) for _ in calls]
            out: list[tuple[dict[str, Any], int] | OSError] = []
            try:
                conn.send_frames([conn.sealed_frame(Kind.REQUEST, rid, msg.to_wire())
                                  for rid, (msg, _) in zip(rids, calls, strict=True)])
                for rid, (_, into) in zip(rids, calls, strict=True):
                    out.append(self._batch_reply(rid, into))
            except ProtocolError as exc:
                conn.close()
                raise OSError(getattr(exc, "errno", None) or errno.EPROTO,
                              f"connection to {conn.name} failed: {exc}") from None
            except BaseException:
                conn.close()  # replies left unread would be taken for the next call's
                raise
            self._used = time.monotonic()
            return out

    def _batch_reply(self, rid: int, into: memoryview) -> tuple[dict[str, Any], int] | OSError:
        conn = self.conn
        head = conn.recv_head(HEAD_FIRST if len(into) > HEAD_RECV else 0)
        if head is None:
            raise OSError(errno.ECONNRESET, f"connection to {conn.name} closed")
        if head.rid != rid or head.payload_len > len(into) or (
                head.payload_len and head.kind != Kind.REPLY):
            raise OSError(errno.EPROTO, f"{conn.name} answered request {head.rid} (kind "
                                        f"{head.kind}, {head.payload_len} payload bytes), "
                                        f"not {rid}")
        if head.payload_len:
            conn.recv_payload_into(into[:head.payload_len])
        if head.kind == Kind.ERROR:
            return from_wire(head.fields.get("errno"), head.fields.get("msg"))
        if head.kind != Kind.REPLY:
            raise OSError(errno.EPROTO, f"{conn.name} sent a frame of kind {head.kind} "
                                        "as a reply")
        return head.fields, head.payload_len

    def close(self) -> None:
        self.conn.close()

"""Request/reply on top of :mod:`pfs.core.wire.transport`.

``RpcClient`` multiplexes many calls on one connection by request id; a reply's payload
is received straight into the buffer the caller passed (``into=``). ``RpcService`` is the
server side: methods named ``rpc_<name>``. A service with a message registry
(``messages``, see :mod:`pfs.core.messages`) hands each handler its typed request, decoded and
validated from the frame (a bad field answers the message's errno), and encodes the typed
reply it returns (or a :class:`Reply` around one, for payloads and descriptors). A
service without one (test fakes) gets the raw :class:`Request` and returns a dict. An
``OSError`` a handler raises travels back as errno + message.
"""
from __future__ import annotations

import builtins
import collections
import contextvars
import errno
import itertools
import logging
import math
import os
import resource
import select
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import trio

from pfs.core import metrics
from pfs.core.auth import OPEN, Identity, ServerAuth
from pfs.core.config import ConnLimits
from pfs.core.errors import ProtocolError, from_wire, to_wire
from pfs.core.messages.base import Registry, ReplyMessage, RequestMessage, parse_reply
from pfs.core.wire.admission import Admission, Ticket
from pfs.core.wire.protocol import FrameHead, Kind, Limits
from pfs.core.wire.seal import TAG
from pfs.core.wire.transport import (
    NOT_READY,
    YIELD_EVERY,
    Connection,
    ConnectionClosed,
    Payload,
    Sink,
    TlsConnection,
    open_connection,
    tls_connection,
    tune_socket,
)

log = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT = 60.0
# accept() failing for want of descriptors or memory: wait, doubling, then try again
ACCEPT_SHORT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# ... or because the peer left before we took it: the next one
ACCEPT_RETRY_ERRNOS = ACCEPT_SHORT_ERRNOS | {errno.ECONNABORTED, errno.EPROTO,
                                             errno.EPERM, errno.ENETDOWN, errno.EHOSTUNREACH}
ACCEPT_BACKOFF_MIN = 0.01
ACCEPT_BACKOFF_MAX = 1.0
# seconds a caller that gives up waits for the rest of a reply already arriving into its
# buffer, before dropping the connection (and the other calls on it) instead
ABANDON_GRACE = 1.0
# seconds a connection must have been idle before :attr:`RpcClient.alive` asks the
# socket whether the peer went away (a system call): a peer that closed the connection
# while it was idle longer is noticed before the next request goes out on it; within
# this window (back-to-back calls) a closed connection shows as the send's or the
# reply's error, as one that closes just after the check always did
PEER_CHECK_IDLE = 0.01
# Called with a reply's map and payload length before its payload is received: a sink for
# its pieces as they land (``Connection._recv_streamed``), or None.
OnReply = Callable[[dict[str, Any], int], Sink | None]


# ---------------------------------------------------------------------------
# client side
# ---------------------------------------------------------------------------
class _Call:
    """One call in flight: where its reply goes, and how it ended."""

    __slots__ = ("into", "on_reply", "done", "waiter", "fields", "payload", "nbytes", "error")

    def __init__(self, into: memoryview | list[memoryview] | None,
                 on_reply: OnReply | None = None) -> None:
        self.into = into
        self.on_reply = on_reply
        self.done = False
        self.waiter: trio.Event | None = None  # made only when someone waits for it
        self.fields: dict[str, Any] | None = None
        self.payload: bytearray | None = None
        self.nbytes = 0
        self.error: OSError | None = None

    def finish(self) -> None:
        self.done = True
        if self.waiter is not None:
            self.waiter.set()

    async def wait(self) -> None:
        """Until :meth:`finish` (called by whoever reads the reply)."""
        if self.waiter is None:
            self.waiter = trio.Event()
        await self.waiter.wait()


@dataclass(slots=True)
class Result:
    fields: dict[str, Any]
    payload: bytearray | None  # when no ``into`` buffer was given
    nbytes: int  # payload bytes received (into ``into`` or ``payload``)


@dataclass(slots=True)
class Hold:
    """A caller that knows nothing else waits on the event loop (the mount, serving one
    request at a time) may wait for its reply in a ``poll()`` of the socket, holding the
    loop, for up to ``seconds``: the reply of a quick call is read without the
    scheduler's passes, a wait on the socket and a cancel scope. Past that it waits the
    usual way, the request sent once all the same (a change is never sent again);
    ``waits()`` is called first, and before any other wait."""

    seconds: float
    waits: Callable[[], None]


# the calls of this task (a context variable: trio gives each task its own) may hold
# the event loop while they wait, as this says (``MetaClient.holding``)
HOLD: contextvars.ContextVar[Hold | None] = contextvars.ContextVar("pfs_rpc_hold",
                                                                  default=None)


class RpcClient:
    """Calls over one connection; run :meth:`run` in a nursery before calling.

    Who reads the replies: a caller alone on the connection reads its own reply, in its
    own task, straight after sending (no reader task to wake, no event to wait for: the
    hand-offs are most of a small call's cost under trio), and completes any other
    reply that arrives meanwhile. While it reads, later callers wait; when it is done
    and others still wait, the reader task (:meth:`run`) takes over until none does,
    then the next caller alone reads its own again. The reader task also receives every
    payload that has not fully arrived with its head, so a cancelled caller never leaves
    a frame half-received (:meth:`_abandon`'s grace applies as before). TLS connections
    are read by the reader task only. With nobody reading, :attr:`alive` peeks at the
    socket to notice a peer that closed the connection while it was idle
    (``PEER_CHECK_IDLE``). A caller alone with a small request enters the call's
    timeout scope only when something has to wait (see ``_exchange``).
    """

    def __init__(self, conn: Connection, timeout: float = DEFAULT_CALL_TIMEOUT) -> None:
        self.conn = conn
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._pending: dict[int, _Call] = {}
        self._dead: OSError | None = None
        self._cancel = trio.CancelScope()
        # callers read their own replies (plain sockets: a cancelled read loses nothing)
        self._direct = not isinstance(conn, TlsConnection)
        # someone (a caller or the reader task) reads replies off the socket
        self._reading = not self._direct
        self._wake = trio.Event()  # the reader task is to take over
        self._handoff: FrameHead | None = None  # a head whose payload it is to receive
        # calls since the last sure yield to the scheduler (a reply that is always there
        # when read would never let other tasks run: see ``_exchange``)
        self._unyielded = 0
        self._used = -math.inf  # time.monotonic() of the last call's end (``alive``)
        self._poller: select.poll | None = None  # of ``_poll``

    @classmethod
    async def open(cls, nursery: trio.Nursery, host: str, port: int,
                   limits: Limits | None = None, timeout: float = DEFAULT_CALL_TIMEOUT,
                   hello: Callable[[Connection], Awaitable[None]] | None = None,
                   tls: ssl.SSLContext | None = None) -> RpcClient:
        conn = await open_connection(host, port, limits, tls=tls)
        if hello is not None:
            try:
                await hello(conn)
            except BaseException:
                conn.close()
                raise
        client = cls(conn, timeout)
        nursery.start_soon(client.run, name=f"rpc-reader {host}:{port}")
        return client

    @property
    def alive(self) -> bool:
        if self._dead is not None or self.conn.closed:
            return False
        if not self._reading and time.monotonic() - self._used >= PEER_CHECK_IDLE \
                and self.conn.peer_gone():  # idle a while, nobody watching it
            self._fail(ConnectionClosed(f"{self.conn.name} closed the connection"))
            return False
        return True

    @property
    def busy(self) -> bool:
        """Whether a call waits for its reply."""
        return bool(self._pending)

    async def run(self) -> None:
        """The reader task: reads replies whenever no caller does (see the class doc)."""
        with self._cancel:
            try:
                if not self._direct:
                    await self._read_loop(forever=True)
                while self._dead is None:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    if self._dead is None:
                        await self._read_loop()
            except (OSError, ProtocolError) as exc:
                self._fail(OSError(getattr(exc, "errno", None) or errno.ECONNRESET,
                                   f"connection to {self.conn.name} failed: {exc}"))
                return
        self._fail(OSError(errno.ECONNRESET, f"connection to {self.conn.name} closed"))

    async def _read_loop(self, forever: bool = False) -> None:
        """Read replies while calls wait for them (``forever``: until the end)."""
        conn = self.conn
        pending = self._pending
        head, self._handoff = self._handoff, None
        try:
            while True:
                if head is None:
                    if not forever and not pending:
                        return
                    head = await conn.recv_head()
                    if head is None:
                        self._fail(ConnectionClosed(f"{conn.name} closed the connection"))
                        return
                call = pending.pop(head.rid, None)
                this, head = head, None
                if call is None:  # cancelled or unknown: drop its payload
                    await conn.skip_payload(this.payload_len)
                    continue
                await self._complete_or_fail(call, this)
        finally:
            if not forever:
                self._reading = False

    async def _read_own(self, rid: int, call: _Call, *, nowait: bool = False,
                        resumed: bool = False, ready: bool = False) -> bool:
        """A caller alone on the connection reads until its reply is in (or hands a
        frame whose payload is still arriving to the reader task). ``nowait``: only
        what is there already; False when it would have to wait (the caller still
        reads: it goes on with ``resumed``, waiting for the socket first). ``ready``:
        the socket was just seen readable (receive at once)."""
        conn = self.conn
        dec = conn.decoder
        pending = self._pending
        self._reading = True
        handoff = paused = False
        try:
            just_sent, wait_first = not (resumed or ready), resumed and not ready
            while not call.done:
                head = await conn.recv_head(fair=False, just_sent=just_sent, nowait=nowait,
                                            wait_first=wait_first)
                just_sent = wait_first = False
                if head is NOT_READY:
                    paused = True
                    return False
                if head is None:
                    self._fail(ConnectionClosed(f"{conn.name} closed the connection"))
                    return True
                n = head.payload_len
                if n and dec.buffered < n + (TAG if dec.tag_due else 0):
                    # receiving it could be cancelled half-way: the reader task's job
                    self._handoff = head
                    handoff = True
                    return True
                # from here on nothing waits (all of it is buffered): no cancellation
                other = pending.pop(head.rid, None)
                if other is None:
                    await conn.skip_payload(n)
                else:
                    await self._complete_or_fail(other, head)
        except (OSError, ProtocolError) as exc:
            self._fail(OSError(getattr(exc, "errno", None) or errno.ECONNRESET,
                               f"connection to {conn.name} failed: {exc}"))
        finally:
            if paused:
                pass  # the caller reads on
            elif handoff or (self._dead is None and len(pending) > (rid in pending)):
                self._wake.set()  # others wait: the reader task reads on (``_reading``)
            else:
                self._reading = False
        return True

    def _poll(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the socket to be readable, in this thread, holding
        the event loop (:class:`Hold`); whether it is."""
        poller = self._poller
        if poller is None:
            assert self.conn._raw is not None  # (only the plain socket's fast path polls)
            poller = self._poller = select.poll()
            poller.register(self.conn._raw.fileno(), select.POLLIN)
        try:
            return bool(poller.poll(seconds * 1000.0))
        except InterruptedError:  # a signal: the usual way
            return False

    async def _complete_or_fail(self, call: _Call, head: FrameHead) -> None:
        try:
            await self._complete(call, head)
        except BaseException as exc:
            # out of ``_pending`` already: ``_fail`` would not wake its caller
            if not call.done:
                call.error = OSError(getattr(exc, "errno", None) or errno.ECONNRESET,
                                     f"connection to {self.conn.name} failed: {exc}")
                call.finish()
            raise

    async def _complete(self, call: _Call, head: FrameHead) -> None:
        conn = self.conn
        n = head.payload_len
        if head.kind == Kind.ERROR:
            await conn.skip_payload(n)
            call.error = from_wire(head.fields.get("errno"), head.fields.get("msg"))
        elif head.kind != Kind.REPLY:
            raise ProtocolError(f"{conn.name} sent a frame of kind {head.kind} as a reply")
        else:
            sink = call.on_reply(head.fields, n) if n and call.on_reply is not None else None
            if n and isinstance(call.into, list):
                await conn.recv_payload_into_vec(call.into, n, sink)
            elif n and isinstance(call.into, memoryview):
                if n > len(call.into):
                    raise ProtocolError(
                        f"{conn.name} replied with {n} bytes into a {len(call.into)}-byte buffer")
                await conn.recv_payload_into(call.into[:n], sink)
            elif n:
                call.payload = await conn.recv_payload(n)
            call.nbytes = n
            call.fields = head.fields
        call.finish()

    def _fail(self, exc: OSError) -> None:
        if self._dead is None:
            self._dead = exc
        pending, self._pending = self._pending, {}
        for call in pending.values():
            call.error = OSError(exc.errno, str(exc.strerror or exc))
            call.finish()
        self.conn.close()
        self._wake.set()  # the reader task ends

    async def send(self, msg: RequestMessage, *, payload: Payload | None = None,
                   into: memoryview | list[memoryview] | None = None,
                   timeout: float | None = None, closes: list[int] | None = None,
                   unwritten: list[int] | None = None,
                   on_reply: OnReply | None = None, hold: Hold | None = None) -> Result:
        """One typed request (with handles to release first, ``closes``, and those of
        them that sent no data, ``unwritten``: a metaserver request); the reply's map
        unparsed (see :meth:`request`), its payload in
        ``into`` (a buffer, or a list of buffers filled in order) when given.
        ``on_reply(fields, n)``, called with the reply's map before its ``n`` payload
        bytes are received into ``into``, may return a sink to hand each piece to as it
        lands (it must not raise; the payload's tag is checked only after it).
        ``hold``: the caller may hold the event loop while it waits (see :class:`Hold`)."""
        wire = msg.to_wire()
        if closes:
            wire["closes"] = closes
            if unwritten:
                wire["unwritten"] = unwritten
        return await self._exchange(msg.method, wire, payload, into, timeout, on_reply, hold)

    async def call(self, method: str, fields: dict[str, Any] | None = None, *,
                   payload: Payload | None = None,
                   into: memoryview | list[memoryview] | None = None,
                   timeout: float | None = None, hold: Hold | None = None) -> Result:
        """An untyped request, for tests that send what no message allows (a missing
        field, an unknown method); the library sends messages (:meth:`send`,
        :meth:`request`)."""
        wire = {"m": method}
        if fields:
            wire.update(fields)
        return await self._exchange(method, wire, payload, into, timeout, None, hold)

    async def _exchange(self, method: str, wire: dict[str, Any], payload: Payload | None,
                        into: memoryview | list[memoryview] | None,
                        timeout: float | None, on_reply: OnReply | None = None,
                        hold: Hold | None = None) -> Result:
        if self._dead is not None:
            raise OSError(self._dead.errno, str(self._dead.strerror or self._dead))
        self._unyielded += 1
        if self._unyielded >= YIELD_EVERY:  # before anything is sent: cancelling is harmless
            self._unyielded = 0
            await trio.lowlevel.checkpoint()
            if self._dead is not None:
                raise OSError(self._dead.errno, str(self._dead.strerror or self._dead))
        rid = next(self._ids)
        started = time.perf_counter()
        call = _Call(into, on_reply)
        self._pending[rid] = call
        limit = self.timeout if timeout is None else timeout
        conn = self.conn
        rest: memoryview | None = None
        resumed = False
        scope: trio.CancelScope | None = None
        try:
            # Alone, and a small request: sending it and reading a reply already there
            # wait for nothing, so need no timeout (a cancel scope costs more than the
            # system calls); the scope covers whatever has to wait.
            fast = payload is None and not self._reading and conn._raw is not None \
                and not conn._send_lock.busy
            if fast:
                rest = conn.try_send(Kind.REQUEST, rid, wire)
                if rest is None:
                    resumed = not await self._read_own(rid, call, nowait=True)
                    if resumed and hold is not None and self._poll(hold.seconds):
                        resumed = not await self._read_own(rid, call, nowait=True, ready=True)
            if not call.done and hold is not None:
                hold.waits()  # the loop is the others' again
            if not call.done:
                with trio.move_on_after(limit if limit > 0 else math.inf) as scope:
                    if resumed:  # the reply was not there yet: wait for it
                        await self._read_own(rid, call, resumed=True)
                    elif not fast or rest is not None:
                        if rest is not None:
                            await conn.send_rest(rest)
                        else:
                            await conn.send_frame(Kind.REQUEST, rid, wire, payload)
                        if not self._reading:  # alone: read the reply here (the class doc)
                            await self._read_own(rid, call)
                    if not call.done:
                        await call.wait()
        except BaseException:
            await self._abandon(rid, call)
            raise
        self._used = time.monotonic()
        if scope is not None and scope.cancelled_caught:
            await self._abandon(rid, call)
            raise OSError(errno.ETIMEDOUT,
                          f"{method} to {self.conn.name} got no reply in {limit:g} s")
        # a client's view (the mount's /metrics): service "client", reply bytes in
        metrics.rpc_done("client", method, started,
                         None if call.error is None else call.error.errno or errno.EIO,
                         call.nbytes, 0)
        if call.error is not None:
            raise call.error
        assert call.fields is not None
        return Result(call.fields, call.payload, call.nbytes)

    async def request(self, msg: RequestMessage, *, payload: Payload | None = None,
                      timeout: float | None = None) -> Any:
        """A typed call: ``msg`` out, its reply class back (a reply that does not
        match it is ``EPROTO``: the peer broke the protocol)."""
        result = await self._exchange(msg.method, msg.to_wire(), payload, None, timeout)
        return parse_reply(msg, result.fields)

    async def _abandon(self, rid: int, call: _Call) -> None:
        """The caller gives up on a call (timeout, cancellation)."""
        if self._pending.pop(rid, None) is not None or call.done or call.into is None:
            return
        # Its reply is being received straight into the caller's buffer, which is the
        # caller's again once we return. The reader cannot be stopped half-way through a
        # payload, so let the rest arrive (quick on a live connection) and keep the
        # connection for the calls sharing it; if it does not come soon, the connection
        # goes (the next call reconnects).
        with trio.CancelScope(shield=True), trio.move_on_after(ABANDON_GRACE):
            await call.wait()
        if not call.done:
            self._fail(OSError(errno.ECONNRESET, f"connection to {self.conn.name} "
                               "dropped: a call gave up while its reply was arriving"))

    def close(self) -> None:
        self._cancel.cancel()
        self.conn.close()


# ---------------------------------------------------------------------------
# server side
# ---------------------------------------------------------------------------
_REQUIRED: Any = object()


@dataclass(slots=True)
class Request:
    """A request frame as received: what an untyped service's handler gets."""

    method: str
    fields: dict[str, Any]
    payload: bytearray | None
    reply: ClassVar[None] = None  # no reply class (``encode``)

    def _get(self, key: str, kind: type, what: str, default: Any) -> Any:
        if key not in self.fields:
            if default is _REQUIRED:
                raise OSError(errno.EINVAL, f"{self.method}: missing field '{key}'")
            return default
        value = self.fields[key]
        if value is None and default is not _REQUIRED:
            return default
        if not isinstance(value, kind) or isinstance(value, bool):  # True is no integer
            raise OSError(errno.EINVAL, f"{self.method}: field '{key}' must be {what}")
        return value

    def int(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._get(key, int, "an integer", default)

    def list(self, key: builtins.str, default: Any = _REQUIRED) -> Any:
        return self._get(key, list, "a list", default)

    def any(self, key: builtins.str, default: Any = None) -> Any:
        return self.fields.get(key, default)


@dataclass(slots=True)
class Reply:
    fields: dict[str, Any] | ReplyMessage  # a message is encoded by the service
    payload: bytes | bytearray | memoryview | None = None
    # (fd, offset, count): payload sent from a file with sendfile; closed by ``release``
    file: tuple[int, int, int] | None = None
    release: Callable[[], None] | None = None
    # ``file``'s range is neither written nor shortened until ``release`` (the blocks'
    # lock is held): a MAC'd reply may be read through a mapping, not copied first
    stable: bool = False
    # descriptors passed to the peer with the reply (local Unix connections only)
    fds: list[int] | None = None


@dataclass
class ConnContext:
    """Per-connection state a service can keep (session, verified capabilities...)."""

    conn: Connection
    peer: str
    state: dict[str, Any] = field(default_factory=dict)
    identity: Identity | None = None  # who authenticated (None: not yet)
    inflight: set[int] = field(default_factory=set)  # request ids being handled
    local: bool = False  # came through the local Unix socket (same host)
    # set when a request ends, while the reader waits for one to (max_in_flight reached)
    slot_freed: trio.Event | None = None
    # the connection's handler tasks: where a reply :meth:`RpcService.answer` could not
    # send whole at once is finished
    tasks: trio.Nursery | None = None

    @property
    def version(self) -> int:
        """The protocol version this connection's frames carry (negotiated by the
        handshake, pfs/core/versions.py)."""
        return self.conn.decoder.version


class ByteBudget:
    """Payload bytes held by requests in flight; a reader waits while it is spent."""

    def __init__(self, total: int) -> None:
        self.total = self.free = total
        self._freed = trio.Event()

    async def acquire(self, n: int) -> None:
        n = min(n, self.total)
        while n > self.free:
            await self._freed.wait()
        self.free -= n

    def release(self, n: int) -> None:
        self.free += min(n, self.total)
        self._freed.set()
        self._freed = trio.Event()


_Job = tuple["ConnContext", int, "Request", "tuple[ByteBudget, ByteBudget, int] | None"]


class _Workers:
    """The tasks that answer a connection's requests that may wait (not inline), kept
    between requests: handing a request to a parked worker is one reschedule, where a
    task of its own (spawn, context copy, nursery bookkeeping, exit) cost the server
    about as much again as the rest of a small request. A request finding no worker
    parked gets a new one, so as many wait at once as before (``max_in_flight``); they
    live in the connection's nursery and end with it."""

    __slots__ = ("_svc", "_nursery", "_jobs", "_idle", "_closed")

    def __init__(self, svc: RpcService, nursery: trio.Nursery) -> None:
        self._svc = svc
        self._nursery = nursery
        self._jobs: collections.deque[_Job] = collections.deque()
        self._idle = trio.lowlevel.ParkingLot()
        self._closed = False

    def submit(self, job: _Job) -> None:
        self._jobs.append(job)
        if self._idle:
            self._idle.unpark()
        else:
            self._nursery.start_soon(self._work, name=f"{self._svc.name}-handler")

    async def _work(self) -> None:
        jobs, handle = self._jobs, self._svc._handle
        while True:
            while jobs:
                await handle(*jobs.popleft())
            if self._closed:
                return
            await self._idle.park()

    def close(self) -> None:
        """No more requests: parked workers end, busy ones after their request."""
        self._closed = True
        self._idle.unpark_all()


class RpcService:
    """Base for servers: dispatches ``rpc_<method>`` handlers."""

    name = "rpc"
    # Methods answered in the connection's reader task, without a task of their own:
    # quick ones that never wait (a task spawn and its scheduling are a third of a
    # small request's cost). Everything else runs concurrently.
    inline_methods: frozenset[str] = frozenset()
    max_in_flight = 256  # requests per connection
    max_connections = 4096  # connections served at once; accept waits beyond
    # floods (docs/security.md; ConnLimits in the servers' configs): connections from one
    # address, and handshakes in flight (pfs/core/wire/admission.py)
    max_per_peer = 1024
    max_unauthenticated = 256
    max_unauthenticated_per_peer = 64
    frame_timeout = 30.0  # seconds a started frame (head, then payload) may take to arrive
    auth_timeout = 5.0  # seconds a new connection has to authenticate
    conn_payload_budget = 256 << 20  # payload bytes in flight per connection
    payload_budget = 1 << 30  # ... and across all connections
    # the typed messages of this service's methods; None: handlers get raw requests
    messages: Registry | None = None

    def __init__(self, limits: Limits | None = None, auth: ServerAuth | None = None) -> None:
        self.limits = limits or Limits()
        self.auth = auth
        self._methods: dict[str, tuple[Callable[[ConnContext, Any], Awaitable[Any]],
                                       type[RequestMessage] | None]] = {}
        for name in self.handler_names():
            msg = None if self.messages is None else self.messages.get(name)
            if self.messages is not None and msg is None:
                raise TypeError(f"{self.name}: rpc_{name} has no message in "
                                f"{self.messages.service}'s registry")
            self._methods[name] = (getattr(self, "rpc_" + name), msg)
        if self.messages is not None:
            unserved = [m for m in self.messages.requests if m not in self._methods]
            if unserved:
                raise TypeError(f"{self.name}: no handler for {', '.join(unserved)}")
        self._budget: ByteBudget | None = None
        self._conn_slots: trio.Semaphore | None = None
        self._admission: Admission | None = None
        self._accept_logged = -1e9  # when accept's failure was last logged (monotonic)

    def apply_limits(self, limits: ConnLimits, fd_budget: int | None = None) -> None:
        """The connection limits of a server's config; ``max_connections`` lowered to
        ``fd_budget`` (the descriptors left for connections under RLIMIT_NOFILE), so
        that a flood makes ``accept`` wait rather than fail."""
        self.max_connections = limits.max_connections
        if fd_budget is not None and fd_budget < self.max_connections:
            log.info("%s: serving at most %d connections (of max_connections %d) to fit "
                     "the open-file limit", self.name, max(fd_budget, 16),
                     self.max_connections)
            self.max_connections = max(fd_budget, 16)
        self.max_per_peer = limits.max_per_peer
        self.max_unauthenticated = limits.max_unauthenticated
        self.max_unauthenticated_per_peer = limits.max_unauthenticated_per_peer
        self.auth_timeout = limits.handshake_timeout

    @property
    def admission(self) -> Admission:
        if self._admission is None:
            self._admission = Admission(self.max_per_peer, self.max_unauthenticated,
                                        self.max_unauthenticated_per_peer, self.name)
        return self._admission

    @classmethod
    def handler_names(cls) -> list[str]:
        """The methods this service answers (its ``rpc_<name>`` handlers)."""
        return [attr[4:] for attr in dir(cls) if attr.startswith("rpc_")]

    def is_inline(self, req: Request) -> bool:
        """Whether ``req`` is answered in the reader task (see ``inline_methods``); a
        service may also inline a method's requests that will not wait."""
        return req.method in self.inline_methods

    def take(self, ctx: ConnContext, rid: int, req: Request) -> bool:
        """Whether the service takes ``req`` (authenticated, no payload, not inline)
        to answer it itself with :meth:`answer` once it can, from whatever runs then:
        no worker task is handed it, none waits for it and none is woken to send its
        reply (the metaserver's group commit answers its changes right after the
        flush). Called in the reader task; it must not block. Default: never."""
        return False

    def answer(self, ctx: ConnContext, rid: int, method: str,
               result: Reply | dict[str, Any] | BaseException, started: float = 0.0) -> None:
        """Answer request ``rid`` that :meth:`take` took, without waiting: its reply
        (as :meth:`encode` made it) or its error, sent now when the socket takes it
        whole, else by a task of the connection; its in-flight slot freed. Nothing is
        sent on a connection already closed. ``started``: ``time.perf_counter()`` when
        it was taken, for the metrics (0 when they are off)."""
        ctx.inflight.discard(rid)
        freed = ctx.slot_freed
        if freed is not None:
            ctx.slot_freed = None
            freed.set()
        err = None
        if isinstance(result, BaseException):
            if not isinstance(result, OSError):  # a bug: logged, the peer gets EIO
                log.error("%s: %s failed", self.name, method, exc_info=result)
                result = OSError(errno.EIO, f"internal error in {method}; see the server "
                                            "log")
            err = result.errno or errno.EIO
        if started:
            metrics.rpc_done(self.name, method, started, err, 0, 0)
        conn = ctx.conn
        if conn.closed:
            return
        if isinstance(result, Reply):
            self._send_later(ctx, self._send_reply(conn, rid, result))
            return
        kind, fields = ((Kind.ERROR, to_wire(result)) if isinstance(result, OSError)
                        else (Kind.REPLY, result))
        if conn._raw is not None and not conn._send_lock.busy:
            rest = conn.try_send(kind, rid, fields)
            if rest is not None:
                self._send_later(ctx, conn.send_rest(rest))
        else:
            self._send_later(ctx, conn.send_frame(kind, rid, fields, None))

    @staticmethod
    def _send_later(ctx: ConnContext, send: Awaitable[Any]) -> None:
        """Finish ``send`` in a task of the connection (none left: dropped)."""
        async def finish() -> None:
            try:
                await send
            except ConnectionClosed:
                pass

        try:
            if ctx.tasks is None:
                raise RuntimeError("no tasks")
            ctx.tasks.start_soon(finish)
        except RuntimeError:  # the connection's tasks are over: it is closing
            send.close()  # type: ignore[attr-defined]

    async def connection_made(self, ctx: ConnContext) -> None:
        """Hook: authenticate or set up per-connection state. The base authenticates
        the peer with ``self.auth`` (nothing is served before) and sets ``ctx.identity``."""
        if self.auth is None:
            ctx.identity = OPEN
            return
        ctx.identity = await self.auth.authenticate(ctx.conn)

    def connection_lost(self, ctx: ConnContext) -> None:
        """Hook: release what the connection held (open files...)."""

    def decode(self, req: Request) -> tuple[Callable[[ConnContext, Any], Awaitable[Any]],
                                            Any]:
        """The handler of ``req`` and what it receives: the typed request (validated:
        a bad field raises the message's errno), or ``req`` itself for an untyped
        service. ENOSYS for an unknown method."""
        entry = self._methods.get(req.method)
        if entry is None:
            raise OSError(errno.ENOSYS, f"{self.name}: unknown method {req.method!r}")
        handler, cls = entry
        return handler, req if cls is None else cls.from_wire(req.fields, req.payload)

    @staticmethod
    def encode(msg: Any, result: Any) -> Reply | dict[str, Any]:
        """What a handler returned for ``msg``, encoded: a reply's map (no payload, the
        common case: no :class:`Reply` built), or a :class:`Reply` with its map."""
        if type(result) is msg.reply:  # only typed requests have a reply class
            return result.to_wire()  # type: ignore[no-any-return]
        if isinstance(result, ReplyMessage):
            raise TypeError(f"{msg.method} answered a {type(result).__name__}, "
                            f"not a {msg.reply.__name__}")
        if isinstance(result, Reply):
            if isinstance(result.fields, ReplyMessage):
                result.fields = result.fields.to_wire()
            return result
        if isinstance(msg, RequestMessage):
            raise TypeError(f"{msg.method} answered {type(result).__name__}, not a "
                            f"{msg.reply.__name__}")
        return Reply(result or {})

    async def dispatch(self, ctx: ConnContext, req: Request) -> Reply | dict[str, Any]:
        handler, msg = self.decode(req)
        return self.encode(msg, await handler(ctx, msg))

    # -- serving --------------------------------------------------------------
    async def serve(self, host: str = "127.0.0.1", port: int = 0, *,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve forever; ``nursery.start`` returns the bound port."""
        sock = trio.socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                  socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind((host, port))
        sock.listen(512)
        bound = sock.getsockname()[1]
        log.info("%s listening on %s:%d", self.name, host, bound)
        tls = self.auth.tls if self.auth is not None else None
        await self._accept_loop(sock, tls, False, lambda: task_status.started(bound))

    async def serve_unix(self, name: str, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on a local Unix socket (a leading NUL: Linux's abstract namespace, no
        file to clean up); its connections are marked ``local``. Same authentication."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(name)
        sock.listen(128)
        log.info("%s listening on local socket %r", self.name, name.lstrip("\0"))
        await self._accept_loop(sock, None, True, task_status.started)

    async def _accept_loop(self, sock: trio.socket.SocketType, tls: ssl.SSLContext | None,
                           local: bool, started: Callable[[], None]) -> None:
        if self._conn_slots is None:
            self._conn_slots = trio.Semaphore(self.max_connections)
        admission = self.admission
        backoff = ACCEPT_BACKOFF_MIN
        async with trio.open_nursery() as nursery:
            started()
            with sock:
                while True:
                    await self._conn_slots.acquire()
                    try:
                        client, addr = await sock.accept()
                    except OSError as exc:
                        self._conn_slots.release()
                        if exc.errno not in ACCEPT_RETRY_ERRNOS:
                            raise
                        if exc.errno in ACCEPT_SHORT_ERRNOS:
                            # out of descriptors or memory: free one handshake's, wait
                            admission.evict_one()
                            _log_accept_failure(self, exc, backoff)
                            await trio.sleep(backoff)
                            backoff = min(backoff * 2, ACCEPT_BACKOFF_MAX)
                        continue  # or a peer gone before we accepted it: next
                    except BaseException:
                        self._conn_slots.release()
                        raise
                    backoff = ACCEPT_BACKOFF_MIN
                    peer = "local" if local else _peer_of(addr)
                    if not admission.admit(peer):
                        client.close()
                        self._conn_slots.release()
                        continue
                    if not local:
                        tune_socket(client)
                    nursery.start_soon(self._accepted, client, tls, local, peer,
                                       name=f"{self.name}-conn")

    async def _accepted(self, sock: trio.socket.SocketType, tls: ssl.SSLContext | None,
                        local: bool = False, peer: str = "") -> None:
        admission = self.admission
        ticket = admission.handshake(peer)
        try:
            if tls is None:
                conn = Connection(sock, self.limits, name="local" if local else "")
                conn.local = local
            else:
                tls_conn = None
                with ticket.scope:
                    try:
                        tls_conn = await tls_connection(sock, tls, True, self.limits,
                                                        self.auth_timeout)
                    except OSError as exc:
                        log.info("%s: TLS handshake failed: %s", self.name, exc)
                        return
                if tls_conn is None:  # evicted from the handshake pool
                    sock.close()
                    return
                conn = tls_conn
            await self.serve_connection(conn, ticket)
        finally:
            admission.finish(ticket)
            admission.leave(peer)
            if self._conn_slots is not None:
                self._conn_slots.release()

    async def serve_connection(self, conn: Connection, ticket: Ticket | None = None) -> None:
        ctx = ConnContext(conn, conn.name, local=conn.local)
        if self._budget is None:
            self._budget = ByteBudget(self.payload_budget)
        budget = self._budget
        mine = ByteBudget(self.conn_payload_budget)
        authed = False
        try:
            scope = trio.CancelScope()
            if ticket is not None:
                if ticket.evicted:
                    return
                ticket.scope = scope  # an eviction from the handshake pool cancels it
            try:
                with scope, trio.fail_after(self.auth_timeout):
                    await self.connection_made(ctx)
            except trio.TooSlowError:
                log.info("%s: %s did not authenticate in %g s", self.name, conn.name,
                         self.auth_timeout)
                return
            except (OSError, ProtocolError) as exc:
                log.info("%s: %s not authenticated: %s", self.name, conn.name, exc)
                return
            if scope.cancelled_caught:
                log.debug("%s: %s evicted from the handshake pool", self.name, conn.name)
                return
            if ticket is not None:
                self.admission.finish(ticket)
            authed = True
            metrics.connections(self.name, 1)
            async with trio.open_nursery() as handlers:
                workers = _Workers(self, handlers)
                ctx.tasks = handlers
                try:
                    # requests in flight are bounded by counting ``inflight`` (a semaphore
                    # would add a scheduler round trip to every request)
                    inflight = ctx.inflight
                    limit = self.max_in_flight
                    frame_timeout = self.frame_timeout
                    dec = conn.decoder
                    answered = False  # a reply was just sent, or a request handed off
                    while True:
                        # after a reply, with nothing buffered: the next request is
                        # read as a client reads its reply (``just_sent``: a peer that
                        # is never this quick gets a wait, not a receive that fails)
                        head = await conn.recv_head(
                            frame_timeout, just_sent=answered and not dec.buffered)
                        answered = False
                        if head is None:
                            break
                        kind, rid, fields, n = head
                        if kind != Kind.REQUEST:
                            raise ProtocolError(f"expected a request, got frame kind {kind}")
                        if rid in inflight:
                            raise ProtocolError(f"request id {rid} reused while in flight")
                        payload = None
                        if n:
                            await mine.acquire(n)
                            await budget.acquire(n)
                            with trio.move_on_after(frame_timeout) as scope:
                                payload = await conn.recv_payload(n)
                            if scope.cancelled_caught:
                                raise ProtocolError(f"payload of {n} bytes not received in "
                                                    f"{frame_timeout:g} s")
                        method = fields.get("m")
                        if type(method) is not str:
                            self._release_payload(mine, budget, n)
                            await self._send_error(conn, rid, OSError(
                                errno.EINVAL, "request has no method name ('m')"))
                            continue
                        req = Request(method, fields, payload)
                        inline = ctx.identity is not None and self.is_inline(req)
                        if inline and not n:
                            # answered before the next frame is read: no slot to hold
                            await self._answer_inline(ctx, rid, req)
                            answered = True
                            continue
                        while len(inflight) >= limit:
                            freed = ctx.slot_freed = trio.Event()
                            await freed.wait()
                        inflight.add(rid)
                        held = (mine, budget, n) if n else None
                        if inline:
                            await self._handle(ctx, rid, req, held)
                        elif not n and self.take(ctx, rid, req):
                            answered = True  # as below: the client waits for it
                        else:
                            workers.submit((ctx, rid, req, held))
                            # a client that waits for this reply sends nothing more
                            # meanwhile: read on as after a reply (a receive that would
                            # fail with EAGAIN skipped once that is the rule)
                            answered = True
                except (ProtocolError, OSError) as exc:
                    # caught here, not outside: the nursery would wrap it in a group
                    handlers.cancel_scope.cancel()
                    if isinstance(exc, ProtocolError):
                        log.warning("%s: dropping %s: %s", self.name, conn.name, exc)
                    else:
                        log.debug("%s: connection %s ended: %s", self.name, conn.name, exc)
                    return
                workers.close()
                handlers.cancel_scope.deadline = trio.current_time() + 30
        except ProtocolError as exc:
            log.warning("%s: dropping %s: %s", self.name, conn.name, exc)
        except OSError as exc:
            log.debug("%s: connection %s ended: %s", self.name, conn.name, exc)
        finally:
            conn.close()
            budget.release(self.conn_payload_budget - mine.free)  # what its handlers held
            if authed:
                metrics.connections(self.name, -1)
                self.connection_lost(ctx)

    @staticmethod
    def _release_payload(mine: ByteBudget, budget: ByteBudget, n: int) -> None:
        if n:
            mine.release(n)
            budget.release(n)

    async def _answer_inline(self, ctx: ConnContext, rid: int, req: Request) -> None:
        """Answer an inline request that came without a payload, in the reader task (a
        stat, a lookup): what ``_handle`` does, less the in-flight slot (the reader reads
        nothing else meanwhile) and the metrics' clock when no metrics are kept."""
        timed = metrics.enabled()
        started = time.perf_counter() if timed else 0.0
        err, sent = None, 0
        conn = ctx.conn
        try:
            try:
                reply = await self.dispatch(ctx, req)
            except Exception as exc:  # noqa: BLE001 - answered, as in ``_handle``
                err = await self._answer_error(conn, rid, req, exc)
            else:
                if type(reply) is dict:  # a typed reply, encoded
                    await conn.send_frame(Kind.REPLY, rid, reply, None)
                else:
                    sent = await self._send_reply(conn, rid, reply)
        except ConnectionClosed:
            pass
        except OSError as exc:  # reading the reply's file failed
            err = await self._reply_failed(conn, rid, req, exc)
        if timed:
            metrics.rpc_done(self.name, req.method, started, err, 0, sent)

    async def _handle(self, ctx: ConnContext, rid: int, req: Request,
                      held: tuple[ByteBudget, ByteBudget, int] | None = None) -> None:
        """Answer ``req``: its reply or its error sent, its slot and payload bytes
        released (in the reader task for an inline request, else in a task of its
        own)."""
        started, err, sent = time.perf_counter(), None, 0
        conn = ctx.conn
        try:
            try:
                reply = await self.dispatch(ctx, req)
            except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the connection
                err = await self._answer_error(conn, rid, req, exc)
                return
            if type(reply) is dict:  # a typed reply, encoded
                await conn.send_frame(Kind.REPLY, rid, reply, None)
                return
            sent = await self._send_reply(conn, rid, reply)
        except ConnectionClosed:
            pass
        except OSError as exc:  # reading the reply's file failed
            err = await self._reply_failed(conn, rid, req, exc)
        finally:
            metrics.rpc_done(self.name, req.method, started, err, held[2] if held else 0, sent)
            ctx.inflight.discard(rid)
            freed = ctx.slot_freed
            if freed is not None:
                ctx.slot_freed = None
                freed.set()
            if held is not None:
                req.payload = None
                self._release_payload(*held)

    async def _reply_failed(self, conn: Connection, rid: int, req: Request,
                            exc: OSError) -> int:
        """A reply whose file could not be read (a disk error): the error instead where
        none of the reply went out, else the connection was cut (the peer's other
        calls on it fail and are retried); never the server's end."""
        log.warning("%s: %s reply to %s failed: %s", self.name, req.method, conn.name,
                    exc.strerror or exc)
        if conn.closed:
            return exc.errno or errno.EIO
        return await self._answer_error(conn, rid, req, exc)

    async def _answer_error(self, conn: Connection, rid: int, req: Request,
                            exc: Exception) -> int:
        """A handler's failure as the peer gets it: an ``OSError`` as its errno, anything
        else (a bug: logged here, or the peer would hang) as ``EIO``; the errno sent."""
        if isinstance(exc, OSError):
            await self._send_error(conn, rid, exc)
            return exc.errno or errno.EIO
        log.error("%s: %s failed", self.name, req.method, exc_info=exc)
        await self._send_error(conn, rid, OSError(
            errno.EIO, f"internal error in {req.method}; see the server log"))
        return errno.EIO

    @staticmethod
    async def _send_reply(conn: Connection, rid: int, reply: Any) -> int:
        """A :class:`Reply` sent (its payload, file or descriptors with it); the payload
        bytes sent."""
        assert isinstance(reply, Reply)
        sent = reply.file[2] if reply.file else len(reply.payload or b"")
        try:
            fields = reply.fields
            assert isinstance(fields, dict)  # encoded by ``encode``
            if reply.fds:
                await conn.send_frame_with_fds(Kind.REPLY, rid, fields, reply.fds)
            elif reply.file is not None:
                fd, off, count = reply.file
                await conn.send_frame_from_file(Kind.REPLY, rid, fields, fd, off, count,
                                                reply.stable)
            else:
                await conn.send_frame(Kind.REPLY, rid, fields, reply.payload)
        finally:
            if reply.release is not None:
                reply.release()
        return sent

    @staticmethod
    async def _send_error(conn: Connection, rid: int, exc: OSError) -> None:
        try:
            await conn.send_frame(Kind.ERROR, rid, to_wire(exc))
        except ConnectionClosed:
            pass


def _peer_of(addr: Any) -> str:
    """The address a connection came from: what per-peer limits count."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)


def _log_accept_failure(svc: RpcService, exc: OSError, backoff: float) -> None:
    """One line per 10 s about accept failing (the cause, how many descriptors)."""
    now = time.monotonic()
    if now - svc._accept_logged < 10.0:
        return
    svc._accept_logged = now
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = -1
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    log.warning("%s: accept failed: %s (%d of %d descriptors open); backing off %.2f s",
                svc.name, exc, used, soft, backoff)

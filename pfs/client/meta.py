"""The metaserver connection, and its operations by inode number (the FUSE layer's view).

Each method runs the one plan of :mod:`pfs.client.ops` for its operation (``meta_*``:
the typed request and how its reply is read, defined once for every caller) on the trio
driver; the path API runs the same plans with a path ``At``. What is here is the
connection: one multiplexed connection, opened again when it broke. A transient outage
(``pfs.core.errors.transient``: refused, reset, a handshake cut, the metaserver starting)
is retried within the client's ``timeout`` (a mount whose metaserver restarts waits for
it, as an NFS hard mount would, up to that bound) and is ``ETIMEDOUT`` once it passes. A
request that may have reached the metaserver before its connection broke is sent again
only if it changes nothing (:data:`IDEMPOTENT`); the others fail with the connection's
errno (a close with a size to commit has its own retries, in ``ops``).

``direct=True`` (the synchronous client): calls go over a blocking connection instead
(``request_blocking``), one at a time, from whichever thread makes them: the blocking
driver carries the sync client's metadata plans (``pfs.client.ops``) out in the caller's
thread with no hop into its trio thread. A call made from the trio thread blocks that
loop for one round trip.

:meth:`MetaClient.run_now` (the mount): a read-only call made from the trio thread at
once, over a blocking connection of its own with a short timeout, when its caller knows
nothing else waits on the loop; it saves the trio round trip's scheduling (a wait on the
socket, the scheduler's passes, a cancel scope). That connection never carries handles
(no ``closes``, no ``generation``); when it is down or fails, the call goes the usual way.
"""
from __future__ import annotations

import contextvars
import errno
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from pfs.client import ops
from pfs.client.plan import MetaCall, Plan
from pfs.client.trio_driver import TrioDriver
from pfs.client.types import Cred, DirEntry, StatResult, fsname
from pfs.core import errors as E
from pfs.core import metrics
from pfs.core.auth import ClientAuth
from pfs.core.messages import meta as M
from pfs.core.messages.base import RequestMessage, parse_reply
from pfs.core.messages.records import At, WireCred
from pfs.core.wire.blocking import BlockingRpcClient
from pfs.core.wire.connect import open_blocking, open_rpc
from pfs.core.wire.rpc import HOLD, Hold, RpcClient

log = logging.getLogger(__name__)
T = TypeVar("T")

CLOSE_DELAY = 0.2  # seconds a deferred close waits for a request to carry it
# run_now: how long one call may hold the event loop (then it goes the usual way), and
# how long after a failure (or before the connection is up) calls go the usual way
NOW_TIMEOUT = 0.25
NOW_BACKOFF = 5.0

# requests that change nothing: sent again after their connection broke mid-call
IDEMPOTENT: tuple[type[RequestMessage], ...] = (
    M.Hello, M.Resolve, M.Lookup, M.Getattr, M.Access, M.Renew, M.Readlink, M.Readdir,
    M.Statfs, M.Getxattr, M.Listxattr, M.GetLayout, M.Servers, M.ScanInodes,
    M.ScanDeleting, M.ScanCap)
FIRST_DELAY, MAX_DELAY = 0.05, 1.0  # seconds between tries: doubling up to MAX_DELAY


class Retry:
    """The retries of one call: the pause before each next try, until ``timeout``
    seconds from the first have passed (then :class:`pfs.core.errors.Final`
    ``ETIMEDOUT`` naming the last error)."""

    __slots__ = ("what", "timeout", "deadline", "delay", "quiet")

    def __init__(self, what: str, timeout: float, quiet: bool = False) -> None:
        self.what, self.timeout = what, timeout
        self.quiet = quiet  # never reached yet: the final error says it all
        self.deadline = time.monotonic() + timeout
        self.delay = FIRST_DELAY

    def pause(self, exc: OSError, sent: bool, msg: RequestMessage) -> float:
        """Seconds to wait before trying again after ``exc``; raise it (or ETIMEDOUT)
        when it is not retried. ``sent``: the request may have reached the server."""
        if not E.transient(exc) or (sent and exc.errno != errno.EAGAIN
                                    and not isinstance(msg, IDEMPOTENT)):
            raise exc
        delay = self.delay
        if time.monotonic() + delay > self.deadline:
            why = str(exc.strerror or exc)  # name the metaserver once
            why = why.replace(f"{self.what}: ", "").replace(f"{self.what} ", "")
            raise E.Final(errno.ETIMEDOUT, f"{self.what}: no answer within {self.timeout:g} s "
                                           f"({why})") from exc
        if delay == FIRST_DELAY:
            text = exc.strerror or str(exc)
            log.log(logging.INFO if self.quiet else logging.WARNING, "%s; retrying for up to %g s",
                        text if self.what in text else f"{self.what}: {text}", self.timeout)
        self.delay = min(delay * 2, MAX_DELAY)
        return delay


class MetaClient:
    def __init__(self, nursery: trio.Nursery, host: str, port: int, *,
                 timeout: float = 60.0, cred: Cred | None = None,
                 auth: ClientAuth | None = None, direct: bool = False,
                 connect_timeout: float | None = None) -> None:
        self._nursery = nursery
        self._auth = auth or ClientAuth()
        self.host, self.port = host, port
        self.timeout = timeout
        # before the first answer an outage is retried this long (ClientConfig)
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._reached = False
        self.cred = cred or Cred.current()
        self._wire_cred: tuple[Cred | None, WireCred] = (None, (0, 0, ()))
        self._driver = TrioDriver(meta=self)  # runs the metadata plans of ops
        self._rpc: RpcClient | None = None
        self._connect_lock = trio.Lock()
        self.direct = direct
        self._blocking: BlockingRpcClient | None = None
        self._blocking_lock = threading.Lock()
        self._disconnected = False
        # direct mode: the blocking connection's number (handle ids are per connection),
        # and the handles closed with nothing to commit, released by the next request
        self.generation = 0
        # handles closed with nothing to commit are released along with the next
        # request instead of a round trip each: always in direct mode, and where the
        # owner asks for it (the mount: a clean RELEASE costs no metaserver call)
        self.defer_closes = direct
        self._closes: list[int] = []
        self._unwritten: list[int] = []  # those of them that sent no data (handles.py)
        self._closes_gen = 0
        self._closes_lock = threading.Lock()
        self._closes_since = 0.0  # time.monotonic() when the oldest of ``_closes`` came
        self._flush_due = False
        self._now_rpc: BlockingRpcClient | None = None  # run_now's connection
        self._now_after = 0.0  # monotonic time before which run_now opens none
        try:
            self._token: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:  # made outside trio: deferred closes wait for a request
            self._token = None

    async def _client(self) -> RpcClient:
        rpc = self._rpc
        if rpc is not None and rpc.alive:
            return rpc
        async with self._connect_lock:
            if self._rpc is None or not self._rpc.alive:
                try:
                    self._rpc = await open_rpc(self._auth, self._nursery, self.host,
                                               self.port, timeout=self.timeout)
                except E.Final:
                    raise
                except OSError as exc:
                    raise self._unreachable(exc) from None
                await self._rpc.request(M.Hello(client=f"pfs-{os.getpid()}"))
                self.generation += 1  # handle ids are per connection
            return self._rpc

    @property
    def name(self) -> str:
        return f"metaserver {self.host}:{self.port}"

    def _unreachable(self, exc: OSError) -> OSError:
        """A connection that could not be opened: its errno (refused, reset, timed out),
        a message naming the metaserver once."""
        code = exc.errno if exc.errno in E.errnos(E.Action.RECONNECT) else errno.ENOTCONN
        why = str(exc.strerror or exc).replace(f"cannot connect to {self.host}:{self.port}: ", "")
        return OSError(code, f"{self.name} unreachable: {why}")

    def _blocking_client(self) -> BlockingRpcClient:
        with self._blocking_lock:
            if self._disconnected:
                raise E.Final(errno.ENOTCONN, "the client was closed")
            rpc = self._blocking
            if rpc is None or not rpc.alive:
                self._blocking = None
                try:
                    rpc = open_blocking(self._auth, self.host, self.port, timeout=self.timeout)
                except E.Final:
                    raise
                except OSError as exc:
                    raise self._unreachable(exc) from None
                try:
                    rpc.request(M.Hello(client=f"pfs-{os.getpid()}"))
                except BaseException:
                    rpc.close()
                    raise
                self._blocking = rpc
                self.generation += 1
            return rpc

    def request_blocking(self, msg: RequestMessage, retry_outage: bool = True) -> Any:
        """:meth:`request` over the blocking connection, in the caller's thread; the
        handles whose close was deferred go with it (``closes``). A transient outage is
        retried within ``timeout`` (the module doc) unless ``retry_outage`` is False."""
        retry: Retry | None = None
        while True:
            sent = False
            try:
                rpc = self._blocking  # (up and in use: no lock to take)
                if rpc is None or not rpc.alive or self._disconnected:
                    rpc = self._blocking_client()
                closes, unwritten = self._take_closes() if self._closes else (None, None)
                sent = True
                reply = rpc.request(msg, closes=closes, unwritten=unwritten)
                self._reached = True
                return reply
            except OSError as exc:
                if not retry_outage or not E.transient(exc):
                    raise  # the answer (ENOENT, EEXIST, ...): no Retry to make
                retry = retry or self._retry()
                pause = retry.pause(exc, sent, msg)
            time.sleep(pause)

    def _retry(self) -> Retry:
        if self._reached:
            return Retry(self.name, self.timeout)
        return Retry(self.name, min(self.timeout, self.connect_timeout), quiet=True)

    def _take_closes(self) -> tuple[list[int] | None, list[int] | None]:
        """The deferred closes to send with a request on connection ``generation``, and
        those of them that sent nothing to a data server."""
        with self._closes_lock:
            closes, self._closes = self._closes, []
            unwritten, self._unwritten = self._unwritten, []
            if self._closes_gen != self.generation:
                return None, None  # opened on a connection that is gone
            return closes, unwritten

    def defer_close(self, fh: int, generation: int, unwritten: bool = False) -> bool:
        """Release handle ``fh`` (opened on connection ``generation``, with nothing to
        commit) along with the next request, or a ``release`` of its own after
        CLOSE_DELAY, instead of a round trip now (docs/rpc.md, ``closes``); ``unwritten``:
        it sent nothing to a data server. False: not deferred (``defer_closes`` off),
        close it now."""
        if not self.defer_closes:
            return False
        with self._closes_lock:
            conn = self._blocking if self.direct else self._rpc
            if generation != self.generation or conn is None:
                return True  # its connection is gone, and the handle with it
            if self._closes_gen != generation:
                self._closes, self._unwritten, self._closes_gen = [], [], generation
            if not self._closes:
                self._closes_since = time.monotonic()
            self._closes.append(fh)
            if unwritten:
                self._unwritten.append(fh)
            flush = not self._flush_due and self._token is not None
            self._flush_due = self._flush_due or flush
        if flush:
            assert self._token is not None
            try:
                self._token.run_sync_soon(self._nursery.start_soon, self._flush_closes)
            except trio.RunFinishedError:
                pass  # the client is gone; so are its handles
        return True

    async def _flush_closes(self) -> None:
        """Release deferred closes that no request carried within CLOSE_DELAY of the
        oldest's close. While requests keep carrying them (a loop of creates: each takes
        the closes before it), none is ever that old: the timer waits on for the oldest
        still waiting instead of sending a ``release`` of its own every CLOSE_DELAY."""
        wait = CLOSE_DELAY
        while True:
            await trio.sleep(wait)
            with self._closes_lock:
                if not self._closes:
                    self._flush_due = False
                    return
                wait = self._closes_since + CLOSE_DELAY - time.monotonic()
                if wait <= 0:
                    self._flush_due = False
                    break
        try:  # not retried: a lost connection released them
            if self.direct:  # (this is the trio thread: one blocking round trip)
                self.request_blocking(M.Release(), retry_outage=False)
            else:
                rpc = self._rpc
                closes, unwritten = self._take_closes()
                if rpc is not None and rpc.alive and closes:
                    await rpc.send(M.Release(), closes=closes, unwritten=unwritten)
        except OSError as exc:  # the connection broke: the server released them
            log.debug("releasing closed handles: %s", exc)

    async def request(self, msg: RequestMessage) -> Any:
        """A typed call: ``msg`` (a request of :mod:`pfs.core.messages.meta`) out, its typed
        reply back (``EPROTO`` if the reply does not fit it). A transient outage is
        retried within ``timeout`` (the module doc)."""
        if self.direct:
            return self.request_blocking(msg)
        hold = HOLD.get()
        retry: Retry | None = None
        while True:
            sent = False
            try:
                rpc = self._rpc
                if rpc is None or not rpc.alive:
                    if hold is not None:
                        hold.waits()
                    rpc = await self._client()
                closes, unwritten = self._take_closes() if self._closes else (None, None)
                sent = True
                reply = parse_reply(msg, (await rpc.send(msg, closes=closes, unwritten=unwritten,
                                                         hold=hold)).fields)
                self._reached = True
                return reply
            except OSError as exc:
                if not E.transient(exc):
                    raise  # the answer (ENOENT, EEXIST, ...): no Retry to make
                retry = retry or self._retry()
                pause = retry.pause(exc, sent, msg)
            if hold is not None:
                hold.waits()
            await trio.sleep(pause)

    def run_now(self, plan: Plan[T]) -> T | None:
        """Carry out ``plan`` in this thread at once, without yielding to the event loop:
        its requests must change nothing (:data:`IDEMPOTENT`, metadata calls only). None
        when that is not possible now (the connection is not up, or failed: it went, and
        the next tries wait NOW_BACKOFF); the caller runs the plan again the usual way,
        as nothing it sent changed anything. A refusal (``ENOENT``, ...) is raised."""
        rpc = self._now_rpc
        if rpc is None or rpc.conn.closed:
            plan.close()
            self._open_now()
            return None
        try:
            effect = plan.send(None)
            while True:
                if type(effect) is not MetaCall or not isinstance(effect.msg, IDEMPOTENT):
                    return None  # (only read-only metadata plans are run here)
                started = time.perf_counter()
                try:
                    reply = rpc.request(effect.msg)
                except OSError as exc:
                    if rpc.conn.closed:  # not an answer: the connection failed
                        log.debug("%s: quick call failed (%s); the usual way for %g s",
                                  self.name, exc, NOW_BACKOFF)
                        self._now_rpc, self._now_after = None, time.monotonic() + NOW_BACKOFF
                        return None
                    metrics.rpc_done("client", effect.msg.method, started,
                                     exc.errno or errno.EIO, 0, 0)
                    effect = plan.throw(exc)
                else:
                    metrics.rpc_done("client", effect.msg.method, started, None, 0, 0)
                    effect = plan.send(reply)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            plan.close()

    @staticmethod
    def holding(waits: Callable[[], None]) -> contextvars.Token[Hold | None]:
        """The calls this task makes until ``HOLD.reset(token)`` may wait for their
        reply holding the event loop for up to NOW_TIMEOUT (:class:`Hold`); ``waits()``
        is called before any other wait. For a caller that knows nothing else waits on
        the loop (as :meth:`run_now`), for calls that change something too: each is
        still sent once, on the connection its handles belong to."""
        return HOLD.set(Hold(NOW_TIMEOUT, waits))

    def calls_pending(self) -> bool:
        """Whether a call is waiting for the metaserver on the trio connection."""
        rpc = self._rpc
        return rpc is not None and rpc.busy

    def _open_now(self) -> None:
        """Open run_now's connection in a thread, in the background (once at a time)."""
        if self._now_after > time.monotonic() or self._disconnected or self.direct:
            return
        self._now_after = math.inf  # opening

        async def opener() -> None:
            rpc: BlockingRpcClient | None = None
            try:
                rpc = await trio.to_thread.run_sync(self._connect_now)
            except OSError as exc:
                log.debug("%s: no quick connection: %s", self.name, exc)
            finally:  # on failure (or cancellation), next tries after NOW_BACKOFF
                self._now_after = time.monotonic() + (0.0 if rpc else NOW_BACKOFF)
            if self._disconnected and rpc is not None:
                rpc.close()
            else:
                self._now_rpc = rpc

        try:
            self._nursery.start_soon(opener)
        except RuntimeError:  # the nursery is closed: the client is going
            self._now_after = math.inf

    def _connect_now(self) -> BlockingRpcClient:
        rpc = open_blocking(self._auth, self.host, self.port, timeout=self.timeout)
        try:
            rpc.request(M.Hello(client=f"pfs-{os.getpid()}"))
        except BaseException:
            rpc.close()
            raise
        rpc.conn.set_timeout(NOW_TIMEOUT)  # each call from now on
        return rpc

    def wire_cred(self, cred: Cred | None = None) -> WireCred:
        """A message's ``cred``: ``cred``, or the client's own (the last one's is kept:
        callers pass the same credentials over and over)."""
        c = cred or self.cred
        last = self._wire_cred
        if last[0] is c:
            return last[1]
        wire = (c.uid, c.gid, tuple(c.groups))
        self._wire_cred = (c, wire)
        return wire

    def disconnect(self) -> None:
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None
        with self._blocking_lock:
            if self._blocking is not None:
                self._blocking.close()
                self._blocking = None
        if self._now_rpc is not None:
            self._now_rpc.close()
            self._now_rpc = None
        with self._closes_lock:
            self._closes, self._unwritten = [], []  # released with the connection

    def shutdown(self) -> None:
        """Disconnect for good: a late caller (a deferred ``release`` running after the
        client closed) must not open a connection nothing would close."""
        with self._blocking_lock:
            self._disconnected = True
        self.disconnect()

    async def hello(self, client: str) -> M.HelloReply:
        """Check the metaserver answers (the root inode, the protocol version)."""
        r: M.HelloReply = await self.request(M.Hello(client=client))
        return r

    # -- the metadata operations (pfs.client.ops), by inode ----------------------
    async def run(self, plan: Plan[T]) -> T:
        """Carry a metadata plan out over this connection."""
        return await self._driver.run(plan)

    async def resolve(self, path: str | bytes, follow: bool = True,
                      cred: Cred | None = None) -> tuple[StatResult, int, bytes]:
        return await self._driver.run(ops.meta_resolve(fsname(path), follow,
                                                       self.wire_cred(cred)))

    async def lookup(self, parent: int, name: str | bytes, cred: Cred | None = None) -> StatResult:
        return await self._driver.run(ops.meta_lookup(parent, fsname(name),
                                                      self.wire_cred(cred)))

    async def getattr(self, ino: int) -> StatResult:
        return await self._driver.run(ops.meta_getattr(ino))

    def lookup_now(self, parent: int, name: bytes, cred: Cred | None = None
                   ) -> StatResult | None:
        """:meth:`lookup` at once (:meth:`run_now`); None: not now."""
        return self.run_now(ops.meta_lookup(parent, name, self.wire_cred(cred)))

    def getattr_now(self, ino: int) -> StatResult | None:
        """:meth:`getattr` at once (:meth:`run_now`); None: not now."""
        return self.run_now(ops.meta_getattr(ino))

    async def setattr(self, ino: int, cred: Cred | None = None, **changes: Any) -> StatResult:
        return await self._driver.run(ops.meta_setattr(ino, self.wire_cred(cred), **changes))

    async def access(self, ino: int, mask: int, cred: Cred | None = None) -> None:
        await self._driver.run(ops.meta_access(ino, mask, self.wire_cred(cred)))

    # The six entry changes take ``want_parent``: the parent's attributes after the
    # change come back as the last value (None without it).
    async def mkdir(self, parent: int, name: str | bytes, mode: int, cred: Cred | None = None,
                    want_parent: bool = False) -> tuple[StatResult, StatResult | None]:
        return await self._driver.run(ops.meta_mkdir(At(parent, fsname(name)), mode,
                                                     self.wire_cred(cred), want_parent))

    async def mknod(self, parent: int, name: str | bytes, mode: int, rdev: int = 0,
                    cred: Cred | None = None, want_parent: bool = False
                    ) -> tuple[StatResult, StatResult | None]:
        return await self._driver.run(ops.meta_mknod(At(parent, fsname(name)), mode, rdev,
                                                     self.wire_cred(cred), want_parent))

    async def create(self, parent: int, name: str | bytes, mode: int, flags: int,
                     cred: Cred | None = None, want_parent: bool = False
                     ) -> tuple[M.OpenedReply, StatResult | None]:
        return await self._driver.run(ops.meta_create(At(parent, fsname(name)), mode, flags,
                                                      self.wire_cred(cred), want_parent))

    async def open(self, ino: int, flags: int, cred: Cred | None = None) -> M.OpenedReply:
        return await self._driver.run(ops.meta_open(ino, flags, self.wire_cred(cred)))

    async def close(self, fh: int, written_end: int | None = None,
                    mtime: int | None = None) -> None:
        await self._driver.run(ops.meta_close(fh, written_end, mtime))

    async def renew(self, fh: int) -> M.CapReply:
        """A fresh capability for open handle ``fh``."""
        return await self._driver.run(ops.meta_renew(fh))

    async def commit_size(self, fh: int, written_end: int | None,
                          mtime: int | None = None) -> StatResult:
        return await self._driver.run(ops.meta_commit_size(fh, written_end, mtime))

    async def unlink(self, parent: int, name: str | bytes, cred: Cred | None = None,
                     want_parent: bool = False) -> StatResult | None:
        return await self._driver.run(ops.meta_unlink(At(parent, fsname(name)),
                                                      self.wire_cred(cred), want_parent))

    async def rmdir(self, parent: int, name: str | bytes, cred: Cred | None = None,
                    want_parent: bool = False) -> StatResult | None:
        return await self._driver.run(ops.meta_rmdir(At(parent, fsname(name)),
                                                     self.wire_cred(cred), want_parent))

    async def rename(self, parent: int, name: str | bytes, newparent: int,
                     newname: str | bytes, flags: int = 0, cred: Cred | None = None) -> None:
        await self._driver.run(ops.meta_rename(At(parent, fsname(name)),
                                               At(newparent, fsname(newname)), flags,
                                               self.wire_cred(cred)))

    async def link(self, ino: int, newparent: int, newname: str | bytes,
                   cred: Cred | None = None) -> StatResult:
        return await self._driver.run(ops.meta_link(ino, At(newparent, fsname(newname)),
                                                    self.wire_cred(cred)))

    async def symlink(self, parent: int, name: str | bytes, target: str | bytes,
                      cred: Cred | None = None, want_parent: bool = False
                      ) -> tuple[StatResult, StatResult | None]:
        return await self._driver.run(ops.meta_symlink(At(parent, fsname(name)),
                                                       fsname(target), self.wire_cred(cred),
                                                       want_parent))

    async def readlink(self, ino: int) -> bytes:
        return await self._driver.run(ops.meta_readlink(ino))

    async def readdir(self, ino: int, cookie: int = 0, limit: int = 1024, plus: bool = False,
                      cred: Cred | None = None) -> tuple[list[DirEntry], bool]:
        return await self._driver.run(ops.meta_readdir(ino, cookie, limit, plus,
                                                       self.wire_cred(cred)))

    async def statfs(self) -> M.StatfsReply:
        return await self._driver.run(ops.meta_statfs())

    async def getxattr(self, ino: int, name: str | bytes, cred: Cred | None = None) -> bytes:
        return await self._driver.run(ops.meta_getxattr(ino, fsname(name),
                                                        self.wire_cred(cred)))

    async def setxattr(self, ino: int, name: str | bytes, value: bytes, flags: int = 0,
                       cred: Cred | None = None) -> None:
        await self._driver.run(ops.meta_setxattr(ino, fsname(name), bytes(value), flags,
                                                 self.wire_cred(cred)))

    async def listxattr(self, ino: int, cred: Cred | None = None) -> list[bytes]:
        return await self._driver.run(ops.meta_listxattr(ino, self.wire_cred(cred)))

    async def removexattr(self, ino: int, name: str | bytes, cred: Cred | None = None) -> None:
        await self._driver.run(ops.meta_removexattr(ino, fsname(name), self.wire_cred(cred)))

    async def get_layout(self, ino: int) -> dict[str, Any]:
        """The file's layout (None for symlinks and devices)."""
        return await self._driver.run(ops.meta_get_layout(ino))

    async def set_layout(self, ino: int, unit: int = 0, count: int = 0, replicas: int = 0,
                         cred: Cred | None = None, durable: bool | None = None
                         ) -> dict[str, Any]:
        return await self._driver.run(ops.meta_set_layout(ino, unit, count, replicas,
                                                          self.wire_cred(cred), durable))

    async def servers(self) -> dict[str, dict[str, Any]]:
        return await self._driver.run(ops.meta_servers())

"""The synchronous client: the async client's plans, carried out in the calling thread.

Operations are plans (:mod:`pfs.client.plan` for data, :mod:`pfs.client.ops` for
metadata). With ``direct_meta`` (the default) the metadata connection is a blocking
socket and the blocking driver (:mod:`pfs.client.blocking_driver`) carries metadata
plans (stat, mkdir, open and close of a handle, ...) and small reads and writes (up to
the profile's ``direct_max``) out in the calling thread. Larger requests, and whatever
the blocking driver hands over (a capability to renew, a descriptor to ask for, a server
to reconnect to), run on the trio driver in the client's private trio thread, crossing
with ``trio.from_thread.run``: that hop costs about 150 us of CPU, several times a round
trip.
"""
from __future__ import annotations

import errno
import io
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from pfs.client import ops
from pfs.client.aio import AsyncClient, FileHandle, open_flags
from pfs.client.ops import StatVFS
from pfs.client.plan import HandOver, Plan
from pfs.client.types import Cred, DirEntry, StatResult
from pfs.core.config import client_config

T = TypeVar("T")
log = logging.getLogger(__name__)

# How long an interrupted call may take to end (its in-flight I/O to complete).
DRAIN_TIMEOUT = 30.0


class _Loop:
    """A trio event loop on a daemon thread, with a nursery for connection tasks."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pfs-trio", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported to the creating thread
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` in the trio thread. A KeyboardInterrupt (Ctrl-C) that
        arrives while it runs cancels it there and waits for it to end before it goes
        on up: the call may have reads in flight (an io_uring submission, a socket
        ``recv_into``) into the caller's buffer, and unwinding past them freed that
        buffer, or let the interpreter exit and tear liburing down, under the kernel's
        feet (a segfault in liburing's queue module)."""
        scope = trio.CancelScope()
        ended = threading.Event()

        async def guarded() -> T:
            try:
                with scope:
                    return await fn(*args)
                raise OSError(errno.EINTR, "interrupted")  # cancelled: only on an interrupt
            finally:
                ended.set()

        try:
            return trio.from_thread.run(guarded, trio_token=self.token)
        except KeyboardInterrupt:
            self._drain(scope, ended)
            raise

    def _drain(self, scope: trio.CancelScope, ended: threading.Event) -> None:
        """Cancel an interrupted call and wait (through further interrupts) until it
        has ended; the engine shields its in-flight batches, so this waits for them."""
        if self.token is None:
            return
        try:
            self.token.run_sync_soon(scope.cancel)
        except trio.RunFinishedError:
            return
        deadline = DRAIN_TIMEOUT
        while deadline > 0:
            try:
                if ended.wait(0.05):
                    return
                deadline -= 0.05
            except KeyboardInterrupt:
                continue
        log.warning("an interrupted call did not end within %.0f s", DRAIN_TIMEOUT)

    def stop(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
            self._thread.join(timeout=10)


class Client:
    """os-like access to a pfs cluster. Make one with :func:`pfs.connect`."""

    def __init__(self, loop: _Loop, aclient: AsyncClient) -> None:
        self._loop = loop
        self.aio = aclient
        self.closed = False
        # metadata plans touch the async client's state outside its trio thread: one at
        # a time, as they would be inside it
        self._meta_lock = threading.Lock()

    @classmethod
    def connect(cls, config: Any = None, meta: str | None = None,
                cred: Cred | None = None) -> Client:
        cfg = client_config(config, meta)
        loop = _Loop()
        try:
            async def make() -> AsyncClient:
                assert loop.nursery is not None
                c = AsyncClient(cfg, loop.nursery, cred, direct_meta=cfg.direct_meta)
                await c.meta.hello("pfs")
                return c

            return cls(loop, loop.run(make))
        except BaseException:
            loop.stop()
            raise

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._loop.run(fn, *args)

    def _drive(self, make: Callable[..., Plan[T]], *args: Any) -> T:
        """Carry the metadata plan ``make(*args)`` out in this thread (see the module
        doc); through the trio thread when the metadata connection is not blocking, or
        when this client is closed (which fails there, as data calls do: run here, the
        call would open a new metaserver connection that nothing closes)."""
        if not self.closed and self.aio.meta.direct:
            with self._meta_lock:
                try:
                    return self.aio.blocking.run(make(*args))
                except HandOver:
                    pass  # cannot have done anything a second run does not redo
        return self._loop.run(self.aio.driver.run, make(*args))

    def _close_later(self, handle: FileHandle) -> None:
        """Close ``handle`` in the trio thread, soon; safe from any thread and from a
        finalizer (it only queues)."""
        async def close() -> None:
            try:
                await handle.close()
            except OSError as exc:
                log.warning("closing %s dropped unclosed: %s", handle.path or "a file", exc)

        loop = self._loop
        if loop.token is None or loop.nursery is None:
            return
        try:
            loop.token.run_sync_soon(loop.nursery.start_soon, close)
        except trio.RunFinishedError:
            pass  # the client is gone; so is the handle's connection

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True

        async def shut() -> None:
            await self.aio.aclose()

        try:
            self._run(shut)
        finally:
            self._loop.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- files ---------------------------------------------------------------
    def open(self, path: str | bytes, mode: str = "rb", perm: int = 0o666,
             encoding: str | None = None) -> Any:
        flags = open_flags(mode)
        handle = self._drive(ops.open_path, self.aio, path, flags, perm)
        raw = File(self, handle, mode)
        if "b" in mode:
            return raw
        buffered: io.BufferedIOBase
        if "+" in mode:
            buffered = io.BufferedRandom(raw)
        elif flags & os.O_ACCMODE == os.O_RDONLY:
            buffered = io.BufferedReader(raw)
        else:
            buffered = io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding=encoding or "utf-8")

    def read_file(self, path: str | bytes) -> bytes:
        return self._run(self.aio.read_file, path)

    def write_file(self, path: str | bytes, data: Any) -> None:
        self._run(self.aio.write_file, path, data)

    # -- namespace -----------------------------------------------------------
    def stat(self, path: str | bytes, *, follow_symlinks: bool = True) -> StatResult:
        return self._drive(ops.stat, self.aio, path, follow_symlinks)

    def lstat(self, path: str | bytes) -> StatResult:
        return self._drive(ops.lstat, self.aio, path)

    def exists(self, path: str | bytes) -> bool:
        return self._drive(ops.exists, self.aio, path)

    def listdir(self, path: str | bytes = "/") -> list[str]:
        return self._drive(ops.listdir, self.aio, path)

    def scandir(self, path: str | bytes = "/") -> list[DirEntry]:
        return self._drive(ops.scandir, self.aio, path, True)

    def mkdir(self, path: str | bytes, mode: int = 0o777) -> None:
        self._drive(ops.mkdir, self.aio, path, mode)

    def makedirs(self, path: str | bytes, mode: int = 0o777, exist_ok: bool = False) -> None:
        self._drive(ops.makedirs, self.aio, path, mode, exist_ok)

    def remove(self, path: str | bytes) -> None:
        self._drive(ops.remove, self.aio, path)

    unlink = remove

    def rmdir(self, path: str | bytes) -> None:
        self._drive(ops.rmdir, self.aio, path)

    def rename(self, src: str | bytes, dst: str | bytes, flags: int = 0) -> None:
        self._drive(ops.rename, self.aio, src, dst, flags)

    replace = rename

    def link(self, src: str | bytes, dst: str | bytes) -> None:
        self._drive(ops.link, self.aio, src, dst)

    def symlink(self, target: str | bytes, path: str | bytes) -> None:
        self._drive(ops.symlink, self.aio, target, path)

    def readlink(self, path: str | bytes) -> str:
        return self._drive(ops.readlink, self.aio, path)

    def chmod(self, path: str | bytes, mode: int) -> None:
        self._drive(ops.chmod, self.aio, path, mode)

    def chown(self, path: str | bytes, uid: int, gid: int) -> None:
        self._drive(ops.chown, self.aio, path, uid, gid)

    def utime(self, path: str | bytes, times: tuple[float, float] | None = None, *,
              ns: tuple[int, int] | None = None) -> None:
        self._drive(ops.utime, self.aio, path, times, ns)

    def truncate(self, path: str | bytes, size: int) -> None:
        self._drive(ops.truncate, self.aio, path, size)

    def getxattr(self, path: str | bytes, name: str | bytes) -> bytes:
        return self._drive(ops.getxattr, self.aio, path, name)

    def setxattr(self, path: str | bytes, name: str | bytes, value: bytes, flags: int = 0) -> None:
        self._drive(ops.setxattr, self.aio, path, name, value, flags)

    def listxattr(self, path: str | bytes) -> list[str]:
        return self._drive(ops.listxattr, self.aio, path)

    def removexattr(self, path: str | bytes, name: str | bytes) -> None:
        self._drive(ops.removexattr, self.aio, path, name)

    # -- batched: one request per MAX_MANY paths, one commit for each; a result per path
    def create_many(self, paths: Sequence[str | bytes], mode: int = 0o666,
                    exclusive: bool = True) -> list[OSError | None]:
        """Create each path as an empty file (and close it): None, or the path's
        OSError (``FileExistsError`` when it exists and ``exclusive``)."""
        return self._drive(ops.create_many, self.aio, paths, mode, exclusive)

    def stat_many(self, paths: Sequence[str | bytes], *, follow_symlinks: bool = True
                  ) -> list[StatResult | OSError]:
        """Each path's attributes, or its OSError."""
        return self._drive(ops.stat_many, self.aio, paths, follow_symlinks)

    def unlink_many(self, paths: Sequence[str | bytes]) -> list[OSError | None]:
        """Unlink each path: None, or the path's OSError."""
        return self._drive(ops.unlink_many, self.aio, paths)

    def statvfs(self, path: str | bytes = "/") -> StatVFS:
        return self._drive(ops.statvfs, self.aio, path)

    def get_layout(self, path: str | bytes) -> dict[str, Any]:
        return self._drive(ops.get_layout, self.aio, path)

    def set_layout(self, path: str | bytes, count: int = 0, unit: int = 0,
                   replicas: int = 0, durable: bool | None = None) -> dict[str, Any]:
        return self._drive(ops.set_layout, self.aio, path, count, unit, replicas, durable)


class File(io.RawIOBase):
    """A binary pfs file, usable wherever Python expects a raw file object."""

    def __init__(self, client: Client, handle: FileHandle, mode: str = "rb") -> None:
        super().__init__()
        self._client = client
        self.handle = handle
        self.mode = mode
        self.name = handle.path
        self._pos = handle.size if handle.flags & os.O_APPEND else 0
        self._dropped = False  # collected without close(): see __del__

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._client._run(fn, *args)

    def readable(self) -> bool:
        return self.handle.readable

    def writable(self) -> bool:
        return self.handle.writable

    def seekable(self) -> bool:
        return True

    @property
    def size(self) -> int:
        return self.handle.size

    def readinto(self, buf: Any) -> int:
        n = self.preadinto(buf, self._pos)
        self._pos += n
        return n

    def readall(self) -> bytes:
        buf = bytearray(max(0, self.handle.size - self._pos))
        n = self.readinto(buf)
        return bytes(buf[:n])

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        buf = bytearray(max(0, min(size, self.handle.size - self._pos)))
        n = self.readinto(buf)
        return bytes(buf[:n])

    def pread(self, length: int, offset: int) -> bytes:
        buf = bytearray(max(0, min(length, self.handle.size - offset)))
        n = self.preadinto(buf, offset)
        return bytes(buf[:n]) if n < len(buf) else bytes(buf)

    def preadinto(self, buf: Any, offset: int) -> int:
        # small reads: in this thread (the blocking driver)
        n = self.handle.pread_blocking(buf, offset)
        if n is None:
            n = self._run(self.handle.pread_into, buf, offset)
        return n

    def write(self, data: Any) -> int:
        n = self.pwrite(data, self._pos)
        self._pos = (self.handle.size if self.handle.flags & os.O_APPEND else self._pos + n)
        return n

    def pwrite(self, data: Any, offset: int) -> int:
        # small writes: in this thread (the blocking driver)
        n = self.handle.pwrite_blocking(data, offset)
        if n is None:
            n = self._run(self.handle.pwrite, data, offset)
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_SET:
            pos = offset
        elif whence == os.SEEK_CUR:
            pos = self._pos + offset
        elif whence == os.SEEK_END:
            pos = self.handle.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise OSError(22, "negative seek position")
        self._pos = pos
        return pos

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        self._client._drive(ops.truncate_handle, self.handle, size)
        return size

    def flush(self) -> None:
        if self._dropped:
            return  # being collected: the handle's close (elsewhere) commits
        if not self.closed and not self.handle.closed and self.handle.writable:
            self._client._drive(ops.commit, self.handle)

    def fsync(self) -> None:
        self._run(self.handle.fsync)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("pfs files have no OS file descriptor")

    def close(self) -> None:
        if not self.closed:
            try:
                if self._client.closed:  # its handle went with the client's connection
                    self.handle.closed = True
                else:
                    self._client._drive(ops.close_handle, self.handle)
            finally:
                super().close()

    def __del__(self) -> None:
        # Garbage collection runs wherever an allocation triggers it, also inside this
        # client's own locked sections in this very thread (a file in a reference
        # cycle): closing here could deadlock on them. A file dropped unclosed is
        # closed later in the client's trio thread instead.
        if self.closed:
            return
        self._dropped = True
        if not self._client.closed and not self.handle.closed:
            self._client._close_later(self.handle)
        io.RawIOBase.close(self)

"""The synchronous client: the async client run on a private trio thread.

Data calls cross into that thread with ``trio.from_thread.run``; bulk reads and writes
still go straight between the caller's buffer and the sockets. Metadata-only calls (stat,
mkdir, unlink, rename, open and close of a handle, ...) do not cross: with
``direct_meta`` (the default) the client's metadata connection is a blocking socket, so
those coroutines never suspend and :meth:`Client._direct` runs them to completion in the
calling thread. Small reads and writes (one stripe piece, up to the profile's
``direct_max``) do not cross either (``FileHandle.pread_direct``/``pwrite_direct``,
:mod:`pfs.client.direct`). The hop costs about 150 us of CPU, several times the round
trip itself.
"""
from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import trio

from pfs.client.aio import AsyncClient, FileHandle, StatVFS, open_flags
from pfs.client.types import Cred, DirEntry, StatResult
from pfs.config import client_config

T = TypeVar("T")
log = logging.getLogger(__name__)


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
        return trio.from_thread.run(fn, *args, trio_token=self.token)

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
        # direct calls touch the async client's state outside its trio thread: one at
        # a time, as they would be inside it
        self._direct_lock = threading.Lock()

    @classmethod
    def connect(cls, config: Any = None, meta: str | None = None,
                cred: Cred | None = None) -> Client:
        cfg = client_config(config, meta)
        loop = _Loop()
        try:
            async def make() -> AsyncClient:
                assert loop.nursery is not None
                c = AsyncClient(cfg, loop.nursery, cred, direct_meta=cfg.direct_meta)
                await c.meta.call("hello", client="pfs")
                return c

            return cls(loop, loop.run(make))
        except BaseException:
            loop.stop()
            raise

    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._loop.run(fn, *args)

    def _direct(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run a coroutine that makes only metadata calls in this thread (see the module
        doc); through the trio thread when the metadata connection is not direct, or
        when this client is closed (which fails there, as data calls do: run here, the
        call would open a new metaserver connection that nothing closes)."""
        if self.closed or not self.aio.meta.direct:
            return self._loop.run(fn, *args)
        with self._direct_lock:
            coro = fn(*args)
            try:
                coro.send(None)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            coro.close()
        raise RuntimeError(f"{getattr(fn, '__qualname__', fn)} waited on the event loop: "
                           "it cannot run in the calling thread (a pfs bug)")

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
        handle = self._direct(self.aio.open, path, flags, perm)
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
        return self._direct(self.aio.stat, path, follow_symlinks)

    def lstat(self, path: str | bytes) -> StatResult:
        return self._direct(self.aio.lstat, path)

    def exists(self, path: str | bytes) -> bool:
        return self._direct(self.aio.exists, path)

    def listdir(self, path: str | bytes = "/") -> list[str]:
        return self._direct(self.aio.listdir, path)

    def scandir(self, path: str | bytes = "/") -> list[DirEntry]:
        return self._direct(self.aio.scandir, path, True)

    def mkdir(self, path: str | bytes, mode: int = 0o777) -> None:
        self._direct(self.aio.mkdir, path, mode)

    def makedirs(self, path: str | bytes, mode: int = 0o777, exist_ok: bool = False) -> None:
        self._direct(self.aio.makedirs, path, mode, exist_ok)

    def remove(self, path: str | bytes) -> None:
        self._direct(self.aio.remove, path)

    unlink = remove

    def rmdir(self, path: str | bytes) -> None:
        self._direct(self.aio.rmdir, path)

    def rename(self, src: str | bytes, dst: str | bytes, flags: int = 0) -> None:
        self._direct(self.aio.rename, src, dst, flags)

    replace = rename

    def link(self, src: str | bytes, dst: str | bytes) -> None:
        self._direct(self.aio.link, src, dst)

    def symlink(self, target: str | bytes, path: str | bytes) -> None:
        self._direct(self.aio.symlink, target, path)

    def readlink(self, path: str | bytes) -> str:
        return self._direct(self.aio.readlink, path)

    def chmod(self, path: str | bytes, mode: int) -> None:
        self._direct(self.aio.chmod, path, mode)

    def chown(self, path: str | bytes, uid: int, gid: int) -> None:
        self._direct(self.aio.chown, path, uid, gid)

    def utime(self, path: str | bytes, times: tuple[float, float] | None = None, *,
              ns: tuple[int, int] | None = None) -> None:
        async def go() -> None:
            await self.aio.utime(path, times, ns=ns)

        self._direct(go)

    def truncate(self, path: str | bytes, size: int) -> None:
        self._direct(self.aio.truncate, path, size)

    def getxattr(self, path: str | bytes, name: str | bytes) -> bytes:
        return self._direct(self.aio.getxattr, path, name)

    def setxattr(self, path: str | bytes, name: str | bytes, value: bytes, flags: int = 0) -> None:
        self._direct(self.aio.setxattr, path, name, value, flags)

    def listxattr(self, path: str | bytes) -> list[str]:
        return self._direct(self.aio.listxattr, path)

    def removexattr(self, path: str | bytes, name: str | bytes) -> None:
        self._direct(self.aio.removexattr, path, name)

    def statvfs(self, path: str | bytes = "/") -> StatVFS:
        return self._direct(self.aio.statvfs, path)

    def get_layout(self, path: str | bytes) -> dict[str, Any]:
        return self._direct(self.aio.get_layout, path)

    def set_layout(self, path: str | bytes, count: int = 0, unit: int = 0,
                   replicas: int = 0) -> dict[str, Any]:
        return self._direct(self.aio.set_layout, path, count, unit, replicas)


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
        self._client._direct(self.handle.truncate, size)
        return size

    def flush(self) -> None:
        if self._dropped:
            return  # being collected: the handle's close (elsewhere) commits
        if not self.closed and not self.handle.closed and self.handle.writable:
            self._client._direct(self.handle.commit)

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
                    self._client._direct(self.handle.close)
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

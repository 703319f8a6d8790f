"""GPU destinations: reads that land in device memory.

A destination is a GPU buffer when it exposes ``__cuda_array_interface__`` (CuPy arrays,
torch CUDA tensors, Numba device arrays). Two ways in:

- **GDS** (kvikio): a file this host can open — a local object (short-circuit) or a local
  file — is read by kvikio straight into device memory (GPUDirect Storage where the
  drivers are present, kvikio's own POSIX compatibility mode where they are not);
- **staging**: anything else (remote stripes over the network) lands in a pinned host
  buffer, allocated once per :class:`DeviceStager` and reused, and is copied to the device
  with ``cudaMemcpyAsync``; two halves alternate so the copy of one overlaps the read of
  the next.

kvikio is the optional ``gpu`` extra and is imported only when a device buffer is read:
never at ``import pfs`` and never for host buffers (kvikio 26.x loads ``libcuda.so.1``
even for host memory, so a host read through it would fail on a machine without a GPU).
Every path that cannot run says which piece is missing: :class:`GpuUnavailable`.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pfs.client.plan import Call, Plan, one, read_device
from pfs.client.trio_driver import TrioDriver
from pfs.core.engine import DEFAULT_QUEUE_DEPTH, Engine, Op, register_engine

log = logging.getLogger(__name__)

STAGING_SIZE = 64 << 20  # pinned bytes per DeviceStager (two halves)
GDS_TASK_SIZE = 16 << 20  # kvikio task size for the `load` profile (large sequential reads)

_H2D = 1  # cudaMemcpyHostToDevice


class GpuUnavailable(OSError):
    """A GPU path was asked for and a piece it needs is missing (ENOTSUP)."""

    def __init__(self, missing: str, hint: str = "") -> None:
        self.missing = missing
        super().__init__(errno.ENOTSUP, f"GPU read needs {missing}" + (f": {hint}" if hint else ""))


# -- buffers ------------------------------------------------------------------------
def is_device_buffer(obj: Any) -> bool:
    """True for objects exposing ``__cuda_array_interface__`` (GPU memory)."""
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except Exception:  # noqa: BLE001 - torch raises for CPU tensors on some versions
        return False


@dataclass(frozen=True)
class DeviceBuffer:
    """Where a device buffer lives: its pointer and size in bytes (C-contiguous only)."""

    ptr: int
    nbytes: int
    obj: Any
    readonly: bool = False


def device_buffer(obj: Any) -> DeviceBuffer:
    """Read ``__cuda_array_interface__``; a non-contiguous buffer is refused (EINVAL)."""
    cai = obj.__cuda_array_interface__
    ptr, readonly = cai["data"]
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    nbytes = itemsize
    for d in shape:
        nbytes *= int(d)
    strides = cai.get("strides")
    if strides is not None and nbytes:
        expect, want = itemsize, []
        for d in reversed(shape):
            want.append(expect)
            expect *= int(d)
        if tuple(strides) != tuple(reversed(want)):
            raise OSError(errno.EINVAL, f"GPU buffer with strides {tuple(strides)} is not "
                                        "C-contiguous; read into a contiguous buffer")
    if readonly:
        raise OSError(errno.EINVAL, "read into a read-only GPU buffer")
    return DeviceBuffer(int(ptr or 0), nbytes, obj, bool(readonly))


# -- what is there ------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def libcuda_missing() -> str | None:
    """Why the CUDA driver cannot be loaded, or None."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the CUDA driver (libcuda.so.1 cannot be loaded: {exc})"
    return None


def _import_kvikio() -> Any:
    import kvikio  # the `gpu` extra

    return kvikio


def kvikio_missing() -> str | None:
    try:
        _import_kvikio()
    except ImportError as exc:
        return f"kvikio (not installed: {exc}; pip install 'pfs[gpu]')"
    except OSError as exc:  # a kvikio wheel without its CUDA libraries
        return f"kvikio's CUDA libraries ({exc})"
    return None


def _copier() -> str | None:
    """Which library copies host → device here: 'cupy', 'torch' or None."""
    try:
        import cupy  # noqa: F401

        return "cupy"
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except ImportError:
        pass
    return None


def require_gds() -> Any:
    """kvikio, or GpuUnavailable naming what is missing (driver first, then kvikio)."""
    why = libcuda_missing()
    if why is not None:
        raise GpuUnavailable(why, "no NVIDIA driver on this host")
    why = kvikio_missing()
    if why is not None:
        raise GpuUnavailable(why)
    return _import_kvikio()


def require_staging() -> str:
    """The host → device copier ('cupy' or 'torch'), or GpuUnavailable."""
    why = libcuda_missing()
    if why is not None:
        raise GpuUnavailable(why, "no NVIDIA driver on this host")
    lib = _copier()
    if lib is None:
        raise GpuUnavailable("CuPy or a CUDA build of torch",
                             "to copy staged bytes to the device (pip install 'pfs[gpu]')")
    return lib


def choose_path(buf: Any, *, local: bool, profile: str = "auto", nbytes: int = 0) -> str:
    """The data path for a read of ``nbytes`` into ``buf``, by the client profile:

    - ``host``: not a GPU buffer (posix/uring engines; kvikio is never touched);
    - ``gds``: a GPU buffer and a file this host can open (local object or local file),
      with profile ``load``, or ``auto`` and at least :data:`pfs.core.config.GDS_MIN_BYTES`;
    - ``staging``: every other GPU read (remote stripes; small reads under ``inference``).

    ``gds`` falls back to ``staging`` when kvikio is missing; when staging cannot run
    either, GpuUnavailable names the missing piece."""
    if not is_device_buffer(buf):
        return "host"
    from pfs.core.config import GDS_MIN_BYTES, check_profile

    check_profile(profile)
    if local and (profile == "load" or (profile == "auto" and nbytes >= GDS_MIN_BYTES)):
        try:
            require_gds()
            return "gds"
        except GpuUnavailable as exc:
            log.debug("GDS unavailable (%s); staging through host memory", exc)
    require_staging()
    return "staging"


def set_task_size(kvikio: Any, nbytes: int) -> None:
    """kvikio's task size across its API versions (``defaults.set`` from 24.x on)."""
    defaults = kvikio.defaults
    if hasattr(defaults, "set"):
        defaults.set("task_size", nbytes)
    elif hasattr(defaults, "task_size_reset"):
        defaults.task_size_reset(nbytes)


# -- GDS ----------------------------------------------------------------------------
def gds_read(path: str | os.PathLike[str], buf: Any, file_offset: int = 0,
             nbytes: int | None = None, task_size: int = GDS_TASK_SIZE) -> int:
    """Read ``nbytes`` of ``path`` at ``file_offset`` into device buffer ``buf`` with
    kvikio (blocking; kvikio parallelises internally). Returns bytes read."""
    dev = device_buffer(buf)
    kvikio = require_gds()
    n = dev.nbytes if nbytes is None else nbytes
    if n > dev.nbytes:
        raise OSError(errno.EINVAL, f"read of {n} bytes into a GPU buffer of {dev.nbytes}")
    if n == 0:
        return 0
    f = kvikio.CuFile(os.fspath(path), "r")
    try:
        return int(f.pread(buf, n, file_offset, task_size=task_size).get())
    finally:
        f.close()


class GdsEngine(Engine):
    """The ``gds`` engine: batches of reads from fds into GPU buffers through kvikio.

    kvikio opens files by path, so an fd is reopened through ``/proc/self/fd``. Host
    buffers are refused: they belong to the posix/uring engines."""

    name = "gds"

    def __init__(self, queue_depth: int = DEFAULT_QUEUE_DEPTH,
                 task_size: int = GDS_TASK_SIZE) -> None:
        super().__init__(queue_depth)
        self.kvikio = require_gds()
        self.task_size = task_size

    async def submit(self, ops: Sequence[Op]) -> list[int]:
        import trio

        self._check_open()
        for op in ops:
            if op.write:
                raise OSError(errno.ENOTSUP, "the gds engine only reads")
            if not is_device_buffer(op.buf):
                raise OSError(errno.EINVAL, "the gds engine reads into GPU buffers only; "
                                            "host buffers go through the posix or uring engine")

        def run() -> list[int]:
            files: dict[int, Any] = {}
            try:
                futures = []
                for op in ops:
                    f = files.get(op.fd)
                    if f is None:
                        f = files[op.fd] = self.kvikio.CuFile(f"/proc/self/fd/{op.fd}", "r")
                    futures.append(f.pread(op.buf, op.length, op.offset,
                                           task_size=self.task_size))
                return [int(fu.get()) for fu in futures]
            finally:
                for f in files.values():
                    f.close()

        return await trio.to_thread.run_sync(run)

    async def fsync(self, fd: int) -> None:
        raise OSError(errno.ENOTSUP, "the gds engine only reads")


register_engine("gds", GdsEngine)


# -- staging ------------------------------------------------------------------------
class DeviceStager:
    """A pinned host buffer, allocated once and reused, and host → device copies.

    ``async with``-free on purpose: make one per loader/client and call :meth:`close`."""

    def __init__(self, size: int = STAGING_SIZE, device: int | None = None) -> None:
        self.lib = require_staging()
        self.size = max(2 << 20, size)
        self.half = self.size // 2
        if self.lib == "cupy":
            import cupy
            import cupyx

            if device is not None:
                cupy.cuda.Device(device).use()
            self._host = cupyx.empty_pinned((self.size,), dtype="uint8")
            self._streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
            self.view = memoryview(self._host).cast("B")
        else:
            import torch

            self._host = torch.empty(self.size, dtype=torch.uint8, pin_memory=True)
            self._streams = [torch.cuda.Stream(device=device) for _ in range(2)]
            self.view = memoryview(self._host.numpy()).cast("B")
        self._pending: list[bool] = [False, False]

    def copy(self, slot: int, dst_ptr: int, src_off: int, n: int) -> None:
        if self.lib == "cupy":
            import cupy

            stream = self._streams[slot]
            src = self._host.ctypes.data + src_off
            cupy.cuda.runtime.memcpyAsync(dst_ptr, src, n, _H2D, stream.ptr)
        else:
            import torch

            stream = self._streams[slot]
            src = self._host[src_off:src_off + n]
            dst = _torch_from_ptr(dst_ptr, n, stream.device)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        self._pending[slot] = True

    def wait(self, slot: int) -> None:
        if self._pending[slot]:
            self._streams[slot].synchronize()
            self._pending[slot] = False

    async def read_into_device(self, pread_into: Any, buf: Any, offset: int,
                               nbytes: int | None = None) -> int:
        """Fill device buffer ``buf`` from ``await pread_into(host_view, file_offset)``
        (any async reader), half the staging buffer at a time, each copy overlapping
        the next read (the planner's device executor, :func:`pfs.client.plan.read_device`).
        Returns bytes read (short only at end of file)."""
        dev = device_buffer(buf)
        total = dev.nbytes if nbytes is None else min(nbytes, dev.nbytes)

        def chunk(host: memoryview, off: int) -> Plan[int]:
            return one(Call(pread_into, (host, off)))

        return await TrioDriver().run(read_device(self, dev.ptr, offset, total, chunk))

    def close(self) -> None:
        self.wait(0)
        self.wait(1)
        self._host = None
        self.view = memoryview(b"")


def _torch_from_ptr(ptr: int, n: int, device: Any) -> Any:
    """A uint8 CUDA tensor over ``n`` bytes at ``ptr`` (borrowed, not owned)."""
    import torch

    class _Cai:
        __cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "|u1",
                                    "version": 3}

    return torch.as_tensor(_Cai(), device=device)

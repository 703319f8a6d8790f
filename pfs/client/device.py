"""Device destinations: the executor that fills GPU memory from planned reads.

A destination is a GPU buffer when it exposes ``__cuda_array_interface__`` (CuPy arrays,
torch CUDA tensors, Numba device arrays). The planner's pieces land in a pinned host
buffer, allocated once per :class:`DeviceStager` and reused, and are copied on with
``cudaMemcpyAsync``; two halves alternate so the copy of one overlaps the read of the
next (:func:`pfs.client.plan.read_device` yields the ``ToDevice``/``DeviceWait``
effects, the drivers hand them to the stager).

CuPy or torch is imported only when a device buffer is read: never at ``import pfs``
and never for host buffers. A read that cannot run says which piece is missing:
:class:`GpuUnavailable`. kvikio/GDS (local files straight into device memory) belongs to
the loader (:mod:`pfs.loader.gpu`).
"""
from __future__ import annotations

import ctypes
import errno
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pfs.client.plan import Call, Plan, one, read_device
from pfs.client.trio_driver import TrioDriver

STAGING_SIZE = 64 << 20  # pinned bytes per DeviceStager (two halves)
_MIN_STAGING = 2 << 20
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


def buffer_size(buf: Any) -> int:
    """Bytes of a destination, host or device."""
    if is_device_buffer(buf):
        return device_buffer(buf).nbytes
    return memoryview(buf).nbytes


# -- what is there ------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def libcuda_missing() -> str | None:
    """Why the CUDA driver cannot be loaded, or None."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the CUDA driver (libcuda.so.1 cannot be loaded: {exc})"
    return None


def _copier() -> str | None:
    """Which library copies host → device here: 'cupy', 'torch' or None."""
    try:
        import cupy  # noqa: F401 - optional: the `gpu` extra

        return "cupy"
    except ImportError:
        pass
    try:
        import torch  # optional

        if torch.cuda.is_available():
            return "torch"
    except ImportError:
        pass
    return None


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


# -- staging ------------------------------------------------------------------------
class DeviceStager:
    """A pinned host buffer, allocated once and reused, and host → device copies: the
    executor of the ``ToDevice``/``DeviceWait`` effects.

    ``async with``-free on purpose: make one per loader/client and call :meth:`close`."""

    def __init__(self, size: int = STAGING_SIZE, device: int | None = None) -> None:
        self.lib = require_staging()
        self.size = max(_MIN_STAGING, size)
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
        the next read. Returns bytes read (short only at end of file)."""
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


def read(buf: Any, off: int, size: int,
         chunk: Callable[[memoryview, int], Plan[int]]) -> Plan[int]:
    """A read of a file of ``size`` bytes at ``off`` into device buffer ``buf``: through a
    stager made for this request (up to :data:`STAGING_SIZE`), each half filled by
    ``chunk(host_view, file_offset)``. Returns bytes read."""
    dev = device_buffer(buf)
    stager = DeviceStager(min(STAGING_SIZE, max(_MIN_STAGING, dev.nbytes)))
    try:
        if off < 0:
            raise OSError(errno.EINVAL, "negative offset")
        total = max(0, min(dev.nbytes, size - off))
        return (yield from read_device(stager, dev.ptr, off, total, chunk))
    finally:
        stager.close()


def _torch_from_ptr(ptr: int, n: int, device: Any) -> Any:
    """A uint8 CUDA tensor over ``n`` bytes at ``ptr`` (borrowed, not owned)."""
    import torch

    class _Cai:
        __cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "|u1",
                                    "version": 3}

    return torch.as_tensor(_Cai(), device=device)

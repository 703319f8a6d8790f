"""Device destinations: the executor that fills GPU memory from planned reads.

A destination is a GPU buffer when it exposes ``__cuda_array_interface__`` (CuPy arrays,
torch CUDA tensors, Numba device arrays). The planner's pieces land in a pinned host
buffer, allocated once per :class:`DeviceStager` and reused, and are copied on with
``cudaMemcpyAsync``; two halves alternate so the copy of one overlaps the read of the
next (:func:`pfs.client.plan.read_device` yields the ``ToDevice``/``DeviceWait``
effects, the drivers hand them to the stager).

The *direct* route (:func:`read_direct`): under the ``load`` profile (or ``auto`` from
1 MiB), a stripe whose object is on this host is read by kvikio straight into device
memory and its blocks verified there by the CRC kernel (:mod:`pfs.core.gpu_crc`), or,
without CuPy, through a host bounce buffer; other stripes are staged as above.

CuPy or torch is imported only when a device buffer is read: never at ``import pfs``
and never for host buffers. A read that cannot run says which piece is missing:
:class:`GpuUnavailable`. kvikio/GDS of local files outside pfs belongs to the loader
(:mod:`pfs.loader.gpu`).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c

from pfs.client.data import run_all
from pfs.client.plan import Call, Plan, one, read_device
from pfs.client.trio_driver import TrioDriver
from pfs.core import gpu_crc, metrics
from pfs.core.checksums import (
    BLOCK,
    ChecksumError,
    blocks,
    check_map,
    read_records,
    read_verified,
    whole_blocks,
)
from pfs.core.config import GDS_MIN_BYTES
from pfs.core.layout import Piece

log = logging.getLogger(__name__)

STAGING_SIZE = 64 << 20  # pinned bytes per DeviceStager (two halves)
_MIN_STAGING = 2 << 20
_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost


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


# -- the direct route: local objects straight into device memory (kvikio/GDS) ----------
def kvikio_module() -> Any:
    """kvikio, or None where it (or the CUDA driver) is missing: the staging route then."""
    if libcuda_missing() is not None:
        return None
    try:
        import kvikio  # the `gpu` extra
    except (ImportError, OSError):
        return None
    return kvikio


def gds_wanted(profile: str, nbytes: int) -> bool:
    """Whether a read of ``nbytes`` into device memory takes GDS where it can (the rule
    of :func:`pfs.loader.gpu.choose_path`)."""
    return profile == "load" or (profile == "auto" and nbytes >= GDS_MIN_BYTES)


class Copies:
    """Host ↔ device copies and zeroing of device bytes, with the copier library."""

    def __init__(self, lib: str) -> None:
        self.lib = lib

    def h2d(self, dst_ptr: int, src: memoryview) -> None:
        if not len(src):
            return
        if self.lib == "cupy":
            import cupy

            host = (ctypes.c_char * len(src)).from_buffer(src)
            cupy.cuda.runtime.memcpy(dst_ptr, ctypes.addressof(host), len(src), _H2D)
        else:
            import torch

            dst = _torch_from_ptr(dst_ptr, len(src), torch.device("cuda"))
            dst.copy_(torch.frombuffer(src, dtype=torch.uint8))

    def d2h(self, dst: memoryview, src_ptr: int) -> None:
        if not len(dst):
            return
        if self.lib == "cupy":
            import cupy

            host = (ctypes.c_char * len(dst)).from_buffer(dst)
            cupy.cuda.runtime.memcpy(ctypes.addressof(host), src_ptr, len(dst), _D2H)
        else:
            import torch

            src = _torch_from_ptr(src_ptr, len(dst), torch.device("cuda"))
            torch.frombuffer(dst, dtype=torch.uint8).copy_(src)

    def zero(self, ptr: int, n: int) -> None:
        for at in range(0, n, BLOCK):
            self.h2d(ptr + at, memoryview(bytearray(min(BLOCK, n - at))))


BOUNCE = 4 << 20  # host bytes per copy back when the device cannot hash (no CuPy)


def read_object(obj: tuple[int, int], fd: int, cfd: int | None,
                pieces: list[tuple[int, int, int]], dev: DeviceBuffer, kvikio: Any,
                copies: Copies) -> int:
    """Read pieces ``(object offset, length, device offset)`` of local object ``fd`` into
    device buffer ``dev`` (blocking; the object opened by kvikio once): the whole blocks
    straight into device memory, verified there against the block map (sidecar ``cfd``)
    by the CRC kernel (:mod:`pfs.core.gpu_crc`), or, without CuPy, through a host bounce
    buffer; the edge blocks through the host (read and verified by
    :func:`read_verified`, then copied). Returns the bytes read; ChecksumError (EIO) on a
    mismatch or a short object, the bad block zeroed on the device first. Bytes past
    the object's end are left to the caller (the file's holes)."""
    size = os.fstat(fd).st_size
    f = kvikio.CuFile(f"/proc/self/fd/{fd}", "r")
    try:
        total = 0
        for obj_off, length, dev_off in pieces:
            n = max(0, min(length, size - obj_off))
            if n:
                _read_piece(obj, f, fd, cfd, size, obj_off, n, dev, dev_off, copies)
            if n < length:  # past the object's end: a hole, unless the map says written
                if cfd is not None:
                    first = blocks(obj_off + n, length - n)
                    for blk, rec in zip(first, read_records(cfd, first.start, len(first)),
                                        strict=True):
                        check_map(obj, blk, rec, size)  # ChecksumError: a short object
                copies.zero(dev.ptr + dev_off + n, length - n)
            total += length
        return total
    finally:
        f.close()


def _read_piece(obj: tuple[int, int], f: Any, fd: int, cfd: int | None, size: int,
                obj_off: int, n: int, dev: DeviceBuffer, dev_off: int,
                copies: Copies) -> None:
    if cfd is None:  # an object from before checksums: read as before, unchecked
        _gds(f, dev, n, obj_off, dev_off)
        return
    mid = whole_blocks(obj_off, n)
    lo = mid.start * BLOCK if mid else obj_off + n
    hi = mid.stop * BLOCK if mid else obj_off + n
    for a, b in ((obj_off, lo), (hi, obj_off + n)):  # the edges (all, without a block)
        if b > a:
            host = memoryview(bytearray(b - a))
            (k,) = read_verified(obj, fd, cfd, a, [host])
            copies.h2d(dev.ptr + dev_off + (a - obj_off), host[:k])
    if not mid:
        return
    start = dev_off + (lo - obj_off)
    got = _gds(f, dev, hi - lo, lo, start)
    if got < hi - lo:
        raise ChecksumError(obj, lo + got, "short object: it shrank while being read")
    recs = read_records(cfd, mid.start, len(mid))
    ptr = dev.ptr + start
    hasher = gpu_crc.device_crc()
    if hasher is not None:
        crcs = hasher.blocks(ptr, len(mid), dev.obj)
    else:  # no kernel here: copy back and hash on the host (a D2H copy of every byte)
        crcs, bounce = [], memoryview(bytearray(min(BOUNCE, hi - lo)))
        for at in range(0, hi - lo, len(bounce)):
            part = bounce[:min(len(bounce), hi - lo - at)]
            copies.d2h(part, ptr + at)
            crcs.extend(crc32c.crc32c(part[i:i + BLOCK]) for i in range(0, len(part), BLOCK))
    for i, (blk, rec) in enumerate(zip(mid, recs, strict=True)):
        if not check_map(obj, blk, rec, size):  # a hole: zeros, whatever the file holds
            copies.zero(ptr + i * BLOCK, BLOCK)
        elif crcs[i] != rec[0]:
            copies.zero(ptr + i * BLOCK, BLOCK)  # the bad bytes never stay
            raise ChecksumError(obj, blk * BLOCK, "checksum mismatch (verified on the GPU "
                                "route)")


class DeviceView:
    """``n`` bytes of device memory at ``ptr``, as a ``__cuda_array_interface__`` (what
    kvikio reads into: its ``pread`` takes no device offset)."""

    def __init__(self, ptr: int, n: int, owner: Any) -> None:
        self.owner = owner  # kept alive while the view is
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,),
                                         "typestr": "|u1", "version": 3}


def _gds(f: Any, dev: DeviceBuffer, n: int, file_off: int, dev_off: int) -> int:
    """kvikio's read (open file ``f``) of ``n`` bytes into ``dev`` at ``dev_off``."""
    return int(f.pread(DeviceView(dev.ptr + dev_off, n, dev.obj), n, file_off).get())


async def read_direct(h: Any, buf: Any, off: int) -> int | None:
    """The direct route of a read into device buffer ``buf`` at file offset ``off`` by
    handle ``h`` (an open read-only FileHandle): the pieces of each stripe whose object
    is on this host are read by kvikio straight into device memory and verified there
    (:func:`read_object`; stripes in parallel); other stripes, and a stripe whose local
    read fails verification (the servers check again under their locks), go through
    pinned staging. None when this route does not apply (no kvikio, no local objects, a
    read the profile keeps on staging): the caller stages all of it."""
    objects = getattr(h, "_objects", None)
    if objects is None:
        return None
    dev = device_buffer(buf)
    total = max(0, min(dev.nbytes, h.state.known_size - off))
    if total == 0 or not gds_wanted(h.client.config.profile, total):
        return None
    kvikio = kvikio_module()
    if kvikio is None:
        return None
    copies = Copies(require_staging())
    by_stripe: dict[int, list[Piece]] = {}
    for p in h.layout.pieces(off, total):
        by_stripe.setdefault(p.stripe, []).append(p)
    staged: list[Piece] = []

    async def stripe(s: int, ps: list[Piece]) -> None:
        fd = await objects.fd(h.layout.servers[s], h.ino, s, h.cap)
        if fd is not None:
            want = [(p.obj_off, p.length, p.file_off - off) for p in ps]
            try:
                await objects.read_device(fd, read_object, (h.ino, s), want, dev, kvikio,
                                          copies)
                return
            except ChecksumError as exc:
                metrics.checksum_failure("gpu")
                log.warning("GPU route: %s; reading it through the servers", exc)
        staged.extend(ps)

    await run_all([functools.partial(stripe, s, ps) for s, ps in by_stripe.items()])
    stager: DeviceStager | None = None
    try:
        for p in staged:
            if stager is None:
                stager = DeviceStager(min(STAGING_SIZE, max(_MIN_STAGING, p.length)))
            await h.client.driver.run(read_device(stager, dev.ptr + (p.file_off - off),
                                                  p.file_off, p.length, h._read_chunk))
    finally:
        if stager is not None:
            stager.close()
    return total

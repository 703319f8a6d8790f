"""GPU reads for the loader: kvikio/GDS and the ``gds`` engine.

A file this host can open — a local object (short-circuit) or a local file — is read by
kvikio straight into device memory (GPUDirect Storage where the drivers are present,
kvikio's own POSIX compatibility mode where they are not). Everything else reaches a GPU
buffer through the client's device executor (pinned staging + copy,
:mod:`pfs.client.device`); :func:`choose_path` picks between them by profile.

kvikio is the optional ``gpu`` extra and is imported only when a device buffer is read:
never at ``import pfs`` and never for host buffers (kvikio 26.x loads ``libcuda.so.1``
even for host memory, so a host read through it would fail on a machine without a GPU).
Every path that cannot run says which piece is missing: :class:`GpuUnavailable`.
"""
from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from typing import Any

import trio

from pfs.client import device
from pfs.client.device import GpuUnavailable, device_buffer, is_device_buffer, require_staging
from pfs.core.config import GDS_MIN_BYTES, check_profile
from pfs.core.engine import DEFAULT_QUEUE_DEPTH, Engine, Op, register_engine

log = logging.getLogger(__name__)

GDS_TASK_SIZE = 16 << 20  # kvikio task size for the `load` profile (large sequential reads)

__all__ = ["GDS_TASK_SIZE", "GdsEngine", "choose_path", "gds_read", "kvikio_missing",
           "require_gds", "set_task_size"]


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


def require_gds() -> Any:
    """kvikio, or GpuUnavailable naming what is missing (driver first, then kvikio)."""
    why = device.libcuda_missing()  # looked up there: one answer for staging and GDS
    if why is not None:
        raise GpuUnavailable(why, "no NVIDIA driver on this host")
    why = kvikio_missing()
    if why is not None:
        raise GpuUnavailable(why)
    return _import_kvikio()


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

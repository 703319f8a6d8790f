"""Block CRC32C on the GPU: verify 64 KiB blocks where they landed, in device memory.

A GDS read (kvikio) puts an object's bytes straight into GPU memory; copying them back to
the host to hash them would undo the point of it. So the blocks are hashed on the device:

- one CUDA thread block per 64 KiB block, :data:`THREADS` threads, each hashing its
  :data:`PIECE` bytes (256) with a byte table in shared memory (the *raw* CRC: init 0,
  no final xor, :mod:`pfs.core.crcmath`);
- the pieces' CRCs combined pairwise in a tree of 8 levels: ``raw(A + B) =
  shift(raw(A), len(B)) ^ raw(B)``, the shift by ``PIECE << level`` bytes a 32x32 bit
  matrix (32 words per level, computed on the host by :func:`crcmath.shift_columns`);
- the block's CRC32C is then ``raw ^ FINISH`` (``FINISH``: the effect of the init and
  final xor on a full block), compared on the host with the block map's CRCs (one
  4-byte result per block comes back).

:func:`crc_blocks_numpy` is the same algorithm, step for step, in numpy: the tests check it
against the ``crc32c`` package on the CPU, so the kernel's math is tested where no GPU is.
Only whole blocks are hashed here (a block at the object's end, or one cut by the read's
edges, is read through the host and verified there).
"""
from __future__ import annotations

import functools
import logging
from typing import Any

from pfs.core import crcmath
from pfs.core.checksums import BLOCK

log = logging.getLogger(__name__)

THREADS = 256  # threads per CUDA block, one piece each
PIECE = BLOCK // THREADS  # bytes hashed by one thread
LEVELS = THREADS.bit_length() - 1  # combine levels: log2(THREADS)

KERNEL = r"""
extern "C" __global__ void crc32c_blocks(const unsigned char* data,
                                         const unsigned int* table,
                                         const unsigned int* cols,
                                         unsigned int finish,
                                         unsigned int* out) {
    __shared__ unsigned int t[256];
    __shared__ unsigned int part[@THREADS@];
    const unsigned int tid = threadIdx.x;
    t[tid] = table[tid];
    __syncthreads();
    const unsigned char* p = data + (unsigned long long)blockIdx.x * @BLOCK@ULL
                             + (unsigned long long)tid * @PIECE@;
    unsigned int c = 0;
    for (int i = 0; i < @PIECE@; i++) {
        c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    }
    part[tid] = c;
    __syncthreads();
    for (int lvl = 0, w = 1; w < @THREADS@; lvl++, w <<= 1) {
        if ((tid & (2 * w - 1)) == 0) {
            unsigned int a = part[tid], s = 0;
            const unsigned int* m = cols + lvl * 32;
            for (int bit = 0; bit < 32; bit++) {
                if ((a >> bit) & 1) s ^= m[bit];
            }
            part[tid] = s ^ part[tid + w];
        }
        __syncthreads();
    }
    if (tid == 0) out[blockIdx.x] = part[0] ^ finish;
}
""".replace("@THREADS@", str(THREADS)).replace("@BLOCK@", str(BLOCK)).replace(
    "@PIECE@", str(PIECE))


@functools.lru_cache(maxsize=1)
def constants() -> tuple[list[int], list[int], int]:
    """The kernel's inputs: the byte table (256 words), the shift matrices of the
    combine levels (``LEVELS`` x 32 words), and ``FINISH`` for a full block."""
    table = []
    for b in range(256):
        r = b
        for _ in range(8):
            r = (r >> 1) ^ (crcmath.POLY if r & 1 else 0)
        table.append(r)
    cols: list[int] = []
    for lvl in range(LEVELS):
        cols.extend(crcmath.shift_columns(PIECE << lvl))
    finish = crcmath.shift_by(BLOCK)(crcmath.MASK) ^ crcmath.MASK
    return table, cols, finish


def crc_blocks_numpy(data: Any) -> list[int]:
    """CRC32C of each whole block of ``data`` (bytes-like, a multiple of ``BLOCK``), by
    the kernel's algorithm: per-thread pieces, a table step per byte, the tree combine."""
    import numpy as np

    table, cols, finish = constants()
    t = np.array(table, dtype=np.uint32)
    raw = np.frombuffer(data, dtype=np.uint8)
    nblocks = len(raw) // BLOCK
    pieces = raw[:nblocks * BLOCK].reshape(nblocks * THREADS, PIECE)
    c = np.zeros(nblocks * THREADS, dtype=np.uint32)
    for i in range(PIECE):  # every thread's i-th byte at once
        c = t[(c ^ pieces[:, i]) & 0xFF] ^ (c >> np.uint32(8))
    part = c.reshape(nblocks, THREADS)
    for lvl in range(LEVELS):  # pairs of neighbours, as the threads tid and tid + w
        a, b = part[:, 0::2], part[:, 1::2]
        m = cols[lvl * 32:(lvl + 1) * 32]
        s = np.zeros_like(a)
        for bit in range(32):
            s ^= np.where((a >> np.uint32(bit)) & np.uint32(1), np.uint32(m[bit]),
                          np.uint32(0))
        part = s ^ b
    return [int(x) ^ finish for x in part[:, 0]]


class DeviceCrc:
    """The kernel compiled once (CuPy's ``RawKernel``); :meth:`blocks` hashes whole
    blocks at a device address. Needs CuPy and a CUDA device."""

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        table, cols, self.finish = constants()
        self.kernel = cupy.RawKernel(KERNEL, "crc32c_blocks")
        self.table = cupy.asarray(table, dtype=cupy.uint32)
        self.cols = cupy.asarray(cols, dtype=cupy.uint32)

    def blocks(self, ptr: int, nblocks: int, owner: Any = None) -> list[int]:
        """CRC32C of the ``nblocks`` blocks at device address ``ptr``."""
        cupy = self.cupy
        if nblocks == 0:
            return []
        mem = cupy.cuda.UnownedMemory(ptr, nblocks * BLOCK, owner)
        data = cupy.ndarray((nblocks * BLOCK,), dtype=cupy.uint8,
                            memptr=cupy.cuda.MemoryPointer(mem, 0))
        out = cupy.empty(nblocks, dtype=cupy.uint32)
        self.kernel((nblocks,), (THREADS,), (data, self.table, self.cols,
                                             cupy.uint32(self.finish), out))
        return [int(x) for x in out.get()]


@functools.lru_cache(maxsize=1)
def device_crc() -> DeviceCrc | None:
    """The device hasher, or None where CuPy (or a device) is missing: the caller then
    verifies through a host bounce buffer."""
    try:
        return DeviceCrc()
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - CuPy raises its own types for no device
        log.info("no CRC kernel on the device (%s): verifying "
                                         "GPU reads through host memory", exc)
        return None

#!/usr/bin/env bash
# GPU checks for the loader fast path, on a machine with an NVIDIA GPU (< 8 minutes):
#   1. the GPU tests (tests/integration/test_gpu.py -m gpu: GDS, staging, the loader's CUDA
#      test, and the CRC32C kernel of pfs.core.gpu_crc against crc32c);
#   2. a small GDS benchmark: a 1 GiB file read into device memory with kvikio (GDS, or
#      kvikio's compat mode where the GDS driver is absent), against preadv into pinned
#      host memory + cudaMemcpy, and through pfs.client.device.DeviceStager (the
#      client's device executor).
# Needs the gpu extra: pip install -e '.[gpu,dev]' (kvikio-cu12, cupy-cuda12x).
#   PY=.venv/bin/python tests/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
SIZE_MB=${SIZE_MB:-1024}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" - <<'PYEOF'
import importlib
for m in ("kvikio", "cupy", "torch"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')}")
    except ImportError as exc:
        print(f"{m}: missing ({exc})")
PYEOF

echo "== GPU tests"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_gpu.py -rs

echo "== CRC32C kernel: GB/s of device memory verified (pfs.core.gpu_crc)"
timeout 60 "$PY" - <<'PYEOF'
import time
import cupy
from pfs.core import gpu_crc
n = 4096  # 256 MiB of 64 KiB blocks
dev = cupy.random.randint(0, 256, n * gpu_crc.BLOCK, dtype=cupy.uint8)
h = gpu_crc.device_crc()
h.blocks(dev.data.ptr, n, dev)
cupy.cuda.runtime.deviceSynchronize()
t0 = time.perf_counter()
for _ in range(5):
    h.blocks(dev.data.ptr, n, dev)
print(f"crc32c kernel: {5 * n * gpu_crc.BLOCK / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
PYEOF

echo "== GDS benchmark (${SIZE_MB} MiB)"
timeout 180 "$PY" - "$SIZE_MB" <<'PYEOF'
import os, sys, tempfile, time
import cupy
import trio
import pfs.loader.gpu as gpu
import pfs.client.device as device

size = int(sys.argv[1]) << 20
d = tempfile.mkdtemp(prefix="pfs-gds-")
path = os.path.join(d, "blob")
with open(path, "wb") as f:
    for _ in range(size >> 24):
        f.write(os.urandom(16 << 20))
fd = os.open(path, os.O_RDONLY)
dev = cupy.empty(size, dtype=cupy.uint8)

def rate(label, fn, rounds=3):
    best = 0.0
    for _ in range(rounds):
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        n = fn()
        cupy.cuda.runtime.deviceSynchronize()
        best = max(best, n / (time.perf_counter() - t0))
    print(f"{label:42s} {best / 1e9:7.2f} GB/s")

try:
    import kvikio
    try:
        print("kvikio compat mode:", kvikio.defaults.get("compat_mode"))
    except (AttributeError, TypeError, KeyError):
        print("kvikio compat mode:", getattr(kvikio.defaults, "compat_mode", lambda: "?")())
    rate("kvikio/GDS file -> device (16 MiB tasks)", lambda: gpu.gds_read(path, dev, 0))
except ImportError as exc:
    print("kvikio missing:", exc)

import cupyx
pinned = cupyx.empty_pinned((size,), dtype="uint8")
host = memoryview(pinned).cast("B")
def posix_copy():
    n = 0
    while n < size:
        n += os.preadv(fd, [host[n:n + (64 << 20)]], n)
    cupy.cuda.runtime.memcpy(dev.data.ptr, pinned.ctypes.data, size, 1)
    return size
rate("preadv -> pinned host -> cudaMemcpy", posix_copy)

st = device.DeviceStager(64 << 20)
async def pr(view, off):
    return os.preadv(fd, [view], off)
rate("pfs.client.device.DeviceStager (2 x 32 MiB pinned)",
     lambda: trio.run(st.read_into_device, pr, dev, 0))
st.close()
os.close(fd)
os.remove(path)
os.rmdir(d)
PYEOF
echo "gpu_check: done"

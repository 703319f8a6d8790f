"""GPU destinations: the client's device executor (pfs.client.device: pinned staging
and copies) and the loader's kvikio/GDS path (pfs.loader.gpu). CPU-side tests use a fake object exposing
``__cuda_array_interface__`` and mock only what cannot run here (the CUDA driver, kvikio,
CuPy); tests marked ``gpu`` need a CUDA device and skip without one
(``tests/gpu_check.sh`` runs them on a GPU machine)."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import pfs.client.device as device
import pfs.loader.gpu as gpu
from pfs.client.device import GpuUnavailable, device_buffer, is_device_buffer
from pfs.core.engine import get_engine
from pfs.loader.gpu import choose_path


class FakeDeviceArray:
    """Looks like a CuPy array to pfs; holds no GPU memory."""

    def __init__(self, shape: tuple[int, ...], typestr: str = "|u1",
                 strides: tuple[int, ...] | None = None, readonly: bool = False) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (0xDEAD0000, readonly), "version": 3,
                                         "strides": strides}


@pytest.fixture
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "libcuda_missing",
                        lambda: "the CUDA driver (libcuda.so.1 cannot be loaded: test)")


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "libcuda_missing", lambda: None)


def _no_kvikio() -> Any:
    raise ImportError("No module named 'kvikio'")


def test_detects_device_buffers() -> None:
    assert is_device_buffer(FakeDeviceArray((4,)))
    for host in (bytearray(4), memoryview(b"x"), b"", None):
        assert not is_device_buffer(host)
    import numpy as np

    assert not is_device_buffer(np.zeros(3))


def test_device_buffer_geometry() -> None:
    b = device_buffer(FakeDeviceArray((3, 5), "<f4"))
    assert b.ptr == 0xDEAD0000 and b.nbytes == 60
    assert device_buffer(FakeDeviceArray((3, 5), "<f4", strides=(20, 4))).nbytes == 60
    with pytest.raises(OSError) as e:
        device_buffer(FakeDeviceArray((3, 5), "<f4", strides=(4, 12)))
    assert e.value.errno == errno.EINVAL and "contiguous" in str(e.value)
    with pytest.raises(OSError, match="read-only"):
        device_buffer(FakeDeviceArray((3,), readonly=True))


def test_host_buffers_never_touch_kvikio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_import_kvikio", lambda: pytest.fail("kvikio imported"))
    assert choose_path(bytearray(10), local=True, profile="load") == "host"
    # and importing pfs (and its loader, engines, client) does not import kvikio
    code = ("import sys, pfs, pfs.core.engine, pfs.loader.safetensors, pfs.loader.gpu, "
            "pfs.client.device, pfs.client.sync; "
            "assert 'kvikio' not in sys.modules and 'cupy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_driver_names_libcuda(no_driver: None) -> None:
    with pytest.raises(GpuUnavailable) as e:
        choose_path(FakeDeviceArray((4,)), local=True, profile="load", nbytes=4)
    assert e.value.errno == errno.ENOTSUP and "libcuda.so.1" in str(e.value)
    with pytest.raises(GpuUnavailable, match="libcuda.so.1"):
        get_engine("gds")


def test_missing_kvikio_falls_back_to_staging(driver: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_import_kvikio", _no_kvikio)
    monkeypatch.setattr(device, "_copier", lambda: "cupy")
    buf = FakeDeviceArray((8 << 20,))
    assert choose_path(buf, local=True, profile="load", nbytes=8 << 20) == "staging"
    with pytest.raises(GpuUnavailable) as e:
        get_engine("gds")
    assert "kvikio" in str(e.value) and "pfs[gpu]" in str(e.value)


def test_nothing_to_copy_with_names_cupy_or_torch(driver: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_import_kvikio", _no_kvikio)
    monkeypatch.setattr(device, "_copier", lambda: None)
    with pytest.raises(GpuUnavailable, match="CuPy or a CUDA build of torch"):
        choose_path(FakeDeviceArray((4,)), local=False, nbytes=4)


def test_path_by_profile_and_locality(driver: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_import_kvikio", lambda: object())
    monkeypatch.setattr(device, "_copier", lambda: "cupy")
    big, small = FakeDeviceArray((4 << 20,)), FakeDeviceArray((4096,))
    assert choose_path(big, local=True, profile="load", nbytes=4 << 20) == "gds"
    assert choose_path(small, local=True, profile="load", nbytes=4096) == "gds"
    assert choose_path(big, local=True, profile="auto", nbytes=4 << 20) == "gds"
    assert choose_path(small, local=True, profile="auto", nbytes=4096) == "staging"
    assert choose_path(big, local=True, profile="inference", nbytes=4 << 20) == "staging"
    assert choose_path(big, local=False, profile="load", nbytes=4 << 20) == "staging"
    with pytest.raises(ValueError, match="unknown profile"):
        choose_path(big, local=True, profile="fast")


def test_gds_engine_refuses_host_buffers(driver: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_import_kvikio", lambda: object())
    eng = get_engine("gds")
    assert eng.name == "gds"

    async def main() -> None:
        with pytest.raises(OSError, match="GPU buffers only"):
            await eng.read_into(0, 0, memoryview(bytearray(10)))
        with pytest.raises(OSError) as e:
            await eng.fsync(0)
        assert e.value.errno == errno.ENOTSUP

    trio.run(main)


def test_client_readinto_gpu_buffer_without_cuda(no_driver: None) -> None:
    """The async FileHandle hands GPU buffers to its device executor, which says what is
    missing (the file's servers are never asked)."""
    from types import SimpleNamespace

    from pfs.client.aio import FileHandle
    from pfs.client.trio_driver import TrioDriver
    from pfs.client.writeback import WriteBack

    class Handle:
        _check = FileHandle._check
        _read_chunk = FileHandle._read_chunk
        _named = FileHandle._named
        path = ""
        closed = False
        readable = True
        writable = False
        ino = 7
        state = SimpleNamespace(known_size=16)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            h = Handle()
            h.client = SimpleNamespace(driver=TrioDriver(),  # type: ignore[attr-defined]
                                       writes=WriteBack(nursery))
            with pytest.raises(GpuUnavailable, match="libcuda.so.1"):
                await FileHandle.pread_into(h, FakeDeviceArray((16,)), 0)  # type: ignore[arg-type]

    trio.run(main)


def test_loader_cuda_device_needs_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from pfs.loader.safetensors import load_safetensors

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: covered by the gpu tests")
    (tmp_path / "x.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    with pytest.raises(GpuUnavailable) as e:
        load_safetensors(tmp_path / "x.safetensors", device="cuda:0")
    assert "libcuda.so.1" in str(e.value) or "CUDA build of torch" in str(e.value)


# -- on a GPU ---------------------------------------------------------------------------
def _cupy() -> Any:
    if device.libcuda_missing() is not None:
        pytest.skip("no CUDA driver")
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"no CUDA device: {exc}")
    return cupy


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom((24 << 20) + 12345)
    p = tmp_path / "blob"
    p.write_bytes(data)
    return p, data


@pytest.mark.gpu
def test_gpu_gds_read(data_file: tuple[Path, bytes]) -> None:
    cupy = _cupy()
    pytest.importorskip("kvikio")
    path, data = data_file
    buf = cupy.empty(len(data) - 1000, dtype=cupy.uint8)
    assert gpu.gds_read(path, buf, 1000) == len(data) - 1000
    assert cupy.asnumpy(buf).tobytes() == data[1000:]


@pytest.mark.gpu
def test_gpu_gds_engine(data_file: tuple[Path, bytes]) -> None:
    cupy = _cupy()
    pytest.importorskip("kvikio")
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)
    bufs = [cupy.empty(n, dtype=cupy.uint8) for n in (4096, 3 << 20, 1)]

    async def main() -> list[int]:
        eng = get_engine("gds")
        return await eng.readv([(fd, 0, 4096, bufs[0]), (fd, 777, 3 << 20, bufs[1]),
                                (fd, len(data) - 1, 1, bufs[2])])

    try:
        assert trio.run(main) == [4096, 3 << 20, 1]
    finally:
        os.close(fd)
    assert cupy.asnumpy(bufs[1]).tobytes() == data[777:777 + (3 << 20)]
    assert cupy.asnumpy(bufs[2]).tobytes() == data[-1:]


@pytest.mark.gpu
def test_gpu_staging_reuses_pinned_buffer(data_file: tuple[Path, bytes]) -> None:
    cupy = _cupy()
    path, data = data_file
    fd = os.open(path, os.O_RDONLY)

    async def pread_into(view: memoryview, off: int) -> int:
        return os.preadv(fd, [view], off)

    async def main() -> None:
        st = device.DeviceStager(4 << 20)
        host = st.view
        for off in (0, 5, 1 << 20):
            buf = cupy.empty(len(data) - off, dtype=cupy.uint8)
            assert await st.read_into_device(pread_into, buf, off) == len(data) - off
            assert cupy.asnumpy(buf).tobytes() == data[off:]
            assert st.view is host  # the same pinned buffer every time
        st.close()

    try:
        trio.run(main)
    finally:
        os.close(fd)


@pytest.mark.gpu
def test_gpu_client_readinto(request: pytest.FixtureRequest) -> None:
    cupy = _cupy()  # before the cluster starts
    client = request.getfixturevalue("client")
    workdir = request.getfixturevalue("workdir")
    data = os.urandom((5 << 20) + 3)
    client.write_file(f"{workdir}/g", data)
    with client.open(f"{workdir}/g", "rb") as f:
        buf = cupy.empty(len(data), dtype=cupy.uint8)
        assert f.readinto(buf) == len(data)
    assert cupy.asnumpy(buf).tobytes() == data


@pytest.mark.gpu
def test_gpu_crc_kernel_matches_crc32c() -> None:
    """The CRC32C kernel (pfs.core.gpu_crc) on a real device, against crc32c."""
    cupy = _cupy()
    import crc32c

    from pfs.core import gpu_crc

    data = bytearray(os.urandom(37 * gpu_crc.BLOCK))
    data[5 * gpu_crc.BLOCK:6 * gpu_crc.BLOCK] = bytes(gpu_crc.BLOCK)
    dev = cupy.asarray(memoryview(data), dtype=cupy.uint8)
    hasher = gpu_crc.device_crc()
    assert hasher is not None
    got = hasher.blocks(dev.data.ptr, 37, dev)
    assert got == [crc32c.crc32c(data[i:i + gpu_crc.BLOCK])
                   for i in range(0, len(data), gpu_crc.BLOCK)]


@pytest.mark.gpu
def test_gpu_route_verifies_on_the_device(client_toml: Path, cluster_dir: Path,
                                          workdir: str) -> None:
    """A read of local objects into a CuPy array under the `load` profile: kvikio into
    device memory, the CRC kernel verifies; a flipped byte is EIO naming the file."""
    cupy = _cupy()
    pytest.importorskip("kvikio")
    import pfs
    from pfs.core.config import ClientConfig, load

    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit, cfg.profile = True, "load"
    data = os.urandom((6 << 20) + 777)
    with pfs.connect(config=cfg) as c:
        c.set_layout(workdir, count=2, unit=1 << 20)
        path = f"{workdir}/gv"
        c.write_file(path, data)
        with c.open(path, "rb") as f:
            buf = cupy.empty(len(data) - 5, dtype=cupy.uint8)
            assert f.preadinto(buf, 5) == len(data) - 5
        assert cupy.asnumpy(buf).tobytes() == data[5:]
        (obj,) = (cluster_dir / "data").glob(f"ds*/objects/*/{c.stat(path).st_ino}.0")
        with open(obj, "r+b") as o:
            o.seek(3 << 16)
            b = o.read(1)
            o.seek(3 << 16)
            o.write(bytes([b[0] ^ 1]))
        with c.open(path, "rb") as f, pytest.raises(OSError) as err:
            f.readinto(cupy.empty(len(data), dtype=cupy.uint8))
        assert err.value.errno == errno.EIO and path in str(err.value)


@pytest.mark.gpu
def test_gpu_loader_cuda(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from safetensors.torch import save_file

    from pfs.loader.safetensors import load_safetensors

    t = {"a": torch.randn(1000, 257).to(torch.bfloat16), "b": torch.arange(10)}
    save_file(t, str(tmp_path / "m.safetensors"))
    out = load_safetensors(tmp_path / "m.safetensors", device="cuda:0")
    for k, v in t.items():
        assert out[k].device.type == "cuda"
        assert torch.equal(out[k].cpu().view(torch.uint8) if v.element_size() == 1
                           else out[k].cpu(), v)
    part = load_safetensors(tmp_path / "m.safetensors", device="cuda:0", tp_rank=1,
                            tp_size=2, split={"a": 1})
    assert torch.equal(part["a"].cpu(), torch.tensor_split(t["a"], 2, 1)[1])


def test_loader_gds_plan_with_fake_kvikio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's GDS path (kvikio reads into device buffers), run on CPU tensors with a
    stand-in kvikio that reads with preadv: same bytes as the host path, TP too."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    import pfs.loader.safetensors as L

    class FakeCuFile:
        def __init__(self, path: str, flags: str) -> None:
            self.fd = os.open(path, os.O_RDONLY)

        def pread(self, buf: Any, size: int, off: int, task_size: int = 0) -> Any:
            n = os.preadv(self.fd, [memoryview(buf.numpy())[:size]], off)

            class Done:
                def get(self) -> int:
                    return n
            return Done()

        def close(self) -> None:
            os.close(self.fd)

    class FakeKvikio:
        CuFile = FakeCuFile

    monkeypatch.setattr(gpu, "require_gds", lambda: FakeKvikio)
    t = {"a": torch.randn(300, 70).to(torch.bfloat16), "b": torch.arange(11),
         "e": torch.empty(0, 3)}
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))

    async def load(**kw: Any) -> dict[str, Any]:
        st = L.LoadStats()
        reader = L._LocalReader(L.profile_settings("load"))
        try:
            out = await L._load(reader, str(path), L._Torch("cpu"), "cpu", None,
                                kw.get("split"), kw.get("rank", 0), kw.get("size", 1),
                                1 << 20, st, gds_ok=True)
        finally:
            reader.aclose()
        assert st.engine == "gds"
        return out

    out = trio.run(load)
    for k, v in t.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k].view(-1).view(torch.uint8),
                                                       v.view(-1).view(torch.uint8))
    part = trio.run(lambda: load(split={"a": 1}, rank=1, size=2))
    assert torch.equal(part["a"].view(torch.int16), torch.tensor_split(t["a"], 2, 1)[1]
                       .contiguous().view(torch.int16))


# -- the direct route of local objects, verified (on a host-backed stand-in GPU) ----------
class HostDeviceArray:
    """A 'GPU buffer' in host memory: ``__cuda_array_interface__`` over a numpy array,
    so the copies, kvikio and the CRC can be stood in for by host code."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.host = np.zeros(n, dtype=np.uint8)
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "version": 3,
                                         "data": (self.host.ctypes.data, False)}

    def bytes(self) -> bytes:
        return self.host.tobytes()


def _host(ptr: int, n: int) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


class HostCopies(device.Copies):
    def h2d(self, dst_ptr: int, src: memoryview) -> None:
        _host(dst_ptr, len(src))[:] = src

    def d2h(self, dst: memoryview, src_ptr: int) -> None:
        dst[:] = _host(src_ptr, len(dst))


class FakeStager:
    def __init__(self, size: int, device: int | None = None) -> None:
        self.size, self.half = size, size // 2
        self.view = memoryview(bytearray(size))

    def copy(self, slot: int, dst_ptr: int, src_off: int, n: int) -> None:
        _host(dst_ptr, n)[:] = self.view[src_off:src_off + n]

    def wait(self, slot: int) -> None:
        pass

    def close(self) -> None:
        pass


class FakeKvikio:
    reads = 0

    class CuFile:
        def __init__(self, path: str, flags: str) -> None:
            self.fd = os.open(path, os.O_RDONLY)

        def pread(self, buf: Any, size: int, file_offset: int = 0,
                  task_size: int | None = None) -> Any:  # kvikio's signature
            FakeKvikio.reads += 1
            cai = buf.__cuda_array_interface__
            assert cai["shape"] == (size,)  # a view of just the bytes to read
            ptr = cai["data"][0]
            n = os.preadv(self.fd, [_host(ptr, size)], file_offset)

            class Done:
                def get(self) -> int:
                    return n
            return Done()

        def close(self) -> None:
            os.close(self.fd)


class TwinCrc:
    """The CRC kernel's algorithm (gpu_crc.crc_blocks_numpy) over 'device' memory."""

    def blocks(self, ptr: int, nblocks: int, owner: Any = None) -> list[int]:
        from pfs.core import gpu_crc

        return gpu_crc.crc_blocks_numpy(_host(ptr, nblocks * gpu_crc.BLOCK))


@pytest.fixture
def host_gpu(driver: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from pfs.core import gpu_crc

    monkeypatch.setattr(device, "_copier", lambda: "cupy")
    monkeypatch.setattr(device, "kvikio_module", lambda: FakeKvikio)
    monkeypatch.setattr(device, "Copies", HostCopies)
    monkeypatch.setattr(device, "DeviceStager", FakeStager)
    monkeypatch.setattr(gpu_crc, "device_crc", lambda: None)  # no CuPy: bounce buffer


@pytest.mark.parametrize("hasher", ["bounce", "kernel-twin"])
def test_gpu_route_reads_local_objects_verified(host_gpu: None, client_toml: Path,
                                                cluster_dir: Path, workdir: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture,
                                                hasher: str) -> None:
    """kvikio reads local objects straight into 'device' memory and the blocks are
    verified there (the CRC kernel's algorithm, or a host bounce buffer without CuPy):
    the right bytes, holes as zeros, and a flipped byte is EIO naming the file."""
    import random

    import pfs
    from pfs.core import gpu_crc
    from pfs.core.config import ClientConfig, load

    if hasher == "kernel-twin":
        monkeypatch.setattr(gpu_crc, "device_crc", TwinCrc)
    cfg = load(ClientConfig, client_toml)
    cfg.short_circuit, cfg.profile = True, "load"
    block = 64 << 10
    with pfs.connect(config=cfg) as c:
        c.set_layout(workdir, count=2, unit=4 * block, replicas=1)
        path = f"{workdir}/g"
        data = bytearray(random.Random(7).randbytes(20 * block + 321))
        with c.open(path, "wb") as f:
            f.pwrite(data[:9 * block], 0)
            f.pwrite(data[10 * block:], 10 * block)  # block 9 of the file: a hole
        data[9 * block:10 * block] = bytes(block)
        before = FakeKvikio.reads
        with c.open(path, "rb") as f:
            buf = HostDeviceArray(len(data) - 1000)
            assert f.readinto(buf) == len(buf.host)
            assert buf.bytes() == data[:len(buf.host)]
            buf = HostDeviceArray(len(data))
            assert f.preadinto(buf, 1000) == len(data) - 1000
            assert buf.bytes()[:len(data) - 1000] == data[1000:]
        assert FakeKvikio.reads > before  # the direct route, not staging
        ino = c.stat(path).st_ino
        (obj,) = (cluster_dir / "data").glob(f"ds*/objects/*/{ino}.1")
        with open(obj, "r+b") as o:  # stripe 1's object offset block + 5: a whole block
            o.seek(block + 5)
            b = o.read(1)
            o.seek(block + 5)
            o.write(bytes([b[0] ^ 1]))
        with c.open(path, "rb") as f, pytest.raises(OSError) as err:
            f.readinto(HostDeviceArray(len(data)))
        assert err.value.errno == errno.EIO and path in str(err.value)
        assert "checksum mismatch (verified on the GPU route)" in caplog.text
        # a file grown by truncate: past its objects' ends, zeros (holes), on the route
        ext = f"{workdir}/ext"
        with c.open(ext, "wb") as f:
            f.write(data[:2 * block])
            f.truncate(12 * block)
        with c.open(ext, "rb") as f:
            buf = HostDeviceArray(12 * block)
            buf.host[:] = 0xEE
            assert f.readinto(buf) == 12 * block
        assert buf.bytes() == data[:2 * block] + bytes(10 * block)
        # an object cut short where its block map says data was written: EIO
        (obj0,) = (cluster_dir / "data").glob(f"ds*/objects/*/{ino}.0")
        os.truncate(obj0, block + 10)
        caplog.clear()
        with c.open(path, "rb") as f, pytest.raises(OSError) as err:
            f.readinto(HostDeviceArray(8 * block))
        assert err.value.errno == errno.EIO and "short object" in caplog.text

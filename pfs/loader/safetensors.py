"""Sharded safetensors loader: checkpoints from pfs or local disk into tensors, fast.

    tensors = pfs.load_safetensors("/models/llama", client=c)            # pfs directory
    tensors = pfs.load_safetensors("ckpt/model.safetensors")              # local file
    part = pfs.load_safetensors(src, tp_rank=1, tp_size=4,
                                split={"*.q_proj.weight": 0, "*.o_proj.weight": 1})

How it reads:

1. every shard's header (8-byte little-endian length, then JSON) is read and checked;
2. the wanted byte ranges are planned: whole tensors whose ranges lie within
   ``merge_gap`` bytes of each other are merged into one *region*, read with one large
   request into one preallocated buffer; each tensor is a zero-copy view of its region;
3. a tensor-parallel slice (``split``) gets a buffer of its own and only its bytes are
   read: one range for a split along dim 0, one range per outer row for a later dim
   (rows that touch are merged);
4. all reads of all shards are issued at once: local files through an I/O engine
   (io_uring where the kernel has it: one batch of SQEs; otherwise preadv in threads),
   pfs files through the async client (``File.pread_many``: a shard's local objects are
   read by object, in 4 MiB preadv's on a pool of threads, each verified right after
   its read; everything else striped across the data servers; a pfs shard's
   short-circuit descriptors are all asked for when it is opened, beside its header);
5. each buffer is a mapping of its own: one an earlier load of the process handed back
   when its tensors were freed (:mod:`pfs.loader.pool`: no page to fault in again), or
   a fresh one that a thread faults in from its far end while the reads fill it from
   the front (:mod:`pfs.loader.buffers`), so most pages are there before a copy
   reaches them instead of faulting in one by one inside it; a fresh buffer of a pfs
   shard whose every stripe is local is instead registered with a userfaultfd and
   filled by the short-circuit reads page for page from the objects' page cache
   (:mod:`pfs.client.filled`: no fault and no zeroing per page, still a private copy,
   every block verified in place);
6. with ``zero_copy=True`` (opt-in, pfs, CPU) a shard with local objects gets one
   anonymous mapping instead, over which the local objects' pages are mapped
   copy-on-write and verified in place (:mod:`pfs.client.mapping`), the rest read into
   it: no copy and no fresh pages, but the tensors alias the stored file (see
   :func:`load_safetensors` for the rule when it changes).

It returns ``{name: tensor}``: torch tensors when torch is installed (or
``framework="torch"``), else numpy arrays (``framework="numpy"``). numpy has no bf16 or
fp8: with ``ml_dtypes`` installed those come as ``ml_dtypes.bfloat16`` /
``float8_e4m3fn`` / ``float8_e5m2`` arrays, without it as their raw bits — ``uint16`` for
BF16, ``uint8`` for the F8 types — bit-exact either way (``arr.view(ml_dtypes.bfloat16)``
gives floats later).

The ``load`` profile (:func:`pfs.core.config.profile_settings`) sets the engine, queue depth,
request size and merge gap.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import logging
import math
import mmap
import os
import posixpath
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from pfs.client import uffd
from pfs.client.shortcircuit import BULK_THREADS
from pfs.core.config import ProfileSettings, profile_settings
from pfs.loader import pool
from pfs.loader.arrivals import Arrivals
from pfs.loader.buffers import address, populate

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
HEADER_PROBE = 64 << 10  # first read of a shard: the length and, usually, the whole header
ALIGN = 8  # region buffers start at multiples of this (relative to the data section)
POPULATE_THREADS = 1  # beside the reads' own workers (io_uring, the client's threads)

# safetensors dtype -> (itemsize, numpy dtype name, torch dtype attribute)
DTYPES: dict[str, tuple[int, str, str]] = {
    "BOOL": (1, "bool", "bool"),
    "U8": (1, "uint8", "uint8"),
    "I8": (1, "int8", "int8"),
    "I16": (2, "int16", "int16"),
    "U16": (2, "uint16", "uint16"),
    "F16": (2, "float16", "float16"),
    "BF16": (2, "bfloat16", "bfloat16"),
    "I32": (4, "int32", "int32"),
    "U32": (4, "uint32", "uint32"),
    "F32": (4, "float32", "float32"),
    "F64": (8, "float64", "float64"),
    "I64": (8, "int64", "int64"),
    "U64": (8, "uint64", "uint64"),
    "F8_E4M3": (1, "float8_e4m3fn", "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2", "float8_e5m2"),
    "F8_E4M3FNUZ": (1, "float8_e4m3fnuz", "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (1, "float8_e5m2fnuz", "float8_e5m2fnuz"),
    "C64": (8, "complex64", "complex64"),
}
# numpy stand-ins (same bits) for types numpy lacks when ml_dtypes is absent
_RAW = {1: "uint8", 2: "uint16"}

SplitRule = int | Callable[[str, tuple[int, ...], int, int], Any]
Landed = Callable[[Any, int, int], None]  # (file handle, file offset, bytes)
OnTensor = Callable[[str, Any], None]


class CheckpointError(ValueError):
    """A safetensors file or index that is malformed, truncated or inconsistent."""

    def __init__(self, filename: str, msg: str) -> None:
        self.filename = filename
        super().__init__(f"{filename}: {msg}")


@dataclass
class LoadStats:
    """Filled by :func:`load_safetensors` when passed as ``stats``."""

    files: int = 0
    tensors: int = 0
    bytes: int = 0  # bytes of the returned tensors
    read_bytes: int = 0  # bytes read from storage (merging may read small gaps)
    requests: int = 0
    seconds: float = 0.0
    engine: str = ""
    # told the bytes to read once they are planned (``set_total(n)``), then each read's
    # bytes as it completes (``add(n)``): a progress bar (pfs/tools/output.py's Progress)
    progress: Any = field(default=None, repr=False, compare=False)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


# -- headers ------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class Shard:
    name: str  # as shown in errors
    path: str
    size: int
    data_start: int = 0
    tensors: list[TensorInfo] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    handle: Any = None


def header_length(shard: str, head: bytes, size: int) -> int:
    if size < 8 or len(head) < 8:
        raise CheckpointError(shard, f"{size} bytes is too small for a safetensors file "
                                     "(no 8-byte header length)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER:
        raise CheckpointError(shard, f"corrupt header: header length {n} exceeds the "
                                     f"{MAX_HEADER}-byte limit")
    if 8 + n > size:
        raise CheckpointError(shard, f"truncated or corrupt: header length {n} runs past "
                                     f"the end of the file ({size} bytes)")
    return n


def parse_header(shard: str, raw: bytes, size: int) -> tuple[list[TensorInfo], dict[str, str]]:
    """Tensors of one file (absolute offsets), checked as safetensors checks them."""
    data_start = 8 + len(raw)
    try:
        text = raw.decode("utf-8")
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(shard, f"corrupt header: not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(shard, "corrupt header: the JSON is not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise CheckpointError(shard, "corrupt header: __metadata__ must map strings to strings")
    tensors: list[TensorInfo] = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise CheckpointError(shard, f"corrupt header: entry {name!r} is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPES:
            raise CheckpointError(shard, f"tensor {name!r}: unknown dtype {dtype!r}; "
                                         f"known: {', '.join(DTYPES)}")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise CheckpointError(shard, f"corrupt header: tensor {name!r} has shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise CheckpointError(shard, f"corrupt header: tensor {name!r} has data_offsets "
                                         f"{offs!r}")
        want = math.prod(shape) * DTYPES[dtype][0]
        if offs[1] - offs[0] != want:
            raise CheckpointError(shard, f"corrupt header: tensor {name!r} ({dtype} "
                                         f"{tuple(shape)}) needs {want} bytes but its "
                                         f"data_offsets {offs} span {offs[1] - offs[0]}")
        tensors.append(TensorInfo(name, dtype, tuple(shape), data_start + offs[0],
                                  data_start + offs[1]))
    tensors.sort(key=lambda t: (t.begin, t.end))
    prev_end, prev_name = data_start, None
    for t in tensors:
        if t.begin < prev_end and t.nbytes:
            raise CheckpointError(shard, f"corrupt header: tensor {t.name!r} overlaps "
                                         f"{prev_name!r}")
        prev_end, prev_name = max(prev_end, t.end), t.name
    if prev_end > size:
        raise CheckpointError(shard, f"truncated: the tensors need {prev_end} bytes but the "
                                     f"file has {size} ({prev_end - size} missing)")
    return tensors, meta


# -- tensor parallelism -------------------------------------------------------------
def _rule_for(name: str, split: Mapping[str, SplitRule] | None) -> SplitRule | None:
    if not split:
        return None
    if name in split:
        return split[name]
    for pattern, rule in split.items():
        if fnmatch.fnmatchcase(name, pattern):
            return rule
    return None


def slice_of(t: TensorInfo, rule: SplitRule | None, rank: int, size: int
             ) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of rank's part of ``t``, or None for the whole tensor.

    A rule is a dim (``0``, ``1``, negative counts from the end): the dim is cut into
    ``size`` balanced parts (the first ``n % size`` ranks get one more), as
    ``torch.tensor_split`` and ``numpy.array_split`` cut. A callable rule
    ``f(name, shape, rank, size)`` returns a dim, an explicit ``(dim, start, stop)``, or
    None (every rank gets the whole tensor)."""
    if rule is None:
        return None
    got = rule(t.name, t.shape, rank, size) if callable(rule) else rule
    if got is None:
        return None
    if isinstance(got, tuple):
        dim, start, stop = got
    else:
        dim, start, stop = int(got), -1, -1
    ndim = len(t.shape)
    if not -ndim <= dim < ndim:
        raise ValueError(f"tensor {t.name!r} of shape {t.shape}: cannot split along dim {dim}")
    dim %= ndim
    if start < 0:
        n = t.shape[dim]
        base, extra = divmod(n, size)
        start = rank * base + min(rank, extra)
        stop = start + base + (1 if rank < extra else 0)
    if not 0 <= start <= stop <= t.shape[dim]:
        raise ValueError(f"tensor {t.name!r}: slice [{start}:{stop}] of dim {dim} is outside "
                         f"its size {t.shape[dim]}")
    return dim, start, stop


def slice_ranges(t: TensorInfo, dim: int, start: int, stop: int) -> list[tuple[int, int]]:
    """File ranges ``(offset, length)`` of ``t[..., start:stop (dim), ...]``, in order,
    touching ranges merged."""
    outer = math.prod(t.shape[:dim])
    inner = math.prod(t.shape[dim + 1:]) * t.itemsize
    row = t.shape[dim] * inner
    piece = (stop - start) * inner
    if piece == 0 or outer == 0:
        return []
    if piece == row:  # the whole dim: one range
        return [(t.begin, outer * row)]
    out: list[tuple[int, int]] = []
    for o in range(outer):
        off = t.begin + o * row + start * inner
        out.append((off, piece))
    return out


# -- sources ------------------------------------------------------------------------
class _Reader:
    """Where shard bytes come from. Subclasses: local files, pfs files."""

    engine_name = ""

    async def open(self, path: str, bulk: bool = True) -> tuple[Any, int]:
        """A handle of ``path`` and its size; ``bulk``: it will be read whole."""
        raise NotImplementedError

    async def read_many(self, ops: list[tuple[Any, int, memoryview]],
                        progress: Any = None, landed: Landed | None = None,
                        mapped: frozenset[int] = frozenset(),
                        filled: frozenset[int] = frozenset()) -> list[int]:
        """Read every ``(handle, offset, buffer)`` at once; ``progress.add(n)`` as
        reads complete; ``landed(handle, off, n)`` (where the reader knows: the pfs
        bulk reads) as the ``n`` file bytes at ``off`` are in their buffer. ``mapped``:
        indexes of ops whose buffers lie in a :func:`_reserve` mapping, for a reader
        that can map its bytes there (:meth:`map_unit`). ``filled``: indexes of ops
        whose buffers lie in fresh memory registered with :mod:`pfs.client.uffd`
        (:meth:`can_fill`)."""
        raise NotImplementedError

    def can_fill(self, handle: Any) -> bool:
        """Whether fresh buffers of ``handle`` can be filled by ``UFFDIO_COPY``
        (:func:`_fill_buffers`): every byte of the file is read by the reader itself,
        page for page as the file lays them out."""
        return False

    def map_unit(self, handle: Any) -> int | None:
        """The span (bytes) whose multiples a zero-copy load of ``handle`` maps, or
        None: this file's bytes cannot be mapped, read them."""
        return None

    async def close(self, handle: Any) -> None:
        raise NotImplementedError

    async def exists(self, path: str) -> bool:
        raise NotImplementedError

    async def is_dir(self, path: str) -> bool:
        raise NotImplementedError

    async def listdir(self, path: str) -> list[str]:
        raise NotImplementedError

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path)

    def aclose(self) -> None:
        pass


class _LocalReader(_Reader):
    def __init__(self, settings: ProfileSettings) -> None:
        from pfs.core.engine import get_engine, uring_unavailable

        name = settings.engine
        if name == "uring" and uring_unavailable() is not None:
            name = "posix"
        opts: dict[str, int] = {"queue_depth": settings.queue_depth}
        if name == "uring":
            opts["chunk"] = settings.chunk
        self.engine = get_engine(name, **opts)
        self.engine_name = name
        self.chunk = settings.chunk

    async def open(self, path: str, bulk: bool = True) -> tuple[int, int]:
        return await trio.to_thread.run_sync(_open_local, path)

    async def read_many(self, ops: list[tuple[Any, int, memoryview]],
                        progress: Any = None, landed: Landed | None = None,
                        mapped: frozenset[int] = frozenset(),
                        filled: frozenset[int] = frozenset()) -> list[int]:
        from pfs.core.engine import Op

        batch: list[Op] = []
        where: list[tuple[int, int]] = []  # (op index, offset in its buffer) per piece
        for i, (fd, off, view) in enumerate(ops):
            # posix runs an op per thread: cut large ones so threads share them too
            step = self.chunk if self.engine_name == "posix" else max(len(view), 1)
            for s in range(0, len(view), step):
                batch.append(Op(fd, off + s, min(step, len(view) - s), view[s:s + step]))
                where.append((i, s))
        counts = await self.engine.submit(batch)
        out = [0] * len(ops)
        short: set[int] = set()
        for (i, _s), n, op in zip(where, counts, batch, strict=True):
            if i not in short:
                out[i] += n
                if n < op.length:
                    short.add(i)
        if progress is not None:  # one batch: the engine reports it whole
            progress.add(sum(out))
        return out

    async def close(self, handle: Any) -> None:
        os.close(handle)

    async def exists(self, path: str) -> bool:
        return await trio.to_thread.run_sync(os.path.exists, path)

    async def is_dir(self, path: str) -> bool:
        return await trio.to_thread.run_sync(os.path.isdir, path)

    async def listdir(self, path: str) -> list[str]:
        return await trio.to_thread.run_sync(os.listdir, path)

    def aclose(self) -> None:
        self.engine.close()


def _open_local(path: str) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return fd, os.fstat(fd).st_size


class _PfsReader(_Reader):
    engine_name = "pfs"

    def __init__(self, aclient: Any) -> None:
        self.client = aclient

    async def open(self, path: str, bulk: bool = True) -> tuple[Any, int]:
        f = await self.client.open(path, "rb")
        if not bulk:  # the index: one small read, no descriptors to ask for first
            return f, f.size
        try:
            # every stripe's local descriptor now, while the header is read: the bulk
            # reads then find them held instead of each asking within a 1 s deadline
            await f.open_local()
        except BaseException:
            with trio.CancelScope(shield=True):
                await f.close()
            raise
        return f, f.size

    async def read_many(self, ops: list[tuple[Any, int, memoryview]],
                        progress: Any = None, landed: Landed | None = None,
                        mapped: frozenset[int] = frozenset(),
                        filled: frozenset[int] = frozenset()) -> list[int]:
        """Each file's reads in one call (``File.pread_many``): its local objects are
        read in bulk on threads, by object, each chunk verified as it is read (or, for
        the ``mapped`` ops, mapped and verified in place; for the ``filled`` ones,
        copied from the page cache into fresh pages and verified in place)."""
        out = [0] * len(ops)
        by_file: dict[tuple[int, int], tuple[Any, list[int]]] = {}
        for i, (f, _off, _view) in enumerate(ops):
            mode = 1 if i in mapped else 2 if i in filled else 0
            by_file.setdefault((id(f), mode), (f, []))[1].append(i)
        lock = threading.Lock()
        # one pool of reader threads for every shard: the files are read one after
        # another, front to back, rather than all at once by 4 threads each
        threads = trio.CapacityLimiter(BULK_THREADS)

        def done(f: Any, off: int, n: int) -> None:  # from the client's worker threads
            if progress is not None:
                with lock:
                    progress.add(n)
            if landed is not None:
                landed(f, off, n)

        async def one(f: Any, idx: list[int], mode: int) -> None:
            tell = None if progress is None and landed is None else partial(done, f)
            got = await f.pread_many([(ops[i][1], ops[i][2]) for i in idx], done=tell,
                                     limiter=threads, mapped=mode == 1, fill=mode == 2)
            for i, n in zip(idx, got, strict=True):
                out[i] = n

        async with trio.open_nursery() as n:
            for (_id, mode), (f, idx) in by_file.items():
                n.start_soon(one, f, idx, mode)
        return out

    def can_fill(self, handle: Any) -> bool:
        """A file whose every stripe this handle holds a short-circuit descriptor of,
        with a page-multiple stripe unit, where the kernel has userfaultfd."""
        return (handle.layout.unit % mmap.PAGESIZE == 0
                and handle.local_stripes() == handle.layout.count and uffd.available())

    def map_unit(self, handle: Any) -> int | None:
        """The stripe unit, when it is a multiple of the page size and the handle holds
        a short-circuit descriptor of at least one stripe."""
        unit = handle.layout.unit
        if unit % mmap.PAGESIZE or not handle.local_stripes():
            return None
        return int(unit)

    async def close(self, handle: Any) -> None:
        await handle.close()

    async def exists(self, path: str) -> bool:
        return bool(await self.client.exists(path))

    async def is_dir(self, path: str) -> bool:
        try:
            return bool((await self.client.stat(path)).is_dir())
        except FileNotFoundError:
            return False

    async def listdir(self, path: str) -> list[str]:
        return list(await self.client.listdir(path))

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def dirname(self, path: str) -> str:
        return posixpath.dirname(path)


async def _shard_paths(reader: _Reader, source: str) -> tuple[list[str], str | None]:
    """The shard files of ``source`` (a file, an index, or a directory) and the index."""
    if await reader.is_dir(source):
        index = reader.join(source, INDEX_NAME)
        try:  # opened, not looked up first: one round trip fewer on pfs
            return await _from_index(reader, index), index
        except FileNotFoundError:  # (its shards are not opened here: only the index)
            pass
        names = sorted(n for n in await reader.listdir(source) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(errno.ENOENT, f"no {INDEX_NAME} and no *.safetensors "
                                                  "files in the directory", source)
        return [reader.join(source, n) for n in names], None
    if source.endswith(".json"):
        return await _from_index(reader, source), source
    if not await reader.exists(source):
        raise FileNotFoundError(errno.ENOENT, "no such checkpoint", source)
    return [source], None


async def _from_index(reader: _Reader, index: str) -> list[str]:
    h, size = await reader.open(index, bulk=False)
    try:
        buf = bytearray(size)
        n = (await reader.read_many([(h, 0, memoryview(buf))]))[0]
    finally:
        await reader.close(h)
    try:
        doc = json.loads(bytes(buf[:n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(index, f"not valid JSON ({exc})") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise CheckpointError(index, "no weight_map of tensor names to shard files")
    base = reader.dirname(index)
    names = list(dict.fromkeys(wmap.values()))  # first-seen order, no repeats
    for fname in names:
        if os.path.isabs(fname) or ".." in fname.split("/"):
            raise CheckpointError(index, f"shard {fname!r} is not a plain file name")
    # not looked up here: opening them (all at once, beside their headers) tells
    return [reader.join(base, fname) for fname in names]


async def _read_header(reader: _Reader, path: str) -> Shard:
    handle, size = await reader.open(path)
    try:
        return await _parse_shard(reader, path, handle, size)
    except BaseException:
        with trio.CancelScope(shield=True):
            await reader.close(handle)
        raise


async def _parse_shard(reader: _Reader, path: str, handle: Any, size: int) -> Shard:
    shard = Shard(path, path, size, handle=handle)
    probe = bytearray(min(size, HEADER_PROBE))
    got = (await reader.read_many([(handle, 0, memoryview(probe))]))[0] if probe else 0
    n = header_length(path, bytes(probe[:got]), size)
    if 8 + n <= got:
        raw = bytes(probe[8:8 + n])
    else:
        rest = bytearray(8 + n - got)
        more = (await reader.read_many([(handle, got, memoryview(rest))]))[0]
        if more < len(rest):
            raise CheckpointError(path, "truncated while reading the header")
        raw = bytes(probe[8:got]) + bytes(rest)
    shard.data_start = 8 + n
    shard.tensors, shard.metadata = parse_header(path, raw, size)
    return shard


# -- planning -----------------------------------------------------------------------
@dataclass
class _Region:
    shard: Shard
    start: int
    end: int
    members: list[TensorInfo] = field(default_factory=list)
    buf: Any = None  # framework buffer (uint8)


@dataclass
class _Sliced:
    shard: Shard
    info: TensorInfo
    shape: tuple[int, ...]
    ranges: list[tuple[int, int]]
    buf: Any = None


def _plan(shards: list[Shard], names: Any, split: Mapping[str, SplitRule] | None,
          rank: int, size: int, merge_gap: int) -> tuple[list[_Region], list[_Sliced]]:
    regions: list[_Region] = []
    sliced: list[_Sliced] = []
    seen: dict[str, str] = {}
    for sh in shards:
        whole: list[TensorInfo] = []
        for t in sh.tensors:
            if t.name in seen:
                raise CheckpointError(sh.name, f"tensor {t.name!r} is also in {seen[t.name]}")
            seen[t.name] = sh.name
            if names is not None and t.name not in names:
                continue
            if not t.nbytes:  # an empty tensor: nothing to read, no region
                sliced.append(_Sliced(sh, t, t.shape, []))
                continue
            cut = slice_of(t, _rule_for(t.name, split), rank, size) if size > 1 else None
            if cut is None or (cut[1] == 0 and cut[2] == t.shape[cut[0]]):
                whole.append(t)
                continue
            dim, start, stop = cut
            shape = t.shape[:dim] + (stop - start,) + t.shape[dim + 1:]
            sliced.append(_Sliced(sh, t, shape, slice_ranges(t, dim, start, stop)))
        cur: _Region | None = None
        for t in whole:  # sorted by offset
            if cur is not None and t.begin - cur.end <= merge_gap:
                cur.members.append(t)
                cur.end = max(cur.end, t.end)
                continue
            rel = (t.begin - sh.data_start) // ALIGN * ALIGN
            cur = _Region(sh, sh.data_start + rel, t.end, [t])
            regions.append(cur)
    if names is not None:
        missing = set(names) - set(seen)
        if missing:
            raise KeyError(f"tensors not in the checkpoint: {sorted(missing)[:10]}")
    return regions, sliced


# -- frameworks ---------------------------------------------------------------------
class _Numpy:
    name = "numpy"

    def __init__(self) -> None:
        import numpy as np

        self.np = np
        try:
            import ml_dtypes
        except ImportError:
            ml_dtypes = None
        self.ml = ml_dtypes

    def alloc(self, n: int, pad: int = 0) -> tuple[Any, memoryview, bool]:
        if n == 0:
            return self.np.empty(0, dtype=self.np.uint8), memoryview(b""), False
        lease = pool.take(n, pad)  # a freed buffer of an earlier load, or a fresh mapping
        a = self.np.frombuffer(lease.array, dtype=self.np.uint8, count=n)
        return a, lease.view, lease.fresh

    def wrap(self, mm: mmap.mmap) -> Any:
        """A uint8 array over a whole (writable) mapping; it keeps the mapping alive."""
        return self.np.frombuffer(mm, dtype=self.np.uint8)

    def dtype(self, st: str) -> Any:
        size, npname, _ = DTYPES[st]
        if st != "BF16" and not st.startswith("F8"):
            return self.np.dtype(npname)
        if self.ml is not None and hasattr(self.ml, npname):
            return self.np.dtype(getattr(self.ml, npname))
        return self.np.dtype(_RAW[size])

    def view(self, buf: Any, off: int, t: TensorInfo, shape: tuple[int, ...]) -> Any:
        n = math.prod(shape) * t.itemsize
        return buf[off:off + n].view(self.dtype(t.dtype)).reshape(shape)

    def to_device(self, buf: Any, device: str) -> Any:
        raise ValueError(f"device={device!r} needs torch (numpy arrays live in host memory)")


class _Torch:
    name = "torch"

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.pin = device.startswith("cuda")

    def alloc(self, n: int, pad: int = 0) -> tuple[Any, memoryview, bool]:
        """A uint8 buffer of ``n`` bytes (``pad`` bytes into its first page: see
        :func:`pfs.loader.pool.take`), a writable view of it, and whether it is fresh
        memory to fault in (pinned pages are faulted in by their allocator)."""
        if self.pin or n == 0:  # pinned: cudaHostAlloc's own pages
            t = self.torch.empty(n, dtype=self.torch.uint8, pin_memory=self.pin)
            return t, memoryview(t.numpy()).cast("B"), False  # type: ignore[arg-type]
        lease = pool.take(n, pad)  # a freed buffer of an earlier load, or a fresh mapping
        return (self.torch.frombuffer(lease.array, dtype=self.torch.uint8, count=n),
                lease.view, lease.fresh)

    def wrap(self, mm: mmap.mmap) -> Any:
        """A uint8 tensor over a whole (writable) mapping; it keeps the mapping alive."""
        return self.torch.frombuffer(mm, dtype=self.torch.uint8)

    def dtype(self, st: str) -> Any:
        attr = DTYPES[st][2]
        if not hasattr(self.torch, attr):
            raise ValueError(f"torch {self.torch.__version__} has no {attr} for {st}")
        return getattr(self.torch, attr)

    def view(self, buf: Any, off: int, t: TensorInfo, shape: tuple[int, ...]) -> Any:
        dt = self.dtype(t.dtype)
        n = math.prod(shape) * t.itemsize
        if n == 0:
            return self.torch.empty(shape, dtype=dt, device=buf.device)
        if off % t.itemsize == 0:
            return buf[off:off + n].view(dt).view(shape)
        # an odd offset (a file not written by safetensors): one copy for this tensor
        return buf[off:off + n].clone().view(dt).view(shape)

    def to_device(self, buf: Any, device: str) -> Any:
        return buf.to(device, non_blocking=True)


def _framework(framework: str | None, device: str) -> _Numpy | _Torch:
    if framework not in (None, "torch", "numpy"):
        raise ValueError(f"framework must be 'torch' or 'numpy', not {framework!r}")
    if framework == "numpy":
        if device != "cpu":
            raise ValueError(f"device={device!r} needs framework='torch'")
        return _Numpy()
    try:
        fw = _Torch(device)
    except ImportError:
        if framework == "torch":
            raise
        if device != "cpu":
            raise ValueError(f"device={device!r} needs torch (pip install torch)") from None
        return _Numpy()
    if device.startswith("cuda"):
        from pfs.client.device import GpuUnavailable, libcuda_missing

        why = libcuda_missing()
        if why is not None:
            raise GpuUnavailable(why, f"device={device!r}")
        if not fw.torch.cuda.is_available():
            raise GpuUnavailable("a CUDA build of torch",
                                 f"torch {fw.torch.__version__} cannot reach a GPU "
                                 f"for device={device!r}")
    elif device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda:N', not {device!r}")
    return fw


# -- the load -----------------------------------------------------------------------
async def _read_gds(fw: _Torch, device: str, regions: list[_Region],
                    sliced: list[_Sliced]) -> None:
    """Regions and slices of local shards read by kvikio into device buffers."""
    from pfs.loader.gpu import GDS_TASK_SIZE, require_gds

    kvikio = require_gds()
    torch = fw.torch
    jobs: list[tuple[str, int, int, Any]] = []  # path, offset, length, device view
    for r in regions:
        r.buf = torch.empty(r.end - r.start, dtype=torch.uint8, device=device)
        if r.end > r.start:
            jobs.append((r.shard.path, r.start, r.end - r.start, r.buf))
    for s in sliced:
        s.buf = torch.empty(math.prod(s.shape) * s.info.itemsize, dtype=torch.uint8,
                            device=device)
        pos = 0
        for off, length in s.ranges:
            jobs.append((s.shard.path, off, length, s.buf[pos:pos + length]))
            pos += length

    def run() -> None:
        files: dict[str, Any] = {}
        try:
            futures = []
            for path, off, length, view in jobs:
                f = files.get(path)
                if f is None:
                    f = files[path] = kvikio.CuFile(path, "r")
                futures.append((path, length, f.pread(view, length, off,
                                                      task_size=GDS_TASK_SIZE)))
            for path, length, fu in futures:
                got = int(fu.get())
                if got < length:
                    raise CheckpointError(path, f"truncated: read {got} of {length} bytes")
        finally:
            for f in files.values():
                f.close()

    await trio.to_thread.run_sync(run)


def _register(view: memoryview, registered: list[tuple[int, int]]) -> bool:
    """Register the fresh pages under ``view`` with the userfaultfd (the reader then
    fills them page for page, :mod:`pfs.client.filled`); noted in ``registered``."""
    page = mmap.PAGESIZE
    start = address(view) // page * page
    length = -(-(address(view) + len(view)) // page) * page - start
    if not uffd.register(start, length):
        return False
    registered.append((start, length))
    return True


def _unregister(registered: list[tuple[int, int]]) -> None:
    """The registered buffers plain memory again (a page still missing: zeros), each
    one even if another fails (the load's own error, if any, is the one raised)."""
    for addr, length in registered:
        try:
            uffd.unregister(addr, length)
        except OSError as exc:
            log.warning("loader buffer at %#x stays registered: %s", addr, exc)


async def _read_populating(reader: _Reader, ops: list[tuple[Any, int, memoryview]],
                           views: list[memoryview], progress: Any,
                           landed: Landed | None = None,
                           mapped: frozenset[int] = frozenset(),
                           filled: frozenset[int] = frozenset()) -> list[int]:
    """``reader.read_many(ops)`` while a thread faults the fresh buffers in from their
    far end (buffers.py): the reads, which start at the front, copy into pages already
    there instead of faulting each one in; the thread stops once the reads are done."""
    fresh = [(address(v), len(v)) for v in views if len(v)]
    if not fresh:
        return await reader.read_many(ops, progress, landed, mapped, filled)
    stop = threading.Event()
    counts: list[int] = []
    async with trio.open_nursery() as n:
        n.start_soon(partial(trio.to_thread.run_sync, populate, fresh, POPULATE_THREADS, stop))
        try:
            counts = await reader.read_many(ops, progress, landed, mapped, filled)
        finally:
            stop.set()
    return counts


def _reserve(n: int) -> mmap.mmap:
    """A private anonymous mapping for a zero-copy shard: the reader maps object pages
    over it (MAP_FIXED), and reads what it cannot map into it. Unmapped, all of it,
    when the last tensor over it is freed (it is no pool buffer: its pages are the
    objects', or faulted in by the reads that needed them)."""
    return mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _map_spans(regions: list[_Region], unit: int, size: int) -> list[tuple[int, int]]:
    """The file spans ``[a, b)`` a zero-copy load of one shard's ``regions`` reads:
    each region widened to multiples of ``unit`` (the object pages line up with the
    mapping's pages only from a unit's start), capped at the file's size, overlapping
    or touching ones merged."""
    spans: list[tuple[int, int]] = []
    for r in sorted(regions, key=lambda r: r.start):
        a = r.start // unit * unit
        b = min(size, -(-r.end // unit) * unit)
        if spans and a <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    return spans


def _mapped_ops(reader: _Reader, fw: _Numpy | _Torch, regions: list[_Region]
                ) -> tuple[list[tuple[Any, int, memoryview]], list[_Region]]:
    """Zero-copy: for each shard the reader can map, one :func:`_reserve` mapping
    over its regions' spans (file offset ``f`` at ``base + f - lo``), the regions'
    buffers views of it; the ops that fill it, and the regions left to read."""
    by_shard: dict[int, list[_Region]] = {}
    for r in regions:
        by_shard.setdefault(id(r.shard), []).append(r)
    ops: list[tuple[Any, int, memoryview]] = []
    rest: list[_Region] = []
    for rs in by_shard.values():
        sh = rs[0].shard
        unit = reader.map_unit(sh.handle)
        if unit is None:
            rest += rs
            continue
        spans = _map_spans(rs, unit, sh.size)
        lo = spans[0][0]
        mm = _reserve(spans[-1][1] - lo)
        whole = fw.wrap(mm)
        view = memoryview(mm)
        for a, b in spans:
            ops.append((sh.handle, a, view[a - lo:b - lo]))
        for r in rs:
            r.buf = whole[r.start - lo:r.end - lo]
    return ops, rest


async def _load(reader: _Reader, source: str, fw: _Numpy | _Torch, device: str,
                names: Any, split: Mapping[str, SplitRule] | None, rank: int, size: int,
                merge_gap: int, stats: LoadStats, gds_ok: bool = False,
                on_tensor: OnTensor | None = None, zero_copy: bool = False) -> dict[str, Any]:
    paths, index = await _shard_paths(reader, source)
    gds = gds_ok and isinstance(reader, _LocalReader) and isinstance(fw, _Torch)
    regions_on_device = False
    arrivals: Arrivals | None = None
    early: dict[str, Any] = {}  # tensors handed to on_tensor during the reads
    shards: list[Shard] = [None] * len(paths)  # type: ignore[list-item]
    registered: list[tuple[int, int]] = []  # fresh buffers filled by UFFDIO_COPY
    try:
        async def head(i: int, p: str) -> None:
            try:
                shards[i] = await _read_header(reader, p)
            except FileNotFoundError:
                if index is None:
                    raise
                raise FileNotFoundError(errno.ENOENT, f"shard {p.rsplit('/', 1)[-1]!r} "
                                                      f"named by {index} is missing", p) from None

        async with trio.open_nursery() as n:
            for i, p in enumerate(paths):
                n.start_soon(head, i, p)
        regions, sliced = _plan(shards, names, split, rank, size, merge_gap)
        ops: list[tuple[Any, int, memoryview]] = []
        owners: list[tuple[str, int]] = []  # (file, bytes it should give)
        views: list[memoryview] = []  # fresh host buffers to fault in (pool.py)
        if gds:  # local files straight into device memory (kvikio), no host copy
            assert isinstance(fw, _Torch)
            await _read_gds(fw, device, regions, sliced)
            regions_on_device = True
        to_read = regions
        mapped: frozenset[int] = frozenset()
        if zero_copy and device == "cpu" and not gds:
            names_of = {id(sh.handle): sh.name for sh in shards}
            ops, to_read = _mapped_ops(reader, fw, regions)
            owners += [(names_of[id(h)], len(v)) for h, _o, v in ops]
            mapped = frozenset(range(len(ops)))
        can_fill: dict[int, bool] = {}
        filling: list[int] = []  # ops whose fresh buffers are registered (uffd)
        for r in to_read if not gds else []:
            fill = device == "cpu" and can_fill.setdefault(
                id(r.shard), reader.can_fill(r.shard.handle))
            # a buffer to fill lies as the file does within pages (page-for-page copies)
            r.buf, view, fresh = fw.alloc(r.end - r.start, r.start % mmap.PAGESIZE
                                          if fill else 0)
            if fill and fresh and len(view) and _register(view, registered):
                filling.append(len(ops))
            elif fresh:
                views.append(view)
            if len(view):
                ops.append((r.shard.handle, r.start, view))
                owners.append((r.shard.name, len(view)))
        for s in sliced if not gds else []:
            s.buf, view, fresh = fw.alloc(math.prod(s.shape) * s.info.itemsize)
            if fresh:
                views.append(view)
            pos = 0
            for off, length in s.ranges:
                ops.append((s.shard.handle, off, view[pos:pos + length]))
                owners.append((s.shard.name, length))
                pos += length
        if stats.progress is not None:
            stats.progress.set_total(sum(len(v) for _h, _o, v in ops))
        if on_tensor is not None and device == "cpu" and not gds:
            arrivals = _arrivals(fw, regions, on_tensor, early)
        counts = await _read_populating(reader, ops, views, stats.progress,
                                        arrivals.landed if arrivals is not None else None,
                                        mapped, frozenset(filling))
        for (fname, want), got in zip(owners, counts, strict=True):
            if got < want:
                raise CheckpointError(fname, f"truncated: read {got} of {want} bytes "
                                             "(the file shrank while loading?)")
    finally:
        _unregister(registered)
        for sh in shards:
            if sh is not None and sh.handle is not None:
                with trio.CancelScope(shield=True):
                    await reader.close(sh.handle)
    stats.files = len(paths)
    stats.requests = len(ops)
    stats.read_bytes = sum(len(v) for _h, _o, v in ops)
    stats.engine = "gds" if gds else reader.engine_name
    if arrivals is not None:
        arrivals.rest()  # what landed with no word from the reader
    out: dict[str, Any] = {}
    host = device == "cpu" or regions_on_device
    for r in regions:
        buf = r.buf if host else fw.to_device(r.buf, device)
        for t in r.members:
            had = early.get(t.name)
            out[t.name] = had if had is not None else fw.view(buf, t.begin - r.start, t, t.shape)
            if arrivals is None and on_tensor is not None:
                on_tensor(t.name, out[t.name])
    for s in sliced:
        buf = s.buf if host else fw.to_device(s.buf, device)
        out[s.info.name] = fw.view(buf, 0, s.info, s.shape)
        if on_tensor is not None:
            on_tensor(s.info.name, out[s.info.name])
    stats.tensors = len(out)
    stats.bytes = sum(t.nbytes for r in regions for t in r.members) + sum(
        math.prod(s.shape) * s.info.itemsize for s in sliced)
    return out


def _arrivals(fw: _Numpy | _Torch, regions: list[_Region], on_tensor: OnTensor,
              early: dict[str, Any]) -> Arrivals:
    """Hands each whole tensor to ``on_tensor`` once its bytes are in (read and
    verified): during the reads where the reader says what landed (pfs bulk reads),
    else when they are done. The view is kept in ``early`` for the result."""
    owner = {id(t): r for r in regions for t in r.members}

    def ready(t: TensorInfo) -> None:
        r = owner[id(t)]
        early[t.name] = view = fw.view(r.buf, t.begin - r.start, t, t.shape)
        on_tensor(t.name, view)

    return Arrivals([(r.shard.handle, t.begin, t.end, t) for r in regions
                     for t in r.members], ready)


def _check_tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    if tp_rank is None and tp_size is None:
        return 0, 1
    if tp_rank is None or tp_size is None:
        raise ValueError("give both tp_rank and tp_size")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} must be in [0, tp_size={tp_size})")
    return tp_rank, tp_size


async def aload_safetensors(source: str, device: str = "cpu", client: Any = None, *,
                            tp_rank: int | None = None, tp_size: int | None = None,
                            split: Mapping[str, SplitRule] | None = None,
                            names: Sequence[str] | None = None, framework: str | None = None,
                            profile: str = "load", merge_gap: int | None = None,
                            stats: LoadStats | None = None,
                            on_tensor: OnTensor | None = None,
                            zero_copy: bool = False) -> dict[str, Any]:
    """:func:`load_safetensors` inside a trio run; ``client`` is an async client."""
    rank, size = _check_tp(tp_rank, tp_size)
    settings = profile_settings(profile)
    gap = settings.merge_gap if merge_gap is None else merge_gap
    fw = _framework(framework, device)
    st = stats if stats is not None else LoadStats()
    wanted = set(names) if names is not None else None
    reader: _Reader = _PfsReader(client) if client is not None else _LocalReader(settings)
    gds_ok = False
    if device.startswith("cuda") and settings.gds and client is None:
        from pfs.loader.gpu import kvikio_missing

        gds_ok = kvikio_missing() is None  # else: pinned host buffers + copy
    t0 = time.perf_counter()
    try:
        out = await _load(reader, os.fspath(source), fw, device, wanted, split, rank, size,
                          gap, st, gds_ok, on_tensor, zero_copy)
    except BaseExceptionGroup as group:  # parallel reads: report the (first) error itself
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        if isinstance(leaf, Exception):
            raise leaf from None
        raise
    finally:
        reader.aclose()
    st.seconds = time.perf_counter() - t0
    return out


def load_safetensors(source: str | os.PathLike[str], device: str = "cpu", client: Any = None,
                     tp_rank: int | None = None, tp_size: int | None = None,
                     split: Mapping[str, SplitRule] | None = None, *,
                     names: Sequence[str] | None = None, framework: str | None = None,
                     profile: str = "load", merge_gap: int | None = None,
                     config: Any = None, meta: str | None = None,
                     stats: LoadStats | None = None,
                     on_tensor: OnTensor | None = None,
                     zero_copy: bool = False) -> dict[str, Any]:
    """Load a safetensors checkpoint into ``{name: tensor}``.

    ``source``: a local file, a local directory (with ``model.safetensors.index.json``, or
    else every ``*.safetensors`` in it), an index file; or the same on pfs — with
    ``client`` (from :func:`pfs.connect`), or as ``pfs:///path`` (connecting with
    ``config``/``meta``/``$PFS_CONFIG``).

    ``device``: ``"cpu"`` or ``"cuda:N"`` (torch; local files with kvikio installed are
    read by GDS straight into device buffers, anything else lands in pinned host buffers
    and is copied region by region). ``tp_rank``/``tp_size``/``split``: tensor-parallel
    slices, see :func:`slice_of`; tensors no rule matches are loaded whole.
    ``names``: load only these. ``framework``: ``"torch"`` or ``"numpy"`` (default: torch
    if installed). ``merge_gap``: bytes of unwanted data worth reading to merge two ranges
    (default: the profile's). ``stats``: a :class:`LoadStats` to fill.
    ``on_tensor(name, tensor)``: called once per tensor as soon as all its bytes are in
    memory and verified, before this returns, so a caller can start with the first
    tensors while the rest load (short-circuit pfs reads hand them out as their chunks
    land, from the loader's worker threads, one call at a time; other sources when
    their reads are done). The tensor is the one the result holds. If the load then
    fails, what was handed out is right, but the load raises.

    Memory: CPU tensors are views of buffers that go back to a per-process pool when
    the last tensor over each is freed; the process's next load reads into them
    without faulting pages in again (:mod:`pfs.loader.pool`; unused ones are unmapped
    after 30 s, or at once by ``pfs.loader.pool.release()``).

    ``zero_copy`` (opt-in; pfs sources, CPU): where a shard's stripes lie on data servers
    of this host, its tensors are copy-on-write mappings of their object files (the
    page cache itself: no copy, no fresh memory to fault in and zero), every checksum
    block verified in place before this returns; stripes that are not local (and
    blocks that do not verify, which are read from the other replicas or fail with
    EIO) are read into the same mapping the usual way. Like safetensors' ``safe_open``
    or ``torch.load(mmap=True)``, the tensors then alias the stored file: writing to a
    tensor is private to the process, but a later write of the file through pfs shows
    in the pages the process has not written (unverified), and a truncation of the
    file below a tensor makes touching it raise SIGBUS. Use it for checkpoints that are
    not changed while loaded (written once, then served); the default copies.

    Errors: :class:`CheckpointError` (a ValueError naming the file) for corrupt headers
    and truncated files, FileNotFoundError naming a missing shard."""
    src = os.fspath(source)
    own_client = None
    if client is None and src.startswith("pfs://"):
        from pfs.client.sync import Client  # only for pfs:// paths without a client

        own_client = client = Client.connect(config=config, meta=meta)
    if src.startswith("pfs://"):
        src = "/" + src[len("pfs://"):].lstrip("/")
    try:
        kwargs = dict(device=device, tp_rank=tp_rank, tp_size=tp_size, split=split,
                      names=names, framework=framework, profile=profile, merge_gap=merge_gap,
                      stats=stats, on_tensor=on_tensor, zero_copy=zero_copy)
        aio = getattr(client, "aio", None) if client is not None else None
        if client is not None and aio is None:
            raise TypeError("client must be a pfs.connect() client; inside trio use "
                            "aload_safetensors with an async client")
        # the result goes back through a box, not as the call's return value: trio
        # keeps a run's return value in a reference cycle (its runner's outcome), so
        # the tensors, once the caller frees them, would wait for the garbage collector
        # instead of handing their buffers back to the next load (pool.py)
        box: dict[str, dict[str, Any]] = {}

        async def go() -> None:
            box["out"] = await aload_safetensors(src, client=aio, **kwargs)  # type: ignore[arg-type]

        if client is None:
            trio.run(go)
        else:
            client._run(go)
        return box.pop("out")
    finally:
        if own_client is not None:
            own_client.close()

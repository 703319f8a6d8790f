"""``pfs bench io500``: the twelve scored IO500 phases, run against a directory (a pfs
FUSE mount or any POSIX path) or against pfs through the native client.

Phases, in IO500's order, with IO500's definitions (io500 ``standard`` mode):

  ior-easy-write      a file per process, 2 MiB transfers, fsync at close
  mdtest-easy-write   empty files, a directory per process
  (timestamp)         the reference file for find's ``-newer``
  ior-hard-write      one shared file, 47,008-byte transfers interleaved between processes
                      (segment s of rank r at ``(s * nprocs + r) * 47008``), fsync at close
  mdtest-hard-write   3,901-byte files, all processes in one shared directory
  find                a search over everything written: ``-newer timestamp -size 3901c
                      -name *01*``; the rate is entries examined per second
  ior-easy-read       each process reads its neighbour's file (IOR ``-C``)
  mdtest-easy-stat    each process stats its neighbour's files (mdtest ``-N 1``)
  ior-hard-read       each process reads its neighbour's segments
  mdtest-hard-stat
  mdtest-easy-delete
  mdtest-hard-read    open, read 3,901 bytes, close
  mdtest-hard-delete

Write phases run until the stonewall time, then every process keeps writing until it has
done as much as the process that did most (IO500's stonewall wear-out), so every
process's share is the same and the read, stat and delete phases find it all. Sizes are
caps (``--easy-size``, ``--hard-segments``, ``--easy-files``, ``--hard-files``): a write
phase that reaches its cap before the stonewall is shorter than the stonewall, which makes
the run invalid, as in IO500.

Scoring: bandwidth phases in GiB/s (2^30 B/s), metadata phases and find in kIOPS; each
group's geometric mean over its phases with a positive score; score = sqrt(bw x md).

A run is flagged ``[INVALID]`` when IO500's rules are not met: a write phase shorter than
the stonewall or than 300 s (so every ``--quick`` run is invalid, as any short IO500 run
is), a phase scoring 0, I/O errors, read-back that fails ``--verify``, find not finding
exactly the files it should, or a phase not run.

Parallelism: ``-n N`` processes on this node (rank 0 is this process), or ``mpirun -np N
pfs bench io500 ...`` with mpi4py (``pip install 'pfs[mpi]'``), detected from the MPI
environment or forced with ``--mpi``.

Output: IO500's layout on stdout (one ``[RESULT]`` line per phase, then ``[SCORE ]``),
and in the results directory ``result_summary.txt`` (the same lines), ``result.txt``
(io500's per-phase ini sections) and ``result.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import stat as statmod
import struct
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pfs.bench.common import drop_caches, log, machine_info, parse_size

VERSION = "pfs-io500-1.0"
GiB = 1 << 30
EASY_TRANSFER = 2 << 20  # ior-easy: -t 2m -F
HARD_TRANSFER = 47008  # ior-hard: -t 47008 -b 47008, shared file
HARD_FILE_SIZE = 3901  # mdtest-hard: -w 3901 -e 3901
MIN_WRITE_S = 300.0  # IO500's minimum runtime of a write phase
FIND_NAME = "01"  # find -name "*01*"
HEADER = struct.Struct("<QQQ")  # stamp of every transfer / file: offset, writer rank + 1, seed

# name, score group (bw / md / None), whether the phase is a stonewalled write
PHASES: list[tuple[str, str | None, bool]] = [
    ("ior-easy-write", "bw", True),
    ("mdtest-easy-write", "md", True),
    ("timestamp", None, False),
    ("ior-hard-write", "bw", True),
    ("mdtest-hard-write", "md", True),
    ("find", "md", False),
    ("ior-easy-read", "bw", False),
    ("mdtest-easy-stat", "md", False),
    ("ior-hard-read", "bw", False),
    ("mdtest-hard-stat", "md", False),
    ("mdtest-easy-delete", "md", False),
    ("mdtest-hard-read", "md", False),
    ("mdtest-hard-delete", "md", False),
]
SCORED = [name for name, group, _ in PHASES if group]
GROUP = {name: group for name, group, _ in PHASES}
STONEWALLED = {name for name, _, sw in PHASES if sw}
# the write phase whose per-rank counts a later phase needs
SOURCE = {"ior-easy-read": "ior-easy-write", "ior-hard-read": "ior-hard-write",
          "mdtest-easy-stat": "mdtest-easy-write", "mdtest-easy-delete": "mdtest-easy-write",
          "mdtest-hard-stat": "mdtest-hard-write", "mdtest-hard-read": "mdtest-hard-write",
          "mdtest-hard-delete": "mdtest-hard-write", "find": "mdtest-hard-write"}


@dataclass
class Io500Config:
    """What one run does; the same on every rank."""

    stonewall: float = 300.0  # seconds; 0 = no stonewall (write up to the caps)
    easy_size: int = 0  # ior-easy bytes per rank (cap); 0 = from the free space
    hard_segments: int = 0  # ior-hard segments per rank (cap); 0 = from the free space
    easy_files: int = 1_000_000  # mdtest-easy files per rank (cap), io500's -n
    hard_files: int = 1_000_000  # mdtest-hard files per rank (cap)
    easy_transfer: int = EASY_TRANSFER
    verify: bool = False
    drop_caches: bool = False
    keep: bool = False  # leave the data directory behind
    phases: list[str] = field(default_factory=lambda: [p for p, _, _ in PHASES])
    timestamp: str = ""  # names the data directory, io500's --timestamp
    seed: int = 0
    quick: bool = False

    def data_name(self) -> str:
        return f"io500-{self.timestamp}"


# -- scoring -----------------------------------------------------------------------
def geo_mean(values: Sequence[float]) -> float:
    """IO500's group score: the geometric mean of the positive values (0 if none)."""
    pos = [v for v in values if v > 0]
    if not pos:
        return 0.0
    return math.exp(sum(math.log(v) for v in pos) / len(pos))


def score(phase_scores: dict[str, float]) -> dict[str, float]:
    """bw = geo-mean of the ior phases (GiB/s), md = geo-mean of mdtest and find (kIOPS),
    total = sqrt(bw * md)."""
    bw = geo_mean([v for k, v in phase_scores.items() if GROUP.get(k) == "bw"])
    md = geo_mean([v for k, v in phase_scores.items() if GROUP.get(k) == "md"])
    return {"bw": bw, "md": md, "total": math.sqrt(bw * md)}


def unit_of(phase: str) -> str:
    return "GiB/s" if phase.startswith("ior") else "kIOPS"


def result_line(phase: str, value: float, seconds: float, valid: bool) -> str:
    """One line as io500 prints it."""
    tag = "[RESULT]" if GROUP.get(phase) else "[      ]"
    return (f"{tag} {phase:>20s} {f'{value:f}':>15s} {unit_of(phase)} : "
            f"time {seconds:.3f} seconds{'' if valid else ' [INVALID]'}")


def score_line(s: dict[str, float], valid: bool) -> str:
    return (f"[SCORE ] Bandwidth {s['bw']:f} GiB/s : IOPS {s['md']:f} kiops : "
            f"TOTAL {s['total']:f}{'' if valid else ' [INVALID]'}")


# -- where the files go --------------------------------------------------------------
class Store(ABC):
    """The few operations the phases need, on a POSIX directory or through pfs."""

    kind = "?"

    @abstractmethod
    def path(self, *parts: str) -> str: ...
    @abstractmethod
    def mkdir(self, p: str) -> None: ...
    @abstractmethod
    def makedirs(self, p: str) -> None: ...
    @abstractmethod
    def rmdir(self, p: str) -> None: ...
    @abstractmethod
    def unlink(self, p: str) -> None: ...
    @abstractmethod
    def stat(self, p: str) -> tuple[int, int]:
        """(size, mtime_ns)."""
    @abstractmethod
    def scan(self, p: str) -> list[tuple[str, bool]]:
        """(name, is_dir) of each entry."""
    @abstractmethod
    def scan_stat(self, p: str, name: str, hint: Any) -> tuple[int, int, bool]:
        """(size, mtime_ns, is_regular_file) of an entry from :meth:`scan`."""
    @abstractmethod
    def create_empty(self, p: str) -> None: ...
    @abstractmethod
    def write_new(self, p: str, data: memoryview) -> None:
        """Create ``p`` (it must not exist), write ``data``, close."""
    @abstractmethod
    def read_whole(self, p: str, buf: memoryview) -> int:
        """Open, read up to ``len(buf)`` bytes, close."""
    @abstractmethod
    def open(self, p: str, create: bool, write: bool) -> Any: ...
    @abstractmethod
    def pwrite(self, h: Any, data: memoryview, off: int) -> None: ...
    @abstractmethod
    def pread_into(self, h: Any, buf: memoryview, off: int) -> int: ...
    @abstractmethod
    def fsync(self, h: Any) -> None: ...
    @abstractmethod
    def close_file(self, h: Any) -> None: ...
    @abstractmethod
    def free_bytes(self) -> int: ...

    def close(self) -> None:  # noqa: B027 - most stores hold nothing to release
        return None

    def scan_with_hints(self, p: str) -> list[tuple[str, bool, Any]]:
        return [(n, d, None) for n, d in self.scan(p)]


class PosixStore(Store):
    kind = "posix"

    def __init__(self, root: str) -> None:
        self.root = str(root)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def mkdir(self, p: str) -> None:
        os.mkdir(p)

    def makedirs(self, p: str) -> None:
        os.makedirs(p, exist_ok=True)

    def rmdir(self, p: str) -> None:
        os.rmdir(p)

    def unlink(self, p: str) -> None:
        os.unlink(p)

    def stat(self, p: str) -> tuple[int, int]:
        st = os.stat(p)
        return st.st_size, st.st_mtime_ns

    def scan(self, p: str) -> list[tuple[str, bool]]:
        return [(n, d) for n, d, _ in self.scan_with_hints(p)]

    def scan_with_hints(self, p: str) -> list[tuple[str, bool, Any]]:
        with os.scandir(p) as it:
            return [(e.name, e.is_dir(follow_symlinks=False), e) for e in it]

    def scan_stat(self, p: str, name: str, hint: Any) -> tuple[int, int, bool]:
        st = hint.stat(follow_symlinks=False) if hint is not None else \
            os.lstat(os.path.join(p, name))
        return st.st_size, st.st_mtime_ns, statmod.S_ISREG(st.st_mode)

    def create_empty(self, p: str) -> None:
        os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))

    def write_new(self, p: str, data: memoryview) -> None:
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        finally:
            os.close(fd)

    def read_whole(self, p: str, buf: memoryview) -> int:
        fd = os.open(p, os.O_RDONLY)
        try:
            return os.readv(fd, [buf])
        finally:
            os.close(fd)

    def open(self, p: str, create: bool, write: bool) -> int:
        flags = os.O_WRONLY if write else os.O_RDONLY
        if create:
            flags |= os.O_CREAT | os.O_TRUNC
        return os.open(p, flags, 0o644)

    def pwrite(self, h: int, data: memoryview, off: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwritev(h, [data[done:]], off + done)

    def pread_into(self, h: int, buf: memoryview, off: int) -> int:
        got = 0
        while got < len(buf):
            n = os.preadv(h, [buf[got:]], off + got)
            if n == 0:
                break
            got += n
        return got

    def fsync(self, h: int) -> None:
        os.fsync(h)

    def close_file(self, h: int) -> None:
        os.close(h)

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


class PfsStore(Store):
    """pfs through the native client (one connection per rank)."""

    kind = "pfs"

    def __init__(self, client_toml: str, root: str) -> None:
        import pfs

        self.client = pfs.connect(config=client_toml)
        self.root = "/" + root.strip("/")

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts]) or "/"

    def mkdir(self, p: str) -> None:
        self.client.mkdir(p)

    def makedirs(self, p: str) -> None:
        self.client.makedirs(p, exist_ok=True)

    def rmdir(self, p: str) -> None:
        self.client.rmdir(p)

    def unlink(self, p: str) -> None:
        self.client.remove(p)

    def stat(self, p: str) -> tuple[int, int]:
        st = self.client.stat(p)
        return st.st_size, st.st_mtime_ns

    def scan(self, p: str) -> list[tuple[str, bool]]:
        return [(n, d) for n, d, _ in self.scan_with_hints(p)]

    def scan_with_hints(self, p: str) -> list[tuple[str, bool, Any]]:
        return [(e.name, e.is_dir(), e) for e in self.client.scandir(p)]

    def scan_stat(self, p: str, name: str, hint: Any) -> tuple[int, int, bool]:
        st = hint.attr if hint is not None and hint.attr is not None else \
            self.client.lstat(f"{p}/{name}")
        return st.st_size, st.st_mtime_ns, statmod.S_ISREG(st.st_mode)

    def create_empty(self, p: str) -> None:
        self.client.open(p, "xb").close()

    def write_new(self, p: str, data: memoryview) -> None:
        f = self.client.open(p, "xb")
        try:
            f.pwrite(data, 0)
        finally:
            f.close()

    def read_whole(self, p: str, buf: memoryview) -> int:
        f = self.client.open(p, "rb")
        try:
            return f.preadinto(buf, 0)
        finally:
            f.close()

    def open(self, p: str, create: bool, write: bool) -> Any:
        return self.client.open(p, ("wb" if create else "r+b") if write else "rb")

    def pwrite(self, h: Any, data: memoryview, off: int) -> None:
        h.pwrite(data, off)

    def pread_into(self, h: Any, buf: memoryview, off: int) -> int:
        return h.preadinto(buf, off)

    def fsync(self, h: Any) -> None:
        h.fsync()

    def close_file(self, h: Any) -> None:
        h.close()

    def free_bytes(self) -> int:
        st = self.client.statvfs("/")
        return st.f_bavail * st.f_frsize

    def close(self) -> None:
        self.client.close()


@dataclass(frozen=True)
class Target:
    """Where a run goes: ``posix`` + a directory, or ``pfs`` + client.toml + a pfs dir."""

    kind: str
    path: str
    client_toml: str = ""

    def open(self) -> Store:
        if self.kind == "pfs":
            return PfsStore(self.client_toml, self.path)
        return PosixStore(self.path)

    def describe(self) -> str:
        if self.kind == "pfs":
            return f"pfs native client ({self.client_toml}) {self.path}"
        from pfs.bench.common import fs_of

        return f"{self.path} ({fs_of(Path(self.path))})"


# -- ranks ---------------------------------------------------------------------------
WIDTH = 8  # numbers per rank in one allgather


class Comm(ABC):
    rank = 0
    size = 1

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def allgather(self, values: Sequence[float]) -> list[list[float]]: ...


class SelfComm(Comm):
    def barrier(self) -> None:
        pass

    def allgather(self, values: Sequence[float]) -> list[list[float]]:
        return [list(values)]


class ProcComm(Comm):
    """Processes of this node: a shared barrier and a shared array of doubles."""

    def __init__(self, rank: int, size: int, barrier: Any, slots: Any) -> None:
        self.rank, self.size = rank, size
        self._barrier, self._slots = barrier, slots

    def barrier(self) -> None:
        self._barrier.wait()

    def allgather(self, values: Sequence[float]) -> list[list[float]]:
        n = len(values)
        assert n <= WIDTH
        base = self.rank * WIDTH
        for i, v in enumerate(values):
            self._slots[base + i] = float(v)
        self.barrier()
        out = [list(self._slots[r * WIDTH:r * WIDTH + n]) for r in range(self.size)]
        self.barrier()  # nobody overwrites a slot before everyone has read it
        return out


class MpiComm(Comm):
    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def allgather(self, values: Sequence[float]) -> list[list[float]]:
        return [list(v) for v in self.comm.allgather([float(x) for x in values])]


def under_mpi() -> bool:
    """Whether this process was started by mpirun/srun with more than one rank."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "1") not in ("", "1"):
            return True
    return False


# -- the phases --------------------------------------------------------------------
class Rank:
    """One process's part of the run (SPMD: every rank runs the same phases)."""

    def __init__(self, comm: Comm, cfg: Io500Config, store: Store) -> None:
        self.comm, self.cfg, self.store = comm, cfg, store
        self.r, self.n = comm.rank, comm.size
        self.data = store.path(cfg.data_name())
        self.counts: dict[str, list[int]] = {}  # write phase -> items per rank
        self.deadline = math.inf
        rng = random.Random(cfg.seed)
        self.pattern = bytearray(rng.randbytes(max(cfg.easy_transfer, HARD_TRANSFER)))
        self._body: dict[int, bytes] = {}  # expected bytes after the header, by length

    # helpers
    def d(self, *parts: str) -> str:
        return self.store.path(self.cfg.data_name(), *parts)

    def neighbour(self) -> int:
        return (self.r + 1) % self.n

    def stamped(self, buf: bytearray, off: int, writer: int) -> bytearray:
        HEADER.pack_into(buf, 0, off, writer + 1, self.cfg.seed)
        return buf

    def check(self, view: memoryview, off: int, writer: int) -> bool:
        """Whether ``view`` holds what ``writer`` wrote at ``off``."""
        n = len(view)
        if n not in self._body:
            self._body[n] = bytes(self.pattern[HEADER.size:n])
        head = HEADER.pack(off, writer + 1, self.cfg.seed)
        # bytes(): a memoryview compares item by item, a bytes object with memcmp
        return bytes(view[:HEADER.size]) == head[:n] and bytes(view[HEADER.size:]) == self._body[n]

    def stonewall_passed(self) -> bool:
        return time.perf_counter() >= self.deadline

    def wear_out(self, done: int, cap: int) -> tuple[int, bool]:
        """The count every rank must reach: the most any rank did by the stonewall."""
        hit = done < cap
        got = self.comm.allgather([done, 1.0 if hit else 0.0])
        return int(max(g[0] for g in got)), any(g[1] for g in got)

    def load_counts(self, phase: str) -> list[int]:
        src = SOURCE[phase]
        if src not in self.counts:
            try:
                with self._state_open("r") as f:
                    self.counts.update(json.load(f)["counts"])
            except (OSError, ValueError, KeyError) as exc:
                raise RuntimeError(f"{phase} needs {src} (run it first, with the same "
                                   f"--timestamp): {exc}") from exc
        return self.counts[src]

    @contextlib.contextmanager
    def _state_open(self, mode: str) -> Iterator[Any]:
        # the stonewall status file: kept in the data directory, like io500's
        if self.store.kind == "posix":
            with open(self.d("io500-state.json"), mode) as f:
                yield f
        else:
            client = self.store.client  # type: ignore[attr-defined]
            with client.open(self.d("io500-state.json"), mode + "b") as fb:
                import io

                if mode == "r":
                    yield io.StringIO(fb.read().decode())
                else:
                    s = io.StringIO()
                    yield s
                    fb.write(s.getvalue().encode())

    def save_counts(self) -> None:
        if self.r == 0:
            with self._state_open("w") as f:
                json.dump({"counts": self.counts}, f)

    # -- setup and teardown -------------------------------------------------------
    def setup(self) -> None:
        if self.r == 0:
            self.store.makedirs(self.data)
            for sub in ("ior-easy", "ior-hard", "mdtest-easy", "mdtest-hard"):
                self.store.makedirs(self.d(sub))
        self.comm.barrier()

    def cleanup(self) -> None:
        """Remove what the delete phases do not: ior files, the timestamp, the dirs."""
        s = self.store
        with contextlib.suppress(FileNotFoundError):
            s.unlink(self.d("ior-easy", f"ior_file_easy.{self.r:08d}"))
        self.comm.barrier()
        if self.r == 0:
            for p in (self.d("ior-hard", "IOR_file"), self.d("timestampfile"),
                      self.d("io500-state.json")):
                with contextlib.suppress(FileNotFoundError):
                    s.unlink(p)
            for sub in ("ior-easy", "ior-hard", "mdtest-easy", "mdtest-hard"):
                try:
                    s.rmdir(self.d(sub))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log(f"io500: {self.d(sub)} not removed: {exc}")
            try:
                s.rmdir(self.data)
            except OSError as exc:
                log(f"io500: {self.data} not removed: {exc}")
        self.comm.barrier()

    # -- ior ---------------------------------------------------------------------
    def _ior_write(self, path: str, create: bool, transfer: int, cap: int,
                   offset: Callable[[int], int]) -> dict[str, float]:
        buf = bytearray(self.pattern[:transfer])
        h = self.store.open(path, create=create, write=True)
        done = 0
        try:
            while done < cap and not self.stonewall_passed():
                off = offset(done)
                self.store.pwrite(h, memoryview(self.stamped(buf, off, self.r)), off)
                done += 1
            at_stonewall = done
            target, hit = self.wear_out(done, cap)
            while done < target:
                off = offset(done)
                self.store.pwrite(h, memoryview(self.stamped(buf, off, self.r)), off)
                done += 1
            self.store.fsync(h)
        finally:
            self.store.close_file(h)
        return {"items": done, "bytes": done * transfer, "at_stonewall": at_stonewall,
                "stonewall_hit": hit}

    def _ior_read(self, path: str, transfer: int, count: int, writer: int,
                  offset: Callable[[int], int]) -> dict[str, float]:
        buf = memoryview(bytearray(transfer))
        h = self.store.open(path, create=False, write=False)
        got = bad = 0
        try:
            for i in range(count):
                off = offset(i)
                n = self.store.pread_into(h, buf, off)
                got += n
                if n != transfer or (self.cfg.verify and not self.check(buf[:n], off, writer)):
                    bad += 1
        finally:
            self.store.close_file(h)
        return {"items": count, "bytes": got, "verify_errors": bad}

    def ior_easy_write(self) -> dict[str, float]:
        cap = max(1, self.cfg.easy_size // self.cfg.easy_transfer)
        t = self.cfg.easy_transfer
        return self._ior_write(self.d("ior-easy", f"ior_file_easy.{self.r:08d}"), True, t,
                               cap, lambda i: i * t)

    def ior_easy_read(self) -> dict[str, float]:
        w = self.neighbour()
        count = self.load_counts("ior-easy-read")[w]
        t = self.cfg.easy_transfer
        return self._ior_read(self.d("ior-easy", f"ior_file_easy.{w:08d}"), t, count, w,
                              lambda i: i * t)

    def ior_hard_write(self) -> dict[str, float]:
        path = self.d("ior-hard", "IOR_file")
        if self.r == 0:  # rank 0 creates the shared file, then the others open it
            self.store.close_file(self.store.open(path, create=True, write=True))
        self.comm.barrier()
        n, r, t = self.n, self.r, HARD_TRANSFER
        return self._ior_write(path, False, t, self.cfg.hard_segments,
                               lambda s: (s * n + r) * t)

    def ior_hard_read(self) -> dict[str, float]:
        w = self.neighbour()
        count = self.load_counts("ior-hard-read")[w]
        n, t = self.n, HARD_TRANSFER
        return self._ior_read(self.d("ior-hard", "IOR_file"), t, count, w,
                              lambda s: (s * n + w) * t)

    # -- mdtest ------------------------------------------------------------------
    def easy_dir(self, rank: int) -> str:
        return self.d("mdtest-easy", f"mdtest_tree.{rank}")

    @staticmethod
    def file_name(rank: int, i: int) -> str:
        return f"file.mdtest.{rank}.{i}"

    def _md_write(self, dirpath: str, cap: int, size: int) -> dict[str, float]:
        s = self.store
        data = bytearray(self.pattern[:size])
        done = 0

        def one(i: int) -> None:
            p = f"{dirpath}/{self.file_name(self.r, i)}"
            if size:
                s.write_new(p, memoryview(self.stamped(data, i, self.r)))
            else:
                s.create_empty(p)

        while done < cap and not self.stonewall_passed():
            one(done)
            done += 1
        at_stonewall = done
        target, hit = self.wear_out(done, cap)
        while done < target:
            one(done)
            done += 1
        return {"items": done, "bytes": done * size, "at_stonewall": at_stonewall,
                "stonewall_hit": hit}

    def mdtest_easy_write(self) -> dict[str, float]:
        self.store.makedirs(self.easy_dir(self.r))
        return self._md_write(self.easy_dir(self.r), self.cfg.easy_files, 0)

    def mdtest_hard_write(self) -> dict[str, float]:
        return self._md_write(self.d("mdtest-hard"), self.cfg.hard_files, HARD_FILE_SIZE)

    def mdtest_easy_stat(self) -> dict[str, float]:
        w = self.neighbour()
        base = self.easy_dir(w)
        count = self.load_counts("mdtest-easy-stat")[w]
        bad = 0
        for i in range(count):
            size, _ = self.store.stat(f"{base}/{self.file_name(w, i)}")
            bad += size != 0
        return {"items": count, "verify_errors": bad}

    def mdtest_hard_stat(self) -> dict[str, float]:
        w = self.neighbour()
        base = self.d("mdtest-hard")
        count = self.load_counts("mdtest-hard-stat")[w]
        bad = 0
        for i in range(count):
            size, _ = self.store.stat(f"{base}/{self.file_name(w, i)}")
            bad += size != HARD_FILE_SIZE
        return {"items": count, "verify_errors": bad}

    def mdtest_hard_read(self) -> dict[str, float]:
        w = self.neighbour()
        base = self.d("mdtest-hard")
        count = self.load_counts("mdtest-hard-read")[w]
        buf = memoryview(bytearray(HARD_FILE_SIZE))
        bad = got = 0
        for i in range(count):
            n = self.store.read_whole(f"{base}/{self.file_name(w, i)}", buf)
            got += n
            if n != HARD_FILE_SIZE or (self.cfg.verify and not self.check(buf, i, w)):
                bad += 1
        return {"items": count, "bytes": got, "verify_errors": bad}

    def mdtest_easy_delete(self) -> dict[str, float]:
        w = self.neighbour()
        base = self.easy_dir(w)
        count = self.load_counts("mdtest-easy-delete")[w]
        for i in range(count):
            self.store.unlink(f"{base}/{self.file_name(w, i)}")
        self.store.rmdir(base)
        return {"items": count}

    def mdtest_hard_delete(self) -> dict[str, float]:
        w = self.neighbour()
        base = self.d("mdtest-hard")
        count = self.load_counts("mdtest-hard-delete")[w]
        for i in range(count):
            self.store.unlink(f"{base}/{self.file_name(w, i)}")
        return {"items": count}

    # -- timestamp and find --------------------------------------------------------
    def timestamp(self) -> dict[str, float]:
        if self.r == 0:
            p = self.d("timestampfile")
            with contextlib.suppress(FileNotFoundError):
                self.store.unlink(p)
            self.store.create_empty(p)
        return {"items": 0}

    def find(self) -> dict[str, float]:
        """Every rank lists every directory; entry j of a listing is examined (stat'ed
        and matched) by rank ``j % nprocs``, so each entry is examined exactly once."""
        s = self.store
        _, newer = s.stat(self.d("timestampfile"))
        examined = found = 0
        stack = [self.data]
        while stack:
            d = stack.pop()
            # sorted: every rank sees the same order, whatever the filesystem's
            for j, (name, is_dir, hint) in enumerate(sorted(s.scan_with_hints(d),
                                                            key=lambda e: e[0])):
                if is_dir:
                    stack.append(f"{d}/{name}")
                if j % self.n != self.r:
                    continue
                examined += 1
                if is_dir or FIND_NAME not in name:
                    continue
                size, mtime, regular = s.scan_stat(d, name, hint)
                if regular and size == HARD_FILE_SIZE and mtime > newer:
                    found += 1
        return {"items": examined, "found": found}

    # -- the run -------------------------------------------------------------------
    FIELDS = ("items", "bytes", "verify_errors", "found", "at_stonewall", "stonewall_hit")

    def run_phase(self, name: str) -> dict[str, Any]:
        fn = getattr(self, name.replace("-", "_"))
        if self.cfg.drop_caches and self.r == 0 and name != "timestamp":
            drop_caches()
        self.comm.barrier()
        t0 = time.perf_counter()
        self.deadline = t0 + self.cfg.stonewall if self.cfg.stonewall > 0 else math.inf
        rec = fn()  # an I/O error ends the run (the other ranks are aborted)
        self.comm.barrier()
        runtime = time.perf_counter() - t0
        got = self.comm.allgather([float(rec.get(k, 0)) for k in self.FIELDS])
        per = {k: [g[i] for g in got] for i, k in enumerate(self.FIELDS)}
        if name in STONEWALLED:
            self.counts[name] = [int(x) for x in per["items"]]
            self.save_counts()
        out: dict[str, Any] = {"name": name, "time": runtime}
        for k in ("items", "bytes", "verify_errors", "found"):
            out[k] = int(sum(per[k]))
        out["items_per_rank"] = [int(x) for x in per["items"]]
        if name in STONEWALLED:
            out["at_stonewall_per_rank"] = [int(x) for x in per["at_stonewall"]]
            out["stonewall_hit"] = bool(max(per["stonewall_hit"]))
        if name.startswith("ior"):
            out["score"] = out["bytes"] / GiB / runtime if runtime > 0 else 0.0
        elif name == "timestamp":
            out["score"] = 0.0
        else:
            out["score"] = out["items"] / 1000.0 / runtime if runtime > 0 else 0.0
        return out


def expected_found(hard_counts: Sequence[int]) -> int:
    """How many mdtest-hard files find must match (``-name *01*``)."""
    return sum(1 for r, c in enumerate(hard_counts) for i in range(c)
               if FIND_NAME in Rank.file_name(r, i))


def judge(phase: dict[str, Any], cfg: Io500Config, counts: dict[str, list[int]]) -> list[str]:
    """Why a phase breaks IO500's rules (empty: valid)."""
    why = []
    name, t = phase["name"], phase["time"]
    if name in STONEWALLED:
        if cfg.stonewall > 0 and t < cfg.stonewall:
            why.append(f"runtime {t:.3f} s below the stonewall {cfg.stonewall:g} s "
                       f"(the size cap was reached first)")
        if t < MIN_WRITE_S:
            why.append(f"runtime {t:.3f} s below IO500's minimum {MIN_WRITE_S:g} s")
    if name != "timestamp" and phase["score"] <= 0:
        why.append("score is 0")
    if phase.get("verify_errors"):
        why.append(f"{phase['verify_errors']} items failed verification")
    if name == "find" and "mdtest-hard-write" in counts:
        want = expected_found(counts["mdtest-hard-write"])
        if phase["found"] != want:
            why.append(f"find matched {phase['found']} files, expected {want}")
    return why


def rank_main(comm: Comm, cfg: Io500Config, target: Target,
              hook: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any] | None:
    """Run every phase of ``cfg`` on this rank; rank 0 returns the result."""
    store = target.open()
    try:
        rk = Rank(comm, cfg, store)
        rk.setup()
        phases: list[dict[str, Any]] = []
        for name, _, _ in PHASES:
            if name not in cfg.phases:
                continue
            if comm.rank == 0:
                log(f"io500: {name}")
            rec = rk.run_phase(name)
            if comm.rank == 0:
                rec["invalid"] = judge(rec, cfg, rk.counts)
                rec["valid"] = not rec["invalid"]
                print(result_line(name, rec["score"], rec["time"], rec["valid"]), flush=True)
                phases.append(rec)
                if hook is not None:
                    hook(rec)
            comm.barrier()
        if not cfg.keep:
            rk.cleanup()
        return summarize(cfg, target, comm.size, phases) if comm.rank == 0 else None
    finally:
        store.close()


def summarize(cfg: Io500Config, target: Target, nprocs: int,
              phases: list[dict[str, Any]]) -> dict[str, Any]:
    scores = {p["name"]: p["score"] for p in phases if GROUP.get(p["name"])}
    s = score(scores)
    reasons = [f"{p['name']}: {w}" for p in phases for w in p["invalid"]]
    missing = [p for p in SCORED if p not in scores]
    if missing:
        reasons.append(f"phases not run: {', '.join(missing)}")
    return {"version": VERSION, "mode": "standard", "nprocs": nprocs,
            "target": asdict(target), "config": asdict(cfg), "phases": phases,
            "score": s, "valid": not reasons, "invalid": reasons}


# -- local processes -------------------------------------------------------------
def _child(rank: int, size: int, barrier: Any, slots: Any, errq: Any, cfg: Io500Config,
           target: Target) -> None:
    try:
        rank_main(ProcComm(rank, size, barrier, slots), cfg, target)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then the run is aborted
        errq.put((rank, traceback.format_exc()))
        barrier.abort()
        raise SystemExit(1) from None


def run_local(cfg: Io500Config, target: Target, nprocs: int,
              hook: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run on ``nprocs`` processes of this node; this process is rank 0."""
    if nprocs <= 1:
        res = rank_main(SelfComm(), cfg, target, hook)
        assert res is not None
        return res
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(nprocs)
    slots = ctx.RawArray("d", nprocs * WIDTH)
    errq = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, nprocs, barrier, slots, errq, cfg, target),
                         name=f"io500-rank{r}", daemon=True) for r in range(1, nprocs)]
    for p in procs:
        p.start()
    stop = threading.Event()

    def watch() -> None:  # a rank that dies without reporting must not hang the others
        while not stop.wait(0.5):
            if any(p.exitcode not in (None, 0) for p in procs):
                barrier.abort()
                return

    watcher = threading.Thread(target=watch, name="io500-watch", daemon=True)
    watcher.start()
    try:
        res = rank_main(ProcComm(0, nprocs, barrier, slots), cfg, target, hook)
        assert res is not None
        for p in procs:
            p.join(timeout=60)
        return res
    except threading.BrokenBarrierError:
        errors = []
        while True:
            try:
                errors.append(errq.get(timeout=2))
            except Exception:  # noqa: BLE001 - queue.Empty: no more reports
                break
        detail = "\n".join(f"rank {r}:\n{tb}" for r, tb in errors) or \
            ", ".join(f"{p.name} exit {p.exitcode}" for p in procs)
        raise RuntimeError(f"io500: a rank failed:\n{detail}") from None
    except BaseException:
        barrier.abort()
        raise
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        errq.close()
        errq.join_thread()


# -- output ------------------------------------------------------------------------
def summary_lines(res: dict[str, Any]) -> list[str]:
    lines = [f"IO500 version {res['version']} ({res['mode']})"]
    for p in res["phases"]:
        lines.append(result_line(p["name"], p["score"], p["time"], p["valid"]))
    lines.append(score_line(res["score"], res["valid"]))
    return lines


def result_ini(res: dict[str, Any]) -> str:
    """io500's result.txt: a section per phase."""
    out = ["[run]", f"procs           = {res['nprocs']}", f"version         = {res['version']}",
           f"mode            = {res['mode']}", f"target          = {res['target']['kind']}:"
           f"{res['target']['path']}", f"stonewall       = {res['config']['stonewall']}"]
    for p in res["phases"]:
        out += ["", f"[{p['name']}]"]
        for w in p["invalid"]:
            out.append(f"; ERROR INVALID {w}")
        for k in ("items", "bytes", "found", "verify_errors"):
            if p.get(k):
                out.append(f"{k:<15s} = {p[k]}")
        if p["name"] == "find":
            out.append(f"{'total-files':<15s} = {p['items']}")
        if GROUP.get(p["name"]):
            out.append(f"{'score':<15s} = {p['score']:f}")
        out.append(f"{'t_delta':<15s} = {p['time']:.4f}")
    s = res["score"]
    out += ["", "[SCORE]", f"BW              = {s['bw']:f}", f"MD              = {s['md']:f}",
            f"SCORE           = {s['total']:f}{'' if res['valid'] else ' [INVALID]'}"]
    return "\n".join(out) + "\n"


def write_results(res: dict[str, Any], resdir: Path, json_path: str | None) -> None:
    resdir.mkdir(parents=True, exist_ok=True)
    (resdir / "result_summary.txt").write_text("\n".join(summary_lines(res)) + "\n")
    (resdir / "result.txt").write_text(result_ini(res))
    text = json.dumps(res, indent=2) + "\n"
    (resdir / "result.json").write_text(text)
    if json_path:
        Path(json_path).write_text(text)
    log(f"io500: results in {resdir}")


# -- command line ------------------------------------------------------------------
QUICK: dict[str, Any] = {"stonewall": 2.0, "easy_size": 256 << 20, "hard_segments": 2000,
         "easy_files": 5000, "hard_files": 2000}


def add_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target (one of)")
    t.add_argument("--path", help="a directory: a pfs mount, local disk, any POSIX filesystem")
    t.add_argument("--config", help="client.toml: pfs through the native client")
    p.add_argument("--pfs-dir", default="/io500",
                   help="with --config: the pfs directory to work in (default /io500)")
    p.add_argument("-n", "--procs", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes on this node (default: CPUs, at most 4); ignored under MPI")
    p.add_argument("--mpi", action="store_true",
                   help="ranks from MPI (mpirun -np N pfs bench io500 ...); automatic when "
                        "started by mpirun with more than one rank")
    p.add_argument("--stonewall", type=float, help="seconds (default 300, IO500's rule; 0: "
                   "none, write up to the caps)")
    p.add_argument("--easy-size", help="ior-easy cap per process, e.g. 64G "
                   "(default: a quarter of the free space)")
    p.add_argument("--hard-segments", type=int, help="ior-hard cap: 47,008-byte segments per "
                   "process (default: a quarter of the free space)")
    p.add_argument("--easy-files", type=int, help="mdtest-easy cap per process (default 1000000)")
    p.add_argument("--hard-files", type=int, help="mdtest-hard cap per process (default 1000000)")
    p.add_argument("--phases", help="comma-separated subset of the phases (default: all; "
                   "a later phase in another run needs --timestamp and --keep)")
    p.add_argument("--timestamp", help="name of the data directory io500-TIMESTAMP "
                   "(default: now)")
    p.add_argument("--verify", action="store_true",
                   help="check every byte read back (ior reads, mdtest-hard-read)")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop this node's page cache before each phase (root)")
    p.add_argument("--keep", action="store_true", help="leave the data directory behind")
    p.add_argument("--results", help="results directory (default ./io500-results/TIMESTAMP)")
    p.add_argument("--json", help="also write the JSON result here")
    p.add_argument("--quick", action="store_true",
                   help="stonewall 2 s and small caps: a smoke run well under a minute "
                        "(invalid by IO500's rules)")


def config_from_args(args: argparse.Namespace, target: Target) -> Io500Config:
    cfg = Io500Config()
    if args.quick:
        cfg = replace(cfg, quick=True, **QUICK)
    if args.stonewall is not None:
        cfg.stonewall = args.stonewall
    if args.easy_size:
        cfg.easy_size = parse_size(args.easy_size)
    if args.hard_segments is not None:
        cfg.hard_segments = args.hard_segments
    if args.easy_files is not None:
        cfg.easy_files = args.easy_files
    if args.hard_files is not None:
        cfg.hard_files = args.hard_files
    if args.phases:
        names = [x.strip() for x in args.phases.split(",") if x.strip()]
        known = [p for p, _, _ in PHASES]
        bad = [x for x in names if x not in known]
        if bad:
            raise SystemExit(f"pfs bench io500: unknown phase(s) {', '.join(bad)}; "
                             f"known: {', '.join(known)}")
        cfg.phases = names
    cfg.verify, cfg.drop_caches, cfg.keep = args.verify, args.drop_caches, args.keep
    cfg.timestamp = args.timestamp or time.strftime("%Y.%m.%d-%H.%M.%S")
    cfg.seed = random.randrange(1 << 62)
    return cfg


def default_caps(cfg: Io500Config, target: Target, nprocs: int) -> Io500Config:
    """Caps that cannot fill the target: each ior phase gets a quarter of the free space."""
    if cfg.easy_size and cfg.hard_segments:
        return cfg
    store = target.open()
    try:
        share = store.free_bytes() // 4 // max(1, nprocs)
    finally:
        store.close()
    if not cfg.easy_size:
        cfg.easy_size = max(cfg.easy_transfer, share - share % cfg.easy_transfer)
    if not cfg.hard_segments:
        cfg.hard_segments = max(1, share // HARD_TRANSFER)
    return cfg


def run(args: argparse.Namespace, hook: Callable[[dict[str, Any]], None] | None = None
        ) -> dict[str, Any] | None:
    if bool(args.path) == bool(args.config):
        raise SystemExit("pfs bench io500: give one target: --path DIR or --config client.toml")
    target = (Target("pfs", args.pfs_dir, str(Path(args.config).resolve())) if args.config
              else Target("posix", str(Path(args.path).resolve())))
    if target.kind == "posix" and not os.path.isdir(target.path):
        raise SystemExit(f"pfs bench io500: {target.path} is not a directory")
    use_mpi = args.mpi or under_mpi()
    if use_mpi:
        try:
            comm: Comm = MpiComm()
        except ImportError:
            raise SystemExit("pfs bench io500: MPI needs mpi4py: pip install 'pfs[mpi]'") \
                from None
        cfg = None
        if comm.rank == 0:
            cfg = default_caps(config_from_args(args, target), target, comm.size)
        cfg = comm.comm.bcast(cfg, root=0)  # type: ignore[attr-defined]
        nprocs = comm.size
    else:
        nprocs = max(1, args.procs)
        cfg = default_caps(config_from_args(args, target), target, nprocs)
    if use_mpi and comm.rank != 0:
        try:
            rank_main(comm, cfg, target)
        except BaseException:
            traceback.print_exc()
            comm.comm.Abort(1)  # type: ignore[attr-defined]
        return None
    log(f"io500: {nprocs} process(es){' (MPI)' if use_mpi else ''} on {target.describe()}; "
        f"stonewall {cfg.stonewall:g} s; caps per process: ior-easy {cfg.easy_size >> 20} MiB, "
        f"ior-hard {cfg.hard_segments} segments, mdtest {cfg.easy_files}/{cfg.hard_files} files")
    print(f"IO500 version {VERSION} (standard)", flush=True)
    if use_mpi:
        try:
            res = rank_main(comm, cfg, target, hook)
        except BaseException:
            traceback.print_exc()
            comm.comm.Abort(1)  # type: ignore[attr-defined]
            raise
    else:
        res = run_local(cfg, target, nprocs, hook)
    assert res is not None
    res["mpi"] = use_mpi
    res["machine"] = machine_info(Path(target.path) if target.kind == "posix" else None)
    print(score_line(res["score"], res["valid"]), flush=True)
    for w in res["invalid"]:
        log(f"io500: INVALID: {w}")
    resdir = Path(args.results) if args.results else Path("io500-results") / cfg.timestamp
    write_results(res, resdir, args.json)
    return res


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pfs bench io500", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

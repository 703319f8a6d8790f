"""``pfs bench io500``: the twelve scored IO500 phases, run against a directory (a pfs
FUSE mount or any POSIX path) or against pfs through the native client.

Each phase does the work the IO500 harness (IO500/io500 calling IOR, mdtest and pfind)
does, read from their sources, with the same files, order, rank shifts and timing rules:

  ior-easy-write      IOR -F -t 2m -e -g: a file per process ior-easy/ior_file_easy.RANK,
                      2 MiB transfers; timed from the first rank's open to the last
                      rank's close (each rank's fsync before IOR's barrier)
  mdtest-easy-write   mdtest -u -F -L -Y: empty files, rank r's in
                      mdtest-easy/test-dir.0-0/mdtest_tree.{r+1}.0 (mdtest's own naming);
                      every rank's system("sync") after the creates, inside the time
                      (-Y: IOR's POSIX_Sync runs the sync command through a shell)
  (timestamp)         the reference file for find's -newer, in the results directory
                      (io500's resdir: on local disk, not on the target)
  ior-hard-write      IOR -t 47008 -b 47008 -s N: one shared file ior-hard/file, opened
                      O_CREAT|O_RDWR by every rank at once, segment s of rank r at
                      (s * nprocs + r) * 47008, fsync at the end; after each IOR
                      phase every rank stat()s its file, untimed (CheckFileSize)
  mdtest-hard-write   mdtest -w 3901 -Y: 3,901-byte files, all ranks in
                      mdtest-hard/test-dir.0-0/mdtest_tree.0; system("sync") inside the time
  find                pfind -newer -size 3901c -name *01*: each directory listed once, the
                      rate counts every entry that is not a directory (pfind's
                      total_files), only *01* names are lstat'ed, -newer compares whole
                      seconds of ctime; the ranks share the walk by pfind's job stealing
                      (io500_find.py: a stack each, the top half to a rank that asks,
                      idle ranks spin, a token ring ends it); timed as pfind times
                      itself, the slowest rank's walk from after the timestamp file's
                      lstat and broadcast
  ior-easy-read       IOR -C -Q 1 -R: the read shift of IOR's node mapping (none on one
                      node: each rank reads what it wrote); every byte compared
  mdtest-easy-stat    mdtest -N 1 shifts each phase once more: stat rank+1's files,
  ior-hard-read       read rank+2's, delete rank+3's (modulo the ranks)
  mdtest-hard-stat
  mdtest-easy-delete  unlinks timed; the tree's rmdir after, untimed (mdtest's tree removal)
  mdtest-hard-read    open (read-write, as mdtest does), read 3,901 bytes, compare them
                      (-X), close
  mdtest-hard-delete

mdtest phases are timed as mdtest times them: the slowest rank's time from the barrier
that opens the phase to after the one that closes it.

The local ranks (``-n``) are bound to cores as mpirun binds the harness's (``--bind-to``:
Open MPI puts each of at most 2 ranks on a core of its own), and wait at barriers as
Open MPI's shared-memory ranks wait: polling, on the CPU (io500_comm.SpinBarrier). The timestamp file and the
stonewall counts live in the results directory, on local disk, as io500 keeps them.

mdtest sleeps one second before each of its runs (mdtest.c); every mdtest phase here does
too, untimed (``--mdtest-pause``): on a FUSE mount with 1 s entry and attribute timeouts it
decides whether a stat is answered by the kernel or by the filesystem. On a POSIX path the
mdtest, find and IOR read loops run in C (io500_loops.c: the same system calls as mdtest,
pfind and IOR), since Python's per-call cost decides where the kernel answers in a
microsecond; the Python loops are the fallback. What cannot be done as the harness does
(the native client has no kernel caches and nothing for sync() to flush; the Python
loops) is printed as ``[NOTE  ]`` lines. ``--compare`` runs the harness itself beside this (pfs/bench/io500ref.py).

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
is), a phase scoring 0, I/O errors, read-back that fails verification, find not finding
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
import array
import contextlib
import io
import json
import logging
import math
import mmap
import multiprocessing as mp
import os
import random
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pfs.bench import io500_find, io500_loops, io500ref
from pfs.bench.common import drop_caches, log, machine_info, parse_size
from pfs.bench.io500_comm import (
    WIDTH,
    Comm,
    MpiComm,
    ProcComm,
    SelfComm,
    SpinBarrier,
    rank_cpus,
    under_mpi,
)
from pfs.bench.io500_find import LocalNet
from pfs.bench.io500_store import PfsStore, PosixStore, Store, Target

logger = logging.getLogger(__name__)

__all__ = ["Comm", "Io500Config", "MpiComm", "PfsStore", "PosixStore", "ProcComm", "Rank",
           "SelfComm", "Store", "Target", "main", "run", "run_local", "under_mpi"]

VERSION = "pfs-io500-1.0"
GiB = 1 << 30
EASY_TRANSFER = 2 << 20  # ior-easy: -t 2m -F
HARD_TRANSFER = 47008  # ior-hard: -t 47008 -b 47008, shared file
HARD_FILE_SIZE = 3901  # mdtest-hard: -w 3901 -e 3901
MIN_WRITE_S = 300.0  # IO500's minimum runtime of a write phase
FIND_NAME = "01"  # find -name "*01*"
WBuf = bytearray | mmap.mmap  # a writable transfer buffer
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
    verify: bool = True  # IOR -R and mdtest -X: every byte read is compared
    drop_caches: bool = False
    md_pause: float = 1.0  # mdtest's sleep(1) before each of its runs (untimed)
    bind: str = "auto"  # local ranks on cores as mpirun binds them (io500_comm.rank_cpus)
    resdir: str = ""  # the results directory: the timestamp and stonewall state go there
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


# -- where each rank works: IOR's and mdtest's own layout and rank shifts ----------------
EASY_DIR = "mdtest-easy/test-dir.0-0"  # mdtest -d DIR makes DIR/test-dir.0-0 (iteration 0)
HARD_DIR = "mdtest-hard/test-dir.0-0/mdtest_tree.0"  # no -u: one shared tree, depth 0
# mdtest -N 1: every phase after the create shifts the ranks once more
# (mdtest.c: stat_name rank+1, read_name rank+2, rm_name rank+3)
MD_SHIFT = {"stat": 1, "read": 2, "delete": 3}
MD_READERS = ("mdtest-easy-stat", "mdtest-hard-stat", "mdtest-hard-read", "mdtest-easy-delete",
              "mdtest-hard-delete")


def md_owner(rank: int, nprocs: int, what: str) -> int:
    """Whose files rank ``rank`` stats, reads or deletes in an mdtest phase (``-N 1``)."""
    return (rank + MD_SHIFT[what]) % nprocs


def easy_tree(owner: int, nprocs: int) -> str:
    """The directory that holds rank ``owner``'s mdtest-easy files. With ``-u`` mdtest
    creates a rank's files in the directory it names ``unique_chdir_dir``, which is the
    next rank's: ``mdtest_tree.{owner+1}.0``."""
    return f"{EASY_DIR}/mdtest_tree.{(owner + 1) % nprocs}.0"


def ior_read_shift(hosts: Sequence[str]) -> int:
    """How far IOR ``-C -Q 1`` moves a rank for the read phases (ior.c): by the number
    of tasks on node 0 when ranks are mapped to nodes in blocks (rank 1 beside rank 0),
    else by one; modulo the number of tasks. On one node that is 0: each rank reads
    back what it wrote."""
    n = len(hosts)
    if n <= 1:
        return 0
    block = hosts[1] == hosts[0]
    shift = sum(1 for h in hosts if h == hosts[0]) if block else 1
    return shift % n


class Rank:
    """One process's part of the run (SPMD: every rank runs the same phases)."""

    def __init__(self, comm: Comm, cfg: Io500Config, store: Store) -> None:
        self.comm, self.cfg, self.store = comm, cfg, store
        self.r, self.n = comm.rank, comm.size
        self.data = store.path(cfg.data_name())
        self.counts: dict[str, list[int]] = {}  # write phase -> items per rank
        self.deadline = math.inf
        self.ior_shift = 0
        self._paths: list[str] = []  # the files of the mdtest phase about to run (Python)
        self._md_work: tuple[str, int, int] = ("", 0, 0)  # their directory, owner, count
        self._ior_file = ""  # the file the IOR phase that just ran wrote or read
        self._newer = 0  # find -newer: the timestamp file's ctime, whole seconds
        self._net: io500_find.Net | None = None  # find's messages between the ranks
        self.pattern = bytearray()
        self._body: dict[int, bytes] = {}  # expected bytes after the header, by length
        self.reseed(cfg.seed)
        # the mdtest and find loops in C on a POSIX path (io500_loops.py), else in Python
        self.c = io500_loops.load()[0] if store.kind == "posix" else None

    # helpers
    def d(self, *parts: str) -> str:
        return self.store.path(self.cfg.data_name(), *parts)

    def beside(self, what: str) -> str:
        """A file outside what find searches: in the results directory, as io500 keeps
        its timestamp and stonewall files there (``cfg.resdir``; a local file, not one on
        the target), else next to the data directory."""
        if self.cfg.resdir:
            return os.path.join(self.cfg.resdir, f"{self.cfg.data_name()}.{what}")
        return self.store.path(f"{self.cfg.data_name()}.{what}")

    @property
    def side(self) -> Store:
        """The store of the :meth:`beside` files."""
        return PosixStore(self.cfg.resdir) if self.cfg.resdir else self.store

    def reseed(self, seed: int) -> None:
        """The data pattern of ``seed`` (a later run of a read phase takes its writers')."""
        self.cfg = replace(self.cfg, seed=seed)
        self.pattern[:] = ior_pattern(seed, max(self.cfg.easy_transfer, HARD_TRANSFER))
        self._body.clear()

    def stamped(self, buf: WBuf, off: int, writer: int) -> WBuf:
        HEADER.pack_into(buf, 0, off, writer + 1, self.cfg.seed)
        return buf

    def check(self, view: memoryview, off: int, writer: int) -> bool:
        """Whether ``view`` holds what ``writer`` wrote at ``off`` (every byte compared,
        as IOR ``-R`` and mdtest ``-X`` compare every word)."""
        n = len(view)
        head = HEADER.pack(off, writer + 1, self.cfg.seed)
        # bytes(): a memoryview compares item by item, a bytes object with memcmp
        return bytes(view[:HEADER.size]) == head[:n] and bytes(view[HEADER.size:]) == self.body(n)

    def body(self, n: int) -> bytes:
        """What follows the header in an item of ``n`` bytes."""
        if n not in self._body:
            self._body[n] = bytes(self.pattern[HEADER.size:n])
        return self._body[n]

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
                    state = json.load(f)
                self.counts.update(state["counts"])
                self.reseed(int(state.get("seed", self.cfg.seed)))  # what the writers wrote
            except (OSError, ValueError, KeyError) as exc:
                raise RuntimeError(f"{phase} needs {src} (run it first, with the same "
                                   f"--timestamp): {exc}") from exc
        return self.counts[src]

    @contextlib.contextmanager
    def _state_open(self, mode: str) -> Iterator[Any]:
        # the stonewall status (io500's *.stonewall files), beside the data directory
        path = self.beside("state.json")
        if self.side.kind == "posix":
            with open(path, mode) as f:
                yield f
        else:
            client = self.store.client  # type: ignore[attr-defined]
            with client.open(path, mode + "b") as fb:
                if mode == "r":
                    yield io.StringIO(fb.read().decode())
                else:
                    s = io.StringIO()
                    yield s
                    fb.write(s.getvalue().encode())

    def save_counts(self) -> None:
        if self.r == 0:
            with self._state_open("w") as f:
                json.dump({"counts": self.counts, "seed": self.cfg.seed}, f)

    # -- setup and teardown -------------------------------------------------------
    def setup(self) -> None:
        if self.r == 0:
            self.store.makedirs(self.data)
            for sub in ("ior-easy", "ior-hard", "mdtest-easy", "mdtest-hard"):
                self.store.makedirs(self.d(sub))
        self.comm.barrier()
        self.ior_shift = ior_read_shift(self.comm.hosts())

    def cleanup(self) -> None:
        """Remove what the delete phases do not: ior files, the timestamp, the dirs."""
        s = self.store
        with contextlib.suppress(FileNotFoundError):
            s.unlink(self.d("ior-easy", f"ior_file_easy.{self.r:08d}"))
        self.comm.barrier()
        if self.r == 0:
            with contextlib.suppress(FileNotFoundError):
                s.unlink(self.d("ior-hard", "file"))
            for p in (self.beside("timestampfile"), self.beside("state.json")):
                with contextlib.suppress(FileNotFoundError):
                    self.side.unlink(p)
            for sub in (HARD_DIR, "mdtest-hard/test-dir.0-0", EASY_DIR, "ior-easy", "ior-hard",
                        "mdtest-easy", "mdtest-hard"):
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

    # -- ior: -g (barriers around open, transfers, close), -e (fsync at close) -----------
    def _ior_write(self, path: str, shared: bool, transfer: int, cap: int,
                   offset: Callable[[int], int]) -> dict[str, float]:
        buf = aligned_buffer(self.pattern[:transfer])
        s = self.store
        # IOR's POSIX create: every rank opens O_CREAT|O_RDWR at once, the shared file
        # too (no barrier between rank 0's create and the others' opens)
        self._ior_file = path
        h = s.open(path, create=True, write=True)
        self.comm.barrier()
        done = 0
        try:
            while done < cap and not self.stonewall_passed():
                off = offset(done)
                s.pwrite(h, memoryview(self.stamped(buf, off, self.r)), off)
                done += 1
            at_stonewall = done
            target, hit = self.wear_out(done, cap)
            while done < target:
                off = offset(done)
                s.pwrite(h, memoryview(self.stamped(buf, off, self.r)), off)
                done += 1
            s.fsync(h)  # IOR -e: each rank's fsync ends its transfers, before the barrier
            self.comm.barrier()
        finally:
            s.close_file(h)
        return {"items": done, "bytes": done * transfer, "at_stonewall": at_stonewall,
                "stonewall_hit": hit}

    def _ior_read(self, path: str, transfer: int, count: int, writer: int,
                  offset: Callable[[int], int]) -> dict[str, float]:
        buf = memoryview(aligned_buffer(self.pattern[:transfer]))
        self._ior_file = path
        h = self.store.open(path, create=False, write=False)
        self.comm.barrier()
        got = bad = 0
        try:
            if self.c is not None:  # offsets are first + k * stride (IOR's -s/-b/-t walk)
                first = offset(0)
                stride = offset(1) - first
                _, got, bad = self.c.ior_read(h, buf, count, first, stride, writer,
                                              self.body(transfer), self.cfg.seed,
                                              self.cfg.verify)
            for i in range(count if self.c is None else 0):
                off = offset(i)
                n = self.store.pread_into(h, buf, off)
                got += n
                if n != transfer or (self.cfg.verify and not self.check(buf[:n], off, writer)):
                    bad += 1
            self.comm.barrier()
        finally:
            self.store.close_file(h)
        return {"items": count, "bytes": got, "verify_errors": bad}

    def _ior_remove(self, phase: str) -> None:
        """IOR removes the file it is about to write, untimed (it opens without O_TRUNC)."""
        if phase == "ior-easy-write":
            path = self.d("ior-easy", f"ior_file_easy.{self.r:08d}")
        elif self.r == 0:
            path = self.d("ior-hard", "file")
        else:
            path = ""
        if path:
            with contextlib.suppress(FileNotFoundError):
                self.store.unlink(path)
        self.comm.barrier()

    def ior_easy_write(self) -> dict[str, float]:
        cap = max(1, self.cfg.easy_size // self.cfg.easy_transfer)
        t = self.cfg.easy_transfer
        return self._ior_write(self.d("ior-easy", f"ior_file_easy.{self.r:08d}"), False, t,
                               cap, lambda i: i * t)

    def ior_easy_read(self) -> dict[str, float]:
        w = (self.r + self.ior_shift) % self.n
        count = self.load_counts("ior-easy-read")[w]
        t = self.cfg.easy_transfer
        return self._ior_read(self.d("ior-easy", f"ior_file_easy.{w:08d}"), t, count, w,
                              lambda i: i * t)

    def ior_hard_write(self) -> dict[str, float]:
        n, r, t = self.n, self.r, HARD_TRANSFER
        return self._ior_write(self.d("ior-hard", "file"), True, t, self.cfg.hard_segments,
                               lambda s: (s * n + r) * t)

    def ior_hard_read(self) -> dict[str, float]:
        w = (self.r + self.ior_shift) % self.n
        count = self.load_counts("ior-hard-read")[w]
        n, t = self.n, HARD_TRANSFER
        return self._ior_read(self.d("ior-hard", "file"), t, count, w,
                              lambda s: (s * n + w) * t)

    # -- mdtest ------------------------------------------------------------------
    @staticmethod
    def file_name(rank: int, i: int) -> str:
        return f"file.mdtest.{rank}.{i}"

    def _md_write(self, dirpath: str, cap: int, size: int) -> dict[str, float]:
        s = self.store
        data = aligned_buffer(self.pattern[:size]) if size else bytearray()  # mdtest's too
        done = 0

        c = self.c

        def one(i: int) -> None:
            p = f"{dirpath}/{self.file_name(self.r, i)}"
            if size:
                s.write_new(p, memoryview(self.stamped(data, i, self.r)))
            else:
                s.create_empty(p)

        if c is not None:
            done = c.md_create(dirpath, self.r, 0, cap, self.deadline, data, self.cfg.seed)
        else:
            while done < cap and not self.stonewall_passed():
                one(done)
                done += 1
        at_stonewall = done
        target, hit = self.wear_out(done, cap)
        if c is not None:
            done = c.md_create(dirpath, self.r, done, target, math.inf, data, self.cfg.seed)
        while done < target:
            one(done)
            done += 1
        s.sync()  # mdtest -Y: system("sync") after the phase, inside its time
        return {"items": done, "bytes": done * size, "at_stonewall": at_stonewall,
                "stonewall_hit": hit}

    def _md_stat(self, paths: list[str], size: int) -> dict[str, float]:
        if self.c is not None:
            d, owner, count = self._md_work
            done, bad = self.c.md_stat(d, owner, count, size)
            return {"items": done, "verify_errors": bad}
        bad = 0
        stat = self.store.stat
        for p in paths:
            bad += stat(p)[0] != size
        return {"items": len(paths), "verify_errors": bad}

    def _md_delete(self, paths: list[str]) -> dict[str, float]:
        if self.c is not None:
            return {"items": self.c.md_unlink(*self._md_work)}
        unlink = self.store.unlink
        for p in paths:
            unlink(p)
        return {"items": len(paths)}

    def md_work(self, phase: str) -> tuple[str, int, int]:
        """(directory, owner rank, count) of the files an mdtest read phase works on."""
        what = "stat" if phase.endswith("stat") else "read" if phase.endswith("read") \
            else "delete"
        w = md_owner(self.r, self.n, what)
        base = self.d(easy_tree(w, self.n) if "easy" in phase else HARD_DIR)
        return base, w, self.load_counts(phase)[w]

    def md_paths(self, phase: str) -> list[str]:
        """The files an mdtest read phase works on, named before its clock starts (for
        the Python loops): mdtest formats a name in C for nothing, in Python it would be
        most of a cached stat."""
        base, w, count = self.md_work(phase)
        return [f"{base}/{self.file_name(w, i)}" for i in range(count)]

    def mdtest_easy_write(self) -> dict[str, float]:
        return self._md_write(self.d(easy_tree(self.r, self.n)), self.cfg.easy_files, 0)

    def mdtest_hard_write(self) -> dict[str, float]:
        return self._md_write(self.d(HARD_DIR), self.cfg.hard_files, HARD_FILE_SIZE)

    def mdtest_easy_stat(self) -> dict[str, float]:
        return self._md_stat(self._paths, 0)

    def mdtest_hard_stat(self) -> dict[str, float]:
        return self._md_stat(self._paths, HARD_FILE_SIZE)

    def mdtest_hard_read(self) -> dict[str, float]:
        w = md_owner(self.r, self.n, "read")
        if self.c is not None:
            d, owner, count = self._md_work
            done, got, bad = self.c.md_read(d, owner, count, HARD_FILE_SIZE,
                                            self.body(HARD_FILE_SIZE), self.cfg.seed,
                                            self.cfg.verify)
            return {"items": done, "bytes": got, "verify_errors": bad}
        buf = memoryview(bytearray(HARD_FILE_SIZE))
        bad = got = 0
        for i, p in enumerate(self._paths):
            n = self.store.read_whole(p, buf)
            got += n
            if n != HARD_FILE_SIZE or (self.cfg.verify and not self.check(buf, i, w)):
                bad += 1
        return {"items": len(self._paths), "bytes": got, "verify_errors": bad}

    def mdtest_easy_delete(self) -> dict[str, float]:
        return self._md_delete(self._paths)

    def mdtest_hard_delete(self) -> dict[str, float]:
        return self._md_delete(self._paths)

    def _md_tree(self, create: bool, easy: bool) -> None:
        """mdtest's tree creation and removal: outside the timed file phases."""
        if self.r != 0:
            return
        dirs = ([EASY_DIR] + [f"{EASY_DIR}/mdtest_tree.{k}.0" for k in range(self.n)]
                if easy else ["mdtest-hard/test-dir.0-0", HARD_DIR])
        for sub in (dirs if create else reversed(dirs)):
            if create:
                self.store.makedirs(self.d(sub))
            else:
                try:
                    self.store.rmdir(self.d(sub))
                except FileNotFoundError:
                    pass

    # -- timestamp and find --------------------------------------------------------
    def timestamp(self) -> dict[str, float]:
        if self.r == 0:
            p, side = self.beside("timestampfile"), self.side
            with contextlib.suppress(FileNotFoundError):
                side.unlink(p)
            side.create_empty(p)
        return {"items": 0}

    def find(self) -> dict[str, float]:
        """pfind's work: every directory listed once, every entry that is not a
        directory counted (pfind's total_files, the rate's numerator), and only the
        names matching ``*01*`` lstat'ed and tested for ``-size 3901c`` and ``-newer``
        (pfind compares whole seconds of ctime). The ranks share the walk as pfind's do
        (io500_find.py: a stack per rank, chunked reads, halves of a stack handed to a
        rank that asks, spinning while idle, pfind's token ring to end)."""
        newer = self._newer
        lister: io500_find.Lister = (
            io500_find.CLister(self.c, HARD_FILE_SIZE, newer) if self.c is not None else
            io500_find.StoreLister(self.store, HARD_FILE_SIZE, newer, FIND_NAME))
        net = self._net
        assert net is not None  # run_phase made it
        w = io500_find.Walker(self.r, self.n, lister, net)
        w.run(self.data)
        net.finish()
        logger.debug("find rank %d: %s", self.r, w.mon)
        return {"items": w.files, "found": w.found}

    def find_newer(self) -> int:
        """The timestamp file's ctime in whole seconds, known to every rank: pfind lstats
        it on rank 0 and broadcasts it before its clock starts."""
        ts = None
        if self.r == 0:
            ts = self.side.stat(self.beside("timestampfile"))[1] // 1_000_000_000
        return int(self.comm.allgather_obj(ts)[0])

    # -- the run -------------------------------------------------------------------
    FIELDS = ("items", "bytes", "verify_errors", "found", "at_stonewall", "stonewall_hit",
              "start", "end", "span", "cpu")

    def run_phase(self, name: str) -> dict[str, Any]:
        cpu0 = time.process_time()  # the phase with its set-up, as --compare counts both
        fn = getattr(self, name.replace("-", "_"))
        if name in ("mdtest-easy-write", "mdtest-hard-write"):
            self._md_tree(True, name == "mdtest-easy-write")
        if name in ("ior-easy-write", "ior-hard-write"):
            self._ior_remove(name)
        if name == "find":
            self._newer = self.find_newer()
            self._net = self.comm.find_net()  # cleared before the barrier: no request lost
        self._paths, self._md_work = [], ("", 0, 0)
        if name in MD_READERS:
            self._md_work = self.md_work(name)
            if self.c is None:
                self._paths = self.md_paths(name)
        if self.cfg.drop_caches and self.r == 0 and name != "timestamp":
            drop_caches()
        if name.startswith("mdtest") and self.cfg.md_pause > 0:
            # mdtest sleeps a second before its test (mdtest.c, the loop over task
            # counts); caches that expire within it (a FUSE mount's 1 s entry and
            # attribute timeouts) are cold for mdtest, so they are here
            time.sleep(self.cfg.md_pause)
        self.comm.barrier()
        t0, c0 = time.perf_counter(), self.comm.clock()
        self.deadline = t0 + self.cfg.stonewall if self.cfg.stonewall > 0 else math.inf
        rec = fn()  # an I/O error ends the run (the other ranks are aborted)
        c1 = self.comm.clock()
        self.comm.barrier()
        if self._ior_file:
            # IOR's CheckFileSize after its close, untimed: every rank stat()s the file it
            # wrote or read (on a FUSE mount the first attributes after the writes are
            # fetched here, not in a later phase)
            self.store.stat(self._ior_file)
            self._ior_file = ""
        rec.update(start=c0, end=c1, span=self.comm.clock() - c0)
        if name in ("mdtest-easy-delete", "mdtest-hard-delete"):
            self.comm.barrier()
            self._md_tree(False, name == "mdtest-easy-delete")
        rec["cpu"] = time.process_time() - cpu0
        got = self.comm.allgather([float(rec.get(k, 0)) for k in self.FIELDS])
        per = {k: [g[i] for g in got] for i, k in enumerate(self.FIELDS)}
        runtime = phase_time(name, per["start"], per["end"], per["span"])
        if name in STONEWALLED:
            self.counts[name] = [int(x) for x in per["items"]]
            self.save_counts()
        out: dict[str, Any] = {"name": name, "time": runtime}
        for k in ("items", "bytes", "verify_errors", "found"):
            out[k] = int(sum(per[k]))
        out["items_per_rank"] = [int(x) for x in per["items"]]
        out["cpu_s"] = sum(per["cpu"])  # CPU seconds of every rank in this phase
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


def aligned_buffer(fill: bytes | bytearray) -> mmap.mmap:
    """IOR's transfer buffer (aligned_buffer_alloc): page-aligned, here an anonymous
    mapping, and written through before the clock starts as IOR writes its pattern into
    it (generate_memory_pattern). A buffer off the page boundary (malloc's, 16 bytes in)
    makes the kernel's copy to or from the page cache several times slower."""
    buf = mmap.mmap(-1, max(1, len(fill)))
    buf[:len(fill)] = fill
    return buf


def ior_pattern(seed: int, n: int) -> bytes:
    """``n`` bytes of IOR's "timestamp" data packet (io500's dataPacketType; hpc/ior
    generate_memory_pattern): word i is (rank << 32) | (signature + i), here rank 0 and
    the signature the seed's low 31 bits. Every file and transfer is its first bytes
    with the stamp over the first three words; the C read loops check it word by word
    as IOR's verify_memory_pattern does (io500_loops.c)."""
    sig = seed & 0x7FFFFFFF
    return array.array("Q", range(sig, sig + (n + 7) // 8)).tobytes()[:n]


def phase_time(name: str, starts: Sequence[float], ends: Sequence[float],
               spans: Sequence[float]) -> float:
    """A phase's time as its tool takes it, from each rank's start (after the opening
    barrier) and end (before the closing one) on a clock the ranks share, and its span
    from the start to after the closing barrier:

    IOR: the last rank's close less the first rank's open (ReduceIterResults: MPI_MAX of
    the close timers less MPI_MIN of the open timers; no barrier after a read's close);
    pfind: the slowest rank's walk, which ends without a barrier (MPI_MAX of each rank's
    runtime); mdtest: the slowest rank's time to after the barrier that ends the phase
    (summarize_results: the most of each rank's t_end - t_start)."""
    if name.startswith("ior"):
        return max(ends) - min(starts)
    if name == "find":
        return max(e - s for s, e in zip(starts, ends, strict=True))
    return max(spans)


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
@contextlib.contextmanager
def _bound(cpus: set[int] | None) -> Iterator[None]:
    """Run the block on ``cpus`` (none: where it may), then where it ran before."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _child(rank: int, size: int, barrier: Any, slots: Any, inboxes: list[Any], net: LocalNet,
           errq: Any, cfg: Io500Config, target: Target, cpus: set[int] | None) -> None:
    try:
        with _bound(cpus):
            rank_main(ProcComm(rank, size, barrier, slots, inboxes, net), cfg, target)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then the run is aborted
        errq.put((rank, traceback.format_exc()))
        barrier.abort()
        raise SystemExit(1) from None


def run_local(cfg: Io500Config, target: Target, nprocs: int,
              hook: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run on ``nprocs`` processes of this node; this process is rank 0. The ranks are
    bound to cores as mpirun binds the harness's (``cfg.bind``, :func:`rank_cpus`)."""
    cpus = rank_cpus(nprocs, cfg.bind)
    if nprocs <= 1:
        with _bound(cpus[0] if cpus else None):
            res = rank_main(SelfComm(), cfg, target, hook)
        assert res is not None
        return res
    ctx = mp.get_context("spawn")
    barrier = SpinBarrier(ctx, nprocs)
    slots = ctx.RawArray("d", nprocs * WIDTH)
    inboxes = [ctx.Queue() for _ in range(nprocs)]
    net = LocalNet.make(ctx, nprocs)
    errq = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, nprocs, barrier, slots, inboxes, net, errq,
                                              cfg, target, cpus[r] if cpus else None),
                         name=f"io500-rank{r}", daemon=True) for r in range(1, nprocs)]
    for p in procs:
        p.start()
    stop = threading.Event()

    def watch() -> None:  # a rank that dies without reporting must not hang the others
        while not stop.wait(0.5):
            if any(p.exitcode not in (None, 0) for p in procs):
                net.stop()  # a rank spinning in find's walk stops, then meets the abort
                barrier.abort()
                return

    watcher = threading.Thread(target=watch, name="io500-watch", daemon=True)
    watcher.start()
    try:
        with _bound(cpus[0] if cpus else None):
            res = rank_main(ProcComm(0, nprocs, barrier, slots, inboxes, net), cfg, target,
                            hook)
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
        net.stop()
        barrier.abort()
        raise
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for q in (errq, *inboxes):
            q.cancel_join_thread()  # leftovers of a failed run must not hang the exit
            q.close()
        net.close()


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
                   "a later phase in another run needs --timestamp, --keep and the same --results)")
    p.add_argument("--timestamp", help="name of the data directory io500-TIMESTAMP "
                   "(default: now)")
    p.add_argument("--verify", action="store_true",
                   help="check every byte read back (the default, as IOR -R and mdtest -X)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not compare what the read phases read (faster than the harness)")
    p.add_argument("--mdtest-pause", type=float, default=1.0,
                   help="seconds each mdtest phase waits before it starts, untimed (default "
                        "1: mdtest's own sleep(1), which lets a FUSE mount's 1 s caches "
                        "expire)")
    p.add_argument("--bind-to", choices=("auto", "core", "none"), default="auto",
                   help="where the local ranks run (-n): auto (default) binds them as "
                        "mpirun binds the harness's, each to a core of its own with at most "
                        "2 ranks, else not; core: a core each whenever they fit; none: "
                        "where the scheduler puts them. Under MPI, mpirun binds")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop this node's page cache before each phase (root)")
    p.add_argument("--keep", action="store_true", help="leave the data directory behind")
    p.add_argument("--results", help="results directory, which holds the timestamp file and "
                   "the stonewall counts too, as io500's does (default "
                   "./io500-results/TIMESTAMP)")
    p.add_argument("--json", help="also write the JSON result here")
    c = p.add_argument_group("side by side with the IO500 harness")
    c.add_argument("--compare", action="store_true",
                   help="run the reference harness (IO500/io500 with IOR, mdtest, pfind) and "
                        "this, interleaved, with the same parameters, and print both phase by "
                        "phase (medians); needs --path or --reference-path")
    c.add_argument("--reference", help=f"the built io500 binary (default ${io500ref.ENV_REFERENCE}; "
                   "deploy/io500-reference.sh builds it)")
    c.add_argument("--reference-path", help="where the harness writes (default: --path; with "
                   "--config, a FUSE mount of the same pfs)")
    c.add_argument("--repeat", type=int, default=1,
                   help="with --compare: runs of each tool, interleaved (default 1)")
    c.add_argument("--settle", choices=io500ref.SETTLE_MODES, default="sync",
                   help="with --compare: before every run of either tool, sync: write back "
                        "all dirty data and wait for the writeback (default); drop: then also "
                        "drop the page cache (root, machine-wide); none: nothing")
    c.add_argument("--compare-results", nargs="+", metavar="DIR",
                   help="print the table of saved --compare results (their directories or "
                        "compare.json files), several pooled: every run's medians and every "
                        "pair's ratio; runs nothing")
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
    cfg.verify, cfg.drop_caches, cfg.keep = not args.no_verify, args.drop_caches, args.keep
    cfg.md_pause = max(0.0, args.mdtest_pause)
    cfg.bind = args.bind_to
    cfg.timestamp = args.timestamp or time.strftime("%Y.%m.%d-%H.%M.%S")
    cfg.resdir = str(Path(args.results or Path("io500-results") / cfg.timestamp).resolve())
    cfg.seed = random.randrange(1 << 62)
    return cfg


def differences(cfg: Io500Config, target: Target) -> list[str]:
    """What this run does unlike the IO500 harness would on the same target."""
    if target.kind == "pfs":
        out = list(PfsStore.DIFFERENCES)
    elif io500_loops.load()[0] is not None:
        out = [PosixStore.IOR_IN_PYTHON]
    else:
        out = list(PosixStore.DIFFERENCES)
    if not cfg.verify:
        out.append("--no-verify: the read phases do not compare what they read "
                   "(IOR -R and mdtest -X do)")
    if cfg.md_pause != 1.0:
        out.append(f"--mdtest-pause {cfg.md_pause:g}: mdtest sleeps 1 s before each phase")
    return out


def loops_note() -> str:
    """Which loops the mdtest and find phases run on a POSIX path (built here, before
    the ranks start, so that they find the library built)."""
    lib, why = io500_loops.load()
    if lib is None:
        return (f"[NOTE  ] C loops unavailable: {why}; the mdtest, find and IOR read loops "
                "run in Python")
    return f"[NOTE  ] C loops: the mdtest, find and IOR read loops run in C ({lib.path.name})"


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
    Path(cfg.resdir).mkdir(parents=True, exist_ok=True)  # its timestamp file goes there
    if target.kind == "posix":
        print(loops_note(), flush=True)
    for why in differences(cfg, target):
        print(f"[NOTE  ] not as the harness: {why}", flush=True)
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
    write_results(res, Path(cfg.resdir), args.json)
    return res


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    """``--compare``: the harness and this, ``--repeat`` times each, interleaved
    (harness first), on the same path with the same parameters; the medians side by side."""
    binary = io500ref.find_reference(args.reference)
    if binary is None:
        raise SystemExit("pfs bench io500 --compare: no reference harness: give --reference "
                         f"PATH/io500 or set ${io500ref.ENV_REFERENCE} (build it with "
                         "deploy/io500-reference.sh)")
    ref_path = args.reference_path or args.path
    if not ref_path or not os.path.isdir(ref_path):
        raise SystemExit("pfs bench io500 --compare: the harness needs a directory: "
                         "--path DIR or --reference-path DIR")
    if args.stonewall is None or args.stonewall != int(args.stonewall):
        raise SystemExit("pfs bench io500 --compare: give --stonewall in whole seconds "
                         "(the harness's unit)")
    target = (Target("pfs", args.pfs_dir, str(Path(args.config).resolve())) if args.config
              else Target("posix", str(Path(args.path).resolve())))
    cfg = default_caps(config_from_args(args, target), target, max(1, args.procs))
    stamp = cfg.timestamp
    resdir = Path(args.results) if args.results else Path("io500-results") / f"compare-{stamp}"
    params = io500ref.RefParams(
        procs=max(1, args.procs), stonewall=int(args.stonewall), easy_size=cfg.easy_size,
        hard_segments=cfg.hard_segments, easy_files=cfg.easy_files, hard_files=cfg.hard_files,
        datadir=str(Path(ref_path).resolve() / "io500-reference"),
        resultdir=str((resdir / "harness").resolve()))
    refs: list[io500ref.Parsed] = []
    ours: list[io500ref.Parsed] = []
    conditions: list[dict[str, Any]] = []

    def settled(tool: str, k: int) -> None:
        c = io500ref.settle(args.settle)
        conditions.append({"tool": tool, "run": k, **c})
        log(f"io500 --compare: {tool} run {k + 1}: load {c['load1']:.1f}, "
            f"{c['dirty_mb']:.0f} MiB dirty, settle ({args.settle}) {c['sync_s']:.2f} s")

    for k in range(max(1, args.repeat)):
        params.resultdir = str((resdir / f"harness-{k}").resolve())
        settled("harness", k)
        parsed, text = io500ref.run_reference(binary, params, resdir / f"harness-{k}")
        (resdir / f"harness-{k}" / "stdout.txt").write_text(text)
        refs.append(parsed)
        settled("pfs bench io500", k)
        mine = argparse.Namespace(**vars(args))
        mine.timestamp, mine.results, mine.json = f"{stamp}-{k}", str(resdir / f"pfs-{k}"), None
        res = run(mine)
        assert res is not None
        mine_parsed = io500ref.parse_output("\n".join(summary_lines(res)))
        mine_parsed.cpu = {p["name"]: p["cpu_s"] for p in res["phases"] if "cpu_s" in p}
        ours.append(mine_parsed)
        try:
            os.rmdir(Path(ref_path) / "io500-reference")
        except OSError:
            pass
    a, b = io500ref.medians(refs), io500ref.medians(ours)
    pairs = io500ref.paired_ratios(refs, ours)
    table = io500ref.compare_table(a, b, len(refs), len(ours), io500ref.spread(refs), pairs)
    table += io500ref.cpu_table(refs, ours)
    print("\n".join(table), flush=True)
    out = {"params": asdict(params), "harness": [asdict(r) for r in refs],
           "pfs": [asdict(r) for r in ours], "median_harness": a, "median_pfs": b,
           "paired_ratios": pairs, "table": table, "settle": args.settle,
           "conditions": conditions}
    (resdir / "compare.json").write_text(json.dumps(out, indent=2) + "\n")
    (resdir / "compare.txt").write_text("\n".join(table) + "\n")
    if args.json:  # the same record where the caller asked for it (as without --compare)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    log(f"io500 --compare: results in {resdir}")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pfs bench io500", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    if args.compare_results:
        print("\n".join(io500ref.pooled_table([Path(x) for x in args.compare_results])))
    elif args.compare:
        run_compare(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

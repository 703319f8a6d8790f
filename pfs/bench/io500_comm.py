"""The ranks of ``pfs bench io500``: one process, processes of this node, or MPI ranks.

Each gives a barrier, an allgather of a few numbers (the per-phase counts) and an
allgather of small picklable objects (host names), and find's messages (io500_find.py)."""
from __future__ import annotations

import os
import queue
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pfs.bench.io500_find import LocalNet, MpiNet, Net, SoloNet

WIDTH = 12  # numbers per rank in one allgather


class Comm(ABC):
    rank = 0
    size = 1

    @staticmethod
    def clock() -> float:
        """Seconds on a clock every rank shares, for a phase's first start and last end
        across ranks (IOR's timers): on one node the monotonic clock."""
        return time.perf_counter()

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def allgather(self, values: Sequence[float]) -> list[list[float]]: ...

    @abstractmethod
    def allgather_obj(self, obj: Any) -> list[Any]: ...

    @abstractmethod
    def find_net(self) -> Net:
        """pfind's messages between the ranks (io500_find.py), cleared for a walk."""

    def hosts(self) -> list[str]:
        """The host name of every rank, by rank (IOR's node mapping)."""
        return [str(h) for h in self.allgather_obj(socket.gethostname())]


class SpinBarrier:
    """A barrier for the processes of one node that waits as MPI_Barrier does between
    Open MPI's shared-memory ranks: by polling, on the CPU, not asleep in the kernel. A
    rank that arrives early keeps its core busy (on a small machine the core a FUSE
    daemon or a server would have used) and passes the moment the last arrives, where a
    sleeping one would wait to be woken and scheduled. Ranks that outnumber the cores
    yield while they poll, as Open MPI does when oversubscribed."""

    def __init__(self, ctx: Any, parties: int) -> None:
        self.parties = parties
        self._arrived = ctx.Value("q", 0)  # its lock orders the arrivals
        self._generation = ctx.RawValue("q", 0)
        self._broken = ctx.RawValue("i", 0)
        self._yield = parties > len(os.sched_getaffinity(0))

    def wait(self) -> None:
        gen = self._generation.value  # cannot move before this rank has arrived
        with self._arrived.get_lock():
            self._arrived.value += 1
            last = self._arrived.value == self.parties
            if last:
                self._arrived.value = 0
                self._generation.value = gen + 1
        if last:
            return
        generation, broken, pause = self._generation, self._broken, self._yield
        while generation.value == gen:
            if broken.value:
                raise threading.BrokenBarrierError
            if pause:
                os.sched_yield()
        if broken.value:
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        self._broken.value = 1

    @property
    def broken(self) -> bool:
        return bool(self._broken.value)


class SelfComm(Comm):
    def barrier(self) -> None:
        pass

    def allgather(self, values: Sequence[float]) -> list[list[float]]:
        return [list(values)]

    def allgather_obj(self, obj: Any) -> list[Any]:
        return [obj]

    def find_net(self) -> Net:
        return SoloNet()


class ProcComm(Comm):
    """Processes of this node: a shared barrier, a shared array of doubles, and a queue
    per rank for objects."""

    def __init__(self, rank: int, size: int, barrier: Any, slots: Any,
                 inboxes: Sequence[Any], net: LocalNet) -> None:
        self.rank, self.size = rank, size
        self._barrier, self._slots, self._inboxes = barrier, slots, inboxes
        self._net = net
        self._round = 0
        self._early: dict[tuple[int, int], Any] = {}  # (round, rank) -> obj from a rank ahead

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

    def find_net(self) -> Net:
        return self._net.at(self.rank)

    def allgather_obj(self, obj: Any) -> list[Any]:
        self._round += 1
        for r, box in enumerate(self._inboxes):
            if r != self.rank:
                box.put((self._round, self.rank, obj))
        got = {self.rank: obj}
        for r in range(self.size):
            if (self._round, r) in self._early:
                got[r] = self._early.pop((self._round, r))
        while len(got) < self.size:
            try:
                rnd, r, o = self._inboxes[self.rank].get(timeout=1.0)
            except queue.Empty:
                # a dead rank aborts the barrier; notice it instead of waiting forever
                if self._barrier.broken:
                    raise threading.BrokenBarrierError from None
                continue
            if rnd == self._round:
                got[r] = o
            else:  # a rank already in the next round
                self._early[(rnd, r)] = o
        return [got[r] for r in range(self.size)]


class MpiComm(Comm):
    def __init__(self) -> None:
        from mpi4py import MPI  # optional dependency (pfs[mpi]): only under mpirun

        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    @staticmethod
    def clock() -> float:
        # ranks on other nodes share no monotonic clock; IOR's timers are wall-clock too
        return time.time()

    def allgather(self, values: Sequence[float]) -> list[list[float]]:
        return [list(v) for v in self.comm.allgather([float(x) for x in values])]

    def find_net(self) -> Net:
        return MpiNet(self.comm)

    def allgather_obj(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))


def core_cpus() -> list[set[int]]:
    """The CPUs this process may run on, grouped by core (hardware threads of one core
    together), cores in the order of their lowest CPU."""
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[tuple[str, str], set[int]] = {}
    for cpu in allowed:
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as f1, open(f"{topo}/core_id") as f2:
                key = (f1.read().strip(), f2.read().strip())
        except OSError:
            key = ("", str(cpu))
        cores.setdefault(key, set()).add(cpu)
    return sorted(cores.values(), key=min)


def rank_cpus(nprocs: int, policy: str) -> list[set[int]] | None:
    """Where each local rank runs, as mpirun places the harness's ranks on one node:
    Open MPI binds each rank to a core of its own (rank r to the r-th core) when there
    are at most 2 ranks and otherwise to a socket, which on one node leaves the ranks
    where they may go; ``policy`` "core" binds to cores for any count that fits, "none"
    never binds. None: no binding."""
    if policy == "none" or (policy == "auto" and nprocs > 2):
        return None
    cores = core_cpus()
    if nprocs > len(cores):  # oversubscribed: mpirun does not bind either
        return None
    return [cores[r] for r in range(nprocs)]


def under_mpi() -> bool:
    """Whether this process was started by mpirun/srun with more than one rank."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "1") not in ("", "1"):
            return True
    return False

"""The find phase of ``pfs bench io500`` as pfind (VI4IO/pfind, src/pfind.c) runs it.

Each rank keeps pfind's work queue: a stack of directories to read and of files to lstat
(those whose name matches; every other entry is only counted). A rank takes one item per
turn of its loop, the top of the stack first; a directory it opens is read a chunk at a
time (pfind's current_dir, at most ``MAX_ENTRIES_PER_ITER`` + 1 entries a turn) and read
to its end before the stack is touched again. Between turns a rank answers the ranks
that asked it for work with the top half of its stack (``pending_work / 2`` items, maybe
none). A rank whose stack is empty asks one rank, chosen by glibc's ``rand() % size``
from pfind's never-seeded generator (itself: no request that turn), and spins until the
answer, answering others with nothing meanwhile, as pfind spins in ``MPI_Iprobe``. The
end is pfind's token ring: the token goes round while ranks are idle, and rank 0 counts
the rounds in which no rank got work; after the third, every rank stops.

The deterministic parts (the stack, the halving, the chunks, the full queue, the token,
the generator) are :class:`Walker` and :class:`GlibcRand`; the messages go through a
:class:`Net`: :class:`LocalNet` between the processes of this node (shared memory that
the ranks poll, as Open MPI's shared-memory transport), :class:`MpiNet` over MPI,
:class:`SoloNet` for one process.
"""

from __future__ import annotations

import logging
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

QUEUE_LENGTH = 10000  # io500's pfind-queue-length (pfind -q)
MAX_ENTRIES_PER_ITER = 1000  # pfind's default -M
LAST_PHASE = 3  # pfind: 1 potential cleanup, 2 stop stealing, 3 terminate

# a queued item: ("d", directory) or ("f", file to lstat), and the lister's hint for it
Item = tuple[str, str, Any]

# pfind's work_t as it travels in a steal answer: char name[PATH_MAX], dir_start, dir_end,
# type, padded to 8 bytes (4,120 bytes an item: an answer of n items is n * 4,120 bytes)
WORK_T = struct.Struct("=4096sQQc7x")
# Open MPI's shared-memory eager limit (btl_vader_eager_limit): a longer message (any
# answer with a work item) goes by rendezvous, and MPI_Send returns only once the
# receiver has matched and copied it
EAGER_LIMIT = 4096


def pack_work(items: list[Item]) -> bytes:
    """A steal answer as pfind sends it: each item a whole work_t (hints stay behind)."""
    pack = WORK_T.pack
    return b"".join(pack(path.encode(), 0, 0, kind.encode()) for kind, path, _ in items)


def unpack_work(buf: bytes | bytearray | memoryview) -> list[Item]:
    out: list[Item] = []
    for name, _, _, kind in WORK_T.iter_unpack(buf):
        out.append((kind.decode(), name.split(b"\0", 1)[0].decode(), None))
    return out


class GlibcRand:
    """glibc's ``rand()`` after ``srand(seed)``: the TYPE_3 additive feedback generator
    (r[i] = r[i-3] + r[i-31], the first 310 outputs discarded). pfind never seeds it,
    and nothing in io500 calls rand() before find: the sequence from seed 1, the same on
    every rank."""

    def __init__(self, seed: int = 1) -> None:
        r = [seed or 1]
        for i in range(1, 31):
            hi, lo = divmod(r[i - 1], 127773)
            word = 16807 * lo - 2836 * hi
            r.append(word + 2147483647 if word < 0 else word)
        r += r[:3]
        for _ in range(310):
            r.append((r[-31] + r[-3]) & 0xFFFFFFFF)
        self._r = r[-34:]

    def __call__(self) -> int:
        r = self._r
        v = (r[-31] + r[-3]) & 0xFFFFFFFF
        r.append(v)
        del r[0]
        return v >> 1


class Cursor(Protocol):
    def chunk(self, max_entries: int, room: int) -> tuple[int, int, list[Item], bool]:
        """(files counted, files found, items to queue, finished); see FindCursor.chunk."""

    def close(self) -> None: ...


class Lister(Protocol):
    """Reads directories and lstats files as pfind does (C or Python)."""

    def open(self, d: str) -> Cursor: ...

    def lstat(self, path: str, hint: Any) -> int:
        """pfind's find_do_lstat: 1 if the file matches -size and -newer, else 0."""


class Net(ABC):
    """pfind's messages, from one rank's side."""

    @abstractmethod
    def requests(self) -> list[int]:
        """The ranks that asked this one for work since the last call."""

    @abstractmethod
    def respond(self, thief: int, items: list[Item]) -> None: ...

    @abstractmethod
    def ask(self, victim: int) -> None: ...

    @abstractmethod
    def answer(self) -> list[Item] | None:
        """The work the asked rank gave (maybe none), or None while it has not answered."""

    @abstractmethod
    def token(self) -> int | None:
        """The finalize token from the left neighbour (its phase), if it came."""

    @abstractmethod
    def pass_token(self, right: int, phase: int) -> None: ...

    def check(self) -> None:  # noqa: B027 - most nets cannot be aborted
        """Raise if the run was aborted (a rank died: nobody will answer)."""

    def finish(self) -> None:  # noqa: B027 - most nets have nothing in flight
        """After this rank's walk: wait for what it still sends."""


class SoloNet(Net):
    """One rank: nobody to ask, nobody asking."""

    def requests(self) -> list[int]:
        return []

    def respond(self, thief: int, items: list[Item]) -> None:
        raise AssertionError("no other rank")

    def ask(self, victim: int) -> None:
        raise AssertionError("no other rank")

    def answer(self) -> list[Item] | None:
        return []

    def token(self) -> int | None:
        return None

    def pass_token(self, right: int, phase: int) -> None:
        raise AssertionError("no other rank")


@dataclass
class Monitor:
    """pfind's per-rank monitor (io500 writes it to find.csv)."""

    steal_inbound: int = 0  # requests answered
    work_send: int = 0  # items given away
    steal_tries: int = 0  # requests sent
    work_stolen: int = 0  # items received
    tokens_send: int = 0
    lstats: int = 0
    dirs: int = 0


@dataclass
class Walker:
    """One rank's pfind: its queue (``work``, the top last), its excess directories, the
    directory it is reading, and its counts (``files``: pfind's total_files, ``found``)."""

    rank: int
    size: int
    lister: Lister
    net: Net
    rand: Callable[[], int] = field(default_factory=GlibcRand)
    queue_length: int = QUEUE_LENGTH
    max_entries: int = MAX_ENTRIES_PER_ITER
    work: list[Item] = field(default_factory=list)
    excess: list[str] = field(default_factory=list)
    current: Cursor | None = None
    files: int = 0
    found: int = 0
    mon: Monitor = field(default_factory=Monitor)

    # -- the work of one item (find_process_one_item) ---------------------------------
    def completed(self) -> bool:
        return not self.work and not self.excess and self.current is None

    def process_one_item(self) -> None:
        if self.current is not None:
            self._read(self.current)
        elif self.excess:
            self.readdir(self.excess.pop())
        else:
            kind, path, hint = self.work.pop()
            if kind == "d":
                self.readdir(path)
            else:
                self.lstat(path, hint)

    def readdir(self, d: str) -> None:
        self.mon.dirs += 1
        self._read(self.lister.open(d))

    def lstat(self, path: str, hint: Any) -> None:
        self.files += 1
        self.mon.lstats += 1
        self.found += self.lister.lstat(path, hint)

    def _read(self, cur: Cursor) -> None:
        """One find_do_readdir call: a chunk of the directory, its items queued."""
        try:
            files, found, items, finished = cur.chunk(
                self.max_entries, self.queue_length - len(self.work)
            )
        except BaseException:
            self.current = None
            raise
        self.files += files
        self.found += found
        if items and items[-1][0] in ("D", "F"):  # the queue was full
            kind, path, hint = items.pop()
            if kind == "D":
                self.excess.append(path)
            else:
                self.lstat(path, hint)
        self.work.extend(items)
        self.current = None if finished else cur

    # -- the messages ------------------------------------------------------------------
    def give(self) -> list[Item]:
        """Answer a steal request: the top half of the queue (pfind sends
        ``work[pending_work - n .. pending_work)`` after ``pending_work -= n``), then as
        many excess directories moved into the queue, the last first. Hints stay here."""
        n = len(self.work) // 2
        cut = len(self.work) - n
        out = [(k, p, None) for k, p, _ in self.work[cut:]]
        del self.work[cut:]
        for _ in range(min(n, len(self.excess))):
            self.work.append(("d", self.excess.pop(), None))
        self.mon.steal_inbound += 1
        self.mon.work_send += n
        return out

    def start(self, root: str) -> None:
        """pfind_find's state before its loop: rank 0 holds the start directory and the
        token."""
        if self.rank == 0:
            self.work.append(("d", root, None))
        self._have_token = self.rank == 0
        self._worked_after_token = True
        self._phase = 0
        self._asked: int | None = None  # the rank asked for work, until it answers

    def run(self, root: str) -> None:
        """pfind_find's loop, from its start to this rank's end."""
        self.start(root)
        step = self.step
        while not step():
            pass

    def step(self) -> bool:
        """One turn of pfind_find's loop (or of its spin while it waits for work it
        asked for); True once this rank has ended."""
        net = self.net
        if self._asked is not None:
            got = net.answer()
            if got is None:
                for thief in net.requests():
                    self.mon.steal_inbound += 1
                    net.respond(thief, [])
                net.check()
                return False
            self._asked = None
            self.mon.work_stolen += len(got)
            self.work = got
            if got:
                self._worked_after_token = True
            return False
        done = self.completed()
        if not done:
            self.process_one_item()
        else:
            net.check()
        tok = net.token()
        if tok is not None:
            self._phase, self._have_token = tok, True
        if done and self._have_token:
            if self._worked_after_token:
                self._phase = 0
            elif self.rank == 0:
                self._phase += 1
            right = (self.rank + 1) % self.size
            if self.size == 1 or (right == 0 and self._phase == LAST_PHASE):
                return True
            net.pass_token(right, self._phase)
            self.mon.tokens_send += 1
            if self._phase == LAST_PHASE:
                return True
            self._worked_after_token = self._have_token = False
        for thief in net.requests():
            net.respond(thief, self.give())
        if not self.work and self._phase < 2:
            victim = self.rand() % self.size
            if victim != self.rank:  # ask, then spin (the next turns) until it answers
                self.mon.steal_tries += 1
                net.ask(victim)
                self._asked = victim
        return False


class LocalNet(Net):
    """pfind's messages between the processes of one node, all in shared memory, which
    every rank polls as Open MPI's shared-memory ranks poll theirs (no system call, no
    sleep). ``req[v * size + t]`` is set by rank t asking rank v; ``tok[r]`` holds the
    token's phase + 1 for rank r; ``stop`` ends every spinning rank (a rank failed). The
    work handed to rank t goes through its mailbox: ``slot[t]``, room for ``SLOT_ITEMS``
    of pfind's work_t (:data:`WORK_T`), and ``box[t]``'s counters (fragments posted and
    taken, and the posted fragment's items and whether more follow). Made in the parent
    (:meth:`make`), bound to a rank in each (:meth:`at`).

    An answer is handed over as pfind's MPI_Send of it over Open MPI's shared memory:
    an empty one is eager (posted, the giver goes on); one with work items (4,120 bytes
    each, over the 4 KiB eager limit) by rendezvous: the giver waits, spinning, until the
    asker, spinning in its own wait, has taken it. The giver packs the items straight
    into the mailbox and the asker unpacks them from there (one copy, as the asker's
    single-copy read of the giver's buffer); an answer over ``SLOT_ITEMS`` goes in
    fragments, each taken before the next is posted."""

    SLOT_ITEMS = 256  # ~1 MiB a rank: an answer of more items goes in fragments
    POSTED, TAKEN, COUNT, MORE = range(4)  # box[t * 4 + field]

    def __init__(
        self,
        size: int,
        req: Any,
        tok: Any,
        box: Any,
        slots: Any,
        stop: Any,
        rank: int = 0,
    ) -> None:
        self.size, self.rank = size, rank
        self._req, self._tok, self._box, self._slots = req, tok, box, slots
        self._stop = stop
        self._slot_bytes = self.SLOT_ITEMS * WORK_T.size
        self._view: memoryview | None = None  # the mailboxes' bytes (not pickled: at())

    @classmethod
    def make(cls, ctx: Any, size: int) -> LocalNet:
        return cls(
            size,
            ctx.RawArray("i", size * size),
            ctx.RawArray("i", size),
            ctx.RawArray("q", size * 4),
            ctx.RawArray("c", size * cls.SLOT_ITEMS * WORK_T.size),
            ctx.RawValue("i", 0),
        )

    def at(self, rank: int) -> LocalNet:
        """This net as rank ``rank`` sees it, cleared for a new walk (before the barrier
        that starts it: nobody answers this rank before it asks)."""
        net = LocalNet(self.size, self._req, self._tok, self._box, self._slots, self._stop, rank)
        net._view = memoryview(self._slots).cast("B")
        row = rank * self.size
        for t in range(self.size):
            self._req[row + t] = 0
        self._tok[rank] = 0
        for f in range(4):  # an answer left by an aborted walk
            self._box[rank * 4 + f] = 0
        return net

    def stop(self) -> None:
        self._stop.value = 1

    def close(self) -> None:
        if self._view is not None:
            self._view.release()

    def requests(self) -> list[int]:
        row = self.rank * self.size
        asked = self._req[row : row + self.size]
        if not any(asked):
            return []
        out = [t for t, a in enumerate(asked) if a]
        for t in out:
            self._req[row + t] = 0
        return out

    def respond(self, thief: int, items: list[Item]) -> None:
        box, b, view = self._box, thief * 4, self._view
        assert view is not None  # at() made this net
        base = thief * self._slot_bytes
        pack, step = WORK_T.pack_into, WORK_T.size
        for k in range(0, max(1, len(items)), self.SLOT_ITEMS):
            part = items[k : k + self.SLOT_ITEMS]
            for i, (kind, path, _) in enumerate(part):
                pack(view, base + i * step, path.encode(), 0, 0, kind.encode())
            box[b + self.COUNT] = len(part)
            box[b + self.MORE] = int(k + self.SLOT_ITEMS < len(items))
            posted = box[b + self.POSTED] + 1
            box[b + self.POSTED] = posted  # last: the asker reads the fields above after it
            if len(part) * step <= EAGER_LIMIT:
                return  # eager (an empty answer): the asker takes it when it looks
            while box[b + self.TAKEN] != posted:  # MPI_Send of a rendezvous message
                self.check()

    def ask(self, victim: int) -> None:
        self._req[victim * self.size + self.rank] = 1

    def answer(self) -> list[Item] | None:
        box, b, view = self._box, self.rank * 4, self._view
        if box[b + self.POSTED] == box[b + self.TAKEN]:
            return None
        assert view is not None
        base = self.rank * self._slot_bytes
        out: list[Item] = []
        while True:
            posted = box[b + self.POSTED]
            if posted == box[b + self.TAKEN]:  # the next fragment is not posted yet
                self.check()
                continue
            n, more = box[b + self.COUNT], box[b + self.MORE]
            out += unpack_work(view[base : base + n * WORK_T.size])
            box[b + self.TAKEN] = posted  # the giver may reuse the slot now
            if not more:
                return out

    def token(self) -> int | None:
        t = self._tok[self.rank]
        if not t:
            return None
        self._tok[self.rank] = 0
        return int(t) - 1

    def pass_token(self, right: int, phase: int) -> None:
        self._tok[right] = phase + 1

    def check(self) -> None:
        if self._stop.value:
            raise RuntimeError("find: the run was aborted while this rank waited for work")


class MpiNet(Net):
    """pfind's messages over MPI (mpi4py), with pfind's tags: a request is an empty
    message to the victim, the answer a message back with the jobs as pfind's bytes
    (:func:`pack_work`, sent with MPI_Send as pfind sends them), the token a message to
    the right neighbour."""

    COMPLETE, STEAL, STEAL_RESPONSE = 777, 800, 820

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI  # optional dependency (pfs[mpi])

        self._mpi, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._left = (self.rank - 1) % self.size
        self._victim = -1
        self._sends: list[Any] = []  # requests and tokens in flight (pfind's MPI_Bsend)

    def _status(self) -> Any:
        return self._mpi.Status()

    def requests(self) -> list[int]:
        out = []
        st = self._status()
        while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=self.STEAL, status=st):
            self.comm.recv(source=st.Get_source(), tag=self.STEAL)
            out.append(st.Get_source())
        return out

    def respond(self, thief: int, items: list[Item]) -> None:
        data = pack_work(items)
        self.comm.Send([data, self._mpi.BYTE], dest=thief, tag=self.STEAL_RESPONSE)

    def ask(self, victim: int) -> None:
        self._victim = victim
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.isend(None, dest=victim, tag=self.STEAL))

    def answer(self) -> list[Item] | None:
        st = self._status()
        if not self.comm.Iprobe(source=self._victim, tag=self.STEAL_RESPONSE, status=st):
            return None
        buf = bytearray(st.Get_count(self._mpi.BYTE))
        self.comm.Recv([buf, self._mpi.BYTE], source=self._victim, tag=self.STEAL_RESPONSE)
        return unpack_work(buf)

    def token(self) -> int | None:
        if not self.comm.Iprobe(source=self._left, tag=self.COMPLETE):
            return None
        return int(self.comm.recv(source=self._left, tag=self.COMPLETE))

    def pass_token(self, right: int, phase: int) -> None:
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.isend(phase, dest=right, tag=self.COMPLETE))

    def finish(self) -> None:
        for r in self._sends:
            r.Wait()
        self._sends = []


# -- listers ---------------------------------------------------------------------------
class StoreCursor:
    """A directory of a :class:`pfs.bench.io500_store.Store`, listed at once and handed
    out in pfind's chunks (the Python loops: without the C library, or the native client)."""

    def __init__(
        self, d: str, entries: list[tuple[str, bool, Any]], name_matches: Callable[[str], bool]
    ) -> None:
        self.dir, self._entries, self._i = d, entries, 0
        self._name_matches = name_matches

    def chunk(self, max_entries: int, room: int) -> tuple[int, int, list[Item], bool]:
        files = processed = 0
        items: list[Item] = []
        entries, d = self._entries, self.dir
        while self._i < len(entries):
            if processed > max_entries:
                return files, 0, items, False
            name, is_dir, hint = entries[self._i]
            self._i += 1
            processed += 1
            if not is_dir and not self._name_matches(name):
                files += 1
                continue
            kind = "d" if is_dir else "f"
            if len(items) >= room:
                items.append((kind.upper(), f"{d}/{name}", hint))
                return files, 0, items, False
            items.append((kind, f"{d}/{name}", hint))
        return files, 0, items, True

    def close(self) -> None:
        self._entries = []


class StoreLister:
    """pfind's reads and lstats through a Store (scan_with_hints, scan_stat)."""

    def __init__(self, store: Any, size: int, newer: int, name: str) -> None:
        self.store, self.size, self.newer, self.name = store, size, newer, name

    def open(self, d: str) -> StoreCursor:
        return StoreCursor(d, self.store.scan_with_hints(d), lambda n: self.name in n)

    def lstat(self, path: str, hint: Any) -> int:
        d, _, name = path.rpartition("/")
        size, ctime_ns, _ = self.store.scan_stat(d, name, hint)
        return int(size == self.size and ctime_ns // 1_000_000_000 >= self.newer)


class CLister:
    """pfind's reads and lstats in C (io500_loops.c)."""

    def __init__(self, loops: Any, size: int, newer: int) -> None:
        self.loops, self.size, self.newer = loops, size, newer

    def open(self, d: str) -> Cursor:
        cur: Cursor = self.loops.find_open(d, self.size, self.newer)
        return cur

    def lstat(self, path: str, hint: Any) -> int:
        return int(self.loops.find_lstat(path, self.size, self.newer))

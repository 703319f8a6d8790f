"""The data path, sans-IO: what to send where for a read, write or fsync of a file range.

A plan is a generator. It yields *effects* — :class:`Send` a request to a server,
:class:`Parallel` sub-plans, :class:`Renew` the capability, :class:`LocalFd` /
:class:`LocalRead` for short-circuit objects, :class:`MetaCall` and :class:`Sleep` for the
metadata plans of :mod:`pfs.client.ops` — and is sent each effect's result, or thrown the
``OSError`` it raised. It opens nothing and waits for nothing (h11's idea), so every
data-path rule lives here once and is tested without a socket (tests/unit/test_plan.py):

- a range is cut into per-stripe *runs* (contiguous in the object, at most MAX_REQUEST);
  one request per run, its reply scattered over the caller's buffer;
- a read tries a stripe's replicas in order (those that failed lately last); with a
  :class:`~pfs.client.health.Health`, a replica that has not answered by its deadline
  (measured latency, bounded) is *hedged*: the next one is asked too, the first good
  answer wins (:class:`Hedge`); a short reply is a hole, read as zeros;
- a write goes to its stripe's chain head only, naming the members after it: the head
  applies it and forwards it down the chain, and answers once the tail has it
  (docs/architecture.md "Replication"; :func:`stripes_of` says which stripes a handle
  must sync for it); a sync (close, fsync) is one request per server listing the
  objects written there (:func:`sync_targets`), every replica must answer;
- a server that says the chain version is stale (``CHAIN_STALE``) has the handle fetch
  its layout again (:class:`Refresh`) and the operation retried;
- a failure is classified (:func:`classify`): renew the capability and retry here,
  try the next replica, or give up with its errno; a refused connection is reported to
  the metaserver (:class:`Report`).

A small request of one piece is planned as a *step* (:func:`read_step`,
:func:`write_step`): the general plan's first effect, built by a plain call, when that
effect is all it takes to succeed; a failure goes on in the general plan (:func:`resume`).

Two drivers carry plans out: :class:`pfs.client.trio_driver.TrioDriver` (many requests in
flight) and :class:`pfs.client.blocking_driver.BlockingDriver` (the caller's thread). A
driver that cannot carry out an effect the classification asks for (the blocking one
cannot :class:`Renew` a capability, :class:`Reconnect` to a server that may have moved,
or ask a data server for a descriptor) raises :class:`HandOver`; the operation then runs
again, whole, on the trio driver (a refused or failed request changed nothing that
running it again does not redo).
"""
from __future__ import annotations

import enum
import errno
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pfs.client.health import Health
from pfs.core import errors as E
from pfs.core.layout import Layout, Piece, stripe_extents
from pfs.core.messages import data as D
from pfs.core.messages import meta as M
from pfs.core.messages.base import RequestMessage

T = TypeVar("T")
Plan = Generator[Any, Any, T]

# Largest single request; bigger pieces (huge stripe units) are cut to this.
MAX_REQUEST = 8 << 20


class HandOver(Exception):  # noqa: N818 - a signal between drivers, not an error
    """The driver cannot carry out this effect: run the operation on the trio driver."""


# -- failures -------------------------------------------------------------------------
class Failure(enum.Enum):
    RENEW = "renew"  # the capability was refused: renew it, retry here (nothing changed)
    RECONNECT = "reconnect"  # the connection failed: reconnect (Reconnect), else elsewhere
    ELSEWHERE = "elsewhere"  # this server failed: the next replica
    FINAL = "final"  # the request itself is wrong or cannot fit: the caller's errno


# derived from the one table of failures (pfs.core.errors.FAILURES, docs "Errors")
RENEW_ERRNOS = E.errnos(E.Action.RENEW)
FINAL_ERRNOS = E.errnos(E.Action.FAIL)
# the server could not be reached, or the connection broke or timed out
CONNECTION_ERRNOS = E.errnos(E.Action.RECONNECT)


def classify(exc: OSError) -> Failure:
    code = exc.errno
    if code in RENEW_ERRNOS:
        return Failure.RENEW
    if code in FINAL_ERRNOS:
        return Failure.FINAL
    if code in CONNECTION_ERRNOS:
        return Failure.RECONNECT
    return Failure.ELSEWHERE


# -- effects ------------------------------------------------------------------------
@dataclass(slots=True)
class Send:
    """Request ``msg`` (of :mod:`pfs.core.messages.data`) to data server ``sid``; the
    result is the payload bytes received (into ``into``: a buffer or a list of buffers
    filled in order). The driver checks the reply fits ``msg`` (``EPROTO``)."""

    sid: str
    msg: RequestMessage
    payload: Any = None
    into: Any = None
    reply: bool = False  # the result is the reply's fields, not the bytes received


@dataclass(slots=True)
class Hedge:
    """Send ``first``; when it has not answered after ``after`` seconds, send ``second``
    as well and take the first good answer, cancelling the other (the trio driver puts
    ``second``'s reply in a spare buffer, copied over when it wins). The result is
    ``(value, errors)``: ``errors`` is None when one answered (``value``: its result),
    else ``[first's error, second's error or None when it was never sent]``. A driver
    that cannot race (the blocking one) carries ``first`` out alone with ``after`` as its
    deadline and raises its error, which the plan reads as ``[error, None]``."""

    first: Send
    second: Send
    after: float


@dataclass(slots=True)
class Report:
    """Tell the metaserver that ``sid`` refused a connection (``errno``), without
    waiting for it; the driver rate-limits (:meth:`Health.report_due`). Result: None."""

    sid: str
    errno: int


# what a client reports: the server is not there at all, or its process went (a reset);
# a hang is the lease's
REPORT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH})


@dataclass(slots=True)
class Parallel:
    """Run sub-plans at once (the blocking driver: one after the other); the result is
    the list of their results; the first ``OSError`` is raised."""

    plans: list[Plan[Any]]


@dataclass(slots=True)
class Renew:
    """A fresh capability for ``owner`` (a file handle); the result is the new one."""

    owner: Any


@dataclass(slots=True)
class Refresh:
    """A server said the chain version is stale: fetch ``owner``'s layout again (the
    chains' members and versions now); the result is the new :class:`Layout`."""

    owner: Any


@dataclass(slots=True)
class Reconnect:
    """The connection to ``sid`` failed: the driver reconnects for the next request
    (the trio driver's connections do, looking the server up again when it moved); a
    driver that cannot hands the operation over. Then the plan goes on: the next
    replica for a read, the error for a write."""

    sid: str


@dataclass(slots=True)
class LocalFd:
    """Ask the stripe's local server for a descriptor of its object (short circuit);
    the result is the descriptor, or None: read over the network."""

    local: Any
    replicas: tuple[str, ...]
    ino: int
    stripe: int
    cap: bytes | None


@dataclass(slots=True)
class LocalRead:
    """Read consecutive object bytes at ``obj_off`` of ``fd`` into ``dests``; the result
    is the bytes there were for each destination."""

    local: Any
    fd: int
    obj_off: int
    dests: list[memoryview]


@dataclass(slots=True)
class MetaCall:
    """Request ``msg`` (of :mod:`pfs.core.messages.meta`) to the metaserver; the result
    is its typed reply (``EPROTO`` when the reply does not fit)."""

    msg: RequestMessage


@dataclass(slots=True)
class DeferClose:
    """Release handle ``fh`` with the next metadata request, if the connection does that
    (``MetaClient.defer_close``); the result says whether it did. ``unwritten``: the
    handle sent nothing to a data server."""

    fh: int
    generation: int
    unwritten: bool = False


@dataclass(slots=True)
class Sleep:
    seconds: float


@dataclass(slots=True)
class ToDevice:
    """Copy ``n`` bytes at ``src_off`` of ``stager``'s pinned buffer to device address
    ``dst_ptr`` on the stream of ``slot`` (asynchronous: :class:`DeviceWait` ends it)."""

    stager: Any
    slot: int
    dst_ptr: int
    src_off: int
    n: int


@dataclass(slots=True)
class DeviceWait:
    """Wait until the copy from ``stager``'s ``slot`` is done (the slot is free)."""

    stager: Any
    slot: int


@dataclass(slots=True)
class Call:
    """Await ``fn(*args)`` (a source the caller supplies, e.g. another kind of file)."""

    fn: Any
    args: tuple[Any, ...]


class LocalObjects(Protocol):
    """What a plan asks of a handle's short-circuit descriptors (no I/O)."""

    def tried(self, stripe: int) -> bool: ...

    def known_fd(self, stripe: int) -> int | None: ...


# -- requests: one builder per data RPC ------------------------------------------------
def read_request(ino: int, stripe: int, off: int, length: int, cap: bytes | None,
                 layout: Layout | None = None) -> D.Read:
    if layout is not None and layout.chains:
        cid, ver = layout.chain_of(stripe)
        return D.Read(obj=(ino, stripe), off=off, len=length, cap=cap, chain=cid, ver=ver)
    return D.Read(obj=(ino, stripe), off=off, len=length, cap=cap)


def write_request(ino: int, stripe: int, off: int, cap: bytes | None,
                  layout: Layout | None = None) -> D.Write:
    """A write of a stripe to its chain's head, naming the members after it."""
    if layout is None:
        return D.Write(obj=(ino, stripe), off=off, cap=cap)
    cid, ver = layout.chain_of(stripe)
    rest = list(layout.servers[stripe][1:])
    return D.Write(obj=(ino, stripe), off=off, cap=cap, chain=cid or None,
                   ver=ver if cid else None, fwd=rest or None)


def sync_request(ino: int, stripes: Sequence[int], cap: bytes | None) -> D.Sync:
    return D.Sync(objs=[(ino, s) for s in stripes], cap=cap)


def fsync_request(ino: int, stripe: int, cap: bytes | None) -> D.Fsync:
    return D.Fsync(obj=(ino, stripe), cap=cap)


def open_fd_request(ino: int, stripe: int, cap: bytes | None) -> D.OpenFd:
    return D.OpenFd(obj=(ino, stripe), cap=cap)


# -- pieces ---------------------------------------------------------------------------
def one_piece(layout: Layout, off: int, length: int) -> tuple[int, int] | None:
    """``(stripe, object offset)`` of a range that is one piece of one request (the
    common small case), else None."""
    unit = layout.unit
    block, within = divmod(off, unit)
    if length <= MAX_REQUEST and 0 < length <= unit - within:
        row, stripe = divmod(block, layout.count)
        return stripe, row * unit + within
    return None


def runs(layout: Layout, off: int, length: int) -> list[list[Piece]]:
    """Per-stripe runs of pieces, each contiguous in its object and at most MAX_REQUEST."""
    one = one_piece(layout, off, length)
    if one is not None:
        return [[Piece(one[0], one[1], off, length)]]
    unit = layout.unit
    out: list[list[Piece]] = []
    for ext in stripe_extents(unit, layout.count, off, length):
        run: list[Piece] = []
        size = 0
        for p in _split(ext.pieces):
            if run and size + p.length > MAX_REQUEST:
                out.append(run)
                run, size = [], 0
            run.append(p)
            size += p.length
        if run:
            out.append(run)
    return out


@dataclass(frozen=True, slots=True)
class LocalChunk:
    """Consecutive bytes of one stripe's object (from ``obj_off``) for ``dests`` in
    order; ``file_offs``: where in the file each destination's bytes are."""

    stripe: int
    obj_off: int
    dests: list[memoryview]
    file_offs: list[int]

    @property
    def length(self) -> int:
        return sum(len(d) for d in self.dests)


LOCAL_IOV_MAX = 1024  # Linux's IOV_MAX: destinations of one preadv


def local_chunks(layout: Layout, reads: Sequence[tuple[int, memoryview]],
                 chunk: int) -> list[LocalChunk]:
    """Many reads ``(file offset, buffer)`` of one file regrouped by object: per stripe,
    the pieces in object order, pieces that continue one another joined into chunks of
    about ``chunk`` bytes (one ``preadv`` each for a short-circuit reader). A piece
    never splits: a chunk ends at a piece's edge, so it is the units of an object, not
    the file's, that decide how large a read is (with a 1 MiB unit and 4 stripes, a
    16 MiB region is four 4 MiB reads, one per object, not sixteen). Chunks come in
    the order of their first byte in the file: readers taking them in turn fill the
    buffers front to back (the loader faults them in from the far end meanwhile)."""
    by_stripe: dict[int, list[tuple[int, memoryview, int]]] = {}
    for off, buf in reads:
        for run in runs(layout, off, len(buf)) if len(buf) else ():
            for p in run:
                at = p.file_off - off
                by_stripe.setdefault(p.stripe, []).append(
                    (p.obj_off, buf[at:at + p.length], p.file_off))
    out: list[LocalChunk] = []
    for stripe in sorted(by_stripe):
        cur: LocalChunk | None = None
        end = size = 0
        for obj_off, view, file_off in sorted(by_stripe[stripe], key=lambda x: x[0]):
            if (cur is not None and obj_off == end and size + len(view) <= chunk
                    and len(cur.dests) < LOCAL_IOV_MAX):
                cur.dests.append(view)
                cur.file_offs.append(file_off)
                size += len(view)
            else:
                cur = LocalChunk(stripe, obj_off, [view], [file_off])
                out.append(cur)
                size = len(view)
            end = obj_off + len(view)
    out.sort(key=lambda c: c.file_offs[0])  # front to back, as a caller fills buffers
    return out


def _split(pieces: Sequence[Piece]) -> Any:
    for p in pieces:
        if p.length <= MAX_REQUEST:
            yield p
            continue
        for start in range(0, p.length, MAX_REQUEST):
            n = min(MAX_REQUEST, p.length - start)
            yield Piece(p.stripe, p.obj_off + start, p.file_off + start, n)


def fill_hole(dests: Sequence[memoryview], got: int) -> None:
    """Zeros after the first ``got`` bytes of ``dests`` (taken in order): a reply short
    of the request ended past the object's end, a hole up to the file size."""
    for d in dests:
        if got >= len(d):
            got -= len(d)
            continue
        d[got:] = bytes(len(d) - got)
        got = 0


def zero_unread(dests: Sequence[memoryview], counts: Sequence[int]) -> None:
    """Zeros after the bytes a local read found for each destination: past the
    object's end, a hole up to the file size."""
    for d, n in zip(dests, counts, strict=True):
        if n < len(d):
            d[n:] = bytes(len(d) - n)


def _views(buf: memoryview, base: int, run: list[Piece]) -> list[memoryview]:
    return [buf[p.file_off - base:p.file_off - base + p.length] for p in run]


# -- plans ----------------------------------------------------------------------------
def one(effect: Any) -> Plan[Any]:
    """A plan of one effect (an item of :class:`Parallel`)."""
    return (yield effect)


def send(effect: Send) -> Plan[int]:
    """One request with no other server to try (a write, an fsync: every replica must
    answer): a failed connection is still reconnected for the next request."""
    try:
        return (yield effect)
    except OSError as exc:
        if classify(exc) is Failure.RECONNECT:
            yield Reconnect(effect.sid)
        raise


def from_replicas(replicas: Sequence[str], msg: RequestMessage, *,
                  payload: Any = None, into: Any = None,
                  health: Health | None = None) -> Plan[int]:
    """Send to each replica in turn until one answers; a failure that is not the
    server's (a refused capability, a bad request) ends it at once. With ``health`` (a
    read): replicas that failed lately go last, and each but the last is hedged with the
    next after its deadline."""
    err: OSError | None = None
    last = ""
    order = replicas if health is None else health.order(replicas)
    i, n = 0, len(order)
    while i < n:
        sid = order[i]
        if health is None or i + 1 == n:
            tried: Sequence[str] = (sid,)
            try:
                return (yield Send(sid, msg, payload, into))
            except OSError as exc:
                errors: list[OSError | None] = [exc]
        else:
            tried = (sid, order[i + 1])
            hedge = Hedge(Send(sid, msg, payload, into), Send(order[i + 1], msg, payload, into),
                          health.deadline(sid, getattr(msg, "len", 0)))
            try:
                value, raced = yield hedge
            except OSError as exc:  # a driver that sent only the first
                value, raced = None, [exc, None]
            if raced is None:
                return value  # type: ignore[no-any-return]
            errors = raced
        for tsid, failed in zip(tried, errors, strict=False):
            if failed is None:
                continue
            i += 1
            kind = classify(failed)
            if kind is Failure.RECONNECT:
                if failed.errno in REPORT_ERRNOS:
                    yield Report(tsid, failed.errno)
                yield Reconnect(tsid)
            elif kind is not Failure.ELSEWHERE:
                raise failed
            err = failed
            last = tsid
    if err is None:
        raise OSError(errno.EIO, "no data server holds this stripe")
    if err.errno == errno.ETIMEDOUT:
        raise OSError(errno.ETIMEDOUT, f"data server {last}: {err.strerror}")
    raise err


def with_cap(owner: Any, cap: bytes | None, renew_due: bool,
             body: Any) -> Plan[Any]:
    """Run ``body(cap)`` with a capability that is renewed first when due, and once more
    when a server refuses it (expired, or stale after a truncation)."""
    if renew_due:
        cap = yield Renew(owner)
    try:
        return (yield from body(cap))
    except OSError as exc:
        if cap is None or classify(exc) is not Failure.RENEW:
            raise
    cap = yield Renew(owner)
    return (yield from body(cap))


def _all(plans: list[Plan[Any]]) -> Plan[Any]:
    if len(plans) == 1:
        return [(yield from plans[0])]
    return (yield Parallel(plans))


def read_run(ino: int, layout: Layout, base: int, buf: memoryview, run: list[Piece],
             cap: bytes | None, local: LocalObjects | None = None,
             health: Health | None = None) -> Plan[None]:
    """One stripe's run: from a local descriptor when there is one, else from the first
    replica that answers (hedged, with ``health``); holes read as zeros. A stripe no
    replica answered in time is ``ETIMEDOUT`` naming it and the server."""
    first = run[0]
    stripe, obj_off = first.stripe, first.obj_off
    if len(run) == 1:
        start = first.file_off - base
        dests = [buf[start:start + first.length]]
    else:
        dests = _views(buf, base, run)
    if local is not None:
        fd = (local.known_fd(stripe) if local.tried(stripe)
              else (yield LocalFd(local, layout.servers[stripe], ino, stripe, cap)))
        if fd is not None:
            try:
                zero_unread(dests, (yield LocalRead(local, fd, obj_off, dests)))
                return
            except OSError as exc:
                # a block that did not verify (or a write landing meanwhile): the
                # servers check again under their block locks, replica by replica
                if exc.errno != errno.EIO:
                    raise
    total = first.length if len(run) == 1 else sum(p.length for p in run)
    replicas = layout.servers[stripe]
    try:
        got = yield from from_replicas(replicas, read_request(ino, stripe, obj_off, total, cap,
                                                        layout),
                                       into=dests[0] if len(dests) == 1 else dests,
                                       health=health if len(replicas) > 1 else None)
    except OSError as exc:
        if exc.errno != errno.ETIMEDOUT:
            raise
        raise OSError(errno.ETIMEDOUT,
                      f"inode {ino} stripe {stripe}: {exc.strerror}") from None
    if got < total:
        fill_hole(dests, got)


def _read_all(ino: int, layout: Layout, off: int, buf: memoryview, rs: list[list[Piece]],
              cap: bytes | None, local: LocalObjects | None,
              health: Health | None) -> Plan[None]:
    if len(rs) == 1:
        yield from read_run(ino, layout, off, buf, rs[0], cap, local, health)
    else:
        yield Parallel([read_run(ino, layout, off, buf, run, cap, local, health)
                        for run in rs])


def read(owner: Any, ino: int, layout: Layout, off: int, buf: memoryview,
         cap: bytes | None, *, renew_due: bool = False,
         local: LocalObjects | None = None, health: Health | None = None) -> Plan[None]:
    """Fill ``buf`` with the file's bytes from ``off`` (the caller bounds it by the size).
    The capability is renewed first when due, and once more when a server refuses it
    (as :func:`with_cap`; written out here: this is the small reads' hot path).
    ``health``: order replicas and hedge slow ones (:func:`from_replicas`)."""
    if renew_due:
        cap = yield Renew(owner)
    rs = runs(layout, off, len(buf))
    try:
        if len(rs) == 1:  # the small reads' case, without a level of generators
            yield from read_run(ino, layout, off, buf, rs[0], cap, local, health)
        else:
            yield from _read_all(ino, layout, off, buf, rs, cap, local, health)
        return
    except OSError as exc:
        if exc.errno == D.CHAIN_STALE:  # every replica said so: the chains now, once
            layout = yield Refresh(owner)
            yield from _read_all(ino, layout, off, buf, runs(layout, off, len(buf)), cap,
                                 local, health)
            return
        if cap is None or classify(exc) is not Failure.RENEW:
            raise
    cap = yield Renew(owner)
    yield from _read_all(ino, layout, off, buf, rs, cap, local, health)


def write_run(ino: int, layout: Layout, base: int, data: memoryview, run: list[Piece],
              cap: bytes | None) -> Plan[Any]:
    """One stripe's run to its chain's head; its answer means every member has it."""
    srcs = _views(data, base, run)
    payload = srcs[0] if len(srcs) == 1 else srcs
    stripe = run[0].stripe
    msg = write_request(ino, stripe, run[0].obj_off, cap, layout)
    head = layout.servers[stripe][0]
    try:
        return (yield from send(Send(head, msg, payload, reply=True)))
    except OSError as exc:
        cid, _ver = layout.chain_of(stripe)
        if classify(exc) is not Failure.RECONNECT or not cid or len(msg.fwd or ()) == 0:
            raise
        # the head is gone: the metaserver (having checked) takes it out of the chain,
        # and the write goes again to the new head
        try:
            yield MetaCall(M.ChainDrop(chain=cid, sid=head))
        except OSError:  # it answers the metaserver, or is the last member: as it was
            raise exc from None
        raise OSError(D.CHAIN_STALE, f"chain {cid}: its head {head} is unreachable "
                                     f"({exc.strerror or exc})") from exc


MAX_REFRESH = 8  # layouts fetched again for one operation before its CHAIN_STALE stands


def write(owner: Any, ino: int, layout: Layout, off: int, data: memoryview,
          cap: bytes | None, *, renew_due: bool = False) -> Plan[None]:
    """Each run to its chain's head; a stale chain version: the layout again, and the
    write again (a write is idempotent: the bytes land where they landed)."""
    for attempt in range(MAX_REFRESH + 1):
        def body(c: bytes | None, lay: Layout = layout) -> Plan[Any]:
            return _all([write_run(ino, lay, off, data, run, c)
                         for run in runs(lay, off, len(data))])
        try:
            got = yield from with_cap(owner, cap, renew_due, body)
        except OSError as exc:
            if exc.errno != D.CHAIN_STALE or attempt == MAX_REFRESH:
                raise
            layout = yield Refresh(owner)
            renew_due = False
            continue
        if owner is not None and any(isinstance(r, dict) and r.get("ver") is not None
                                     for r in got):
            yield Refresh(owner)  # a chain changed under this write: the close syncs
        return


def stripes_of(layout: Layout, off: int, length: int) -> range | tuple[int, ...]:
    """The stripes a write of ``[off, off+length)`` touches (what a later sync must
    reach), without walking a large range piece by piece."""
    unit, count = layout.unit, layout.count
    if length <= 0:
        return ()
    first, last = off // unit, (off + length - 1) // unit
    if last - first + 1 >= count:
        return range(count)
    return tuple(b % count for b in range(first, last + 1))


def sync_targets(layout: Layout, stripes: Iterable[int]) -> dict[str, list[int]]:
    """Server -> the stripes whose objects it holds (a replica of), in stripe order:
    what one sync request to that server lists."""
    out: dict[str, list[int]] = {}
    for stripe in sorted(set(stripes)):
        for sid in layout.servers[stripe] if stripe < len(layout.servers) else ():
            out.setdefault(sid, []).append(stripe)
    return out


def sync(owner: Any, ino: int, layout: Layout, stripes: Iterable[int], cap: bytes | None,
         *, renew_due: bool = False) -> Plan[None]:
    """The objects of ``stripes``, on every replica, to stable storage: one request per
    server (batched like NFS's COMMIT), all at once; every one must answer."""
    stripes = sorted(set(stripes))
    for attempt in range(MAX_REFRESH + 1):
        targets = sync_targets(layout, stripes)
        if not targets:
            return

        def body(c: bytes | None, lay: Layout = layout,
                 ts: dict[str, list[int]] = targets) -> Plan[Any]:
            return _all([_sync_member(lay, sid, ino, ss, c) for sid, ss in ts.items()])
        try:
            yield from with_cap(owner, cap, renew_due, body)
            return
        except OSError as exc:
            if exc.errno != D.CHAIN_STALE or attempt == MAX_REFRESH:
                raise
        # a member was taken out: what the chains hold now is what must be synced
        layout = yield Refresh(owner)
        renew_due = False


def _sync_member(layout: Layout, sid: str, ino: int, stripes: list[int],
                 cap: bytes | None) -> Plan[Any]:
    """:func:`sync_server`, and when ``sid`` cannot be reached and its chains have other
    members: have the metaserver take it out of them (it checks), then CHAIN_STALE (the
    sync goes again to the members left)."""
    try:
        return (yield from sync_server(sid, ino, stripes, cap))
    except OSError as exc:
        if classify(exc) is not Failure.RECONNECT:
            raise
        chains = {layout.chain_of(s)[0] for s in stripes
                  if s < len(layout.servers) and len(layout.servers[s]) > 1}
        chains.discard(0)
        if not chains:
            raise
        try:
            for cid in sorted(chains):
                yield MetaCall(M.ChainDrop(chain=cid, sid=sid))
        except OSError:  # it answers the metaserver, or is the last member: as it was
            raise exc from None
        raise OSError(D.CHAIN_STALE, f"data server {sid} is unreachable "
                                     f"({exc.strerror or exc}): taken out of chains "
                                     f"{sorted(chains)}") from exc


def sync_server(sid: str, ino: int, stripes: list[int], cap: bytes | None) -> Plan[Any]:
    """One server's share of :func:`sync`; a server from before ``sync`` (``ENOSYS``,
    during a rolling upgrade) gets one ``fsync`` per object instead."""
    try:
        return (yield from send(Send(sid, sync_request(ino, stripes, cap))))
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
    return (yield from _all([send(Send(sid, fsync_request(ino, s, cap))) for s in stripes]))


def fsync(owner: Any, ino: int, layout: Layout, cap: bytes | None, *,
          renew_due: bool = False) -> Plan[None]:
    """Every object of the file, on every replica, to stable storage (whoever wrote it)."""
    yield from sync(owner, ino, layout, range(len(layout.servers)), cap,
                    renew_due=renew_due)


# -- steps: small plans without a generator ------------------------------------------
# A request of one piece to one object, when its first effect is all it takes to succeed
# (a descriptor already held, or one replica's reply), is planned as that effect alone,
# a *step*: a plain call builds it as the general plan would build its first effect, the
# driver carries it out inline, and ``read_step_done`` does with the result what the
# general plan does. When the effect fails, :func:`resume` picks the general plan up at
# that effect with the error, so failover, renewal and hand-over are still written once.
def read_step(ino: int, layout: Layout, off: int, buf: memoryview, cap: bytes | None,
              renew_due: bool = False, local: LocalObjects | None = None,
              health: Health | None = None) -> LocalRead | Send | Hedge | None:
    """The step of :func:`read` (same arguments), or None: run the general plan (a
    capability due, more than one piece, a local descriptor not asked for yet)."""
    if renew_due:
        return None
    one = one_piece(layout, off, len(buf))
    if one is None:
        return None
    stripe, obj_off = one
    if local is not None:
        if not local.tried(stripe):
            return None  # LocalFd first: a step of its own
        fd = local.known_fd(stripe)
        if fd is not None:
            return LocalRead(local, fd, obj_off, [buf])
    replicas = layout.servers[stripe]
    msg = read_request(ino, stripe, obj_off, len(buf), cap, layout)
    if health is None or len(replicas) == 1:
        return Send(replicas[0], msg, None, buf)
    order = health.order(replicas)  # as from_replicas: its first effect
    return Hedge(Send(order[0], msg, None, buf), Send(order[1], msg, None, buf),
                 health.deadline(order[0], len(buf)))


def read_step_done(step: LocalRead | Send | Hedge, result: Any) -> None:
    """What :func:`read` does with its step's result: holes read as zeros. A hedge's
    result that is all errors raises the first (:func:`resume` goes on from it)."""
    if isinstance(step, LocalRead):
        if result[0] < len(step.dests[0]):  # a step reads into one destination
            zero_unread(step.dests, result)
        return
    if isinstance(step, Hedge):
        result, errors = result
        if errors is not None:
            raise next(e for e in errors if e is not None)
        step = step.first
    if result < len(step.into):
        fill_hole((step.into,), result)


def write_step(ino: int, layout: Layout, off: int, data: memoryview, cap: bytes | None,
               renew_due: bool = False) -> Send | None:
    """The step of :func:`write` (same arguments): one piece to a stripe's chain head;
    else None."""
    if renew_due:
        return None
    one = one_piece(layout, off, len(data))
    if one is None:
        return None
    stripe, obj_off = one
    return Send(layout.servers[stripe][0], write_request(ino, stripe, obj_off, cap, layout),
                data)


def _same_effect(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is Send:
        return bool(a.sid == b.sid and a.msg.method == b.msg.method)
    if type(a) is LocalRead:
        return bool(a.fd == b.fd and a.obj_off == b.obj_off)
    if type(a) is Hedge:
        return _same_effect(a.first, b.first) and _same_effect(a.second, b.second)
    return False


def resume(general: Plan[T], step: Any, exc: OSError) -> Plan[T]:
    """The general plan of an operation whose step raised ``exc``: its first effect is
    the step's (one rule built both), so the error is thrown there and the plan goes on
    as ever. A first effect that differs (the handle's state changed meanwhile) is
    carried out instead: as if the step had not been tried."""
    try:
        effect = general.send(None)
        if _same_effect(effect, step):
            effect = general.throw(exc)
        while True:
            try:
                value = yield effect
            except OSError as err:  # what drivers throw: the effect's failure
                effect = general.throw(err)
            else:
                effect = general.send(value)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        general.close()


def read_device(stager: Any, dst_ptr: int, off: int, total: int,
                chunk: Callable[[memoryview, int], Plan[int]]) -> Plan[int]:
    """A device destination's executor: ``total`` bytes from ``off`` through
    ``stager``'s pinned host buffer (two halves: the copy of one overlaps the read of
    the next), each half filled by ``chunk(host_view, file_offset)`` (bytes got; short:
    the end). Returns the bytes read."""
    done, slot, half = 0, 0, stager.half
    while done < total:
        n = min(half, total - done)
        yield DeviceWait(stager, slot)
        got = yield from chunk(stager.view[slot * half:slot * half + n], off + done)
        if got:
            yield ToDevice(stager, slot, dst_ptr + done, slot * half, got)
        done += got
        if got < n:
            break
        slot ^= 1
    yield DeviceWait(stager, 0)
    yield DeviceWait(stager, 1)
    return done

"""The metadata service: ``docs/rpc.md``'s metaserver methods over :mod:`namespace`.

``MetaService`` holds the RPC handlers and wires the parts they use, each a module:

- :mod:`pfs.metaserver.commit`: group commit. Reads (getattr, lookup, readdir, ...) run in a
  read transaction on the event loop; every mutation goes through the commit queue, and
  a handler replies only once its batch is on disk.
- :mod:`pfs.metaserver.handles`: open handles per connection, open counts per inode, orphans
  (unlinked while open) and their reclaim.
- :mod:`pfs.metaserver.registry`: which data servers are up, from registrations and
  heartbeats (leases), which are draining; placement and ``statfs`` read it.
- :mod:`pfs.metaserver.detector`: a reported or seen connection refusal, checked with a
  probe of our own before a server is taken out of placement.
- :mod:`pfs.metaserver.dataplane`: the connections to data servers; truncation and deletion
  of objects. Shrinking a file (setattr size, O_TRUNC) first truncates its objects on the
  data servers, then commits the new size, so old bytes never reappear past a later
  extension.
- :mod:`pfs.metaserver.deleter`: deleted files' objects, queued (key ``Q``) in the
  transaction that drops them, deleted on the data servers in the background.
- :mod:`pfs.metaserver.security`: keys, peer authentication, the capability signer.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import trio

from pfs.core import caps, metrics
from pfs.core.config import MetaConfig
from pfs.core.daemon import FD_RESERVE, nofile_limit
from pfs.core.messages import meta as M
from pfs.core.messages.base import Empty
from pfs.core.messages.records import At
from pfs.core.wire.protocol import Limits
from pfs.core.wire.rpc import ConnContext, Reply, Request, RpcService
from pfs.metaserver import batch, watch
from pfs.metaserver import keys as K
from pfs.metaserver.catchup import CatchUp
from pfs.metaserver.commit import CommitQueue, Op, dry_run
from pfs.metaserver.counters import Counters
from pfs.metaserver.dataplane import DataPlane
from pfs.metaserver.deleter import Deleter
from pfs.metaserver.detector import Detector
from pfs.metaserver.handles import OpenFiles, rights_of
from pfs.metaserver.namespace import Cred, Namespace
from pfs.metaserver.registry import Registry, Reserve
from pfs.metaserver.repair import Repair
from pfs.metaserver.security import (
    SERVER_METHODS,
    MetaSecurity,
    cap_signer,
    keep_private,
    meta_security,
)
from pfs.metaserver.store import LmdbStore, Store, WriteTxn

log = logging.getLogger(__name__)


PROBE_TIMEOUT = 2.0  # seconds a chain head a client reports has to answer the metaserver


class MetaService(RpcService):
    name = "meta"
    messages = M.REGISTRY
    # read-only handlers that never wait: answered in the connection's reader task
    inline_methods = frozenset({"hello", "resolve", "lookup", "getattr", "access", "readlink",
                                "readdir", "statfs", "getxattr", "listxattr", "get_layout",
                                "servers", "heartbeat", "renew", "release", "stat_many"})

    def is_inline(self, req: Request) -> bool:
        # an open without O_TRUNC and a close with no size to commit only read and sign
        # (they wait only to reclaim a file deleted while open): no task of their own
        if req.method == "close":
            f = req.fields
            return f.get("written_end") is None and f.get("mtime") is None
        if req.method == "open":
            flags = req.fields.get("flags", os.O_RDONLY)
            return isinstance(flags, int) and not flags & os.O_TRUNC
        return req.method in self.inline_methods

    # changes answered from the group commit itself (``take``)
    taken_methods = frozenset({"create", "mkdir", "mknod", "symlink", "unlink", "rmdir",
                               "close", "commit_size", "setattr", "rename", "link"})

    def take(self, ctx: ConnContext, rid: int, req: Request) -> bool:
        """A change that waits for nothing but its commit (a create without O_TRUNC, an
        entry change, a close or commit of a size, a setattr that cuts no object, a
        rename, a link): checked and queued here, in the reader task, and answered by
        the writer right after the flush that makes it durable, where a handler task
        would wait for the flush, be woken and switched to, and send. Anything else, and
        a request that is not plain (a data server's credentials, a bad field), goes the
        usual way."""
        method = req.method
        ident = ctx.identity
        if method not in self.taken_methods or ident is None or ident.role == "server":
            return False
        try:
            _, msg = self.decode(req)
        except OSError:
            return False  # dispatch answers it, and releases its closes
        if method == "create" and msg.flags & os.O_TRUNC:
            return False  # objects to cut first: the handler waits for that
        if method == "setattr" and self._cuts_objects(ctx, msg):
            return False  # likewise
        started = time.perf_counter() if metrics.enabled() else 0.0
        try:
            if msg.closes:
                self.handles.release_closed(ctx, msg.closes, msg.unwritten)
            if method == "create":
                self._take_create(ctx, rid, msg, started)
            elif method == "close":
                self._take_close(ctx, rid, msg, started)
            elif isinstance(msg, M.EntryChange):
                parent, fn, frees = self._entry_fn(ctx, msg)
                self._take_op(ctx, rid, msg, started, self._entry_op(msg, parent, fn),
                              lambda r: M.EntryReply(attr=r[0], parent_attr=r[1]), frees)
            else:
                fn, reply = self._change_fn(ctx, msg)
                self._take_op(ctx, rid, msg, started, fn, reply)
        except Exception as exc:  # noqa: BLE001 - answered, as a handler's would be
            self.answer(ctx, rid, method, exc, started)
        return True

    def _take_create(self, ctx: ConnContext, rid: int, msg: M.Create, started: float
                     ) -> None:
        """``rpc_create`` (no O_TRUNC) answered from the writer: its reply (a handle,
        a signed capability) is made once the file is durable; if the connection is gone
        by then, or the batch failed, the open count taken in the batch is dropped."""
        cred = self._cred(ctx, msg)
        parent, name = self._at(msg.at, cred)
        mode, flags, want_parent = msg.mode, msg.flags, msg.want_parent

        def op(txn: WriteTxn) -> tuple[dict[str, Any], Any, Any, bool]:
            attr, layout, created = self.ns.create(txn, cred, parent, name, mode, flags)
            self.handles.ref(attr["ino"])
            parent_attr = self.ns.getattr(txn, parent) if want_parent else None
            return attr, layout, parent_attr, created

        def done(o: Op) -> None:
            err = o.error
            if o.result is not None:  # it ran: its open count was taken
                attr, layout, parent_attr, created = o.result
                if err is None and not ctx.conn.closed:
                    try:
                        reply = self.encode(msg, self._opened_reply(
                            ctx, attr, layout, flags, cred, parent_attr, created))
                    except Exception as exc:  # noqa: BLE001 - answered below
                        err = exc
                    else:
                        self.answer(ctx, rid, msg.method, reply, started)
                        return
                self.handles.release_later(attr["ino"])  # nobody gets a handle
            self.answer(ctx, rid, msg.method, err if err is not None else OSError(
                errno.ECONNRESET, "connection closed"), started)

        self.commit.then(op, done)

    def _cuts_objects(self, ctx: ConnContext, req: M.Setattr) -> bool:
        """Whether setattr ``req`` must cut objects on data servers first (or fails
        planning it: the handler raises that)."""
        if req.size is None:
            return False
        try:
            cred = self._cred(ctx, req)
            with self.store.read() as txn:
                return self.ns.truncate_plan(txn, cred, req.ino, req.size) is not None
        except OSError:
            return True

    def _take_op(self, ctx: ConnContext, rid: int, msg: Any, started: float,
                 fn: Callable[[WriteTxn], Any], reply: Callable[[Any], Any],
                 frees: bool = False) -> None:
        """Commit ``fn`` and answer ``reply(its result)`` (or its error) once durable."""
        def done(o: Op) -> None:
            if o.error is not None:
                self.answer(ctx, rid, msg.method, o.error, started)
                return
            self.answer(ctx, rid, msg.method, self.encode(msg, reply(o.result)), started)

        self.commit.then(fn, done, frees)

    def _change_fn(self, ctx: ConnContext, req: Any
                   ) -> tuple[Callable[[WriteTxn], Any], Callable[[Any], Any]]:
        """A taken change other than create, close and entry changes: the change and
        how its result becomes the reply (what ``rpc_<method>`` awaits and returns)."""
        ns = self.ns
        if isinstance(req, M.CommitSize):
            h = self.handles.handle(ctx, req.fh)
            ino, root, end, mtime = h.ino, h.root, req.written_end, req.mtime
            return (lambda t: ns.commit_size(t, ino, end, mtime, root),
                    lambda a: M.AttrReply(attr=a))
        cred = self._cred(ctx, req)
        if isinstance(req, M.Setattr):
            kw = self._setattr_kw(req)
            return lambda t: ns.setattr(t, cred, req.ino, **kw), lambda a: M.AttrReply(attr=a)
        if isinstance(req, M.Rename):
            parent, name = self._at(req.at, cred)
            newparent, newname = self._at(req.new, cred)
            flags = req.flags
            return (lambda t: ns.rename(t, cred, parent, name, newparent, newname, flags),
                    lambda _: Empty())
        if isinstance(req, M.Link):
            ino = req.ino
            newparent, newname = self._at(req.new, cred)
            return (lambda t: ns.link(t, cred, ino, newparent, newname),
                    lambda a: M.AttrReply(attr=a))
        raise OSError(errno.ENOSYS, f"{req.method}: not a taken change")

    async def _change(self, ctx: ConnContext, req: Any) -> Any:
        """A change of :meth:`_change_fn` in a handler: committed, then its reply (the
        same change a reader task takes, ``_take_op``, when the request is plain)."""
        fn, reply = self._change_fn(ctx, req)
        return reply(await self.commit.mutate(fn))

    def _take_close(self, ctx: ConnContext, rid: int, msg: M.Close, started: float
                    ) -> None:
        """``rpc_close`` with a size to commit, answered from the writer. The handle
        leaves the connection now, so its open count is dropped here whatever becomes
        of the connection meanwhile; the last close of a file deleted while open is
        answered once its reclaim is durable too, as the handler's is."""
        h = self.handles.close_handle(ctx, msg.fh)
        self.handles.closed(h, self._closed_unwritten(msg))
        ino, root, end, mtime = h.ino, h.root, msg.written_end, msg.mtime

        def done(o: Op) -> None:
            err = None if isinstance(o.error, FileNotFoundError) else o.error

            def released(rerr: BaseException | None) -> None:
                e = err if err is not None else rerr
                self.answer(ctx, rid, msg.method,
                            e if e is not None else self.encode(msg, Empty()), started)

            try:
                self.handles.release_then(ino, released)
            except Exception as exc:  # noqa: BLE001 - answered
                released(exc)

        self.commit.then(lambda t: self.ns.commit_size(t, ino, end, mtime, root), done)

    def __init__(self, store: Store, config: MetaConfig | None = None,
                 limits: Limits | None = None, *, signer: caps.CapSigner | None = None,
                 security: MetaSecurity | None = None) -> None:
        cfg = config or MetaConfig()
        sec = security or meta_security(cfg)
        self._data_keys = sec.data_keys
        self._no_root = sec.no_root if sec.server.mode == "key" else frozenset()
        if sec.server.mode == "open":
            log.warning("metaserver: no cluster key or TLS configured: UNSECURED, every peer "
                        "is trusted (development only; see docs/security.md)")
        super().__init__(limits, sec.server)
        self.store = store
        self.config = cfg
        self.signer = signer or caps.CapSigner.generate(cfg.cap_ttl)
        counters = Counters()  # the namespace's, stored once per batch by the writer
        self.commit = CommitQueue(store, self._batch_committed, counters)
        self.registry = Registry(cfg.heartbeat_timeout,
                                 reserve=Reserve(cfg.reserve_bytes, cfg.reserve_percent),
                                 suspect_after=cfg.suspect_after)
        self.handles = OpenFiles(store, self.commit, self._reclaim)
        # data servers recorded by the previous run that have not reported since this
        # start (filled at start-up): placement waits for them (see _placeable)
        self._awaited: set[str] = set()
        self._grace_end = 0.0
        self.ns = Namespace(self.config.layout, servers=self._placeable,
                            opened=self.handles.opened, is_open=self.handles.is_open,
                            deleting=self._deleting_objects, counters=counters,
                            unwritten=self.handles.unwritten, made=self.handles.made)
        self.dataplane = DataPlane(sec.own, self.limits, self.registry, self.signer)
        self.detector = Detector(self.registry, self.dataplane.open,
                                 probe_timeout=cfg.probe_timeout)
        self.dataplane.on_refused = self._refused
        # truncations are stamped past every restore window: the data servers enforce
        # only the cuts made before a restore (dataserver/cuts.py)
        self.dataplane.cut_floor = max((w[1] for w in self._restores() or ()), default=0)
        self.deleter = Deleter(store, self.ns, self.commit, self.dataplane)
        # stale chain members that are up again: joined, copied to, serving (catchup.py)
        self.catchup = CatchUp(store, self.commit, self.ns.chains,
                               lambda sid: self.registry.address(sid) is not None,
                               self.dataplane, rate=cfg.repair_rate)
        # lost servers, short chains, drains and rebalancing (repair.py)
        self.repair = Repair(store, self.commit, self.ns.chains, self.registry,
                             self.catchup, self.ns.list_servers,
                             lost_after=cfg.lost_after, interval=cfg.repair_interval)

    # ------------------------------------------------------------------ running
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Format or recover the store, then run the writer and the deleter."""
        await self.commit.write_alone(self._startup)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.dataplane.run, name="meta-dataplane")
                nursery.start_soon(self.commit.run, name="meta-writer")
                nursery.start_soon(self.deleter.run, name="meta-deleter")
                nursery.start_soon(self.catchup.run, name="meta-catchup")
                nursery.start_soon(self.repair.run, name="meta-repair")
                nursery.start_soon(watch.log_changes, self.registry, name="meta-watch")
                task_status.started()
        finally:
            self.commit.close()

    async def serve_all(self, host: str, port: int, *,
                        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.run)
            bound = await nursery.start(self.serve, host, port)
            task_status.started(bound)

    def _startup(self, txn: WriteTxn) -> None:
        if self.ns.format(txn):
            log.info("formatted a new metadata store")
        self._awaited = set(self.ns.list_servers(txn))
        self._grace_end = time.monotonic() + self.config.heartbeat_timeout
        self.registry.set_draining({sid for sid, rec in self.ns.list_servers(txn).items()
                                    if rec.get("draining")})
        orphans = self.ns.orphans(txn)
        for ino in orphans:
            self.ns.reclaim(txn, ino)
        if orphans:
            log.info("reclaimed %d orphaned inode(s) from the previous run", len(orphans))

    def _placeable(self) -> dict[str, int]:
        """Free bytes of each data server placement may choose. Right after a start, none
        known yet while a server recorded by the previous run has not reported again is
        EAGAIN (the client retries), not ENOSPC, for up to ``heartbeat_timeout``: the
        servers re-register within a heartbeat or two."""
        free = self.registry.free_space()
        if free or not self._awaited or time.monotonic() >= self._grace_end:
            return free
        self._awaited = {sid for sid in self._awaited if self.registry.address(sid) is None}
        if not self._awaited:
            return free
        raise OSError(errno.EAGAIN, f"metaserver starting: waiting for {len(self._awaited)} "
                                    "data server(s) to report again; retry")

    def _batch_committed(self) -> None:
        self.handles.batch_committed()
        self.deleter.wake()

    # the namespace asks the open files and the deleter, and they use it: these hooks
    # close the loop once all three exist
    def _reclaim(self, txn: WriteTxn, ino: int) -> bool:
        return self.ns.reclaim(txn, ino)

    def _deleting_objects(self, ino: int) -> bool:
        return self.deleter.deleting(ino)

    def _opened_reply(self, ctx: ConnContext, attr: dict[str, Any], layout: Any,
                      flags: int, cred: Cred, parent_attr: Any = None,
                      created: bool = False) -> M.OpenedReply:
        """An open/create reply: the handle, and a capability for its data; ``created``:
        the create made the file (handles.py, "Files no data server saw")."""
        ino = attr["ino"]
        fh = self.handles.new_handle(ctx, ino, flags, cred.root, created)
        cap, ttl = self._file_cap(ctx, ino, rights_of(flags), layout)
        return M.OpenedReply(attr=attr, fh=fh, layout=layout, cap=cap, cap_ttl=ttl,
                             parent_attr=parent_attr, created=created)

    def _file_cap(self, ctx: ConnContext, ino: int, rights: int, layout: Any
                  ) -> tuple[bytes, float]:
        """A capability for ``ino``'s objects as ``layout`` places them, bound to the
        identity of ``ctx`` (docs/security.md, "Capabilities")."""
        if hasattr(layout, "to_wire"):
            layout = layout.to_wire()
        who = ctx.identity.name if ctx.identity is not None else ""
        return self.signer.issue_file(ino, rights, who, caps.stripes_of(layout),
                                      self.config.max_object_size)

    # ------------------------------------------------------------------ who may do what
    async def dispatch(self, ctx: ConnContext, req: Request) -> Reply | dict[str, Any]:
        ident = ctx.identity
        if ident is not None and ident.role == "server" and req.method not in SERVER_METHODS:
            raise OSError(errno.EACCES, f"{req.method}: data server credentials give no "
                                        "access to the namespace")
        try:
            handler, msg = self.decode(req)
        except OSError:
            # a request refused (bad field, unknown method) still releases its handles
            closes = req.fields.get("closes")
            if closes:
                self.handles.release_closed(ctx, closes)
            raise
        if msg.closes:
            self.handles.release_closed(ctx, msg.closes, msg.unwritten)
        return self.encode(msg, await handler(ctx, msg))

    async def rpc_release(self, ctx: ConnContext, req: M.Release) -> Empty:
        """Only its ``closes`` (handled in ``dispatch``): what a client sends when no
        other request comes soon enough to carry them."""
        return Empty()

    def _at(self, at: At, cred: Cred) -> tuple[int, bytes]:
        """Where a request's entry lives: ``parent`` + ``name``, or a ``path`` resolved here
        (one round trip for path-based clients instead of a resolve, then the call)."""
        if at.path is not None:
            with self.store.read() as txn:
                return self.ns.entry_of(txn, cred, at.path, cache=True)
        assert at.parent is not None and at.name is not None  # the message checked
        return at.parent, at.name

    def _cred(self, ctx: ConnContext, req: Any) -> Cred:
        """The caller's credentials (the request's ``cred``, checked by its message),
        squashed and checked against what its key allows. A client sends the same
        credentials again and again: the last ones allowed on a connection are kept
        (what they become depends only on them, the connection's identity and the
        config)."""
        raw = req.cred
        kept = ctx.state.get("cred")
        if kept is not None and kept[0] == raw:
            cred: Cred = kept[1]
            return cred
        cred = self._check_cred(ctx, raw)
        ctx.state["cred"] = (raw, cred)
        return cred

    def _check_cred(self, ctx: ConnContext, raw: Any) -> Cred:
        uid, gid, groups = raw
        cred = Cred(uid, gid, groups)
        cfg = self.config
        ident = ctx.identity
        squashed = False
        if cred.uid == 0 and (cfg.root_squash or (ident is not None
                                                   and ident.name in self._no_root)):
            cred = Cred(cfg.squash_uid, cfg.squash_gid, ())  # a key without allow_root
            squashed = True
        if ident is not None and ident.role == "client":
            squashed = squashed or (cfg.root_squash and cred.uid == cfg.squash_uid)
            lo, hi = ident.uids
            if not squashed and not lo <= cred.uid <= hi:
                raise OSError(errno.EPERM, f"{ident.name!r} may not act as uid {cred.uid} "
                                           f"(allowed {lo}-{hi})")
            glo, ghi = ident.gids
            for g in (cred.gid, *cred.groups):
                if not glo <= g <= ghi and not (squashed and g == cfg.squash_gid):
                    raise OSError(errno.EPERM, f"{ident.name!r} may not act as gid {g} "
                                               f"(allowed {glo}-{ghi})")
        return cred

    def connection_lost(self, ctx: ConnContext) -> None:
        self.handles.connection_lost(ctx)

    # ------------------------------------------------------------------ handlers
    async def rpc_hello(self, ctx: ConnContext, req: M.Hello) -> M.HelloReply:
        ctx.state["client"] = req.client
        return M.HelloReply(root=K.ROOT_INO, version=ctx.version)  # as negotiated

    async def rpc_resolve(self, ctx: ConnContext, req: M.Resolve) -> M.ResolveReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            r = self.ns.resolve(txn, cred, req.path, req.follow, cache=True)
        return M.ResolveReply(attr=r["attr"], parent=r["parent"], name=r["name"])

    async def rpc_lookup(self, ctx: ConnContext, req: M.Lookup) -> M.AttrReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            return M.AttrReply(attr=self.ns.lookup(txn, cred, req.parent, req.name))

    async def rpc_getattr(self, ctx: ConnContext, req: M.Getattr) -> M.AttrReply:
        with self.store.read() as txn:
            return M.AttrReply(attr=self.ns.getattr(txn, req.ino))

    async def rpc_setattr(self, ctx: ConnContext, req: M.Setattr) -> M.AttrReply:
        cred, ino = self._cred(ctx, req), req.ino
        kw = self._setattr_kw(req)
        size = kw["size"]
        if size is not None:
            with self.store.read() as txn:
                plan = self.ns.truncate_plan(txn, cred, ino, size)
            if plan is not None:
                if any(v is not None for k, v in kw.items() if k != "size"):
                    # the other changes must be allowed before any object is cut
                    await self.commit.mutate(functools.partial(self._try_setattr, cred, ino, kw))
                await self._truncate_objects(ino, plan[0], size)
        attr = await self.commit.mutate(lambda t: self.ns.setattr(t, cred, ino, **kw))
        return M.AttrReply(attr=attr)

    @staticmethod
    def _setattr_kw(req: M.Setattr) -> dict[str, Any]:
        return {"mode": req.mode, "uid": req.uid, "gid": req.gid, "size": req.size,
                "atime": req.atime, "mtime": req.mtime}

    async def _truncate_objects(self, ino: int, layout: dict[str, Any], size: int) -> None:
        """Cut ``ino``'s objects to ``size``, once the state its plan read is durable
        (it may be committed but not yet flushed: commit.py, "One flush per batch")."""
        self.handles.written(ino)  # (cut records may be left where no object was)
        await self.commit.durable()
        await self.dataplane.truncate_objects(ino, layout, size)

    def _try_setattr(self, cred: Cred, ino: int, kw: dict[str, Any], txn: WriteTxn) -> None:
        """Raise what ``setattr`` would raise; change nothing."""
        dry_run(txn, lambda sub: self.ns.setattr(sub, cred, ino, **kw))

    async def rpc_access(self, ctx: ConnContext, req: M.Access) -> Empty:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            self.ns.access(txn, cred, req.ino, req.mask)
        return Empty()

    def _entry_fn(self, ctx: ConnContext, req: M.EntryChange
                  ) -> tuple[int, Callable[[WriteTxn], Any], bool]:
        """An entry change other than create: the directory whose entry it makes or
        removes, the change (its result, if any, is the reply's ``attr``) and whether
        it frees space."""
        cred = self._cred(ctx, req)
        parent, name = self._at(req.at, cred)
        ns = self.ns
        if isinstance(req, M.Mkdir):
            mode = req.mode
            return parent, lambda t: ns.mkdir(t, cred, parent, name, mode), False
        if isinstance(req, M.Mknod):
            mode, rdev = req.mode, req.rdev
            return parent, lambda t: ns.mknod(t, cred, parent, name, mode, rdev), False
        if isinstance(req, M.Symlink):
            target = req.target
            return parent, lambda t: ns.symlink(t, cred, parent, name, target), False
        if isinstance(req, M.Unlink):
            return parent, lambda t: ns.unlink(t, cred, parent, name), True
        if isinstance(req, M.Rmdir):
            return parent, lambda t: ns.rmdir(t, cred, parent, name), True
        raise OSError(errno.ENOSYS, f"{req.method}: not an entry change")

    def _entry_op(self, req: M.EntryChange, parent: int, fn: Callable[[WriteTxn], Any]
                  ) -> Callable[[WriteTxn], tuple[Any, Any]]:
        """``fn`` and, with ``want_parent``, the parent's new attributes: the kernel
        asks for them next (its cached ones went stale), and the mount can answer
        without a round trip."""
        want = req.want_parent

        def op(txn: WriteTxn) -> tuple[Any, Any]:
            return fn(txn), self.ns.getattr(txn, parent) if want else None

        return op

    async def _entry_change(self, ctx: ConnContext, req: M.EntryChange) -> M.EntryReply:
        parent, fn, frees = self._entry_fn(ctx, req)
        result, parent_attr = await self.commit.mutate(self._entry_op(req, parent, fn), frees)
        return M.EntryReply(attr=result, parent_attr=parent_attr)

    async def rpc_mkdir(self, ctx: ConnContext, req: M.Mkdir) -> M.EntryReply:
        return await self._entry_change(ctx, req)

    async def rpc_mknod(self, ctx: ConnContext, req: M.Mknod) -> M.EntryReply:
        return await self._entry_change(ctx, req)

    async def rpc_create(self, ctx: ConnContext, req: M.Create) -> M.OpenedReply:
        cred = self._cred(ctx, req)
        parent, name = self._at(req.at, cred)
        mode, flags = req.mode, req.flags
        if flags & os.O_TRUNC:
            with self.store.read() as txn:
                plan = self.ns.create_plan(txn, cred, parent, name, flags)
            if plan is not None:
                await self._truncate_objects(plan[0], plan[1], 0)
        opened: list[int] = []
        abandoned = False  # the handler was cancelled: nobody will get or close a handle
        want_parent = req.want_parent

        def op(txn: WriteTxn) -> tuple[dict[str, Any], Any, Any, bool]:
            attr, layout, created = self.ns.create(txn, cred, parent, name, mode, flags)
            if not abandoned:
                self.handles.ref(attr["ino"])
                opened.append(attr["ino"])
            parent_attr = self.ns.getattr(txn, parent) if want_parent else None
            return attr, layout, parent_attr, created

        try:
            attr, layout, parent_attr, created = await self.commit.mutate(op)
        except BaseException:
            abandoned = True  # the op may still be queued
            for ino in opened:  # the op ran but the batch did not commit
                await self.handles.release(ino)
            raise
        return self._opened_reply(ctx, attr, layout, flags, cred, parent_attr, created)

    async def rpc_open(self, ctx: ConnContext, req: M.Open) -> M.OpenedReply:
        cred, ino, flags = self._cred(ctx, req), req.ino, req.flags
        if not flags & os.O_TRUNC:
            self.handles.ref(ino)
            try:
                with self.store.read() as txn:
                    attr, layout = self.ns.open(txn, cred, ino, flags)
            except BaseException:
                await self.handles.release(ino)
                raise
            return self._opened_reply(ctx, attr, layout, flags, cred)
        with self.store.read() as txn:
            self.ns.open(txn, cred, ino, flags & ~os.O_TRUNC)
            plan = self.ns.truncate_plan(txn, cred, ino, 0)
        if plan is not None:
            await self._truncate_objects(ino, plan[0], 0)
        opened: list[int] = []
        abandoned = False

        def op(txn: WriteTxn) -> tuple[dict[str, Any], Any]:
            result = self.ns.open(txn, cred, ino, flags)
            if not abandoned:
                self.handles.ref(ino)
                opened.append(ino)
            return result

        try:
            attr, layout = await self.commit.mutate(op)
        except BaseException:
            abandoned = True
            for i in opened:
                await self.handles.release(i)
            raise
        return self._opened_reply(ctx, attr, layout, flags, cred)

    async def rpc_renew(self, ctx: ConnContext, req: M.Renew) -> M.CapReply:
        """A fresh capability for an open handle (before the old one expires, or after
        a truncation made it stale)."""
        h = self.handles.handle(ctx, req.fh)
        with self.store.read() as txn:  # a file's layout cannot change while it is open
            layout = self.ns.get_layout(txn, h.ino)
        cap, ttl = self._file_cap(ctx, h.ino, h.rights, layout)
        return M.CapReply(cap=cap, cap_ttl=ttl)

    @staticmethod
    def _closed_unwritten(req: M.Close) -> bool:
        """The client's word that the handle it closes sent nothing to a data server
        (a size to commit says otherwise)."""
        return req.written_end is None and req.unwritten is not None \
            and req.fh in req.unwritten

    async def rpc_close(self, ctx: ConnContext, req: M.Close) -> Empty:
        written_end, mtime = req.written_end, req.mtime
        h = self.handles.close_handle(ctx, req.fh)
        self.handles.closed(h, self._closed_unwritten(req))
        ino, root = h.ino, h.root
        try:
            if written_end is not None or mtime is not None:
                try:
                    await self.commit.mutate(
                        lambda t: self.ns.commit_size(t, ino, written_end, mtime, root))
                except FileNotFoundError:
                    pass
        finally:
            await self.handles.release(ino)
        return Empty()

    async def rpc_commit_size(self, ctx: ConnContext, req: M.CommitSize) -> M.AttrReply:
        return await self._change(ctx, req)

    async def rpc_unlink(self, ctx: ConnContext, req: M.Unlink) -> M.EntryReply:
        return await self._entry_change(ctx, req)

    async def rpc_rmdir(self, ctx: ConnContext, req: M.Rmdir) -> M.EntryReply:
        return await self._entry_change(ctx, req)

    async def rpc_rename(self, ctx: ConnContext, req: M.Rename) -> Empty:
        return await self._change(ctx, req)

    async def rpc_link(self, ctx: ConnContext, req: M.Link) -> M.AttrReply:
        return await self._change(ctx, req)

    async def rpc_symlink(self, ctx: ConnContext, req: M.Symlink) -> M.EntryReply:
        return await self._entry_change(ctx, req)

    # ------------------------------------------------------------------ batched calls
    async def rpc_create_many(self, ctx: ConnContext, req: M.CreateMany) -> M.ManyReply:
        cred, paths, mode, excl = self._cred(ctx, req), req.paths, req.mode, req.exclusive
        return M.ManyReply(results=await self.commit.mutate(
            lambda t: batch.create_many(self.ns, t, cred, paths, mode, excl)))

    async def rpc_stat_many(self, ctx: ConnContext, req: M.StatMany) -> M.ManyReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            return M.ManyReply(results=batch.stat_many(self.ns, txn, cred, req.paths,
                                                       req.follow))

    async def rpc_unlink_many(self, ctx: ConnContext, req: M.UnlinkMany) -> M.ManyReply:
        cred, paths = self._cred(ctx, req), req.paths
        return M.ManyReply(results=await self.commit.mutate(
            lambda t: batch.unlink_many(self.ns, t, cred, paths), frees=True))

    async def rpc_readlink(self, ctx: ConnContext, req: M.Readlink) -> M.TargetReply:
        with self.store.read() as txn:
            return M.TargetReply(target=self.ns.readlink(txn, req.ino))

    async def rpc_readdir(self, ctx: ConnContext, req: M.Readdir) -> M.ReaddirReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            entries, eof = self.ns.readdir(txn, cred, req.ino, req.cookie, req.limit,
                                           req.plus)
        return M.ReaddirReply(entries=entries, eof=eof)

    async def rpc_statfs(self, ctx: ConnContext, req: M.Statfs) -> M.StatfsReply:
        total, free = self.registry.capacity()
        with self.store.read() as txn:
            return M.StatfsReply(**self.ns.statfs(txn, total, free))

    async def rpc_getxattr(self, ctx: ConnContext, req: M.Getxattr) -> M.ValueReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            return M.ValueReply(value=self.ns.getxattr(txn, cred, req.ino, req.name))

    async def rpc_setxattr(self, ctx: ConnContext, req: M.Setxattr) -> Empty:
        cred, ino, name = self._cred(ctx, req), req.ino, req.name
        value, flags = req.value, req.flags
        await self.commit.mutate(lambda t: self.ns.setxattr(t, cred, ino, name, value, flags))
        return Empty()

    async def rpc_listxattr(self, ctx: ConnContext, req: M.Listxattr) -> M.NamesReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            return M.NamesReply(names=self.ns.listxattr(txn, cred, req.ino))

    async def rpc_removexattr(self, ctx: ConnContext, req: M.Removexattr) -> Empty:
        cred, ino, name = self._cred(ctx, req), req.ino, req.name
        await self.commit.mutate(lambda t: self.ns.removexattr(t, cred, ino, name),
                                 frees=True)
        return Empty()

    async def rpc_get_layout(self, ctx: ConnContext, req: M.GetLayout) -> M.LayoutReply:
        with self.store.read() as txn:
            return M.LayoutReply(layout=self.ns.get_layout(txn, req.ino))

    async def rpc_set_layout(self, ctx: ConnContext, req: M.SetLayout) -> M.LayoutReply:
        cred, ino = self._cred(ctx, req), req.ino
        unit, count, replicas, durable = req.unit, req.count, req.replicas, req.durable
        return M.LayoutReply(layout=await self.commit.mutate(
            lambda t: self.ns.set_layout(t, cred, ino, unit, count, replicas, durable)))

    async def rpc_servers(self, ctx: ConnContext, req: M.Servers) -> M.ServersReply:
        with self.store.read() as txn:
            stored = self.ns.list_servers(txn)
        return M.ServersReply(servers=self.registry.describe(stored))

    # ------------------------------------------------------------------ failure detection
    def _refused(self, sid: str) -> None:
        """The data plane's own connection to ``sid`` was refused: that is our probe."""
        if self.registry.refused(sid):
            log.warning("data server %s refused the metaserver's connection: down (out of "
                        "placement until its next heartbeat)", sid)

    async def rpc_report_server(self, ctx: ConnContext, req: M.ReportServer
                                ) -> M.ServerStateReply:
        """A client could not reach ``sid``: probe it (rate-limited) and answer its
        state after."""
        log.debug("client %s reports data server %s: errno %d",
                  ctx.state.get("client", "?"), req.sid, req.errno)
        state = await self.detector.report(req.sid)
        return M.ServerStateReply(state=state.value)

    async def rpc_drain(self, ctx: ConnContext, req: M.Drain) -> M.ServerStateReply:
        self._root_only(ctx, req)
        sid, on = req.sid, req.on
        await self.commit.mutate(lambda t: self.ns.set_draining(t, sid, on))
        self.registry.draining(sid, on)
        self.repair.wake.set()  # draining: its chain memberships move off it now
        log.info("data server %s %s", sid, "draining: no new stripes" if on
                 else "no longer draining")
        return M.ServerStateReply(state=self.registry.state(sid).value)

    # ------------------------------------------------------------------ repair
    async def rpc_repair_status(self, ctx: ConnContext, req: M.RepairStatus
                                ) -> M.RepairReply:
        return M.RepairReply(status=self.repair.status())

    async def rpc_lost(self, ctx: ConnContext, req: M.Lost) -> M.RepairReply:
        self._root_only(ctx, req)
        with self.store.read() as txn:
            if req.sid not in self.ns.list_servers(txn):
                raise OSError(errno.ENOENT, f"no data server {req.sid}")
        await self.repair.declare_lost(req.sid)
        return M.RepairReply(status=self.repair.status())

    async def rpc_rebalance(self, ctx: ConnContext, req: M.Rebalance) -> M.RepairReply:
        self._root_only(ctx, req)
        self.repair.rebalance()
        return M.RepairReply(status=self.repair.status())

    # ------------------------------------------------------------------ admin scans
    def _root_only(self, ctx: ConnContext, req: Any) -> None:
        """Scans of the whole namespace are root's (after squashing and the key's uid
        range): they read past every permission."""
        if self._cred(ctx, req).uid != 0:
            raise OSError(errno.EPERM, f"{req.method}: root only (pfs fsck needs a client "
                                       "key made with --allow-root, and no root_squash)")

    async def rpc_scan_inodes(self, ctx: ConnContext, req: M.ScanInodes) -> M.ScanInodesReply:
        self._root_only(ctx, req)
        with self.store.read() as txn:
            files, last, end = self.ns.scan_files(txn, req.after, req.limit)
        return M.ScanInodesReply(inodes=files, next=last, end=end)

    async def rpc_scan_deleting(self, ctx: ConnContext, req: M.ScanDeleting
                                ) -> M.ScanDeletingReply:
        self._root_only(ctx, req)
        with self.store.read() as txn:
            entries, nxt, end = self.ns.scan_deleting(txn, req.start, req.limit)
        return M.ScanDeletingReply(entries=entries, next=nxt, end=end)

    async def rpc_scan_cap(self, ctx: ConnContext, req: M.ScanCap) -> M.CapReply:
        self._root_only(ctx, req)
        cap, ttl = self.signer.issue(0, caps.READ | caps.SCAN, who=ctx.identity.name
                                     if ctx.identity is not None else "")
        return M.CapReply(cap=cap, cap_ttl=ttl)

    async def rpc_register(self, ctx: ConnContext, req: M.Register) -> M.RegisterReply:
        if ctx.identity is None or not ctx.identity.may_serve:
            raise OSError(errno.EACCES, "register: only a data server (cluster key or server "
                                        "certificate) may register")
        sid = req.sid or uuid.uuid4().hex  # port, sizes and sid: checked by the message
        host, port, total, free = req.host, req.port, req.total, req.free
        domain = req.domain or ""
        await self.commit.mutate(
            lambda t: self.ns.register_server(t, sid, host, port, total, free, domain))
        self.registry.register(sid, host, port, total, free, req.dirs, domain,
                               req.version, req.protocol, req.kv)
        self.dataplane.forget(sid)
        log.info("data server %s registered at %s:%d (%d of %d bytes free)",
                 sid, host, port, free, total)
        # what it needs to check clients: the capability key, the generation floor
        # (capabilities from before this registration are stale for writing: it may have
        # restarted and lost its fences) and the node keys' data-plane keys
        return M.RegisterReply(sid=sid, cap_key=self.signer.public_bytes,
                               gen=self.signer.next_gen(), cap_ttl=self.config.cap_ttl,
                               data_keys=self._data_keys, stale=self._stale_on(sid),
                               cap_format=caps.VERSION, restores=self._restores())

    async def rpc_get_chain(self, ctx: ConnContext, req: M.GetChain) -> M.ChainReply:
        if ctx.identity is None or not ctx.identity.may_serve:
            raise OSError(errno.EACCES, "get_chain: data servers only")
        with self.store.read() as txn:
            chain = self.ns.chains.get(txn, req.chain)
        if chain is None:
            raise OSError(errno.ENOENT, f"no chain {req.chain}")
        return M.ChainReply(chain=chain.to_wire(), restores=self._restores())

    async def rpc_chain_drop(self, ctx: ConnContext, req: M.ChainDrop) -> M.ChainReply:
        cid, sid = req.chain, req.sid
        if ctx.identity is None or not ctx.identity.may_serve:
            # a client that could not reach a chain's head: believed once it is confirmed
            if await self.dataplane.probe(sid, PROBE_TIMEOUT):
                raise OSError(errno.EAGAIN, f"chain_drop: data server {sid} answers; "
                                            "try again")
        chain = await self.commit.mutate(lambda t: self.ns.chains.remove(t, cid, sid))
        return M.ChainReply(chain=chain.to_wire())

    def _restores(self) -> list[list[int]] | None:
        """The store's restore windows (metaserver/backup.py), for data servers."""
        with self.store.read() as txn:
            return [[K.read_u64(k, 1), K.read_u64(v)]
                    for k, v in txn.scan(K.RESTORE)] or None

    def _stale_on(self, sid: str) -> list[int] | None:
        """The chains ``sid`` was taken out of and is not back in (it serves none)."""
        with self.store.read() as txn:
            return [c.cid for c in self.ns.chains.stale_on(txn, sid)] or None

    async def rpc_heartbeat(self, ctx: ConnContext, req: M.Heartbeat) -> M.HeartbeatReply:
        if ctx.identity is None or not ctx.identity.may_serve:
            raise OSError(errno.EACCES, "heartbeat: only data servers send heartbeats")
        sid, total, free = req.sid, req.total, req.free
        if self.registry.heartbeat(sid, total, free, req.dirs, req.load, req.version,
                                   req.protocol, req.kv):
            return M.HeartbeatReply(stale=self._stale_on(sid))
        with self.store.read() as txn:
            rec = self.ns.list_servers(txn).get(sid)
        if rec is None:
            raise OSError(errno.ENOENT, f"unknown data server {sid}; register first")
        self.registry.register(sid, rec["host"], rec["port"], total, free, req.dirs,
                               rec.get("domain", ""), req.version, req.protocol, req.kv)
        self.registry.heartbeat(sid, total, free, req.dirs, req.load, kv=req.kv)
        return M.HeartbeatReply(stale=self._stale_on(sid))


def _registry_gauges(reg: Registry) -> None:
    """Each data server's capacity and heartbeat age, read from the registry at scrape."""
    def column(i: int) -> Callable[[], dict[str, float]]:
        return lambda: {sid: float(v[i]) for sid, v in reg.live().items()}

    metrics.add_gauges("pfs_server_total_bytes", "a data server's capacity", "server",
                       column(0))
    metrics.add_gauges("pfs_server_free_bytes", "a data server's free bytes", "server",
                       column(1))
    metrics.add_gauges("pfs_server_heartbeat_age_seconds",
                       "seconds since a data server's last heartbeat", "server", column(2))


async def serve_meta(config: MetaConfig, *, store: Store | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Open the store named by ``config.db`` (or use ``store``) and serve until
    cancelled; ``await nursery.start(serve_meta, config)`` returns the bound port."""
    owned = store is None
    security = meta_security(config)  # key files are checked before anything starts
    st: Store = LmdbStore(config.db, config.map_size) if store is None else store
    try:
        if owned:
            keep_private(config.db)  # a store made before umask 077 was world-readable
        signer = cap_signer(config, persistent=owned)
        service = MetaService(st, config, signer=signer, security=security)
        service.apply_limits(config.connections, nofile_limit() - FD_RESERVE)
        if metrics.serve(config.metrics_port, config.host):
            _registry_gauges(service.registry)
        await service.serve_all(config.host, config.port, task_status=task_status)
    finally:
        if owned:
            st.close()

"""The metadata service: ``docs/rpc.md``'s metaserver methods over :mod:`namespace`.

``MetaService`` holds the RPC handlers and wires the parts they use, each a module:

- :mod:`metaserver.commit`: group commit. Reads (getattr, lookup, readdir, ...) run in a
  read transaction on the event loop; every mutation goes through the commit queue, and
  a handler replies only once its batch is on disk.
- :mod:`metaserver.handles`: open handles per connection, open counts per inode, orphans
  (unlinked while open) and their reclaim.
- :mod:`metaserver.registry`: which data servers are up, from registrations and
  heartbeats; placement and ``statfs`` read it.
- :mod:`metaserver.dataplane`: the connections to data servers; truncation and deletion
  of objects. Shrinking a file (setattr size, O_TRUNC) first truncates its objects on the
  data servers, then commits the new size, so old bytes never reappear past a later
  extension.
- :mod:`metaserver.deleter`: deleted files' objects, queued (key ``Q``) in the
  transaction that drops them, deleted on the data servers in the background.
- :mod:`metaserver.security`: keys, peer authentication, the capability signer.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import trio

from metaserver import keys as K
from metaserver.commit import CommitQueue, dry_run
from metaserver.dataplane import DataPlane
from metaserver.deleter import Deleter
from metaserver.handles import OpenFiles, rights_of
from metaserver.namespace import NOW, Cred, Namespace
from metaserver.registry import Registry
from metaserver.security import SERVER_METHODS, MetaSecurity, cap_signer, meta_security
from metaserver.store import LmdbStore, Store, WriteTxn
from pfs import caps
from pfs.config import MetaConfig
from pfs.wire.protocol import Limits
from pfs.wire.rpc import ConnContext, Request, RpcService

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


def _time(req: Request, key: str) -> int | str | None:
    value = req.any(key)
    if value is None or value == NOW:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise OSError(errno.EINVAL, f"{req.method}: field '{key}' must be an integer or 'now'")
    return value


class MetaService(RpcService):
    name = "meta"
    # read-only handlers that never wait: answered in the connection's reader task
    inline_methods = frozenset({"hello", "resolve", "lookup", "getattr", "access", "readlink",
                                "readdir", "statfs", "getxattr", "listxattr", "get_layout",
                                "servers", "heartbeat", "renew", "release"})

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

    def __init__(self, store: Store, config: MetaConfig | None = None,
                 limits: Limits | None = None, *, signer: caps.CapSigner | None = None,
                 security: MetaSecurity | None = None) -> None:
        cfg = config or MetaConfig()
        sec = security or meta_security(cfg)
        self._data_keys = sec.data_keys
        if sec.server.mode == "open":
            log.warning("metaserver: no cluster key or TLS configured: UNSECURED, every peer "
                        "is trusted (development only; see docs/security.md)")
        super().__init__(limits, sec.server)
        self.store = store
        self.config = cfg
        self.signer = signer or caps.CapSigner.generate(cfg.cap_ttl)
        self.commit = CommitQueue(store, self._batch_committed)
        self.registry = Registry(cfg.heartbeat_timeout)
        self.handles = OpenFiles(store, self.commit, self._reclaim)
        self.ns = Namespace(self.config.layout, servers=self.registry.free_space,
                            opened=self.handles.opened, is_open=self.handles.is_open,
                            deleting=self._deleting_objects)
        self.dataplane = DataPlane(sec.own, self.limits, self.registry, self.signer)
        self.deleter = Deleter(store, self.ns, self.commit, self.dataplane)

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
        orphans = self.ns.orphans(txn)
        for ino in orphans:
            self.ns.reclaim(txn, ino)
        if orphans:
            log.info("reclaimed %d orphaned inode(s) from the previous run", len(orphans))

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
                      flags: int, cred: Cred) -> dict[str, Any]:
        """An open/create reply: the handle, and a capability for its data."""
        ino = attr["ino"]
        fh = self.handles.new_handle(ctx, ino, flags, cred.root)
        cap, ttl = self.signer.issue(ino, rights_of(flags))
        return {"attr": attr, "fh": fh, "layout": layout, "cap": cap, "cap_ttl": ttl}

    # ------------------------------------------------------------------ who may do what
    async def dispatch(self, ctx: ConnContext, req: Request) -> Any:
        ident = ctx.identity
        if ident is not None and ident.role == "server" and req.method not in SERVER_METHODS:
            raise OSError(errno.EACCES, f"{req.method}: data server credentials give no "
                                        "access to the namespace")
        if "closes" in req.fields:
            self.handles.release_closed(ctx, req.list("closes"))
        return await super().dispatch(ctx, req)

    async def rpc_release(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        """Only its ``closes`` (handled in ``dispatch``): what a client sends when no
        other request comes soon enough to carry them."""
        return {}

    def _at(self, req: Request, cred: Cred, parent_key: str = "parent", name_key: str = "name",
            path_key: str = "path") -> tuple[int, bytes]:
        """Where a request's entry lives: ``parent`` + ``name``, or a ``path`` resolved here
        (one round trip for path-based clients instead of a resolve, then the call)."""
        if path_key in req.fields:
            path = req.bytes(path_key)
            with self.store.read() as txn:
                return self.ns.entry_of(txn, cred, path)
        return req.int(parent_key), req.bytes(name_key)

    def _cred(self, ctx: ConnContext, req: Request) -> Cred:
        """The caller's credentials, squashed and checked against what its key allows."""
        if "cred" not in req.fields:
            raise OSError(errno.EINVAL, f"{req.method}: missing field 'cred'")
        cred = Cred.from_wire(req.fields["cred"])
        cfg = self.config
        if cfg.root_squash and cred.uid == 0:
            cred = Cred(cfg.squash_uid, cfg.squash_gid, ())
        ident = ctx.identity
        if ident is not None and ident.role == "client":
            squashed = cfg.root_squash and cred.uid == cfg.squash_uid
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
    async def rpc_hello(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        ctx.state["client"] = req.str("client", "")
        return {"root": K.ROOT_INO, "version": PROTOCOL_VERSION}

    async def rpc_resolve(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, path, follow = self._cred(ctx, req), req.bytes("path"), req.bool("follow", True)
        with self.store.read() as txn:
            return self.ns.resolve(txn, cred, path, follow)

    async def rpc_lookup(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, parent, name = self._cred(ctx, req), req.int("parent"), req.bytes("name")
        with self.store.read() as txn:
            return {"attr": self.ns.lookup(txn, cred, parent, name)}

    async def rpc_getattr(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        ino = req.int("ino")
        with self.store.read() as txn:
            return {"attr": self.ns.getattr(txn, ino)}

    async def rpc_setattr(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino = self._cred(ctx, req), req.int("ino")
        kw: dict[str, Any] = {k: req.opt_int(k) for k in ("mode", "uid", "gid", "size")}
        kw["atime"], kw["mtime"] = _time(req, "atime"), _time(req, "mtime")
        size = kw["size"]
        if size is not None:
            with self.store.read() as txn:
                plan = self.ns.truncate_plan(txn, cred, ino, size)
            if plan is not None:
                if any(v is not None for k, v in kw.items() if k != "size"):
                    # the other changes must be allowed before any object is cut
                    await self.commit.mutate(functools.partial(self._try_setattr, cred, ino, kw))
                await self.dataplane.truncate_objects(ino, plan[0], size)
        attr = await self.commit.mutate(lambda t: self.ns.setattr(t, cred, ino, **kw))
        return {"attr": attr}

    def _try_setattr(self, cred: Cred, ino: int, kw: dict[str, Any], txn: WriteTxn) -> None:
        """Raise what ``setattr`` would raise; change nothing."""
        dry_run(txn, lambda sub: self.ns.setattr(sub, cred, ino, **kw))

    async def rpc_access(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino, mask = self._cred(ctx, req), req.int("ino"), req.int("mask")
        with self.store.read() as txn:
            self.ns.access(txn, cred, ino, mask)
        return {}

    async def _entry_change(self, req: Request, parent: int,
                            fn: Callable[[WriteTxn], Any]) -> dict[str, Any]:
        """Run ``fn`` (it makes or removes an entry of ``parent``; its result, if any, is
        the reply's ``attr``). With ``want_parent`` the reply also carries the parent's
        new attributes: the kernel asks for them next (its cached ones went stale), and
        the mount can answer without a round trip."""
        want = req.bool("want_parent")

        def op(txn: WriteTxn) -> tuple[Any, Any]:
            return fn(txn), self.ns.getattr(txn, parent) if want else None

        result, parent_attr = await self.commit.mutate(op)
        out: dict[str, Any] = {} if result is None else {"attr": result}
        if parent_attr is not None:
            out["parent_attr"] = parent_attr
        return out

    async def rpc_mkdir(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, mode = self._cred(ctx, req), req.int("mode")
        parent, name = self._at(req, cred)
        return await self._entry_change(req, parent,
                                        lambda t: self.ns.mkdir(t, cred, parent, name, mode))

    async def rpc_mknod(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred = self._cred(ctx, req)
        parent, name = self._at(req, cred)
        mode, rdev = req.int("mode"), req.int("rdev", 0)
        return await self._entry_change(
            req, parent, lambda t: self.ns.mknod(t, cred, parent, name, mode, rdev))

    async def rpc_create(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred = self._cred(ctx, req)
        parent, name = self._at(req, cred)
        mode, flags = req.int("mode"), req.int("flags", os.O_WRONLY)
        if flags & os.O_TRUNC:
            with self.store.read() as txn:
                plan = self.ns.create_plan(txn, cred, parent, name, flags)
            if plan is not None:
                await self.dataplane.truncate_objects(plan[0], plan[1], 0)
        opened: list[int] = []
        abandoned = False  # the handler was cancelled: nobody will get or close a handle
        want_parent = req.bool("want_parent")

        def op(txn: WriteTxn) -> tuple[dict[str, Any], Any, Any]:
            attr, layout, _ = self.ns.create(txn, cred, parent, name, mode, flags)
            if not abandoned:
                self.handles.ref(attr["ino"])
                opened.append(attr["ino"])
            return attr, layout, self.ns.getattr(txn, parent) if want_parent else None

        try:
            attr, layout, parent_attr = await self.commit.mutate(op)
        except BaseException:
            abandoned = True  # the op may still be queued
            for ino in opened:  # the op ran but the batch did not commit
                await self.handles.release(ino)
            raise
        reply = self._opened_reply(ctx, attr, layout, flags, cred)
        if parent_attr is not None:
            reply["parent_attr"] = parent_attr
        return reply

    async def rpc_open(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino, flags = self._cred(ctx, req), req.int("ino"), req.int("flags", os.O_RDONLY)
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
            await self.dataplane.truncate_objects(ino, plan[0], 0)
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

    async def rpc_renew(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        """A fresh capability for an open handle (before the old one expires, or after
        a truncation made it stale)."""
        h = self.handles.handle(ctx, req.int("fh"))
        cap, ttl = self.signer.issue(h.ino, h.rights)
        return {"cap": cap, "cap_ttl": ttl}

    async def rpc_close(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        written_end, mtime = req.opt_int("written_end"), req.opt_int("mtime")
        h = self.handles.close_handle(ctx, req.int("fh"))
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
        return {}

    async def rpc_commit_size(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        written_end, mtime = req.opt_int("written_end"), req.opt_int("mtime")
        h = self.handles.handle(ctx, req.int("fh"))
        ino, root = h.ino, h.root
        return {"attr": await self.commit.mutate(
            lambda t: self.ns.commit_size(t, ino, written_end, mtime, root))}

    async def rpc_unlink(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred = self._cred(ctx, req)
        parent, name = self._at(req, cred)
        return await self._entry_change(req, parent,
                                        lambda t: self.ns.unlink(t, cred, parent, name))

    async def rpc_rmdir(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred = self._cred(ctx, req)
        parent, name = self._at(req, cred)
        return await self._entry_change(req, parent,
                                        lambda t: self.ns.rmdir(t, cred, parent, name))

    async def rpc_rename(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred = self._cred(ctx, req)
        parent, name = self._at(req, cred)
        newparent, newname = self._at(req, cred, "newparent", "newname", "newpath")
        flags = req.int("flags", 0)
        await self.commit.mutate(
            lambda t: self.ns.rename(t, cred, parent, name, newparent, newname, flags))
        return {}

    async def rpc_link(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino = self._cred(ctx, req), req.int("ino")
        newparent, newname = self._at(req, cred, "newparent", "newname", "newpath")
        return {"attr": await self.commit.mutate(
            lambda t: self.ns.link(t, cred, ino, newparent, newname))}

    async def rpc_symlink(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, target = self._cred(ctx, req), req.bytes("target")
        parent, name = self._at(req, cred)
        return await self._entry_change(
            req, parent, lambda t: self.ns.symlink(t, cred, parent, name, target))

    async def rpc_readlink(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        ino = req.int("ino")
        with self.store.read() as txn:
            return {"target": self.ns.readlink(txn, ino)}

    async def rpc_readdir(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino = self._cred(ctx, req), req.int("ino")
        cookie, limit, plus = req.int("cookie", 0), req.int("limit", 1024), req.bool("plus")
        with self.store.read() as txn:
            entries, eof = self.ns.readdir(txn, cred, ino, cookie, limit, plus)
        return {"entries": entries, "eof": eof}

    async def rpc_statfs(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        total, free = self.registry.capacity()
        with self.store.read() as txn:
            return self.ns.statfs(txn, total, free)

    async def rpc_getxattr(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino, name = self._cred(ctx, req), req.int("ino"), req.bytes("name")
        with self.store.read() as txn:
            return {"value": self.ns.getxattr(txn, cred, ino, name)}

    async def rpc_setxattr(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino, name = self._cred(ctx, req), req.int("ino"), req.bytes("name")
        value, flags = req.bytes("value"), req.int("flags", 0)
        await self.commit.mutate(lambda t: self.ns.setxattr(t, cred, ino, name, value, flags))
        return {}

    async def rpc_listxattr(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino = self._cred(ctx, req), req.int("ino")
        with self.store.read() as txn:
            return {"names": self.ns.listxattr(txn, cred, ino)}

    async def rpc_removexattr(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino, name = self._cred(ctx, req), req.int("ino"), req.bytes("name")
        await self.commit.mutate(lambda t: self.ns.removexattr(t, cred, ino, name))
        return {}

    async def rpc_get_layout(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        ino = req.int("ino")
        with self.store.read() as txn:
            return {"layout": self.ns.get_layout(txn, ino)}

    async def rpc_set_layout(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        cred, ino = self._cred(ctx, req), req.int("ino")
        unit, count, replicas = req.int("unit", 0), req.int("count", 0), req.int("replicas", 0)
        return {"layout": await self.commit.mutate(
            lambda t: self.ns.set_layout(t, cred, ino, unit, count, replicas))}

    async def rpc_servers(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        with self.store.read() as txn:
            stored = self.ns.list_servers(txn)
        return {"servers": self.registry.describe(stored)}

    async def rpc_register(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        if ctx.identity is None or not ctx.identity.may_serve:
            raise OSError(errno.EACCES, "register: only a data server (cluster key or server "
                                        "certificate) may register")
        sid = req.str("sid", None) or uuid.uuid4().hex
        host, port = req.str("host"), req.int("port")
        total, free = req.int("total"), req.int("free")
        if not 0 < port < 65536 or total < 0 or free < 0 or len(sid) > 128:
            raise OSError(errno.EINVAL, "register: bad port, sizes or sid")
        await self.commit.mutate(
            lambda t: self.ns.register_server(t, sid, host, port, total, free))
        self.registry.register(sid, host, port, total, free)
        self.dataplane.forget(sid)
        log.info("data server %s registered at %s:%d (%d of %d bytes free)",
                 sid, host, port, free, total)
        # what it needs to check clients: the capability key, the generation floor
        # (capabilities from before this registration are stale for writing: it may have
        # restarted and lost its fences) and the node keys' data-plane keys
        return {"sid": sid, "cap_key": self.signer.public_bytes, "gen": self.signer.next_gen(),
                "cap_ttl": self.config.cap_ttl, "data_keys": self._data_keys}

    async def rpc_heartbeat(self, ctx: ConnContext, req: Request) -> dict[str, Any]:
        if ctx.identity is None or not ctx.identity.may_serve:
            raise OSError(errno.EACCES, "heartbeat: only data servers send heartbeats")
        sid, total, free = req.str("sid"), req.int("total"), req.int("free")
        if self.registry.heartbeat(sid, total, free):
            return {}
        with self.store.read() as txn:
            rec = self.ns.list_servers(txn).get(sid)
        if rec is None:
            raise OSError(errno.ENOENT, f"unknown data server {sid}; register first")
        self.registry.register(sid, rec["host"], rec["port"], total, free)
        return {}


async def serve_meta(config: MetaConfig, *, store: Store | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Open the store named by ``config.db`` (or use ``store``) and serve until
    cancelled; ``await nursery.start(serve_meta, config)`` returns the bound port."""
    owned = store is None
    security = meta_security(config)  # key files are checked before anything starts
    st: Store = LmdbStore(config.db, config.map_size) if store is None else store
    try:
        signer = cap_signer(config, persistent=owned)
        service = MetaService(st, config, signer=signer, security=security)
        await service.serve_all(config.host, config.port, task_status=task_status)
    finally:
        if owned:
            st.close()

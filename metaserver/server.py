"""The metadata service: ``docs/rpc.md``'s metaserver methods over :mod:`namespace`.

Reads (getattr, lookup, readdir, ...) run in a read transaction on the event loop.
Mutations go through **group commit**: a handler queues its operation and waits; one
writer task drains the queue, runs every queued operation in one write transaction
(each in a nested transaction, so a failing one rolls back alone), commits once (LMDB
``sync=True``: one fsync per batch) and only then wakes the handlers, which reply. An
acknowledged mutation is therefore on disk.

Open files: a handle (``fh``) belongs to a connection; the service counts open handles
per inode. Dropping the last link of an open inode keeps it as an orphan (key ``O``)
until its last handle is closed or its connection ends; orphans left by a crash are
reclaimed at start. Deleted files' objects go to the deletion queue (key ``Q``) in the
same transaction; a background task asks the data servers to delete them.

Shrinking a file (setattr size, O_TRUNC) first truncates its objects on the data
servers, then commits the new size, so old bytes never reappear past a later extension.
"""
from __future__ import annotations

import errno
import functools
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from metaserver import keys as K
from metaserver.namespace import Cred, Namespace
from metaserver.store import LmdbStore, Store, WriteTxn
from pfs import auth, caps
from pfs.auth import ClientAuth, ServerAuth
from pfs.config import ConfigError, MetaConfig
from pfs.layout import object_size
from pfs.messages import meta as M
from pfs.messages.base import Empty
from pfs.messages.records import At
from pfs.wire.protocol import Limits
from pfs.wire.rpc import ConnContext, Reply, Request, RpcClient, RpcService

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_BATCH = 256  # operations per group commit (bounds how long one commit holds the loop)
DELETE_CHUNK = 1024  # object ids per delete request
DELETE_BATCH = 256  # queue entries per deletion round
DELETE_RETRY = 2.0  # seconds before retrying deletions that failed
DELETE_COALESCE = 0.25  # seconds queued deletions wait to be sent together
DATA_TIMEOUT = 30.0  # seconds per call to a data server
MAX_CLOSES = 4096  # handles one request may release along with it ("closes")


@dataclass(slots=True, eq=False)
class _Op:
    fn: Callable[[WriteTxn], Any]
    done: trio.Event | None
    result: Any = None
    error: BaseException | None = None


class _Undo(Exception):
    """Rolls back a nested transaction that only checked what an operation would do."""


@dataclass(slots=True)
class _Live:
    host: str
    port: int
    total: int
    free: int
    seen: float  # time.monotonic() of the last register/heartbeat


# Methods a peer with the "server" role (a data server) may call; every other one
# needs a client (or, on an unsecured cluster, anyone).
SERVER_METHODS = frozenset({"hello", "register", "heartbeat", "servers", "statfs"})


def rights_of(flags: int) -> int:
    acc = flags & os.O_ACCMODE
    return {os.O_RDONLY: caps.READ, os.O_WRONLY: caps.WRITE}.get(acc, caps.READ | caps.WRITE)


def meta_security(config: MetaConfig) -> tuple[ServerAuth, ClientAuth, dict[str, bytes]]:
    """From the config: how peers authenticate to the metaserver, how it authenticates
    to data servers, and the data-plane keys it hands to registered data servers."""
    tls = auth.server_tls_from(config.tls_cert, config.tls_key, config.tls_ca)
    keys: dict[str, tuple[bytes, auth.Identity]] = {}
    data_keys: dict[str, bytes] = {}
    if config.key_file:
        keys[auth.CLUSTER] = (auth.read_secret_file(config.key_file),
                              auth.Identity(auth.CLUSTER, "server"))
    elif config.node_keys and tls is None:
        raise ConfigError("node_keys need key_file (the cluster key) as well")
    for nk in config.node_keys:
        k = auth.read_secret_file(nk.file)
        keys[nk.name] = (k, auth.Identity(nk.name, "client", (nk.uids[0], nk.uids[1]),
                                          (nk.gids[0], nk.gids[1])))
        data_keys[nk.name] = auth.data_plane_key(k)
    if tls is not None:
        own = auth.client_auth(tls_cert=config.tls_cert, tls_key=config.tls_key,
                               tls_ca=config.tls_ca)
        return ServerAuth(tls=tls), own, {}
    own = auth.client_auth(key_file=config.key_file)
    return ServerAuth(keys=keys), own, data_keys


class MetaService(RpcService):
    name = "meta"
    messages = M.REGISTRY
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
                 security: tuple[ServerAuth, ClientAuth, dict[str, bytes]] | None = None
                 ) -> None:
        cfg = config or MetaConfig()
        server_auth, self._own_auth, self._data_keys = security or meta_security(cfg)
        if server_auth.mode == "open":
            log.warning("metaserver: no cluster key or TLS configured: UNSECURED, every peer "
                        "is trusted (development only; see docs/security.md)")
        super().__init__(limits, server_auth)
        self.store = store
        self.config = cfg
        self.signer = signer or caps.CapSigner.generate(cfg.cap_ttl)
        self.ns = Namespace(self.config.layout, servers=self._alive_free, opened=self._opened,
                            is_open=self._is_open, deleting=self._deleting_objects)
        # shared with the writer thread: open counts, inodes being deleted, live servers
        self._lock = threading.Lock()
        self._open: dict[int, int] = {}
        self._dying: set[int] = set()
        self._deleting: set[int] = set()  # live inodes the deleter is deleting objects of
        # inodes whose last link went while open (perhaps in a batch that then failed:
        # a hint, checked against the store when their last handle closes)
        self._orphan_hint: set[int] = set()
        self._live: dict[str, _Live] = {}
        self._send, self._recv = trio.open_memory_channel[_Op](math.inf)
        self._wake_deleter = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._dclients: dict[str, RpcClient] = {}
        self._dlocks: dict[str, trio.Lock] = {}
        self._closed = False
        self._delq_from = 0  # deletion queue sequence number the next round starts at

    # ------------------------------------------------------------------ running
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Format or recover the store, then run the writer and the deleter."""
        await self._in_writer_thread(self._startup)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer, name="meta-writer")
                nursery.start_soon(self._deleter, name="meta-deleter")
                task_status.started()
        finally:
            self._closed = True
            for client in self._dclients.values():
                client.close()

    async def serve_all(self, host: str, port: int, *,
                        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.run)
            bound = await nursery.start(self.serve, host, port)
            task_status.started(bound)

    def _startup(self) -> None:
        with self.store.write() as txn:
            if self.ns.format(txn):
                log.info("formatted a new metadata store")
            orphans = self.ns.orphans(txn)
            for ino in orphans:
                self.ns.reclaim(txn, ino)
            if orphans:
                log.info("reclaimed %d orphaned inode(s) from the previous run", len(orphans))

    async def _in_writer_thread(self, fn: Callable[[], Any]) -> Any:
        if self.store.threaded:
            return await trio.to_thread.run_sync(fn)
        return fn()

    # ------------------------------------------------------------------ group commit
    async def _mutate(self, fn: Callable[[WriteTxn], Any]) -> Any:
        op = _Op(fn, trio.Event())
        self._send.send_nowait(op)
        assert op.done is not None
        await op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    async def _writer(self) -> None:
        while True:
            batch = [await self._recv.receive()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._recv.receive_nowait())
                except trio.WouldBlock:
                    break
            # The batch runs and commits in the event loop's own thread: handing it to a
            # worker thread costs more (~300 us here) than the loop loses by waiting for
            # the fsync, and requests arriving meanwhile simply join the next batch.
            self._run_batch(batch)
            await trio.lowlevel.checkpoint()
            with self._lock:
                self._dying.clear()
            for op in batch:
                if op.done is not None:
                    op.done.set()
                elif op.error is not None:
                    log.warning("background metadata update failed: %s", op.error)
            self._wake_deleter.set()

    def _run_batch(self, batch: list[_Op]) -> None:
        try:
            with self.store.write() as txn:
                for op in batch:
                    try:
                        with txn.nested() as sub:
                            op.result = op.fn(sub)
                    except Exception as exc:  # noqa: BLE001 - re-raised in the op's handler
                        op.error = exc
        except OSError as exc:  # the commit itself failed: nothing of the batch is stored
            log.error("metadata commit of %d operation(s) failed: %s", len(batch), exc)
            for op in batch:
                if op.error is None:
                    op.error = exc

    # ------------------------------------------------------------------ open counts
    def _opened(self, ino: int) -> bool:
        """Namespace hook (writer thread): keep ``ino`` as an orphan if open; else mark
        it dying so an ``open`` racing with its deletion fails."""
        with self._lock:
            if self._open.get(ino, 0) > 0:
                self._orphan_hint.add(ino)
                return True
            self._dying.add(ino)
            return False

    def _is_open(self, ino: int) -> bool:
        """Namespace hook (writer thread): whether ``ino`` has open handles; unlike
        :meth:`_opened` it marks nothing."""
        with self._lock:
            return self._open.get(ino, 0) > 0

    def _deleting_objects(self, ino: int) -> bool:
        """Namespace hook: whether objects of an old layout of ``ino`` are being deleted
        right now (its layout must not change meanwhile)."""
        with self._lock:
            return ino in self._deleting

    def _ref(self, ino: int) -> None:
        with self._lock:
            if ino in self._dying:
                raise OSError(errno.ENOENT, f"inode {ino} is being removed")
            self._open[ino] = self._open.get(ino, 0) + 1

    def _unref(self, ino: int) -> bool:
        """One handle fewer; True when that was the last one and ``ino`` is an orphan."""
        with self._lock:
            n = self._open.get(ino, 0) - 1
            if n > 0:
                self._open[ino] = n
                return False
            self._open.pop(ino, None)
            if ino not in self._orphan_hint:
                return False  # never made an orphan while open: no store read per close
            self._orphan_hint.discard(ino)
        if self._closed:
            return False
        with self.store.read() as txn:
            return txn.get(K.orphan(ino)) is not None

    def _reclaim(self, ino: int, txn: WriteTxn) -> bool:
        return self.ns.reclaim(txn, ino)

    def _new_fh(self, ctx: ConnContext, ino: int, flags: int = os.O_RDONLY) -> int:
        fhs = ctx.state.setdefault("fhs", {})
        fh = ctx.state.get("next_fh", 1)
        ctx.state["next_fh"] = fh + 1
        fhs[fh] = ino
        ctx.state.setdefault("rights", {})[fh] = rights_of(flags)
        return fh

    def _opened_reply(self, ctx: ConnContext, attr: dict[str, Any], layout: Any,
                      flags: int, cred: Cred, parent_attr: Any = None) -> M.OpenedReply:
        """An open/create reply: the handle, and a capability for its data."""
        ino = attr["ino"]
        fh = self._new_fh(ctx, ino, flags)
        if not cred.root:  # its writes drop setuid/setgid (see Namespace.commit_size)
            ctx.state.setdefault("fh_user", set()).add(fh)
        cap, ttl = self.signer.issue(ino, rights_of(flags))
        return M.OpenedReply(attr=attr, fh=fh, layout=layout, cap=cap, cap_ttl=ttl,
                             parent_attr=parent_attr)

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
                self._release_closed(ctx, closes)
            raise
        if msg.closes:
            self._release_closed(ctx, msg.closes)
        return self.encode(msg, await handler(ctx, msg))

    def _release_closed(self, ctx: ConnContext, fhs: list[Any]) -> None:
        """Handles the client closed with nothing to commit, sent along with its next
        request (docs/rpc.md, ``closes``) and released before it: a close without a
        round trip of its own. Unknown handles are skipped (already released)."""
        if len(fhs) > MAX_CLOSES:
            raise OSError(errno.EINVAL, f"closes: {len(fhs)} handles, at most {MAX_CLOSES}")
        if not all(isinstance(fh, int) and not isinstance(fh, bool) for fh in fhs):
            raise OSError(errno.EINVAL, "closes: handles must be integers")
        open_fhs: dict[int, int] = ctx.state.get("fhs", {})
        for fh in fhs:
            ino = open_fhs.pop(fh, None)
            if ino is None:
                continue
            ctx.state.get("rights", {}).pop(fh, None)
            ctx.state.get("fh_user", set()).discard(fh)
            if self._unref(ino) and not self._closed:  # the last handle of an orphan
                self._send.send_nowait(_Op(functools.partial(self._reclaim, ino), None))

    async def rpc_release(self, ctx: ConnContext, req: M.Release) -> Empty:
        """Only its ``closes`` (handled in ``dispatch``): what a client sends when no
        other request comes soon enough to carry them."""
        return Empty()

    def _at(self, at: At, cred: Cred) -> tuple[int, bytes]:
        """Where a request's entry lives: ``parent`` + ``name``, or a ``path`` resolved here
        (one round trip for path-based clients instead of a resolve, then the call)."""
        if at.path is not None:
            with self.store.read() as txn:
                return self.ns.entry_of(txn, cred, at.path)
        assert at.parent is not None and at.name is not None  # the message checked
        return at.parent, at.name

    def _cred(self, ctx: ConnContext, req: Any) -> Cred:
        """The caller's credentials (the request's ``cred``, checked by its message),
        squashed and checked against what its key allows."""
        uid, gid, groups = req.cred
        cred = Cred(uid, gid, groups)
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
        fhs: dict[int, int] = ctx.state.pop("fhs", {})
        for ino in fhs.values():
            if self._unref(ino) and not self._closed:
                self._send.send_nowait(_Op(functools.partial(self._reclaim, ino), None))

    # ------------------------------------------------------------------ data servers
    def _alive_free(self) -> dict[str, int]:
        limit = time.monotonic() - self.config.heartbeat_timeout
        with self._lock:
            return {sid: s.free for sid, s in self._live.items() if s.seen >= limit}

    def _alive(self, sid: str) -> _Live | None:
        with self._lock:
            s = self._live.get(sid)
        if s is None or s.seen < time.monotonic() - self.config.heartbeat_timeout:
            return None
        return s

    async def _dclient(self, sid: str) -> RpcClient:
        lock = self._dlocks.setdefault(sid, trio.Lock())
        async with lock:
            client = self._dclients.get(sid)
            if client is not None and client.alive:
                return client
            s = self._alive(sid)
            if s is None:
                raise OSError(errno.EHOSTDOWN, f"data server {sid} is down")
            assert self._nursery is not None
            client = await self._own_auth.open_rpc(self._nursery, s.host, s.port,
                                                   limits=self.limits, timeout=DATA_TIMEOUT)
            self._dclients[sid] = client
            return client

    async def _call_servers(self, calls: dict[str, list[tuple[str, dict[str, Any]]]]
                            ) -> dict[str, OSError]:
        """Run each server's calls in order, servers in parallel; errors by server."""
        errors: dict[str, OSError] = {}

        async def one(sid: str, todo: list[tuple[str, dict[str, Any]]]) -> None:
            try:
                client = await self._dclient(sid)
                for method, fields in todo:
                    # an admin capability for this server only; its generation fences
                    # the inode (every capability issued before is stale for writing)
                    ino = fields["obj"][0] if "obj" in fields else 0
                    cap, _ = self.signer.issue(ino, caps.ADMIN, ttl=DATA_TIMEOUT * 2, sid=sid)
                    await client.call(method, {**fields, "cap": cap})
            except OSError as exc:
                errors[sid] = exc

        async with trio.open_nursery() as nursery:
            for sid, todo in calls.items():
                nursery.start_soon(one, sid, todo)
        return errors

    async def _truncate_objects(self, ino: int, layout: dict[str, Any], size: int) -> None:
        unit, count = layout["unit"], layout["count"]
        calls: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for stripe, sids in enumerate(layout["servers"]):
            fields = {"obj": [ino, stripe], "size": object_size(unit, count, stripe, size)}
            for sid in sids:
                calls.setdefault(sid, []).append(("truncate", fields))
        # reach every server before cutting any object: a replica cut while another
        # cannot be leaves copies that disagree about data the file (its size unchanged
        # by the failed truncation) still has
        errors = await self._call_servers({sid: [] for sid in calls})
        if not errors:
            errors = await self._call_servers(calls)
        if errors:
            sid, exc = next(iter(errors.items()))
            raise OSError(errno.EIO, f"cannot truncate inode {ino} on data server {sid}: {exc}")

    async def _deleter(self) -> None:
        while True:
            with trio.move_on_after(30):
                await self._wake_deleter.wait()
            # let deletions pile up a moment: one round (a delete per data server and
            # one commit) then serves many unlinks instead of costing each its own
            await trio.sleep(DELETE_COALESCE)
            self._wake_deleter = trio.Event()
            try:
                failed = await self._delete_round()
            except OSError as exc:  # its commit failed: the entries stay queued
                log.warning("deletion round failed, will retry: %s", exc)
                failed = True
            if failed:
                await trio.sleep(DELETE_RETRY)
                self._wake_deleter.set()  # retry then, not when some change next wakes us

    async def _delete_round(self) -> bool:
        """Send one round of queued deletions; True if some must be retried."""
        with self.store.read() as txn:
            entries = self.ns.delq_entries(txn, DELETE_BATCH, self._delq_from)
            if not entries and self._delq_from:
                self._delq_from = 0
                entries = self.ns.delq_entries(txn, DELETE_BATCH)
        if not entries:
            return False
        # the next round goes on after this one's entries, so a round's worth that one
        # server keeps refusing cannot hold back the ones behind them
        self._delq_from = entries[-1][0] + 1 if len(entries) >= DELETE_BATCH else 0
        with self.store.read() as txn:
            objs, needs, live = self.ns.deletion_plan(txn, entries)
        calls = {sid: [("delete", {"objs": lst[i:i + DELETE_CHUNK]})
                       for i in range(0, len(lst), DELETE_CHUNK)]
                 for sid, lst in objs.items()}
        # the plan spared the objects of these inodes' current layouts: until the
        # deletes are done, a new layout could take back one of those being deleted
        with self._lock:
            self._deleting |= live
        try:
            errors = await self._call_servers(calls)
        finally:
            with self._lock:
                self._deleting -= live
        for sid, exc in errors.items():
            log.debug("deletion on data server %s deferred: %s", sid, exc)
        done = [seq for seq, sids in needs.items() if not sids & errors.keys()]
        if done:
            def finish(txn: WriteTxn) -> None:
                for seq in done:
                    self.ns.delq_done(txn, seq)
            await self._mutate(finish)
        if self._delq_from and not errors:
            self._wake_deleter.set()  # more queued than one round takes
        return bool(errors)

    # ------------------------------------------------------------------ handlers
    async def rpc_hello(self, ctx: ConnContext, req: M.Hello) -> M.HelloReply:
        ctx.state["client"] = req.client
        return M.HelloReply(root=K.ROOT_INO, version=PROTOCOL_VERSION)

    async def rpc_resolve(self, ctx: ConnContext, req: M.Resolve) -> M.ResolveReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            r = self.ns.resolve(txn, cred, req.path, req.follow)
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
        kw: dict[str, Any] = {"mode": req.mode, "uid": req.uid, "gid": req.gid,
                              "size": req.size, "atime": req.atime, "mtime": req.mtime}
        size = kw["size"]
        if size is not None:
            with self.store.read() as txn:
                plan = self.ns.truncate_plan(txn, cred, ino, size)
            if plan is not None:
                if any(v is not None for k, v in kw.items() if k != "size"):
                    # the other changes must be allowed before any object is cut
                    await self._mutate(functools.partial(self._try_setattr, cred, ino, kw))
                await self._truncate_objects(ino, plan[0], size)
        attr = await self._mutate(lambda t: self.ns.setattr(t, cred, ino, **kw))
        return M.AttrReply(attr=attr)

    def _try_setattr(self, cred: Cred, ino: int, kw: dict[str, Any], txn: WriteTxn) -> None:
        """Raise what ``setattr`` would raise; change nothing."""
        try:
            with txn.nested() as sub:
                self.ns.setattr(sub, cred, ino, **kw)
                raise _Undo
        except _Undo:
            pass

    async def rpc_access(self, ctx: ConnContext, req: M.Access) -> Empty:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            self.ns.access(txn, cred, req.ino, req.mask)
        return Empty()

    async def _entry_change(self, req: M.EntryChange, parent: int,
                            fn: Callable[[WriteTxn], Any]) -> M.EntryReply:
        """Run ``fn`` (it makes or removes an entry of ``parent``; its result, if any, is
        the reply's ``attr``). With ``want_parent`` the reply also carries the parent's
        new attributes: the kernel asks for them next (its cached ones went stale), and
        the mount can answer without a round trip."""
        want = req.want_parent

        def op(txn: WriteTxn) -> tuple[Any, Any]:
            return fn(txn), self.ns.getattr(txn, parent) if want else None

        result, parent_attr = await self._mutate(op)
        return M.EntryReply(attr=result, parent_attr=parent_attr)

    async def rpc_mkdir(self, ctx: ConnContext, req: M.Mkdir) -> M.EntryReply:
        cred, mode = self._cred(ctx, req), req.mode
        parent, name = self._at(req.at, cred)
        return await self._entry_change(req, parent,
                                        lambda t: self.ns.mkdir(t, cred, parent, name, mode))

    async def rpc_mknod(self, ctx: ConnContext, req: M.Mknod) -> M.EntryReply:
        cred = self._cred(ctx, req)
        parent, name = self._at(req.at, cred)
        mode, rdev = req.mode, req.rdev
        return await self._entry_change(
            req, parent, lambda t: self.ns.mknod(t, cred, parent, name, mode, rdev))

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

        def op(txn: WriteTxn) -> tuple[dict[str, Any], Any, Any]:
            attr, layout, _ = self.ns.create(txn, cred, parent, name, mode, flags)
            if not abandoned:
                self._ref(attr["ino"])
                opened.append(attr["ino"])
            return attr, layout, self.ns.getattr(txn, parent) if want_parent else None

        try:
            attr, layout, parent_attr = await self._mutate(op)
        except BaseException:
            abandoned = True  # the op may still be queued
            for ino in opened:  # the op ran but the batch did not commit
                await self._release(ino)
            raise
        return self._opened_reply(ctx, attr, layout, flags, cred, parent_attr)

    async def rpc_open(self, ctx: ConnContext, req: M.Open) -> M.OpenedReply:
        cred, ino, flags = self._cred(ctx, req), req.ino, req.flags
        if not flags & os.O_TRUNC:
            self._ref(ino)
            try:
                with self.store.read() as txn:
                    attr, layout = self.ns.open(txn, cred, ino, flags)
            except BaseException:
                await self._release(ino)
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
                self._ref(ino)
                opened.append(ino)
            return result

        try:
            attr, layout = await self._mutate(op)
        except BaseException:
            abandoned = True
            for i in opened:
                await self._release(i)
            raise
        return self._opened_reply(ctx, attr, layout, flags, cred)

    async def _release(self, ino: int) -> None:
        if self._unref(ino):
            await self._mutate(lambda t: self.ns.reclaim(t, ino))

    def _fh(self, ctx: ConnContext, fh: int, pop: bool = False) -> int:
        fhs: dict[int, int] = ctx.state.get("fhs", {})
        ino = fhs.pop(fh, None) if pop else fhs.get(fh)
        if ino is None:
            raise OSError(errno.EBADF, f"no open file handle {fh}")
        if pop:
            ctx.state.get("rights", {}).pop(fh, None)
        return ino

    async def rpc_renew(self, ctx: ConnContext, req: M.Renew) -> M.CapReply:
        """A fresh capability for an open handle (before the old one expires, or after
        a truncation made it stale)."""
        ino = self._fh(ctx, req.fh)
        cap, ttl = self.signer.issue(ino, ctx.state["rights"][req.fh])
        return M.CapReply(cap=cap, cap_ttl=ttl)

    async def rpc_close(self, ctx: ConnContext, req: M.Close) -> Empty:
        written_end, mtime = req.written_end, req.mtime
        fh = req.fh
        ino = self._fh(ctx, fh, pop=True)
        users: set[int] = ctx.state.get("fh_user", set())
        root = fh not in users
        users.discard(fh)
        try:
            if written_end is not None or mtime is not None:
                try:
                    await self._mutate(
                        lambda t: self.ns.commit_size(t, ino, written_end, mtime, root))
                except FileNotFoundError:
                    pass
        finally:
            await self._release(ino)
        return Empty()

    async def rpc_commit_size(self, ctx: ConnContext, req: M.CommitSize) -> M.AttrReply:
        written_end, mtime = req.written_end, req.mtime
        ino = self._fh(ctx, req.fh)
        root = req.fh not in ctx.state.get("fh_user", set())
        return M.AttrReply(attr=await self._mutate(
            lambda t: self.ns.commit_size(t, ino, written_end, mtime, root)))

    async def rpc_unlink(self, ctx: ConnContext, req: M.Unlink) -> M.EntryReply:
        cred = self._cred(ctx, req)
        parent, name = self._at(req.at, cred)
        return await self._entry_change(req, parent,
                                        lambda t: self.ns.unlink(t, cred, parent, name))

    async def rpc_rmdir(self, ctx: ConnContext, req: M.Rmdir) -> M.EntryReply:
        cred = self._cred(ctx, req)
        parent, name = self._at(req.at, cred)
        return await self._entry_change(req, parent,
                                        lambda t: self.ns.rmdir(t, cred, parent, name))

    async def rpc_rename(self, ctx: ConnContext, req: M.Rename) -> Empty:
        cred = self._cred(ctx, req)
        parent, name = self._at(req.at, cred)
        newparent, newname = self._at(req.new, cred)
        flags = req.flags
        await self._mutate(
            lambda t: self.ns.rename(t, cred, parent, name, newparent, newname, flags))
        return Empty()

    async def rpc_link(self, ctx: ConnContext, req: M.Link) -> M.AttrReply:
        cred, ino = self._cred(ctx, req), req.ino
        newparent, newname = self._at(req.new, cred)
        return M.AttrReply(attr=await self._mutate(
            lambda t: self.ns.link(t, cred, ino, newparent, newname)))

    async def rpc_symlink(self, ctx: ConnContext, req: M.Symlink) -> M.EntryReply:
        cred, target = self._cred(ctx, req), req.target
        parent, name = self._at(req.at, cred)
        return await self._entry_change(
            req, parent, lambda t: self.ns.symlink(t, cred, parent, name, target))

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
        limit = time.monotonic() - self.config.heartbeat_timeout
        with self._lock:
            alive = [s for s in self._live.values() if s.seen >= limit]
        total, free = sum(s.total for s in alive), sum(s.free for s in alive)
        with self.store.read() as txn:
            return M.StatfsReply(**self.ns.statfs(txn, total, free))

    async def rpc_getxattr(self, ctx: ConnContext, req: M.Getxattr) -> M.ValueReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            return M.ValueReply(value=self.ns.getxattr(txn, cred, req.ino, req.name))

    async def rpc_setxattr(self, ctx: ConnContext, req: M.Setxattr) -> Empty:
        cred, ino, name = self._cred(ctx, req), req.ino, req.name
        value, flags = req.value, req.flags
        await self._mutate(lambda t: self.ns.setxattr(t, cred, ino, name, value, flags))
        return Empty()

    async def rpc_listxattr(self, ctx: ConnContext, req: M.Listxattr) -> M.NamesReply:
        cred = self._cred(ctx, req)
        with self.store.read() as txn:
            return M.NamesReply(names=self.ns.listxattr(txn, cred, req.ino))

    async def rpc_removexattr(self, ctx: ConnContext, req: M.Removexattr) -> Empty:
        cred, ino, name = self._cred(ctx, req), req.ino, req.name
        await self._mutate(lambda t: self.ns.removexattr(t, cred, ino, name))
        return Empty()

    async def rpc_get_layout(self, ctx: ConnContext, req: M.GetLayout) -> M.LayoutReply:
        with self.store.read() as txn:
            return M.LayoutReply(layout=self.ns.get_layout(txn, req.ino))

    async def rpc_set_layout(self, ctx: ConnContext, req: M.SetLayout) -> M.LayoutReply:
        cred, ino = self._cred(ctx, req), req.ino
        unit, count, replicas = req.unit, req.count, req.replicas
        return M.LayoutReply(layout=await self._mutate(
            lambda t: self.ns.set_layout(t, cred, ino, unit, count, replicas)))

    async def rpc_servers(self, ctx: ConnContext, req: M.Servers) -> M.ServersReply:
        with self.store.read() as txn:
            stored = self.ns.list_servers(txn)
        limit = time.monotonic() - self.config.heartbeat_timeout
        out: dict[str, Any] = {}
        with self._lock:
            for sid, rec in stored.items():
                live = self._live.get(sid)
                if live is not None:
                    rec = {"host": live.host, "port": live.port, "total": live.total,
                           "free": live.free}
                out[sid] = {**rec, "alive": live is not None and live.seen >= limit}
        return M.ServersReply(servers=out)

    async def rpc_register(self, ctx: ConnContext, req: M.Register) -> M.RegisterReply:
        if ctx.identity is None or not ctx.identity.may_serve:
            raise OSError(errno.EACCES, "register: only a data server (cluster key or server "
                                        "certificate) may register")
        sid = req.sid or uuid.uuid4().hex  # port, sizes and sid: checked by the message
        host, port, total, free = req.host, req.port, req.total, req.free
        await self._mutate(
            lambda t: self.ns.register_server(t, sid, host, port, total, free))
        with self._lock:
            self._live[sid] = _Live(host, port, total, free, time.monotonic())
        old = self._dclients.pop(sid, None)
        if old is not None:
            old.close()
        log.info("data server %s registered at %s:%d (%d of %d bytes free)",
                 sid, host, port, free, total)
        # what it needs to check clients: the capability key, the generation floor
        # (capabilities from before this registration are stale for writing: it may have
        # restarted and lost its fences) and the node keys' data-plane keys
        return M.RegisterReply(sid=sid, cap_key=self.signer.public_bytes,
                               gen=self.signer.next_gen(), cap_ttl=self.config.cap_ttl,
                               data_keys=self._data_keys)

    async def rpc_heartbeat(self, ctx: ConnContext, req: M.Heartbeat) -> Empty:
        if ctx.identity is None or not ctx.identity.may_serve:
            raise OSError(errno.EACCES, "heartbeat: only data servers send heartbeats")
        sid, total, free = req.sid, req.total, req.free
        with self._lock:
            live = self._live.get(sid)
            if live is not None:
                live.total, live.free, live.seen = total, free, time.monotonic()
                return Empty()
        with self.store.read() as txn:
            rec = self.ns.list_servers(txn).get(sid)
        if rec is None:
            raise OSError(errno.ENOENT, f"unknown data server {sid}; register first")
        with self._lock:
            self._live[sid] = _Live(rec["host"], rec["port"], total, free, time.monotonic())
        return Empty()




async def serve_meta(config: MetaConfig, *, store: Store | None = None,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Open the store named by ``config.db`` (or use ``store``) and serve until
    cancelled; ``await nursery.start(serve_meta, config)`` returns the bound port."""
    owned = store is None
    security = meta_security(config)  # key files are checked before anything starts
    st: Store = LmdbStore(config.db, config.map_size) if store is None else store
    try:
        signer = (caps.CapSigner.load_or_create(os.path.join(config.db, caps.KEY_FILE),
                                                config.cap_ttl)
                  if owned else caps.CapSigner.generate(config.cap_ttl))
        service = MetaService(st, config, signer=signer, security=security)
        await service.serve_all(config.host, config.port, task_status=task_status)
    finally:
        if owned:
            st.close()

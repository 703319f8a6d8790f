"""The message layer, in memory (no sockets): round trips, each violation's errno,
limits checked before anything is built, registry completeness, docs/rpc.md in sync."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from pfs.core.messages import data as D
from pfs.core.messages import doc
from pfs.core.messages import meta as M
from pfs.core.messages.base import (
    AnyField,
    BoolField,
    BytesField,
    Empty,
    Field,
    IntField,
    ListField,
    MapField,
    PayloadField,
    RequestMessage,
    StrField,
)
from pfs.core.messages.records import (
    At,
    AtField,
    CredField,
    ObjIdField,
    TimeField,
    Volume,
    VolumeField,
)
from pfs.core.wire.rpc import ConnContext, Reply, Request, RpcService
from pfs.dataserver.server import DataService
from pfs.metaserver.server import MetaService

ROOT = Path(__file__).resolve().parents[2]
ALL = [*M.REGISTRY, *D.REGISTRY]


def _sample(spec: Field) -> dict[str, Any]:
    """A valid wire value for ``spec``, as the keys it occupies."""
    if isinstance(spec, AtField):
        return {spec.parent.key: 7, spec.name_.key: b"n"}
    value: Any
    if isinstance(spec, CredField):
        value = [1000, 100, [5, 6]]
    elif isinstance(spec, ObjIdField):
        value = [3, 1]
    elif isinstance(spec, ListField):
        value = ([[1, 2]] if isinstance(spec.item, ObjIdField)
                 else [["/d", "boot:2049", 10, 5]] if isinstance(spec.item, VolumeField)
                 else ["s"] if isinstance(spec.item, StrField)
                 else [b"k"] if isinstance(spec.item, BytesField)
                 else [True] if isinstance(spec.item, BoolField)
                 else [[1, 2]] if isinstance(spec.item, ListField)
                 else [4])
    elif isinstance(spec, TimeField):
        value = "now"
    elif isinstance(spec, IntField):
        value = spec.lo if spec.lo is not None else 9
    elif isinstance(spec, BoolField):
        value = True
    elif isinstance(spec, StrField):
        value = "s"
    elif isinstance(spec, BytesField):
        value = b"b"
    elif isinstance(spec, MapField):
        value = {"k": 1}
    elif isinstance(spec, (AnyField, PayloadField)):
        return {} if isinstance(spec, PayloadField) else {spec.key: b"any"}
    else:
        raise AssertionError(f"no sample for {spec!r}")
    return {spec.key: value}


def sample(cls: type[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in cls._fields.values():
        out.update(_sample(spec))
    return out


def err(fn: Any, *args: Any) -> OSError:
    with pytest.raises(OSError) as ei:
        fn(*args)
    return ei.value


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("cls", ALL, ids=lambda c: f"{c.registry.service}.{c.method}")
def test_every_request_and_reply_round_trips(cls: type[RequestMessage]) -> None:
    wire = sample(cls)
    msg = cls.from_wire(wire)
    again = msg.to_wire()
    assert again.pop("m") == cls.method
    # decoded values come back as the same map (tuples travel as msgpack arrays)
    assert cls.from_wire(again) == msg
    assert set(again) == set(wire)
    reply = cls.reply.from_wire(sample(cls.reply))
    assert cls.reply.from_wire(reply.to_wire()) == reply


def test_decoded_values_have_their_python_types() -> None:
    m = M.Create.from_wire({"parent": 1, "name": "caf\udce9", "mode": 0o644,
                            "cred": [1, 2, [3]], "closes": [4, 5]})
    assert m.at == At(1, b"caf\xe9") and m.cred == (1, 2, (3,)) and m.closes == [4, 5]
    assert m.flags == os.O_WRONLY and m.want_parent is False
    r = D.Read.from_wire({"obj": [1, 2], "off": 0, "len": 10})
    assert r.obj == (1, 2) and r.cap is None
    d = D.Delete.from_wire({"objs": [[1, 2], (3, 4)]})
    assert d.objs == [(1, 2), (3, 4)]
    assert M.Setattr.from_wire({"ino": 2, "cred": [0, 0], "mtime": None}).mtime is None
    assert M.Setattr.from_wire({"ino": 2, "cred": [0, 0], "atime": "now"}).atime == "now"


def wire(msg: Any) -> Any:
    """A map as the peer decodes it (msgpack sends tuples as arrays)."""
    return msgpack.unpackb(msgpack.packb(msg.to_wire(), use_bin_type=True), raw=False)


def test_wire_format_is_the_old_one() -> None:
    """What clients sent before the message layer, key for key."""
    cred = (1, 2, (3,))
    assert wire(M.Close(fh=3)) == {"m": "close", "fh": 3, "written_end": None,
                                   "mtime": None}
    assert wire(M.Register(host="h", port=1, total=2, free=1)) == {
        "m": "register", "sid": None, "host": "h", "port": 1, "total": 2, "free": 1}
    assert wire(M.Mkdir(at=At.by_path(b"/a"), mode=0o755, cred=cred)) == {
        "m": "mkdir", "path": b"/a", "mode": 0o755, "cred": [1, 2, [3]]}
    assert wire(M.Unlink(at=At.of(1, b"a"), cred=cred, want_parent=True)) == {
        "m": "unlink", "parent": 1, "name": b"a", "cred": [1, 2, [3]], "want_parent": True}
    assert wire(M.Rename(at=At.of(1, b"a"), new=At.by_path(b"/b"), cred=cred)) == {
        "m": "rename", "parent": 1, "name": b"a", "newpath": b"/b", "flags": 0,
        "cred": [1, 2, [3]]}
    assert wire(M.Setattr(ino=5, cred=cred, size=0)) == {
        "m": "setattr", "ino": 5, "cred": [1, 2, [3]], "size": 0}
    assert M.GetLayout.reply(layout=None).to_wire() == {"layout": None}
    assert wire(M.EntryReply()) == {}
    assert Empty().to_wire() == {}


# ---------------------------------------------------------------- violations
@pytest.mark.parametrize(("cls", "wire", "code", "field"), [
    (M.Getattr, {}, errno.EINVAL, "ino"),
    (M.Getattr, {"ino": "1"}, errno.EINVAL, "ino"),
    (M.Getattr, {"ino": True}, errno.EINVAL, "ino"),
    (M.Getattr, {"ino": 1.0}, errno.EINVAL, "ino"),
    (M.Mkdir, {"parent": 1, "name": b"d", "mode": 0o755}, errno.EINVAL, "cred"),
    (M.Mkdir, {"parent": 1, "name": b"x" * 256, "mode": 1, "cred": [0, 0]},
     errno.ENAMETOOLONG, "name"),
    (M.Mkdir, {"path": b"/" + b"x" * 4095, "mode": 1, "cred": [0, 0]},
     errno.ENAMETOOLONG, "path"),
    (M.Mkdir, {"name": b"x", "mode": 1, "cred": [0, 0]}, errno.EINVAL, "parent"),
    (M.Mkdir, {"parent": 1, "mode": 1, "cred": [0, 0]}, errno.EINVAL, "name"),
    (M.Mkdir, {"parent": 1, "name": 5, "mode": 1, "cred": [0, 0]}, errno.EINVAL, "name"),
    (M.Rename, {"parent": 1, "name": b"a", "newparent": 1, "cred": [0, 0]},
     errno.EINVAL, "newname"),
    (M.Lookup, {"parent": 1, "name": b"x", "cred": "root"}, errno.EINVAL, "cred"),
    (M.Lookup, {"parent": 1, "name": b"x", "cred": [0, 0, ["a"]]}, errno.EINVAL, "cred"),
    (M.Lookup, {"parent": 1, "name": b"x", "cred": [0, True]}, errno.EINVAL, "cred"),
    (M.Symlink, {"parent": 1, "name": b"l", "target": b"t" * 4096, "cred": [0, 0]},
     errno.ENAMETOOLONG, "target"),
    (M.Getxattr, {"ino": 1, "name": b"user." + b"x" * 251, "cred": [0, 0]},
     errno.ERANGE, "name"),
    (M.Setxattr, {"ino": 1, "name": b"user.a", "value": b"v" * 65537, "cred": [0, 0]},
     errno.E2BIG, "value"),
    (M.Setattr, {"ino": 1, "cred": [0, 0], "mtime": "later"}, errno.EINVAL, "mtime"),
    (M.Readdir, {"ino": 1, "cookie": -1, "cred": [0, 0]}, errno.EINVAL, "cookie"),
    (M.Release, {"closes": ["x"]}, errno.EINVAL, "closes"),
    (M.Release, {"closes": 3}, errno.EINVAL, "closes"),
    (M.Register, {"host": "h", "port": 0, "total": 1, "free": 1}, errno.EINVAL, "port"),
    (M.Register, {"sid": "s" * 129, "host": "h", "port": 1, "total": 1, "free": 1},
     errno.EINVAL, "sid"),
    (M.Register, {"host": "h", "port": 1, "total": -1, "free": 1}, errno.EINVAL, "total"),
    (M.Resolve, {"path": b"/a", "follow": 1, "cred": [0, 0]}, errno.EINVAL, "follow"),
    (D.Read, {"obj": [1, 1], "off": -1, "len": 1}, errno.EINVAL, "off"),
    (D.Read, {"obj": [1, 1], "off": 2**63, "len": 1}, errno.EINVAL, "off"),
    (D.Read, {"obj": [1, 1], "off": 0, "len": -1}, errno.EINVAL, "len"),
    (D.Read, {"obj": [1, 1], "len": 1}, errno.EINVAL, "off"),
    (D.Read, {"obj": [1, True], "off": 0, "len": 1}, errno.EINVAL, "object id"),
    (D.Truncate, {"obj": [1, 1], "size": -1}, errno.EINVAL, "size"),
    (D.Delete, {"objs": "nope"}, errno.EINVAL, "objs"),
    (D.Delete, {"objs": [[1, 1], [-1, 0]]}, errno.EINVAL, "object id"),
])
def test_violations_answer_their_errno_and_name_the_field(
        cls: type[RequestMessage], wire: dict[str, Any], code: int, field: str) -> None:
    e = err(cls.from_wire, wire)
    assert e.errno == code, e
    assert field in str(e), e


@pytest.mark.parametrize("bad", [None, "x", [1], [1, 2, 3], [-1, 0], [0, -1], [2**63, 0],
                                 [0, 2**63], ["a", 0], [True, 0], [1.0, 0], {"ino": 1}])
def test_bad_object_ids(bad: Any) -> None:
    for cls, extra in ((D.Read, {"off": 0, "len": 1}), (D.Write, {"off": 0}),
                       (D.Truncate, {"size": 1}), (D.Fsync, {}), (D.StatObj, {}),
                       (D.OpenFd, {})):
        assert err(cls.from_wire, {"obj": bad, **extra}).errno == errno.EINVAL
    assert err(D.Delete.from_wire, {"objs": [[1, 1], bad]}).errno == errno.EINVAL


@pytest.mark.parametrize("bad", [None, "x", ["/d", "fs", 1], ["/d", "fs", -1, 0],
                                 ["/d", 7, 1, 0], [b"/d", "fs", 1, 0], ["/d", "fs", 1, 2**63],
                                 ["/d", "f" * 256, 1, 0], {"path": "/d"}])
def test_volumes_a_data_server_reports(bad: Any) -> None:
    """Each data directory with its filesystem identity; an older server sends none."""
    hb = {"sid": "s", "total": 10, "free": 5}
    assert M.Heartbeat.from_wire(hb).dirs is None
    m = M.Heartbeat.from_wire({**hb, "dirs": [["/d", "boot:2049", 10, 5]]})
    assert m.dirs == [Volume("/d", "boot:2049", 10, 5)]
    assert wire(m)["dirs"] == [["/d", "boot:2049", 10, 5]]
    for cls, extra in ((M.Heartbeat, hb), (M.Register, {"host": "h", "port": 1, "total": 1,
                                                         "free": 0})):
        assert err(cls.from_wire, {**extra, "dirs": [bad]}).errno == errno.EINVAL


def test_list_limits_are_checked_before_their_items() -> None:
    """An over-long list is refused on its length, before any item is looked at or a
    single object id is built."""
    e = err(D.Delete.from_wire, {"objs": [None] * (D.MAX_DELETE + 1)})
    assert e.errno == errno.EINVAL and "at most 65536" in str(e)
    e = err(M.Release.from_wire, {"closes": ["x"] * (M.MAX_CLOSES + 1)})
    assert e.errno == errno.EINVAL and "at most 4096" in str(e)
    assert len(D.Delete.from_wire({"objs": [[1, 2]] * D.MAX_DELETE}).objs) == D.MAX_DELETE


def test_messages_are_keyword_only_values() -> None:
    a, b = M.Getattr(ino=1), M.Getattr(ino=1)
    assert a == b and a != M.Getattr(ino=2) and "ino=1" in repr(a)
    with pytest.raises(TypeError):
        M.Getattr(1)  # type: ignore[misc, call-arg, arg-type]
    with pytest.raises(AttributeError):
        a.other = 1  # type: ignore[attr-defined]  # slotted


# ---------------------------------------------------------------- registry
def test_every_handler_has_a_message_and_every_message_a_handler() -> None:
    for service, registry in ((MetaService, M.REGISTRY), (DataService, D.REGISTRY)):
        assert service.messages is registry
        assert set(service.handler_names()) == set(registry.requests), service
        for cls in registry:
            assert issubclass(cls.reply, M.ReplyMessage), cls


def test_a_typed_service_refuses_a_handler_without_a_message() -> None:
    class Extra(RpcService):
        messages = D.REGISTRY

        async def rpc_frobnicate(self, ctx: ConnContext, req: Any) -> None:
            pass

    with pytest.raises(TypeError, match="frobnicate"):
        Extra()


def _data_service(tmp_path: Path) -> DataService:
    from pfs.core.engine import PosixEngine
    from pfs.dataserver.objects import ObjectStore

    return DataService(ObjectStore([str(tmp_path)]), PosixEngine(), use_sendfile=False)


def test_dispatch_decodes_and_encodes(tmp_path: Path) -> None:
    svc = _data_service(tmp_path)
    ctx = ConnContext(None, "test")  # type: ignore[arg-type]

    async def main() -> None:
        w = await svc.dispatch(ctx, Request("write", {"obj": [1, 0], "off": 0},
                                            bytearray(b"hi")))
        assert w == {"n": 2}
        r = await svc.dispatch(ctx, Request("read", {"obj": [1, 0], "off": 0, "len": 9}, None))
        assert isinstance(r, Reply)
        assert r.fields == {"n": 2} and bytes(r.payload or b"") == b"hi"
        with pytest.raises(OSError) as ei:
            await svc.dispatch(ctx, Request("frobnicate", {}, None))
        assert ei.value.errno == errno.ENOSYS
        with pytest.raises(OSError) as ei:
            await svc.dispatch(ctx, Request("truncate", {"obj": [1, 0], "size": "x"}, None))
        assert ei.value.errno == errno.EINVAL and "'size'" in str(ei.value)

    trio.run(main)
    svc.store.close()


def test_a_reply_of_the_wrong_class_is_a_bug() -> None:
    with pytest.raises(TypeError):
        RpcService.encode(M.Getattr(ino=1), Empty())
    with pytest.raises(TypeError):
        RpcService.encode(M.Getattr(ino=1), {"attr": {}})
    assert RpcService.encode(M.Getattr(ino=1), M.AttrReply(attr={"ino": 1})) == {
        "attr": {"ino": 1}}
    r = RpcService.encode(D.Read(obj=(1, 1), off=0, len=1), Reply(D.ReadReply(n=0)))
    assert isinstance(r, Reply) and r.fields == {"n": 0}
    raw = Request("ping", {}, None)  # an untyped service's handlers answer maps
    assert RpcService.encode(raw, {"pong": True}) == Reply({"pong": True})


# ---------------------------------------------------------------- docs
def test_docs_rpc_md_tables_match_the_definitions() -> None:
    text = (ROOT / "docs" / "rpc.md").read_text()
    assert doc.render(text) == text, (
        "docs/rpc.md and pfs/core/messages drifted: run "
        "`python -m pfs.core.messages.doc --write docs/rpc.md`")
    for cls in ALL:
        assert f"| `{cls.method}` |" in text

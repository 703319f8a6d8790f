"""Metadata plans (pfs/client/ops.py), driven in memory: no socket, no trio."""
from __future__ import annotations

import errno
import os
from types import SimpleNamespace
from typing import Any

import pytest

from pfs.client import ops
from pfs.client.plan import DeferClose, MetaCall, Parallel, Send, Sleep
from pfs.client.types import Cred
from pfs.core.layout import Layout
from pfs.core.messages.base import parse_reply


def _attr(ino: int = 5, size: int = 0) -> dict[str, Any]:
    return {"ino": ino, "mode": 0o100644, "uid": 0, "gid": 0, "size": size, "atime": 0,
            "mtime": 0, "ctime": 0, "nlink": 1, "rdev": 0}


def _wire(cred: Cred) -> Any:
    return (cred.uid, cred.gid, tuple(cred.groups))


def _opened(fh: int, cap: bytes | None = None, ttl: float = 0) -> dict[str, Any]:
    return {"attr": _attr(), "fh": fh, "cap": cap or b"", "cap_ttl": ttl}


def drive(plan: Any, answer: Any) -> tuple[Any, list[Any]]:
    """Run ``plan``; ``answer(effect)`` returns a result or raises; what was asked."""
    seen: list[Any] = []
    value: Any = None
    exc: BaseException | None = None
    while True:
        try:
            eff = plan.send(value) if exc is None else plan.throw(exc)
        except StopIteration as done:
            return done.value, seen
        seen.append(eff)
        value, exc = None, None
        try:
            value = answer(eff)
            if isinstance(eff, MetaCall) and isinstance(value, dict):
                value = parse_reply(eff.msg, value)  # as a driver hands it over
        except OSError as e:
            exc = e


class _State:
    def __init__(self) -> None:
        self.size = 0
        self.written_end = 0
        self.unsynced: set[int] = set()


def _handle(dirty: bool = True, end: int = 100, unsynced: tuple[int, ...] = (),
            durable: bool = True) -> Any:
    st = _State()
    st.written_end = end
    st.unsynced = set(unsynced)
    layout = Layout(4096, 2, 2, (("a", "b"), ("b", "c")), durable)
    h = SimpleNamespace(fh=1, ino=5, flags=os.O_WRONLY, cred=None, path="/f", meta_gen=1,
                        state=st, _dirty=dirty, sent=dirty, writable=True,
                        closed=False, released=0, caps=[],
                        layout=layout, cap=b"c",
                        renew_due=lambda: False)
    h.client = SimpleNamespace(cred=Cred(0, 0), meta=SimpleNamespace(generation=2,
                                                                      wire_cred=_wire),
                               config=SimpleNamespace(timeout=60.0))
    h._set_cap = lambda cap, ttl: h.caps.append(cap)
    h._released = lambda: setattr(h, "released", h.released + 1)
    return h


def test_commit_reopens_a_handle_the_metaserver_lost() -> None:
    h = _handle()

    def answer(eff: Any) -> Any:
        if eff.msg.method == "commit_size" and eff.msg.fh == 1:
            raise OSError(errno.EBADF, "lost")
        if eff.msg.method == "open":
            return _opened(9, b"new", 10)
        return {"attr": _attr(size=100)}

    _, seen = drive(ops.commit(h), answer)
    assert [e.msg.method for e in seen] == ["commit_size", "open", "commit_size"]
    assert seen[1].msg.flags == os.O_WRONLY and h.fh == 9 and h.meta_gen == 2
    assert h.state.size == 100 and not h._dirty


def test_a_failed_commit_leaves_the_handle_dirty() -> None:
    h = _handle()

    def answer(eff: Any) -> Any:
        raise OSError(errno.EIO, "no")

    with pytest.raises(OSError):
        drive(ops.commit(h), answer)
    assert h._dirty


def test_close_with_bytes_to_commit_retries_through_an_outage() -> None:
    h = _handle()
    fails = [errno.ECONNREFUSED, errno.ENOTCONN, errno.ETIMEDOUT]

    def answer(eff: Any) -> Any:
        if isinstance(eff, Sleep):
            return None
        if fails:
            raise OSError(fails.pop(0), "down")
        return {}

    _, seen = drive(ops.close_handle(h), answer)
    sleeps = [e.seconds for e in seen if isinstance(e, Sleep)]
    assert sleeps == [0.05, 0.1, 0.2]  # backing off
    closes = [e for e in seen if isinstance(e, MetaCall)]
    assert len(closes) == 4 and closes[-1].msg.written_end == 100  # type: ignore[attr-defined]
    assert h.closed and h.released == 1 and h.state.size == 100


def test_close_with_nothing_to_commit_is_deferred_and_never_retried() -> None:
    h = _handle(dirty=False)
    _, seen = drive(ops.close_handle(h), lambda eff: True)
    assert seen == [DeferClose(1, 1, True)] and h.released == 1
    h = _handle(dirty=False)

    def answer(eff: Any) -> Any:
        if isinstance(eff, DeferClose):
            return False  # not deferred: a close of its own
        raise OSError(errno.ECONNREFUSED, "down")

    with pytest.raises(OSError):
        drive(ops.close_handle(h), answer)
    assert h.released == 1  # released here even so


def test_a_close_says_whether_its_handle_sent_anything_to_a_data_server() -> None:
    # the metaserver then knows whether a file it created can hold objects
    # (metaserver/handles.py): a handle that wrote, synced, or reads only says nothing
    h = _handle(dirty=False)
    h.sent = True  # wrote, and committed its size since: still no word
    _, seen = drive(ops.close_handle(h), lambda eff: True)
    assert seen == [DeferClose(1, 1, False)]
    h = _handle(dirty=False)
    h.writable = False
    _, seen = drive(ops.close_handle(h), lambda eff: True)
    assert seen == [DeferClose(1, 1, False)]
    h = _handle(dirty=False)  # not deferred: the close of its own carries the word
    _, seen = drive(ops.close_handle(h), lambda eff: False if isinstance(eff, DeferClose)
                    else {})
    close = seen[-1].msg  # type: ignore[attr-defined]
    assert close.method == "close" and close.unwritten == [1] and close.written_end is None
    h = _handle(dirty=False, unsynced=(0,))
    h.sent = False
    drive(ops.fsync(h), lambda eff: {"attr": _attr(size=100)} if isinstance(eff, MetaCall)
          else None)
    assert h.sent  # a sync went to the data servers under its capability


def test_a_final_close_error_is_not_retried() -> None:
    h = _handle()
    with pytest.raises(OSError) as err:
        drive(ops.close_handle(h), lambda eff: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
    assert err.value.errno == errno.EIO and h.released == 1


def test_open_with_o_creat_falls_back_to_the_existing_file() -> None:
    c: Any = SimpleNamespace(cred=Cred(1, 1), umask=0o022, handles=[],
                             meta=SimpleNamespace(wire_cred=_wire))
    c._handle = lambda r, flags, p: (r.fh, flags, p)

    def answer(eff: Any) -> Any:
        if eff.msg.method == "create":
            raise OSError(errno.EEXIST, "exists")
        if eff.msg.method == "resolve":
            return {"attr": _attr(ino=8), "parent": 1, "name": b"b"}
        return _opened(3)

    flags = os.O_CREAT | os.O_WRONLY
    handle, seen = drive(ops.open_path(c, "a//b", flags, 0o666), answer)
    assert handle == (3, flags, "/a/b")
    assert [e.msg.method for e in seen] == ["create", "resolve", "open"]
    assert seen[0].msg.mode == 0o644 and seen[2].msg.ino == 8
    with pytest.raises(FileExistsError):
        drive(ops.open_path(c, "/a/b", flags | os.O_EXCL), answer)


def test_renew_reopens_on_ebadf() -> None:
    h = _handle()

    def answer(eff: Any) -> Any:
        if eff.msg.method == "renew":
            raise OSError(errno.EBADF, "lost")
        return _opened(4, b"c2", 5)

    drive(ops.renew(h), answer)
    assert h.fh == 4 and h.caps == [b"c2", b"c2"]


def test_paths_are_checked_before_any_request() -> None:
    c: Any = SimpleNamespace(cred=Cred(0, 0), umask=0)
    for bad, code in [("", errno.ENOENT), ("a\0b", errno.EINVAL)]:
        with pytest.raises(OSError) as err:
            drive(ops.mkdir(c, bad), lambda eff: {})
        assert err.value.errno == code


# -- durable acknowledgements: the data is synced before the size is committed ---------
def _sync_answer(fail: dict[str, int] | None = None) -> tuple[Any, list[tuple[str, Any]]]:
    """An ``answer`` that runs Parallel sub-plans in turn and logs (sid, objs) per sync."""
    synced: list[tuple[str, Any]] = []

    def answer(eff: Any) -> Any:
        if isinstance(eff, Parallel):
            return [drive(p, answer)[0] for p in eff.plans]
        if isinstance(eff, Send):
            assert eff.msg.method == "sync"
            if fail and eff.sid in fail:
                raise OSError(fail[eff.sid], f"injected on {eff.sid}")
            synced.append((eff.sid, eff.msg.objs))  # type: ignore[attr-defined]
            return 0
        if isinstance(eff, DeferClose):
            return False
        return {"attr": _attr(size=100)}

    return answer, synced


def test_commit_syncs_what_was_written_on_every_replica_before_the_size() -> None:
    h = _handle(unsynced=(1,))
    answer, synced = _sync_answer()
    _, seen = drive(ops.commit(h), answer)
    assert sorted(synced) == [("b", [(5, 1)]), ("c", [(5, 1)])]
    methods = [e.msg.method for e in seen if isinstance(e, (Send, MetaCall))]
    assert methods[-1] == "commit_size" and "commit_size" not in methods[:-1]
    assert h.state.unsynced == set() and not h._dirty


def test_close_syncs_then_commits_and_an_opt_out_skips_the_sync() -> None:
    h = _handle(unsynced=(0, 1))
    answer, synced = _sync_answer()
    drive(ops.close_handle(h), answer)
    assert sorted(synced) == [("a", [(5, 0)]), ("b", [(5, 0), (5, 1)]), ("c", [(5, 1)])]
    h = _handle(unsynced=(0, 1), durable=False)
    answer, synced = _sync_answer()
    _, seen = drive(ops.close_handle(h), answer)
    assert synced == [] and seen[-1].msg.written_end == 100
    # fsync syncs every object even so
    h = _handle(unsynced=(), durable=False)
    answer, synced = _sync_answer()
    drive(ops.fsync(h), answer)
    assert sorted(s for s, _ in synced) == ["a", "b", "c"]


def test_a_failed_sync_fails_close_with_its_errno_and_commits_no_size() -> None:
    h = _handle(unsynced=(1,))
    answer, synced = _sync_answer({"c": errno.EIO})
    with pytest.raises(OSError) as err:
        drive(ops.close_handle(h), answer)
    assert err.value.errno == errno.EIO
    assert h.closed and h.released == 1 and h.state.size == 0
    # the handle is released on the metaserver, with no size
    h = _handle(unsynced=(1,))
    seen: list[Any] = []

    def logged(eff: Any) -> Any:
        seen.append(eff)
        return answer(eff)

    with pytest.raises(OSError):
        drive(ops.close_handle(h), logged)
    closes = [e for e in seen if isinstance(e, MetaCall)]
    assert [c.msg.method for c in closes] == ["close"]
    assert closes[0].msg.written_end is None  # type: ignore[attr-defined]


def test_a_failed_sync_keeps_the_stripes_for_the_next_commit() -> None:
    h = _handle(unsynced=(1,))
    answer, _ = _sync_answer({"b": errno.EIO})
    with pytest.raises(OSError):
        drive(ops.commit(h), answer)
    assert h.state.unsynced == {1} and h._dirty

"""POSIX semantics of the metadata namespace, run against every store engine."""
from __future__ import annotations

import errno
import os
import random
import stat
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pfs.core.config import LayoutDefaults
from pfs.metaserver import keys as K
from pfs.metaserver.namespace import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT,
    XATTR_CREATE,
    XATTR_REPLACE,
    Cred,
    Namespace,
)
from pfs.metaserver.store import LmdbStore, MemoryStore

USER = Cred(1000, 1000, (1000, 50))
OTHER = Cred(2000, 2000, (2000,))
RW = os.O_RDWR
CREAT = os.O_CREAT | os.O_RDWR


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Any]:
    # the bare engine: no ``C format`` key (the metaserver's format check is tested in
    # tests/integration/test_versions.py), so both engines start empty
    s = (MemoryStore() if request.param == "memory"
         else LmdbStore(tmp_path / "db", 1 << 26, check_format=False))
    yield s
    s.close()


class FS:
    """Each call runs one namespace operation in its own write transaction."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.alive: dict[str, int] = {"s1": 100, "s2": 200, "s3": 300, "s4": 400}
        self.is_open: set[int] = set()
        self.deleting: set[int] = set()
        self.now = 1_000_000_000
        self.ns = Namespace(LayoutDefaults(unit=65536, count=2, replicas=1),
                            servers=lambda: dict(self.alive),
                            opened=lambda ino: ino in self.is_open,
                            is_open=lambda ino: ino in self.is_open,
                            deleting=lambda ino: ino in self.deleting,
                            clock=self._tick, rng=random.Random(7))
        with store.write() as txn:
            assert self.ns.format(txn)

    def _tick(self) -> int:
        self.now += 1000
        return self.now

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.ns, name)

        def call(*args: Any, **kw: Any) -> Any:
            with self.store.write() as txn:
                return fn(txn, *args, **kw)
        return call

    def get(self, key: bytes) -> bytes | None:
        with self.store.read() as txn:
            return txn.get(key)

    def ino(self, parent: int, name: bytes, cred: Cred = ROOT) -> int:
        return self.lookup(cred, parent, name)["ino"]

    def names(self, ino: int, cred: Cred = ROOT) -> list[bytes]:
        entries, eof = self.readdir(cred, ino, 0, 4096)
        assert eof
        return [e[0] for e in entries]

    def file(self, parent: int, name: bytes, cred: Cred = ROOT, mode: int = 0o644) -> int:
        attr, _, created = self.create(cred, parent, name, mode, CREAT | os.O_EXCL)
        assert created
        return attr["ino"]


@pytest.fixture
def fs(store: Any) -> FS:
    return FS(store)


def err(code: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
    with pytest.raises(OSError) as info:
        fn(*args, **kw)
    assert info.value.errno == code, f"{errno.errorcode.get(info.value.errno or 0)} != {errno.errorcode[code]}: {info.value}"


def test_root_and_reopen(fs: FS) -> None:
    a = fs.getattr(1)
    assert a["mode"] == stat.S_IFDIR | 0o755 and a["nlink"] == 2 and a["uid"] == 0
    with fs.store.write() as txn:
        assert not fs.ns.format(txn)


def test_store_nested_rollback(store: Any) -> None:
    with store.write() as txn:
        txn.put(b"a", b"1")
        with pytest.raises(OSError):
            with txn.nested() as sub:
                sub.put(b"b", b"2")
                sub.put(b"a", b"changed")
                sub.delete(b"a")
                raise OSError(errno.EIO, "boom")
        with txn.nested() as sub:
            sub.put(b"c", b"3")
    with store.read() as txn:
        assert txn.get(b"a") == b"1" and txn.get(b"b") is None and txn.get(b"c") == b"3"
        assert list(txn.scan(b"")) == [(b"a", b"1"), (b"c", b"3")]
        assert list(txn.scan(b"", b"b")) == [(b"c", b"3")]
    with pytest.raises(RuntimeError):
        with store.write() as txn:
            txn.put(b"d", b"4")
            raise RuntimeError
    with store.read() as txn:
        assert txn.get(b"d") is None


def test_mkdir_nlink_times(fs: FS) -> None:
    before = fs.getattr(1)
    d = fs.mkdir(ROOT, 1, b"d", 0o755)
    assert stat.S_ISDIR(d["mode"]) and d["nlink"] == 2
    root = fs.getattr(1)
    assert root["nlink"] == 3 and root["mtime"] > before["mtime"] and root["ctime"] > before["ctime"]
    fs.mkdir(ROOT, d["ino"], b"e", 0o700)
    assert fs.getattr(d["ino"])["nlink"] == 3
    assert fs.lookup(ROOT, d["ino"], b"..")["ino"] == 1
    assert fs.lookup(ROOT, d["ino"], b".")["ino"] == d["ino"]
    err(errno.EEXIST, fs.mkdir, ROOT, 1, b"d", 0o755)
    fs.rmdir(ROOT, d["ino"], b"e")
    assert fs.getattr(d["ino"])["nlink"] == 2


def test_name_validation(fs: FS) -> None:
    err(errno.EINVAL, fs.mkdir, ROOT, 1, b"", 0o755)
    err(errno.EINVAL, fs.mkdir, ROOT, 1, b"a/b", 0o755)
    err(errno.EINVAL, fs.mkdir, ROOT, 1, b"a\0b", 0o755)
    err(errno.ENAMETOOLONG, fs.mkdir, ROOT, 1, b"x" * 256, 0o755)
    fs.mkdir(ROOT, 1, b"x" * 255, 0o755)
    err(errno.EEXIST, fs.mkdir, ROOT, 1, b".", 0o755)
    err(errno.EEXIST, fs.mkdir, ROOT, 1, b"..", 0o755)
    err(errno.EEXIST, fs.symlink, ROOT, 1, b"..", b"t")
    f = fs.file(1, b"f")
    err(errno.ENOTDIR, fs.lookup, ROOT, f, b"x")
    err(errno.ENOTDIR, fs.mkdir, ROOT, f, b"x", 0o755)
    err(errno.ENOENT, fs.lookup, ROOT, 1, b"missing")
    err(errno.ENOENT, fs.getattr, 999)
    err(errno.ENOTDIR, fs.resolve, ROOT, b"/f/x", True)


def test_create_open_trunc(fs: FS) -> None:
    attr, layout, created = fs.create(ROOT, 1, b"f", 0o644, CREAT)
    assert created and stat.S_ISREG(attr["mode"]) and attr["nlink"] == 1
    assert layout["count"] == 2 and len(layout["servers"]) == 2
    err(errno.EEXIST, fs.create, ROOT, 1, b"f", 0o644, CREAT | os.O_EXCL)
    fs.commit_size(attr["ino"], 5000, None)
    again, layout2, created = fs.create(ROOT, 1, b"f", 0o644, CREAT)
    assert not created and again["size"] == 5000 and layout2 == layout
    a, _ = fs.open(ROOT, attr["ino"], os.O_RDWR | os.O_TRUNC)
    assert a["size"] == 0 and a["mtime"] > again["mtime"]
    fs.commit_size(attr["ino"], 10, None)
    a, _, _ = fs.create(ROOT, 1, b"f", 0o644, CREAT | os.O_TRUNC)
    assert a["size"] == 0
    fs.mkdir(ROOT, 1, b"d", 0o755)
    err(errno.EISDIR, fs.create, ROOT, 1, b"d", 0o644, CREAT)
    d = fs.ino(1, b"d")
    err(errno.EISDIR, fs.open, ROOT, d, os.O_WRONLY)
    fs.open(ROOT, d, os.O_RDONLY | os.O_DIRECTORY)
    err(errno.ENOTDIR, fs.open, ROOT, attr["ino"], os.O_RDONLY | os.O_DIRECTORY)
    s = fs.symlink(ROOT, 1, b"s", b"f")
    err(errno.ELOOP, fs.open, ROOT, s["ino"], os.O_RDONLY)
    # create through a symlink opens (or creates) its target
    assert fs.create(ROOT, 1, b"s", 0o644, CREAT)[0]["ino"] == attr["ino"]
    fs.symlink(ROOT, 1, b"dangling", b"d/new")
    a, _, created = fs.create(ROOT, 1, b"dangling", 0o644, CREAT)
    assert created and fs.ino(d, b"new") == a["ino"]
    err(errno.EEXIST, fs.create, ROOT, 1, b"s", 0o644, CREAT | os.O_EXCL)


def test_permissions_non_root(fs: FS) -> None:
    f = fs.file(1, b"secret", mode=0o600)
    err(errno.EACCES, fs.open, USER, f, os.O_RDONLY)
    fs.open(ROOT, f, os.O_RDWR)
    fs.setattr(ROOT, f, mode=0o640, gid=50)
    fs.open(USER, f, os.O_RDONLY)  # via supplementary group 50
    err(errno.EACCES, fs.open, USER, f, os.O_WRONLY)
    err(errno.EACCES, fs.open, OTHER, f, os.O_RDONLY)
    # creating needs w+x on the directory
    err(errno.EACCES, fs.mkdir, USER, 1, b"u", 0o755)
    d = fs.mkdir(ROOT, 1, b"pub", 0o777)["ino"]
    u = fs.mkdir(USER, d, b"u", 0o700)
    assert u["uid"] == 1000 and u["gid"] == 1000
    err(errno.EACCES, fs.lookup, OTHER, u["ino"], b"x")
    err(errno.EACCES, fs.readdir, OTHER, u["ino"], 0, 10)
    err(errno.EACCES, fs.resolve, OTHER, b"/pub/u/x", True)
    # access(): root bypasses rwx, but execute needs some x bit
    fs.access(ROOT, f, os.R_OK | os.W_OK)
    err(errno.EACCES, fs.access, ROOT, f, os.X_OK)
    fs.setattr(ROOT, f, mode=0o641)
    fs.access(ROOT, f, os.X_OK)
    err(errno.EACCES, fs.access, USER, f, os.X_OK)
    fs.access(USER, f, 0)
    # truncate needs write permission
    err(errno.EACCES, fs.setattr, USER, f, size=0)


def test_unlink_rmdir(fs: FS) -> None:
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    f = fs.file(d, b"f")
    err(errno.EISDIR, fs.unlink, ROOT, 1, b"d")
    err(errno.ENOTEMPTY, fs.rmdir, ROOT, 1, b"d")
    err(errno.ENOTDIR, fs.rmdir, ROOT, d, b"f")
    err(errno.EINVAL, fs.rmdir, ROOT, d, b".")
    err(errno.ENOTEMPTY, fs.rmdir, ROOT, d, b"..")
    err(errno.ENOENT, fs.unlink, ROOT, d, b"nope")
    err(errno.EACCES, fs.unlink, USER, d, b"f")
    fs.unlink(ROOT, d, b"f")
    err(errno.ENOENT, fs.getattr, f)
    assert fs.get(K.inode(f)) is None
    fs.rmdir(ROOT, 1, b"d")
    assert fs.getattr(1)["nlink"] == 2 and fs.names(1) == []


def test_sticky(fs: FS) -> None:
    t = fs.mkdir(ROOT, 1, b"tmp", 0o1777)["ino"]
    fs.file(t, b"mine", USER)
    fs.file(t, b"theirs", OTHER)
    err(errno.EPERM, fs.unlink, USER, t, b"theirs")
    err(errno.EPERM, fs.rename, USER, t, b"theirs", t, b"x")
    err(errno.EPERM, fs.rename, USER, t, b"mine", t, b"theirs")
    fs.unlink(USER, t, b"mine")
    fs.unlink(ROOT, t, b"theirs")


def test_link(fs: FS) -> None:
    f = fs.file(1, b"f")
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    assert fs.link(ROOT, f, d, b"g")["nlink"] == 2
    err(errno.EEXIST, fs.link, ROOT, f, d, b"g")
    err(errno.EPERM, fs.link, ROOT, d, 1, b"dd")
    err(errno.EEXIST, fs.link, ROOT, f, d, b".")
    fs.unlink(ROOT, 1, b"f")
    assert fs.getattr(f)["nlink"] == 1
    assert fs.ino(d, b"g") == f


def test_symlink_resolve(fs: FS) -> None:
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    e = fs.mkdir(ROOT, d, b"e", 0o755)["ino"]
    f = fs.file(e, b"f")
    s = fs.symlink(ROOT, 1, b"s", b"d/e")
    assert stat.S_ISLNK(s["mode"]) and s["size"] == 3
    assert fs.readlink(s["ino"]) == b"d/e"
    err(errno.EINVAL, fs.readlink, f)
    err(errno.ENOENT, fs.symlink, ROOT, 1, b"empty", b"")
    r = fs.resolve(ROOT, b"/s/f", True)
    assert r["attr"]["ino"] == f and r["parent"] == e and r["name"] == b"f"
    assert fs.resolve(ROOT, b"/s", False)["attr"]["ino"] == s["ino"]
    assert fs.resolve(ROOT, b"/s", True)["attr"]["ino"] == e
    assert fs.resolve(ROOT, b"/d/e/../e/./f", True)["attr"]["ino"] == f
    fs.symlink(ROOT, e, b"up", b"/d")
    assert fs.resolve(ROOT, b"/s/up/e/f", True)["attr"]["ino"] == f
    assert fs.resolve(ROOT, b"/", True)["attr"]["ino"] == 1
    fs.symlink(ROOT, 1, b"loop1", b"loop2")
    fs.symlink(ROOT, 1, b"loop2", b"loop1")
    err(errno.ELOOP, fs.resolve, ROOT, b"/loop1/x", True)
    err(errno.ELOOP, fs.resolve, ROOT, b"/loop1", True)
    assert stat.S_ISLNK(fs.resolve(ROOT, b"/loop1", False)["attr"]["mode"])
    err(errno.ENOENT, fs.resolve, ROOT, b"/d/missing/x", True)
    err(errno.ENOENT, fs.resolve, ROOT, b"/d/missing", True)
    err(errno.ENOTDIR, fs.resolve, ROOT, b"/d/e/f/", True)
    err(errno.ENAMETOOLONG, fs.resolve, ROOT, b"/" + b"a" * 300, True)


def test_entry_of_trailing_slash_does_not_follow_a_symlink(fs: FS) -> None:
    """A path-based rmdir/rename/unlink of 'link/' names the symlink, which is not a
    directory (ENOTDIR, as Linux says), never the directory it points to."""
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    fs.mkdir(ROOT, d, b"victim", 0o755)
    fs.symlink(ROOT, 1, b"l", b"d/victim")
    fs.file(1, b"f")
    err(errno.ENOTDIR, fs.entry_of, ROOT, b"/l/")
    err(errno.ENOTDIR, fs.entry_of, ROOT, b"/l//")
    err(errno.ENOTDIR, fs.entry_of, ROOT, b"/f/")
    assert fs.entry_of(ROOT, b"/l") == (1, b"l")
    assert fs.entry_of(ROOT, b"/d/victim/") == (d, b"victim")
    assert fs.entry_of(ROOT, b"/d/new/") == (d, b"new")
    assert fs.entry_of(ROOT, b"/l/x") == (fs.ino(d, b"victim"), b"x")
    err(errno.EBUSY, fs.entry_of, ROOT, b"/")
    assert fs.names(d) == [b"victim"]


def test_entry_of_walks_the_directories_with_every_check(fs: FS) -> None:
    """``entry_of`` of a plain last name walks only the directories above it (the
    caller looks the name up), and still refuses what a full walk refuses: a missing or
    non-directory component, a directory the caller may not search, a name too long;
    a symlink on the way is followed; ``.`` and ``..`` go the full way."""
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    sub = fs.mkdir(ROOT, d, b"sub", 0o755)["ino"]
    fs.mkdir(ROOT, 1, b"locked", 0o700)
    fs.file(d, b"f")
    fs.symlink(ROOT, 1, b"ld", b"d/sub")
    fs.symlink(ROOT, 1, b"dangling", b"d/none")
    assert fs.entry_of(USER, b"/x") == (1, b"x")
    assert fs.entry_of(USER, b"/d/sub/new") == (sub, b"new")  # missing: still its entry
    assert fs.entry_of(USER, b"/d/f") == (d, b"f")
    assert fs.entry_of(USER, b"/ld/x") == (sub, b"x")
    assert fs.entry_of(USER, b"/d//sub/x") == (sub, b"x")
    assert fs.entry_of(USER, b"/d/sub/../x") == (d, b"x")
    assert fs.entry_of(USER, b"/d/sub/..") == (sub, b"..")
    assert fs.entry_of(USER, b"/d/.") == (d, b".")
    err(errno.ENOENT, fs.entry_of, USER, b"/none/x")
    err(errno.ENOENT, fs.entry_of, USER, b"/dangling/x")
    err(errno.ENOTDIR, fs.entry_of, USER, b"/d/f/x")
    err(errno.EACCES, fs.entry_of, USER, b"/locked/x")
    assert fs.entry_of(ROOT, b"/locked/x")[1] == b"x"
    err(errno.ENAMETOOLONG, fs.entry_of, USER, b"/d/" + b"n" * 300)
    err(errno.EINVAL, fs.entry_of, USER, b"/d/a\0b")


def test_rename_rules(fs: FS) -> None:
    a = fs.mkdir(ROOT, 1, b"a", 0o755)["ino"]
    b = fs.mkdir(ROOT, 1, b"b", 0o755)["ino"]
    f = fs.file(a, b"f")
    g = fs.file(b, b"g")
    # file over file: the target's inode goes away
    fs.rename(ROOT, a, b"f", b, b"g")
    assert fs.ino(b, b"g") == f and fs.names(a) == []
    err(errno.ENOENT, fs.getattr, g)
    # directory moves update '..' and the parents' link counts
    c = fs.mkdir(ROOT, a, b"c", 0o755)["ino"]
    assert fs.getattr(a)["nlink"] == 3
    fs.rename(ROOT, a, b"c", b, b"c")
    assert fs.getattr(a)["nlink"] == 2 and fs.getattr(b)["nlink"] == 3
    assert fs.lookup(ROOT, c, b"..")["ino"] == b
    # dir over empty dir ok; over non-empty ENOTEMPTY
    e = fs.mkdir(ROOT, a, b"e", 0o755)["ino"]
    fs.rename(ROOT, b, b"c", a, b"e")
    assert fs.ino(a, b"e") == c and fs.getattr(a)["nlink"] == 3 and fs.getattr(b)["nlink"] == 2
    err(errno.ENOENT, fs.getattr, e)
    fs.mkdir(ROOT, b, b"full", 0o755)
    fs.file(fs.ino(b, b"full"), b"x")
    err(errno.ENOTEMPTY, fs.rename, ROOT, a, b"e", b, b"full")
    # type mismatches
    err(errno.EISDIR, fs.rename, ROOT, b, b"g", a, b"e")
    err(errno.ENOTDIR, fs.rename, ROOT, a, b"e", b, b"g")
    # into its own subtree
    err(errno.EINVAL, fs.rename, ROOT, 1, b"a", c, b"a")
    err(errno.EINVAL, fs.rename, ROOT, 1, b"a", a, b"self")
    # noreplace / exchange / bad flags
    err(errno.EEXIST, fs.rename, ROOT, b, b"g", b, b"full", RENAME_NOREPLACE)
    fs.rename(ROOT, b, b"g", b, b"g2", RENAME_NOREPLACE)
    err(errno.ENOENT, fs.rename, ROOT, b, b"g2", b, b"nope", RENAME_EXCHANGE)
    err(errno.EINVAL, fs.rename, ROOT, b, b"g2", b, b"x", 3)
    err(errno.EBUSY, fs.rename, ROOT, b, b".", b, b"x")
    err(errno.ENOENT, fs.rename, ROOT, b, b"nope", b, b"x")
    full = fs.ino(b, b"full")
    fs.rename(ROOT, b, b"g2", a, b"e", RENAME_EXCHANGE)  # file <-> dir across parents
    assert fs.ino(a, b"e") == f and fs.ino(b, b"g2") == c
    assert fs.lookup(ROOT, c, b"..")["ino"] == b
    assert fs.getattr(a)["nlink"] == 2 and fs.getattr(b)["nlink"] == 4
    # renaming onto another link of the same inode does nothing
    fs.link(ROOT, f, a, b"f2")
    fs.rename(ROOT, a, b"e", a, b"f2")
    assert sorted(fs.names(a)) == [b"e", b"f2"] and fs.getattr(f)["nlink"] == 2
    # a non-root user moving a directory needs write permission on it ('..' changes)
    pub = fs.mkdir(ROOT, 1, b"pub", 0o777)["ino"]
    fs.mkdir(ROOT, pub, b"rootdir", 0o755)
    fs.mkdir(USER, pub, b"sub", 0o777)
    err(errno.EACCES, fs.rename, USER, pub, b"rootdir", fs.ino(pub, b"sub"), b"x")
    assert full


def test_readdir_cookies(fs: FS) -> None:
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    for i in range(10):
        fs.file(d, b"f%d" % i)
    page, eof = fs.readdir(ROOT, d, 0, 4)
    assert [e[0] for e in page] == [b"f0", b"f1", b"f2", b"f3"] and not eof
    assert page[0][4] is None and page[0][2] == stat.S_IFREG | 0o644
    cookie = page[-1][3]
    # the directory changes between pages: cookies stay valid, nothing is skipped twice
    fs.unlink(ROOT, d, b"f2")
    fs.unlink(ROOT, d, b"f4")
    fs.file(d, b"late")
    fs.rename(ROOT, d, b"f5", d, b"f5b")
    rest: list[bytes] = []
    while True:
        page, eof = fs.readdir(ROOT, d, cookie, 3, plus=True)
        rest += [e[0] for e in page]
        assert all(e[4]["ino"] == e[1] for e in page)
        if eof:
            break
        cookie = page[-1][3]
    assert rest == [b"f6", b"f7", b"f8", b"f9", b"late", b"f5b"]
    assert fs.readdir(ROOT, d, 10**6, 10) == ([], True)
    err(errno.ENOTDIR, fs.readdir, ROOT, fs.ino(d, b"f0"), 0, 10)


def test_setattr_rules(fs: FS) -> None:
    pub = fs.mkdir(ROOT, 1, b"pub", 0o777)["ino"]
    f = fs.file(pub, b"f", USER, 0o6755)
    a = fs.getattr(f)
    assert a["mode"] & 0o7777 == 0o6755 and a["uid"] == 1000
    err(errno.EPERM, fs.setattr, OTHER, f, mode=0o777)
    err(errno.EPERM, fs.setattr, USER, f, uid=2000)
    err(errno.EPERM, fs.setattr, USER, f, gid=2000)  # not a member
    err(errno.EPERM, fs.setattr, OTHER, f, gid=1000)
    fs.setattr(USER, f, uid=1000)  # no-op chown to itself is allowed
    b = fs.setattr(USER, f, gid=50)  # member of 50: ok, clears setuid/setgid
    assert b["gid"] == 50 and b["mode"] & 0o7777 == 0o755 and b["ctime"] > a["ctime"]
    # chmod by a non-member of the file's group drops setgid
    fs.setattr(ROOT, f, gid=3000)
    assert fs.setattr(USER, f, mode=0o2755)["mode"] & 0o7777 == 0o755
    assert fs.setattr(ROOT, f, mode=0o2755)["mode"] & 0o7777 == 0o2755
    assert fs.setattr(ROOT, f, uid=2000, gid=2000)["uid"] == 2000
    # times: "now" needs ownership or write permission, explicit times need ownership
    g = fs.file(pub, b"g", OTHER, 0o666)
    t = fs.setattr(USER, g, atime="now", mtime="now")
    assert t["mtime"] == t["atime"] == t["ctime"]
    err(errno.EPERM, fs.setattr, USER, g, mtime=5)
    assert fs.setattr(OTHER, g, atime=7, mtime=5)["mtime"] == 5
    h = fs.file(pub, b"h", OTHER, 0o644)
    err(errno.EACCES, fs.setattr, USER, h, mtime="now")
    # size
    s = fs.setattr(OTHER, g, size=12345)
    assert s["size"] == 12345 and s["blocks"] == 25 and s["blksize"] == 65536
    err(errno.EISDIR, fs.setattr, ROOT, pub, size=0)
    err(errno.EINVAL, fs.setattr, ROOT, g, size=-1)
    # only directories keep the file type
    assert stat.S_ISDIR(fs.setattr(ROOT, pub, mode=0o700)["mode"])


def test_setattr_writer_drops_set_id_bits(fs: FS) -> None:
    """A write by a non-owner drops the file's set-ID bits: a FUSE kernel asks for that
    as a mode change in the writer's name, allowed to one who may write the file, and
    only that change (Linux ``file_remove_privs``)."""
    pub = fs.mkdir(ROOT, 1, b"pub", 0o777)["ino"]
    f = fs.file(pub, b"f", ROOT, 0o6777)
    a = fs.getattr(f)
    err(errno.EPERM, fs.setattr, USER, f, mode=0o6775)  # a chmod, not a drop
    err(errno.EPERM, fs.setattr, USER, f, mode=0o4777 | 0o2000 | 0o1000)  # adds sticky
    b = fs.setattr(USER, f, mode=0o777)
    assert b["mode"] & 0o7777 == 0o777 and b["uid"] == 0 and b["ctime"] > a["ctime"]
    err(errno.EPERM, fs.setattr, USER, f, mode=0o777)  # nothing left to drop: a chmod
    fs.setattr(ROOT, f, gid=50, mode=0o6777)  # USER is in group 50: setgid may stay
    assert fs.setattr(USER, f, mode=0o2777)["mode"] & 0o7777 == 0o2777
    fs.setattr(ROOT, f, mode=0o6777)  # OTHER is not: the setgid bit goes with setuid
    assert fs.setattr(OTHER, f, mode=0o2777)["mode"] & 0o7777 == 0o777
    fs.setattr(ROOT, f, mode=0o6755)  # not writable by others: no drop for them
    err(errno.EPERM, fs.setattr, USER, f, mode=0o755)
    d = fs.mkdir(ROOT, pub, b"d", 0o2777)["ino"]  # only regular files
    err(errno.EPERM, fs.setattr, USER, d, mode=0o777)


def test_setgid_directories(fs: FS) -> None:
    d = fs.mkdir(ROOT, 1, b"d", 0o777)["ino"]
    fs.setattr(ROOT, d, gid=50, mode=0o2777)
    sub = fs.mkdir(USER, d, b"sub", 0o755)
    assert sub["gid"] == 50 and sub["mode"] & stat.S_ISGID
    f = fs.file(d, b"f", OTHER, 0o2755)  # OTHER is not in group 50: setgid dropped
    a = fs.getattr(f)
    assert a["gid"] == 50 and not a["mode"] & stat.S_ISGID
    assert fs.mkdir(ROOT, 1, b"plain", 0o2755)["mode"] & 0o7777 == 0o755


def test_mknod(fs: FS) -> None:
    fifo = fs.mknod(USER, fs.mkdir(ROOT, 1, b"p", 0o777)["ino"], b"fifo", stat.S_IFIFO | 0o644)
    assert stat.S_ISFIFO(fifo["mode"]) and fifo["uid"] == 1000
    p = fs.ino(1, b"p")
    assert stat.S_ISSOCK(fs.mknod(ROOT, p, b"sock", stat.S_IFSOCK | 0o644)["mode"])
    err(errno.EPERM, fs.mknod, USER, p, b"chr", stat.S_IFCHR | 0o644, 0x0501)
    c = fs.mknod(ROOT, p, b"chr", stat.S_IFCHR | 0o644, 0x0501)
    assert c["rdev"] == 0x0501
    err(errno.EPERM, fs.mknod, ROOT, p, b"dir", stat.S_IFDIR | 0o755)
    reg = fs.mknod(ROOT, p, b"reg", 0o644)
    assert stat.S_ISREG(reg["mode"]) and fs.get_layout(reg["ino"])["servers"]
    assert fs.get_layout(fifo["ino"]) is None


def test_xattrs(fs: FS) -> None:
    pub = fs.mkdir(ROOT, 1, b"pub", 0o777)["ino"]
    f = fs.file(pub, b"f", USER, 0o644)
    err(errno.ENODATA, fs.getxattr, USER, f, b"user.a")
    fs.setxattr(USER, f, b"user.a", b"1")
    assert fs.getxattr(OTHER, f, b"user.a") == b"1"
    err(errno.EEXIST, fs.setxattr, USER, f, b"user.a", b"2", XATTR_CREATE)
    err(errno.ENODATA, fs.setxattr, USER, f, b"user.b", b"2", XATTR_REPLACE)
    fs.setxattr(USER, f, b"user.a", b"2", XATTR_REPLACE)
    assert fs.getxattr(USER, f, b"user.a") == b"2"
    err(errno.EACCES, fs.setxattr, OTHER, f, b"user.c", b"x")
    err(errno.E2BIG, fs.setxattr, USER, f, b"user.big", b"x" * 65537)
    fs.setxattr(USER, f, b"user.max", b"x" * 65536)
    err(errno.ERANGE, fs.setxattr, USER, f, b"user." + b"n" * 251, b"")
    err(errno.ERANGE, fs.getxattr, USER, f, b"")
    err(errno.EOPNOTSUPP, fs.setxattr, USER, f, b"bogus.x", b"")
    err(errno.EPERM, fs.setxattr, USER, f, b"trusted.t", b"")
    fs.setxattr(ROOT, f, b"trusted.t", b"t")
    assert fs.listxattr(USER, f) == [b"user.a", b"user.max"]
    assert fs.listxattr(ROOT, f) == [b"trusted.t", b"user.a", b"user.max"]
    err(errno.ENODATA, fs.getxattr, USER, f, b"trusted.t")
    fs.removexattr(USER, f, b"user.a")
    err(errno.ENODATA, fs.removexattr, USER, f, b"user.a")
    s = fs.symlink(ROOT, pub, b"s", b"f")["ino"]
    err(errno.EPERM, fs.setxattr, ROOT, s, b"user.x", b"")
    fs.unlink(ROOT, pub, b"f")
    with fs.store.read() as txn:
        assert list(txn.scan(K.xattr_prefix(f))) == []


def test_layouts_inherit(fs: FS) -> None:
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    assert fs.get_layout(d) == {"unit": 0, "count": 0, "replicas": 0, "servers": []}
    fs.set_layout(ROOT, d, 1 << 20, 3, 0)
    sub = fs.mkdir(ROOT, d, b"sub", 0o755)["ino"]
    assert fs.get_layout(sub)["count"] == 3 and fs.get_layout(sub)["unit"] == 1 << 20
    _, layout, _ = fs.create(ROOT, sub, b"f", 0o644, CREAT)
    assert layout["unit"] == 1 << 20 and layout["count"] == 3 and layout["replicas"] == 1
    _, top, _ = fs.create(ROOT, 1, b"top", 0o644, CREAT)
    assert top["unit"] == 65536 and top["count"] == 2
    ino = fs.ino(sub, b"f")
    new = fs.set_layout(ROOT, ino, 1 << 16, 4, 2)
    assert new["count"] == 4 and new["replicas"] == 2 and fs.get_layout(ino) == new
    assert fs.getattr(ino)["blksize"] == 1 << 16
    fs.commit_size(ino, 1, None)
    err(errno.EBUSY, fs.set_layout, ROOT, ino, 1 << 16, 1, 1)
    err(errno.EINVAL, fs.set_layout, ROOT, d, 1000, 1, 1)
    err(errno.EPERM, fs.set_layout, USER, d, 0, 1, 1)
    # a directory made before its parent got a default still inherits it (nearest wins)
    fs.set_layout(ROOT, d, 0, 0, 0)
    old = fs.mkdir(ROOT, d, b"old", 0o755)["ino"]
    fs.set_layout(ROOT, d, 1 << 17, 0, 0)
    fs.set_layout(ROOT, 1, 0, 3, 0)
    _, lay, _ = fs.create(ROOT, old, b"f", 0o644, CREAT)
    assert (lay["unit"], lay["count"], lay["replicas"]) == (1 << 17, 3, 1)


def test_set_layout_of_an_empty_file_queues_its_old_objects(fs: FS) -> None:
    """An empty file may still have objects (truncated to 0, or never committed): a new
    layout queues them for deletion, except those the new layout itself uses (an object
    id is [ino, stripe], so deleting those would delete the new layout's data)."""
    def queue() -> list[dict[str, Any]]:
        with fs.store.read() as txn:
            return [e for _, e in fs.ns.delq_entries(txn)]

    fs.alive = {"s1": 100, "s2": 200}
    f = fs.file(1, b"f")
    old = fs.get_layout(f)
    assert sorted(s[0] for s in old["servers"]) == ["s1", "s2"]
    fs.alive = {"s3": 300, "s4": 400}
    new = fs.set_layout(ROOT, f, 0, 1, 2)  # nothing in common with the old one
    assert queue() == [{"ino": f, "layout": old}]
    fs.alive = {"s3": 300}
    fs.set_layout(ROOT, f, 0, 1, 1)  # keeps [f, 0] on s3: only the copy on s4 goes
    assert sorted(new["servers"][0]) == ["s3", "s4"]
    assert queue()[1:] == [{"ino": f, "layout": {**new, "servers": [["s4"]]}}]
    fs.set_layout(ROOT, f, 0, 1, 1)  # the very same objects: nothing to delete
    assert len(queue()) == 2
    # an open file keeps its layout: its handles write to the objects they were given
    fs.is_open.add(f)
    before = fs.get_layout(f)
    err(errno.EBUSY, fs.set_layout, ROOT, f, 0, 2, 1)
    assert fs.get_layout(f) == before and len(queue()) == 2
    fs.is_open.discard(f)
    # a directory's default layout has no objects
    d = fs.mkdir(ROOT, 1, b"d", 0o755)["ino"]
    fs.set_layout(ROOT, d, 0, 2, 1)
    assert len(queue()) == 2
    # unlinking later queues the current layout (once), not the replaced ones again
    fs.unlink(ROOT, 1, b"f")
    assert queue()[2:] == [{"ino": f, "layout": before}]


def test_queued_deletions_spare_objects_a_later_layout_took_back(fs: FS) -> None:
    """A queued deletion of an old layout's objects must not delete an object ([ino,
    stripe] on a server) that the file's current layout uses again: a layout changed
    twice before the deleter ran (or while a data server was down and deletes retried)."""
    def plan() -> tuple[dict[str, list[list[int]]], list[set[str]], set[int]]:
        with fs.store.read() as txn:
            entries = fs.ns.delq_entries(txn)
            objs, needs, live = fs.ns.deletion_plan(txn, entries)
        return objs, [needs[seq] for seq, _ in entries], live

    fs.alive = {"s1": 100}
    f = fs.file(1, b"f")
    fs.set_layout(ROOT, f, 0, 1, 1)
    assert fs.get_layout(f)["servers"] == [["s1"]]
    fs.alive = {"s2": 100}
    fs.set_layout(ROOT, f, 0, 1, 1)  # queues [f, 0] on s1
    fs.alive = {"s1": 100}
    fs.set_layout(ROOT, f, 0, 1, 1)  # back on s1: queues [f, 0] on s2
    assert fs.get_layout(f)["servers"] == [["s1"]]
    assert plan() == ({"s2": [[f, 0]]}, [set(), {"s2"}], {f})
    # while the deleter works on its objects, the layout stays as the plan saw it
    fs.deleting.add(f)
    err(errno.EBUSY, fs.set_layout, ROOT, f, 0, 1, 1)
    fs.deleting.discard(f)
    # once the file is gone, every queued object goes
    fs.unlink(ROOT, 1, b"f")
    objs, needs, live = plan()
    assert objs == {"s1": [[f, 0], [f, 0]], "s2": [[f, 0]]} and live == set()
    assert needs == [{"s1"}, {"s2"}, {"s1"}]


def test_placement(fs: FS) -> None:
    for i in range(50):
        _, lay, _ = fs.create(ROOT, 1, b"f%d" % i, 0o644, CREAT)
        firsts = [s[0] for s in lay["servers"]]
        assert len(set(firsts)) == 2 and set(firsts) <= set(fs.alive)
    fs.set_layout(ROOT, 1, 0, 8, 2)
    _, lay, _ = fs.create(ROOT, 1, b"wide", 0o644, CREAT)
    assert lay["count"] == 4 and lay["replicas"] == 2  # only four servers alive
    assert sorted(s[0] for s in lay["servers"]) == ["s1", "s2", "s3", "s4"]
    assert all(len(set(s)) == 2 for s in lay["servers"])
    fs.set_layout(ROOT, 1, 0, 2, 2)
    _, lay, _ = fs.create(ROOT, 1, b"spread", 0o644, CREAT)
    flat = [sid for s in lay["servers"] for sid in s]
    assert len(set(flat)) == 4  # 2 stripes x 2 replicas on 4 distinct servers
    # weighted by free space: the emptiest server is chosen most often
    fs.set_layout(ROOT, 1, 0, 1, 1)
    fs.alive = {"big": 10**12, "small": 10**9}
    counts = {"big": 0, "small": 0}
    for i in range(60):
        _, lay, _ = fs.create(ROOT, 1, b"w%d" % i, 0o644, CREAT)
        counts[lay["servers"][0][0]] += 1
    assert counts["big"] > counts["small"]
    fs.alive = {}
    err(errno.ENOSPC, fs.create, ROOT, 1, b"none", 0o644, CREAT)


def test_orphans_and_delete_queue(fs: FS) -> None:
    f = fs.file(1, b"f")
    g = fs.file(1, b"g")
    fs.is_open.add(f)
    fs.unlink(ROOT, 1, b"f")
    assert fs.get(K.orphan(f)) is not None and fs.getattr(f)["nlink"] == 0
    err(errno.ENOENT, fs.open, ROOT, f, os.O_RDONLY)
    fs.commit_size(f, 100, None)  # an open handle may still commit its size
    with fs.store.write() as txn:
        assert not fs.ns.reclaim(txn, f)  # still open
    fs.is_open.discard(f)
    with fs.store.write() as txn:
        assert fs.ns.orphans(txn) == [f]
        assert fs.ns.reclaim(txn, f)
    err(errno.ENOENT, fs.getattr, f)
    fs.rename(ROOT, 1, b"g", 1, b"g2")
    fs.unlink(ROOT, 1, b"g2")
    with fs.store.read() as txn:
        q = fs.ns.delq_entries(txn)
    assert [e["ino"] for _, e in q] == [f, g]
    assert all(e["layout"]["servers"] for _, e in q)
    with fs.store.write() as txn:
        fs.ns.delq_done(txn, q[0][0])
    with fs.store.read() as txn:
        assert [e["ino"] for _, e in fs.ns.delq_entries(txn)] == [g]


def test_draining_is_kept_across_registrations(fs: FS) -> None:
    err(errno.ENOENT, fs.set_draining, "nobody", True)
    fs.register_server("s1", "h", 1, 8192, 4096)
    fs.set_draining("s1", True)
    fs.register_server("s1", "h", 2, 8192, 4000)  # a restart: new port, still draining
    with fs.store.read() as txn:
        assert fs.ns.list_servers(txn)["s1"] == {"host": "h", "port": 2, "total": 8192,
                                                  "free": 4000, "draining": True}
    fs.set_draining("s1", False)
    with fs.store.read() as txn:
        assert "draining" not in fs.ns.list_servers(txn)["s1"]


def test_statfs_and_registry(fs: FS) -> None:
    fs.register_server("s1", "h", 1, 8192, 4096)
    with fs.store.read() as txn:
        assert fs.ns.list_servers(txn) == {"s1": {"host": "h", "port": 1, "total": 8192,
                                                   "free": 4096}}
    st = fs.statfs(8192 * 4096, 4096 * 4096)
    assert st["blocks"] == 8192 and st["bfree"] == 4096 and st["namemax"] == 255
    before = st["ffree"]
    fs.file(1, b"x")
    assert fs.statfs(0, 0)["ffree"] == before - 1


class _Undo(Exception):
    pass


def test_walks_see_every_change_of_a_directory(fs: FS, store: Any) -> None:
    """Path walks keep decoded directory records (checked against the stored bytes):
    a committed change is seen at once, a rolled-back one never."""
    d = fs.mkdir(ROOT, K.ROOT_INO, b"d", 0o755)["ino"]
    fs.create(ROOT, K.ROOT_INO, b"f", 0o644, CREAT)  # a file to reach through /d/..
    fs.mkdir(ROOT, d, b"sub", 0o755)
    assert fs.resolve(USER, b"/d/sub", True)["attr"]["mode"] & 0o777 == 0o755
    fs.setattr(ROOT, d, mode=0o700)  # USER may no longer search /d
    with pytest.raises(PermissionError):
        fs.resolve(USER, b"/d/sub", True)
    with pytest.raises(_Undo), store.write() as txn:  # a change that is rolled back
        fs.ns.setattr(txn, ROOT, d, mode=0o755)
        assert fs.ns.resolve(txn, USER, b"/d/sub", True)["attr"]["ino"]  # walked, cached
        raise _Undo
    with pytest.raises(PermissionError):
        fs.resolve(USER, b"/d/sub", True)
    fs.setattr(ROOT, d, mode=0o755)
    assert fs.resolve(USER, b"/d/../f", True)["attr"]["uid"] == 0
    fs.rmdir(ROOT, d, b"sub")
    with pytest.raises(FileNotFoundError):
        fs.resolve(USER, b"/d/sub", True)


def test_walk_cache_sees_every_change_that_alters_a_walk(fs: FS, store: Any) -> None:
    """Path-based calls in read transactions keep the directory each head walked to
    (walks.py): a change of a mode or owner on the way, a rename, a removed or replaced
    symlink or directory is seen at once; a regular file's unlink keeps them."""
    def res(cred: Cred, path: bytes, follow: bool = True) -> dict[str, Any]:
        with store.read() as txn:
            return fs.ns.resolve(txn, cred, path, follow, cache=True)

    def ent(cred: Cred, path: bytes) -> tuple[int, bytes]:
        with store.read() as txn:
            return fs.ns.entry_of(txn, cred, path, cache=True)

    d = fs.mkdir(ROOT, K.ROOT_INO, b"d", 0o755)["ino"]
    sub = fs.mkdir(ROOT, d, b"sub", 0o755)["ino"]
    f = fs.file(sub, b"f")
    fs.file(sub, b"g")
    fs.symlink(ROOT, K.ROOT_INO, b"l", b"d/sub")
    assert res(USER, b"/d/sub/f")["attr"]["ino"] == f
    assert stat.S_ISLNK(res(USER, b"/l", False)["attr"]["mode"])
    assert res(USER, b"/l")["attr"]["ino"] == sub  # a symlink last: followed in full
    assert ent(USER, b"/l/x") == (sub, b"x")
    fs.unlink(ROOT, sub, b"g")  # a regular file: no walk changes
    assert fs.ns.walks.get(b"/d/sub", USER) == sub
    err(errno.ENOENT, res, USER, b"/d/sub/g")
    fs.setattr(ROOT, d, mode=0o700)  # USER may no longer search /d
    err(errno.EACCES, res, USER, b"/d/sub/f")
    err(errno.EACCES, ent, USER, b"/l/x")
    fs.setattr(ROOT, d, uid=USER.uid)  # ... until it owns it
    assert ent(USER, b"/d/sub/x") == (sub, b"x")
    fs.setattr(ROOT, d, uid=OTHER.uid)
    err(errno.EACCES, ent, USER, b"/d/sub/x")
    fs.setattr(ROOT, d, mode=0o755)
    fs.rename(ROOT, d, b"sub", d, b"moved")
    err(errno.ENOENT, res, USER, b"/d/sub/f")
    err(errno.ENOENT, ent, USER, b"/l/x")  # the symlink dangles now
    assert res(USER, b"/d/moved/f")["parent"] == sub
    fs.unlink(ROOT, K.ROOT_INO, b"l")
    fs.symlink(ROOT, K.ROOT_INO, b"l", b"d")
    assert ent(USER, b"/l/x") == (d, b"x")
    fs.unlink(ROOT, sub, b"f")
    assert ent(USER, b"/d/moved/x") == (sub, b"x")
    fs.rmdir(ROOT, d, b"moved")
    again = fs.mkdir(ROOT, d, b"moved", 0o755)["ino"]
    assert again != sub and ent(USER, b"/d/moved/x") == (again, b"x")
    assert res(OTHER, b"/d/moved")["attr"]["ino"] == again  # keyed by credentials too

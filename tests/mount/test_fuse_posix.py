"""POSIX semantics through a real pfs mount: errno values, permissions as root and as
unprivileged users, ownership rules, link counts, times, open flags, sparse and huge
offsets, unlinked-but-open files, xattrs, special files and a read-only mount."""
from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.fuse_fixtures import *  # noqa: F403
from tests.fuse_fixtures import GID, GID_EXTRA, UID, UID2, AsUser, mounted

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def renameat2(src: Path, dst: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def err(fn, *args, **kw) -> str:  # type: ignore[no-untyped-def]
    """The errno name ``fn`` fails with, or 'ok'."""
    try:
        fn(*args, **kw)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "ok"


def uerr(u: AsUser, expr: str, **vars) -> str:  # type: ignore[no-untyped-def]
    code = u.errno(expr, **vars)
    return "ok" if code == 0 else errno.errorcode.get(code, str(code))


def put(path: Path, data: bytes = b"data", mode: int = 0o644) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


# -- errno, as root --------------------------------------------------------------
def test_enoent(mdir: Path) -> None:
    m = mdir / "missing"
    assert err(os.stat, m) == "ENOENT"
    assert err(os.open, m, os.O_RDONLY) == "ENOENT"
    assert err(os.unlink, m) == "ENOENT"
    assert err(os.rmdir, m) == "ENOENT"
    assert err(os.readlink, m) == "ENOENT"
    assert err(os.mkdir, m / "sub") == "ENOENT"
    assert err(os.rename, m, mdir / "x") == "ENOENT"
    assert err(os.link, m, mdir / "x") == "ENOENT"
    assert err(os.chmod, m, 0o600) == "ENOENT"
    os.symlink("nowhere", mdir / "dangling")
    assert err(os.stat, mdir / "dangling") == "ENOENT"
    assert os.lstat(mdir / "dangling").st_size == len("nowhere")
    assert err(os.symlink, "", mdir / "empty") == "ENOENT"


def test_eexist(mdir: Path) -> None:
    f = put(mdir / "f")
    (mdir / "d").mkdir()
    os.symlink("nowhere", mdir / "dangling")
    assert err(os.mkdir, mdir / "d") == "EEXIST"
    assert err(os.mkdir, f) == "EEXIST"
    assert err(os.mkdir, mdir / "dangling") == "EEXIST"
    assert err(os.open, f, os.O_CREAT | os.O_EXCL | os.O_WRONLY) == "EEXIST"
    assert err(os.open, mdir / "dangling", os.O_CREAT | os.O_EXCL | os.O_WRONLY) == "EEXIST"
    assert err(os.link, f, mdir / "d") == "EEXIST"
    assert err(os.symlink, "x", f) == "EEXIST"
    assert err(os.mkfifo, f) == "EEXIST"
    put(mdir / "g")
    assert err(renameat2, f, mdir / "g", RENAME_NOREPLACE) == "EEXIST"
    assert f.exists()


def test_enotdir(mdir: Path) -> None:
    f = put(mdir / "f")
    (mdir / "d").mkdir()
    assert err(os.mkdir, f / "x") == "ENOTDIR"
    assert err(os.stat, f / "x") == "ENOTDIR"
    assert err(os.open, str(f) + "/", os.O_RDONLY) == "ENOTDIR"
    assert err(os.rmdir, f) == "ENOTDIR"
    assert err(os.listdir, f) == "ENOTDIR"
    assert err(os.open, f, os.O_RDONLY | os.O_DIRECTORY) == "ENOTDIR"
    assert err(os.rename, mdir / "d", f) == "ENOTDIR"


def test_eisdir(mdir: Path) -> None:
    d = mdir / "d"
    d.mkdir()
    f = put(mdir / "f")
    assert err(os.open, d, os.O_WRONLY) == "EISDIR"
    assert err(os.open, d, os.O_RDWR) == "EISDIR"
    assert err(os.unlink, d) == "EISDIR"
    assert err(os.rename, f, d) == "EISDIR"
    fd = os.open(d, os.O_RDONLY)
    try:
        assert err(os.read, fd, 10) == "EISDIR"
    finally:
        os.close(fd)


def test_enotempty(mdir: Path) -> None:
    (mdir / "a").mkdir()
    put(mdir / "a" / "f")
    (mdir / "b").mkdir()
    put(mdir / "b" / "g")
    assert err(os.rmdir, mdir / "a") == "ENOTEMPTY"
    assert err(os.rename, mdir / "b", mdir / "a") == "ENOTEMPTY"
    os.unlink(mdir / "a" / "f")
    os.rename(mdir / "b", mdir / "a")  # over an empty directory
    assert os.listdir(mdir / "a") == ["g"]


def test_enametoolong(mdir: Path) -> None:
    ok, long = "n" * 255, "n" * 256
    put(mdir / ok, b"255")
    assert (mdir / ok).read_bytes() == b"255"
    assert ok in os.listdir(mdir)
    assert err(os.open, mdir / long, os.O_CREAT | os.O_WRONLY) == "ENAMETOOLONG"
    assert err(os.mkdir, mdir / long) == "ENAMETOOLONG"
    assert err(os.symlink, "t", mdir / long) == "ENAMETOOLONG"
    assert err(os.rename, mdir / ok, mdir / long) == "ENAMETOOLONG"
    assert err(os.link, mdir / ok, mdir / long) == "ENAMETOOLONG"
    assert err(os.stat, mdir / long) == "ENAMETOOLONG"


def test_eloop(mdir: Path) -> None:
    os.symlink("b", mdir / "a")
    os.symlink("a", mdir / "b")
    assert err(os.stat, mdir / "a") == "ELOOP"
    assert err(os.open, mdir / "a", os.O_RDONLY) == "ELOOP"
    put(mdir / "f")
    os.symlink("f", mdir / "lf")
    assert err(os.open, mdir / "lf", os.O_RDONLY | os.O_NOFOLLOW) == "ELOOP"
    prev = "f"
    for i in range(41):
        os.symlink(prev, mdir / f"c{i}")
        prev = f"c{i}"
    assert os.stat(mdir / "c39").st_size == 4
    assert err(os.stat, mdir / "c40") == "ELOOP"


def test_einval(mdir: Path) -> None:
    d = mdir / "d"
    (d / "sub").mkdir(parents=True)
    f = put(mdir / "f")
    assert err(os.rename, d, d / "sub" / "x") == "EINVAL"
    assert err(os.readlink, f) == "EINVAL"
    assert err(os.rmdir, f"{d}/.") == "EINVAL"
    assert err(os.truncate, f, -1) == "EINVAL"
    assert err(renameat2, f, mdir / "g", RENAME_NOREPLACE | RENAME_EXCHANGE) == "EINVAL"


def test_exdev(mdir: Path, tmp_path: Path) -> None:
    f = put(mdir / "f")
    assert err(os.rename, f, tmp_path / "f") == "EXDEV"
    assert err(os.link, f, tmp_path / "f") == "EXDEV"


def test_eperm_root(mdir: Path) -> None:
    (mdir / "d").mkdir()
    assert err(os.link, mdir / "d", mdir / "d2") == "EPERM"
    f = put(mdir / "f")
    assert err(os.setxattr, f, "bogus.name", b"v") == errno.errorcode[errno.EOPNOTSUPP]


# -- renames -------------------------------------------------------------------------
def test_rename_flags(mdir: Path) -> None:
    put(mdir / "f", b"file")
    (mdir / "d").mkdir()
    put(mdir / "d" / "inner", b"in")
    renameat2(mdir / "f", mdir / "d", RENAME_EXCHANGE)
    assert (mdir / "d").read_bytes() == b"file"
    assert (mdir / "f" / "inner").read_bytes() == b"in"
    assert err(renameat2, mdir / "f", mdir / "nope", RENAME_EXCHANGE) == "ENOENT"
    renameat2(mdir / "d", mdir / "e", RENAME_NOREPLACE)
    assert sorted(os.listdir(mdir)) == ["e", "f"]
    os.rename(mdir / "e", mdir / "f" / "inner")  # over a file: replaced
    assert os.listdir(mdir / "f") == ["inner"]
    assert (mdir / "f" / "inner").read_bytes() == b"file"


# -- permissions as an unprivileged user ----------------------------------------------
def test_unprivileged_eacces(mdir: Path, user: AsUser) -> None:
    secret = put(mdir / "secret", b"s3cret", 0o600)
    private = mdir / "private"
    private.mkdir(mode=0o700)
    put(private / "f", b"p")
    locked = mdir / "locked"
    locked.mkdir(mode=0o755)
    put(locked / "g", b"g")
    os.stat(private / "f")  # cached in the kernel: must still be refused to others
    assert uerr(user, "read(p)", p=secret) == "EACCES"
    assert uerr(user, "os.stat(p)", p=private / "f") == "EACCES"
    assert uerr(user, "os.listdir(p)", p=private) == "EACCES"
    assert uerr(user, "write(p)", p=locked / "new") == "EACCES"
    assert uerr(user, "os.unlink(p)", p=locked / "g") == "EACCES"
    assert uerr(user, "os.mkdir(p)", p=locked / "sub") == "EACCES"
    assert uerr(user, "os.rename(a, b)", a=locked / "g", b=mdir / "g") == "EACCES"
    assert uerr(user, "write(p, 'x', os.O_WRONLY)", p=locked / "g") == "EACCES"
    assert user("os.access(p, os.R_OK)", p=secret) is False
    assert user("os.access(p, os.R_OK)", p=locked / "g") is True
    # the user's own read-only file: refused to the user, not to root
    mine = mdir / "mine"
    user("write(p, 'abc', mode=0o444)", p=mine)
    assert uerr(user, "write(p, 'x', os.O_WRONLY)", p=mine) == "EACCES"
    assert user("read(p)", p=mine) == "abc"
    with open(mine, "r+b") as fobj:
        fobj.write(b"X")
    assert mine.read_bytes() == b"Xbc"
    # no search permission on a directory the user can read
    noexec = mdir / "noexec"
    noexec.mkdir(mode=0o744)
    put(noexec / "h")
    assert uerr(user, "os.stat(p)", p=noexec / "h") == "EACCES"
    assert sorted(user("os.listdir(p)", p=noexec)) == ["h"]
    assert user("os.access(p, os.X_OK)", p=mine) is False


def test_unprivileged_create_owner_and_umask(mdir: Path, user: AsUser) -> None:
    user("write(p, 'hi')", p=mdir / "f")
    user("os.mkdir(p)", p=mdir / "d")
    s, d = os.stat(mdir / "f"), os.stat(mdir / "d")
    assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)) == (UID, GID, 0o644)
    assert (d.st_uid, d.st_gid, stat.S_IMODE(d.st_mode)) == (UID, GID, 0o755)
    old = os.umask(0o077)
    try:
        put(mdir / "r", b"x", 0o600)
        fd = os.open(mdir / "r2", os.O_CREAT | os.O_WRONLY, 0o666)
        os.close(fd)
        os.mkdir(mdir / "rd")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(mdir / "r2").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(mdir / "rd").st_mode) == 0o700


def test_unprivileged_eperm(mdir: Path, user: AsUser, user2: AsUser) -> None:
    rootfile = put(mdir / "rootfile", b"r", 0o666)
    user("write(p, 'u')", p=mdir / "u")
    u = mdir / "u"
    assert uerr(user, "os.chown(p, a, -1)", p=u, a=UID2) == "EPERM"
    assert uerr(user, "os.chmod(p, 0o777)", p=rootfile) == "EPERM"
    assert uerr(user, "os.chown(p, -1, g)", p=rootfile, g=GID) == "EPERM"
    # explicit times need ownership; "now" needs only write permission
    assert uerr(user, "os.utime(p, ns=(10**9, 10**9))", p=rootfile) == "EPERM"
    assert uerr(user, "os.utime(p)", p=rootfile) == "ok"
    assert abs(os.stat(rootfile).st_mtime - time.time()) < 60
    assert uerr(user2, "os.utime(p)", p=u) == "EACCES"  # 0644, not user2's
    # chgrp to one's own groups only
    assert uerr(user, "os.chown(p, -1, g)", p=u, g=GID_EXTRA) == "ok"
    assert os.stat(u).st_gid == GID_EXTRA
    assert uerr(user, "os.chown(p, -1, 0)", p=u) == "EPERM"
    # xattr namespaces
    assert uerr(user, "os.setxattr(p, 'trusted.x', b'1')", p=u) == "EPERM"
    assert uerr(user, "os.setxattr(p, 'user.x', b'1')", p=u) == "ok"
    assert uerr(user2, "os.setxattr(p, 'user.y', b'1')", p=u) == "EACCES"


def test_sticky_directory(mdir: Path, user: AsUser, user2: AsUser) -> None:
    tmp = mdir / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    user("write(p)", p=tmp / "a")
    user("os.mkdir(p)", p=tmp / "ad")
    user2("write(p)", p=tmp / "b")
    assert uerr(user2, "os.unlink(p)", p=tmp / "a") == "EPERM"
    assert uerr(user2, "os.rename(a, b)", a=tmp / "a", b=tmp / "c") == "EPERM"
    assert uerr(user2, "os.rmdir(p)", p=tmp / "ad") == "EPERM"
    assert uerr(user2, "os.rename(a, b)", a=tmp / "b", b=tmp / "a") == "EPERM"  # replaces a
    assert uerr(user, "os.unlink(p)", p=tmp / "b") == "EPERM"
    assert uerr(user, "os.unlink(p)", p=tmp / "a") == "ok"
    assert uerr(user, "os.rmdir(p)", p=tmp / "ad") == "ok"
    os.unlink(tmp / "b")  # the directory's owner (root) may
    assert os.listdir(tmp) == []


def test_setgid_directory(mdir: Path, user: AsUser, user2: AsUser) -> None:
    sg = mdir / "sg"
    sg.mkdir()
    os.chown(sg, 0, GID_EXTRA)
    os.chmod(sg, 0o2777)
    user("write(p)", p=sg / "f")
    user("os.mkdir(p)", p=sg / "sub")
    f, sub = os.stat(sg / "f"), os.stat(sg / "sub")
    assert (f.st_uid, f.st_gid) == (UID, GID_EXTRA)
    assert sub.st_gid == GID_EXTRA and sub.st_mode & stat.S_ISGID
    # a setgid file for a group its creator is not in loses the bit
    user2("os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o2755))", p=sg / "g")
    g = os.stat(sg / "g")
    assert g.st_gid == GID_EXTRA and not g.st_mode & stat.S_ISGID


def test_chmod_chown_rules(mdir: Path, user: AsUser) -> None:
    f = mdir / "f"
    user("write(p)", p=f)
    assert uerr(user, "os.chmod(p, 0o600)", p=f) == "ok"
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    os.chown(f, UID, 0)  # a group the user is not in: setgid is dropped silently
    assert uerr(user, "os.chmod(p, 0o2755)", p=f) == "ok"
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o755
    os.chmod(f, 0o6755)
    os.chown(f, UID2, GID)  # chown clears set-user-ID (and executable set-group-ID)
    s = os.stat(f)
    assert (s.st_uid, s.st_gid) == (UID2, GID)
    assert not s.st_mode & (stat.S_ISUID | stat.S_ISGID)
    before = os.stat(f).st_ctime_ns
    os.chmod(f, 0o640)
    assert os.stat(f).st_ctime_ns >= before
    assert uerr(user, "os.chmod(p, 0o777)", p=f) == "EPERM"  # no longer the owner


def test_write_by_non_root_drops_setuid(mdir: Path, user: AsUser) -> None:
    f = mdir / "suid"
    user("write(p)", p=f)
    assert uerr(user, "os.chmod(p, 0o6755)", p=f) == "ok"
    assert os.stat(f).st_mode & (stat.S_ISUID | stat.S_ISGID) == stat.S_ISUID | stat.S_ISGID
    with open(f, "ab") as fh:  # root (CAP_FSETID) writing keeps them
        fh.write(b"root")
    assert os.stat(f).st_mode & stat.S_ISUID
    # the owner, not root, writing (no truncation): both drop (the file is g+x)
    user("write(p, 'user', flags=os.O_WRONLY | os.O_APPEND)", p=f)
    s = os.stat(f)
    assert not s.st_mode & (stat.S_ISUID | stat.S_ISGID) and stat.S_IMODE(s.st_mode) == 0o755


@pytest.mark.parametrize("mode", [0o6777, 0o4777, 0o2777])
def test_write_by_non_owner_drops_set_id_bits(mdir: Path, user: AsUser, mode: int) -> None:
    """A write by a user who may write a root-owned set-ID file (not its owner, no
    CAP_FSETID) succeeds and drops the bits, as on a local filesystem: the kernel asks
    for that as a mode change in the writer's name."""
    f = put(mdir / "suid", b"root", mode)
    assert uerr(user, "write(p, 'user', flags=os.O_WRONLY | os.O_APPEND)", p=f) == "ok"
    s = os.stat(f)
    assert stat.S_IMODE(s.st_mode) == 0o777 and s.st_uid == 0
    assert f.read_bytes() == b"rootuser"
    # a truncating open by the same user too
    os.chmod(f, mode)
    assert uerr(user, "write(p, 'again')", p=f) == "ok"
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o777 and f.read_bytes() == b"again"
    # still no chmod for them: only the drop a write makes
    os.chmod(f, mode)
    assert uerr(user, "os.chmod(p, 0o777)", p=f) == "EPERM"


def test_open_fd_keeps_its_access(mdir: Path, user: AsUser) -> None:
    f = mdir / "f"
    user("write(p, 'abc')", p=f)
    fd = os.open(f, os.O_RDWR)
    try:
        os.chmod(f, 0o000)
        assert os.pwrite(fd, b"Z", 1) == 1
        os.ftruncate(fd, 5)
        assert os.pread(fd, 10, 0) == b"aZc\0\0"
    finally:
        os.close(fd)
    assert uerr(user, "read(p)", p=f) == "EACCES"


# -- links, times, open flags ---------------------------------------------------------
def test_link_counts(mdir: Path) -> None:
    f = put(mdir / "f")
    assert os.stat(f).st_nlink == 1
    os.link(f, mdir / "g")
    assert os.stat(f).st_nlink == 2 and os.stat(mdir / "g").st_ino == os.stat(f).st_ino
    os.unlink(f)
    assert os.stat(mdir / "g").st_nlink == 1
    d = mdir / "d"
    d.mkdir()
    base = os.stat(mdir).st_nlink
    assert os.stat(d).st_nlink == 2
    (d / "s").mkdir()
    assert os.stat(d).st_nlink == 3
    os.rename(d / "s", mdir / "s")
    assert os.stat(d).st_nlink == 2
    assert os.stat(mdir).st_nlink == base + 1
    os.rmdir(mdir / "s")
    assert os.stat(mdir).st_nlink == base


def test_times(mdir: Path) -> None:
    t0 = time.time_ns()
    f = put(mdir / "f", b"x")
    s = os.stat(f)
    for t in (s.st_atime_ns, s.st_mtime_ns, s.st_ctime_ns):
        assert abs(t - t0) < 30 * 10**9
    os.utime(f, ns=(1_000_000_005, 2_000_000_007))
    s = os.stat(f)
    assert (s.st_atime_ns, s.st_mtime_ns) == (1_000_000_005, 2_000_000_007)
    assert s.st_ctime_ns >= t0
    with open(f, "ab") as fobj:
        fobj.write(b"more")
    s2 = os.stat(f)
    assert s2.st_mtime_ns > 2_000_000_007 and s2.st_ctime_ns >= s2.st_mtime_ns - 10**9
    assert s2.st_size == 5
    os.utime(f, ns=(3 * 10**9, 4 * 10**9))
    os.chmod(f, 0o600)  # ctime only
    s3 = os.stat(f)
    assert s3.st_mtime_ns == 4 * 10**9 and s3.st_ctime_ns >= t0
    # UTIME_OMIT: touch -m sets mtime and leaves atime, touch -a the other way round
    subprocess.run(["touch", "-m", "-d", "@1500000000", str(f)], check=True)
    s4 = os.stat(f)
    assert (s4.st_atime_ns, s4.st_mtime_ns) == (3 * 10**9, 1_500_000_000 * 10**9)
    subprocess.run(["touch", "-a", "-d", "@1600000000", str(f)], check=True)
    s5 = os.stat(f)
    assert (s5.st_atime_ns, s5.st_mtime_ns) == (1_600_000_000 * 10**9, 1_500_000_000 * 10**9)
    os.utime(f)  # UTIME_NOW
    assert abs(os.stat(f).st_mtime_ns - time.time_ns()) < 30 * 10**9
    dm = os.stat(mdir).st_mtime_ns
    os.utime(mdir, ns=(10**9, 10**9))
    put(mdir / "new")
    assert os.stat(mdir).st_mtime_ns > 10**9 and dm > 0


def test_o_append_trunc_excl(mdir: Path) -> None:
    f = mdir / "f"
    f.write_bytes(b"ab")
    fd1 = os.open(f, os.O_WRONLY | os.O_APPEND)
    fd2 = os.open(f, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd1, b"cd")
        os.write(fd2, b"ef")
        os.write(fd1, b"gh")
    finally:
        os.close(fd1)
        os.close(fd2)
    assert f.read_bytes() == b"abcdefgh"
    fd = os.open(f, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"12")
        os.ftruncate(fd, 6)  # the truncated bytes must not come back
    finally:
        os.close(fd)
    assert f.read_bytes() == b"12\0\0\0\0"
    assert err(os.open, f, os.O_CREAT | os.O_EXCL | os.O_WRONLY) == "EEXIST"
    fd = os.open(mdir / "g", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o400)
    try:  # the creating open may write although the mode says read-only
        os.write(fd, b"ok")
        assert os.pread(fd, 2, 0) == b"ok"
    finally:
        os.close(fd)


def test_sparse_reads_zeros(mdir: Path) -> None:
    f = mdir / "sparse"
    off = 10 * 1024 * 1024 + 3
    with open(f, "wb") as fobj:
        fobj.seek(off)
        fobj.write(b"X")
    assert os.stat(f).st_size == off + 1
    data = f.read_bytes()
    assert data[:off] == bytes(off) and data[off:] == b"X"
    with open(f, "r+b") as fobj:
        fobj.write(b"head")
        fobj.truncate(2)
        fobj.truncate(1 << 20)
    data = f.read_bytes()
    assert data == b"he" + bytes((1 << 20) - 2)


def test_offsets_beyond_4gib(mdir: Path) -> None:
    f = mdir / "huge"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        edge = (4 << 30) - 3
        far = (5 << 30) + 17
        os.pwrite(fd, b"0123456", edge)
        os.pwrite(fd, b"far", far)
        assert os.fstat(fd).st_size == far + 3
        assert os.pread(fd, 7, edge) == b"0123456"
        assert os.pread(fd, 10, far - 2) == b"\0\0far"
        assert os.pread(fd, 4, 3 << 30) == bytes(4)
    finally:
        os.close(fd)
    assert os.stat(f).st_size == (5 << 30) + 20
    with open(f, "rb") as fobj:
        fobj.seek((4 << 30) - 3)
        assert fobj.read(7) == b"0123456"


def test_unlinked_open_file(mdir: Path) -> None:
    f = mdir / "f"
    fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"before")
        rd = os.open(f, os.O_RDONLY)
        os.unlink(f)
        assert err(os.stat, f) == "ENOENT"
        assert os.listdir(mdir) == []
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 100, 0) == b"before"
        os.pwrite(fd, b"-after", 6)
        os.fsync(fd)
        assert os.pread(rd, 100, 0) == b"before-after"
        os.ftruncate(fd, 3)
        assert os.pread(fd, 100, 0) == b"bef"
        os.close(rd)
    finally:
        os.close(fd)
    put(f, b"new")  # the name is free again
    assert f.read_bytes() == b"new"


# -- xattrs, special files, statfs, directories ----------------------------------------
def test_xattrs(mdir: Path) -> None:
    f = put(mdir / "f")
    os.setxattr(f, "user.a", b"1")
    os.setxattr(f, "user.big", b"v" * 65536)
    assert os.getxattr(f, "user.a") == b"1"
    assert len(os.getxattr(f, "user.big")) == 65536
    assert sorted(os.listxattr(f)) == ["user.a", "user.big"]
    assert err(os.setxattr, f, "user.a", b"2", os.XATTR_CREATE) == "EEXIST"
    assert err(os.setxattr, f, "user.zz", b"2", os.XATTR_REPLACE) == "ENODATA"
    os.setxattr(f, "user.a", b"2", os.XATTR_REPLACE)
    assert os.getxattr(f, "user.a") == b"2"
    os.removexattr(f, "user.a")
    assert err(os.getxattr, f, "user.a") == "ENODATA"
    assert err(os.removexattr, f, "user.a") == "ENODATA"
    assert os.listxattr(f) == ["user.big"]
    os.symlink("f", mdir / "l")
    assert err(os.setxattr, mdir / "l", "user.a", b"1", follow_symlinks=False) == "EPERM"
    os.setxattr(mdir, "user.dir", b"d")
    assert os.getxattr(mdir, "user.dir") == b"d"


def test_special_files(mdir: Path) -> None:
    os.mkfifo(mdir / "fifo", 0o640)
    s = os.lstat(mdir / "fifo")
    assert stat.S_ISFIFO(s.st_mode) and stat.S_IMODE(s.st_mode) == 0o640
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(mdir / "sock"))
    finally:
        sock.close()
    assert stat.S_ISSOCK(os.lstat(mdir / "sock").st_mode)
    os.mknod(mdir / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    s = os.lstat(mdir / "chr")
    assert stat.S_ISCHR(s.st_mode) and s.st_rdev == os.makedev(1, 3)
    assert sorted(os.listdir(mdir)) == ["chr", "fifo", "sock"]


def test_statfs(mnt: Path, client_toml: Path) -> None:
    s = os.statvfs(mnt)
    assert s.f_namemax == 255 and s.f_blocks > 0 and s.f_bsize > 0 and s.f_files > 0
    # the session's four data servers share one disk: its size, counted once
    disk = os.statvfs(client_toml.parent / "data")
    assert abs(s.f_blocks * s.f_frsize - disk.f_blocks * disk.f_frsize) <= s.f_frsize


def test_large_directory(mdir: Path) -> None:
    names = {f"file-{i:05d}-{'x' * (i % 40)}" for i in range(700)}
    for n in names:
        os.close(os.open(mdir / n, os.O_CREAT | os.O_WRONLY, 0o644))
    assert set(os.listdir(mdir)) == names
    # removing entries during a listing: nothing repeats, the rest still come
    seen: list[str] = []
    with os.scandir(mdir) as it:
        for i, e in enumerate(it):
            seen.append(e.name)
            if i == 10:
                for n in sorted(names - set(seen))[:100:2]:
                    os.unlink(mdir / n)
    assert len(seen) == len(set(seen))
    assert set(seen) >= set(os.listdir(mdir))
    fd = os.open(mdir, os.O_RDONLY)
    try:
        assert sorted(os.listdir(fd)) == sorted(os.listdir(mdir))
    finally:
        os.close(fd)
    out = subprocess.run(["ls", "-a", str(mdir)], capture_output=True, text=True, check=True)
    assert out.stdout.split()[:2] == [".", ".."]


def test_read_only_mount(client_toml: Path, mdir: Path, mnt: Path) -> None:
    put(mdir / "f", b"content")
    (mdir / "d").mkdir()
    with mounted(client_toml, "ro") as ro:
        rd = ro / mdir.relative_to(mnt)
        assert (rd / "f").read_bytes() == b"content"
        assert sorted(os.listdir(rd)) == ["d", "f"]
        assert err(os.open, rd / "f", os.O_WRONLY) == "EROFS"
        assert err(os.open, rd / "new", os.O_CREAT | os.O_WRONLY) == "EROFS"
        assert err(os.mkdir, rd / "new") == "EROFS"
        assert err(os.unlink, rd / "f") == "EROFS"
        assert err(os.rmdir, rd / "d") == "EROFS"
        assert err(os.chmod, rd / "f", 0o600) == "EROFS"
        assert err(os.rename, rd / "f", rd / "g") == "EROFS"
        assert err(os.setxattr, rd / "f", "user.a", b"1") == "EROFS"
        assert err(os.truncate, rd / "f", 0) == "EROFS"
        assert os.access(rd / "f", os.R_OK) and not os.access(rd / "f", os.W_OK)
    assert (mdir / "f").read_bytes() == b"content"


def test_access_checks(mdir: Path, user: AsUser) -> None:
    f = put(mdir / "f", b"x", 0o640)
    os.chown(f, 0, GID_EXTRA)  # readable through the user's supplementary group
    assert user("os.access(p, os.R_OK)", p=f) is True
    assert user("os.access(p, os.W_OK)", p=f) is False
    assert user("read(p)", p=f) == "x"
    x = put(mdir / "x", b"#!/bin/sh\n", 0o755)
    assert os.access(x, os.X_OK) and not os.access(f, os.X_OK)


def test_uid_in_helper(user: AsUser) -> None:
    assert user("os.getuid()") == UID
    assert sorted(user("os.getgroups()")) == sorted({GID, GID_EXTRA})


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, (1 << 20) + 7, (3 << 20) + 1])
def test_write_read_sizes(mdir: Path, size: int) -> None:
    data = os.urandom(size)
    f = mdir / "f"
    f.write_bytes(data)
    assert os.stat(f).st_size == size
    assert f.read_bytes() == data


def test_file_capabilities_go_on_write(mdir: Path) -> None:
    """The kernel asks for security.capability before every write (to remove it); the
    mount may remember its absence, but never past its own setxattr."""
    import struct

    f = put(mdir / "capf")
    assert err(os.getxattr, f, "security.capability") == "ENODATA"
    with open(f, "ab") as fh:
        fh.write(b"x")
    cap = struct.pack("<5I", 0x02000000, 1 << 10, 0, 0, 0)  # v2, CAP_NET_BIND_SERVICE
    os.setxattr(f, "security.capability", cap)
    assert os.getxattr(f, "security.capability") == cap
    with open(f, "ab") as fh:
        fh.write(b"y")  # the kernel removes the capability before writing
    assert err(os.getxattr, f, "security.capability") == "ENODATA"
    assert f.read_bytes().endswith(b"xy")


def test_directory_attributes_after_changes_in_it(mnt: Path, mdir: Path, client,
                                                  user: AsUser) -> None:
    """After a create or unlink the kernel asks again for the directory's attributes;
    the mount answers from the metaserver's reply to the change. What the kernel sees
    must be the metaserver's, and permission checks must follow a chmod at once."""
    d = mdir / "pd"
    d.mkdir()
    os.chmod(d, 0o777)
    user("write(p, 'a')", p=d / "a")
    os.mkdir(d / "sub")
    (d / "c").write_bytes(b"c")
    os.unlink(d / "c")
    native = client.stat("/" + str(d.relative_to(mnt)))
    seen = os.stat(d)
    assert (seen.st_nlink, seen.st_mtime_ns, seen.st_ctime_ns, seen.st_mode) == \
        (native.st_nlink, native.st_mtime_ns, native.st_ctime_ns, native.st_mode)
    assert seen.st_nlink == 3
    os.chmod(d, 0o755)
    assert uerr(user, "write(p, 'b')", p=d / "b") == "EACCES"
    (d / "e").write_bytes(b"e")  # root, after the chmod: the mode stays 0755
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
    assert uerr(user, "write(p, 'b')", p=d / "b") == "EACCES"

"""What the mount leaves to the kernel's caches, and what it answers without the
metaserver: negative entries (``negative_timeout``) against close-to-open across two
mounts, and FLUSH/RELEASE of a handle that wrote nothing (no metaserver call)."""
from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.fuse_fixtures import *  # noqa: F403
from tests.fuse_fixtures import mounted
from tests.metrics_scrape import free_port as _free_port
from tests.metrics_scrape import scrape as _scrape
from tests.metrics_scrape import value as _value

NEG = 3.0  # seconds of negative_timeout on the caching mount


def _metered(client_toml: Path, tmp_path: Path) -> tuple[Path, int]:
    """A client.toml for a mount that serves /metrics, and its port."""
    port = _free_port()
    toml = tmp_path / "client.toml"
    toml.write_text(client_toml.read_text().replace("metrics_port = 0",
                                                    f"metrics_port = {port}"))
    return toml, port


def _missing(p: Path) -> bool:
    try:
        os.stat(p)
    except FileNotFoundError:
        return True
    return False


def test_default_mount_sees_a_name_made_elsewhere_at_once(mdir: Path, mdir2: Path) -> None:
    """Without negative_timeout (the default) a name this mount just found missing is
    there at the next open by path once another mount created it (close-to-open)."""
    a, b = mdir / "late", mdir2 / "late"
    assert _missing(a)
    b.write_bytes(b"from b")
    assert a.read_bytes() == b"from b"
    os.unlink(b)
    with pytest.raises(FileNotFoundError):  # gone at open, cached entry or not
        a.read_bytes()


def test_negative_entries_expire_and_never_hide_a_create(client_toml: Path, mnt: Path,
                                                        mdir: Path) -> None:
    """With negative_timeout a missing name may stay missing on this mount for that
    long after another mount created it, then it is there; an exclusive create, or a
    create of the cached name, still finds the file the other mount made."""
    with mounted(client_toml, f"negative_timeout={NEG:g}") as neg:
        here = neg / mdir.relative_to(mnt)
        names = ("seen", "excl", "creat")
        t0 = time.monotonic()
        for n in names:
            assert _missing(here / n)  # cached as missing for NEG seconds
        for n in names:
            (mdir / n).write_bytes(b"made elsewhere")
        # O_EXCL makes the kernel ask again: EEXIST, not a second file
        with pytest.raises(FileExistsError):
            os.open(here / "excl", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        # O_CREAT of a name cached as missing opens the existing file
        fd = os.open(here / "creat", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        try:
            os.write(fd, b"+")
        finally:
            os.close(fd)
        assert (mdir / "creat").read_bytes() == b"made elsewhere+"
        if time.monotonic() - t0 < NEG - 0.5:  # (a slow machine may be past it already)
            assert _missing(here / "seen")  # the kernel's cached answer
        time.sleep(max(0.0, t0 + NEG + 0.5 - time.monotonic()))
        assert (here / "seen").read_bytes() == b"made elsewhere"
        # a name this mount creates itself is there at once
        assert _missing(here / "own")
        (here / "own").write_bytes(b"own")
        assert (mdir / "own").read_bytes() == b"own"


def test_clean_close_makes_no_metaserver_call(client_toml: Path, tmp_path: Path) -> None:
    """FLUSH and RELEASE of a handle that wrote nothing send no request of their own:
    the release rides on the next request (or one batched ``release``); a handle that
    wrote still commits its size when it is closed (FLUSH)."""
    toml, port = _metered(client_toml, tmp_path)
    n = 40
    with mounted(toml) as m:
        d = m / f"clean-{os.getpid()}"
        d.mkdir()
        (d / "data").write_bytes(b"x" * 100)
        before = _scrape(port)
        for i in range(n):
            os.close(os.open(d / f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            with open(d / "data", "rb") as f:
                assert f.read() == b"x" * 100
        time.sleep(0.5)  # the last releases go out in a batch of their own
        after = _scrape(port)
        with open(d / "data", "ab") as w:
            w.write(b"y")
        assert os.stat(d / "data").st_size == 101
        last = _scrape(port)
        # an unlink right after a close: the file is gone, not kept open
        os.close(os.open(d / "gone", os.O_CREAT | os.O_WRONLY, 0o644))
        os.unlink(d / "gone")
        assert sorted(os.listdir(d)) == ["data"] + sorted(f"f{i}" for i in range(n))
        for p in d.iterdir():
            p.unlink()
        d.rmdir()

    def calls(text: str, method: str) -> float:
        return _value(text, "pfs_rpc_requests_total", service="client", method=method)

    assert calls(after, "close") - calls(before, "close") == 0
    assert calls(after, "commit_size") - calls(before, "commit_size") == 0
    assert calls(after, "create") - calls(before, "create") == n
    assert calls(after, "release") - calls(before, "release") < n  # batched, if at all
    assert calls(last, "commit_size") - calls(after, "commit_size") == 1  # at FLUSH



def test_a_default_mount_holds_no_name_missing_in_a_directory_it_made_or_listed(
        mdir: Path, mdir2: Path) -> None:
    """Without negative_timeout, a directory this mount made, or listed in full, never
    answers a missing name itself: a name another mount creates in it is there at once."""
    os.mkdir(mdir / "made")
    assert _missing(mdir / "made" / "x")
    (mdir2 / "made" / "x").write_bytes(b"b")
    assert (mdir / "made" / "x").read_bytes() == b"b"
    assert os.listdir(mdir / "made") == ["x"]  # listed in full
    (mdir2 / "made" / "y").write_bytes(b"b2")
    assert (mdir / "made" / "y").read_bytes() == b"b2"


def test_a_known_directory_hides_a_name_made_elsewhere_at_most_negative_timeout(
        client_toml: Path, mnt: Path, mdir: Path) -> None:
    """With negative_timeout, a directory this mount made (or listed in full) answers a
    missing name itself, for at most negative_timeout from when it was known: then a
    name another mount made in it is there. A create never makes a second file: O_EXCL
    gets EEXIST, a plain O_CREAT opens the other mount's file."""
    with mounted(client_toml, f"negative_timeout={NEG:g}") as neg:
        here = neg / mdir.relative_to(mnt)
        t0 = time.monotonic()
        os.mkdir(here / "made")  # known: empty
        os.mkdir(mdir / "listed")
        assert os.listdir(here / "listed") == []  # known: listed in full
        for d in ("made", "listed"):
            for n in ("seen", "excl", "creat"):
                (mdir / d / n).write_bytes(b"elsewhere")
            # missing here until the bound is over (if it is not over already); the
            # kernel caches that answer only for what is left of the bound
            _missing(here / d / "seen")
            with pytest.raises(FileExistsError):
                os.open(here / d / "excl", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            fd = os.open(here / d / "creat", os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
            try:
                os.write(fd, b"+")
            finally:
                os.close(fd)
            assert (mdir / d / "creat").read_bytes() == b"elsewhere+"
        time.sleep(max(0.0, t0 + NEG + 0.5 - time.monotonic()))
        for d in ("made", "listed"):
            assert (here / d / "seen").read_bytes() == b"elsewhere"


def test_a_name_held_missing_here_is_there_once_this_mount_makes_it(
        client_toml: Path, mnt: Path, mdir: Path) -> None:
    """A missing name answered without the metaserver follows this mount's own changes
    at once: create, mkdir, symlink, link and rename make a name there; unlink, rmdir
    and rename take it away."""
    with mounted(client_toml, f"negative_timeout={NEG:g}") as neg:
        d = neg / mdir.relative_to(mnt) / "own"
        os.mkdir(d)
        for n in ("f", "sub", "sym", "hard", "moved"):
            assert _missing(d / n)
        (d / "f").write_bytes(b"f")
        assert (d / "f").read_bytes() == b"f"
        os.mkdir(d / "sub")
        assert (d / "sub").is_dir()
        os.symlink("f", d / "sym")
        assert os.readlink(d / "sym") == "f"
        os.link(d / "f", d / "hard")
        assert os.stat(d / "hard").st_nlink == 2
        os.rename(d / "hard", d / "moved")
        assert _missing(d / "hard") and (d / "moved").read_bytes() == b"f"
        os.unlink(d / "moved")
        os.rmdir(d / "sub")
        assert _missing(d / "moved") and _missing(d / "sub")
        assert os.stat(d / "f").st_nlink == 1
        assert sorted(os.listdir(mdir / "own")) == ["f", "sym"]  # as the other mount sees


def test_creates_in_a_directory_made_here_skip_the_lookup(client_toml: Path,
                                                          tmp_path: Path) -> None:
    """With negative_timeout, O_EXCL creates in a directory this mount just made cost
    one metaserver call each (the CREATE), not two: the kernel's LOOKUP of each new name
    is answered here."""
    toml, port = _metered(client_toml, tmp_path)
    n = 20
    with mounted(toml, "negative_timeout=30") as m:
        d = m / f"lean-{os.getpid()}"
        before = _scrape(port)
        d.mkdir()
        for i in range(n):
            os.close(os.open(d / f"f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        after = _scrape(port)
        for p in d.iterdir():
            p.unlink()
        d.rmdir()

    def calls(method: str) -> float:
        return (_value(after, "pfs_rpc_requests_total", service="client", method=method)
                - _value(before, "pfs_rpc_requests_total", service="client", method=method))

    assert calls("create") == n
    assert calls("lookup") <= 1  # (the directory's own name, before the mkdir)


def test_kernel_requests_per_create_stat_and_unlink(client_toml: Path, tmp_path: Path) -> None:
    """What the kernel sends for each operation of a create/stat/unlink loop, and which
    of those reach the metaserver (``pfs_fuse_requests_total{op}`` beside the client's
    RPC counters). A create is LOOKUP (missing), CREATE, GETATTR of the directory
    (answered from the create's reply), FLUSH and RELEASE (nothing written: no call):
    2 calls, no GETATTR of the new file (CREATE returned its attributes). A stat within
    the entry timeout sends nothing; an unlink is UNLINK and the directory's GETATTR
    (from the reply): 1 call."""
    toml, port = _metered(client_toml, tmp_path)
    n = 20
    # timeouts long enough for the loop on a loaded machine: what is cached stays so
    with mounted(toml, "entry_timeout=60,attr_timeout=60") as m:
        d = m / f"req-{os.getpid()}"
        d.mkdir()
        os.stat(d)
        paths = [d / f"f{i}" for i in range(n)]
        phases = {}
        last = _scrape(port)
        for phase, fn in (("create", lambda p: os.close(os.open(
                               p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))),
                          ("stat", os.stat), ("unlink", os.unlink)):
            for p in paths:
                fn(p)
            os.stat(d)  # the directory's GETATTR after the last change, in this phase
            time.sleep(0.5)  # deferred releases go out; FORGETs come
            now = _scrape(port)
            phases[phase] = (last, now)
            last = now
        d.rmdir()

    def req(phase: str, op: str) -> float:
        a, b = phases[phase]
        return (_value(b, "pfs_fuse_requests_total", op=op)
                - _value(a, "pfs_fuse_requests_total", op=op))

    def calls(phase: str, method: str) -> float:
        a, b = phases[phase]
        return (_value(b, "pfs_rpc_requests_total", service="client", method=method)
                - _value(a, "pfs_rpc_requests_total", service="client", method=method))

    for op in ("lookup", "create", "getattr", "flush", "release"):
        assert req("create", op) == n, op
    assert calls("create", "lookup") == n and calls("create", "create") == n
    assert calls("create", "getattr") == 0 and calls("create", "close") == 0
    assert _value(phases["stat"][1], "pfs_fuse_requests_total") == \
        _value(phases["stat"][0], "pfs_fuse_requests_total")  # nothing at all
    assert req("unlink", "lookup") == 0 and req("unlink", "unlink") == n
    assert req("unlink", "getattr") == n and calls("unlink", "getattr") == 0
    assert calls("unlink", "unlink") == n and calls("unlink", "lookup") == 0


def test_getattrs_after_a_read_or_a_changed_open_are_answered_from_replies(
        client_toml: Path, tmp_path: Path, mnt: Path) -> None:
    """The kernel drops an inode's attributes after every read (atime, which pfs does
    not move on reads) and at an open whose file changed (the mount tells it to), then
    asks again: the mount answers from the attributes the lookup or the open just
    carried, with no metaserver call; what the open found changed is what fstat shows."""
    toml, port = _metered(client_toml, tmp_path)
    n = 10
    with mounted(toml, "entry_timeout=60,attr_timeout=60") as m:
        d = m / f"ga-{os.getpid()}"
        d.mkdir()
        for i in range(n):
            (d / f"f{i}").write_bytes(b"x" * 10)
        for i in range(n):  # a read: the next stat makes the kernel ask again
            assert (d / f"f{i}").read_bytes() == b"x" * 10
        (mnt / d.relative_to(m) / "f0").write_bytes(b"y" * 20)  # changed elsewhere
        before = _scrape(port)
        for i in range(n):
            fd = os.open(d / f"f{i}", os.O_RDONLY)
            try:
                assert os.fstat(fd).st_size == (20 if i == 0 else 10)
                assert os.read(fd, 100) == (b"y" * 20 if i == 0 else b"x" * 10)
            finally:
                os.close(fd)
            assert os.stat(d / f"f{i}").st_size == (20 if i == 0 else 10)
        after = _scrape(port)
        for i in range(n):
            os.unlink(d / f"f{i}")
        d.rmdir()

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("pfs_fuse_requests_total", op="getattr") >= n  # the kernel asked
    assert delta("pfs_rpc_requests_total", service="client", method="getattr") == 0
    assert delta("pfs_rpc_requests_total", service="client", method="open") == n


def test_attributes_answered_here_follow_this_mounts_changes(mdir: Path) -> None:
    """A GETATTR answered from a reply never hides a change made through this mount:
    the link count after an unlink of another name (an inode the unlink's reply does not
    name), the size after a write and a truncate, the mode after a chmod."""
    f, g = mdir / "f", mdir / "g"
    f.write_bytes(b"abc")
    os.link(f, g)
    fd = os.open(f, os.O_RDWR)
    try:
        assert os.fstat(fd).st_nlink == 2
        assert os.stat(g).st_nlink == 2
        os.unlink(g)
        assert os.fstat(fd).st_nlink == 1
        assert os.read(fd, 10) == b"abc"  # (a read: the kernel asks again at the stat)
        os.write(fd, b"defg")
        assert os.fstat(fd).st_size == 7 and os.stat(f).st_size == 7
        os.ftruncate(fd, 2)
        assert os.fstat(fd).st_size == 2
        os.chmod(f, 0o640)
        assert os.read(fd, 1) == b""
        assert os.fstat(fd).st_mode & 0o777 == 0o640
    finally:
        os.close(fd)
    os.rename(f, mdir / "h")
    assert os.stat(mdir / "h").st_size == 2


def test_attributes_answered_here_expire_with_attr_timeout(client_toml: Path, mnt: Path,
                                                           mdir: Path) -> None:
    """Attributes kept from a reply answer the kernel for at most attr_timeout: a change
    made on another node shows here once that passed, even where the kernel keeps the
    name for much longer (entry_timeout) and asks only for the attributes."""
    attr_timeout = 1.0
    with mounted(client_toml, f"entry_timeout=60,attr_timeout={attr_timeout:g}") as a:
        here = a / mdir.relative_to(mnt) / "f"
        (mdir / "f").write_bytes(b"abc")
        os.chmod(mdir / "f", 0o600)
        assert here.read_bytes() == b"abc"  # a lookup and an open: attributes kept
        t0 = time.monotonic()
        os.chmod(mdir / "f", 0o644)  # elsewhere
        (mdir / "f").write_bytes(b"abcdef")
        time.sleep(max(0.0, t0 + attr_timeout + 0.5 - time.monotonic()))
        st = os.stat(here)
        assert (st.st_mode & 0o777, st.st_size) == (0o644, 6)


def _cached_pages(fd: int) -> int:
    """The file's pages in the kernel's page cache (cachestat(2), Linux 6.5+): asked
    through an open fd, so no lookup or attribute check of the inode happens."""
    import ctypes

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in
                    ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                     "nr_recently_evicted")]

    libc = ctypes.CDLL(None, use_errno=True)
    r, s = Range(0, 0), Stat()
    if libc.syscall(451, fd, ctypes.byref(r), ctypes.byref(s), 0) != 0:  # x86_64 and arm64
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            pytest.skip("cachestat(2) needs Linux 6.5")
        raise OSError(err, "cachestat")
    return int(s.nr_cache)


def test_a_closed_writer_s_pages_leave_the_cache_without_waiting_for_a_stat(
        mdir: Path) -> None:
    """The pages a writer left cached are dropped after its close by the daemon itself,
    not inside whoever looks the file up next (the kernel would drop them there: the
    mtime moved, ~20 ms per 128 MiB in that caller's stat); the file reads back whole."""
    p = mdir / "written"
    p.write_bytes(b"")
    data = os.urandom(8 << 20)
    reader = os.open(p, os.O_RDONLY)  # opened before the writes: nothing looks at p after
    try:
        with open(p, "r+b") as f:
            f.write(data)
            f.flush()
            assert _cached_pages(reader) > 0  # the writes left their pages cached
        deadline = time.monotonic() + 20
        while (left := _cached_pages(reader)) > 0:
            assert time.monotonic() < deadline, f"{left} pages still cached after close"
            time.sleep(0.05)
    finally:
        os.close(reader)
    assert p.read_bytes() == data

"""Fixtures for the FUSE tests: real mounts of the session's cluster (``pfs mount`` in the
background, as an operator runs it), and helper processes acting as unprivileged users.

Import the fixtures in a test module with ``from tests.fuse_fixtures import *``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pyfuse3 = pytest.importorskip("pyfuse3")

PY = sys.executable
# Mounts made by these tests start here; a stale one from a killed run is cleaned up.
MNT_PREFIX = "pfs-test-mnt-"

__all__ = ["mnt", "mnt2", "mdir", "mdir2", "user", "user2", "pfs_cli", "mounted", "AsUser",
           "fuse_usable", "UID", "GID", "GID_EXTRA", "UID2", "GID2"]

UID, GID, GID_EXTRA = 2001, 2001, 2100  # "user": in groups 2001 and 2100
UID2, GID2 = 2002, 2002  # "user2": only in group 2002


def fuse_usable() -> str | None:
    """Why FUSE tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "FUSE tests need root (setresuid helpers, allow_other)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if not shutil.which("fusermount3"):
        return "no fusermount3"
    return None


def pfs_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "pfs.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def _mounted_here(path: Path) -> bool:
    from pfs.fuse.mount import mount_entry

    return mount_entry(str(path)) is not None


@contextmanager
def mounted(client_toml: Path, options: str = "") -> Iterator[Path]:
    """A pfs mount of the cluster in ``client_toml`` on a fresh directory. On exit it is
    unmounted, and its log must hold no traceback or error."""
    if (why := fuse_usable()) is not None:
        pytest.skip(why)
    mnt = Path(tempfile.mkdtemp(prefix=MNT_PREFIX))
    os.chmod(mnt, 0o755)  # other users reach the mount point
    log = Path(str(mnt) + ".log")
    opts = f"allow_other,logfile={log}" + (f",{options}" if options else "")
    r = pfs_cli("mount", "--config", str(client_toml), str(mnt), "-o", opts)
    if r.returncode != 0:
        text = log.read_text() if log.exists() else ""
        os.rmdir(mnt)
        raise AssertionError(f"pfs mount failed: {r.stderr}\n{text}")
    try:
        yield mnt
    finally:
        r = pfs_cli("umount", str(mnt))
        if r.returncode != 0 and _mounted_here(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        failed = r.returncode != 0
        try:
            os.rmdir(mnt)
        except OSError:
            pass
        text = log.read_text() if log.exists() else ""
        log.unlink(missing_ok=True)
        bad = [ln for ln in text.splitlines() if "Traceback" in ln or " ERROR " in ln]
        if failed or bad:
            raise AssertionError(f"unmount: {r.stderr.strip()}; mount log:\n{text}")


@pytest.fixture(scope="session")
def mnt(client_toml: Path) -> Iterator[Path]:
    """The session's mount of the shared cluster."""
    with mounted(client_toml) as m:
        yield m


@pytest.fixture(scope="session")
def mnt2(client_toml: Path, mnt: Path) -> Iterator[Path]:
    """A second mount of the same cluster (another node, for close-to-open tests)."""
    with mounted(client_toml) as m:
        yield m


def _fresh(root: Path, request: pytest.FixtureRequest) -> Path:
    name = request.node.name
    for ch in "[]/ ":
        name = name.replace(ch, "_")
    d = root / f"t-{name[:80]}-{os.getpid()}-{id(request) & 0xffff:x}"
    d.mkdir()
    os.chmod(d, 0o777)
    return d


@pytest.fixture
def mdir(mnt: Path, request: pytest.FixtureRequest) -> Path:
    """A fresh directory (mode 0777, owned by root) in the mount for one test."""
    return _fresh(mnt, request)


@pytest.fixture
def mdir2(mnt: Path, mnt2: Path, mdir: Path) -> Path:
    """``mdir`` as seen through the second mount."""
    return mnt2 / mdir.relative_to(mnt)


# -- other users ---------------------------------------------------------------
_AGENT = r'''
import errno, json, os, stat, sys
def _b(data):
    return data.encode("latin-1") if isinstance(data, str) else data
def write(path, data="x", flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode=0o666, off=None):
    fd = os.open(path, flags, mode)
    try:
        return os.write(fd, _b(data)) if off is None else os.pwrite(fd, _b(data), off)
    finally:
        os.close(fd)
def read(path):
    with open(path, "rb") as f:
        return f.read().decode("latin-1")
def st(path, follow=True):
    s = os.stat(path, follow_symlinks=follow)
    return {"mode": s.st_mode, "uid": s.st_uid, "gid": s.st_gid, "nlink": s.st_nlink,
            "size": s.st_size, "mtime_ns": s.st_mtime_ns, "atime_ns": s.st_atime_ns,
            "ctime_ns": s.st_ctime_ns}
ns = {"os": os, "errno": errno, "stat": stat, "write": write, "read": read, "st": st}
for line in sys.stdin:
    req = json.loads(line)
    try:
        value = eval(req["expr"], ns, dict(req["vars"]))
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        out = {"ok": value}
    except OSError as exc:
        out = {"errno": exc.errno, "msg": str(exc)}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
'''


def _world_runnable(path: str) -> bool:
    """Whether any user may execute ``path`` (every directory above it searchable)."""
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.stat(real).st_mode & 0o001:
        return False
    d = os.path.dirname(real)
    while True:
        if not os.stat(d).st_mode & 0o001:
            return False
        if d == "/":
            return True
        d = os.path.dirname(d)


def _helper_python() -> str:
    for cand in (PY, shutil.which("python3") or "", "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and _world_runnable(cand):
            return cand
    pytest.skip("no Python interpreter that an unprivileged user may run")


class AsUser:
    """A helper process with other credentials: ``u("os.mkdir(p)", p=path)`` evaluates an
    expression there and returns its value, or raises the ``OSError`` it raised."""

    def __init__(self, uid: int, gid: int, groups: tuple[int, ...] = ()) -> None:
        self.uid, self.gid, self.groups = uid, gid, groups
        self.proc = subprocess.Popen([_helper_python(), "-I", "-S", "-c", _AGENT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd="/", user=uid,
                                     group=gid, extra_groups=list(groups), umask=0o022)

    def __call__(self, expr: str, **vars: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"expr": expr, "vars": {k: str(v) if isinstance(
            v, Path) else v for k, v in vars.items()}}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"helper for uid {self.uid} died")
        out = json.loads(line)
        if "errno" in out:
            raise OSError(out["errno"], out["msg"])
        return out["ok"]

    def errno(self, expr: str, **vars: Any) -> int:
        """The errno ``expr`` fails with (0 if it succeeds)."""
        try:
            self(expr, **vars)
        except OSError as exc:
            return exc.errno or -1
        return 0

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture(scope="session")
def user() -> Iterator[AsUser]:
    u = AsUser(UID, GID, (GID, GID_EXTRA))
    try:
        yield u
    finally:
        u.close()


@pytest.fixture(scope="session")
def user2() -> Iterator[AsUser]:
    u = AsUser(UID2, GID2, (GID2,))
    try:
        yield u
    finally:
        u.close()

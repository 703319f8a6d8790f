"""The mount against a model: hypothesis applies one random sequence of file operations
to a pfs mount and to a local directory and requires the same results and errnos; and
two mounts of one cluster agree after close (close-to-open)."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tests.fuse_fixtures import *  # noqa: F403

NAMES = ["a", "b", "d", "d/a", "d/b", "d/e", "d/e/a", "e", "e/a"]
paths = st.sampled_from(NAMES)
data = st.binary(max_size=3000) | st.sampled_from([b"", b"x" * 70000])
offsets = st.sampled_from([0, 1, 100, 4095, 4096, 65536, (1 << 20) - 1, (1 << 20) + 5])


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return ("ok", fn(*args))
    except OSError as exc:
        return ("err", errno.errorcode.get(exc.errno or 0, exc.errno))


def _write(p: str, payload: bytes, off: int | None, flags: int) -> int:
    fd = os.open(p, flags, 0o644)
    try:
        return os.write(fd, payload) if off is None else os.pwrite(fd, payload, off)
    finally:
        os.close(fd)


def _read(p: str) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _stat(p: str) -> tuple[int, ...]:
    s = os.lstat(p)
    size = s.st_size if not stat.S_ISDIR(s.st_mode) else -1
    return (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_nlink, size)


class MountModel(RuleBasedStateMachine):
    mount_root: Path  # set by the test
    model_root: Path  # ditto: a fresh local directory, so "../a" on both sides lands in
    # a directory of this test's own (not /tmp, where another run may have left an "a")

    def __init__(self) -> None:
        super().__init__()
        self.real = Path(tempfile.mkdtemp(prefix="case-", dir=self.mount_root))
        self.model = Path(tempfile.mkdtemp(prefix="pfs-model-", dir=self.model_root))

    def teardown(self) -> None:
        shutil.rmtree(self.real, ignore_errors=True)
        shutil.rmtree(self.model, ignore_errors=True)

    def both(self, fn: Any, *rel: str, extra: tuple[Any, ...] = ()) -> Any:
        a = outcome(fn, *[str(self.real / r) for r in rel], *extra)
        b = outcome(fn, *[str(self.model / r) for r in rel], *extra)
        assert a == b, f"{fn.__name__}{rel}{extra}: mount {a} != local {b}"
        return a

    @rule(p=paths, payload=data)
    def create(self, p: str, payload: bytes) -> None:
        self.both(_write, p, extra=(payload, None, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))

    @rule(p=paths, payload=data, off=offsets)
    def pwrite(self, p: str, payload: bytes, off: int) -> None:
        self.both(_write, p, extra=(payload, off, os.O_WRONLY))

    @rule(p=paths, payload=data)
    def append(self, p: str, payload: bytes) -> None:
        self.both(_write, p, extra=(payload, None, os.O_WRONLY | os.O_APPEND))

    @rule(p=paths)
    def exclusive(self, p: str) -> None:
        self.both(_write, p, extra=(b"x", None, os.O_WRONLY | os.O_CREAT | os.O_EXCL))

    @rule(p=paths)
    def read(self, p: str) -> None:
        self.both(_read, p)

    @rule(p=paths, size=offsets)
    def truncate(self, p: str, size: int) -> None:
        self.both(os.truncate, p, extra=(size,))

    @rule(p=paths)
    def mkdir(self, p: str) -> None:
        self.both(os.mkdir, p)

    @rule(p=paths)
    def rmdir(self, p: str) -> None:
        self.both(os.rmdir, p)

    @rule(p=paths)
    def unlink(self, p: str) -> None:
        self.both(os.unlink, p)

    @rule(src=paths, dst=paths)
    def rename(self, src: str, dst: str) -> None:
        self.both(os.rename, src, dst)

    @rule(src=paths, dst=paths)
    def link(self, src: str, dst: str) -> None:
        self.both(os.link, src, dst)

    @rule(dest=st.sampled_from(["a", "../a", "d", "nowhere", "d/e"]), p=paths)
    def symlink(self, dest: str, p: str) -> None:
        a = outcome(os.symlink, dest, str(self.real / p))
        b = outcome(os.symlink, dest, str(self.model / p))
        assert a == b

    @rule(p=paths)
    def readlink(self, p: str) -> None:
        self.both(os.readlink, p)

    @rule(p=paths, mode=st.sampled_from([0o600, 0o755, 0o4755, 0o1777, 0o000]))
    def chmod(self, p: str, mode: int) -> None:
        self.both(os.chmod, p, extra=(mode,))

    @rule(p=paths)
    def stat(self, p: str) -> None:
        self.both(_stat, p)

    @invariant()
    def same_tree(self) -> None:
        def tree(root: Path) -> dict[str, Any]:
            out = {}
            for d, dirs, files in os.walk(root):
                for n in dirs + files:
                    rel = os.path.relpath(os.path.join(d, n), root)
                    out[rel] = _stat(os.path.join(d, n))
            return out

        assert tree(self.real) == tree(self.model)


def test_model(mnt: Path, tmp_path: Path) -> None:
    MountModel.mount_root = mnt
    MountModel.model_root = tmp_path
    run_state_machine_as_test(MountModel, settings=settings(
        max_examples=30, stateful_step_count=30, deadline=None,
        suppress_health_check=list(HealthCheck)))


def test_two_mounts_close_to_open(mdir: Path, mdir2: Path) -> None:
    a, b = mdir / "f", mdir2 / "f"
    first = os.urandom((5 << 20) + 11)
    a.write_bytes(first)
    assert b.read_bytes() == first  # b now holds the pages in its cache
    assert os.stat(b).st_size == len(first)
    second = os.urandom(len(first))  # same size: only the contents and mtime change
    a.write_bytes(second)
    assert b.read_bytes() == second
    with open(a, "ab") as f:  # grows
        f.write(b"tail")
    assert b.read_bytes() == second + b"tail"
    os.truncate(a, 1000)  # shrinks
    with open(b, "rb") as f:
        assert f.read() == second[:1000]
    # writes through b are whole on a once b closed
    with open(b, "r+b") as f:
        f.seek(500)
        f.write(b"B" * 2000)
    assert a.read_bytes() == second[:500] + b"B" * 2000
    # namespace changes
    (mdir / "sub").mkdir()
    (mdir / "sub" / "x").write_bytes(b"x")
    assert (mdir2 / "sub" / "x").read_bytes() == b"x"
    os.rename(mdir / "sub" / "x", mdir / "sub" / "y")
    assert sorted(os.listdir(mdir2 / "sub")) == ["y"]


@pytest.mark.parametrize("n", [3])
def test_two_mounts_concurrent_writers(mdir: Path, mdir2: Path, n: int) -> None:
    """Different files written at once through both mounts are whole on the other."""
    blobs = {f"w{i}": os.urandom((1 << 20) + i) for i in range(2 * n)}
    for i, (name, blob) in enumerate(blobs.items()):
        ((mdir if i % 2 else mdir2) / name).write_bytes(blob)
    for i, (name, blob) in enumerate(blobs.items()):
        assert ((mdir2 if i % 2 else mdir) / name).read_bytes() == blob

"""Standard tools on a pfs mount: cp -a and tar round trips of a tree with symlinks, hard
links and odd names; git; dd of a few hundred MiB with checksums (read back through a
second, cold mount); find, du, rsync; many readers and writers at once."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.fuse_fixtures import *  # noqa: F403

ODD_NAMES = ["with space", "new\nline", "tab\tname", "ünïcödé-名前", "-leading-dash",
             "*star?", "quote'\"", "back\\slash", ".hidden", "n" * 255, "%percent%"]


def make_tree(root: Path) -> None:
    """A tree with odd names, sizes across stripes, modes, times, links and an xattr."""
    sub = root / "dir a" / "sub dir"
    sub.mkdir(parents=True)
    (root / "empty dir").mkdir()
    for i, name in enumerate(ODD_NAMES):
        (root / "dir a" / name).write_bytes(os.urandom((i * 7919) % 20000))
    (root / "plain.txt").write_bytes(b"hello\n")
    (root / "big.bin").write_bytes(os.urandom((2 << 20) + 3))
    (root / "empty").write_bytes(b"")
    os.link(root / "plain.txt", root / "dir a" / "hard1")
    os.link(root / "plain.txt", sub / "hard2")
    os.symlink("plain.txt", root / "link-rel")
    os.symlink("../../big.bin", sub / "link-up")
    os.symlink("dir a", root / "link-dir")
    os.symlink("/nonexistent/target", root / "link-dangling")
    (root / "exec.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "exec.sh", 0o755)
    os.chmod(root / "empty", 0o600)
    os.chmod(sub, 0o750)
    os.setxattr(root / "plain.txt", "user.tag", b"value")
    t = 1_600_000_000
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for n in filenames + dirnames:
            p = os.path.join(dirpath, n)
            t += 1
            os.utime(p, ns=(t * 10**9 + 1, t * 10**9 + 7), follow_symlinks=False)
    os.utime(root, ns=(10**18, 10**18))


def snapshot(root: Path, times: bool = True) -> dict[str, Any]:
    """Everything a faithful copy keeps: types, modes, sizes, contents, link targets,
    file times and which names are hard links of one another."""
    out: dict[str, Any] = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            s = os.lstat(p)
            rec: dict[str, Any] = {"type": stat.S_IFMT(s.st_mode)}
            if stat.S_ISLNK(s.st_mode):
                rec["target"] = os.readlink(p)
            else:
                rec["mode"] = stat.S_IMODE(s.st_mode)
            if stat.S_ISREG(s.st_mode):
                with open(p, "rb") as f:
                    rec["sha"] = hashlib.sha256(f.read()).hexdigest()
                rec["size"] = s.st_size
                rec["nlink"] = s.st_nlink
                inodes.setdefault(s.st_ino, []).append(rel)
                if times:
                    rec["mtime"] = s.st_mtime_ns
            out[rel] = rec
    out["<hardlinks>"] = sorted(sorted(v) for v in inodes.values() if len(v) > 1)
    return out


def run(*cmd: str, cwd: Path | None = None, **kw: Any) -> str:
    r = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}: {r.stderr}"
    return r.stdout


def test_cp_a_round_trip(mdir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    want = snapshot(src)
    run("cp", "-a", str(src), str(mdir / "copy"))
    assert snapshot(mdir / "copy") == want
    assert os.getxattr(mdir / "copy" / "plain.txt", "user.tag") == b"value"
    run("cp", "-a", str(mdir / "copy"), str(tmp_path / "back"))
    assert snapshot(tmp_path / "back") == want


def test_tar_round_trip(mdir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    want = snapshot(src)
    (mdir / "t").mkdir()
    run("sh", "-c", f'tar --format=posix -C "{src}" -cf - . | tar -C "{mdir / "t"}" -xpf -')
    assert snapshot(mdir / "t") == want
    run("tar", "--format=posix", "-C", str(mdir / "t"), "-cf", str(mdir / "t.tar"), ".")
    (tmp_path / "back").mkdir()
    run("tar", "-C", str(tmp_path / "back"), "-xpf", str(mdir / "t.tar"))
    assert snapshot(tmp_path / "back") == want


def test_git(mdir: Path, tmp_path: Path) -> None:
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    env = dict(os.environ, HOME=str(tmp_path), GIT_CONFIG_NOSYSTEM="1",
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    repo = mdir / "repo"

    def git(*args: str) -> str:
        return run("git", *args, cwd=repo, env=env)

    repo.mkdir()
    git("init", "-q", "-b", "main")
    for i in range(20):
        (repo / f"file{i}.txt").write_text(f"line {i}\n" * (i + 1))
    (repo / "dir").mkdir()
    (repo / "dir" / "bin").write_bytes(os.urandom(300_000))
    os.symlink("file1.txt", repo / "link")
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    (repo / "file3.txt").write_text("changed\n")
    os.unlink(repo / "file4.txt")
    git("mv", "file5.txt", "moved.txt")
    git("commit", "-q", "-am", "second")
    assert git("status", "--porcelain") == ""
    assert git("log", "--format=%s").split() == ["second", "first"]
    git("gc", "-q")
    git("fsck", "--strict")
    git("checkout", "-q", "HEAD~1")
    assert (repo / "file4.txt").exists() and not (repo / "moved.txt").exists()
    git("checkout", "-q", "main")
    assert (repo / "file3.txt").read_text() == "changed\n"
    clone = tmp_path / "clone"
    run("git", "clone", "-q", str(repo), str(clone), env=env)
    assert (clone / "moved.txt").read_text() == "line 5\n" * 6


def _sha(path: Path) -> str:
    return run("sha256sum", str(path)).split()[0]


def test_dd_large_file(mdir: Path, mdir2: Path, tmp_path: Path) -> None:
    size_mib = 200
    src = tmp_path / "src.bin"
    with open(src, "wb") as f:
        for _ in range(size_mib // 8):
            f.write(os.urandom(8 << 20))
    want = _sha(src)
    dst = mdir / "big.bin"
    run("dd", f"if={src}", f"of={dst}", "bs=1M", "conv=fsync", "status=none")
    assert os.stat(dst).st_size == size_mib << 20
    assert _sha(mdir2 / "big.bin") == want  # a cold mount: every byte from the servers
    assert _sha(dst) == want
    # overwrite a range in place with an odd block size
    run("dd", "if=/dev/zero", f"of={dst}", "bs=65537", "count=33", "seek=17",
        "conv=notrunc", "status=none")
    with open(src, "r+b") as f:
        f.seek(17 * 65537)
        f.write(bytes(65537 * 33))
    assert _sha(mdir2 / "big.bin") == _sha(src)
    run("dd", f"if={dst}", f"of={tmp_path / 'back.bin'}", "bs=4M", "status=none")
    assert _sha(tmp_path / "back.bin") == _sha(src)


def test_find_du(mdir: Path) -> None:
    make_tree(mdir / "tree")
    found = run("find", str(mdir / "tree"), "-type", "f").splitlines()
    # names with newlines split lines: count with -print0 instead
    found0 = run("find", str(mdir / "tree"), "-type", "f", "-print0").split("\0")[:-1]
    walked = [os.path.join(d, n) for d, _, fs in os.walk(mdir / "tree") for n in fs
              if os.path.isfile(os.path.join(d, n)) and not os.path.islink(os.path.join(d, n))]
    assert sorted(found0) == sorted(walked) and len(found) >= len(found0)
    assert run("find", str(mdir / "tree"), "-type", "l", "-name", "link-*",
               "-printf", "%f\n").split() != []
    assert len(run("find", str(mdir / "tree"), "-maxdepth", "1", "-type", "d").split("\n")) >= 3
    apparent = int(run("du", "-sb", "--apparent-size", str(mdir / "tree")).split()[0])
    seen: set[int] = set()
    total = 0
    for d, dirs, files in os.walk(mdir / "tree"):
        for n in dirs + files + ([] if d != str(mdir / "tree") else ["."]):
            s = os.lstat(os.path.join(d, n))
            if s.st_ino not in seen:
                seen.add(s.st_ino)
                total += s.st_size
    assert apparent == total
    assert int(run("du", "-sk", str(mdir / "tree")).split()[0]) > 0


def test_rsync(mdir: Path, tmp_path: Path) -> None:
    if not shutil.which("rsync"):
        pytest.skip("rsync is not installed")
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    run("rsync", "-aHX", f"{src}/", f"{mdir / 'r'}/")
    assert snapshot(mdir / "r") == snapshot(src)
    (src / "plain.txt").write_bytes(b"changed\n")
    run("rsync", "-aHX", "--delete", f"{src}/", f"{mdir / 'r'}/")
    assert snapshot(mdir / "r") == snapshot(src)


def test_many_concurrent_readers_and_writers(mdir: Path, mdir2: Path) -> None:
    blobs = {f"f{i}": os.urandom((4 << 20) + i * 4099) for i in range(12)}

    def write(name: str) -> None:
        with open(mdir / name, "wb") as f:
            data = blobs[name]
            for off in range(0, len(data), 1 << 20):
                f.write(data[off:off + (1 << 20)])

    def check(name: str) -> bool:
        return (mdir2 / name).read_bytes() == blobs[name]

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(write, blobs))
        assert all(pool.map(check, blobs))
        assert all(pool.map(check, list(blobs) * 2))

"""``pfs bench io500``'s mdtest stat, read and delete phases make mdtest's system calls:
per rank, the files (whose, in which directory), in mdtest's order, with nothing else
done to them, and the tree's removal only after every rank's unlinks; traced with
strace. Against the rules read from hpc/ior's mdtest.c always, and against the real
mdtest where ``$PFS_IO500_REFERENCE`` names a built harness. Nothing here judges speed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pfs.bench import io500_loops, io500ref

EASY_F, HARD_F = 6, 9  # files per rank
READERS = "mdtest-easy-stat,mdtest-hard-stat,mdtest-easy-delete,mdtest-hard-read,mdtest-hard-delete"

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")

Call = tuple[str, str]  # (stat | lstat | open-rdwr | open-other | unlink | rmdir, path)
# one system call on a path, as strace -ttt prints it (AT_FDCWD forms too)
LINE = re.compile(r'^(?P<t>[0-9.]+) (?P<call>\w+)\((?:AT_FDCWD, )?"(?P<path>[^"]*)"(?P<rest>.*)$')


def traced(prefix: Path) -> dict[int, list[tuple[float, Call]]]:
    """The calls on mdtest's files and trees of each traced process (strace -ff)."""
    out: dict[int, list[tuple[float, Call]]] = {}
    for f in prefix.parent.glob(prefix.name + ".*"):
        calls: list[tuple[float, Call]] = []
        for line in f.read_text().splitlines():
            m = LINE.match(line)
            if m is None or "/mdtest-" not in m["path"]:
                continue
            name, rest = m["call"], m["rest"]
            if name in ("stat", "lstat", "newfstatat", "statx", "fstatat64"):
                name = "lstat" if name == "lstat" or "AT_SYMLINK_NOFOLLOW" in rest else "stat"
            elif name in ("open", "openat"):
                name = "open-rdwr" if "O_RDWR" in rest else "open-other"
            elif name == "unlinkat":
                name = "rmdir" if "AT_REMOVEDIR" in rest else "unlink"
            elif name not in ("unlink", "rmdir"):
                continue
            if "file.mdtest." in m["path"] or name == "rmdir":
                calls.append((float(m["t"]), (name, m["path"])))
        if calls:
            out[int(f.name.rsplit(".", 1)[1])] = calls
    return out


def files_only(calls: list[tuple[float, Call]], base: str) -> list[Call]:
    """The calls on mdtest's files, paths from below ``base`` (the tool's data dir)."""
    return [(op, p.split(base, 1)[1]) for _, (op, p) in calls if "file.mdtest." in p]


def by_phase(calls: list[Call]) -> list[tuple[Call, ...]]:
    """A rank's calls cut into its phases (mdtest runs each in a process of its own):
    a phase is one kind of call on one tree."""
    out: list[list[Call]] = []
    for op, p in calls:
        if not out or (out[-1][-1][0], out[-1][-1][1].split("/")[0]) != (op, p.split("/")[0]):
            out.append([])
        out[-1].append((op, p))
    return [tuple(x) for x in out]


def mdtest_calls(rank: int, n: int) -> list[Call]:
    """What rank ``rank`` of ``n`` does in mdtest's stat, read and delete runs of IO500
    (mdtest.c, -N 1): stat_name, read_name and rm_name shift by 1, 2 and 3 ranks, and
    with -u (easy) the stat and remove directories by 2 and 4 (unique_stat_dir,
    unique_rm_dir); items in ascending order (no -R); mdtest_stat stat()s, mdtest_read
    opens read-write, remove_file unlinks, each nothing else."""

    def easy(op: str, d: int, who: int) -> list[Call]:
        return [
            (
                op,
                f"mdtest-easy/test-dir.0-0/mdtest_tree.{(rank + d) % n}.0/"
                f"file.mdtest.{(rank + who) % n}.{i}",
            )
            for i in range(EASY_F)
        ]

    def hard(op: str, who: int) -> list[Call]:
        return [
            (op, f"mdtest-hard/test-dir.0-0/mdtest_tree.0/file.mdtest.{(rank + who) % n}.{i}")
            for i in range(HARD_F)
        ]

    return (
        easy("stat", 2, 1)
        + hard("stat", 1)
        + easy("unlink", 4, 3)
        + hard("open-rdwr", 2)
        + hard("unlink", 3)
    )


def bench(
    root: Path, res: Path, n: int, phases: str, *pre: str, env: dict[str, str] | None = None
) -> None:
    argv = [
        *pre,
        sys.executable,
        "-P",
        "-m",
        "pfs.bench",
        "io500",
        "--path",
        str(root),
        "-n",
        str(n),
        "--stonewall",
        "0",
        "--easy-files",
        str(EASY_F),
        "--hard-files",
        str(HARD_F),
        "--mdtest-pause",
        "0",
        "--keep",
        "--timestamp",
        "t",
        "--results",
        str(res),
        "--phases",
        phases,
    ]
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {}))
    )
    assert r.returncode == 0, r.stdout + r.stderr


def started(prefix: Path) -> int:
    """The pid of the process strace started (pfs bench's rank 0; the others it spawns)."""
    for f in prefix.parent.glob(prefix.name + ".*"):
        if any(
            line.split("(", 1)[0].endswith("execve") and '"pfs.bench"' in line
            for line in f.read_text().splitlines()[:5]
        ):
            return int(f.name.rsplit(".", 1)[1])
    raise AssertionError("no trace of the process started")


def pfs_calls(
    tmp_path: Path, n: int, env: dict[str, str] | None = None
) -> tuple[int, dict[int, list[tuple[float, Call]]]]:
    """pfs bench's read, stat and delete phases on ``n`` ranks, traced: rank 0's pid and
    the calls by pid."""
    root, res, prefix = tmp_path / "root", tmp_path / "res", tmp_path / "pfs.trace"
    root.mkdir()
    bench(root, res, n, "mdtest-easy-write,mdtest-hard-write", env=env)
    bench(
        root,
        res,
        n,
        READERS,
        "strace",
        "-f",
        "-ff",
        "-qq",
        "-ttt",
        "-e",
        "trace=%file",
        "-o",
        str(prefix),
        env=env,
    )
    return started(prefix), traced(prefix)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("loops", ["c", "python"])
def test_md_phases_make_mdtests_calls(tmp_path: Path, n: int, loops: str) -> None:
    env = {io500_loops.ENV_OFF: "1"} if loops == "python" else {}
    if loops == "c" and io500_loops.load()[0] is None:
        pytest.skip("no C loops here")
    first, by_pid = pfs_calls(tmp_path, n, env)
    base = "/io500-t/"
    ranks = {pid: files_only(c, base) for pid, c in by_pid.items() if files_only(c, base)}
    assert len(ranks) == n
    want = [mdtest_calls(r, n) for r in range(n)]
    # rank 0's calls exactly; the others' as a whole (strace cannot tell them apart)
    assert ranks.pop(first) == want[0]
    assert sorted(ranks.values()) == sorted(want[1:])
    # the trees go after every rank's last unlink there (mdtest: after the closing barrier)
    for tree in ("mdtest-easy/test-dir.0-0", "mdtest-hard/test-dir.0-0"):
        last = max(
            t for c in by_pid.values() for t, (op, p) in c if op == "unlink" and f"/{tree}/" in p
        )
        gone = [
            t
            for c in by_pid.values()
            for t, (op, p) in c
            if op == "rmdir" and p.rstrip("/").endswith(tree)
        ]
        assert gone and min(gone) > last, tree


def _mdtest_binary() -> str | None:
    io500 = io500ref.find_reference(None)
    if io500 is None:
        return None
    top = Path(io500).parent
    for cand in (top / "bin" / "mdtest", top / "build" / "ior" / "src" / "mdtest"):
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def test_md_phases_as_the_real_mdtest(tmp_path: Path) -> None:
    """The same calls as the harness's own mdtest makes, run as IO500 runs it (the
    arguments of io500's phase_mdtest_easy.c and phase_mdtest_hard.c)."""
    mdtest = _mdtest_binary()
    if mdtest is None or shutil.which("mpirun") is None:
        pytest.skip(f"no built harness (${io500ref.ENV_REFERENCE}) or no mpirun")
    n = 2
    mpi = [*io500ref.mpirun_argv(n), mdtest]
    ref = tmp_path / "ref"
    ref.mkdir()
    common = ["--dataPacketType=timestamp", "-P", "-N", "1", "-F", "-a", "POSIX"]
    easy = [*common, "-n", str(EASY_F), "-u", "-L", "-G=1", "-d", f"{ref}/mdtest-easy"]
    hard = [
        *common,
        "-n",
        str(HARD_F),
        "-t",
        "-w",
        "3901",
        "-e",
        "3901",
        "-G=-1",
        "-d",
        f"{ref}/mdtest-hard",
    ]
    prefix = tmp_path / "ref.trace"
    strace = ["strace", "-f", "-ff", "-qq", "-ttt", "-e", "trace=%file", "-o", str(prefix)]
    for args, traced_run in (
        (easy + ["-C"], False),
        (hard + ["-C"], False),
        (easy + ["-T"], True),
        (hard + ["-T"], True),
        (easy + ["-r"], True),
        (hard + ["-E", "-X"], True),
        (hard + ["-r"], True),
    ):
        argv = [*(strace if traced_run else []), *mpi, *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
    theirs = Counter(
        seq for c in traced(prefix).values() for seq in by_phase(files_only(c, f"{ref}/"))
    )
    ours = Counter(
        seq
        for c in pfs_calls(tmp_path, n)[1].values()
        for seq in by_phase(files_only(c, "/io500-t/"))
    )
    assert theirs and ours == theirs

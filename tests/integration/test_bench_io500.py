"""``pfs bench io500``: what each phase creates, reads and deletes (on a local directory,
a pfs mount and the native client), the score arithmetic, the output layout, invalid-run
detection, and a two-rank MPI run. Nothing here judges speed."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pfs.bench import io500
from pfs.bench import main as bench_main
from pfs.bench.io500 import HARD_FILE_SIZE, HARD_TRANSFER, Io500Config, Target

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function Popen.__del__:pytest.PytestUnraisableExceptionWarning")

T = 64 << 10  # ior-easy transfer in these tests
EASY_T, HARD_S, EASY_F, HARD_F = 3, 5, 7, 110  # caps per rank


# -- score arithmetic ------------------------------------------------------------
def test_score_by_hand() -> None:
    bw = {"ior-easy-write": 2.0, "ior-hard-write": 0.5, "ior-easy-read": 8.0,
          "ior-hard-read": 2.0}  # product 16 -> 16^(1/4) = 2
    md = {p: 1.0 for p in io500.SCORED if io500.GROUP[p] == "md"}
    md["find"] = 16.0
    md["mdtest-easy-write"] = 16.0  # product 256 over 8 phases -> 256^(1/8) = 2
    s = io500.score({**bw, **md})
    assert s["bw"] == pytest.approx(2.0)
    assert s["md"] == pytest.approx(2.0)
    assert s["total"] == pytest.approx(2.0)  # sqrt(2 * 2)
    # IO500 leaves phases scoring 0 out of the geometric mean
    s = io500.score({**bw, "ior-hard-write": 0.0, **md})
    assert s["bw"] == pytest.approx(32 ** (1 / 3))  # (2 * 8 * 2)^(1/3)
    assert s["total"] == pytest.approx(math.sqrt(32 ** (1 / 3) * 2.0))
    assert io500.score({})["total"] == 0.0
    # a full set of 4 bw and 8 md phases
    vals = {"ior-easy-write": 0.532118, "ior-hard-write": 0.011389, "ior-easy-read": 0.711097,
            "ior-hard-read": 0.031917, "mdtest-easy-write": 3.185340,
            "mdtest-hard-write": 1.559427, "find": 83.372168, "mdtest-easy-stat": 29.380580,
            "mdtest-hard-stat": 20.022424, "mdtest-easy-delete": 4.028329,
            "mdtest-hard-read": 5.047478, "mdtest-hard-delete": 2.640566}
    s = io500.score(vals)
    bw_hand = (0.532118 * 0.011389 * 0.711097 * 0.031917) ** 0.25
    md_hand = (3.185340 * 1.559427 * 83.372168 * 29.380580 * 20.022424 * 4.028329 * 5.047478
               * 2.640566) ** 0.125
    assert s["bw"] == pytest.approx(bw_hand) and s["bw"] == pytest.approx(0.1082957, abs=1e-7)
    assert s["md"] == pytest.approx(md_hand)
    assert s["total"] == pytest.approx(math.sqrt(bw_hand * md_hand))


def test_line_layout() -> None:
    # byte for byte as io500 prints them
    assert io500.result_line("ior-easy-write", 0.764612, 34.035, True) == \
        "[RESULT]       ior-easy-write        0.764612 GiB/s : time 34.035 seconds"
    assert io500.result_line("find", 83.372168, 1.739, False) == \
        "[RESULT]                 find       83.372168 kIOPS : time 1.739 seconds [INVALID]"
    assert io500.result_line("timestamp", 0.0, 0.0, True) == \
        "[      ]            timestamp        0.000000 kIOPS : time 0.000 seconds"
    assert io500.score_line({"bw": 0.114627, "md": 9.17971, "total": 1.025786}, True) == \
        "[SCORE ] Bandwidth 0.114627 GiB/s : IOPS 9.179710 kiops : TOTAL 1.025786"
    assert io500.score_line({"bw": 1, "md": 1, "total": 1}, False).endswith(" [INVALID]")


def test_expected_found() -> None:
    # -name *01*: of file.mdtest.R.0 .. file.mdtest.R.109 only i = 101 matches
    assert io500.expected_found([110, 110]) == 2
    assert io500.expected_found([100]) == 0
    assert io500.expected_found([1010]) == sum("01" in str(i) for i in range(1010))


# -- what each phase does to the filesystem ----------------------------------------
class View:
    """Listing and sizes on the target, through the OS or the pfs client."""

    def __init__(self, root: str, client: Any = None) -> None:
        self.root, self.client = root, client

    def ls(self, rel: str) -> dict[str, int | None]:
        """name -> size (None for a directory); {} if ``rel`` does not exist."""
        p = f"{self.root}/{rel}".rstrip("/")
        if self.client is not None:
            if not self.client.exists(p):
                return {}
            return {e.name: None if e.is_dir() else self.client.stat(e.path).st_size
                    for e in self.client.scandir(p)}
        if not os.path.exists(p):
            return {}
        out: dict[str, int | None] = {}
        for e in os.scandir(p):
            out[e.name] = None if e.is_dir() else e.stat().st_size
        return out

    def tree(self, rel: str) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for name, size in self.ls(rel).items():
            out[f"{rel}/{name}"] = size
            if size is None:
                out.update(self.tree(f"{rel}/{name}"))
        return out


def cfg(**kw: Any) -> Io500Config:
    base: dict[str, Any] = dict(stonewall=0.0, easy_size=EASY_T * T, easy_transfer=T, hard_segments=HARD_S,
                easy_files=EASY_F, hard_files=HARD_F, verify=True, timestamp="t", seed=12345,
                md_pause=0.0)
    base.update(kw)
    return Io500Config(**base)


EASY = "test-dir.0-0"  # mdtest's layout: mdtest-easy/test-dir.0-0/mdtest_tree.R.0/...
HARD = "test-dir.0-0/mdtest_tree.0"  # and mdtest-hard/test-dir.0-0/mdtest_tree.0/...


def check_phases(view: View, target: Target, n: int) -> dict[str, Any]:
    """Run all phases on ``n`` ranks; after each, compare the whole tree with what that
    phase must have created, read or deleted."""
    data = "io500-t"
    easy = {f"ior_file_easy.{r:08d}": EASY_T * T for r in range(n)}
    # mdtest -u: rank r's files are in the directory mdtest names after rank r+1
    md_easy = {f"{EASY}/mdtest_tree.{(r + 1) % n}.0/file.mdtest.{r}.{i}": 0
               for r in range(n) for i in range(EASY_F)}
    md_hard = {f"{HARD}/file.mdtest.{r}.{i}": HARD_FILE_SIZE for r in range(n) for i in range(HARD_F)}
    state: dict[str, int | None] = {}

    def put(rel: str, files: dict[str, int]) -> None:
        for name, size in files.items():
            parts = name.split("/")
            for k in range(1, len(parts)):
                state[f"{data}/{rel}/{'/'.join(parts[:k])}"] = None
            state[f"{data}/{rel}/{name}"] = size

    def drop(rel: str) -> None:  # the delete phase and mdtest's tree removal after it
        for key in [k for k in state if k.startswith(f"{data}/{rel}/")]:
            state.pop(key)

    for sub in ("ior-easy", "ior-hard", "mdtest-easy", "mdtest-hard"):
        state[f"{data}/{sub}"] = None
    seen: list[str] = []

    def hook(rec: dict[str, Any]) -> None:
        name = rec["name"]
        seen.append(name)
        want_bytes = {"ior-easy-write": n * EASY_T * T, "ior-easy-read": n * EASY_T * T,
                      "ior-hard-write": n * HARD_S * HARD_TRANSFER,
                      "ior-hard-read": n * HARD_S * HARD_TRANSFER,
                      "mdtest-hard-write": n * HARD_F * HARD_FILE_SIZE,
                      "mdtest-hard-read": n * HARD_F * HARD_FILE_SIZE}.get(name, 0)
        want_items = {"ior-easy-write": n * EASY_T, "ior-easy-read": n * EASY_T,
                      "ior-hard-write": n * HARD_S, "ior-hard-read": n * HARD_S,
                      "mdtest-easy-write": n * EASY_F, "mdtest-easy-stat": n * EASY_F,
                      "mdtest-easy-delete": n * EASY_F, "mdtest-hard-write": n * HARD_F,
                      "mdtest-hard-stat": n * HARD_F, "mdtest-hard-read": n * HARD_F,
                      "mdtest-hard-delete": n * HARD_F}
        if name == "ior-easy-write":
            put("ior-easy", easy)
        elif name == "mdtest-easy-write":
            put("mdtest-easy", md_easy)
        elif name == "ior-hard-write":
            state[f"{data}/ior-hard/file"] = n * HARD_S * HARD_TRANSFER
        elif name == "mdtest-hard-write":
            put("mdtest-hard", md_hard)
        elif name == "find":
            # pfind's count: every entry that is not a directory; the *01* 3901-byte
            # files newer than the timestamp found (i = 101 of each rank)
            assert rec["items"] == sum(1 for v in state.values() if v is not None), rec
            assert rec["found"] == n
        elif name == "mdtest-easy-delete":
            drop("mdtest-easy")
        elif name == "mdtest-hard-delete":
            drop("mdtest-hard")
        assert rec["bytes"] == want_bytes, rec
        if name in want_items:
            assert rec["items"] == want_items[name], rec
            assert rec["items_per_rank"] == [want_items[name] // n] * n
        assert rec["verify_errors"] == 0
        got = view.tree(data)
        assert got == state, name

    res = io500.run_local(cfg(), target, n, hook)
    assert seen == [p for p, _, _ in io500.PHASES]
    assert view.ls("") == {} or "io500-t" not in view.ls("")  # cleaned up
    return res


def test_phases_local(tmp_path: Path) -> None:
    root = tmp_path / "local"
    root.mkdir()
    res = check_phases(View(str(root)), Target("posix", str(root)), 2)
    assert list(root.iterdir()) == []
    assert res["nprocs"] == 2 and len(res["phases"]) == 13
    assert res["phases"][5]["found"] == 2


def test_phases_native(client_toml: Path, client: Any) -> None:
    root = f"/io500-test-{os.getpid()}"
    client.makedirs(root)
    check_phases(View(root, client), Target("pfs", root, str(client_toml)), 2)
    assert client.listdir(root) == []


def test_phases_mount(client_toml: Path) -> None:
    from tests.fuse_fixtures import mounted

    with mounted(client_toml) as mnt:
        root = mnt / f"io500-mount-test-{os.getpid()}"
        root.mkdir()
        check_phases(View(str(root)), Target("posix", str(root)), 2)
        assert list(root.iterdir()) == []
        root.rmdir()


# -- stonewall and invalid runs ---------------------------------------------------
def test_stonewall_wear_out(tmp_path: Path) -> None:
    """A stonewall that ends the writes long before the caps: every rank ends with as
    many items as the rank that did most, and the reads, stats and deletes find exactly
    what was written."""
    big = 10 ** 9
    c = cfg(stonewall=0.05, easy_size=big * T, hard_segments=big, easy_files=big,
            hard_files=big)
    res = io500.run_local(c, Target("posix", str(tmp_path)), 2)
    ph = {p["name"]: p for p in res["phases"]}
    for w, readers in (("ior-easy-write", ["ior-easy-read"]), ("ior-hard-write", ["ior-hard-read"]),
                       ("mdtest-easy-write", ["mdtest-easy-stat", "mdtest-easy-delete"]),
                       ("mdtest-hard-write", ["mdtest-hard-stat", "mdtest-hard-read",
                                              "mdtest-hard-delete"])):
        p = ph[w]
        assert p["stonewall_hit"] is True
        per = p["items_per_rank"]
        assert per[0] == per[1] > 0  # wear-out: both ranks did the same
        assert max(p["at_stonewall_per_rank"]) == per[0]
        assert not any("below the stonewall" in why for why in p["invalid"]), p["invalid"]
        for r in readers:
            assert ph[r]["items"] == p["items"], r
            assert ph[r]["verify_errors"] == 0
    assert ph["ior-easy-read"]["bytes"] == ph["ior-easy-write"]["bytes"]
    assert ph["ior-hard-read"]["bytes"] == ph["ior-hard-write"]["bytes"]
    assert ph["find"]["found"] == io500.expected_found(ph["mdtest-hard-write"]["items_per_rank"])
    assert list(tmp_path.iterdir()) == []
    # short phases: invalid by the 300 s minimum, as any short IO500 run
    assert res["valid"] is False
    assert all("minimum 300 s" in " ".join(ph[w]["invalid"]) for w in io500.STONEWALLED)


def test_invalid_caps_before_stonewall(tmp_path: Path) -> None:
    res = io500.run_local(cfg(stonewall=3600.0), Target("posix", str(tmp_path)), 1)
    ph = {p["name"]: p for p in res["phases"]}
    for w in io500.STONEWALLED:
        assert any("below the stonewall 3600 s" in why for why in ph[w]["invalid"]), ph[w]
        assert ph[w]["valid"] is False
    for r in ("ior-easy-read", "mdtest-hard-stat", "find"):
        assert ph[r]["valid"] is True, ph[r]
    assert res["valid"] is False
    assert any(r.startswith("ior-easy-write: runtime") for r in res["invalid"])
    assert io500.summary_lines(res)[-1].endswith("[INVALID]")


def _corrupt(path: str, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("victim", ["ior-easy", "ior-hard", "mdtest-hard"])
def test_invalid_when_verify_fails(tmp_path: Path, victim: str) -> None:
    data = tmp_path / "io500-t"
    spots: dict[str, Callable[[], None]] = {
        "ior-easy": lambda: _corrupt(str(data / "ior-easy" / "ior_file_easy.00000000"), T + 100),
        "ior-hard": lambda: _corrupt(str(data / "ior-hard" / "file"), 3 * HARD_TRANSFER + 7),
        "mdtest-hard": lambda: _corrupt(str(data / "mdtest-hard" / HARD / "file.mdtest.0.5"),
                                        3000),
    }
    after = {"ior-easy": "ior-easy-write", "ior-hard": "ior-hard-write",
             "mdtest-hard": "mdtest-hard-write"}[victim]

    def hook(rec: dict[str, Any]) -> None:
        if rec["name"] == after:
            spots[victim]()

    res = io500.run_local(cfg(), Target("posix", str(tmp_path)), 1, hook)
    bad = [p for p in res["phases"] if p["verify_errors"]]
    assert [p["name"] for p in bad] == [{"ior-easy": "ior-easy-read", "ior-hard": "ior-hard-read",
                                         "mdtest-hard": "mdtest-hard-read"}[victim]]
    assert bad[0]["verify_errors"] == 1 and bad[0]["valid"] is False
    assert any("1 items failed verification" in r for r in res["invalid"])
    # without --verify the same damage goes unseen (the read phase itself stays valid)
    res = io500.run_local(cfg(verify=False), Target("posix", str(tmp_path)), 1, hook)
    assert not any(p["verify_errors"] for p in res["phases"])


def test_invalid_when_phases_missing(tmp_path: Path) -> None:
    res = io500.run_local(cfg(phases=["ior-easy-write", "ior-easy-read"], keep=True),
                          Target("posix", str(tmp_path)), 1)
    assert [p["name"] for p in res["phases"]] == ["ior-easy-write", "ior-easy-read"]
    assert any(r.startswith("phases not run: mdtest-easy-write") for r in res["invalid"])
    # the stonewall state lets a later run (same --timestamp) read what this one wrote
    res = io500.run_local(cfg(phases=["ior-easy-read"]), Target("posix", str(tmp_path)), 1)
    assert res["phases"][0]["bytes"] == EASY_T * T and res["phases"][0]["verify_errors"] == 0


# -- the command ---------------------------------------------------------------------
LINE = re.compile(r"^\[(RESULT|      )\] +([a-z0-9-]+) +(\d+\.\d{6}) (GiB/s|kIOPS) : "
                  r"time (\d+\.\d{3}) seconds( \[INVALID\])?$")


def test_cli_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "t"
    target.mkdir()
    out = tmp_path / "r.json"
    rc = bench_main(["io500", "--quick", "--stonewall", "0.2", "--path", str(target), "-n", "2",
                     "--results", str(tmp_path / "res"), "--json", str(out), "--verify",
                     "--mdtest-pause", "0"])
    assert rc == 0
    out_lines = capsys.readouterr().out.splitlines()
    # what the run does unlike the harness is said, on lines of its own
    assert any("mdtest sleeps 1 s" in ln for ln in out_lines if ln.startswith("[NOTE  ]"))
    lines = [ln for ln in out_lines if not ln.startswith("[NOTE  ]")]
    assert lines[0] == f"IO500 version {io500.VERSION} (standard)"
    got = [LINE.match(ln) for ln in lines[1:14]]
    assert all(got), lines
    assert [m.group(2) for m in got if m] == [p for p, _, _ in io500.PHASES]
    assert [m.group(1) for m in got if m].count("      ") == 1  # the timestamp line
    assert lines[14].startswith("[SCORE ] Bandwidth ")
    assert lines[14].endswith("[INVALID]")  # --quick is below IO500's 300 s
    res = json.loads(out.read_text())
    assert res["nprocs"] == 2 and res["mpi"] is False and res["valid"] is False
    assert res["config"]["quick"] is True and res["config"]["stonewall"] == 0.2
    for p in res["phases"]:
        if io500.GROUP[p["name"]]:
            assert p["score"] > 0 and p["time"] > 0, p
    s = io500.score({p["name"]: p["score"] for p in res["phases"]})
    assert res["score"]["total"] == pytest.approx(s["total"])
    summary = (tmp_path / "res" / "result_summary.txt").read_text().splitlines()
    assert summary == lines[:15]
    ini = (tmp_path / "res" / "result.txt").read_text()
    assert "[ior-easy-write]" in ini and "[SCORE]" in ini and "t_delta" in ini
    assert json.loads((tmp_path / "res" / "result.json").read_text()) == res
    assert list(target.iterdir()) == []


def test_side_files_in_the_results_directory(tmp_path: Path) -> None:
    """io500 keeps its timestamp file and stonewall counts in its results directory, on
    local disk: nothing but the data directory is made on the target, and a later run of
    a read phase finds the counts there."""
    target, res = tmp_path / "t", tmp_path / "res"
    target.mkdir()
    common = ["--path", str(target), "-n", "2", "--stonewall", "0", "--easy-size", "4m",
              "--hard-segments", "20", "--easy-files", "20", "--hard-files", "20",
              "--mdtest-pause", "0", "--timestamp", "side", "--results", str(res), "--keep"]
    assert bench_main(["io500", *common, "--phases",
                       "ior-easy-write,mdtest-easy-write,timestamp"]) == 0
    assert [p.name for p in target.iterdir()] == ["io500-side"]
    assert (res / "io500-side.timestampfile").is_file()
    state = json.loads((res / "io500-side.state.json").read_text())
    assert state["counts"]["ior-easy-write"] == [2, 2]
    assert bench_main(["io500", *common, "--phases", "ior-easy-read"]) == 0
    got = json.loads((res / "result.json").read_text())["phases"]
    assert [(p["name"], p["bytes"], p["verify_errors"]) for p in got] == \
        [("ior-easy-read", 2 * 4 * 2**20, 0)]


def test_cli_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        bench_main(["io500", "--quick"])  # no target
    with pytest.raises(SystemExit):
        bench_main(["io500", "--path", str(tmp_path), "--phases", "ior-medium-write"])


def _mpi_missing() -> str | None:
    if not shutil.which("mpirun"):
        return "mpirun not installed (apt-get install openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed (pip install 'pfs[mpi]')"
    return None


def test_mpi_two_ranks(tmp_path: Path) -> None:
    if (why := _mpi_missing()) is not None:
        if os.environ.get("PFS_REQUIRE_MPI"):  # deploy/test.sh: setup.sh installed MPI
            pytest.fail(f"PFS_REQUIRE_MPI is set but {why}")
        pytest.skip(why)
    target = tmp_path / "t"
    target.mkdir()
    out = tmp_path / "r.json"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    argv = ["mpirun", "-np", "2"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    argv += ["--oversubscribe", sys.executable, "-m", "pfs.tools.cli", "bench", "io500",
             "--path", str(target), "--stonewall", "0", "--easy-size", "4M",
             "--hard-segments", "4", "--easy-files", "6", "--hard-files", "110", "--verify",
             "--mdtest-pause", "0",
             "--timestamp", "mpi", "--results", str(tmp_path / "res"), "--json", str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr + r.stdout
    res = json.loads(out.read_text())
    assert res["mpi"] is True and res["nprocs"] == 2
    ph = {p["name"]: p for p in res["phases"]}
    assert ph["ior-easy-write"]["items_per_rank"] == [2, 2]  # 4 MiB in 2 MiB transfers
    assert ph["ior-hard-read"]["bytes"] == 2 * 4 * HARD_TRANSFER
    assert ph["mdtest-easy-delete"]["items_per_rank"] == [6, 6]
    assert ph["mdtest-hard-read"]["bytes"] == 2 * 110 * HARD_FILE_SIZE
    assert ph["find"]["found"] == 2
    assert all(p["verify_errors"] == 0 for p in res["phases"])
    assert r.stdout.count("[RESULT]") == 12  # rank 0 alone prints
    assert list(target.iterdir()) == []


class _Recording(io500.PosixStore):
    """A POSIX store that records the file operations of the ior phases."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.ops: list[tuple[str, str]] = []
        self._paths: dict[int, str] = {}

    def open(self, p: str, create: bool, write: bool) -> int:
        h = super().open(p, create, write)
        self._paths[h] = p
        self.ops.append(("open", p))
        return h

    def close_file(self, h: int) -> None:
        self.ops.append(("close", self._paths.pop(h)))
        super().close_file(h)

    def stat(self, p: str) -> tuple[int, int]:
        self.ops.append(("stat", p))
        return super().stat(p)


def test_ior_phases_stat_their_file_after_close(tmp_path: Path) -> None:
    """IOR's CheckFileSize: after the timed close each rank stat()s the file it wrote or
    read, untimed (on a FUSE mount the first attributes after the writes cost a round
    trip to the servers; without it a later phase, find, paid for them)."""
    store = _Recording(str(tmp_path))
    rk = io500.Rank(io500.SelfComm(), cfg(stonewall=0, easy_size=4 << 20, hard_segments=4),
                    store)
    rk.setup()
    for phase in ("ior-easy-write", "ior-hard-write", "ior-easy-read", "ior-hard-read"):
        store.ops.clear()
        rec = rk.run_phase(phase)
        assert rec["verify_errors"] == 0
        path = store.ops[0][1]
        assert store.ops == [("open", path), ("close", path), ("stat", path)], phase


def test_mdtest_sync_runs_the_sync_command_through_a_shell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mdtest -Y calls IOR's POSIX_Sync, system("sync"): a shell and the sync command,
    inside the phase's time, not the bare system call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ran = tmp_path / "ran"
    fake = bin_dir / "sync"
    fake.write_text(f"#!/bin/sh\necho $$ >> {ran}\nexit ${{FAKE_SYNC_RC:-0}}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    store = io500.PosixStore(str(tmp_path))
    store.sync()
    assert len(ran.read_text().split()) == 1
    monkeypatch.setenv("FAKE_SYNC_RC", "1")
    with pytest.raises(OSError, match="sync command failed"):
        store.sync()

"""``pfs bench io500``'s phase parameters (the ranks each phase works on, as IOR -C and
mdtest -N 1 shift them) and the reference harness's config and output, read from a
captured run of the real harness (tests/unit/io500_reference_output.txt). No harness, no
processes."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from pfs.bench import io500, io500ref
from pfs.bench.io500 import easy_tree, ior_read_shift, md_owner

SAMPLE = Path(__file__).with_name("io500_reference_output.txt")


def test_mdtest_rank_shifts() -> None:
    # mdtest.c with -N 1: stat rank+1, read rank+2, remove rank+3 (modulo the ranks)
    assert [md_owner(r, 4, "stat") for r in range(4)] == [1, 2, 3, 0]
    assert [md_owner(r, 4, "read") for r in range(4)] == [2, 3, 0, 1]
    assert [md_owner(r, 4, "delete") for r in range(4)] == [3, 0, 1, 2]
    # two ranks: the hard read lands on the rank's own files, stat and delete on the other's
    assert [md_owner(r, 2, "read") for r in range(2)] == [0, 1]
    assert [md_owner(r, 2, "delete") for r in range(2)] == [1, 0]
    assert md_owner(0, 1, "stat") == 0


def test_mdtest_easy_layout() -> None:
    # with -u, rank r's files sit in the directory mdtest names after rank r+1
    assert easy_tree(0, 2) == "mdtest-easy/test-dir.0-0/mdtest_tree.1.0"
    assert easy_tree(1, 2) == "mdtest-easy/test-dir.0-0/mdtest_tree.0.0"
    assert easy_tree(0, 1) == "mdtest-easy/test-dir.0-0/mdtest_tree.0.0"
    assert io500.HARD_DIR == "mdtest-hard/test-dir.0-0/mdtest_tree.0"


def test_ior_read_shift() -> None:
    # IOR -C -Q 1: one node -> no shift (each rank reads what it wrote)
    assert ior_read_shift(["a"] * 4) == 0
    assert ior_read_shift(["a"]) == 0
    # block mapping (rank 1 beside rank 0): shift by the tasks on node 0
    assert ior_read_shift(["a", "a", "b", "b"]) == 2
    assert ior_read_shift(["a", "a", "a", "b", "b", "b"]) == 3
    # round robin over nodes: shift by one
    assert ior_read_shift(["a", "b", "a", "b"]) == 1


def test_expected_found_uses_mdtest_names() -> None:
    assert io500.expected_found([110, 110]) == 2
    assert io500.expected_found([2000]) == sum("01" in str(i) for i in range(2000))


def test_parse_reference_sample() -> None:
    got = io500ref.parse_output(SAMPLE.read_text())
    assert list(got.phases)[:13] == [p for p, _, _ in io500.PHASES]
    assert got.phases["ior-easy-write"] == (0.261260, 1.924, False)
    assert got.phases["find"] == (2900.763722, 0.002, True)
    assert got.phases["mdtest-hard-delete"] == (0.333990, 7.243, True)
    assert got.phases["ior-rnd4K-easy-read"][2] is False
    assert (got.bw, got.md, got.total, got.valid) == (0.507765, 40.999070, 4.562665, False)
    assert set(io500ref.SCORED) <= set(got.phases)


def test_parse_own_output_round_trip() -> None:
    phases = [{"name": n, "score": 1.5, "time": 2.25, "valid": n != "find", "invalid": []}
              for n, _, _ in io500.PHASES]
    res = {"version": io500.VERSION, "mode": "standard", "phases": phases,
           "score": {"bw": 1.5, "md": 1.5, "total": 1.5}, "valid": False}
    got = io500ref.parse_output("\n".join(io500.summary_lines(res)))
    assert got.phases["find"] == (1.5, 2.25, False)
    assert got.phases["ior-hard-read"] == (1.5, 2.25, True)
    assert got.total == 1.5 and got.valid is False


def test_reference_ini_and_argv() -> None:
    p = io500ref.RefParams(procs=2, stonewall=2, easy_size=256 << 20, hard_segments=10000,
                           easy_files=5000, hard_files=2000, datadir="/mnt/x/ref",
                           resultdir="/tmp/r")
    ini = io500ref.reference_ini(p)
    for line in ("datadir = /mnt/x/ref", "resultdir = /tmp/r", "stonewall-time = 2",
                 "transferSize = 2m", f"blockSize = {256 << 20}", "segmentCount = 10000",
                 "[mdtest-easy]\nn = 5000", "[mdtest-hard]\nn = 2000",
                 "[ior-rnd4K-easy-read]\nrun = FALSE"):
        assert line in ini, line
    argv = io500ref.bench_argv(p, "/mnt/x")
    assert argv == ["--path", "/mnt/x", "-n", "2", "--stonewall", "2", "--easy-size",
                    str(256 << 20), "--hard-segments", "10000", "--easy-files", "5000",
                    "--hard-files", "2000"]


def test_reference_runs_where_its_config_lies(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative results directory (the default, ./io500-results/...) still gives the
    harness a config path that exists from the directory it runs in; its output is read
    as it comes, with its ranks' CPU time at each result line."""
    sample = Path(__file__).with_name("io500_reference_output.txt")
    fake = tmp_path / "fake-mpirun"
    # as mpirun: "-np N BINARY INI"; the "rank" (a child) checks the config and prints
    fake.write_text(f'#!/bin/sh\nsh -c \'test -f "$4" || exit 3; cat "{sample}"\' '
                    f'x "$@"\n')
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(io500ref.ENV_MPIRUN, str(fake))
    p = io500ref.RefParams(procs=2, stonewall=2, easy_size=1 << 20, hard_segments=10,
                           easy_files=10, hard_files=10, datadir=str(tmp_path / "data"),
                           resultdir=str(tmp_path / "r"))
    got, text = io500ref.run_reference("/bin/true", p,
                                       Path("io500-results") / "compare-x" / "harness-0")
    assert got.phases == io500ref.parse_output(sample.read_text()).phases
    assert set(got.cpu) == set(got.phases) and all(v >= 0 for v in got.cpu.values())


def test_mpirun_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(io500ref.ENV_MPIRUN, raising=False)
    argv = io500ref.mpirun_argv(3)
    assert argv[0] == "mpirun" and argv[-2:] == ["-np", "3"]
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    monkeypatch.setenv(io500ref.ENV_MPIRUN, "srun --mpi=pmix")
    assert io500ref.mpirun_argv(2) == ["srun", "--mpi=pmix", "-np", "2"]


def test_find_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(io500ref.ENV_REFERENCE, raising=False)
    assert io500ref.find_reference(None) is None
    exe = tmp_path / "io500"
    exe.write_text("#!/bin/sh\n")
    assert io500ref.find_reference(str(exe)) is None  # not executable
    exe.chmod(0o755)
    assert io500ref.find_reference(str(exe)) == str(exe)
    monkeypatch.setenv(io500ref.ENV_REFERENCE, str(exe))
    assert io500ref.find_reference(None) == str(exe)


def test_medians_and_table() -> None:
    def run(v: float) -> io500ref.Parsed:
        return io500ref.Parsed(phases={n: (v, 1.0, True) for n in io500ref.SCORED},
                               bw=v, md=v, total=v, valid=True)

    ref = io500ref.medians([run(1.0), run(3.0), run(2.0)])
    ours = io500ref.medians([run(2.3), run(2.2), run(9.0)])
    assert ref["find"] == 2.0 and ours["find"] == 2.3
    rng = io500ref.spread([run(1.0), run(3.0), run(2.0)])
    assert rng["find"] == (1.0, 3.0)
    table = io500ref.compare_table(ref, ours, 3, 3, rng)
    assert table[0].startswith("phase") and "medians of 3 / 3 runs" in table[0]
    row = next(ln for ln in table if ln.startswith("find "))
    assert row.split()[2:6] == ["2.0000", "2.3000", "1.15", "1.0000-3.0000"]
    assert "over 20%" not in row
    ours["find"] = 2.5
    row = next(ln for ln in io500ref.compare_table(ref, ours, 3, 3) if ln.startswith("find "))
    assert row.endswith("<-- over 20%")


def test_paired_ratios_and_agreement() -> None:
    def run(scale: dict[str, float], total: float) -> io500ref.Parsed:
        return io500ref.Parsed(phases={n: (scale.get(n, 1.0), 1.0, True)
                                       for n in io500ref.SCORED},
                               bw=total, md=total, total=total, valid=True)

    # the load drifts: run k of both tools moves together, so each pair agrees while
    # the medians of the two tools, taken apart, need not
    refs = [run({"find": 1.0}, 1.0), run({"find": 4.0}, 2.0), run({"find": 2.0}, 4.0)]
    ours = [run({"find": 1.1}, 1.0), run({"find": 4.4}, 2.0), run({"find": 0.5}, 3.0)]
    pairs = io500ref.paired_ratios(refs, ours)
    assert pairs["find"] == pytest.approx([1.1, 1.1, 0.25])
    assert pairs["score-total"] == pytest.approx([1.0, 1.0, 0.75])
    assert io500ref.quartiles(pairs["find"]) == pytest.approx((0.675, 1.1, 1.1))
    assert io500ref.quartiles([2.0]) == (2.0, 2.0, 2.0)
    # a pair whose harness run lacks the phase or scored 0 is left out
    refs[0].phases["find"] = (0.0, 1.0, False)
    del ours[1].phases["find"]
    assert io500ref.paired_ratios(refs, ours)["find"] == pytest.approx([0.25])

    ref = io500ref.medians(refs[1:])
    mine = io500ref.medians(ours[1:])
    lines = io500ref.agreement({**ref, "find": 3.0}, {**mine, "find": 1.0},
                               {**pairs, "find": [1.1, 1.1, 0.25]})
    assert lines[0] == "within 20% (ratio of medians): 11 of 12 phases; off: find 0.33"
    assert lines[1] == "within 20% (median of paired ratios): 12 of 12 phases"
    assert io500ref.within(1.2) and io500ref.within(0.8) and not io500ref.within(1.21)
    assert not io500ref.within(float("nan"))

    table = io500ref.compare_table(ref, mine, 2, 2, None, pairs)
    assert "paired" in table[0] and "(interquartile)" in table[0]
    row = next(ln for ln in table if ln.startswith("score-total"))
    assert row.split()[-2:] == ["1.00", "(0.88-1.00)"]
    assert table[-2].startswith("within 20% (ratio of medians): ")
    assert table[-1].startswith("within 20% (median of paired ratios): ")


def test_phase_time_is_each_tools_own() -> None:
    # rank 0 opens at 10.0 and closes at 12.0; rank 1 opens at 10.5 and closes at 12.5;
    # each reached the barrier after the phase 0.25 s after its end
    starts, ends, spans = [10.0, 10.5], [12.0, 12.5], [2.75, 2.25]
    # IOR: the last close less the first open, no closing barrier
    assert io500.phase_time("ior-easy-read", starts, ends, spans) == 2.5
    # pfind: the slowest rank's own walk
    assert io500.phase_time("find", starts, ends, spans) == 2.0
    # mdtest: the slowest rank's time to after the closing barrier
    assert io500.phase_time("mdtest-hard-stat", starts, ends, spans) == 2.75


def test_ranks_bound_as_mpirun_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    from pfs.bench import io500_comm

    monkeypatch.setattr(io500_comm, "core_cpus", lambda: [{0, 4}, {1, 5}, {2, 6}, {3, 7}])
    # Open MPI: a core each with at most 2 ranks, else (a socket) unbound
    assert io500_comm.rank_cpus(2, "auto") == [{0, 4}, {1, 5}]
    assert io500_comm.rank_cpus(1, "auto") == [{0, 4}]
    assert io500_comm.rank_cpus(3, "auto") is None
    assert io500_comm.rank_cpus(3, "core") == [{0, 4}, {1, 5}, {2, 6}]
    assert io500_comm.rank_cpus(5, "core") is None  # more ranks than cores
    assert io500_comm.rank_cpus(2, "none") is None


def test_core_cpus_cover_the_allowed_cpus() -> None:
    from pfs.bench import io500_comm

    cores = io500_comm.core_cpus()
    assert sorted(c for core in cores for c in core) == sorted(os.sched_getaffinity(0))
    assert [min(c) for c in cores] == sorted(min(c) for c in cores)


def test_pooled_table_of_saved_compare_results(tmp_path: Path) -> None:
    from dataclasses import asdict

    def run(v: float) -> io500ref.Parsed:
        return io500ref.Parsed(phases={n: (v, 1.0, True) for n in io500ref.SCORED},
                               bw=v, md=v, total=v, valid=True)

    sets = {"a": ([run(1.0), run(2.0)], [run(1.1), run(2.2)]),
            "b": ([run(4.0)], [run(2.0)])}
    for name, (refs, ours) in sets.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "compare.json").write_text(json.dumps(
            {"harness": [asdict(r) for r in refs], "pfs": [asdict(r) for r in ours]}))
    refs, ours = io500ref.load_compare(tmp_path / "a")
    assert refs == sets["a"][0] and ours == sets["a"][1]
    table = io500ref.pooled_table([tmp_path / "a", tmp_path / "b" / "compare.json"])
    assert "medians of 3 / 3 runs" in table[0]
    row = next(ln for ln in table if ln.startswith("find "))
    # medians 2.0 / 2.0; pairs 1.1, 1.1 (set a) and 0.5 (set b): median 1.1
    assert row.split()[2:5] == ["2.0000", "2.0000", "1.00"]
    assert row.split()[6] == "1.10"
    assert table[-1] == "within 20% (median of paired ratios): 12 of 12 phases"


def test_settle_reports_the_conditions_and_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    """--compare's settle before each run: "none" only reads the conditions, "sync"
    syncs and waits until dirty + writeback is below the threshold."""
    synced: list[int] = []
    dirty = iter([64 << 20, 64 << 20, 1 << 20])  # before, still writing back, settled
    monkeypatch.setattr(io500ref.os, "sync", lambda: synced.append(1))
    monkeypatch.setattr(io500ref, "meminfo_bytes",
                        lambda *k: {"Dirty": next(dirty), "Writeback": 0})
    monkeypatch.setattr(io500ref.time, "sleep", lambda s: None)
    got = io500ref.settle("sync")
    assert synced == [1] and got["dirty_mb"] == 64.0 and got["sync_s"] >= 0.0
    assert got["load1"] == got["load1"]  # a number (this machine has /proc/loadavg)
    dirty = iter([8 << 20])
    assert io500ref.settle("none")["sync_s"] == 0.0 and synced == [1]


def test_cpu_table() -> None:
    def run(cpu: float) -> io500ref.Parsed:
        return io500ref.Parsed(phases={"find": (1.0, 1.0, True)}, cpu={"find": cpu})

    lines = io500ref.cpu_table([run(1.0), run(2.0), run(9.0)], [run(3.0), run(3.0)])
    assert lines[1].split()[1:] == ["2.000", "3.000", "1.50"]
    assert io500ref.cpu_table([io500ref.Parsed()], [io500ref.Parsed()]) == []


def test_compare_writes_its_record_where_json_asks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--compare --json F`` writes the comparison to F too (it was ignored: only the
    results directory had it), the same record as ``compare.json``."""
    from pfs.bench import io500

    def parsed(v: float) -> io500ref.Parsed:
        return io500ref.Parsed(phases={n: (v, 1.0, True) for n in io500ref.SCORED},
                               bw=v, md=v, total=v, valid=True)

    monkeypatch.setattr(io500ref, "find_reference", lambda given: "/bin/true")
    monkeypatch.setattr(io500ref, "settle",
                        lambda how: {"load1": 0.0, "dirty_mb": 0.0, "sync_s": 0.0})

    def harness(binary: str, params: Any, workdir: Path) -> tuple[io500ref.Parsed, str]:
        workdir.mkdir(parents=True, exist_ok=True)
        return parsed(2.0), "harness output"

    monkeypatch.setattr(io500ref, "run_reference", harness)
    monkeypatch.setattr(io500, "run", lambda a: {"phases": []})
    monkeypatch.setattr(io500, "summary_lines", lambda res: [])
    monkeypatch.setattr(io500ref, "parse_output", lambda text: parsed(1.0))
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "out.json"
    p = argparse.ArgumentParser()
    io500.add_args(p)
    args = p.parse_args(["--compare", "--path", str(data), "--stonewall", "2", "--repeat",
                         "2", "--results", str(tmp_path / "res"), "--json", str(out)])
    io500.run_compare(args)
    got = json.loads(out.read_text())
    assert got == json.loads((tmp_path / "res" / "compare.json").read_text())
    assert len(got["harness"]) == len(got["pfs"]) == 2
    assert got["median_harness"]["find"] == 2.0 and got["median_pfs"]["find"] == 1.0

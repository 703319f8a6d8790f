"""The benchmarks run end to end in tiny configurations against a real local cluster and
produce well-formed output and JSON. Nothing here judges speed."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from pfs.bench import main as bench_main

# pfs.tools.cluster drops its Popen objects while the servers run on (they are daemons by
# design); Popen.__del__ then warns, which the suite's "error" filter would turn into a
# failure of whichever test happens to start the shared cluster.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function Popen.__del__:pytest.PytestUnraisableExceptionWarning")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_usage_and_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--help"]) == 0
    assert "throughput" in capsys.readouterr().out
    assert bench_main(["no-such-bench"]) == 2
    assert bench_main([]) == 2


def test_parse_size() -> None:
    from pfs.bench.common import parse_size

    assert parse_size("1G") == 1 << 30
    assert parse_size("64M") == 64 << 20
    assert parse_size("512k") == 512 << 10
    assert parse_size("4096") == 4096
    assert parse_size("1MiB") == 1 << 20
    with pytest.raises(ValueError):
        parse_size("lots")


def test_throughput(cluster_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tp.json"
    rc = bench_main(["throughput", "--dir", str(cluster_dir), "--size", "8M", "--chunk", "2M",
                     "--reps", "2", "--no-cold", "--local-dir", str(tmp_path),
                     "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("pfs_write", "pfs_read_warm", "local_write", "socket", "GB/s/core"):
        assert word in text
    assert re.search(r"aim: pfs read >= 0.5x local read: (met|NOT met) \(", text), text
    res = json.loads(out.read_text())
    assert res["config"]["size"] == 8 << 20
    assert res["config"]["stripe_count"] == 4
    assert res["layout"]["count"] == 4
    assert len(res["runs"]) == 2
    for path in ("local_write", "local_read_warm", "pfs_write", "pfs_read_warm", "socket"):
        m = res["median"][path]
        assert _positive(m["GBps"]) and _positive(m["seconds"]), (path, m)
        assert m["bytes"] == 8 << 20
        assert m["GBps_per_core"] >= 0
    assert _positive(res["ratios"]["pfs_write/local_write"])
    assert _positive(res["ratios"]["pfs_read_warm/local_read_warm"])
    assert "pfs_read_cold" not in res["median"]


def test_meta(cluster_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "meta.json"
    local = tmp_path / "posix"
    local.mkdir()
    rc = bench_main(["meta", "--dir", str(cluster_dir), "--clients", "1,2", "--files", "30",
                     "--lmdb-ops", "30", "--lmdb-batch", "4", "--posix", f"local={local}",
                     "--local-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "creates/s" in text and "CPU budget" in text
    for label in ("pfs native", "pfs batched x256"):  # 1 and 2 clients: no 8-client figure
        assert f"aim: >= 5,000 durable creates/s with 8 clients ({label}): not measured" in text
    res = json.loads(out.read_text())
    got = {(r["label"], r["clients"]) for r in res["median"]}
    assert got == {("pfs native", 1), ("pfs native", 2), ("pfs batched x256", 1),
                   ("pfs batched x256", 2), ("local", 1), ("local", 2)}
    for r in res["median"]:
        for ph in ("create", "stat", "unlink"):
            assert _positive(r[ph]["ops_per_s"]), r
            assert r[ph]["ops"] == 30
        assert r["readdir"]["ops"] == 30 * 5  # every entry, 5 listings
        if r["label"].startswith("pfs"):  # the metaserver's share is counted apart
            assert r["create"]["meta_us_per_op"] >= 0, r
    # CPU time comes in 10 ms clock ticks: one small phase (30 batched creates take a
    # few ms) may see none, but the metaserver's share over the whole run cannot be 0
    meta_s = sum(r[ph]["meta_us_per_op"] * r[ph]["ops"] for r in res["median"]
                 if r["label"].startswith("pfs") for ph in ("create", "stat", "unlink"))
    assert meta_s > 0
    for key in ("durable_1_per_txn", "durable_4_per_txn"):
        assert _positive(res["lmdb"][key]["ops_per_s"])
    assert list(local.iterdir()) == []  # the bench cleaned up after itself


def test_fuse_bench_local_and_native(cluster_dir: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The mount-versus-native comparison with the targets that need no mount or MooseFS."""
    out = tmp_path / "fuse.json"
    rc = bench_main(["fuse", "--dir", str(cluster_dir), "--targets", "local,native",
                     "--mb", "4", "--nfiles", "20", "--reps", "1",
                     "--local-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "cold read MB/s" in text and "aim: mount >= MooseFS on write_MBps: not measured" in text
    res = json.loads(out.read_text())
    assert set(res["median"]) == {"local", "native"}
    for name, rec in res["median"].items():
        for k in ("write_MBps", "read_MBps", "create_ops", "stat_ops", "unlink_ops"):
            assert _positive(rec[k]), (name, k, rec)
    assert _positive(res["ratios"]["native/local write_MBps"])
    # a mounted target's metadata CPU is split by part; a listing is measured too
    assert "CPU us per operation" in text
    local = res["median"]["local"]
    assert _positive(local["readdir_ops"]) and _positive(local["create_caller_us"])
    assert local["create_daemon_us"] == local["create_servers_us"] == 0


def test_sigterm_stops_the_clusters_a_bench_started(tmp_path: Path) -> None:
    """A benchmark killed with SIGTERM (a timeout, a cancelled job) stops the servers it
    started instead of leaving them running."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "pfs.tools.cli", "bench", "meta", "--files",
                             "1000000", "--reps", "1", "--local-dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            files = list(tmp_path.glob("pfs-bench-meta-*/cluster/run/*.pid"))
            if len(files) == 5:  # a metaserver and 4 data servers are up
                pids = [int(f.read_text()) for f in files]
                break
            time.sleep(0.05)  # polling for the pid files, not waiting for readiness
        assert len(pids) == 5, proc.stderr.read().decode() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()

    from pfs.tools.cluster import _pid_alive  # a zombie (exited, not reaped) counts as gone

    assert [pid for pid in pids if _pid_alive(pid)] == []
    assert list(tmp_path.iterdir()) == []  # its scratch directory went too


def test_close(cluster_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "close.json"
    rc = bench_main(["close", "--dir", str(cluster_dir), "--sizes", "256k,1M", "--reps", "2",
                     "--local-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "durable/scratch" in text and "local_fsync" in text
    res = json.loads(out.read_text())
    got = {(p["size"], p["target"]) for p in res["points"]}
    assert got == {(s, t) for s in (256 << 10, 1 << 20)
                   for t in ("durable", "scratch", "local_fsync")}
    for p in res["points"]:
        assert _positive(p["close_ms"]) and len(p["close_ms_all"]) == 2, p


def test_wire_primitives_and_frames(capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_main(["wire", "--no-clusters", "--micro-seconds", "0.03", "--size", "64k",
                     "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["primitives_us"]) == {"4 KiB", "64 KiB"}
    for rows in (*res["primitives_us"].values(), *res["frames_cpu_us"].values()):
        assert rows and all(_positive(v) for v in rows.values()), rows
    assert "mac, from a file" in res["frames_cpu_us"]["64 KiB"]


def test_wire_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_main(["wire", "--no-micro", "--size", "2M", "--seconds", "0.1", "--rounds", "1",
                     "--data-servers", "1", "--dir", str(tmp_path), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    for label in ("1MiB", "4KiB"):
        assert set(res["reads"][label]) == {"none", "mac", "encrypt", "tls"}
        for r in res["reads"][label].values():
            assert _positive(r["reads_per_s"]) and _positive(r["cpu_us_per_read"]), r


def test_failover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pfs.tools import cluster

    out = tmp_path / "failover.json"
    try:  # a cluster of its own: the benchmark stops and kills its servers
        rc = bench_main(["failover", "--dir", str(tmp_path / "c"), "--size", "8M", "--unit",
                         "1M", "--after", "2", "--paths", "network", "--local-dir",
                         str(tmp_path), "--json", str(out)])
    finally:
        cluster.down(tmp_path / "c")
    assert rc == 0
    assert "first read" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [(p["fault"], p["path"]) for p in res["points"]] == [("sigstop", "network"),
                                                               ("kill", "network")]
    for p in res["points"]:
        assert p["n_errors"] == 0 and p["reads_after"] > 0, p
        assert p["first_read_s"] is not None and p["first_read_s"] < 10, p
        assert p["up_again_s"] is not None, p
    # a killed server is refused at once and reported: down well before its lease ends
    assert res["points"][1]["down_s"] is not None and res["points"][1]["down_s"] < 4


def test_repair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "repair.json"
    rc = bench_main(["repair", "--size", "6M", "--files", "3", "--unit", "1M",
                     "--data-servers", "3", "--before", "0.5", "--timeout", "120",
                     "--local-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    assert "repair GB/s" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["n_errors"] == 0, res["errors"]
    assert res["recopied_bytes"] > 0 and _positive(res["repair_gbps"]), res
    assert _positive(res["read_before_gbps"]), res


def test_dir_cluster_stopped_only_if_the_bench_started_it(cluster_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``--dir`` of a stopped cluster: started for the run and stopped after it (data kept);
    ``--dir`` of a running one: left running."""
    from pfs.tools import cluster

    d = tmp_path / "c"
    args = ["close", "--sizes", "256k", "--reps", "1", "--local-dir", str(tmp_path)]
    try:
        assert bench_main([*args, "--dir", str(d)]) == 0
        assert cluster.running(d) == {}
        assert (d / "client.toml").exists()  # stopped, not removed
        before = cluster.running(cluster_dir)
        assert before
        assert bench_main([*args, "--dir", str(cluster_dir)]) == 0
        assert cluster.running(cluster_dir) == before
    finally:
        cluster.down(d)
    capsys.readouterr()

"""``pfs bench sweep``: the quick preset on local files, the native client and a mount
produces CSV, JSON and PNG files with plausible values; resuming; the config file; the
winner arithmetic. Nothing here judges speed."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pfs.bench import main as bench_main
from pfs.bench import sweep

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function Popen.__del__:pytest.PytestUnraisableExceptionWarning")

PNG = b"\x89PNG\r\n\x1a\n"


def check_outputs(out: Path, want_points: int, file_size: int) -> list[dict[str, Any]]:
    res = json.loads((out / "results.json").read_text())
    pts = res["points"]
    assert len(pts) == want_points
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == want_points
    assert [r["engine"] for r in rows] == [p["engine"] for p in pts]
    for name in ("throughput_vs_bs.png", "latency_cdf.png", "gbps_per_core.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    assert res["plots"] == ["throughput_vs_bs.png", "latency_cdf.png", "gbps_per_core.png"]
    for p in pts:
        if p["status"] != "ok":
            assert p["status"].startswith("skipped: "), p
            continue
        bs = p["block_size"]
        assert 0 < p["ops"] <= max(1, file_size // bs), p  # at most one pass
        assert p["bytes"] == p["ops"] * bs, p  # the file is whole: no short reads
        assert p["seconds"] > 0 and p["GBps"] > 0 and p["IOPS"] > 0
        assert math.isclose(p["GBps"], p["IOPS"] * bs / 1e9, rel_tol=1e-9)
        assert 0 < p["lat_p50_us"] <= p["lat_p99_us"] <= p["lat_p999_us"]
        q = p["lat_quantiles_us"]
        assert q == sorted(q) and len(q) == len(sweep.QUANTILES)
        assert p["cpu_s"] >= 0 and p["GBps_per_core"] >= 0
        # a latency per call cannot be longer than the whole point
        assert p["lat_p999_us"] <= p["seconds"] * 1e6 * 1.001
    return pts


def test_quick_local_and_native(tmp_path: Path, client_toml: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = bench_main(["sweep", "--quick", "--seconds", "0.1", "--targets", "local,native",
                     "--config", str(client_toml), "--local-dir", str(tmp_path / "scratch"),
                     "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "winners" in text and "local/uring-qd1" in text and "native/native" in text
    # local: 4 engines x 2 sizes x 4 patterns; native: 1 engine x 2 x 4
    pts = check_outputs(out, 32 + 8, 32 << 20)
    ok = {(p["target"], p["engine"]) for p in pts if p["status"] == "ok"}
    assert ("local", "posix") in ok and ("native", "native") in ok
    res = json.loads((out / "results.json").read_text())
    phases = {w["phase"] for w in res["winners"]["overall"]}
    assert phases == {"inference", "inference (latency)", "loading", "loading (CPU)",
                      "checkpointing"}
    assert {w["phase"] for w in res["winners"]["native"]} == phases
    assert all(w["winner"].startswith("local/") for w in res["winners"]["local"])
    assert list((tmp_path / "scratch").glob("sweep-local-*")) == []  # test file removed

    # resume: nothing left to measure; drop the last point and only it is measured again
    lines = (out / "points.jsonl").read_text().splitlines()
    assert len(lines) == 40
    (out / "points.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])
    rc = bench_main(["sweep", "--quick", "--seconds", "0.1", "--targets", "local,native",
                     "--config", str(client_toml), "--local-dir", str(tmp_path / "scratch"),
                     "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "resuming: 39 of 40 points" in err
    assert err.count("] native native") == 1
    check_outputs(out, 40, 32 << 20)
    # other settings in the same directory are refused
    with pytest.raises(SystemExit):
        bench_main(["sweep", "--quick", "--seconds", "0.3", "--out", str(out)])


def test_mount(tmp_path: Path, client_toml: Path) -> None:
    from tests.fuse_fixtures import mounted

    with mounted(client_toml) as mnt:
        out = tmp_path / "out"
        rc = bench_main(["sweep", "--targets", "mount", "--mount", str(mnt), "--engines",
                         "posix,uring-qd4", "--block-sizes", "64k,1m", "--patterns",
                         "seqread,randwrite", "--threads", "1,2", "--seconds", "0.1",
                         "--file-size", "8M", "--out", str(out)])
        assert rc == 0
        pts = check_outputs(out, 2 * 2 * 2 * 2, 8 << 20)
        assert all(p["status"] == "ok" for p in pts)
        assert list((mnt / "bench-sweep").iterdir()) == []


def test_config_file(tmp_path: Path) -> None:
    cfgf = tmp_path / "sweep.toml"
    cfgf.write_text('engines = ["posix", "uring-direct-qd4"]\nblock_sizes = ["4k", 65536]\n'
                    'patterns = "randread"\nthreads = [1, 2]\nseconds = 0.05\n'
                    'file_size = "4M"\n')
    out = tmp_path / "out"
    rc = bench_main(["sweep", "--config-file", str(cfgf), "--local-dir", str(tmp_path),
                     "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["block_sizes"] == [4096, 65536]
    assert res["config"]["file_size"] == 4 << 20
    got = {(p["engine"], p["block_size"], p["threads"]) for p in res["points"]}
    assert got == {(e, b, t) for e in ("posix", "uring-direct-qd4") for b in (4096, 65536)
                   for t in (1, 2)}
    check_outputs(out, 8, 4 << 20)
    bad = tmp_path / "bad.toml"
    bad.write_text("enignes = ['posix']\n")
    with pytest.raises(SystemExit, match="unknown key 'enignes'"):
        bench_main(["sweep", "--config-file", str(bad), "--out", str(tmp_path / "o2")])


def test_engine_names() -> None:
    assert sweep.parse_engine("posix") == ("posix", False, 1)
    assert sweep.parse_engine("posix-direct") == ("posix", True, 1)
    assert sweep.parse_engine("uring-qd32") == ("uring", False, 32)
    assert sweep.parse_engine("uring-direct-qd8") == ("uring", True, 8)
    for bad in ("uring-qd0", "spdk", "posix-fast"):
        with pytest.raises(SystemExit):
            sweep.parse_engine(bad)


def test_winners_by_hand() -> None:
    def rec(target: str, engine: str, pattern: str, bs: int, **m: float) -> dict[str, Any]:
        base = {"IOPS": 0.0, "GBps": 0.0, "GBps_per_core": 0.0, "lat_p99_us": 0.0}
        return {"target": target, "engine": engine, "pattern": pattern, "block_size": bs,
                "threads": 1, "status": "ok", **base, **m}

    recs = [rec("local", "posix", "randread", 4096, IOPS=100, lat_p99_us=50),
            rec("local", "posix", "randread", 65536, IOPS=400, lat_p99_us=200),  # gm 200
            rec("local", "uring-qd8", "randread", 4096, IOPS=300, lat_p99_us=10),
            rec("local", "uring-qd8", "randread", 65536, IOPS=120, lat_p99_us=1000),  # gm 189.7
            rec("local", "uring-qd8", "randread", 1 << 20, IOPS=1e9),  # not small: ignored
            rec("native", "native", "seqread", 1 << 20, GBps=2.0, GBps_per_core=0.5),
            rec("local", "posix", "seqread", 1 << 20, GBps=1.0, GBps_per_core=4.0),
            rec("local", "posix", "seqread", 16 << 20, GBps=4.0, GBps_per_core=1.0)]  # gm 2, 2
    w = {x["phase"]: x for x in sweep.winners(recs)}
    assert w["inference"]["winner"] == "local/posix"
    assert w["inference"]["value"] == pytest.approx(200.0)
    assert w["inference"]["all"]["local/uring-qd8"] == pytest.approx(math.sqrt(300 * 120))
    assert w["inference (latency)"]["winner"] == "local/posix"  # sqrt(50*200)=100 < sqrt(10*1000)=100.0
    assert w["inference (latency)"]["value"] == pytest.approx(100.0)
    assert w["loading (CPU)"]["winner"] == "local/posix"
    assert w["loading (CPU)"]["value"] == pytest.approx(2.0)
    assert w["loading"]["all"] == pytest.approx({"native/native": 2.0, "local/posix": 2.0})
    assert "checkpointing" not in w  # no sequential writes measured
    assert [x["winner"] for x in sweep.winners(recs, "native")] == ["native/native"] * 2

"""``pfs bench loader`` and ``pfs bench iops`` run end to end in tiny ``--quick``
configurations against a real local cluster and produce well-formed output and JSON.
Nothing here judges speed."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pfs.bench import main as bench_main

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function Popen.__del__:pytest.PytestUnraisableExceptionWarning")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_loader_quick(cluster_dir: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "loader.json"
    rc = bench_main(["loader", "--quick", "--dir", str(cluster_dir), "--size", "8M",
                     "--hidden", "256", "--vocab", "1024", "--shards", "3", "--no-cold",
                     "--no-fuse", "--local-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("st_clone warm", "pfs_sc_on warm", "pfs_sc_off warm", "GB/s/core",
                 "vs st_clone"):
        assert word in text
    res = json.loads(out.read_text())
    ck = res["checkpoint"]
    assert ck["shards"] == 3 and ck["dtype"] == "BF16"
    assert ck["tensor_bytes"] >= 8 << 20
    assert set(res["verified_bit_exact"]) == {"pfs_local", "pfs_sc_on", "pfs_sc_off"}
    med = res["median"]
    for path in ("st_touch", "st_clone", "pfs_local", "pfs_sc_on", "pfs_sc_off"):
        m = med[f"{path}_warm"]
        assert _positive(m["GBps"]) and _positive(m["seconds"]), (path, m)
        assert m["bytes"] == ck["tensor_bytes"] and m["tensors"] == ck["tensors"]
        assert m["GBps_per_core"] >= 0
    assert med["pfs_sc_on_warm"]["short_circuit_bytes"] > 0
    assert not any(k.endswith("_cold") or k.startswith("fuse") for k in med)
    assert _positive(res["ratios"]["pfs_sc_on/st_clone warm"])
    assert _positive(res["ratios"]["pfs_local/st_touch warm"])


def test_iops_quick(cluster_dir: Path, tmp_path: Path,
                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "iops.json"
    rc = bench_main(["iops", "--quick", "--dir", str(cluster_dir), "--file-size", "4M",
                     "--seconds", "0.1", "--qd", "1,8", "--local-dir", str(tmp_path),
                     "--json", str(out)])
    assert rc == 0
    assert "CPU us/IO" in capsys.readouterr().out
    res = json.loads(out.read_text())
    engines = set(res["config"]["engines"])
    assert "posix" in engines
    got = {(p["path"], p["engine"], p["qd"]) for p in res["points"]}
    want = {(path, e, qd) for path in ("local", "short_circuit") for e in engines for qd in (1, 8)}
    want |= {("network", "servers", qd) for qd in (1, 8)}
    want |= {("sync_api", how, qd) for how in ("local", "tcp") for qd in (1, 8)}
    assert got == want
    for p in res["points"]:
        for k in ("iops", "p50_us", "p99_us", "ios", "seconds"):
            assert _positive(p[k]), (p, k)
        assert p["p99_us"] >= p["p50_us"]
        if p["path"] == "short_circuit" or (p["path"], p["engine"]) == ("sync_api", "local"):
            assert p["short_circuit_reads"] >= p["ios"]
        if p["path"] == "network":  # short-circuit off: that client has no local reader
            assert "short_circuit_reads" not in p

"""``pfs bench loader`` and ``pfs bench iops`` run end to end in tiny ``--quick``
configurations against a real local cluster and produce well-formed output and JSON; the
loader bench's fresh-process runner gives safetensors' tensors bit for bit. Nothing here
judges speed."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from pfs.bench import loader, loader_run
from pfs.bench import main as bench_main

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function Popen.__del__:pytest.PytestUnraisableExceptionWarning")


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_loader_quick(cluster_dir: Path, tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "loader.json"
    paths = ("st_clone", "pfs_local", "pfs_sc_on", "pfs_sc_map", "pfs_sc_off")
    rc = bench_main(["loader", "--quick", "--dir", str(cluster_dir), "--size", "8M",
                     "--hidden", "256", "--vocab", "1024", "--shards", "3", "--no-cold",
                     "--paths", ",".join(paths), "--stability", "2",
                     "--local-dir", str(tmp_path), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("st_clone warm", "pfs_sc_on warm", "pfs_sc_off warm", "GB/s/core",
                 "vs st_clone", "1st tensor s", "fresh process", "aim: pfs_sc_on warm",
                 "consecutive warm loads in one process, pfs_local"):
        assert word in text
    res = json.loads(out.read_text())
    ck = res["checkpoint"]
    assert ck["shards"] == 3 and ck["dtype"] == "BF16"
    assert ck["tensor_bytes"] >= 8 << 20
    assert set(res["verified_bit_exact"]) == set(paths)
    med = res["median"]
    for path in paths:
        m = med[f"{path}_warm"]
        assert _positive(m["GBps"]) and _positive(m["seconds"]), (path, m)
        assert 0 < m["first_tensor_s"] <= m["seconds"]
        assert m["bytes"] == ck["tensor_bytes"] and m["tensors"] == ck["tensors"]
        assert m["GBps_per_core"] >= 0
    assert med["pfs_sc_on_warm"]["short_circuit_bytes"] > 0
    assert med["pfs_sc_off_warm"]["short_circuit_bytes"] == 0
    assert med["pfs_sc_on_warm"]["mapped_bytes"] == 0  # the default copies
    assert 0 < med["pfs_sc_map_warm"]["mapped_bytes"] <= med["pfs_sc_map_warm"]["short_circuit_bytes"]
    assert "pfs_sc_map warm: 100% of the bytes read short-circuit (" in text, text
    assert med["pfs_sc_on_warm"]["cpu_servers_s"] >= 0
    assert not any(k.endswith("_cold") or k.startswith("fuse") for k in med)
    assert _positive(res["ratios"]["pfs_sc_on/st_clone warm"])
    st = res["stability"]["pfs_local"]
    assert len(st["GBps"]) == 2 and len(st["cpu_s"]) == 2
    # the second load reads into the buffers the first handed back
    assert st["reused"] == [0.0, 1.0], st
    assert "; faults " in text and "buffers reused 0%, 100%" in text
    assert {a["aim"].split(" ")[0] for a in res["aims"]} >= {"pfs_sc_on", "pfs_sc_map", "pfs_sc_off"}


def _runner(path: str, src: Path, files: list[str], verify: Path | None = None,
            repeat: int = 1) -> dict[str, object]:
    argv = loader.runner_argv(path, str(src), files, repeat=repeat,
                              verify=str(verify) if verify else None)
    return loader.run_fresh(argv, timeout=600)


@pytest.mark.parametrize("path", ["st_clone", "pfs_local", "runai", "fastsafetensors"])
def test_runner_loads_bit_exact_in_a_fresh_process(tmp_path: Path, path: str) -> None:
    ck = loader.make_checkpoint(tmp_path / "ck", 2 << 20, 2, 128, 512)
    res = _runner(path, tmp_path / "ck", ck["files"], verify=tmp_path / "ck", repeat=2)
    if "skipped" in res:  # a reference loader that is not installed
        assert path in loader_run.NEEDS and "not installed" in str(res["skipped"])
        if os.environ.get("PFS_REQUIRE_LOADERS"):  # deploy/test.sh: setup.sh installed them
            pytest.fail(f"PFS_REQUIRE_LOADERS is set but {res['skipped']}")
        pytest.skip(str(res["skipped"]))
    assert res["bit_exact"] is True, res.get("mismatch")
    loads = res["loads"]
    assert isinstance(loads, list) and len(loads) == 2
    for rec in loads:
        assert rec["bytes"] == ck["tensor_bytes"] and rec["tensors"] == ck["tensors"]
        assert 0 < rec["first_tensor_s"] <= rec["seconds"]
        assert rec["cpu_self_s"] >= 0 and rec["minflt"] >= 0


def test_bit_exact_names_the_tensor_that_differs(tmp_path: Path) -> None:
    import torch

    ck = loader.make_checkpoint(tmp_path / "ck", 1 << 20, 1, 128, 512)
    got = loader_run._st_clone([str(tmp_path / "ck" / f) for f in ck["files"]],
                               lambda: None)
    assert loader_run.bit_exact(str(tmp_path / "ck"), ck["files"], got) is None
    name = sorted(got)[0]
    got[name].view(torch.int16).reshape(-1)[0] ^= 1
    assert name in str(loader_run.bit_exact(str(tmp_path / "ck"), ck["files"], got))
    del got[name]
    assert "names differ" in str(loader_run.bit_exact(str(tmp_path / "ck"), ck["files"], got))


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

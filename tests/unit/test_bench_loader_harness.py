"""``pfs bench loader``'s fresh-process harness without processes: the runner's result
line is found and parsed, the aims are judged from medians, and a reference loader that
is not installed is skipped with a clear note instead of failing the run."""
from __future__ import annotations

import json
from typing import Any

import pytest

from pfs.bench import loader, loader_run


def test_parse_runner_takes_the_last_json_line() -> None:
    out = "\n".join(["some library's banner", '{"path": "old"}', "INFO streaming...",
                     json.dumps({"path": "pfs_local", "loads": [{"seconds": 1.0}]}), ""])
    assert loader.parse_runner(out)["path"] == "pfs_local"
    with pytest.raises(RuntimeError, match="no result line"):
        loader.parse_runner("nothing here\n{not json")


def test_load_record_adds_rates() -> None:
    res = {"path": "pfs_sc_on", "short_circuit_bytes": 7,
           "loads": [{"seconds": 2.0, "first_tensor_s": 2.0, "cpu_self_s": 1.0,
                      "cpu_servers_s": 1.0, "bytes": 4_000_000_000, "tensors": 3}]}
    rec = loader.load_record(res)
    assert rec["GBps"] == pytest.approx(2.0)
    assert rec["GBps_per_core"] == pytest.approx(2.0)
    assert rec["short_circuit_bytes"] == 7


def test_runner_argv_names_everything() -> None:
    argv = loader.runner_argv("pfs_sc_on", "/ck", ["a.safetensors", "b.safetensors"],
                              config="/c.toml", pids=[3, 4], repeat=2, verify="/local")
    assert argv[1:4] == ["-m", "pfs.bench.loader_run", "pfs_sc_on"]
    for flag, val in (("--src", "/ck"), ("--files", "a.safetensors,b.safetensors"),
                      ("--config", "/c.toml"), ("--pids", "3,4"), ("--repeat", "2"),
                      ("--verify", "/local")):
        assert argv[argv.index(flag) + 1] == val


def test_spread_and_aims() -> None:
    assert loader.spread([2.0, 2.2, 2.4]) == pytest.approx(0.2)

    def m(gbps: float) -> dict[str, float]:
        return {"GBps": gbps}

    med = {"st_clone_warm": m(2.0), "st_clone_cold": m(1.0), "pfs_sc_on_warm": m(3.2),
           "pfs_sc_on_cold": m(1.5), "runai_warm": m(1.0), "fastsafetensors_warm": m(1.5),
           "pfs_local_warm": m(3.0)}
    got = {a["aim"].split(" (spread")[0]: a for a in
           loader.aims(med, {"pfs_local": {"spread": 0.1}, "pfs_sc_on": {"spread": 0.5}})}
    warm = got["pfs_sc_on warm >= 1.5x st_clone warm"]
    assert warm["value"] == pytest.approx(1.6) and warm["met"]
    cold = got["pfs_sc_on cold >= 2x st_clone cold"]
    assert cold["value"] == pytest.approx(1.5) and not cold["met"]
    tcp = got["pfs_sc_off (TCP only) >= 1.0x st_clone, warm and cold"]
    assert tcp["value"] is None and not tcp["met"]  # not measured
    # the faster of the two dedicated loaders is the bar: 3.0 / 1.5
    ded = got["pfs_local >= 2x the faster of runai and fastsafetensors, warm and cold"]
    assert ded["value"] == pytest.approx(2.0) and ded["met"]
    assert got["pfs_local: consecutive warm loads in one process within 20%"]["met"]
    assert not got["pfs_sc_on: consecutive warm loads in one process within 20%"]["met"]
    text = "\n".join(loader.aim(a["aim"], a["value"], a["target"])
                     for a in loader.aims(med, {}))
    assert "not measured in this run" in text and "NOT met" in text


def test_stability_shows_cpu_and_faults_per_load() -> None:
    s: dict[str, Any] = {"GBps": [1.0, 2.0], "spread": 1.0, "cpu_s": [0.31, 0.05],
                         "faults": [139000, 20], "reused": [0.0, 0.0]}
    assert loader.stability_detail(s) == "; CPU 0.31, 0.05 s; faults 139k, 0k"
    s["reused"] = [0.0, 1.0]
    assert loader.stability_detail(s).endswith("; buffers reused 0%, 100%")
    assert loader.stability_detail({"GBps": [1.0], "spread": 0.0}) == ""
    s.update(GBps=[1.0, 4.0, 5.0], spread=4.0, spread_after_first=0.25,
             cpu_s=[0.3, 0.05, 0.05], faults=[139000, 0, 0], reused=[0.0, 1.0, 1.0])
    assert loader.stability_line("pfs_local", s) == (
        "consecutive warm loads in one process, pfs_local: 1.00, 4.00, 5.00 GB/s "
        "(spread 400%, 25% after the first); CPU 0.30, 0.05, 0.05 s; faults 139k, 0k, 0k; "
        "buffers reused 0%, 100%, 100%")


def test_a_missing_reference_is_skipped(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(loader_run.NEEDS, "runai",
                        ("no_such_module_pfs_test", "runai-model-streamer"))
    why = loader_run.missing("runai")
    assert why is not None and "runai-model-streamer is not installed" in why
    assert "pfs[loaders]" in why
    rc = loader_run.main(["runai", "--src", "/nowhere", "--files", "a.safetensors"])
    assert rc == 0
    res = loader.parse_runner(capsys.readouterr().out)
    assert res["path"] == "runai" and "not installed" in res["skipped"]

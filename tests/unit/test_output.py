"""What the ``pfs`` commands print, without a cluster: progress bars (on a terminal
only, size known late), and the server table of ``admin status`` / ``admin servers``
for servers that report load and version and for older ones that do not."""
from __future__ import annotations

import io
import sys

import pytest

from pfs.tools.admin_status import server_records, server_table
from pfs.tools.output import PROGRESS_MIN, Progress


def test_progress_is_off_when_stderr_is_no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with Progress(None, "load") as bar:
        bar.set_total(PROGRESS_MIN * 4)
        bar.add(PROGRESS_MIN)
        bar.write("a line")
    assert err.getvalue() == "a line\n"


def test_progress_forced_on_draws_a_bar_and_a_late_total(
        monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with Progress(None, "load", force=True) as bar:
        bar.set_total(10 << 20)
        bar.add(5 << 20)
        assert bar._bar is not None and bar._bar.total == 10 << 20
        assert bar._bar.n == 5 << 20
    assert "load" in err.getvalue()
    steps = Progress(3, "sweep", force=True, unit="point")
    steps.add(1)
    assert steps._bar is not None and steps._bar.unit == "point"
    steps.finish()
    steps.add(1)  # after finish: nothing, no error


def test_server_table_with_and_without_load_and_version() -> None:
    servers = {
        "a" * 32: {"host": "10.0.0.1", "port": 7001, "total": 1 << 40, "free": 1 << 39,
                   "state": "up", "domain": "rack1", "age": 0.4, "version": "0.2.0",
                   "protocol": [1, 2], "load": {"requests": 120, "bytes_in": 3 << 20,
                                                "bytes_out": 0, "connections": 5}},
        "b" * 32: {"host": "10.0.0.2", "port": 7001, "total": 1 << 40, "free": 1 << 40,
                   "alive": True, "age": 1.2},  # an older server (and metaserver)
    }
    recs = server_records(servers)
    assert [r["sid"][0] for r in recs] == ["a", "b"]
    assert recs[0]["load"]["requests"] == 120 and recs[1]["load"] is None
    assert recs[1]["state"] == "up" and recs[1]["version"] is None
    short, full = server_table(recs), server_table(recs, full_ids=True)
    assert "0.2.0 (protocol 1-2)" in short[1] and "3.0MiB/s" in short[1]
    assert short[1].split()[:4] == ["aaaaaaaa", "10.0.0.1:7001", "up", "rack1"]
    assert short[2].rstrip().endswith("-") and " - " in short[2]
    assert full[1].startswith("a" * 32) and full[1:] != short[1:]

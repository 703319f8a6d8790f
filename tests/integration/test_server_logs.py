"""Servers say what they do (docs/architecture.md, "Operations"): `pfs meta serve` and
`pfs data serve`, as the service units run them, log at INFO by default: start-up with
the config, registration, a data server lost and found again, a clean stop naming its
signal; a crash logs its cause with the traceback; `--log-format json` is one JSON
object per line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pfs.core.daemon import wait_ready


def start(log: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    """`pfs ARGS --ready-fd N` with stderr to ``log``; the process and its port."""
    rfd, wfd = os.pipe()
    with log.open("ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pfs.tools.cli", *args,
                                 "--ready-fd", str(wfd)], stderr=err, pass_fds=(wfd,))
    os.close(wfd)
    try:
        line = wait_ready(rfd, 60)
    finally:
        os.close(rfd)
    assert line, log.read_text()
    return proc, int(line)


def wait_for(log: Path, text: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = log.read_text()
        if text in body:
            return body
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not logged in {timeout} s:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(30)


def test_servers_log_start_registration_peers_and_shutdown(tmp_path: Path) -> None:
    meta_toml = tmp_path / "meta.toml"
    meta_toml.write_text(f'db = "{tmp_path / "db"}"\nport = 0\nheartbeat_timeout = 1.0\n'
                         'suspect_after = 0.5\n')
    mlog, dlog = tmp_path / "meta.log", tmp_path / "data.log"
    meta, mport = start(mlog, "meta", "serve", "--config", str(meta_toml))
    data_args = ("data", "serve", "--dir", str(tmp_path / "d"), "--port", "0", "--meta",
                 f"127.0.0.1:{mport}", "--heartbeat", "0.2", "--log-format", "json")
    try:
        data, dport = start(dlog, *data_args)
        body = wait_for(mlog, "registered at")
        assert f"metaserver starting: config {meta_toml}" in body
        assert f"ready on port {mport}" in body and " INFO " in body
        records = [json.loads(line) for line in dlog.read_text().splitlines()]
        assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
        messages = [r["message"] for r in records]
        assert any(m.startswith("data server starting: config (none), dirs "
                                f"{tmp_path / 'd'}") for m in messages), messages
        assert any(m.startswith("registered with the metaserver as") for m in messages)
        assert stop(data) == 0
        messages = [json.loads(line)["message"] for line in dlog.read_text().splitlines()]
        assert any(m.endswith("stopping on SIGTERM") for m in messages), messages
        assert any(m.endswith("stopped cleanly (SIGTERM)") for m in messages), messages
        body = wait_for(mlog, "-> down")  # the metaserver saw it go (lease of 1 s)
        data, _ = start(dlog, *data_args)
        wait_for(mlog, "down -> up (back)")
        assert stop(data) == 0
    finally:
        if meta.poll() is None:
            assert stop(meta) == 0
    body = mlog.read_text()
    assert "stopping on SIGTERM" in body and "stopped cleanly (SIGTERM)" in body


def test_a_crash_logs_its_cause_with_the_traceback(tmp_path: Path) -> None:
    (tmp_path / "db").write_text("a file where the store's directory should be")
    r = subprocess.run([sys.executable, "-m", "pfs.tools.cli", "meta", "serve", "--db",
                        str(tmp_path / "db"), "--port", "0", "--log-format", "json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    records = [json.loads(line) for line in r.stderr.splitlines()]  # nothing but JSON
    [died] = [x for x in records if " died: " in x["message"]]
    assert died["level"] == "CRITICAL" and "FileExistsError" in died["message"]
    assert died["exc"].startswith("Traceback") and "LmdbStore" in died["exc"]

"""The ``pfs`` command line as a user meets it: one-line errors naming the path, POSIX
errnos, --json everywhere data is printed, setstripe checked against the cluster, put and
get like cp (stdin/stdout, -r, into directories, atomic), Ctrl-C without a crash."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pfs.client.sync import Client
from pfs.core.versions import PROTOCOL_MAX, PROTOCOL_MIN


def _pfs(toml: Path, *args: str, input: bytes | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PFS_CONFIG": str(toml)}
    return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args], capture_output=True,
                          env=env, input=input, timeout=120, cwd=cwd)


def _one_clean_line(r: subprocess.CompletedProcess[bytes], *names: str) -> str:
    err = r.stderr.decode()
    assert r.returncode != 0 and err.count("\n") == 1, err
    assert "Traceback" not in err and "b'" not in err, err
    for n in names:
        assert n in err, (n, err)
    return err


def test_directory_opened_as_a_file_is_eisdir(client: Client, workdir: str,
                                              client_toml: Path, tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError):
        client.open(workdir, "rb")
    with pytest.raises(IsADirectoryError):
        client.open(workdir, "wb")
    _one_clean_line(_pfs(client_toml, "cat", workdir), workdir, "EISDIR")
    _one_clean_line(_pfs(client_toml, "get", workdir, str(tmp_path / "x")), workdir, "EISDIR")
    client.write_file(f"{workdir}/f", b"x")
    _one_clean_line(_pfs(client_toml, "ls", f"{workdir}/f/x"), f"{workdir}/f/x", "ENOTDIR")


def test_errors_are_one_line_naming_the_path(client_toml: Path, workdir: str,
                                             tmp_path: Path) -> None:
    _one_clean_line(_pfs(client_toml, "ls", f"{workdir}/no/such"), f"{workdir}/no/such",
                    "ENOENT")
    _one_clean_line(_pfs(client_toml, "stat", f"{workdir}/no"), f"{workdir}/no", "ENOENT")
    r = _pfs(client_toml, "get", "/nonexistent", str(tmp_path / "x"))
    _one_clean_line(r, "/nonexistent", "ENOENT")
    (tmp_path / "in").write_bytes(b"abc")
    _pfs(client_toml, "put", str(tmp_path / "in"), f"{workdir}/in")
    r = _pfs(client_toml, "get", f"{workdir}/in", str(tmp_path / "nonexistent-dir" / "x"))
    _one_clean_line(r, str(tmp_path / "nonexistent-dir" / "x"), "ENOENT")
    r = _pfs(client_toml, "load", "--device", "banana", "/x")
    assert r.returncode == 2 and b"banana" in r.stderr and b"Traceback" not in r.stderr


def test_version_and_options_after_the_subcommand(client_toml: Path, workdir: str,
                                                  tmp_path: Path) -> None:
    r = _pfs(client_toml, "--version")
    assert r.returncode == 0 and r.stdout.startswith(b"pfs ")
    (tmp_path / "in").write_bytes(b"abc")
    r = _pfs(client_toml, "put", "-v", str(tmp_path / "in"), f"{workdir}/in")
    assert r.returncode == 0 and b"put: 1 file(s)" in r.stderr, r.stderr


def test_json_on_every_data_command(client_toml: Path, workdir: str, client: Client) -> None:
    client.write_file(f"{workdir}/f", b"12345")
    ls = json.loads(_pfs(client_toml, "ls", "--json", workdir).stdout)
    assert [e["path"] for e in ls] == [f"{workdir}/f"] and ls[0]["size"] == 5
    st = json.loads(_pfs(client_toml, "stat", "--json", f"{workdir}/f").stdout)
    assert st["size"] == 5 and st["type"] == "file"
    lay = json.loads(_pfs(client_toml, "getstripe", "--json", f"{workdir}/f").stdout)
    assert len(lay["addresses"]) == lay["count"]
    assert all(":" in a for stripe in lay["addresses"] for a in stripe)
    df = json.loads(_pfs(client_toml, "df", "--json").stdout)
    assert len(df["servers"]) >= 4 and df["total"] > 0
    human = _pfs(client_toml, "getstripe", f"{workdir}/f").stdout.decode()
    assert "stripe 0:" in human and "127.0.0.1:" in human
    assert "Size: 5" in _pfs(client_toml, "stat", f"{workdir}/f").stdout.decode()


def test_setstripe_checks_values_and_changes_only_those_given(client_toml: Path,
                                                              workdir: str,
                                                              client: Client) -> None:
    for bad in (["--count", "0"], ["--count", "99"], ["--replicas", "5"],
                ["--replicas", "0"], ["--unit", "1000"]):
        _one_clean_line(_pfs(client_toml, "setstripe", *bad, workdir), workdir, "EINVAL")
    assert _pfs(client_toml, "setstripe", "--count", "3", workdir).returncode == 0
    r = _pfs(client_toml, "setstripe", "--replicas", "2", workdir)
    assert r.returncode == 0, r.stderr
    lay = client.get_layout(workdir)
    assert (lay["count"], lay["replicas"]) == (3, 2)
    r = _pfs(client_toml, "setstripe", "--unit", "64K", workdir)
    lay = client.get_layout(workdir)
    assert (lay["count"], lay["replicas"], lay["unit"]) == (3, 2, 65536)


def test_put_get_like_cp(client_toml: Path, workdir: str, client: Client,
                         tmp_path: Path) -> None:
    data = os.urandom(200_000)
    r = _pfs(client_toml, "put", "-", f"{workdir}/from-stdin", input=data)
    assert r.returncode == 0, r.stderr
    assert client.read_file(f"{workdir}/from-stdin") == data
    r = _pfs(client_toml, "get", f"{workdir}/from-stdin", "-")
    assert r.returncode == 0 and r.stdout == data
    # into a directory, under the source's name
    client.mkdir(f"{workdir}/into")
    (tmp_path / "a.bin").write_bytes(data)
    assert _pfs(client_toml, "put", str(tmp_path / "a.bin"), f"{workdir}/into").returncode == 0
    assert client.read_file(f"{workdir}/into/a.bin") == data
    out = tmp_path / "out"
    out.mkdir()
    assert _pfs(client_toml, "get", f"{workdir}/into/a.bin", str(out)).returncode == 0
    assert (out / "a.bin").read_bytes() == data
    # trees with -r, and nothing temporary left behind
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "x").write_bytes(b"x")
    (tree / "sub" / "y").write_bytes(b"yy")
    _one_clean_line(_pfs(client_toml, "put", str(tree), f"{workdir}/t"), "EISDIR", "-r")
    assert _pfs(client_toml, "put", "-r", str(tree), f"{workdir}/t").returncode == 0
    assert client.read_file(f"{workdir}/t/sub/y") == b"yy"
    back = tmp_path / "back"
    assert _pfs(client_toml, "get", "-r", f"{workdir}/t", str(back)).returncode == 0
    assert (back / "sub" / "y").read_bytes() == b"yy" and (back / "x").read_bytes() == b"x"
    assert not [n for n in client.listdir(f"{workdir}/t") if "pfs-tmp" in n]
    assert not [p for p in back.rglob("*") if "pfs-tmp" in p.name]


def test_closed_pipe_is_not_a_traceback(client_toml: Path, workdir: str,
                                        client: Client) -> None:
    for i in range(300):
        client.write_file(f"{workdir}/f{i:03d}", b"")
    env = {**os.environ, "PFS_CONFIG": str(client_toml)}
    p = subprocess.Popen([sys.executable, "-m", "pfs.tools.cli", "ls", workdir],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read()
    p.stderr.close()
    p.wait(timeout=60)
    assert b"Traceback" not in err and b"EPIPE" not in err, err


def _interrupt(argv: list[str], env: dict[str, Any], delay: float,
               started: Callable[[], bool]) -> int:
    """SIGINT ``delay`` seconds after the transfer began (``started``: its temporary
    file is there), so the signal lands in the copy, not in the interpreter's start,
    however slow a loaded machine makes that."""
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while p.poll() is None and not started() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert b"Traceback" not in err, err
    assert p.returncode in (0, 130), (argv, delay, p.returncode, err)
    return p.returncode


def test_ctrl_c_during_transfers_never_crashes_or_leaves_partial_files(
        client_toml: Path, workdir: str, client: Client, tmp_path: Path) -> None:
    """SIGINT at different moments of put and get: the status is 0 (done first) or 130,
    never a signal (a crash); the final name holds the whole file or nothing."""
    big = tmp_path / "big"
    data = os.urandom(1 << 20) * 160  # a second or two to copy: most signals land inside
    big.write_bytes(data)
    client.write_file(f"{workdir}/big", data)
    env = {**os.environ, "PFS_CONFIG": str(client_toml)}
    cli = [sys.executable, "-m", "pfs.tools.cli"]
    statuses = []

    def local_tmp() -> bool:
        return any("pfs-tmp" in p.name for p in tmp_path.iterdir())

    def remote_tmp() -> bool:
        return any("pfs-tmp" in n for n in client.listdir(workdir))

    for i, delay in enumerate((0.0, 0.05, 0.1, 0.2, 0.4, 0.8)):
        out = tmp_path / f"got{i}"
        rc = _interrupt([*cli, "get", f"{workdir}/big", str(out)], env, delay, local_tmp)
        statuses.append(rc)
        assert rc in (0, 130), rc  # before the fix: -11 (liburing) in 2 of 15 such tries
        assert not out.exists() or out.stat().st_size == len(data)
        assert not [p for p in tmp_path.iterdir() if "pfs-tmp" in p.name]
        dest = f"{workdir}/put{i}"
        rc = _interrupt([*cli, "put", str(big), dest], env, delay, remote_tmp)
        assert rc in (0, 130), rc
        assert not client.exists(dest) or client.stat(dest).st_size == len(data)
    assert not [n for n in client.listdir(workdir) if "pfs-tmp" in n]
    assert 130 in statuses


def test_admin_status_shows_every_server(client_toml: Path) -> None:
    r = _pfs(client_toml, "admin", "status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["meta"]["protocol"] >= 1 and ":" in st["meta"]["address"]
    assert len(st["servers"]) >= 4
    for s in st["servers"]:
        assert s["state"] == "up" and s["address"].startswith("127.0.0.1:")
        assert 0 <= s["heartbeat_age"] < 60 and s["total"] > 0
        assert s["version"] and s["protocol"] == [PROTOCOL_MIN, PROTOCOL_MAX]
    human = _pfs(client_toml, "admin", "status").stdout.decode()
    assert all(s["address"] in human for s in st["servers"]) and "heartbeat" in human
    assert "req/s" in human and "protocol" in human


def test_admin_status_shows_load_and_admin_servers_agrees(client_toml: Path) -> None:
    """Load is what each data server served over its last heartbeat interval (1 s):
    writing a file over and over shows up in it (reads may go short-circuit, past the
    servers' RPCs); ``admin servers`` prints the same records."""
    import pfs

    with pfs.connect(config=client_toml) as c:
        blob = os.urandom(1 << 20)
        deadline = time.monotonic() + 30
        busy: list[dict[str, object]] = []
        while not busy and time.monotonic() < deadline:
            t_end = time.monotonic() + 1.5
            while time.monotonic() < t_end:
                c.write_file("/load-probe", blob)
            st = json.loads(_pfs(client_toml, "admin", "status", "--json").stdout)
            busy = [s for s in st["servers"] if s["load"] and s["load"]["requests"] > 0
                    and s["load"]["bytes_in"] > 0]
        c.remove("/load-probe")
    assert busy, st
    assert all(set(s["load"]) == {"requests", "bytes_in", "bytes_out", "connections"}
               for s in st["servers"])
    listed = json.loads(_pfs(client_toml, "admin", "servers", "--json").stdout)
    key = [(s["sid"], s["address"], s["state"], s["domain"], s["version"]) for s in listed]
    assert key == [(s["sid"], s["address"], s["state"], s["domain"], s["version"])
                   for s in st["servers"]]
    table = _pfs(client_toml, "admin", "servers").stdout.decode()
    assert all(s["sid"] in table for s in listed) and "req/s" in table


def test_cluster_commands_on_nothing_and_an_unreachable_metaserver(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PFS_CONFIG"}

    def run(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "pfs.tools.cli", *args],
                              capture_output=True, env=env, timeout=120)

    r = run("cluster", "down", "--dir", str(tmp_path))
    assert r.returncode == 0 and b"no cluster was running" in r.stdout
    _one_clean_line(run("cluster", "down", "--dir", str(tmp_path / "none")), "ENOENT")
    r = run("ls", "--meta", "127.0.0.1:1")
    err = _one_clean_line(r, "127.0.0.1:1", "unreachable")
    assert r.returncode == 69 and err.count("127.0.0.1:1") == 1, err

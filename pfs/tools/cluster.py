"""A local cluster on loopback: one metaserver and N data servers as background
processes under one directory.

Layout of DIR::

    cluster.toml      what was started (metaserver port, number of data servers)
    client.toml       everything a client needs to connect (metaserver, key or certificates)
    meta.toml         the metaserver's config (keys, node keys), mode 0600
    keys/             cluster.key (servers), client.key (the node key "local", an admin
                      key: it may act as root), mode 0600;
                      or certs/ (``--tls``: a CA, the server and the client certificates)
    meta/             the metaserver's LMDB
    data/dsN/         data server N's objects
    run/*.pid         process ids
    logs/*.log        server logs

Readiness comes from the servers themselves: each is started with ``--ready-fd`` and
writes its bound port to that pipe once it serves.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pfs.core import config as cfgmod
from pfs.core.daemon import wait_ready

log = logging.getLogger(__name__)

READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


@dataclass
class ClusterSpec:
    meta_port: int = 0
    data_servers: int = 4
    host: str = "127.0.0.1"
    tls: bool = False  # mutual TLS instead of keys (fixed at the first start)


CLIENT_KEY_NAME = "local"


def init(d: Path, tls: bool = False) -> list[Path]:
    """Create what a secured cluster in ``d`` needs (kept if present): the cluster key
    and the node key of local clients, or (``tls``) a CA and certificates."""
    d = d.resolve()
    d.mkdir(parents=True, exist_ok=True)
    if tls:
        from pfs.tools.certs import generate

        return generate(d / "certs", clients=["client"])
    from pfs.core.auth import create_key

    keys = d / "keys"
    keys.mkdir(mode=0o700, exist_ok=True)
    os.chmod(keys, 0o700)
    out = []
    for name in ("cluster.key", "client.key"):
        create_key(keys / name)
        out.append(keys / name)
    return out


def _security(d: Path, spec: ClusterSpec) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Security settings: of the metaserver, of clients, and data server arguments."""
    if spec.tls:
        c = d / "certs"
        server = {"tls_cert": str(c / "server.pem"), "tls_key": str(c / "server.key"),
                  "tls_ca": str(c / "ca.pem")}
        client = {"tls_cert": str(c / "client.pem"), "tls_key": str(c / "client.key"),
                  "tls_ca": str(c / "ca.pem")}
        dcfg = d / "data.toml"
        _write(dcfg, "".join(f'{k} = "{v}"\n' for k, v in server.items()))
        return server, client, ["--config", str(dcfg)]
    k = d / "keys"
    # the local clients' key is an admin key, explicitly (ADMIN_NOTICE); keys added with
    # ``pfs admin key create --cluster DIR`` are kept across restarts
    meta = {"key_file": str(k / "cluster.key"),
            "node_keys": [cfgmod.NodeKey(CLIENT_KEY_NAME, str(k / "client.key"),
                                         allow_root=True),
                          *(nk for nk in _node_keys(d) if nk.name != CLIENT_KEY_NAME)]}
    client = {"key_file": str(k / "client.key"), "key_name": CLIENT_KEY_NAME}
    return meta, client, ["--key-file", str(k / "cluster.key")]


def _node_keys(d: Path) -> list[cfgmod.NodeKey]:
    """The node keys the existing meta.toml of ``d`` lists."""
    p = d / "meta.toml"
    if not p.exists():
        return []
    return cfgmod.load(cfgmod.MetaConfig, p).node_keys


def admin_notice(d: Path) -> str:
    """What ``pfs cluster up`` says about the key its client.toml holds."""
    key = d.resolve() / "keys" / "client.key"
    return (f"client.toml holds the admin key {CLIENT_KEY_NAME!r} ({key}): it may act as "
            f"root (allow_root). Give other nodes keys without root: pfs admin key create "
            f"NAME --cluster {d} --uids LO-HI")


class ClusterError(RuntimeError):
    pass


def _spec_path(d: Path) -> Path:
    return d / "cluster.toml"


def load_spec(d: Path) -> ClusterSpec | None:
    p = _spec_path(d)
    if not p.exists():
        return None
    with p.open("rb") as f:
        return cfgmod.from_dict(ClusterSpec, tomllib.load(f), str(p))


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def running(d: Path) -> dict[str, int]:
    """Processes of the cluster in ``d`` that are alive: name -> pid."""
    out = {}
    for pf in sorted((d / "run").glob("*.pid")):
        pid = _read_pid(pf)
        if pid and _pid_alive(pid):
            out[pf.stem] = pid
    return out


def _start(d: Path, name: str, argv: list[str]) -> int:
    """Start one server in its own session; return the port it reports on its ready pipe."""
    rfd, wfd = os.pipe()
    os.set_inheritable(wfd, True)
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, str(d / "logs" / f"{name}.log"),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
               (os.POSIX_SPAWN_DUP2, 1, 2)]
    try:
        # posix_spawn, not Popen: the servers outlive this process, so there is no
        # Popen object to wait on (and none to warn about an unwaited child)
        pid = os.posix_spawn(sys.executable,
                             [sys.executable, "-m", *argv, "--ready-fd", str(wfd)],
                             os.environ, file_actions=actions, setsid=True)
    finally:
        os.close(wfd)

    def exit_status() -> int | None:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        return os.waitstatus_to_exitcode(status) if done else None

    (d / "run" / f"{name}.pid").write_text(f"{pid}\n")
    try:
        line = wait_ready(rfd, READY_TIMEOUT)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        raise ClusterError(f"{name} did not report readiness in {READY_TIMEOUT:g} s; "
                           f"see {d / 'logs' / (name + '.log')}") from None
    finally:
        os.close(rfd)
    if line is None:
        raise ClusterError(f"{name} exited (status {exit_status()}) before serving; "
                           f"see {d / 'logs' / (name + '.log')}")
    return int(line.strip())


def up(d: Path, data_servers: int | None = None, meta_port: int | None = None, *,
       tls: bool | None = None, data_args: list[str] | None = None,
       meta_settings: dict[str, Any] | None = None) -> Path:
    """Start (or restart on its existing data) the cluster in ``d``; return client.toml.

    The cluster is always secured: keys (or, with ``tls``, certificates) are made by
    :func:`init` on the first start. ``data_args`` are extra data server arguments
    (the benchmark's test-only ``--insecure-skip-caps``); ``meta_settings``: metaserver
    config values (tests: a short ``lost_after``)."""
    d = d.resolve()
    for sub in ("run", "logs", "data"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    spec = load_spec(d) or ClusterSpec()
    if tls is not None and load_spec(d) is None:
        spec.tls = tls
    init(d, spec.tls)
    meta_sec, client_sec, data_sec = _security(d, spec)
    meta_cfg = d / "meta.toml"
    _write(meta_cfg, cfgmod.dump(cfgmod.MetaConfig(db=str(d / "meta"), host=spec.host,
                                                   **meta_sec,  # type: ignore[arg-type]
                                                   **(meta_settings or {}))),
           0o600)
    if data_servers is not None:
        if load_spec(d) is not None and data_servers < spec.data_servers:
            raise ClusterError(f"{d} already holds {spec.data_servers} data servers; "
                               "refusing to start fewer (their data would be missing)")
        spec.data_servers = data_servers
    if meta_port is not None:
        spec.meta_port = meta_port
    alive = running(d)
    started: list[str] = []  # stopped again if this start fails or is interrupted
    try:
        if "meta" not in alive:
            port = spec.meta_port
            started.append("meta")
            try:
                spec.meta_port = _start(d, "meta", ["pfs.metaserver", "--config", str(meta_cfg),
                                                    "--port", str(port)])
            except ClusterError:
                if not port:
                    raise
                log.warning("metaserver port %d unavailable; taking a new one", port)
                spec.meta_port = _start(d, "meta", ["pfs.metaserver", "--config", str(meta_cfg),
                                                    "--port", "0"])
        _write(_spec_path(d), cfgmod.dump(spec))
        meta = f"{spec.host}:{spec.meta_port}"
        for i in range(spec.data_servers):
            name = f"data{i}"
            if name in alive:
                continue
            ddir = d / "data" / f"ds{i}"
            ddir.mkdir(parents=True, exist_ok=True)
            started.append(name)
            _start(d, name, ["pfs.dataserver", *data_sec, "--dir", str(ddir), "--host",
                             spec.host, "--port", "0", "--meta", meta, *(data_args or [])])
        client_path = d / "client.toml"
        _write(client_path, cfgmod.dump(cfgmod.ClientConfig(meta=meta, **client_sec)))  # type: ignore[arg-type]
        _wait_registered(client_path, spec.data_servers)
    except BaseException:
        _stop(d, {n: pid for n, pid in running(d).items() if n in started})
        raise
    return client_path


def _wait_registered(client_toml: Path, n: int) -> None:
    """Return once the metaserver counts ``n`` live data servers."""
    import pfs

    deadline = time.monotonic() + READY_TIMEOUT
    with pfs.connect(config=client_toml) as client:
        while True:
            alive = sum(1 for s in client._run(client.aio.meta.servers).values() if s["alive"])
            if alive >= n:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"only {alive} of {n} data servers registered")
            time.sleep(0.05)


def down(d: Path) -> list[str]:
    """Stop every process of the cluster in ``d`` (data servers first)."""
    d = d.resolve()
    return _stop(d, running(d))


def _stop(d: Path, procs: dict[str, int]) -> list[str]:
    """Stop ``procs`` (name: pid) of the cluster in ``d``: SIGTERM, then SIGKILL for any
    still running after STOP_TIMEOUT; their pid files go."""
    order = sorted(procs, key=lambda n: n == "meta")
    for name in order:
        try:
            os.kill(procs[name], signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT
    for name in order:
        pid = procs[name]
        while _pid_alive(pid) and time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.02)
        if _pid_alive(pid):
            log.warning("%s (pid %d) ignored SIGTERM; killing it", name, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        (d / "run" / f"{name}.pid").unlink(missing_ok=True)
    return order


def status(d: Path) -> dict[str, object]:
    d = d.resolve()
    spec = load_spec(d)
    if spec is None:
        raise ClusterError(f"{d} holds no cluster (no cluster.toml)")
    return {"dir": str(d), "meta": f"{spec.host}:{spec.meta_port}",
            "data_servers": spec.data_servers, "processes": running(d)}

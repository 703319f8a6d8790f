"""deploy/README.md, run: its command blocks, extracted from the file, bring up a cluster of
five hosts (network namespaces with veth pairs on a bridge, each with its own address and
its own directories), then the test checks what the guide promises: striping over the
data hosts, short-circuit reads only where a data server is on the client's host, each
mount seeing the other's files, and the loader running as an ordinary user.

What is not run verbatim, and why (deploy/README.md, "This guide is a test"):

- the ``variables`` block: each host gets its own paths here (one machine, one
  filesystem), so the test sets the names itself, and checks it sets every one;
- the ``install`` block: these machines reach no package index but pip's, and an install
  takes minutes, so ``$PFS_PREFIX/.venv`` is a link to the virtualenv running this test;
- ``services`` blocks: systemd is not PID 1 here, so the block runs with a ``systemctl``
  that records its arguments and with the host's own directory for /etc/systemd/system;
  the test then runs the ExecStartPre/ExecStart lines of each unit started, from the unit
  file the block installed, with the unit's Environment, in the host's namespace
  (``nsenter --net``: a FUSE mount made there is seen by the whole machine).

Readiness comes from the servers: the metaserver's port answers, a data server is listed
alive by the metaserver, a mount appears in mountinfo; each polled under a deadline.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.deploy_guide import Block, Unit, assigned_names, blocks, load_unit, started_units

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "deploy" / "README.md"
pytestmark = pytest.mark.slow

HOSTS = ("meta", "data1", "data2", "client1", "client2")
DATA_HOSTS = ("data1", "data2", "client2")
CLIENT_HOSTS = ("client1", "client2")
LOADER_UID = LOADER_GID = 1000
LOADER_USER = "alice"  # a name in paths and the key's name; the test runs uid 1000
READY = 60.0  # seconds a server or mount may take to be ready
BLOCK_TIMEOUT = 90.0
SMOKE = f"/users/{LOADER_USER}/smoke/model.safetensors"

# run in a host's namespace: connect to HOST:PORT until it answers or the deadline passes
TCP_PROBE = """
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
while True:
    try:
        socket.create_connection((host, port), timeout=1).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"{host}:{port} did not answer")
        time.sleep(0.05)
"""
# run on the meta host with the admin config: until the metaserver lists ADDR alive
REGISTERED_PROBE = """
import sys, time
import pfs
from pfs.tools.fscmds import live_servers
cfg, addr, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
with pfs.connect(config=cfg) as c:
    while not any(s["host"] == addr and s["alive"] for s in live_servers(c).values()):
        if time.monotonic() > deadline:
            sys.exit(f"no data server of {addr} registered")
        time.sleep(0.05)
"""
# run as the loader on a client host: read the file, print the short-circuit counters
READ_PROBE = """
import json, sys
import pfs
with pfs.connect() as c:
    with c.open(sys.argv[1], "rb") as f:
        n = len(f.read())
    print(json.dumps({"bytes": n, **c.aio.local.stats}))
"""


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    root: Path
    procs: list[tuple[Unit, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def prefix(self) -> Path:
        return self.root / "opt"

    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def var(self) -> Path:
        return self.root / "var"

    @property
    def mnt(self) -> Path:
        return self.root / "mnt"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def units(self) -> Path:
        return self.root / "systemd"


@dataclass
class Lab:
    tmp: Path
    hosts: dict[str, Host]
    outputs: dict[tuple[int, str], str] = field(default_factory=dict)  # (line, host)

    def env(self, h: Host) -> dict[str, str]:
        """The guide's variables on host ``h``, over this process's environment (which
        carries PYTHONPATH: the servers import this checkout)."""
        return dict(os.environ,
                    META_ADDR=self.hosts["meta"].addr, PFS_PREFIX=str(h.prefix),
                    PFS_SRC=str(ROOT), PFS_ETC=str(h.etc), PFS_VAR=str(h.var),
                    PFS_DIST=str(self.tmp / "dist"), PFS_MNT=str(h.mnt),
                    LOADER_USER=LOADER_USER, LOADER_UID=str(LOADER_UID),
                    LOADER_GID=str(LOADER_GID), LOADER_HOME=str(h.home),
                    PATH=f"{h.prefix}/.venv/bin:{os.environ['PATH']}")

    def run(self, h: Host, argv: list[str], *, as_loader: bool = False,
            env: dict[str, str] | None = None, timeout: float = BLOCK_TIMEOUT,
            what: str = "") -> str:
        """``argv`` in ``h``'s namespace (as the loader: its uid, gid and HOME); its
        output, or an assertion naming ``what`` with the output."""
        e = env or self.env(h)
        pre = ["nsenter", f"--net=/run/netns/{h.ns}"]
        if as_loader:
            pre += ["setpriv", f"--reuid={LOADER_UID}", f"--regid={LOADER_GID}",
                    "--clear-groups"]
            e = dict(e, HOME=str(h.home))
        r = subprocess.run([*pre, *argv], env=e, cwd=h.home if as_loader else h.root,
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, (f"{what or argv} on {h.name} failed ({r.returncode}):\n"
                                   f"{r.stdout}{r.stderr}")
        return r.stdout

    def probe(self, h: Host, code: str, *args: str, as_loader: bool = False) -> str:
        return self.run(h, [sys.executable, "-c", code, *args], as_loader=as_loader,
                        what=f"probe {code.strip().splitlines()[-1]!r}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def lab() -> Iterator[Lab]:
    from tests.fuse_fixtures import fuse_usable

    if (why := fuse_usable()) is not None:
        pytest.skip(why)
    if not shutil.which("nsenter") or not shutil.which("setpriv"):
        pytest.skip("needs nsenter and setpriv (util-linux)")
    tag = f"{os.getpid() % 100000}"
    net = f"10.243.{os.getpid() % 250 + 1}"
    bridge = f"pdb{tag}"
    tmp = Path(tempfile.mkdtemp(prefix="pfs-deploy-guide-"))
    os.chmod(tmp, 0o755)  # the loader reaches its home and the mounts
    hosts: dict[str, Host] = {}
    made_bridge = False
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_bridge = True
        _ip("link", "set", bridge, "up")
        for i, name in enumerate(HOSTS):
            h = Host(name, f"pfs-dg{tag}-{name}", f"{net}.{i + 1}", tmp / name)
            _ip("netns", "add", h.ns)
            hosts[name] = h
            inner, outer = f"pd{tag}v{i}", f"pd{tag}e{i}"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", h.ns)
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", inner)
            _ip("-n", h.ns, "link", "set", inner, "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            for d in (h.root, h.units):
                d.mkdir(mode=0o755)
                os.chmod(d, 0o755)
            h.home.mkdir()
            os.chown(h.home, LOADER_UID, LOADER_GID)  # the loader's home exists
        yield Lab(tmp, hosts)
    finally:
        _teardown(hosts)
        for i, h in enumerate(hosts.values()):
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True, timeout=30)
            # a veth not yet moved into its namespace (set-up failed half way)
            subprocess.run(["ip", "link", "del", f"pd{tag}e{i}"], capture_output=True,
                           timeout=30)
        if made_bridge:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


def _teardown(hosts: dict[str, Host]) -> None:
    """Stop what the services blocks started: mounts first (their ExecStop), then data
    servers, then the metaserver."""
    order = [h for h in hosts.values() if h.name.startswith("client")]
    order += [h for h in hosts.values() if h not in order and h.name != "meta"]
    order += [h for h in hosts.values() if h.name == "meta"]
    for h in order:
        for unit, proc in reversed(h.procs):
            for argv in unit.exec_stop:
                subprocess.run(["nsenter", f"--net=/run/netns/{h.ns}", *argv],
                               capture_output=True, timeout=60)
            if unit.name.startswith("pfs-mount@") and os.path.ismount(h.mnt):
                subprocess.run(["umount", "-l", str(h.mnt)], capture_output=True, timeout=30)
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)


# -- running the blocks -----------------------------------------------------------------
def _run_block(lab: Lab, b: Block, h: Host) -> None:
    if b.step == "variables":
        want = set(lab.env(h)) & assigned_names(b)
        assert assigned_names(b) == want, f"the test does not set {assigned_names(b) - want}"
        return
    if b.step == "install":
        assert 'python3 -m venv "$PFS_PREFIX/.venv"' in b.text and "pip\" install" in b.text
        _install(h)
        return
    text = b.text
    env = lab.env(h)
    if b.step == "services":
        assert "/etc/systemd/system" in text
        calls = h.root / f"systemctl-{b.line}"
        # one call a line, its arguments separated by \x1f (an escaped instance name
        # holds backslashes)
        text = ('systemctl() { printf "%s\\037" "$@" >> "$PFS_TEST_SYSTEMCTL"; '
                'echo >> "$PFS_TEST_SYSTEMCTL"; }\n'
                + text.replace("/etc/systemd/system", str(h.units)))
        env["PFS_TEST_SYSTEMCTL"] = str(calls)
    out = lab.run(h, ["bash", "-euo", "pipefail", "-c", text], as_loader=b.as_user == "loader",
                  env=env, what=f"deploy/README.md block at line {b.line}")
    lab.outputs[(b.line, h.name)] = out
    if b.step == "services":
        units = started_units(calls.read_text())
        assert units, f"block at line {b.line} started no unit"
        for name in units:
            _start_unit(lab, h, name)


def _install(h: Host) -> None:
    """What the install block makes, without a package index: ``$PFS_PREFIX/.venv``, a
    virtualenv of a Python the loader's uid may run, that sees the packages of this
    test's virtualenv (a .pth file) and has the ``pfs`` script pip would write. pfs
    itself comes from PYTHONPATH: this checkout."""
    venv = h.prefix / ".venv"
    h.prefix.mkdir(mode=0o755)
    os.chmod(h.prefix, 0o755)
    subprocess.run([_loader_python(), "-m", "venv", "--without-pip", str(venv)], check=True,
                   capture_output=True, timeout=60)
    site = sysconfig.get_paths()["purelib"]
    (venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
     / "pfs-test-shared.pth").write_text(f"import site; site.addsitedir({site!r})\n")
    script = venv / "bin" / "pfs"
    script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom pfs.tools.cli import main\n"
                      "sys.exit(main())\n")
    script.chmod(0o755)


@functools.lru_cache(maxsize=1)
def _loader_python() -> str:
    """This Python, or the system's of the same version, whichever the loader's uid may
    run (this one may live under a home directory closed to others)."""
    want = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for cand in (sys.executable, f"/usr/bin/python{want}"):
        r = subprocess.run(["setpriv", f"--reuid={LOADER_UID}", f"--regid={LOADER_GID}",
                            "--clear-groups", "sh", "-c",
                            'exec "$0" -c "import sys; print(*sys.version_info[:2], sep=\'.\')"',
                            cand], capture_output=True, text=True, timeout=30, cwd="/")
        if r.returncode == 0 and r.stdout.strip() == want:
            return cand
    pytest.skip(f"no Python {want} that uid {LOADER_UID} may run")


def _start_unit(lab: Lab, h: Host, name: str) -> None:
    unit = load_unit(h.units, name, {"/opt/pfs": str(h.prefix), "/etc/pfs": str(h.etc)})
    env = dict(lab.env(h), **unit.environment)
    for argv in unit.exec_start_pre:
        lab.run(h, argv, env=env, what=f"{name} ExecStartPre")
    log = (h.root / f"{name}.log").open("ab")
    proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{h.ns}", *unit.exec_start],
                            env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    h.procs.append((unit, proc))
    try:
        _wait_ready(lab, h, unit)
    except AssertionError as exc:
        text = (h.root / f"{name}.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{exc}\n--- {name} on {h.name}:\n{text}") from None
    assert proc.poll() is None, f"{name} on {h.name} exited ({proc.returncode})"


def _wait_ready(lab: Lab, h: Host, unit: Unit) -> None:
    if unit.name == "pfs-meta":
        cfg = tomllib.loads((h.etc / "meta.toml").read_text())
        lab.probe(h, TCP_PROBE, cfg["host"], str(cfg["port"]), str(READY))
    elif unit.name.startswith("pfs-data@"):
        meta = lab.hosts["meta"]
        lab.probe(meta, REGISTERED_PROBE, str(meta.etc / "admin.toml"), h.addr, str(READY))
    elif unit.name.startswith("pfs-mount@"):
        mnt = unit.exec_start[unit.exec_start.index("mount") + 3]  # mount --config C MNT
        proc = h.procs[-1][1]
        deadline = time.monotonic() + READY
        while not os.path.ismount(mnt):
            assert proc.poll() is None, f"the mount on {h.name} exited ({proc.returncode})"
            assert time.monotonic() < deadline, f"{mnt} not mounted in {READY} s"
            time.sleep(0.05)
    else:
        raise AssertionError(f"no readiness check for unit {unit.name}")


# -- the test -----------------------------------------------------------------------------
def test_the_guide_deploys_a_working_cluster(lab: Lab) -> None:
    guide = blocks(GUIDE, HOSTS)
    steps = {b.step for b in guide}
    assert {"variables", "install", "services"} <= steps
    for b in guide:
        for name in b.hosts:
            _run_block(lab, b, lab.hosts[name])
    hosts = lab.hosts
    meta, c1, c2 = hosts["meta"], hosts["client1"], hosts["client2"]

    status = [out for (_line, name), out in lab.outputs.items() if "data servers:" in out]
    assert status and "data servers: 3 of 3 up" in status[0], status
    # the loader blocks ran as uid 1000 on both client hosts and checked the tensor
    loads = [out for (_line, name), out in lab.outputs.items()
             if name in CLIENT_HOSTS and "values: OK" in out]
    assert len(loads) == 2, lab.outputs
    st = os.stat(c1.mnt / SMOKE.lstrip("/"))
    assert (st.st_uid, st.st_gid) == (LOADER_UID, LOADER_GID)

    # striped over the three data hosts, each holding object files of it
    lay = json.loads(lab.run(meta, ["pfs", "getstripe", "--json", "--config",
                                    str(meta.etc / "admin.toml"), SMOKE]))
    where = [[a.rpartition(":")[0] for a in stripe] for stripe in lay["addresses"]]
    assert {a for stripe in where for a in stripe} == {hosts[n].addr for n in DATA_HOSTS}
    assert len({stripe[0] for stripe in where}) >= 2, where
    for n in DATA_HOSTS:
        objects = [p for p in (hosts[n].var / "data").rglob("*")
                   if p.is_file() and p.stat().st_size > 0]
        assert objects, f"no object files on {n}"

    # short-circuit only where a data server shares the client's host (client2)
    stats = {}
    for h in (c1, c2):
        env = dict(lab.env(h), HOME=str(h.home),
                   PFS_CONFIG=str(h.home / ".config" / "pfs" / "client.toml"))
        out = lab.run(h, [sys.executable, "-c", READ_PROBE, SMOKE], as_loader=True, env=env,
                      what="read probe")
        stats[h.name] = json.loads(out)
    assert stats["client1"]["bytes"] == stats["client2"]["bytes"] > 4 << 20
    assert stats["client1"]["local_bytes"] == 0 and stats["client1"]["fds"] == 0, stats
    assert stats["client2"]["local_bytes"] > 0, stats

    # each mount sees what was written through the other
    data = (c2.mnt / SMOKE.lstrip("/")).read_bytes()
    assert data == (c1.mnt / SMOKE.lstrip("/")).read_bytes() and len(data) > 4 << 20
    note = c2.mnt / "users" / LOADER_USER / "from-client2"
    lab.run(c2, ["sh", "-c", 'printf "written on client2" > "$1"', "sh", str(note)],
            as_loader=True, what="a write through client2's mount")
    assert (c1.mnt / note.relative_to(c2.mnt)).read_text() == "written on client2"
    assert "from-client2" in os.listdir(c1.mnt / "users" / LOADER_USER)

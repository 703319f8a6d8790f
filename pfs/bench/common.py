"""What every benchmark shares: sizes, CPU accounting from /proc, cache dropping,
the cluster under test, and the printing of results.

Units: GB/s is 10^9 bytes per second (as dd prints MB/s = 10^6 B/s). CPU seconds are
utime + stime from ``/proc/PID/stat`` of this process, its benchmark children and the
server processes under test; "GB/s per core" is bytes / CPU seconds / 10^9, i.e. how
many GB one fully busy core moves on that path.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfs.tools.output import Progress

GB = 1e9
CLK_TCK = os.sysconf("SC_CLK_TCK")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text: str) -> int:
    """``1G``, ``64M``, ``512k``, ``4096``: binary multiples (1G = 2^30 bytes)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# -- CPU accounting ------------------------------------------------------------------
def proc_cpu(pid: int, children: bool = False) -> float:
    """utime + stime of ``pid`` in seconds (+ its reaped children's with ``children``);
    0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(v[11]) + int(v[12])
    if children:
        ticks += int(v[13]) + int(v[14])
    return ticks / CLK_TCK


def self_cpu() -> float:
    """This process's CPU seconds, every thread included (the trio client thread too)."""
    t = os.times()
    return t.user + t.system


def machine_cpu() -> tuple[int, int]:
    """(total, idle) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    return sum(v), v[3] + v[4]


class CpuMeter:
    """CPU seconds spent by this process and a set of other processes over a span,
    and how busy the whole machine was."""

    def __init__(self, pids: Iterable[int] = ()) -> None:
        self.pids = list(pids)

    def snapshot(self) -> tuple[float, dict[int, float], tuple[int, int]]:
        return self_cpu(), {p: proc_cpu(p) for p in self.pids}, machine_cpu()

    @contextlib.contextmanager
    def span(self, out: dict[str, Any]) -> Iterator[None]:
        s0, p0, m0 = self.snapshot()
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        s1, p1, m1 = self.snapshot()
        out["seconds"] = t1 - t0
        out["cpu_self_s"] = s1 - s0
        out["cpu_servers_s"] = sum(p1[p] - p0.get(p, 0.0) for p in p1)
        tot, idle = m1[0] - m0[0], m1[1] - m0[1]
        out["machine_busy_pct"] = round(100.0 * (tot - idle) / tot, 1) if tot else 0.0


def rate_fields(nbytes: int, out: dict[str, Any], extra_cpu: float = 0.0) -> dict[str, Any]:
    """Add GB/s, CPU seconds and GB/s per core to a span's record."""
    cpu = out.get("cpu_self_s", 0.0) + out.get("cpu_servers_s", 0.0) + extra_cpu
    out["cpu_total_s"] = cpu
    out["bytes"] = nbytes
    out["GBps"] = nbytes / out["seconds"] / GB if out["seconds"] > 0 else 0.0
    # a span shorter than a clock tick can read 0 CPU seconds: report that as unknown (0)
    out["GBps_per_core"] = nbytes / cpu / GB if cpu > 0 else 0.0
    return out


# -- page cache ----------------------------------------------------------------------
def drop_caches() -> bool:
    """sync, then drop the page cache, dentries and inodes (root only). True if dropped."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# -- random data ---------------------------------------------------------------------
def random_buffer(size: int) -> bytearray:
    """``size`` bytes of random data (incompressible, no zero blocks), made in 64 MiB
    pieces so the peak memory is the buffer itself."""
    buf = bytearray(size)
    view = memoryview(buf)
    step = 64 << 20
    try:
        import numpy as np  # fast when present; otherwise os.urandom

        rng = np.random.default_rng()
        for off in range(0, size, step):
            n = min(step, size - off)
            view[off:off + n] = rng.bytes(n)
    except ImportError:
        for off in range(0, size, step):
            n = min(step, size - off)
            view[off:off + n] = os.urandom(n)
    return buf


# -- the cluster under test ----------------------------------------------------------
@dataclass
class ClusterUnderTest:
    client_toml: Path
    pids: dict[str, int] = field(default_factory=dict)
    own: bool = False
    dir: Path | None = None


def cluster_pids(d: Path) -> dict[str, int]:
    from pfs.tools import cluster

    try:
        return cluster.running(d)
    except OSError:
        return {}


@contextlib.contextmanager
def cluster_in_dir(d: Path, data_servers: int) -> Iterator[Path]:
    """The cluster of ``--dir``: used as it is when running; otherwise started there
    (with ``data_servers`` if the directory holds none yet) and stopped afterwards, its
    data kept, so a benchmark leaves no servers behind that it started."""
    from pfs.tools import cluster

    was_running = bool(cluster_pids(d))
    toml = cluster.up(d, data_servers=None if cluster.load_spec(d) else data_servers)
    try:
        yield toml
    finally:
        if not was_running:
            cluster.down(d)


@contextlib.contextmanager
def cluster_for(args: Any, workdir: Path, data_servers: int = 4) -> Iterator[ClusterUnderTest]:
    """The cluster to measure: ``--config`` (an existing one; server CPU counted when its
    client.toml sits in a cluster directory), ``--dir`` (used if running; else started
    there and stopped afterwards, its data kept), or a fresh one of ``data_servers`` in
    ``workdir/cluster``, stopped and removed afterwards."""
    from pfs.tools import cluster

    if getattr(args, "config", None):
        toml = Path(args.config).resolve()
        yield ClusterUnderTest(toml, cluster_pids(toml.parent), False, toml.parent)
        return
    if getattr(args, "dir", None):
        d = Path(args.dir).resolve()
        with cluster_in_dir(d, data_servers) as toml:
            yield ClusterUnderTest(toml, cluster_pids(d), False, d)
        return
    d = workdir / "cluster"
    t0 = time.perf_counter()
    try:
        # ``--no-checksums``: measure what block checksums cost (data servers keep none)
        toml = cluster.up(d, data_servers=data_servers,
                          data_args=["--no-checksums"] if getattr(args, "no_checksums", False)
                          else None)
        log(f"started a local cluster (1 metaserver, {data_servers} data servers) in {d} "
            f"in {time.perf_counter() - t0:.1f} s")
        yield ClusterUnderTest(toml, cluster_pids(d), True, d)
    finally:
        cluster.down(d)
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def work_dir(base: str | None, prefix: str) -> Iterator[Path]:
    """A private scratch directory (removed afterwards) on the filesystem of ``base``."""
    parent = Path(base) if base else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- the machine -----------------------------------------------------------------
def machine_info(path: Path | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_GiB"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    if path is not None:
        info["fs"] = fs_of(path)
    return info


def fs_of(path: Path) -> str:
    """'<source> <fstype>' of the mount holding ``path``."""
    path = Path(path).resolve()
    best, out = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                src, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) \
                        and len(mnt) >= len(best):
                    best, out = mnt, f"{src} {fstype} on {mnt}"
    except OSError:
        pass
    return out


# -- output ----------------------------------------------------------------------
_bar: Progress | None = None  # the benchmark's step bar while one runs (``steps``)


def log(msg: str) -> None:
    if _bar is not None:
        _bar.write(msg)  # above the bar, not through it
    else:
        print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def steps(total: int, label: str, unit: str = "step") -> Iterator[Progress]:
    """A progress bar over a benchmark's ``total`` steps (reps, points) on a terminal,
    nothing otherwise (pfs/tools/output.py); :func:`log` writes above it meanwhile."""
    global _bar
    with Progress(total, label, unit=unit) as bar:
        _bar = bar
        try:
            yield bar
        finally:
            _bar = None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median of the numeric fields of ``runs``."""
    if not runs:
        return {}
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = median([r[k] for r in runs if k in r])
        else:
            out[k] = v
    return out


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def bench_main(name: str, doc: str | None, add_args: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], dict[str, Any]],
               report: Callable[[dict[str, Any]], str], argv: list[str]) -> int:
    """The shape every ``pfs bench NAME`` shares: parse, run, print the report, --json."""
    p = argparse.ArgumentParser(prog=f"pfs bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    args = p.parse_args(argv)
    res = run(args)
    print(report(res))
    write_json(args.json, res)
    return 0


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    log(f"results written to {path}")


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def aim(text: str, value: float | None, target: float) -> str:
    """One aim and whether this run met it: ``value >= target`` (None: not measured)."""
    if value is None:
        return f"aim: {text}: not measured in this run"
    return f"aim: {text}: {'met' if value >= target else 'NOT met'} ({value:,.3g})"


def run_quiet(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, **kw)

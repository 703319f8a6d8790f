"""The reference IO500 harness beside ``pfs bench io500``: the harness's config for the
same parameters, running it under mpirun, reading its output, and the side-by-side table
of ``pfs bench io500 --compare``.

The harness is IO500/io500 built against hpc/ior and VI4IO/pfind (see
``deploy/io500-reference.sh``); it is found by ``--reference PATH`` or ``$PFS_IO500_REFERENCE``.
Nothing here needs it installed except :func:`run_reference`.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shlex
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_REFERENCE = "PFS_IO500_REFERENCE"  # path of the built io500 binary
ENV_MPIRUN = "PFS_IO500_MPIRUN"  # the mpirun command line before -np (default: see mpirun_argv)

# the twelve scored phases, in the harness's order
SCORED = ["ior-easy-write", "mdtest-easy-write", "ior-hard-write", "mdtest-hard-write",
          "find", "ior-easy-read", "mdtest-easy-stat", "ior-hard-read", "mdtest-hard-stat",
          "mdtest-easy-delete", "mdtest-hard-read", "mdtest-hard-delete"]

RESULT = re.compile(r"^\[(?:RESULT|      )\]\s+(?P<name>[A-Za-z0-9-]+)\s+(?P<value>[0-9.eE+-]+)\s+"
                    r"(?P<unit>GiB/s|kIOPS) : time\s+(?P<time>[0-9.]+) seconds"
                    r"(?P<invalid> \[INVALID\])?\s*$")
SCORE = re.compile(r"^\[SCORE ?\]\s+Bandwidth\s+(?P<bw>[0-9.eE+-]+) GiB/s : IOPS\s+"
                   r"(?P<md>[0-9.eE+-]+) kiops : TOTAL\s+(?P<total>[0-9.eE+-]+)"
                   r"(?P<invalid> \[INVALID\])?")


@dataclass
class RefParams:
    """The parameters both tools get: process count, stonewall and the size caps."""

    procs: int
    stonewall: int  # the harness takes whole seconds
    easy_size: int  # ior-easy bytes per process (IOR -b)
    hard_segments: int  # ior-hard segments per process (IOR -s)
    easy_files: int  # mdtest-easy -n
    hard_files: int  # mdtest-hard -n
    datadir: str  # where the harness writes (it appends a timestamp)
    resultdir: str


def reference_ini(p: RefParams) -> str:
    """The harness's config for ``p``. Its unscored ior-rnd4K-easy-read phase is switched
    off: pfs bench io500 has no counterpart and it would only lengthen the run."""
    return "\n".join([
        "[global]",
        f"datadir = {p.datadir}",
        f"resultdir = {p.resultdir}",
        "timestamp-resultdir = FALSE",
        "drop-caches = FALSE",
        "[debug]",
        f"stonewall-time = {p.stonewall}",
        "[ior-easy]",
        "transferSize = 2m",
        f"blockSize = {p.easy_size}",
        "[ior-hard]",
        f"segmentCount = {p.hard_segments}",
        "[mdtest-easy]",
        f"n = {p.easy_files}",
        "[mdtest-hard]",
        f"n = {p.hard_files}",
        "[ior-rnd4K-easy-read]",
        "run = FALSE",
        "",
    ])


def bench_argv(p: RefParams, path: str) -> list[str]:
    """``pfs bench io500`` arguments that match ``p``."""
    return ["--path", path, "-n", str(p.procs), "--stonewall", str(p.stonewall),
            "--easy-size", str(p.easy_size), "--hard-segments", str(p.hard_segments),
            "--easy-files", str(p.easy_files), "--hard-files", str(p.hard_files)]


@dataclass
class Parsed:
    """One run's output: phase -> (score, seconds, valid), and the score line."""

    phases: dict[str, tuple[float, float, bool]] = field(default_factory=dict)
    bw: float = 0.0
    md: float = 0.0
    total: float = 0.0
    valid: bool = False
    cpu: dict[str, float] = field(default_factory=dict)  # phase -> CPU seconds, all ranks


def parse_output(text: str) -> Parsed:
    """Read the ``[RESULT]`` and ``[SCORE ]`` lines that io500 (and pfs bench io500)
    print; anything else (the harness's ERROR INVALID lines, logs) is skipped."""
    out = Parsed()
    for line in text.splitlines():
        m = RESULT.match(line.rstrip())
        if m:
            out.phases[m["name"]] = (float(m["value"]), float(m["time"]), not m["invalid"])
            continue
        m = SCORE.match(line.strip())
        if m:
            out.bw, out.md, out.total = float(m["bw"]), float(m["md"]), float(m["total"])
            out.valid = not m["invalid"]
    return out


def load_compare(path: Path) -> tuple[list[Parsed], list[Parsed]]:
    """The harness's runs and pfs bench's, in order, from a ``compare.json`` that
    ``--compare`` wrote (its path or its results directory)."""
    if path.is_dir():
        path = path / "compare.json"
    data = json.loads(path.read_text())

    def parsed(items: list[dict[str, Any]]) -> list[Parsed]:
        return [Parsed(**{**r, "phases": {k: tuple(v) for k, v in r["phases"].items()}})
                for r in items]

    return parsed(data["harness"]), parsed(data["pfs"])


def pooled_table(paths: Sequence[Path]) -> list[str]:
    """The side-by-side table of one or more ``--compare`` results pooled: every run's
    medians and every interleaved pair's ratio (sets taken minutes apart under a
    drifting load agree or not by the same statistics as one longer set)."""
    refs: list[Parsed] = []
    ours: list[Parsed] = []
    pairs: dict[str, list[float]] = {}
    for path in paths:
        a, b = load_compare(path)
        refs += a
        ours += b
        for name, ratios in paired_ratios(a, b).items():  # pairs stay within their set
            pairs.setdefault(name, []).extend(ratios)
    return compare_table(medians(refs), medians(ours), len(refs), len(ours), spread(refs),
                         pairs) + cpu_table(refs, ours)


def find_reference(explicit: str | None) -> str | None:
    """The io500 binary: ``explicit``, else ``$PFS_IO500_REFERENCE``; None if neither
    names an executable file."""
    for cand in (explicit, os.environ.get(ENV_REFERENCE)):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return None


def mpirun_argv(procs: int) -> list[str]:
    """``mpirun -np N`` for one node: Open MPI refuses root without --allow-run-as-root,
    more ranks than cores without --oversubscribe, and on a machine without a fast
    network shared memory is the transport to ask for."""
    env = os.environ.get(ENV_MPIRUN)
    if env:
        return [*shlex.split(env), "-np", str(procs)]
    argv = ["mpirun"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    return [*argv, "--oversubscribe", "--mca", "btl", "self,vader", "-np", str(procs)]


def tree_cpu(root: int) -> float:
    """utime + stime of ``root``'s live descendants (mpirun's ranks), in seconds."""
    from pfs.bench.common import proc_cpu

    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    total, todo = 0.0, list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        total += proc_cpu(pid)
        todo += kids.get(pid, [])
    return total


def run_reference(binary: str, p: RefParams, workdir: Path, timeout: float = 3600.0
                  ) -> tuple[Parsed, str]:
    """Run the harness once with ``p``; return what it printed, parsed and raw, with the
    CPU time its ranks spent up to each phase's result line (the phase and what led to
    it): on a machine shared with others the rate moves with the share of the CPUs the
    run got, the CPU it needed does not."""
    # absolute: the harness runs in ``workdir`` and must still find its config there
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    Path(p.datadir).mkdir(parents=True, exist_ok=True)
    ini = workdir / "io500-reference.ini"
    ini.write_text(reference_ini(p))
    argv = [*mpirun_argv(p.procs), binary, str(ini)]
    log.info("io500 reference: %s", shlex.join(argv))
    # the harness resolves ./ior etc. only for display; run it where its config lies
    lines: list[str] = []
    cpu: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    with subprocess.Popen(argv, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        last = 0.0
        for line in proc.stdout:
            lines.append(line)
            m = RESULT.match(line.rstrip())
            if m:
                now = tree_cpu(proc.pid)
                cpu[m["name"]], last = max(0.0, now - last), now
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"io500 reference: no end after {timeout:g} s")
        rc = proc.wait()
    text = "".join(lines)
    if rc != 0:
        raise RuntimeError(f"io500 reference exited {rc}:\n{text[-4000:]}")
    out = parse_output(text)
    out.cpu = cpu
    return out, text


def medians(runs: Sequence[Parsed]) -> dict[str, float]:
    """Per phase, the median score over ``runs`` (phases missing from a run skipped)."""
    out: dict[str, float] = {}
    names = [n for n in SCORED if any(n in r.phases for r in runs)]
    for n in names:
        out[n] = statistics.median(r.phases[n][0] for r in runs if n in r.phases)
    for key in ("bw", "md", "total"):
        out[f"score-{key}"] = statistics.median(getattr(r, key) for r in runs)
    return out


def spread(runs: Sequence[Parsed]) -> dict[str, tuple[float, float]]:
    """Per phase, the lowest and highest score over ``runs``: how far one tool moves
    between runs on this machine, the yardstick for the gap between the two."""
    out: dict[str, tuple[float, float]] = {}
    for n in SCORED:
        vals = [r.phases[n][0] for r in runs if n in r.phases]
        if vals:
            out[n] = (min(vals), max(vals))
    return out


TOLERANCE = 0.2  # the agreement asked of each phase: within 20% of the harness

SETTLE_MODES = ("none", "sync", "drop")
SETTLE_DIRTY = 16 << 20  # dirty + writeback bytes below which the page cache is settled
SETTLE_WAIT_S = 30.0


def meminfo_bytes(*keys: str) -> dict[str, int]:
    """Fields of /proc/meminfo in bytes (0 where there is none)."""
    out = dict.fromkeys(keys, 0)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in out:
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def loadavg() -> float:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def settle(mode: str) -> dict[str, float]:
    """Before a run of either tool, what an operator does between benchmark runs: "sync"
    writes back every dirty page (the previous run's cleanup among them, which would
    otherwise be flushed inside the next run's first fsync or mdtest's timed sync()) and
    waits until writeback is done; "drop" then drops the page cache, dentries and inodes
    too (root; it costs other users of the machine their caches). Returns the conditions
    the run starts under: load average, dirty bytes before, seconds the sync took."""
    from pfs.bench.common import drop_caches

    before = meminfo_bytes("Dirty", "Writeback")
    out = {"load1": loadavg(), "dirty_mb": (before["Dirty"] + before["Writeback"]) / 2**20,
           "sync_s": 0.0}
    if mode == "none":
        return out
    t0 = time.monotonic()
    os.sync()
    while time.monotonic() - t0 < SETTLE_WAIT_S:
        now = meminfo_bytes("Dirty", "Writeback")
        if now["Dirty"] + now["Writeback"] < SETTLE_DIRTY:
            break
        time.sleep(0.1)
    out["sync_s"] = time.monotonic() - t0
    if mode == "drop":
        out["dropped"] = float(drop_caches())
    return out


def paired_ratios(refs: Sequence[Parsed], ours: Sequence[Parsed]) -> dict[str, list[float]]:
    """Per phase (and score), ours / harness of each interleaved pair: run k of each tool
    ran side by side in time, so a drifting load moves both; pairs where either lacks
    the phase or the harness scored 0 are left out."""
    out: dict[str, list[float]] = {}
    for a, b in zip(refs, ours, strict=False):
        for n in SCORED:
            if n in a.phases and n in b.phases and a.phases[n][0] > 0:
                out.setdefault(n, []).append(b.phases[n][0] / a.phases[n][0])
        for key in ("bw", "md", "total"):
            x, y = getattr(a, key), getattr(b, key)
            if x > 0:
                out.setdefault(f"score-{key}", []).append(y / x)
    return out


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile); one value is all three."""
    vals = sorted(values)
    if len(vals) == 1:
        return vals[0], vals[0], vals[0]
    q1, q2, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return q1, q2, q3


def within(ratio: float, tol: float = TOLERANCE) -> bool:
    return ratio == ratio and abs(ratio - 1.0) <= tol


def agreement(ref: dict[str, float], ours: dict[str, float],
              pairs: dict[str, list[float]] | None = None) -> list[str]:
    """How many of the twelve phases agree within 20%: by the ratio of the medians and,
    with ``pairs``, by the median of the paired ratios; the phases that do not, with
    their ratio."""
    def line(label: str, ratios: dict[str, float]) -> str:
        off = [f"{n} {r:.2f}" for n, r in ratios.items() if not within(r)]
        ok = len(ratios) - len(off)
        return (f"within {TOLERANCE:.0%} ({label}): {ok} of {len(ratios)} phases"
                + (f"; off: {', '.join(off)}" if off else ""))

    names = [n for n in SCORED if n in ref or n in ours]
    by_medians = {n: (ours.get(n, 0.0) / ref[n] if ref.get(n, 0.0) > 0 else float("nan"))
                  for n in names}
    lines = [line("ratio of medians", by_medians)]
    if pairs is not None:
        by_pairs = {n: quartiles(pairs[n])[1] if pairs.get(n) else float("nan")
                    for n in names}
        lines.append(line("median of paired ratios", by_pairs))
    return lines


def cpu_table(refs: Sequence[Parsed], ours: Sequence[Parsed]) -> list[str]:
    """Per phase, the median CPU seconds both tools' ranks spent (the harness's: up to
    the phase's result line; pfs bench's: its phase with its set-up) and their ratio:
    the work done, unmoved by the share of a busy machine a run got."""
    names = [n for n in SCORED if any(n in r.cpu for r in refs) and any(n in r.cpu
                                                                         for r in ours)]
    if not names:
        return []
    lines = [f"{'CPU s (all ranks)':<20s} {'':>6s} {'harness':>12s} {'pfs bench':>12s} "
             f"{'ratio':>7s}   (medians)"]
    for n in names:
        a = statistics.median(r.cpu[n] for r in refs if n in r.cpu)
        b = statistics.median(r.cpu[n] for r in ours if n in r.cpu)
        ratio = b / a if a > 0 else float("nan")
        lines.append(f"{n:<20s} {'':>6s} {a:12.3f} {b:12.3f} {ratio:7.2f}")
    return lines


def compare_table(ref: dict[str, float], ours: dict[str, float], n_ref: int, n_ours: int,
                  ref_spread: dict[str, tuple[float, float]] | None = None,
                  pairs: dict[str, list[float]] | None = None) -> list[str]:
    """The phases side by side (medians), with ours / harness, the harness's own range
    over its runs, with ``pairs`` the paired ratios' median and interquartile range, a
    mark where the two medians differ by more than 20%, and the count of phases that
    agree (:func:`agreement`)."""
    head = (f"{'phase':<20s} {'unit':>6s} {'harness':>12s} {'pfs bench':>12s} "
            f"{'ratio':>7s} {'harness min-max':>21s}")
    if pairs is not None:
        head += f" {'paired':>7s} {'(interquartile)':>15s}"
    lines = [f"{head}   (medians of {n_ref} / {n_ours} runs)"]
    for name in [*SCORED, "score-bw", "score-md", "score-total"]:
        if name not in ref and name not in ours:
            continue
        unit = "GiB/s" if name.startswith("ior") or name == "score-bw" else \
            ("" if name == "score-total" else "kIOPS")
        a, b = ref.get(name, 0.0), ours.get(name, 0.0)
        ratio = b / a if a > 0 else float("nan")
        lo, hi = (ref_spread or {}).get(name, (float("nan"), float("nan")))
        rng = f"{lo:.4f}-{hi:.4f}" if lo == lo else ""
        row = f"{name:<20s} {unit:>6s} {a:12.4f} {b:12.4f} {ratio:7.2f} {rng:>21s}"
        if pairs is not None:
            if pairs.get(name):
                q1, q2, q3 = quartiles(pairs[name])
                row += f" {q2:7.2f} {f'({q1:.2f}-{q3:.2f})':>15s}"
            else:
                row += f" {'':>7s} {'':>15s}"
        mark = "" if a > 0 and within(ratio) else "  <-- over 20%"
        lines.append(row + mark)
    return lines + agreement(ref, ours, pairs)

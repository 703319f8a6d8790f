"""``pfs bench io500-peers``: the reference IO500 harness on several file systems, one run.

The fair way to compare two storage systems by IO500 is the harness itself on both, with
the same parameters, interleaved so that a machine's drifting load falls on both alike.
This runs the built harness (``deploy/io500-reference.sh``; ``--reference`` or
``$PFS_IO500_REFERENCE``) on each ``LABEL=PATH`` in turn, ``--repeat`` times, and prints
the medians phase by phase with each system's ratio to the first one named::

    pfs bench io500-peers --reference /opt/io500/io500 -n 2 --stonewall 2 --repeat 3 \\
        pfs=/mnt/pfs moosefs=/mnt/mfs

Say in the figures what durability each side had: a pfs mount acknowledges a create once
it is committed and flushed; other systems may answer from memory.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from pfs.bench import io500ref
from pfs.bench.common import parse_size


def _targets(items: list[str]) -> list[tuple[str, Path]]:
    out = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"pfs bench io500-peers: {item!r}: give LABEL=PATH")
        if not Path(path).is_dir():
            raise SystemExit(f"pfs bench io500-peers: {path}: not a directory")
        out.append((label, Path(path)))
    if len({label for label, _ in out}) != len(out):
        raise SystemExit("pfs bench io500-peers: each LABEL once")
    return out


def table(labels: list[str], meds: dict[str, dict[str, float]],
          runs: dict[str, list[io500ref.Parsed]]) -> list[str]:
    """Medians per phase for every label, then each label's ratio to the first."""
    first = labels[0]
    head = f"{'phase':<20s} " + " ".join(f"{lab:>12s}" for lab in labels)
    head += " " + " ".join(f"{lab + '/' + first:>16s}" for lab in labels[1:])
    lines = [head + f"   (medians of {min(len(r) for r in runs.values())} runs)"]
    for name in [*io500ref.SCORED, "score-bw", "score-md", "score-total"]:
        vals = [meds[lab].get(name, 0.0) for lab in labels]
        row = f"{name:<20s} " + " ".join(f"{v:12.4f}" for v in vals)
        base = vals[0]
        row += " " + " ".join(f"{(v / base if base > 0 else float('nan')):16.2f}"
                              for v in vals[1:])
        lines.append(row)
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pfs bench io500-peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", metavar="LABEL=PATH",
                   help="a directory on each file system to compare; the first is the base")
    p.add_argument("--reference", help="the built io500 binary (default $PFS_IO500_REFERENCE)")
    p.add_argument("-n", "--procs", type=int, default=2, help="MPI processes (default 2)")
    p.add_argument("--stonewall", type=int, default=300, help="seconds (default 300)")
    p.add_argument("--easy-size", default="256m", help="ior-easy bytes per process")
    p.add_argument("--hard-segments", type=int, default=10000)
    p.add_argument("--easy-files", type=int, default=5000)
    p.add_argument("--hard-files", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3, help="runs on each (default 3)")
    p.add_argument("--results", default=None, help="results directory")
    p.add_argument("--json", help="also write medians and every run's phases here")
    args = p.parse_args(argv)
    binary = io500ref.find_reference(args.reference)
    if binary is None:
        raise SystemExit("pfs bench io500-peers: no reference harness: pass --reference or set "
                         f"${io500ref.ENV_REFERENCE} (deploy/io500-reference.sh builds it)")
    targets = _targets(args.targets)
    resdir = Path(args.results or f"io500-peers-results/{time.strftime('%Y.%m.%d-%H.%M.%S')}")
    runs: dict[str, list[io500ref.Parsed]] = {label: [] for label, _ in targets}
    for k in range(args.repeat):
        for label, path in targets:  # interleaved: the load's drift falls on all alike
            params = io500ref.RefParams(
                procs=max(1, args.procs), stonewall=args.stonewall,
                easy_size=parse_size(args.easy_size), hard_segments=args.hard_segments,
                easy_files=args.easy_files, hard_files=args.hard_files,
                datadir=str(path.resolve() / "io500-peers"),
                resultdir=str((resdir / f"{label}-{k}").resolve()))
            parsed, text = io500ref.run_reference(binary, params, resdir / f"{label}-{k}")
            (resdir / f"{label}-{k}" / "stdout.txt").write_text(text)
            shutil.rmtree(params.datadir, ignore_errors=True)
            runs[label].append(parsed)
            print(f"run {k + 1}/{args.repeat} {label}: score {parsed.total:.4f}"
                  f"{'' if parsed.valid else ' [INVALID]'}", flush=True)
    labels = [label for label, _ in targets]
    meds = {label: io500ref.medians(runs[label]) for label in labels}
    lines = table(labels, meds, runs)
    print("\n".join(lines))
    (resdir / "peers.txt").write_text("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "medians": meds,
            "runs": {lab: [{"phases": r.phases, "total": r.total, "valid": r.valid}
                           for r in rs] for lab, rs in runs.items()},
            "score_spread": {lab: [min(r.total for r in rs), statistics.median(
                r.total for r in rs), max(r.total for r in rs)] for lab, rs in runs.items()},
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

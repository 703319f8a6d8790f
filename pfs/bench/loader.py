"""``pfs bench loader``: a sharded safetensors checkpoint loaded into CPU tensors by every
path, each load in a fresh process, beside the loaders an ML engineer would otherwise use.

The checkpoint is synthetic but shaped like an LLM's (``--hidden`` wide decoder layers,
llama proportions: q/k/v/o ``hidden x hidden``, gate/up ``inter x hidden``, down
``hidden x inter``, norms; an embedding and an lm_head of ``vocab x hidden``; all bf16
with finite random values), at least ``--size`` bytes in ``--shards`` files plus
``model.safetensors.index.json``. It is written once to a local directory (on the
filesystem that holds the cluster's objects) and copied byte for byte into pfs (stripe
count ``--count``, unit ``--unit``).

Every load runs in a fresh process (``python -m pfs.bench.loader_run``, imports and the
pfs connection before the clock), as a serving process loads: once, into memory it has
never touched. In each repetition every path is loaded cold, then warm, path after path
(the order rotates between repetitions), so all paths share the machine's state of that
moment; medians over ``--reps``. Paths:

- ``st_clone``: ``safetensors.torch.load_file`` + ``.clone()`` of every tensor: private
  memory, the end state ``pfs.load_safetensors`` gives. **The reference** of the aims.
- ``st_touch``: ``load_file`` + one byte of every page read: every byte mapped from the
  page cache (warm: zero-copy, which no copying loader can match). Shown beside.
- ``runai``: Run:ai Model Streamer (``SafetensorsStreamer``, CPU) on the local files.
- ``fastsafetensors``: ``fastsafe_open(..., device="cpu", nogds=True)`` on the local files.
- ``pfs_local``: ``pfs.load_safetensors(local_dir)``.
- ``pfs_sc_on``: ``pfs.load_safetensors(pfs_dir, client=c)``, short-circuit reads (the
  data servers on this host hand over object descriptors).
- ``pfs_sc_map``: the same with ``zero_copy=True``: the local objects' pages mapped
  copy-on-write into the tensors and verified in place, not read (opt-in: the tensors
  alias the stored file).
- ``pfs_sc_off``: the same over TCP only (a node without a local data server).
- ``fuse_st_touch`` / ``fuse_pfs``: ``st_touch`` / ``pfs.load_safetensors`` through a
  ``pfs mount`` of the cluster (off unless named in ``--paths``).

Cold: before the load, the checkpoint's pages are dropped from the page cache — the
local shards and every object file of the data servers (``fsync`` then
``posix_fadvise(DONTNEED)``: only these files, not the whole machine's cache). Warm: the
same files just read. A reference that is not installed (``pip install 'pfs[loaders]'``)
is skipped and said so.

Reported per path: GB/s (tensor bytes / wall seconds), GB/s per core (tensor bytes / CPU
seconds of the loading process, all its threads, + the data servers and metaserver for
pfs paths), seconds to the first tensor a caller can use (``pfs.load_safetensors``: its
first ``on_tensor`` call; short-circuit pfs reads hand tensors out as their bytes land,
other sources when all reads are done), page faults. ``--stability N``: N
consecutive warm loads in one process per path; the spread (max/min - 1) is reported,
over all of them and over those after the first (which read into memory an earlier
load of the process had: ``pfs.load_safetensors`` reuses the buffers of freed
tensors), with each load's CPU seconds, page faults and share of reused buffers.
Each path's tensors are compared bit for bit with safetensors' once (first repetition),
outside the timed span.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pfs.bench import loader_run
from pfs.bench.common import (
    aim,
    bench_main,
    cluster_for,
    fmt_size,
    log,
    machine_info,
    median_record,
    parse_size,
    rate_fields,
    ratio,
    table,
    work_dir,
)

PATHS = loader_run.PATHS
DEFAULT_PATHS = ("st_clone", "st_touch", "runai", "fastsafetensors", "pfs_local", "pfs_sc_on",
                 "pfs_sc_map", "pfs_sc_off")
REFERENCE = "st_clone"  # the fair reference (same end state); st_touch is shown beside it
REFERENCES = ("st_clone", "st_touch")
INDEX = "model.safetensors.index.json"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: the cluster there (a stopped one is "
                                 "started for the run and stopped after)")
    p.add_argument("--config", help="client.toml of a running cluster to use")
    p.add_argument("--size", type=parse_size, default=2 << 30,
                   help="checkpoint size, at least (default 2G)")
    p.add_argument("--shards", type=int, default=4, help="shard files (default 4)")
    p.add_argument("--hidden", type=int, default=4096, help="model width (default 4096)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--count", type=int, default=4, help="pfs stripe count (default 4)")
    p.add_argument("--unit", type=parse_size, default=1 << 20,
                   help="pfs stripe unit (default 1M)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; medians (default 3)")
    p.add_argument("--data-servers", type=int, default=4,
                   help="data servers of the cluster this command starts (default 4)")
    p.add_argument("--local-dir", help="where the local checkpoint (and the bench's own "
                                       "cluster) live; default: the temp dir")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help=f"which paths to measure (default {','.join(DEFAULT_PATHS)}; "
                        f"known: {','.join(PATHS)})")
    p.add_argument("--stability", type=int, default=4,
                   help="consecutive warm loads in one process per path, for the spread "
                        "(default 4; 0: skip)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold loads")
    p.add_argument("--no-fuse", action="store_true", help="skip the FUSE mount paths")
    p.add_argument("--quick", action="store_true",
                   help="tiny: 24M, width 512, vocab 4096, 1 rep, stability 2")
    p.add_argument("--json", help="write all results here")


# -- the checkpoint ------------------------------------------------------------------
def model_tensors(size: int, hidden: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a llama-shaped bf16 model of at least ``size`` bytes."""
    inter = (hidden * 8 // 3 + 255) // 256 * 256  # 4096 -> 11008 (llama-7B)
    inter = 11008 if hidden == 4096 else inter
    layer = [("self_attn.q_proj.weight", (hidden, hidden)),
             ("self_attn.k_proj.weight", (hidden, hidden)),
             ("self_attn.v_proj.weight", (hidden, hidden)),
             ("self_attn.o_proj.weight", (hidden, hidden)),
             ("mlp.gate_proj.weight", (inter, hidden)),
             ("mlp.up_proj.weight", (inter, hidden)),
             ("mlp.down_proj.weight", (hidden, inter)),
             ("input_layernorm.weight", (hidden,)),
             ("post_attention_layernorm.weight", (hidden,))]

    def nbytes(shape: tuple[int, ...]) -> int:
        n = 2
        for d in shape:
            n *= d
        return n

    ends = 2 * nbytes((vocab, hidden)) + nbytes((hidden,))
    per_layer = sum(nbytes(s) for _n, s in layer)
    nlayers = max(1, -(-(size - ends) // per_layer))
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(nlayers):
        out += [(f"model.layers.{i}.{n}", s) for n, s in layer]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def _random_bf16(rng: Any, shape: tuple[int, ...]) -> Any:
    """Random finite bf16 values (|x| < 2): random bits with the top exponent bit clear."""
    import numpy as np
    import torch

    n = 1
    for d in shape:
        n *= d
    bits = np.frombuffer(rng.bytes(2 * n), dtype=np.uint16).copy()
    bits &= 0xBFFF
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shape)


def make_checkpoint(d: Path, size: int, shards: int, hidden: int, vocab: int) -> dict[str, Any]:
    """Write the checkpoint to ``d``; return its description."""
    import numpy as np
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    specs = model_tensors(size, hidden, vocab)
    total = sum(2 * _prod(s) for _n, s in specs)
    shards = max(1, min(shards, len(specs)))
    # consecutive tensors, cut into shards of about total/shards bytes
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shards)]
    acc = 0
    for name, shape in specs:
        g = min(shards - 1, acc * shards // total)
        groups[g].append((name, shape))
        acc += 2 * _prod(shape)
    groups = [g for g in groups if g]
    rng = np.random.default_rng(4)
    weight_map: dict[str, str] = {}
    files = []
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _random_bf16(rng, shape) for name, shape in group}
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        del tensors
        weight_map.update({name: fname for name, _s in group})
        files.append(fname)
    (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                       "weight_map": weight_map}, indent=1))
    for f in files:
        with open(d / f, "rb") as fh:
            os.fsync(fh.fileno())
    return {"tensors": len(specs), "tensor_bytes": total, "shards": len(files),
            "files": files, "file_bytes": sum((d / f).stat().st_size for f in files),
            "hidden": hidden, "vocab": vocab, "dtype": "BF16",
            "layers": sum(1 for n, _s in specs if n.endswith("q_proj.weight"))}


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def copy_to_pfs(c: Any, src: Path, dst: str, files: list[str]) -> None:
    for name in [*files, INDEX]:
        with open(src / name, "rb", buffering=0) as fin, c.open(f"{dst}/{name}", "wb") as fout:
            while chunk := fin.read(64 << 20):
                fout.write(chunk)
            fout.fsync()


# -- fresh processes -----------------------------------------------------------------
def evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache (written back first: ``DONTNEED``
    leaves dirty pages)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def object_files(cluster_dir: Path | None) -> list[str]:
    """Every file under the data servers' directories of a ``pfs cluster`` directory."""
    if cluster_dir is None or not (cluster_dir / "data").is_dir():
        return []
    return [os.path.join(root, f) for root, _d, fs in os.walk(cluster_dir / "data")
            for f in fs]


def runner_argv(path: str, src: str, files: list[str], *, config: str | None = None,
                pids: Sequence[int] = (), repeat: int = 1, verify: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pfs.bench.loader_run", path, "--src", src,
            "--files", ",".join(files), "--repeat", str(repeat)]
    if config:
        argv += ["--config", config]
    if pids:
        argv += ["--pids", ",".join(map(str, pids))]
    if verify:
        argv += ["--verify", verify]
    return argv


def parse_runner(stdout: str) -> dict[str, Any]:
    """The runner's result: its last stdout line that is a JSON object."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                return doc
    raise RuntimeError("the loader runner printed no result line")


def run_fresh(argv: list[str], timeout: float = 1800) -> dict[str, Any]:
    """Run one fresh loader process; its parsed result (RuntimeError with its stderr's
    tail when it fails)."""
    env = dict(os.environ, RUNAI_STREAMER_LOG_LEVEL="WARNING")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:4])} failed (exit {p.returncode}): "
                           f"{p.stderr.strip()[-2000:]}")
    return parse_runner(p.stdout)


def load_record(res: dict[str, Any], i: int = 0) -> dict[str, Any]:
    """Load ``i`` of a runner result as a bench record (rates added)."""
    rec = dict(res["loads"][i])
    rate_fields(rec["bytes"], rec)
    for key in ("short_circuit_bytes", "mapped_bytes"):
        if key in res:
            rec[key] = res[key]
    return rec


def spread(values: list[float]) -> float:
    """max/min - 1 of consecutive loads' GB/s (0.2 = within 20%)."""
    v = [x for x in values if x > 0]
    return max(v) / min(v) - 1 if v else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfs
    from pfs.bench import fusebench

    if args.quick:
        args.size = min(args.size, 24 << 20)
        args.hidden = min(args.hidden, 512)
        args.vocab = min(args.vocab, 4096)
        args.reps = 1
        args.stability = min(args.stability, 2)
    wanted = [p for p in args.paths.split(",") if p]
    bad = [p for p in wanted if p not in PATHS]
    if bad:
        raise SystemExit(f"pfs bench loader: unknown paths {bad}; known: {', '.join(PATHS)}")
    notes: list[str] = []
    if args.no_fuse:
        wanted = [p for p in wanted if not p.startswith("fuse")]
    elif any(p.startswith("fuse") for p in wanted) and not fusebench.mount_available():
        notes.append("`pfs mount` is not available: FUSE paths skipped")
        wanted = [p for p in wanted if not p.startswith("fuse")]
    for p in list(wanted):
        why = loader_run.missing(p)
        if why is not None:
            notes.append(f"{p}: {why}: skipped")
            log(notes[-1])
            wanted.remove(p)
    if REFERENCE not in wanted:
        wanted.insert(0, REFERENCE)
    with work_dir(args.local_dir, "pfs-bench-loader-") as wd, \
            cluster_for(args, wd, args.data_servers) as cut:
        server_pids = list(cut.pids.values())
        local = wd / "ckpt"
        t0 = time.perf_counter()
        log(f"writing a synthetic checkpoint of >= {fmt_size(args.size)} in {args.shards} "
            f"shards to {local}")
        ck = make_checkpoint(local, args.size, args.shards, args.hidden, args.vocab)
        log(f"  {ck['tensors']} tensors, {ck['file_bytes'] / 2**30:.2f} GiB in "
            f"{ck['shards']} shards ({time.perf_counter() - t0:.1f} s)")
        files = ck["files"]
        result: dict[str, Any] = {
            "bench": "loader",
            "machine": machine_info(wd),
            "config": {"size": args.size, "shards": ck["shards"], "reps": args.reps,
                       "stripe_count": args.count, "stripe_unit": args.unit,
                       "data_servers": len([n for n in cut.pids if n.startswith("data")]),
                       "server_pids_counted": len(server_pids),
                       "cluster": str(cut.dir) if cut.dir else None,
                       "local_dir": str(local), "paths": wanted,
                       "stability_loads": args.stability, "fresh_process": True},
            "checkpoint": ck,
            "notes": notes,
        }
        pdir = f"/bench-loader-{os.getpid()}"
        mnt = wd / "mnt"
        mounted = False
        c = pfs.connect(config=str(cut.client_toml))
        runs: list[dict[str, Any]] = []
        stability: dict[str, Any] = {}
        try:
            c.makedirs(pdir, exist_ok=True)
            c.set_layout(pdir, count=args.count, unit=args.unit)
            t0 = time.perf_counter()
            copy_to_pfs(c, local, pdir, files)
            log(f"copied it into pfs:{pdir} ({time.perf_counter() - t0:.1f} s)")
            result["layout"] = c.get_layout(f"{pdir}/{files[0]}")
            fuse_pids: list[int] = []
            if any(p.startswith("fuse") for p in wanted):
                try:
                    fusebench.pfs_mount(cut.client_toml, mnt, "")
                    mounted = True
                    fuse_pids = fusebench._pids_of_mount(mnt)
                except (RuntimeError, OSError) as exc:
                    notes.append(f"pfs mount failed ({exc}): FUSE paths skipped")
                    wanted = [p for p in wanted if not p.startswith("fuse")]
            mpath = str(mnt / pdir.lstrip("/"))
            local_files = [str(local / f) for f in files]
            checkpoint_files = local_files + object_files(cut.dir)
            mount_files = [os.path.join(mpath, f) for f in files]
            toml = str(cut.client_toml)

            def argv(name: str, repeat: int = 1, verify: bool = False) -> list[str]:
                src, cfg, pids = str(local), None, []
                if name in loader_run.PFS_PATHS:
                    src, cfg, pids = pdir, toml, server_pids
                elif name.startswith("fuse"):
                    src, pids = mpath, server_pids + fuse_pids
                return runner_argv(name, src, files, config=cfg, pids=pids, repeat=repeat,
                                   verify=str(local) if verify else None)

            verified: list[str] = []
            temps = ("cold", "warm") if not args.no_cold else ("warm",)
            evict(checkpoint_files)
            for rep in range(args.reps):
                r: dict[str, Any] = {}
                k = rep % len(wanted)
                for name in wanted[k:] + wanted[:k]:  # the order rotates
                    for temp in temps:
                        if temp == "cold":
                            evict(checkpoint_files + mount_files)
                        elif name.startswith("fuse"):  # through the daemon to warm servers
                            evict(mount_files)
                        res = run_fresh(argv(name, verify=rep == 0))
                        if res.get("skipped"):
                            notes.append(f"{name}: {res['skipped']}: skipped")
                            continue
                        if rep == 0:
                            if not res.get("bit_exact"):
                                raise RuntimeError(f"{name}: not bit-exact with safetensors: "
                                                   f"{res.get('mismatch')}")
                            if name not in verified:
                                verified.append(name)
                        r[f"{name}_{temp}"] = load_record(res)
                runs.append(r)
                log(f"rep {rep + 1}/{args.reps}: " + "  ".join(
                    f"{k}={v['GBps']:.2f}" for k, v in r.items()) + " GB/s")
            for name in wanted if args.stability > 1 else []:
                if name.startswith("fuse"):
                    continue
                res = run_fresh(argv(name, repeat=args.stability))
                if res.get("skipped"):
                    continue
                loads = [load_record(res, i) for i in range(len(res["loads"]))]
                rates = [x["GBps"] for x in loads]
                stability[name] = {"GBps": [round(x, 3) for x in rates],
                                   "spread": round(spread(rates), 3),
                                   # the loads after the first: those into memory an
                                   # earlier load of the process had (pfs: its pool)
                                   "spread_after_first": round(spread(rates[1:]), 3),
                                   # what makes a load steady: its CPU and its faults
                                   # (a load into reused buffers takes next to none)
                                   "cpu_s": [round(x["cpu_self_s"], 3) for x in loads],
                                   "faults": [x.get("minflt", 0) for x in loads],
                                   "reused": [round(x.get("reused_bytes", 0) / x["bytes"], 3)
                                              if x["bytes"] else 0.0 for x in loads]}
                log(f"stability {name}: {stability[name]['GBps']} GB/s "
                    f"(spread {stability[name]['spread']:.0%})")
            result["verified_bit_exact"] = verified
        finally:
            if mounted:
                fusebench.pfs_umount(mnt)
            try:
                for e in c.listdir(pdir):
                    c.remove(f"{pdir}/{e}")
                c.rmdir(pdir)
            except OSError:
                pass
            c.close()
    keys = [f"{p}_{t}" for t in ("warm", "cold") for p in PATHS]
    med = {k: median_record([r[k] for r in runs if k in r]) for k in keys
           if any(k in r for r in runs)}
    result["runs"] = runs
    result["median"] = med
    result["stability"] = stability
    result["ratios"] = ratios(med)
    result["aims"] = aims(med, stability)
    return result


def ratios(med: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for ref_name in REFERENCES:
        for temp in ("warm", "cold"):
            ref = med.get(f"{ref_name}_{temp}")
            if not ref:
                continue
            for p in PATHS:
                m = med.get(f"{p}_{temp}")
                if m is None or p == ref_name:
                    continue
                out[f"{p}/{ref_name} {temp}"] = round(ratio(m["GBps"], ref["GBps"]), 3)
                out[f"{p}/{ref_name} {temp} per core"] = round(
                    ratio(m["GBps_per_core"], ref["GBps_per_core"]), 3)
    return out


def _rate(med: dict[str, Any], key: str) -> float | None:
    m = med.get(key)
    return m["GBps"] if m else None


def _vs(med: dict[str, Any], path: str, refs: tuple[str, ...], temps: tuple[str, ...]
        ) -> float | None:
    """The lowest ratio of ``path`` to the fastest of ``refs``, over ``temps``."""
    got = []
    for t in temps:
        mine = _rate(med, f"{path}_{t}")
        theirs = [x for r in refs if (x := _rate(med, f"{r}_{t}"))]
        if mine is not None and theirs:
            got.append(ratio(mine, max(theirs)))
    return min(got) if got else None


def aims(med: dict[str, Any], stability: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's aims, each with the value this run reached (None: not measured)."""
    dedicated = ("runai", "fastsafetensors")
    out = [
        ("pfs_sc_on warm >= 1.5x st_clone warm", _vs(med, "pfs_sc_on", (REFERENCE,),
                                                     ("warm",)), 1.5),
        ("pfs_sc_on cold >= 2x st_clone cold", _vs(med, "pfs_sc_on", (REFERENCE,),
                                                   ("cold",)), 2.0),
        ("pfs_sc_map (zero-copy, opt-in) warm >= 1.5x st_clone warm",
         _vs(med, "pfs_sc_map", (REFERENCE,), ("warm",)), 1.5),
        ("pfs_sc_map (zero-copy, opt-in) cold >= 2x st_clone cold",
         _vs(med, "pfs_sc_map", (REFERENCE,), ("cold",)), 2.0),
        ("pfs_sc_off (TCP only) >= 1.0x st_clone, warm and cold",
         _vs(med, "pfs_sc_off", (REFERENCE,), ("warm", "cold")), 1.0),
        ("pfs_local >= 2x the faster of runai and fastsafetensors, warm and cold",
         _vs(med, "pfs_local", dedicated, ("warm", "cold")), 2.0),
        ("pfs_sc_on >= 2x the faster of runai and fastsafetensors, warm and cold",
         _vs(med, "pfs_sc_on", dedicated, ("warm", "cold")), 2.0),
    ]
    res = [{"aim": a, "value": v, "target": t, "met": v is not None and v >= t}
           for a, v, t in out]
    for name in ("pfs_local", "pfs_sc_on"):
        if name in stability:  # spread <= 20%: the value is 1.2 / (1 + spread)
            sp = stability[name]["spread"]
            res.append({"aim": f"{name}: consecutive warm loads in one process within 20% "
                               f"(spread {sp:.0%})", "value": round(1.2 / (1 + sp), 3),
                        "target": 1.0, "met": sp <= 0.2})
    return res


def stability_line(name: str, s: dict[str, Any]) -> str:
    after = (f", {s['spread_after_first']:.0%} after the first"
             if len(s["GBps"]) > 2 and "spread_after_first" in s else "")
    return (f"consecutive warm loads in one process, {name}: "
            f"{', '.join(f'{x:.2f}' for x in s['GBps'])} GB/s "
            f"(spread {s['spread']:.0%}{after})" + stability_detail(s))


def stability_detail(s: dict[str, Any]) -> str:
    """CPU seconds, page faults and the share of bytes read into reused buffers of each
    consecutive load (older results lack them)."""
    if "cpu_s" not in s:
        return ""
    out = (f"; CPU {', '.join(f'{x:.2f}' for x in s['cpu_s'])} s"
           f"; faults {', '.join(f'{x / 1000:.0f}k' for x in s['faults'])}")
    if any(s.get("reused", ())):  # pfs.load_safetensors: buffers of the previous load
        out += f"; buffers reused {', '.join(f'{x:.0%}' for x in s['reused'])}"
    return out


def report(res: dict[str, Any]) -> str:
    cfg, ck, med = res["config"], res["checkpoint"], res["median"]
    lines = [f"pfs bench loader: {ck['tensors']} bf16 tensors, {ck['tensor_bytes'] / 2**30:.2f} "
             f"GiB in {ck['shards']} shards (width {ck['hidden']}, {ck['layers']} layers), "
             f"pfs stripe count {cfg['stripe_count']} unit {fmt_size(cfg['stripe_unit'])}, "
             f"{cfg['data_servers']} data servers; every load in a fresh process, "
             f"median of {cfg['reps']}",
             f"machine: {res['machine'].get('cpus')} CPUs ({res['machine'].get('cpu_model', '?')}), "
             f"{res['machine'].get('fs', '?')}",
             f"bit-exact with safetensors: {', '.join(res.get('verified_bit_exact', [])) or '-'}",
             ""]
    rows = []
    for temp in ("warm", "cold"):
        refs = {r: med.get(f"{r}_{temp}", {}).get("GBps", 0.0) for r in REFERENCES}
        for p in PATHS:
            m = med.get(f"{p}_{temp}")
            if m is None:
                continue
            rows.append([f"{p} {temp}", f"{m['GBps']:.3f}", f"{m['seconds']:.3f}",
                         f"{m['first_tensor_s']:.3f}", f"{m['cpu_self_s']:.2f}",
                         f"{m['cpu_servers_s']:.2f}", f"{m['GBps_per_core']:.3f}",
                         f"{m.get('minflt', 0):.0f}",
                         *(f"{ratio(m['GBps'], refs[r]):.2f}x" for r in REFERENCES)])
    lines.append(table(rows, ["path", "GB/s", "s", "1st tensor s", "CPU self", "CPU srv",
                              "GB/s/core", "faults", *(f"vs {r}" for r in REFERENCES)]))
    lines.append("")
    for name, s in res.get("stability", {}).items():
        lines.append(stability_line(name, s))
    for name, temp in ((n, t) for n in ("pfs_sc_on", "pfs_sc_map") for t in ("warm", "cold")):
        m = med.get(f"{name}_{temp}")
        if m and m.get("bytes"):  # the rest went over TCP (no local descriptor given)
            # (a zero-copy load reads whole stripe units: more bytes than the tensors')
            local = m.get("short_circuit_bytes", 0)
            mapped = (f" ({m.get('mapped_bytes', 0) / local:.0%} of them mapped)"
                      if name == "pfs_sc_map" and local else "")
            lines.append(f"{name} {temp}: {min(1.0, local / m['bytes']):.0%} of the bytes "
                         f"read short-circuit{mapped} (median), the rest over TCP")
    lines.append("reference: st_clone = safetensors load_file + .clone() (private memory, "
                 "the end state pfs.load_safetensors returns); st_touch = every page "
                 "mapped from the page cache (zero-copy warm).")
    for a in res.get("aims", []):
        lines.append(aim(a["aim"], a["value"], a["target"]))
    for n in res.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)

def main(argv: list[str]) -> int:
    return bench_main("loader", __doc__, add_args, run, report, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

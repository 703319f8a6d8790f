"""``pfs bench loader``: a sharded safetensors checkpoint loaded into CPU tensors by every
path, in one run, beside ``safetensors`` from a local directory.

The checkpoint is synthetic but shaped like an LLM's (``--hidden`` wide decoder layers,
llama proportions: q/k/v/o ``hidden x hidden``, gate/up ``inter x hidden``, down
``hidden x inter``, norms; an embedding and an lm_head of ``vocab x hidden``; all bf16
with finite random values), at least ``--size`` bytes in ``--shards`` files plus
``model.safetensors.index.json``. It is written once to a local directory (on the
filesystem that holds the cluster's objects) and copied byte for byte into pfs (stripe
count ``--count``, unit ``--unit``).

Paths, each measured warm and cold in every repetition (all warm loads of a repetition
first, then all cold ones; medians over ``--reps``):

- ``st_lazy``: ``safetensors.torch.load_file`` of every shard from the local directory.
  safetensors mmaps the file and returns tensors over the mapping: this times header
  parsing and ``mmap`` only — no tensor byte has been read. Shown, never compared.
- ``st_touch``: the same, then one byte of every 4 KiB page of every tensor is read, so
  every byte is in memory and mapped: the cheapest way to have all the bytes with
  safetensors. Warm, that is a zero-copy mapping of the page cache (page-table work
  only), which no loader that copies into its own memory can match; cold, it is the
  disk-bound reference.
- ``st_clone``: ``load_file`` + ``.clone()`` of every tensor: private memory, the end
  state ``pfs.load_safetensors`` gives (its tensors own their memory; a model's
  ``load_state_dict`` makes that copy too). **This is the fair reference**, the headline
  ratios use it; ratios against ``st_touch`` are reported beside them.
- ``pfs_local``: ``pfs.load_safetensors(local_dir)`` (io_uring engine, ``load`` profile).
- ``pfs_sc_on``: ``pfs.load_safetensors(pfs_dir, client=c)`` with short-circuit reads
  (``ClientConfig.short_circuit = True``, the default): the data servers on this host
  hand over object descriptors and the client reads them itself.
- ``pfs_sc_off``: the same with ``short_circuit = False``: every byte through TCP from the
  data servers.
- ``fuse_st_touch``: ``safetensors`` load_file + touch on the checkpoint through a
  ``pfs mount`` of the cluster (the mount's own client config: short-circuit on).
- ``fuse_pfs``: ``pfs.load_safetensors`` of the mount path (plain local-file reads of the
  mount).

Warm: the local files and the data servers' object files are in the page cache (just
read). For the FUSE paths the mount's own page cache of the shards is dropped before each
warm load (``posix_fadvise(DONTNEED)``), so a warm FUSE load goes through the daemon to
warm servers instead of being a memcpy from the kernel's FUSE cache. Cold: ``sync; echo 3
> /proc/sys/vm/drop_caches`` before each load (root only; skipped otherwise).

CPU seconds: this process (all threads, io_uring workers included) for local paths; +
metaserver and data servers for pfs paths; + the FUSE daemon for mount paths. Every pfs
and FUSE path's result is compared bit for bit (int16 views) with ``st_clone`` once,
outside the timed span.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pfs.bench.common import (
    CpuMeter,
    aim,
    bench_main,
    cluster_for,
    drop_caches,
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

PATHS = ("st_lazy", "st_touch", "st_clone", "pfs_local", "pfs_sc_on", "pfs_sc_off",
         "fuse_st_touch", "fuse_pfs")
REFERENCE = "st_clone"  # the fair reference (same end state); st_touch is shown beside it
REFERENCES = ("st_clone", "st_touch")
INDEX = "model.safetensors.index.json"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="cluster directory: use (or start) the cluster there and "
                                 "leave it running")
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
    p.add_argument("--paths", default=",".join(PATHS),
                   help=f"which paths to measure (default all: {','.join(PATHS)})")
    p.add_argument("--no-cold", action="store_true", help="skip the cold loads")
    p.add_argument("--no-fuse", action="store_true", help="skip the FUSE mount paths")
    p.add_argument("--quick", action="store_true",
                   help="tiny: 24M, width 512, vocab 4096, 1 rep")
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


# -- loading -------------------------------------------------------------------------
def touch(tensors: dict[str, Any]) -> dict[str, Any]:
    """Read one byte of every 4 KiB page of every tensor (faults in mmap-backed tensors)."""
    import torch

    for t in tensors.values():
        if t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            flat[::4096].sum()
    return tensors


def st_load(d: Path | str, files: list[str]) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out


def evict(paths: list[str]) -> None:
    """Drop these files' pages from the page cache of the filesystem they are read
    through (for a FUSE mount: the kernel's FUSE cache, not the servers')."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def same(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    import torch

    if set(ref) != set(got):
        raise RuntimeError(f"{what}: tensor names differ from safetensors' "
                           f"({len(got)} vs {len(ref)})")
    for k, a in ref.items():
        b = got[k]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            raise RuntimeError(f"{what}: {k}: {b.dtype} {tuple(b.shape)} vs "
                               f"{a.dtype} {tuple(a.shape)}")
        if a.numel() and not torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                         b.view(torch.int16) if b.dtype == torch.bfloat16 else b):
            raise RuntimeError(f"{what}: {k}: bytes differ from safetensors'")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import pfs
    from pfs.bench import fusebench
    from pfs.core import config as cfgmod
    from pfs.loader.safetensors import LoadStats

    if args.quick:
        args.size = min(args.size, 24 << 20)
        args.hidden = min(args.hidden, 512)
        args.vocab = min(args.vocab, 4096)
        args.reps = 1
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
        nbytes = ck["tensor_bytes"]
        result: dict[str, Any] = {
            "bench": "loader",
            "machine": machine_info(wd),
            "config": {"size": args.size, "shards": ck["shards"], "reps": args.reps,
                       "stripe_count": args.count, "stripe_unit": args.unit,
                       "data_servers": len([n for n in cut.pids if n.startswith("data")]),
                       "server_pids_counted": len(server_pids),
                       "cluster": str(cut.dir) if cut.dir else None,
                       "local_dir": str(local), "paths": wanted},
            "checkpoint": ck,
            "notes": notes,
        }
        cfg_on = cfgmod.load(cfgmod.ClientConfig, cut.client_toml)
        cfg_on.short_circuit = True
        cfg_off = cfgmod.load(cfgmod.ClientConfig, cut.client_toml)
        cfg_off.short_circuit = False
        pdir = f"/bench-loader-{os.getpid()}"
        mnt = wd / "mnt"
        mounted = False
        c_on = pfs.connect(config=cfg_on)
        c_off = pfs.connect(config=cfg_off)
        runs: list[dict[str, Any]] = []
        try:
            c_on.makedirs(pdir, exist_ok=True)
            c_on.set_layout(pdir, count=args.count, unit=args.unit)
            t0 = time.perf_counter()
            copy_to_pfs(c_on, local, pdir, files)
            log(f"copied it into pfs:{pdir} ({time.perf_counter() - t0:.1f} s)")
            result["layout"] = c_on.get_layout(f"{pdir}/{files[0]}")
            fuse_pids: list[int] = []
            if any(p.startswith("fuse") for p in wanted):
                try:
                    fusebench.pfs_mount(cut.client_toml, mnt, "")
                    mounted = True
                    fuse_pids = fusebench._pids_of_mount(mnt)
                except (RuntimeError, OSError) as exc:
                    notes.append(f"pfs mount failed ({exc}): FUSE paths skipped")
                    wanted = [p for p in wanted if not p.startswith("fuse")]
            mpath = mnt / pdir.lstrip("/")
            meter_local = CpuMeter()
            meter_pfs = CpuMeter(server_pids)
            meter_fuse = CpuMeter(server_pids + fuse_pids)
            local_files = [str(local / f) for f in files]
            mount_files = [str(mpath / f) for f in files]
            sc_bytes = [0]

            def sc_on() -> dict[str, Any]:
                st = LoadStats()
                loc = c_on.aio.local
                before = loc.stats["local_bytes"] if loc is not None else 0
                out = pfs.load_safetensors(pdir, client=c_on, stats=st)
                sc_bytes[0] = (loc.stats["local_bytes"] if loc is not None else 0) - before
                return out

            loaders: dict[str, tuple[Any, CpuMeter]] = {
                "st_lazy": (lambda: st_load(local, files), meter_local),
                "st_touch": (lambda: touch(st_load(local, files)), meter_local),
                "st_clone": (lambda: {k: v.clone() for k, v in st_load(local, files).items()},
                             meter_local),
                "pfs_local": (lambda: pfs.load_safetensors(local), meter_local),
                "pfs_sc_on": (sc_on, meter_pfs),
                "pfs_sc_off": (lambda: pfs.load_safetensors(pdir, client=c_off), meter_pfs),
                "fuse_st_touch": (lambda: touch(st_load(mpath, files)), meter_fuse),
                "fuse_pfs": (lambda: pfs.load_safetensors(mpath), meter_fuse),
            }
            cold_ok = not args.no_cold
            ref: dict[str, Any] | None = None
            verified: list[str] = []
            # the local shards were just written: read them once so warm is warm
            for f in local_files:
                with open(f, "rb", buffering=0) as fh:
                    while fh.read(64 << 20):
                        pass
            for rep in range(args.reps):
                r: dict[str, Any] = {}
                for temp in ("warm", "cold"):
                    if temp == "cold" and not cold_ok:
                        continue
                    for name in wanted:
                        fn, meter = loaders[name]
                        if temp == "warm" and name.startswith("fuse"):
                            evict(mount_files)
                        if temp == "cold":
                            if not drop_caches():
                                cold_ok = False
                                notes.append("cannot drop caches (not root): cold loads "
                                             "skipped")
                                log(notes[-1])
                                break
                        gc.collect()
                        out: dict[str, Any] = {}
                        with meter.span(out):
                            tensors = fn()
                        rec = rate_fields(nbytes, out)
                        rec["tensors"] = len(tensors)
                        if name == "pfs_sc_on":
                            rec["short_circuit_bytes"] = sc_bytes[0]
                        r[f"{name}_{temp}"] = rec
                        if name.startswith(("pfs", "fuse")) and name not in verified:
                            if ref is None:  # outside the timed span
                                ref = {k: v.clone() for k, v in st_load(local, files).items()}
                            same(ref, tensors, name)
                            verified.append(name)
                        del tensors
                runs.append(r)
                log(f"rep {rep + 1}/{args.reps}: " + "  ".join(
                    f"{k}={v['GBps']:.2f}" for k, v in r.items()) + " GB/s")
            result["verified_bit_exact"] = verified
            del ref
        finally:
            if mounted:
                fusebench.pfs_umount(mnt)
            try:
                for e in c_on.listdir(pdir):
                    c_on.remove(f"{pdir}/{e}")
                c_on.rmdir(pdir)
            except OSError:
                pass
            c_on.close()
            c_off.close()
    keys = [f"{p}_{t}" for t in ("warm", "cold") for p in PATHS]
    med = {k: median_record([r[k] for r in runs if k in r]) for k in keys
           if any(k in r for r in runs)}
    result["runs"] = runs
    result["median"] = med
    result["ratios"] = ratios(med)
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
                if m is None or p in (*REFERENCES, "st_lazy"):
                    continue
                out[f"{p}/{ref_name} {temp}"] = round(ratio(m["GBps"], ref["GBps"]), 3)
                out[f"{p}/{ref_name} {temp} per core"] = round(
                    ratio(m["GBps_per_core"], ref["GBps_per_core"]), 3)
    return out


def report(res: dict[str, Any]) -> str:
    cfg, ck, med = res["config"], res["checkpoint"], res["median"]
    lines = [f"pfs bench loader: {ck['tensors']} bf16 tensors, {ck['tensor_bytes'] / 2**30:.2f} "
             f"GiB in {ck['shards']} shards (width {ck['hidden']}, {ck['layers']} layers), "
             f"pfs stripe count {cfg['stripe_count']} unit {fmt_size(cfg['stripe_unit'])}, "
             f"{cfg['data_servers']} data servers, median of {cfg['reps']}",
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
            if p == "st_lazy":  # no tensor byte read: a rate would mislead
                rows.append([f"{p} {temp}", "-", f"{m['seconds']:.3f}", f"{m['cpu_self_s']:.2f}",
                             f"{m['cpu_servers_s']:.2f}", "-", "(not read)", ""])
                continue
            rows.append([f"{p} {temp}", f"{m['GBps']:.3f}", f"{m['seconds']:.3f}",
                         f"{m['cpu_self_s']:.2f}", f"{m['cpu_servers_s']:.2f}",
                         f"{m['GBps_per_core']:.3f}",
                         *(f"{ratio(m['GBps'], refs[r]):.2f}x" for r in REFERENCES)])
    lines.append(table(rows, ["path", "GB/s", "s", "CPU self", "CPU srv", "GB/s/core",
                              *(f"vs {r}" for r in REFERENCES)]))
    lines.append("")
    lines.append("fair reference: st_clone = safetensors load_file + .clone(): tensors in "
                 "private memory, the end state pfs.load_safetensors returns.")
    lines.append("st_touch = load_file + one byte of every page read: every byte in memory "
                 "but mapped from the page cache (warm: zero-copy, no copying loader can "
                 "match it; cold: the disk-bound reference); st_lazy reads no tensor byte.")
    got = [ratio(med[f"{p}_{t}"]["GBps"], med[f"{REFERENCE}_{t}"]["GBps"])
           for t in ("warm", "cold") for p in ("pfs_local", "pfs_sc_on")
           if f"{p}_{t}" in med and f"{REFERENCE}_{t}" in med]
    lines.append(aim(f"pfs loader >= 1.0x safetensors from local disk ({REFERENCE}; the "
                     "lowest of pfs_local and pfs_sc_on, warm and cold)",
                     min(got) if got else None, 1.0))
    for n in res.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return bench_main("loader", __doc__, add_args, run, report, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

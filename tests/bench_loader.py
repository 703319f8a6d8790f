"""Loader benchmark (not a test): pfs.load_safetensors vs safetensors, local and pfs.

    python tests/bench_loader.py [--gib 2] [--shards 4] [--dir /tmp/pfs-bench-ckpt]
                                 [--config client.toml]   # also load from pfs

Writes a synthetic bf16 checkpoint (realistic shapes: a 4096-wide decoder) once, then
loads it (page cache warm) with safetensors.torch.load_file and pfs.load_safetensors,
best of --rounds, and prints GB/s and CPU seconds per GB.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


FILES: list[Path] = []


def make(d: Path, gib: float, shards: int) -> int:
    import torch
    from safetensors.torch import save_file

    if (d / "model.safetensors.index.json").exists():
        return sum(f.stat().st_size for f in d.glob("*.safetensors"))
    d.mkdir(parents=True, exist_ok=True)
    hidden, inter = 4096, 11008
    layer = [("q_proj", (hidden, hidden)), ("k_proj", (hidden, hidden)),
             ("v_proj", (hidden, hidden)), ("o_proj", (hidden, hidden)),
             ("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
             ("down_proj", (hidden, inter)), ("input_layernorm", (hidden,))]
    per_layer = sum(2 * (a * (b[0] if b else 1)) for _n, (a, *b) in
                    [(n, s) for n, s in layer])
    nlayers = max(1, -(-int(gib * (1 << 30)) // per_layer))
    weight_map: dict[str, str] = {}
    shards = min(shards, nlayers)
    total = 0
    for s in range(shards):
        tensors = {}
        for i in range(s * nlayers // shards, (s + 1) * nlayers // shards):
            for name, shape in layer:
                key = f"model.layers.{i}.{name}.weight"
                tensors[key] = torch.empty(shape, dtype=torch.bfloat16).uniform_(-1, 1)
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(d / fname))
        total += (d / fname).stat().st_size
        weight_map.update({k: fname for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


COLD = False


def evict(files: list[Path]) -> None:
    """Drop these files from the page cache (a cold read), without touching others'."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def touch(tensors: dict) -> dict:
    """Fault in every page of every tensor (mmap-backed tensors are lazy)."""
    for t in tensors.values():
        flat = t.reshape(-1).view(__import__("torch").uint8) if t.numel() else None
        if flat is not None:
            flat[::4096].sum()
    return tensors


def best(label: str, fn, rounds: int, nbytes: int) -> None:
    rates = []
    for _ in range(rounds):
        if COLD:
            evict(FILES)
        t0, c0 = time.perf_counter(), cpu()
        out = fn()
        dt, dc = time.perf_counter() - t0, cpu() - c0
        rates.append((nbytes / dt / 1e9, dc / (nbytes / 1e9), dt))
        del out
    r = max(rates)
    print(f"{label:44s} {r[0]:6.2f} GB/s  {r[2]:6.2f} s  {r[1]:5.2f} CPU s/GB")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="/tmp/pfs-bench-ckpt")
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="evict the shards before each load")
    p.add_argument("--config", help="client.toml: also load from pfs (copies the checkpoint in)")
    args = p.parse_args()
    from safetensors.torch import load_file

    import pfs

    d = Path(args.dir)
    total = make(d, args.gib, args.shards)
    files = sorted(d.glob("*.safetensors"))
    print(f"checkpoint {d}: {len(files)} shards, {total / (1 << 30):.2f} GiB, "
          f"cpus={os.cpu_count()}")
    for f in files if not args.cold else []:  # warm the page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass

    def st_all() -> dict:
        out = {}
        for f in files:
            out.update(load_file(str(f)))
        return out

    global COLD, FILES
    FILES = files
    COLD = args.cold
    best("safetensors load_file (lazy mmap, untouched)", st_all, args.rounds, total)
    best("safetensors load_file + touch every page", lambda: touch(st_all()), args.rounds,
         total)
    best("safetensors load_file + clone (private copy)",
         lambda: {k: v.clone() for k, v in st_all().items()}, args.rounds, total)
    best("pfs.load_safetensors local (uring)", lambda: pfs.load_safetensors(d), args.rounds,
         total)
    best("pfs.load_safetensors local (posix engine)",
         lambda: pfs.load_safetensors(d, profile="load", **_posix()), args.rounds, total)
    best("pfs.load_safetensors local TP 1/2 (dim 0/1)",
         lambda: pfs.load_safetensors(d, tp_rank=0, tp_size=2,
                                      split={"*_proj.weight": 0, "*.o_proj.weight": 1}),
         args.rounds, total // 2)
    if args.config:
        with pfs.connect(config=args.config) as c:
            remote = "/bench-ckpt"
            if not c.exists(remote + "/model.safetensors.index.json"):
                c.makedirs(remote, exist_ok=True)
                for f in d.iterdir():
                    with open(f, "rb") as src, c.open(f"{remote}/{f.name}", "wb") as dst:
                        while chunk := src.read(64 << 20):
                            dst.write(chunk)
            best("pfs.load_safetensors from pfs (network path)",
                 lambda: pfs.load_safetensors(remote, client=c), args.rounds, total)


def _posix() -> dict:
    import pfs.loader as L
    from pfs.config import ProfileSettings

    orig = L.profile_settings

    def posix(name: str, nbytes: int | None = None) -> ProfileSettings:
        s = orig(name, nbytes)
        return ProfileSettings(s.name, "posix", s.queue_depth, 8 << 20, s.gds, s.merge_gap)

    L.profile_settings = posix  # type: ignore[assignment]
    return {}


if __name__ == "__main__":
    main()

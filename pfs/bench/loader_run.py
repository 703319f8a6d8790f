"""One checkpoint load in a fresh process, for ``pfs bench loader``.

    python -m pfs.bench.loader_run PATH --src DIR --files a.safetensors,b.safetensors
        [--config client.toml] [--pids 12,13] [--repeat N] [--verify REFDIR]

Everything the path needs is imported (and a pfs client connected) before the clock
starts, so import time is excluded, as a serving process has paid it before it loads.
Then ``--repeat`` loads run one after another (the tensors of one are freed before the
next) and one JSON line goes to stdout: per load the wall seconds, the seconds to the
first tensor a caller could use, this process's CPU seconds (every thread: io_uring
workers and the loaders' own thread pools are threads of it), the CPU seconds of the
``--pids`` processes (data servers, a FUSE daemon) over the same span, page faults and
context switches (``getrusage``), and the bytes read into buffers an earlier load
handed back (``pfs.load_safetensors``'s pool). ``--verify`` then compares every tensor bit for bit
with ``safetensors.torch.load_file`` of the files in ``REFDIR``, outside the timed span.

A path whose loader is not installed prints ``{"skipped": "why"}`` and exits 0.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from pfs.bench.common import proc_cpu

PATHS = ("st_clone", "st_touch", "runai", "fastsafetensors", "pfs_local", "pfs_sc_on",
         "pfs_sc_map", "pfs_sc_off", "fuse_st_touch", "fuse_pfs")
PFS_PATHS = ("pfs_sc_on", "pfs_sc_map", "pfs_sc_off")  # from the cluster, with a client
# the importable module each path needs beyond torch + safetensors, and its pip name
NEEDS = {"runai": ("runai_model_streamer", "runai-model-streamer"),
         "fastsafetensors": ("fastsafetensors", "fastsafetensors")}

Mark = Callable[[], None]


def missing(path: str) -> str | None:
    """Why ``path`` cannot run here (its loader is not installed), or None."""
    mod, pip = NEEDS.get(path, ("safetensors", "safetensors"))
    if importlib.util.find_spec(mod) is None:
        return f"{pip} is not installed (pip install 'pfs[loaders]')"
    return None


# -- the loaders: (mark) -> {name: tensor}; mark() once the first tensor is usable --------
def _st_clone(paths: list[str], mark: Mark) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for p in paths:
        for k, v in load_file(p).items():
            out[k] = v.clone()
            mark()
    return out


def _st_touch(paths: list[str], mark: Mark) -> dict[str, Any]:
    """``load_file`` + one byte of every 4 KiB page read: every byte in memory, mapped
    from the page cache (zero-copy warm)."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for p in paths:
        for k, v in load_file(p).items():
            if v.numel():
                v.reshape(-1).view(torch.uint8)[::4096].sum()
            out[k] = v
            mark()
    return out


def _runai(paths: list[str], mark: Mark) -> dict[str, Any]:
    from runai_model_streamer import SafetensorsStreamer

    out: dict[str, Any] = {}
    with SafetensorsStreamer() as s:
        s.stream_files(paths, device="cpu")  # owned=True: the tensors are the caller's
        for name, t in s.get_tensors():
            out[name] = t
            mark()
    return out


def _fastsafetensors(paths: list[str], mark: Mark) -> dict[str, Any]:
    from fastsafetensors import fastsafe_open

    out: dict[str, Any] = {}
    # CPU mode: pread through a bounce buffer (no GDS); tensors outlive the context
    with fastsafe_open(paths, framework="pt", device="cpu", nogds=True) as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
            mark()
    return out


def _loader_for(path: str, src: str, paths: list[str], client: Any
                ) -> Callable[[Mark], dict[str, Any]]:
    import pfs

    if path in ("st_clone",):
        return lambda mark: _st_clone(paths, mark)
    if path in ("st_touch", "fuse_st_touch"):
        return lambda mark: _st_touch(paths, mark)
    if path == "runai":
        return lambda mark: _runai(paths, mark)
    if path == "fastsafetensors":
        return lambda mark: _fastsafetensors(paths, mark)

    zero_copy = path == "pfs_sc_map"  # local objects mapped, not read (opt-in)

    def load(mark: Mark) -> dict[str, Any]:  # tensors handed out as their bytes land
        out = pfs.load_safetensors(src, client=client, on_tensor=lambda _n, _t: mark(),
                                   zero_copy=zero_copy)
        mark()
        return out

    return load


def _usage() -> dict[str, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu": r.ru_utime + r.ru_stime, "minflt": r.ru_minflt, "majflt": r.ru_majflt,
            "vcsw": r.ru_nvcsw, "ivcsw": r.ru_nivcsw}


def measure(load: Callable[[Mark], dict[str, Any]], pids: list[int]
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One timed load: (its record, its tensors)."""
    first: list[float] = []
    r0 = _reused()
    u0, s0 = _usage(), sum(proc_cpu(p) for p in pids)
    t0 = time.perf_counter()

    def mark() -> None:
        if not first:
            first.append(time.perf_counter() - t0)

    tensors = load(mark)
    secs = time.perf_counter() - t0
    u1, s1 = _usage(), sum(proc_cpu(p) for p in pids)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    rec: dict[str, Any] = {
        "seconds": secs, "first_tensor_s": first[0] if first else secs,
        "cpu_self_s": u1["cpu"] - u0["cpu"], "cpu_servers_s": s1 - s0,
        "bytes": nbytes, "tensors": len(tensors),
        **{k: int(u1[k] - u0[k]) for k in ("minflt", "majflt", "vcsw", "ivcsw")},
        # bytes read into buffers an earlier load of this process handed back
        "reused_bytes": _reused() - r0,
    }
    return rec, tensors


def _reused() -> int:
    """Bytes the pfs loader's buffer pool handed out again so far (0: not loaded)."""
    pool = sys.modules.get("pfs.loader.pool")
    return int(pool.POOL.stats["reused_bytes"]) if pool is not None else 0


def bit_exact(ref_dir: str, files: list[str], got: dict[str, Any]) -> str | None:
    """None when ``got`` equals safetensors' tensors of the files bit for bit, else why."""
    import torch
    from safetensors.torch import load_file

    ref: dict[str, Any] = {}
    for f in files:
        ref.update(load_file(os.path.join(ref_dir, f)))
    if set(ref) != set(got):
        return f"tensor names differ ({len(got)} vs safetensors' {len(ref)})"
    for k, a in ref.items():
        b = got[k]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            return f"{k}: {b.dtype} {tuple(b.shape)} vs {a.dtype} {tuple(a.shape)}"
        if a.numel() and not torch.equal(a.reshape(-1).view(torch.uint8),
                                         b.contiguous().reshape(-1).view(torch.uint8)):
            return f"{k}: bytes differ from safetensors'"
    return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pfs.bench.loader_run")
    p.add_argument("path", choices=PATHS)
    p.add_argument("--src", required=True, help="checkpoint directory (local, or on pfs)")
    p.add_argument("--files", required=True, help="shard file names, comma-separated")
    p.add_argument("--config", help="client.toml (pfs_sc_on / pfs_sc_off)")
    p.add_argument("--pids", default="", help="processes whose CPU time to count too")
    p.add_argument("--repeat", type=int, default=1, help="loads in this process")
    p.add_argument("--verify", help="local directory of the same files: compare bit for bit")
    args = p.parse_args(argv)
    why = missing(args.path)
    if why is not None:
        print(json.dumps({"path": args.path, "skipped": why}), flush=True)
        return 0
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401  (imported before the clock: import time is excluded)

    mod = NEEDS.get(args.path, (None,))[0]
    if mod:
        __import__(mod)
    files = [f for f in args.files.split(",") if f]
    paths = [os.path.join(args.src, f) for f in files]
    pids = [int(x) for x in args.pids.split(",") if x]
    client = None
    connect_s = 0.0
    if args.path in PFS_PATHS:
        import pfs
        from pfs.core import config as cfgmod

        cfg = cfgmod.load(cfgmod.ClientConfig, args.config)
        cfg.short_circuit = args.path != "pfs_sc_off"
        t0 = time.perf_counter()
        client = pfs.connect(config=cfg)
        connect_s = time.perf_counter() - t0
    if args.path.startswith(("pfs", "fuse_pfs")):
        # the loader's own lazy imports (trio, liburing: ~1 s on a busy disk) are import
        # time too; they would otherwise land inside the first load
        import pfs.loader.safetensors  # noqa: F401
        from pfs.core.engine import import_liburing

        import_liburing()
    result: dict[str, Any] = {"path": args.path, "connect_s": connect_s, "loads": []}
    try:
        load = _loader_for(args.path, args.src, paths, client)
        tensors: dict[str, Any] = {}
        sc0, map0 = _sc_bytes(client), _sc_bytes(client, "mapped_bytes")
        for _ in range(args.repeat):
            tensors = {}  # the previous load's tensors freed before the next
            rec, tensors = measure(load, pids)
            result["loads"].append(rec)
        if client is not None:
            result["short_circuit_bytes"] = _sc_bytes(client) - sc0
            result["mapped_bytes"] = _sc_bytes(client, "mapped_bytes") - map0
        if args.verify:
            bad = bit_exact(args.verify, files, tensors)
            result["bit_exact"] = bad is None
            if bad is not None:
                result["mismatch"] = bad
    finally:
        if client is not None:
            client.close()
    print(json.dumps(result), flush=True)
    return 0


def _sc_bytes(client: Any, key: str = "local_bytes") -> int:
    """Bytes the client read (or mapped: ``mapped_bytes``) from local objects so far."""
    loc = client.aio.local if client is not None else None
    return int(loc.stats[key]) if loc is not None else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Medians of old ("base") vs new from docs/ab/run.sh's JSON files, each side's spread (min..max),
and the figures worse by more than the spread of their repetitions."""
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(ver, b, rep):
    p = out / f"{ver}-{b}-{rep}.json"
    return json.loads(p.read_text()) if p.exists() else None
def figures(b, d):
    f = {}
    if d is None: return f
    if b == "tp":
        r = d["runs"][0]
        for k in ("pfs_write", "pfs_read_warm", "pfs_sc_read_warm"):
            if k in r: f[f"throughput {k} GB/s"] = r[k]["GBps"]; f[f"throughput {k} GB/s/core"] = r[k]["GBps_per_core"]
    elif b == "meta":
        for m in d["median"]:
            for ph in ("create", "stat", "unlink"):
                f[f"meta x{m['clients']} {ph}/s"] = m[ph]["ops_per_s"]
    elif b == "fuse":
        for t, m in d["median"].items():
            for k in ("write_MBps", "read_MBps", "create_ops", "stat_ops", "unlink_ops"):
                f[f"fuse {t} {k}"] = m[k]
    elif b == "iops":
        for p in d["points"]:
            f[f"iops {p['path']} {p['engine']} qd{p['qd']} IOPS"] = p["iops"]
    return f
rows = {}
for b in ("tp", "meta", "fuse", "iops"):
    for ver in ("base", "new"):
        for rep in (1, 2, 3):
            for k, v in figures(b, load(ver, b, rep)).items():
                rows.setdefault(k, {"base": [], "new": []})[ver].append(v)
print("| figure | old median (min–max) | new median (min–max) | new/old |")
print("|---|---|---|---|")
worse = []
for k, v in rows.items():
    if not v["base"] or not v["new"]: continue
    mb, mn = statistics.median(v["base"]), statistics.median(v["new"])
    fmt = (lambda x: f"{x:,.3g}") if mb < 100 else (lambda x: f"{x:,.0f}")
    ratio = mn / mb if mb else float("nan")
    spread_b = (min(v["base"]), max(v["base"]))
    flag = ""
    spread = max(max(v["base"]) - min(v["base"]), max(v["new"]) - min(v["new"]))
    if mb - mn > spread:  # worse by more than the spread of the repetitions
        flag = " **worse**"; worse.append(k)
    print(f"| {k} | {fmt(mb)} ({fmt(spread_b[0])}–{fmt(spread_b[1])}) | {fmt(mn)} ({fmt(min(v['new']))}–{fmt(max(v['new']))}) | {ratio:.2f}{flag} |")
print()
print("worse than the spread of their repetitions:", ", ".join(worse) or "none")

"""Direct copy vs collective staging with N local processes acting as N nodes (own DEST each).

Prints one JSON object and writes docs/bench/collective.md. Measures, in the same run: wall time
(launch to last exit, includes Python/torch start-up), in-process staging seconds, and SRC bytes
read in total (from the processes' own JSON results), plus the host's raw figures (SRC read
bandwidth, DEST write+fsync bandwidth, gloo loopback all_gather bandwidth with N processes) and
the model's prediction (stager.advice.scaling) for this host, where the N "nodes" share one disk.

    .venv/bin/python tools/bench/bench_collective.py --nodes 4 --mb 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.advice.scaling import Cluster, predict  # noqa: E402
from stager.manifest import Manifest, ShardInfo  # noqa: E402

GATHER = r'''
import datetime as dt, os, sys, time, torch, torch.distributed as dist
r, n, port, mb = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
st = dist.TCPStore("127.0.0.1", port, n, r == 0, dt.timedelta(seconds=60))
dist.init_process_group("gloo", store=st, rank=r, world_size=n)
c = 8 << 20
s, o = torch.zeros(c, dtype=torch.uint8), torch.zeros(n * c, dtype=torch.uint8)
dist.all_gather_into_tensor(o, s)
steps = max(1, (mb << 20) // c)
t = time.perf_counter()
for _ in range(steps):
    dist.all_gather_into_tensor(o, s)
dt_ = time.perf_counter() - t
if r == 0:
    print(steps * c * (n - 1) / dt_)
dist.destroy_process_group()
'''


def make_dataset(out: Path, mb: int, shard_mb: int = 4) -> Manifest:
    """Random shard files and a manifest (no per-sample index: staging only moves files)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shards = []
    for i in range(max(1, mb // shard_mb)):
        data = rng.integers(0, 256, shard_mb << 20, dtype=np.uint8).tobytes()
        name = f"shard-{i:05d}.bin"
        (out / name).write_bytes(data)
        z = np.zeros(0, np.int64)
        shards.append(ShardInfo(name, len(data), xxhash.xxh3_128_hexdigest(data), [], z, z, z))
    m = Manifest(format="tar", classes=[], shards=shards)
    m.write(out)
    return m


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_nodes(src: Path, work: Path, n: int, collective: bool) -> dict:
    """Launch n `stager stage` processes (one per simulated node); wall time and summed figures."""
    port = _port()
    procs = []
    t = time.perf_counter()
    for i in range(n):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE="1", PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "stager", "stage", str(src), str(work / f"dest{i}"), "--json"]
        cmd += ["--collective", "--timeout", "120"] if collective else ["-j", "1"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    res = []
    for p in procs:
        so, se = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"stage failed: {se}")
        res.append(json.loads(so.splitlines()[-1]))
    wall = time.perf_counter() - t
    if collective:
        src_bytes = res[0]["totals"]["src_bytes"]
    else:
        src_bytes = sum(r["bytes_copied"] for r in res)
    out = {"wall_s": round(wall, 3), "stage_s": round(max(r["seconds"] for r in res), 3), "src_bytes": src_bytes}
    # Data phase only (after the group formed: excludes importing torch and rendezvous).
    out["data_s"] = round(res[0]["totals"]["exchange_s"], 3) if collective else out["stage_s"]
    return out


def host_figures(src: Path, work: Path, n: int, mb: int) -> dict:
    """SRC read bandwidth (page cache here), DEST write+fsync bandwidth, gloo all_gather bandwidth."""
    t = time.perf_counter()
    total = sum(len(p.read_bytes()) for p in sorted(src.glob("*.bin")))
    read_bps = total / (time.perf_counter() - t)
    buf = os.urandom(8 << 20)
    t = time.perf_counter()
    with open(work / "w.tmp", "wb") as f:
        for _ in range(max(1, mb // 8)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    write_bps = max(1, mb // 8) * len(buf) / (time.perf_counter() - t)
    os.unlink(work / "w.tmp")
    port = _port()
    procs = [subprocess.Popen([sys.executable, "-c", GATHER, str(r), str(n), str(port), str(mb)],
                              stdout=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    nic_bps = float(outs[0].strip().splitlines()[-1])
    return {"read_bps": read_bps, "write_bps": write_bps, "allgather_recv_bps": nic_bps}


def model_for_host(h: dict, n: int, d: float, files: int) -> dict:
    """The model with this host's figures; the n simulated nodes share one disk for writing."""
    c = Cluster(dataset_bytes=d, nodes=n, nic_bps=h["allgather_recv_bps"] * n / max(n - 1, 1), fs_bps=h["read_bps"],
                osts=1, ost_bps=h["read_bps"], ssd_write_bps=h["write_bps"] / n, files=files, mds_ops=1e5,
                alpha_s=50e-6)
    return {s: round(predict(c, s).stage_s, 3) for s in ("direct", "collective")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mb", type=int, default=64, help="dataset size in MB")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "collective.md"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-coll-"))
    try:
        m = make_dataset(work / "src", args.mb)
        d = m.num_bytes
        rows = []
        for n in args.nodes:
            h = host_figures(work / "src", work, n, args.mb)
            row: dict = {"nodes": n, "dataset_bytes": d, "host": {k: round(v / 1e9, 3) for k, v in h.items()}}
            for mode in ("direct", "collective"):
                sub = work / f"{mode}{n}"
                sub.mkdir()
                row[mode] = run_nodes(work / "src", sub, n, mode == "collective")
                row[mode]["src_x"] = round(row[mode]["src_bytes"] / d, 3)
                shutil.rmtree(sub)
            row["model_stage_s"] = model_for_host(h, n, d, len(m.shards))
            row["collective_vs_direct_stage"] = round(row["collective"]["stage_s"] / row["direct"]["stage_s"], 3)
            row["src_bytes_ratio"] = round(row["direct"]["src_bytes"] / row["collective"]["src_bytes"], 3)
            rows.append(row)
        print(json.dumps({"rows": rows}, indent=1))
        write_md(Path(args.out), rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_md(path: Path, rows: list[dict]) -> None:
    lines = [
        "# Collective staging vs direct copy (local processes as nodes)",
        "",
        "Provisional figures from `tools/bench/bench_collective.py` on the shared 2-core development box "
        "(busy with other jobs). SRC is on the same local disk as every DEST and mostly in the page "
        "cache, so this measures the mechanics (SRC bytes, exchange overhead), not a Lustre cluster. "
        "Wall time includes Python and torch start-up; stage s is the in-process time of the slowest node "
        "(for collective: importing torch and the rendezvous too); data phase s excludes those.",
        "",
        "| nodes | dataset MB | mode | wall s | stage s | data phase s | model s | SRC bytes (x dataset) |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for mode in ("direct", "collective"):
            x = r[mode]
            lines.append(f"| {r['nodes']} | {r['dataset_bytes'] / 1e6:.0f} | {mode} | {x['wall_s']:.2f} | "
                         f"{x['stage_s']:.2f} | {x['data_s']:.2f} | {r['model_stage_s'][mode]:.2f} | "
                         f"{x['src_x']:.2f} |")
    lines += ["", "Host figures (GB/s) per run: " + "; ".join(
        f"{r['nodes']} nodes: read {r['host']['read_bps']}, write+fsync {r['host']['write_bps']}, "
        f"gloo all_gather receive {r['host']['allgather_recv_bps']}" for r in rows), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()

"""Print stager.advice.scaling's table: staging time and shared-FS bytes per strategy for 1 to 4,096 nodes.

    .venv/bin/python tools/scaling_sim.py --dataset-gb 150 --nic-gbit 100 --fs-gbs 100 --osts 64
    .venv/bin/python tools/scaling_sim.py --png docs/scaling.png      # needs matplotlib
    .venv/bin/python tools/scaling_sim.py --json

Units on the command line: GB (1e9 bytes), GB/s, Gbit/s for the NIC.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stager.advice.scaling import STRATEGIES, Cluster, format_table, recommend, table

NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def build(args: argparse.Namespace) -> Cluster:
    return Cluster(
        dataset_bytes=args.dataset_gb * 1e9,
        nodes=1,
        nic_bps=args.nic_gbit * 1e9 / 8,
        fs_bps=args.fs_gbs * 1e9,
        osts=args.osts,
        ost_bps=args.ost_gbs * 1e9,
        ssd_write_bps=args.ssd_write_gbs * 1e9,
        ssd_read_bps=args.ssd_read_gbs * 1e9,
        files=args.files,
        mds_ops=args.mds_ops,
        epochs=args.epochs,
        group_setup_s=args.group_setup_s,
        local_capacity=args.local_gb * 1e9 if args.local_gb else None,
    )


def plot(base: Cluster, nodes: list[int], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: `pip install matplotlib` for the plot; the table above has the data",
              file=sys.stderr)
        return False
    preds = table(base, nodes)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for s in STRATEGIES:
        ps = [p for p in preds if p.strategy == s]
        if s != "stream":
            a.loglog([p.nodes for p in ps], [max(p.stage_s, 1e-3) for p in ps], marker="o", label=s)
        b.loglog([p.nodes for p in ps], [max(p.fs_bytes_run / 1e9, 1e-3) for p in ps], marker="o", label=s)
    a.set(xlabel="nodes", ylabel="staging time (s)", title="staging time")
    b.set(xlabel="nodes", ylabel="shared-FS GB over the run", title=f"shared-FS bytes ({base.epochs} epochs)")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset-gb", type=float, default=150.0)
    ap.add_argument("--nic-gbit", type=float, default=100.0, help="per-node NIC, Gbit/s")
    ap.add_argument("--fs-gbs", type=float, default=100.0, help="shared FS aggregate read, GB/s")
    ap.add_argument("--osts", type=int, default=64)
    ap.add_argument("--ost-gbs", type=float, default=2.0, help="per-OST read, GB/s")
    ap.add_argument("--ssd-write-gbs", type=float, default=3.0, help="per-node local SSD write, GB/s")
    ap.add_argument("--ssd-read-gbs", type=float, default=6.0)
    ap.add_argument("--files", type=int, default=600, help="files in the dataset (shards)")
    ap.add_argument("--mds-ops", type=float, default=20e3, help="metadata operations/s of the MDS")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--group-setup-s", type=float, default=3.0,
                    help="collective: importing torch and forming the group, seconds (measured 2-3 on tools/cluster)")
    ap.add_argument("--local-gb", type=float, default=None, help="node-local capacity (default: unlimited)")
    ap.add_argument("--nodes", type=int, nargs="+", default=NODES)
    ap.add_argument("--png", default=None, help="also write a plot (matplotlib)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    base = build(args)
    preds = table(base, args.nodes)
    recs = {n: recommend(replace(base, nodes=n)) for n in args.nodes}
    if args.json:
        print(json.dumps({"predictions": [p.to_json() for p in preds],
                          "recommended": {str(n): r["strategy"] for n, r in recs.items()}}))
    else:
        print(format_table(preds))
        print()
        print("recommended: " + ", ".join(f"{n}: {r['strategy']}" for n, r in recs.items()))
    if args.png:
        plot(base, args.nodes, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Direct vs collective staging on the one-machine Slurm cluster (tools/cluster), at 1, 2 and 4 nodes,
next to what stager.scaling predicts for the same link speeds. Needs a running cluster (`make cluster`).

    .venv/bin/python tools/bench/bench_cluster_staging.py --mb 200 --nodes 1 2 4 --repeat 2 \
        --png docs/scaling-cluster.png

Every run is a real job: `srun --ntasks-per-node=1 stager stage SRC DEST --json [--collective]` with
SRC on the cluster's shared file system (sshfs behind the storage host's tbf-capped link) and DEST
on each node's local disk. Measured per run: the step's wall time inside the job (srun start to the
last node's exit: includes Python start-up and, for collective, importing torch and the rendezvous),
stager's in-process seconds on the slowest node, the data phase (collective: reading the share plus
the exchange, `totals.exchange_s`; direct: the copy), and the bytes the storage host sent (its
interface counter, CLUSTER_SERVED_BYTES) as a multiple of the dataset.

The model (stager.scaling.predict) is fed this cluster's own figures, measured in the same run: FS =
what one node reads from the shared file system alone (the storage link), NIC = the gloo all_gather
receive bandwidth between N nodes over the bridge (scaled to a per-node link as in
tools/bench/bench_collective.py), SSD = the machine's one disk's write+fsync bandwidth / N (the
nodes share it). Writes docs/bench/cluster-staging.md and, with --png, a plot.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stager.advice.scaling import Cluster as Model  # noqa: E402
from stager.advice.scaling import predict  # noqa: E402
from tools.bench.bench_collective import GATHER, make_dataset  # noqa: E402
from tools.cluster.client import Cluster  # noqa: E402

STAGE = """#!/bin/bash
source .venv/bin/activate
t0=$(date +%s.%N)
srun --ntasks-per-node=1 --output={tasks}/%N.out --error={tasks}/%N.err stager stage {src} {dest} --json {flags}
rc=$?
t1=$(date +%s.%N)
echo "{{\\"step_wall_s\\": $(awk "BEGIN {{ print $t1 - $t0 }}"), \\"rc\\": $rc}}"
"""

READ = """
import os, sys, time
files = sys.argv[1:]
t = time.perf_counter()
n = 0
for f in files:
    with open(f, "rb", buffering=0) as fh:
        while chunk := fh.read(1 << 20):
            n += len(chunk)
print(n / (time.perf_counter() - t))
"""


def job_script(c: Cluster, work: Path, name: str, body: str) -> tuple[Path, Path]:
    script = work / f"{name}.sh"
    script.write_text(body)
    tasks = work / f"{name}.tasks"
    tasks.mkdir(exist_ok=True)
    return script, tasks


def run_job(c: Cluster, script: Path, nodes: int, timeout: float = 900) -> str:
    out = script.with_suffix(".out")
    job = c.sbatch([f"--nodes={nodes}", "--ntasks-per-node=1", "--cpus-per-task=1", "--exclusive", str(script)],
                   output=out, cwd=ROOT, timeout=timeout)
    if job.state != "COMPLETED":
        raise SystemExit(f"benchmark job failed: {job.describe()}")
    return job.output


def fs_read_bps(c: Cluster, src_export: Path, work: Path) -> float:
    """One node reading the shared file system alone: the storage link's effective throughput."""
    files = sorted(str(c.shared_path(p)) for p in src_export.glob("shard-*"))[:12]
    body = "#!/bin/bash\nsource .venv/bin/activate\npython -c '" + READ.replace("'", "'\\''") + "' " + \
        " ".join(files) + "\n"
    script, _ = job_script(c, work, "fs-read", body)
    return float(run_job(c, script, 1).strip().splitlines()[-1])


def allgather_bps(c: Cluster, work: Path, nodes: int, mb: int = 64) -> float:
    """gloo all_gather receive bandwidth per node with ``nodes`` nodes over the bridge."""
    gather = work / "gather.py"
    gather.write_text(GATHER.replace('"127.0.0.1"', 'os.environ["MASTER_ADDR"]'))
    body = f"""#!/bin/bash
source .venv/bin/activate
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun --ntasks-per-node=1 bash -c 'python {gather} $SLURM_PROCID $SLURM_NTASKS $((21000 + SLURM_JOB_ID % 1000)) {mb}'
"""
    script, _ = job_script(c, work, f"gather{nodes}", body)
    return float(run_job(c, script, nodes).strip().splitlines()[-1])


def disk_write_bps(c: Cluster, mb: int = 256) -> float:
    """write+fsync bandwidth of the disk under every node's CLUSTER_LOCAL (one disk for all nodes)."""
    import os

    target = c.cfg.node_dir(c.nodes[0]) / "local" / "bench-write.tmp"
    buf = os.urandom(8 << 20)
    t = time.perf_counter()
    with open(target, "wb") as f:
        for _ in range(mb // 8):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    bps = (mb // 8) * len(buf) / (time.perf_counter() - t)
    target.unlink()
    return bps


def stage_run(c: Cluster, src_export: Path, work: Path, nodes: int, *, mode: str, tag: str) -> dict:
    dest = c.local / "bench-stage"
    for n in c.nodes:
        shutil.rmtree(c.node_path(n, dest), ignore_errors=True)
    flags = "--collective --timeout 600" if mode == "collective" else ""
    script, tasks = job_script(c, work, tag, STAGE.format(src=c.shared_path(src_export), dest=dest, flags=flags,
                                                          tasks=work / f"{tag}.tasks"))
    before = c.served_bytes()
    out = run_job(c, script, nodes)
    served = c.served_bytes() - before
    step = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    if step["rc"] != 0:
        raise SystemExit(f"{tag}: stage failed; see {tasks}")
    res = [json.loads(ln) for f in sorted(tasks.glob("*.out")) for ln in f.read_text().splitlines()
           if ln.startswith("{")]
    for n in c.nodes:
        shutil.rmtree(c.node_path(n, dest), ignore_errors=True)
    exchange_s = res[0].get("totals", {}).get("exchange_s", 0.0) if mode == "collective" else 0.0
    data_s = exchange_s or max(r["seconds"] for r in res)  # one node: nothing to exchange, a plain copy
    return {"step_wall_s": step["step_wall_s"], "stage_s": max(r["seconds"] for r in res), "data_s": data_s,
            "served_bytes": served}


def model(fs: float, nic: float, write: float, n: int, *, d: float, files: int) -> dict[str, dict[str, float]]:
    """The model's staging time per strategy: ``step`` (with the collective's group setup, default
    3 s) and ``data`` (without it: the bandwidth terms alone, to compare with the data phase)."""
    m = Model(dataset_bytes=d, nodes=n, nic_bps=nic, fs_bps=fs, osts=1, ost_bps=fs, ssd_write_bps=write / n,
              files=files, mds_ops=1e4, alpha_s=100e-6)
    bare = replace(m, group_setup_s=0.0)
    return {s: {"step": predict(m, s).stage_s, "data": predict(bare, s).stage_s} for s in ("direct", "collective")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mb", type=int, default=200, help="dataset size in MB (random 8 MiB shards)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per point; the table shows the median")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "cluster-staging.md"))
    ap.add_argument("--png", default=None, help="also draw the plot (matplotlib)")
    a = ap.parse_args(argv)
    c = Cluster()
    if max(a.nodes) > len(c.nodes):
        raise SystemExit(f"the cluster has {len(c.nodes)} nodes; bring it up with CLUSTER_NODES={max(a.nodes)}")
    work = Path(c.env["CLUSTER_STATE"]) / "bench-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    src = c.export / "bench-stage"
    shutil.rmtree(src, ignore_errors=True)
    try:
        m = make_dataset(src, a.mb, shard_mb=8)
        d = float(m.num_bytes)
        fs = fs_read_bps(c, src, work)
        write = disk_write_bps(c)
        print(f"FS (one node, sshfs over the {c.env['CLUSTER_STORAGE_MBIT']} Mbit link): {fs / 1e6:.1f} MB/s; "
              f"disk write+fsync {write / 1e9:.2f} GB/s", flush=True)
        rows = []
        for n in a.nodes:
            nic = allgather_bps(c, work, n) * n / (n - 1) if n > 1 else 1e12
            pred = model(fs, nic, write, n, d=d, files=len(m.shards))
            row: dict = {"nodes": n, "dataset_bytes": d, "fs_bps": fs, "nic_bps": nic if n > 1 else None,
                         "ssd_write_bps": write / n, "model_s": pred}
            for mode in ("direct", "collective"):
                runs = [stage_run(c, src, work, n, mode=mode, tag=f"{mode}{n}-{r}") for r in range(a.repeat)]
                row[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                row[mode]["runs"] = runs
                print(f"{n} nodes {mode:10s} step {row[mode]['step_wall_s']:6.2f}s (model {pred[mode]['step']:6.2f}s) "
                      f"data {row[mode]['data_s']:6.2f}s (model {pred[mode]['data']:6.2f}s) "
                      f"served {row[mode]['served_bytes'] / d:.2f}x", flush=True)
            rows.append(row)
        write_md(Path(a.out), rows, c)
        if a.png:
            plot(rows, a.png)
        print(json.dumps(rows, indent=1, default=float))
    finally:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def write_md(path: Path, rows: list[dict], c: Cluster) -> None:
    r0 = rows[0]
    lines = [
        "# Staging on the one-machine Slurm cluster: direct vs collective, measured vs modelled",
        "",
        f"`tools/bench/bench_cluster_staging.py` on `make cluster` ({len(c.nodes)} nodes, storage link capped at "
        f"{c.env['CLUSTER_STORAGE_MBIT']} Mbit/s with tc tbf, sshfs as the shared file system), "
        f"{r0['dataset_bytes'] / 1e6:.0f} MB dataset in 8 MiB shards, median of the runs; the machine's 2 cores "
        "run every node. Step = srun start to the last node's exit (Python start-up, and for collective torch "
        "import and rendezvous, included); data = collective: read share + exchange, direct: the copy; model = "
        "stager.advice.scaling.predict with this cluster's measured FS, NIC and disk figures (step: with the "
        "collective's default 3 s group setup; data: the bandwidth terms alone); served = bytes the storage host "
        "sent (its interface counter) / dataset bytes.",
        "",
        "| nodes | strategy | step s | model step s | data s | model data s | served (x dataset) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for mode in ("direct", "collective"):
            x = r[mode]
            pm = r["model_s"][mode]
            lines.append(f"| {r['nodes']} | {mode} | {x['step_wall_s']:.2f} | {pm['step']:.2f} | {x['data_s']:.2f} | "
                         f"{pm['data']:.2f} | {x['served_bytes'] / r['dataset_bytes']:.2f} |")
    def nic(r: dict) -> str:
        return "-" if r["nic_bps"] is None else f"{r['nic_bps'] / 1e6:.0f} MB/s"

    lines += ["", "Model inputs measured in the same run: " + "; ".join(
        f"{r['nodes']} nodes: FS {r['fs_bps'] / 1e6:.1f} MB/s, NIC {nic(r)}, disk per node "
        f"{r['ssd_write_bps'] / 1e6:.0f} MB/s" for r in rows) + ".", ""]
    lines += ["Raw runs (JSON):", "", "```json", json.dumps(rows, indent=1, default=float), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def plot(rows: list[dict], png: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: `pip install matplotlib` for the plot", file=sys.stderr)
        return
    nodes = [r["nodes"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in (("direct", "tab:red"), ("collective", "tab:blue")):
        ax.plot(nodes, [r[mode]["step_wall_s"] for r in rows], "o-", color=color, label=f"{mode}: measured step")
        ax.plot(nodes, [r[mode]["data_s"] for r in rows], "s:", color=color, label=f"{mode}: measured data phase")
        ax.plot(nodes, [r["model_s"][mode]["step"] for r in rows], "--", color=color, alpha=0.6,
                label=f"{mode}: model (step)")
        ax.plot(nodes, [r["model_s"][mode]["data"] for r in rows], "-.", color=color, alpha=0.4,
                label=f"{mode}: model (data)")
        bx.plot(nodes, [r[mode]["served_bytes"] / r["dataset_bytes"] for r in rows], "o-", color=color, label=mode)
    ax.set_xlabel("nodes")
    ax.set_ylabel("seconds")
    ax.set_xticks(nodes)
    ax.set_title(f"staging {rows[0]['dataset_bytes'] / 1e6:.0f} MB, storage link "
                 f"{rows[0]['fs_bps'] * 8 / 1e6:.0f} Mbit/s (measured)", fontsize=10)
    ax.legend(fontsize=7)
    bx.set_xlabel("nodes")
    bx.set_ylabel("bytes served by the storage host / dataset")
    bx.set_xticks(nodes)
    bx.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    raise SystemExit(main())

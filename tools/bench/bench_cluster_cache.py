"""The node-local shard cache on the one-machine Slurm cluster (tools/cluster): a chain of jobs, two
concurrent jobs, and eviction under a quota with three datasets cycling. Needs `make cluster`.

    flock /work/cluster.lock .venv/bin/python tools/bench/bench_cluster_cache.py --mb 300 \\
        --png docs/scaling-cache.png

Every job is a real Slurm job on node1 (`sbatch --nodelist=node1`) that runs `stager stage SRC DEST
[--cache CACHE] --json` with SRC on the cluster's shared file system (sshfs behind the storage
host's tbf-capped link) and DEST and the cache on node1's local disk, then `stager verify DEST`, then
removes DEST as a site epilog does. Measured per job: stager's own staging seconds (in-process, the
`seconds` of its JSON: what the job waits for, without Python's start-up), and the bytes the storage
host sent during the job (its interface counter, CLUSTER_SERVED_BYTES) as a multiple of the dataset.

1. **Chain**: 5 jobs one after another, without a cache and then with one (a fresh cache).
2. **Concurrent**: 2 jobs started together with a fresh cache: SRC served once, both DESTs verified.
3. **Eviction**: datasets A, B, C cycled twice (A B C A B C) under a quota of 1.5x one dataset (and,
   for contrast, 3.5x); each job keeps its DEST (hard links to the objects) until the next job has
   staged, so every stage evicts next to a live job. Checked: no evicted object was linked by a job
   still running (the cache's eviction log against the live jobs' files); hit rate per job.

Writes docs/bench/cluster-cache.md and, with --png, a plot.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.bench.bench_collective import make_dataset  # noqa: E402
from tools.cluster.client import Cluster  # noqa: E402

JOB = """#!/bin/bash
source .venv/bin/activate
dest={jobs}/job$SLURM_JOB_ID
stager stage {src} "$dest" {flags} --json > {out}/job$SLURM_JOB_ID.json 2> {out}/job$SLURM_JOB_ID.err
rc=$?
stager verify "$dest" -q >> {out}/job$SLURM_JOB_ID.err 2>&1 || rc=3
{hold}
stager verify "$dest" -q >> {out}/job$SLURM_JOB_ID.err 2>&1 || rc=3
rm -rf "$dest"
exit $rc
"""
HOLD = "touch {out}/job$SLURM_JOB_ID.staged; while [ ! -e {out}/release$SLURM_JOB_ID ]; do sleep 0.1; done"
NODE = "node1"


class Bench:
    def __init__(self, c: Cluster, work: Path) -> None:
        self.c = c
        self.work = work
        self.out = work / "jobs-out"
        self.out.mkdir(parents=True, exist_ok=True)
        self.jobs = c.local / "bench-cache-jobs"
        self.n = 0

    def script(self, src: Path, flags: str, *, hold: bool = False) -> Path:
        self.n += 1
        p = self.work / f"job{self.n}.sh"
        p.write_text(JOB.format(src=self.c.shared_path(src), jobs=self.jobs, flags=flags, out=self.out,
                                hold=HOLD.format(out=self.out) if hold else ""))
        return p

    def submit(self, script: Path) -> int:
        return self.c.submit([f"--nodelist={NODE}", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
                              f"--output={script.with_suffix('.out')}", str(script)], cwd=ROOT)

    def result(self, job_id: int) -> dict:
        job = self.c.wait(job_id, timeout=900)
        if job.state != "COMPLETED":
            err = (self.out / f"job{job_id}.err")
            raise SystemExit(f"job {job_id} failed: {job.describe()}\n{err.read_text() if err.exists() else ''}")
        return json.loads((self.out / f"job{job_id}.json").read_text().strip().splitlines()[-1])

    def run(self, src: Path, flags: str) -> dict:
        before = self.c.served_bytes()
        t = time.perf_counter()
        res = self.result(self.submit(self.script(src, flags)))
        res["served_bytes"] = self.c.served_bytes() - before
        res["job_wall_s"] = time.perf_counter() - t
        return res

    def cache_dir(self, name: str) -> tuple[Path, Path]:
        """(the cache as the node sees it, as this machine sees it), removed first."""
        d = self.c.local / name
        host = self.c.node_path(NODE, d)
        shutil.rmtree(host, ignore_errors=True)
        return d, host


def chain(b: Bench, src: Path, d: float, n: int) -> dict:
    rows = {}
    for mode in ("no cache", "cache"):
        flags = ""
        if mode == "cache":
            cache, _ = b.cache_dir("bench-cache-chain")
            flags = f"--cache {cache}"
        runs = []
        for i in range(n):
            r = b.run(src, flags)
            runs.append({"job": i + 1, "stage_s": r["seconds"], "served_x": r["served_bytes"] / d,
                         "bytes_copied": r["bytes_copied"], "cache": r.get("cache")})
            print(f"chain {mode:8s} job {i + 1}: staged in {r['seconds']:.3f} s, served {r['served_bytes'] / d:.3f}x",
                  flush=True)
        rows[mode] = runs
    return rows


def concurrent(b: Bench, src: Path, d: float) -> dict:
    cache, _ = b.cache_dir("bench-cache-conc")
    before = b.c.served_bytes()
    ids = [b.submit(b.script(src, f"--cache {cache} --timeout 600")) for _ in range(2)]
    res = [b.result(j) for j in ids]
    served = b.c.served_bytes() - before
    out = {"served_x": served / d, "jobs": [{"stage_s": r["seconds"], **{k: r["cache"][k] for k in (
        "files_hit", "files_filled", "files_from_peer", "bytes_filled", "bytes_from_peer", "waited_s")}}
        for r in res], "verified": True}
    print(f"concurrent: served {served / d:.3f}x; " + "; ".join(
        f"job {i + 1}: filled {j['files_filled']}, from the other {j['files_from_peer']}, {j['stage_s']:.2f} s"
        for i, j in enumerate(out["jobs"])), flush=True)
    return out


def _keys_of(record_dir: Path) -> dict[str, set[str]]:
    out = {}
    for p in record_dir.glob("*.json"):
        rec = json.loads(p.read_text())
        out[rec["dataset_id"]] = {f[2] for f in rec["files"]}
    return out


def eviction(b: Bench, srcs: list[tuple[str, Path, float]], factor: float, pin: str | None = None) -> dict:
    cache, host = b.cache_dir(f"bench-cache-evict-{factor}{'-pin' if pin else ''}")
    quota = int(factor * srcs[0][2])
    if pin is not None:  # on the node: the record's keys are computed from SRC as the node sees it
        py = str(ROOT / ".venv" / "bin" / "python")
        pinned = next(p for n, p, _ in srcs if n == pin)
        for cmd in (["init", str(cache)], ["pin", str(cache), str(b.c.shared_path(pinned))]):
            r = b.c.on(NODE, [py, "-m", "stager", "cache", *cmd, "-q"])
            if r.returncode != 0:
                raise SystemExit(f"stager cache {cmd[0]} on {NODE} failed: {r.stderr}")
    order = [s for _ in range(2) for s in srcs]
    live: list[tuple[int, str]] = []  # (job id, dataset id) of jobs still holding their DEST
    rows = []
    log_seen = 0
    for name, src, d in order:
        jid = b.submit(b.script(src, f"--cache {cache} --cache-quota {quota} --timeout 600", hold=True))
        while not (b.out / f"job{jid}.staged").exists():
            if b.c.job(jid).state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                raise SystemExit(f"eviction job {jid} failed: {b.c.job(jid).describe()}")
            time.sleep(0.1)
        res = json.loads((b.out / f"job{jid}.json").read_text().strip().splitlines()[-1])
        cs = res["cache"]
        log = [json.loads(ln) for ln in (host / "log.jsonl").read_text().splitlines()] if \
            (host / "log.jsonl").exists() else []
        new, log_seen = log[log_seen:], len(log)
        keys = _keys_of(host / "datasets")
        live_keys = set().union(*(keys.get(ds, set()) for _, ds in live))
        evicted_live = [e["key"] for e in new if e["key"] in live_keys]
        rows.append({"dataset": name, "hit_bytes": cs["bytes_hit"], "filled_bytes": cs["bytes_filled"],
                     "uncached_bytes": cs["bytes_uncached"], "evicted_bytes": cs["evicted_bytes"],
                     "in_use_at_eviction": (cs["eviction"] or {}).get("linked_bytes", 0) +
                     (cs["eviction"] or {}).get("in_use_bytes", 0),
                     "hit_rate": cs["bytes_hit"] / d, "evicted_while_in_use": len(evicted_live),
                     "stage_s": res["seconds"]})
        tag = f"x{factor}{' pin ' + pin if pin else ''}"
        print(f"evict {tag} {name}: hit {cs['bytes_hit'] / d:.2f}, evicted {cs['evicted_bytes'] / 1e6:.0f} MB, "
              f"uncached {cs['bytes_uncached'] / 1e6:.0f} MB, evicted while in use: {len(evicted_live)}", flush=True)
        for old, _ in live:  # the previous job ends once this one has staged (its DEST goes with it)
            (b.out / f"release{old}").touch()
            b.result(old)
        live = [(jid, res["dataset_id"])]
    for old, _ in live:
        (b.out / f"release{old}").touch()
        b.result(old)
    total = sum(r["hit_bytes"] for r in rows)
    allb = sum(d for _, _, d in order)
    return {"quota_bytes": quota, "factor": factor, "pinned": pin, "jobs": rows, "hit_rate": total / allb,
            "second_pass_hit_rate": sum(r["hit_bytes"] for r in rows[len(srcs):]) / sum(d for _, _, d in srcs),
            "evicted_while_in_use": sum(r["evicted_while_in_use"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=300, help="chain/concurrent dataset size in MB (8 MiB shards)")
    ap.add_argument("--cycle-mb", type=int, default=64, help="size of each of the three cycled datasets")
    ap.add_argument("--chain", type=int, default=5, help="jobs in the chain")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "cluster-cache.md"))
    ap.add_argument("--png", default=None)
    a = ap.parse_args(argv)
    c = Cluster()
    work = Path(c.env["CLUSTER_STATE"]) / "bench-cache-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    b = Bench(c, work)
    srcs = []
    try:
        src = c.export / "bench-cache-src"
        shutil.rmtree(src, ignore_errors=True)
        m = make_dataset(src, a.mb, shard_mb=8)
        d = float(m.copy_bytes)
        for name in "ABC":
            p = c.export / f"bench-cache-{name}"
            shutil.rmtree(p, ignore_errors=True)
            mm = _distinct(p, a.cycle_mb, ord(name))  # each cycled dataset its own bytes
            srcs.append((name, p, float(mm.copy_bytes)))
        result = {"dataset_bytes": d, "storage_mbit": c.env["CLUSTER_STORAGE_MBIT"],
                  "chain": chain(b, src, d, a.chain), "concurrent": concurrent(b, src, d),
                  "eviction": [eviction(b, srcs, 1.5), eviction(b, srcs, 1.5, pin="A"), eviction(b, srcs, 3.5)]}
        write_md(Path(a.out), result)
        if a.png:
            plot(result, a.png)
        print(json.dumps(result, indent=1, default=float))
    finally:
        for p in [c.export / "bench-cache-src", *(s[1] for s in srcs)]:
            shutil.rmtree(p, ignore_errors=True)
        for name in ("bench-cache-chain", "bench-cache-conc", "bench-cache-evict-1.5", "bench-cache-evict-1.5-pin",
                     "bench-cache-evict-3.5", "bench-cache-jobs"):
            shutil.rmtree(c.node_path(NODE, c.local / name), ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _distinct(out: Path, mb: int, seed: int) -> Any:
    """Random shard files and a manifest, seeded by ``seed`` (bench_collective's make_dataset is seed 0)."""
    import numpy as np
    import xxhash

    from stager.manifest import Manifest, ShardInfo

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards = []
    for i in range(max(1, mb // 8)):
        data = rng.integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
        name = f"shard-{i:05d}.bin"
        (out / name).write_bytes(data)
        z = np.zeros(0, np.int64)
        shards.append(ShardInfo(name, len(data), xxhash.xxh3_128_hexdigest(data), [], z, z, z))
    m = Manifest(format="tar", classes=[], shards=shards)
    m.write(out)
    return m


def write_md(path: Path, r: dict) -> None:
    d = r["dataset_bytes"]
    ch = r["chain"]
    first = ch["cache"][0]["stage_s"]
    lines = [
        "# The node-local shard cache on the one-machine Slurm cluster",
        "",
        f"`tools/bench/bench_cluster_cache.py` on `make cluster`: real Slurm jobs on node1, SRC on the shared file "
        f"system behind the storage host's {r['storage_mbit']} Mbit/s link, DEST and the cache on node1's local "
        "disk; each job stages, verifies its DEST, and removes it as an epilog does. Staging seconds are stager's own "
        "(its JSON `seconds`: what the job waits for, Python start-up not included); served = bytes the storage "
        "host's interface sent during the job / dataset bytes (TCP, SFTP and the manifest read included).",
        "",
        f"## A chain of {len(ch['cache'])} jobs ({d / 1e6:.0f} MB dataset, 8 MiB shards)",
        "",
        "| job | no cache: staged s | served (x) | cache: staged s | % of job 1 | served (x) | linked files |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for a, b in zip(ch["no cache"], ch["cache"], strict=True):
        hit = b["cache"]["files_hit"] if b["cache"] else 0
        lines.append(f"| {a['job']} | {a['stage_s']:.3f} | {a['served_x']:.3f} | {b['stage_s']:.3f} | "
                     f"{100 * b['stage_s'] / first:.1f}% | {b['served_x']:.3f} | {hit} |")
    tot_a = sum(x["served_x"] for x in ch["no cache"])
    tot_b = sum(x["served_x"] for x in ch["cache"])
    lines += ["", f"Source bytes served over the chain: **{tot_a:.2f}x** the dataset without a cache, "
              f"**{tot_b:.2f}x** with one; jobs 2-{len(ch['cache'])} staged in at most "
              f"**{100 * max(x['stage_s'] for x in ch['cache'][1:]) / first:.1f}%** of job 1's staging time.", ""]
    co = r["concurrent"]
    lines += ["## Two concurrent jobs, one dataset, one (empty) cache", "",
              f"Served **{co['served_x']:.3f}x** the dataset for both jobs together; both DESTs verified.", "",
              "| job | staged s | files copied from SRC | files the other job copied (linked) | waited s |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    for i, j in enumerate(co["jobs"]):
        lines.append(f"| {i + 1} | {j['stage_s']:.2f} | {j['files_filled']} | {j['files_from_peer']} | "
                     f"{j['waited_s']:.2f} |")
    lines += [""]
    for ev in r["eviction"]:
        pinned = f", dataset {ev['pinned']} pinned" if ev["pinned"] else ""
        lines += [f"## Eviction: quota {ev['factor']}x one dataset ({ev['quota_bytes'] / 1e6:.0f} MB){pinned}, "
                  "A B C A B C", "",
                  "Each job keeps its DEST (hard links to the objects) until the next job has staged.", "",
                  "| job | dataset | hit rate | copied into the cache MB | not cached MB | evicted MB | "
                  "in use at eviction MB | evicted while in use |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for i, j in enumerate(ev["jobs"]):
            lines.append(f"| {i + 1} | {j['dataset']} | {j['hit_rate']:.2f} | {j['filled_bytes'] / 1e6:.0f} | "
                         f"{j['uncached_bytes'] / 1e6:.0f} | {j['evicted_bytes'] / 1e6:.0f} | "
                         f"{j['in_use_at_eviction'] / 1e6:.0f} | {j['evicted_while_in_use']} |")
        lines += ["", f"Hit rate over the cycle {ev['hit_rate']:.2f}, second pass {ev['second_pass_hit_rate']:.2f}; "
                  f"objects evicted while a live job used them: {ev['evicted_while_in_use']}.", ""]
    lines += ["Raw results (JSON):", "", "```json", json.dumps(r, indent=1, default=float), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def plot(r: dict, png: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: `pip install matplotlib` for the plot", file=sys.stderr)
        return
    ch = r["chain"]
    jobs = [x["job"] for x in ch["cache"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    w = 0.38
    ax.bar([j - w / 2 for j in jobs], [x["stage_s"] for x in ch["no cache"]], w, color="tab:red", label="no cache")
    ax.bar([j + w / 2 for j in jobs], [x["stage_s"] for x in ch["cache"]], w, color="tab:blue", label="--cache")
    ax.set_xlabel("job in the chain")
    ax.set_ylabel("staging seconds (stager's own)")
    ax.set_xticks(jobs)
    ax.set_title(f"{r['dataset_bytes'] / 1e6:.0f} MB over a {r['storage_mbit']} Mbit/s link", fontsize=10)
    ax.legend()
    for mode, color in (("no cache", "tab:red"), ("cache", "tab:blue")):
        cum, tot = [], 0.0
        for x in ch[mode]:
            tot += x["served_x"]
            cum.append(tot)
        bx.plot(jobs, cum, "o-", color=color, label=mode)
    bx.set_xlabel("job in the chain")
    bx.set_ylabel("source bytes served so far / dataset")
    bx.set_xticks(jobs)
    bx.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())

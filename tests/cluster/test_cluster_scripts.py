"""Every job script in tools/slurm/ submitted with sbatch to the cluster, unmodified: only documented
environment variables (DATA, VAL, OUT, TRAIN_ARGS, GPUS, BEEOND_MNT, BUDGET, BATCH, MIX) and sbatch
command-line options (CPU only: ``--gpus-per-task=0``, one CPU per task, small node counts).

Checked for each: exit 0; the staging JSON of every node (verified copy, the mode the script asks
for); the training summary (the loss falls, the run completed); from the ranks' key dumps, the same
steps on every rank and every training sample exactly once per epoch across ranks; the epilogue
cleaned what staging made.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stager.manifest import load_manifest
from tools.cluster.client import Cluster

from .conftest import ROOT, expect, read_json_lines

SLURM = ROOT / "tools" / "slurm"
CPU = ["--gpus-per-task=0", "--cpus-per-task=1", "--time=15"]
SMALL = ("--arch resnet18 --width 4 --image-size 32 --epochs 2 --lr 0.8 --warmup-epochs 0.5 --lr-decay cosine "
         "--label-smoothing 0 --threads 1 --log-every 1 --checkpoint-every 0")


def env_for(cluster: Cluster, cifar: dict[str, Path], out: Path, train_args: str, **extra: str) -> dict[str, str]:
    return {"DATA": str(cluster.shared_path(cifar["train"])), "VAL": str(cluster.shared_path(cifar["test"])),
            "OUT": str(out), "TRAIN_ARGS": f"{SMALL} {train_args} --dump-keys {out / 'keys'}", **extra}


def all_keys(train: Path) -> list[str]:
    return sorted(k for sh in load_manifest(train).shards for k in sh.keys)


def check_epochs(keys_dir: Path, ranks: int, train: Path, epochs: int = 2) -> None:
    """Same steps on every rank; per epoch the ranks' samples are disjoint and cover the set once."""
    per_rank = [[json.loads(ln) for ln in (keys_dir / f"keys-rank{r}.jsonl").read_text().splitlines()]
                for r in range(ranks)]
    steps = [[rec["step"] for rec in recs] for recs in per_rank]
    assert all(s == steps[0] for s in steps) and steps[0], steps
    want = all_keys(train)
    for epoch in range(epochs):
        seen = [k for recs in per_rank for rec in recs if rec["epoch"] == epoch for k in rec["keys"]]
        assert sorted(seen) == want, f"epoch {epoch}: {len(seen)} samples, {len(set(seen))} distinct, want {len(want)}"


def check_summary(summary: dict[str, Any], ranks: int) -> None:
    assert summary["completed"] and summary["world_size"] == ranks, summary
    losses = [e["loss"] for e in summary["epoch_loss"]]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert summary["config"]["device"] == "cpu"
    assert summary["config"]["backend"] == ("gloo" if ranks > 1 else None), summary["config"]


def check_stage(out: Path, name: str, nodes: int, **fields: Any) -> list[dict[str, Any]]:
    """The scripts write one JSON file per node: OUT/<name>.<node>.json."""
    files = sorted(out.glob(f"{name}.*.json"))
    assert len(files) == nodes, files
    results = [r for f in files for r in read_json_lines(f)]
    assert len(results) == nodes, [f.read_text() for f in files]
    for r in results:
        assert r["ok"], r
        for k, v in fields.items():
            assert r[k] == v, (k, r)
    return results


def test_single_node_torchrun(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = env_for(cluster, cifar, out, "--batch-size 8", GPUS="2")
    job = cluster.sbatch(["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2", "--gpus-per-node=0", "--time=15",
                          str(SLURM / "train_single_node.sbatch")], output=tmp_path / "job.out", env=env, cwd=ROOT)
    expect(job)
    check_stage(out, "stage-train", 1, mode="full")
    check_stage(out, "stage-val", 1, mode="full")
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 2)
    assert summary["launcher"] == "torchrun" and summary["data_source"]["staged"], summary["data_source"]
    check_epochs(out / "keys", 2, cifar["train"])
    assert job.output.count("removed") == 2, job.output  # the EXIT trap cleaned train and val


def test_multi_node_srun_collective(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    """4 nodes, one rank each, launched by srun; staged collectively, trained from the node-local copies."""
    out = tmp_path / "out"
    env = env_for(cluster, cifar, out, "--batch-size 4")
    job = cluster.sbatch(["--nodes=4", "--ntasks-per-node=1", *CPU, str(SLURM / "train_multi_node.sbatch")],
                         output=tmp_path / "job.out", env=env, cwd=ROOT)
    expect(job)
    results = check_stage(out, "stage-train", 4, collective=True, fallback=None)
    assert sorted(r["node"] for r in results) == [0, 1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 4)
    assert summary["launcher"] == "slurm"
    src = summary["data_source"]
    assert src["staged"] and src["reading_from"].startswith(str(cluster.local)), src
    check_epochs(out / "keys", 4, cifar["train"])
    assert job.output.count("removed") == 8, job.output  # clean of train and val on each of 4 nodes


def test_independent_sweep(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = env_for(cluster, cifar, out, "--batch-size 8 --lr 0.4,0.8 --seed 0,1")
    job = cluster.sbatch(["--nodes=1", "--ntasks-per-node=2", *CPU, str(SLURM / "train_independent.sbatch")],
                         output=tmp_path / "job.out", env=env, cwd=ROOT)
    expect(job)
    check_stage(out, "stage", 1, mode="full")
    runs = [json.loads((out / f"summary.run{i:02d}.json").read_text()) for i in (0, 1)]
    for i, summary in enumerate(runs):
        check_summary(summary, 1)
        assert summary["independent"]["lr"] == [0.4, 0.8][i] and summary["config"]["seed"] == i
        check_epochs(out / "keys" / f"run{i:02d}", 1, cifar["train"])
    assert "removed" in job.output


def test_beeond_shared_dest(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    """Staged once into the BeeOND stand-in: every shard written by exactly one node."""
    out = tmp_path / "out"
    env = env_for(cluster, cifar, out, "--batch-size 8", BEEOND_MNT=str(cluster.beeond))
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", *CPU, str(SLURM / "train_beeond.sbatch")],
                         output=tmp_path / "job.out", env=env, cwd=ROOT)
    expect(job)
    m = load_manifest(cifar["train"])
    results = check_stage(out, "stage-train", 2, mode="shared")
    assert sum(r["files_copied"] for r in results) == len(m.shards), results
    assert all(r["files_copied"] > 0 for r in results), "both nodes wrote a share"
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 2)
    assert summary["data_source"]["reading_from"] == str(cluster.beeond / "train")
    check_epochs(out / "keys", 2, cifar["train"])
    assert list(cluster.cfg.beeond_backing.iterdir()) == [], "beeond stop -d must leave the file system empty"


def test_prefetch_follower_beside_two_node_training(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    """`stage --follow` on each of 2 nodes beside a 2-node DDP job, within half the data per node."""
    out = tmp_path / "out"
    m = load_manifest(cifar["train"])
    budget = m.num_bytes // 2
    env = env_for(cluster, cifar, out, "", BUDGET=str(budget), BATCH="8")
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", *CPU, str(SLURM / "train_prefetch.sbatch")],
                         output=tmp_path / "job.out", env=env, cwd=ROOT)
    expect(job)
    follow = [r for f in sorted(out.glob("follow.*.json")) for r in read_json_lines(f)]
    assert len(follow) == 2, follow
    for f in follow:
        assert f["stopped"] == "finished", f
        assert f["budget"] == budget and f["peak_local_bytes"] <= budget, f
        assert f["fetched_bytes"] > 0 and 0.0 <= f["hit_rate"] <= 1.0, f
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 2)
    assert summary["data_source"]["staged"] is False
    check_epochs(out / "keys", 2, cifar["train"])


def test_mix_staged_collectively_then_trained(cluster: Cluster, cifar: dict[str, Path], tmp_path: Path) -> None:
    """train_mix.sbatch on 2 nodes: a mix file on the shared file system (streams by relative path), staged
    collectively into each node's local disk, trained with --mix: the same steps on both ranks, each batch
    holding a third from the up-weighted small stream, the epilogue cleaning both streams' copies."""
    mix = cifar["train"].parent / "mix.yaml"
    mix.write_text("composition: stratified\nstreams:\n  - {name: a, path: cifar-train, weight: 2}\n"
                   "  - {name: b, path: cifar-test, weight: 1}\n")
    out = tmp_path / "out"
    env = env_for(cluster, cifar, out, "--batch-size 6", MIX=str(cluster.shared_path(mix)))
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=1", *CPU, str(SLURM / "train_mix.sbatch")],
                         output=tmp_path / "job.out", env=env, cwd=ROOT)
    expect(job)
    for r in check_stage(out, "stage-mix", 2):
        assert [s["name"] for s in r["streams"]] == ["a", "b"] and all(s["collective"] for s in r["streams"]), r
    summary = json.loads((out / "summary.json").read_text())
    check_summary(summary, 2)
    src = summary["data_source"]
    assert src["staged"] and {s["reading_from"].startswith(str(cluster.local)) for s in src["streams"].values()} == {
        True}, src
    per_rank = [[json.loads(ln) for ln in (out / "keys" / f"keys-rank{r}.jsonl").read_text().splitlines()]
                for r in range(2)]
    assert [rec["step"] for rec in per_rank[0]] == [rec["step"] for rec in per_rank[1]] and per_rank[0]
    small = set(all_keys(cifar["test"]))
    for recs in per_rank:
        assert all(sum(k in small for k in rec["keys"]) == 2 for rec in recs), "a third of every batch of 6 from b"
    assert job.output.count("removed") == 2, job.output  # one clean of the staged mix per node

"""tools/train.py end to end: real 2-rank gloo DDP runs (torch.distributed.run) on a packed CIFAR-like set.

One module-scoped fixture packs 96 train / 25 test 32x32 images (tools.datagen + stager.pack); a
tiny ResNet-18 (width 4) trains deterministically (torch.use_deterministic_algorithms, 1 thread).
Checked: the loss falls; each step the two ranks see disjoint samples and each epoch covers the
train set exactly once; both ranks make the same number of steps; a run interrupted mid-epoch and
resumed from its checkpoint takes the same next batch and reproduces the uninterrupted run's losses;
the 2-rank evaluation (25 samples: one padded repeat) equals a 1-rank evaluation of the same model.
Plus fast in-process checks of the model zoo, the LR recipe, rendezvous, sweeps and checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "tools" / "train.py"
sys.path.insert(0, str(ROOT))

from tools.train import build_parser, resolve_sweep  # noqa: E402
from tools.trainlib import checkpoint as ckpt  # noqa: E402
from tools.trainlib.distributed import rendezvous  # noqa: E402
from tools.trainlib.metrics import topk_correct  # noqa: E402
from tools.trainlib.models import build_model  # noqa: E402
from tools.trainlib.schedule import LRSchedule, scaled_lr  # noqa: E402

COMMON = [
    "--arch", "resnet18", "--width", "4", "--image-size", "32", "--batch-size", "8",
    "--epochs", "2", "--lr", "0.8", "--warmup-epochs", "0.5", "--lr-decay", "cosine",
    "--threads", "1", "--deterministic", "--workers", "0", "--log-every", "1",
]


def run_train(args: list[str], nproc: int = 2, timeout: float = 240, summaries: int = 1) -> dict[str, Any]:
    """Run train.py under torch.distributed.run (gloo on localhost); return rank 0's summary.

    ``nproc=0``: a plain ``python tools/train.py`` without any launcher. ``summaries``: how many
    summary lines to expect (1: DDP prints from rank 0 only; N for N
    independent runs)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, str(TRAIN), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert res.returncode == 0, f"train.py failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    found = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith('{"event": "summary"')]
    assert len(found) == summaries, f"expected {summaries} summary line(s), got {len(found)}:\n{res.stdout}"
    return found[0]


def read_keys(d: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (d / f"keys-rank{rank}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def cifar_packed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from stager.pack import pack
    from tools.datagen import make_cifar

    base = tmp_path_factory.mktemp("train")
    src = make_cifar(base / "cifar", n_train=96, n_test=25, seed=5)
    train = pack(src, base / "train", "tar", samples_per_shard=16, split="train").out
    test = pack(src, base / "test", "tar", samples_per_shard=16, split="test").out
    return {"train": Path(train), "test": Path(test), "base": base}


@pytest.fixture(scope="module")
def full_run(cifar_packed: dict[str, Path]) -> dict[str, Any]:
    """The uninterrupted 2-rank reference run: 2 epochs x 6 steps, keys dumped per rank. It reads
    through ``--follow-src`` with a real `stager stage --follow` beside it (half the data's bytes of
    budget): the same samples in the same order as reading SRC, so one run serves the learning,
    resume and evaluation checks and the follower's (test_follow_src_feeds_a_real_follower...)."""
    src, base = cifar_packed["train"], cifar_packed["base"]
    out, dest = base / "full", base / "full-dest"
    total = sum(s["bytes"] for s in json.loads((src / "manifest.json").read_text())["shards"])
    fol = subprocess.Popen(
        [sys.executable, "-m", "stager", "stage", str(src), str(dest), "--follow", "--budget", str(total // 2),
         "--json", "--poll", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        summary = run_train(["--data", str(dest), "--follow-src", str(src), "--val", str(cifar_packed["test"]),
                             *COMMON, "--out", str(out), "--dump-keys", str(out / "keys"), "--baseline-ips", "100"])
        fol_out, fol_err = fol.communicate(timeout=60)
    finally:
        if fol.poll() is None:
            fol.kill()
    return {"summary": summary, "out": out, "dest": dest, "budget": total // 2,
            "follower": (fol.returncode, fol_out, fol_err)}


def test_two_ranks_learn_on_disjoint_samples(full_run: dict[str, Any], cifar_packed: dict[str, Path]) -> None:
    from stager.manifest import load_manifest

    s = full_run["summary"]
    assert s["world_size"] == 2 and s["completed"] and s["global_step"] == 12
    assert s["config"]["global_batch"] == 16 and s["config"]["steps_per_epoch"] == 6
    # Loss falls: the second epoch's mean training loss is below the first's, and below ln(10).
    e0, e1 = (e["loss"] for e in s["epoch_loss"])
    assert e1 < e0 and e1 < 2.302
    keys0, keys1 = read_keys(full_run["out"] / "keys", 0), read_keys(full_run["out"] / "keys", 1)
    assert [r["step"] for r in keys0] == [r["step"] for r in keys1] == list(range(1, 13))
    all_keys = sorted(k for sh in load_manifest(cifar_packed["train"]).shards for k in sh.keys)
    for epoch in (0, 1):
        seen = {0: [], 1: []}
        for rank, recs in ((0, keys0), (1, keys1)):
            for r in recs:
                if r["epoch"] == epoch:
                    assert len(r["keys"]) == 8
                    seen[rank] += r["keys"]
        assert not set(seen[0]) & set(seen[1]), "ranks shared samples within an epoch"
        assert sorted(seen[0] + seen[1]) == all_keys, "an epoch must cover the train set exactly once"
    # Evaluation ran every epoch over all 25 test samples (one of them a padding repeat on rank 1).
    assert [a["samples"] for a in s["accuracy"]] == [25, 25]
    assert all(0.0 <= a["top1"] <= a["top5"] <= 1.0 for a in s["accuracy"])
    assert 0.0 <= s["data_wait_share"] <= 1.0 and s["images_per_s"] > 0
    assert s["scaling_efficiency"] == pytest.approx(s["images_per_s"] / 200, rel=1e-3)
    assert len(s["loss_history"]) == 12


def test_resume_mid_epoch_reproduces_uninterrupted_run(full_run: dict[str, Any], cifar_packed: dict[str, Path]) -> None:
    out = cifar_packed["base"] / "interrupted"
    args = ["--data", str(cifar_packed["train"]), "--val", str(cifar_packed["test"]), *COMMON,
            "--out", str(out), "--dump-keys", str(out / "keys"), "--checkpoint-every", "2"]
    first = run_train([*args, "--max-steps", "4"])
    assert not first["completed"] and first["global_step"] == 4
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert (state["epoch"], state["step_in_epoch"], state["step"]) == (0, 4, 4)
    assert [ls["batches_done"] for ls in state["loader"]] == [4, 4]
    assert not list(out.glob("*.partial")), "a partial checkpoint file was left behind"

    resumed = run_train([*args, "--resume"])
    assert resumed["completed"] and resumed["global_step"] == 12
    ref = full_run["summary"]
    # Same losses at every step (deterministic CPU run; the first 4 come from the checkpoint's history).
    got = {h["step"]: h["loss"] for h in resumed["loss_history"]}
    want = {h["step"]: h["loss"] for h in ref["loss_history"]}
    assert got.keys() == want.keys()
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), f"step {step}: {got[step]} != {loss}"
    assert resumed["accuracy"] == ref["accuracy"]
    # Same next batch: the keys of every step after the interruption match the reference run's.
    for rank in (0, 1):
        mine = {r["step"]: r["keys"] for r in read_keys(out / "keys", rank)}
        theirs = {r["step"]: r["keys"] for r in read_keys(full_run["out"] / "keys", rank)}
        assert sorted(mine) == list(range(1, 13))
        assert mine == theirs


def test_eval_reduction_matches_single_rank(full_run: dict[str, Any], cifar_packed: dict[str, Path]) -> None:
    """Evaluating the final checkpoint in one process (no launcher) gives the 2-rank run's counts:
    no padded repeat counted twice, none missed."""
    out = cifar_packed["base"] / "eval1"
    one = run_train(["--data", str(cifar_packed["train"]), "--val", str(cifar_packed["test"]), *COMMON,
                     "--out", str(out), "--resume", str(full_run["out"] / "checkpoint.pt"), "--eval-only"], nproc=0)
    two = full_run["summary"]["accuracy"][-1]
    (acc,) = one["accuracy"]
    assert acc["samples"] == two["samples"] == 25
    assert (acc["top1"], acc["top5"]) == (two["top1"], two["top5"])
    assert acc["loss"] == pytest.approx(two["loss"], rel=1e-4)


def test_independent_sweep_and_accumulation_on_synthetic_data(tmp_path: Path) -> None:
    """--independent: each local rank trains alone with its own sweep entry and output directory."""
    out = tmp_path / "sweep"
    run_train(["--data", "synthetic", "--num-classes", "10", "--synthetic-images", "64", "--independent",
               "--arch", "resnet18", "--width", "4", "--image-size", "32", "--batch-size", "4",
               "--accum-steps", "2", "--lr", "0.1,0.2", "--seed", "3,4", "--epochs", "1", "--max-steps", "3",
               "--threads", "1", "--log-every", "1", "--out", str(out), "--summary-json", str(out / "s.json")],
              summaries=2)
    runs = [json.loads((out / f"s.run{i:02d}.json").read_text()) for i in (0, 1)]
    assert [r["independent"]["lr"] for r in runs] == [0.1, 0.2]
    assert [r["config"]["seed"] for r in runs] == [3, 4]
    assert all(r["world_size"] == 1 and r["global_step"] == 3 and r["config"]["global_batch"] == 8 for r in runs)
    assert (out / "run00" / "checkpoint.pt").is_file() and (out / "run01" / "checkpoint.pt").is_file()


# ---------------------------------------------------------------- in-process unit checks


@pytest.mark.parametrize(("arch", "params"), [("resnet18", 11_689_512), ("resnet50", 25_557_032),
                                             ("resnet101", 44_549_160)])
def test_model_sizes_match_the_reference_architectures(arch: str, params: int) -> None:
    # Parameter counts of the reference (torchvision / He et al.) ImageNet models.
    assert sum(p.numel() for p in build_model(arch, 1000).parameters()) == params


def test_cifar_stem_and_zero_init_residual() -> None:
    m = build_model("resnet18", 10, width=8, stem="cifar", zero_init_residual=True)
    assert m.stem[0].kernel_size == (3, 3) and m.stem[0].stride == (1, 1) and len(m.stem) == 3  # no max-pool
    assert all(float(b.last_bn.weight.detach().abs().sum()) == 0 for b in m.modules() if hasattr(b, "last_bn"))
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_lr_schedule_follows_goyal_recipe() -> None:
    peak = scaled_lr(0.1, 8192)
    assert peak == pytest.approx(3.2)
    s = LRSchedule(base_lr=0.1, peak_lr=peak, steps_per_epoch=100, epochs=90, warmup_epochs=5,
                   decay="step", milestones=(30, 60, 80))
    assert s(0) == pytest.approx(0.1) and s(250) == pytest.approx(0.1 + (3.2 - 0.1) / 2)
    assert s(500) == pytest.approx(3.2) and s(2999) == pytest.approx(3.2)
    assert s(3000) == pytest.approx(0.32) and s(6000) == pytest.approx(0.032) and s(8999) == pytest.approx(0.0032)
    c = LRSchedule(base_lr=0.1, peak_lr=0.4, steps_per_epoch=10, epochs=10, warmup_epochs=1, decay="cosine")
    assert c(10) == pytest.approx(0.4) and c(55) == pytest.approx(0.2) and c(100) == pytest.approx(0.0, abs=1e-12)
    assert all(c(i) >= c(i + 1) for i in range(10, 100))


def test_topk_counts() -> None:
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.05, 0.15], [0.2, 0.3, 0.5]])
    hits = topk_correct(logits, torch.tensor([1, 2, 0]), ks=(1, 2, 5))
    assert hits.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_rendezvous_from_slurm_environment() -> None:
    env = {"SLURM_JOB_NODELIST": "gpu[07-09],gpu12", "SLURM_JOB_ID": "123456"}
    assert rendezvous(env) == ("gpu07", 20000 + 123456 % 20000)
    assert rendezvous({**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}) == ("10.0.0.5", 29400)
    assert rendezvous({}) == ("127.0.0.1", 29500)


def test_sweep_lists_need_independent_mode() -> None:
    args = build_parser().parse_args(["--data", "synthetic", "--lr", "0.1,0.2"])
    with pytest.raises(SystemExit, match="needs --independent"):
        resolve_sweep(args, 0, 2)
    args = build_parser().parse_args(["--data", "synthetic", "--independent", "--lr", "0.1,0.2,0.3"])
    with pytest.raises(SystemExit, match="3 values for 2 local ranks"):
        resolve_sweep(args, 0, 2)
    args = build_parser().parse_args(["--data", "synthetic", "--independent", "--lr", "0.1,0.2", "--seed", "7"])
    assert resolve_sweep(args, 1, 2)["lr"] == 0.2 and args.seed == 7


def test_checkpoint_is_atomic_and_refuses_missing_files(tmp_path: Path) -> None:
    path = ckpt.save(tmp_path / "ck" / "checkpoint.pt", {"model": {"w": torch.ones(3)}, "step": 7})
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]
    assert ckpt.load(path)["step"] == 7
    assert ckpt.resolve_resume("auto", tmp_path / "nothing") is None
    assert ckpt.resolve_resume("auto", path.parent) == path
    from stager.errors import StagerError

    with pytest.raises(StagerError, match="no checkpoint there"):
        ckpt.load(tmp_path / "missing.pt")


def test_stop_signal_on_one_rank_stops_all_ranks_at_the_same_step(tmp_path: Path) -> None:
    """SIGUSR1 (what `sbatch --signal=USR1@300` sends) reaching only one of two DDP ranks, with
    gradient accumulation (no_sync micro-steps): both ranks stop after the same step, rank 0 writes
    a consistent mid-epoch checkpoint, and the job exits 0."""
    import signal

    out = tmp_path / "pre"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAIN),
           "--data", "synthetic", "--num-classes", "10", "--synthetic-images", "100000", "--arch", "resnet18",
           "--width", "4", "--image-size", "32", "--batch-size", "4", "--accum-steps", "2", "--epochs", "1",
           "--threads", "1", "--log-every", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "step 3/" in line:
                # torchrun's workers are its children; signal just one of them.
                children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
                os.kill(int(children[-1]), signal.SIGUSR1)
        assert proc.wait(timeout=120) == 0, "".join(lines)
    summary = json.loads(next(ln for ln in lines if ln.startswith('{"event": "summary"')))
    assert summary["preempted"] and not summary["completed"] and summary["world_size"] == 2
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert state["step"] == summary["global_step"] >= 3 and state["step_in_epoch"] == state["step"]
    # Both ranks consumed the same number of micro-batches: 2 per optimizer step.
    assert [ls["position"] for ls in state["loader"]] == [2 * state["step"]] * 2


def test_holdout_view_without_val(cifar_packed: dict[str, Path]) -> None:
    """No --val: held-out keys (by hash) are never trained on and are exactly the evaluated samples."""
    from stager.manifest import load_manifest
    from tools.trainlib.data import holdout_mask

    out = cifar_packed["base"] / "holdout"
    s = run_train(["--data", str(cifar_packed["train"]), *COMMON[:-2], "--log-every", "2", "--epochs", "1",
                   "--holdout", "0.25", "--out", str(out), "--dump-keys", str(out / "keys")], nproc=0)
    keys = [k for sh in load_manifest(cifar_packed["train"]).shards for k in sh.keys]
    held = {k for k, h in zip(keys, holdout_mask(keys, 0.25), strict=True) if h}
    assert 0 < len(held) < len(keys)
    (acc,) = s["accuracy"]
    assert acc["samples"] == len(held)
    # Held-out samples still pass through training batches (same batch count on every rank) but
    # are masked out of the loss: exactly the held-out keys are reported as masked.
    recs = read_keys(out / "keys", 0)
    assert sorted(k for r in recs for k in r["keys"]) == sorted(keys)
    assert {k for r in recs for k in r["masked"]} == held


def test_follow_src_feeds_a_real_follower_beside_two_ranks(full_run: dict[str, Any],
                                                          cifar_packed: dict[str, Path]) -> None:
    """train.py --follow-src with `stager stage --follow` running beside it (the reference run): the
    ranks link DEST to SRC and report every step; the follower fetches within its budget and stops
    by itself once both ranks finished, having seen every batch of both epochs as a hit or a miss."""
    from stager.manifest import load_manifest

    src, dest = cifar_packed["train"], full_run["dest"]
    rc, out, err = full_run["follower"]
    assert rc == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["stopped"] == "finished"
    assert res["peak_local_bytes"] <= full_run["budget"]
    sample_bytes = sum(int(sh.sizes.sum()) for sh in load_manifest(src).shards)
    # 96 samples = 2 ranks x 6 batches x 8: every sample read once per epoch, every read accounted.
    assert res["hit_bytes"] + res["miss_bytes"] == 2 * sample_bytes, res
    assert res["fetched_shards"] > 0
    assert full_run["summary"]["data_source"]["reading_from"].startswith(str(dest))
    for r in (0, 1):
        rep = json.loads((dest / ".stager-progress" / f"rank{r}.json").read_text())
        assert rep["finished"] and not rep.get("failed") and rep["epoch"] == 1


def test_log_and_summary_lines_are_single_writes_on_unbuffered_stdout(tmp_path: Path) -> None:
    """Ranks share one stdout pipe; under PYTHONUNBUFFERED=1 ``print`` writes text and newline
    separately, so another rank's line could land between them (a summary JSON glued to a log
    line was seen on a busy machine). Every line must reach the file descriptor in one write."""
    import io

    from tools.trainlib.console import write_line

    writes: list[bytes] = []

    class Recording(io.FileIO):
        def write(self, b: Any) -> int:
            writes.append(bytes(b))
            return super().write(b)

    raw = Recording(tmp_path / "out", "w")
    stream = io.TextIOWrapper(raw, write_through=True)  # what python -u / PYTHONUNBUFFERED gives
    for line in ('{"event": "summary", "steps": 3}', "[train] step 3/8 loss 2.3"):
        write_line(line, stream)
    stream.close()
    assert writes == [b'{"event": "summary", "steps": 3}\n', b"[train] step 3/8 loss 2.3\n"]
    assert "print(" not in (ROOT / "tools" / "train.py").read_text(), "train.py prints through write_line"


def test_train_on_a_mix(cifar_packed: dict[str, Path], tmp_path: Path) -> None:
    """tools/train.py --mix MIX.yaml over a 2:1 stratified mix of two packs, one process (2 ranks under
    Slurm: tests/cluster/test_cluster_scripts.py): the epoch's length is logged, every batch holds each
    stream's share."""
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"composition: stratified\nstreams:\n  - {{name: a, path: {cifar_packed['train']}, weight: 2}}\n"
                   f"  - {{name: b, path: {cifar_packed['test']}, weight: 1}}\n")
    out = tmp_path / "run"
    s = run_train(["--mix", str(mix), "--eval-every", "0", *COMMON[:-4], "--workers", "0", "--log-every", "1",
                   "--epochs", "1", "--out", str(out), "--dump-keys", str(out / "keys")], nproc=0)
    assert s["completed"] and s["world_size"] == 1 and s["global_step"] == s["config"]["steps_per_epoch"] == 15
    assert set(s["data_source"]["streams"]) == {"a", "b"}
    from stager.manifest import load_manifest

    test_keys = {k for sh in load_manifest(cifar_packed["test"]).shards for k in sh.keys}
    recs = read_keys(out / "keys", 0)
    assert len(recs) == 15
    for r in recs:
        from_b = sum(k in test_keys for k in r["keys"])
        assert len(r["keys"]) == 8 and from_b in (2, 3), "each batch holds a third from stream b (8 / 3)"

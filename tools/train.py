#!/usr/bin/env python3
"""Train a ResNet on a stager dataset (or synthetic tensors) with DDP, resumable mid-epoch.

Launch it any of these ways (docs/training.md has the details)::

    python tools/train.py --data synthetic --max-steps 50                   # one process
    torchrun --nproc-per-node 4 tools/train.py --data /lustre/ds/packed    # one node
    srun --ntasks-per-node 4 python tools/train.py --data ...               # one task per GPU
    srun --ntasks-per-node 4 python tools/train.py --independent --lr 0.05,0.1,0.2,0.4 ...
    horovodrun -np 4 python tools/train.py --dist horovod --data ...       # Horovod (gloo or MPI)

Recipe (Goyal et al. 2017): SGD momentum 0.9, LR = lr * global_batch / 256 with linear warmup,
step or cosine decay, optional nesterov / label smoothing / no decay on BN and bias, bf16 autocast
and channels_last on GPU, gradient accumulation with ``no_sync`` on non-final micro-steps.

Output: human log lines every ``--log-every`` steps (images/s per rank and in total, step time split
into data wait and compute, an ``input-bound`` warning when data wait exceeds 10%), and one final
line ``{"event": "summary", ...}`` (JSON) from rank 0, also written to ``--summary-json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script (python tools/train.py, torchrun tools/train.py): make `tools` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the usual torch spelling

from tools.trainlib import checkpoint as ckpt
from tools.trainlib import distributed as tdist
from tools.trainlib.console import write_line
from tools.trainlib.data import DeviceBatch, Normalizer, StagerSource, SyntheticSource
from tools.trainlib.metrics import INPUT_BOUND_HINT, INPUT_BOUND_SHARE, RunStats, StepTimer, summarize, topk_correct
from tools.trainlib.models import ARCHS, build_model
from tools.trainlib.schedule import LRSchedule, scaled_lr

# Flags that take a comma list in --independent mode: local rank i trains with entry i.
SWEEP_FLAGS: dict[str, type] = {
    "arch": str,
    "lr": float,
    "weight_decay": float,
    "batch_size": int,
    "seed": int,
    "label_smoothing": float,
    "warmup_epochs": float,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train a ResNet on a stager dataset with DDP (torchrun, srun, or one process).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data")
    d.add_argument("--data",
                   help="stager dataset (packed dir or ImageFolder, staged or not) or 'synthetic'")
    d.add_argument("--mix", metavar="MIX",
                   help="instead of --data: a mix of datasets, a YAML/JSON mix file (docs/loader.md, 'Mixing "
                   "datasets'); each stream's staged copy is used where `stager stage MIX DEST` made one")
    d.add_argument("--composition", choices=("random", "stratified", "per_stream"),
                   help="with --mix: how batches mix the streams (default: the mix file's, else random)")
    d.add_argument("--val", help="evaluation dataset; default: a held-out view of --data (see --holdout)")
    d.add_argument("--follow-src", metavar="SRC",
                   help="--data is a node-local DEST that `stager stage SRC DEST --follow` fills beside this job: "
                   "every rank links DEST to SRC (prepare_dest), reads DEST as it is, and reports its position "
                   "to the follower (ProgressReporter)")
    d.add_argument("--holdout", type=float, default=0.1,
                   help="without --val: fraction of --data (by key hash) never trained on and used for evaluation")
    d.add_argument("--image-size", type=int, default=224, help="training/eval crop size in pixels")
    d.add_argument("--workers", type=int, default=4, help="loader worker processes per rank")
    d.add_argument("--num-classes", type=int, default=1000, help="classes of --data synthetic")
    d.add_argument("--synthetic-images", type=int, default=1281167, help="images per epoch of --data synthetic")

    m = p.add_argument_group("model")
    m.add_argument("--arch", default="resnet50", help=f"one of {', '.join(ARCHS)} (comma list with --independent)")
    m.add_argument("--width", type=int, default=64, help="channels of the first stage (64 = the paper's)")
    m.add_argument("--stem", choices=("auto", "imagenet", "cifar"), default="auto",
                   help="auto: cifar (3x3 stride 1, no max-pool) when --image-size <= 40")
    m.add_argument("--zero-init-residual", action="store_true", help="zero the last BN gamma of each residual block")

    o = p.add_argument_group("optimization")
    o.add_argument("--epochs", type=int, default=90)
    o.add_argument("--max-steps", type=int,
                   help="stop after this many optimizer steps in total (simulates an interruption)")
    o.add_argument("--batch-size", default="256", help="images per rank per micro-step")
    o.add_argument("--accum-steps", type=int, default=1, help="micro-steps per optimizer step (gradient accumulation)")
    o.add_argument("--lr", default="0.1", help="base LR for a global batch of 256 (linear scaling rule)")
    o.add_argument("--momentum", type=float, default=0.9)
    o.add_argument("--nesterov", action="store_true")
    o.add_argument("--weight-decay", default="1e-4")
    o.add_argument("--no-bn-decay", action="store_true", help="no weight decay on BN parameters and biases")
    o.add_argument("--warmup-epochs", default="5", help="linear LR warmup length in epochs (may be fractional)")
    o.add_argument("--lr-decay", choices=("step", "cosine", "none"), default="step")
    o.add_argument("--lr-milestones", default="30,60,80",
                   help="epochs where step decay multiplies the LR by --lr-gamma")
    o.add_argument("--lr-gamma", type=float, default=0.1)
    o.add_argument("--label-smoothing", default="0.0")
    o.add_argument("--amp", choices=("auto", "bf16", "off"), default="auto", help="auto: bf16 autocast on GPU only")
    o.add_argument("--channels-last", choices=("auto", "on", "off"), default="auto", help="auto: on GPU only")
    o.add_argument("--seed", default="0")
    o.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True), no cudnn autotuning (bitwise-reproducible resume)")
    o.add_argument("--threads", type=int, help="torch intra-op threads per process")

    r = p.add_argument_group("run")
    r.add_argument("--out", default="runs/train", help="output directory (checkpoints, summary)")
    r.add_argument("--resume", nargs="?", const="auto",
                   help="resume from PATH, or (no value) from OUT/checkpoint.pt when it exists")
    r.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every N optimizer steps (0: epoch ends only)")
    r.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs (0: never)")
    r.add_argument("--eval-batch-size", type=int, help="default: --batch-size")
    r.add_argument("--eval-only", action="store_true", help="evaluate the --resume checkpoint once, no training")
    r.add_argument("--log-every", type=int, default=50, help="log every N optimizer steps")
    r.add_argument("--summary-json", help="also write the final summary to this file")
    r.add_argument("--baseline-ips", type=float, help="images/s of a 1-rank run: report scaling efficiency")
    r.add_argument("--independent", action="store_true",
                   help="each local rank trains its own model (no DDP) on the full data; comma lists of "
                   f"{', '.join('--' + k.replace('_', '-') for k in SWEEP_FLAGS)} give one value per local rank")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    r.add_argument("--dist", choices=("torch", "horovod"), default="torch",
                   help="torch: DDP over a torch.distributed group; horovod: hvd.DistributedOptimizer "
                   "(start with horovodrun, or mpirun/srun --mpi)")
    r.add_argument("--dump-keys", metavar="DIR",
                   help="debug: append each rank's sample keys per step to DIR/keys-rank<R>.jsonl")
    return p


def resolve_sweep(args: argparse.Namespace, index: int, count: int) -> dict[str, Any]:
    """Replace comma-list sweep flags by this process's entry; return the chosen values."""
    chosen = {}
    for name, typ in SWEEP_FLAGS.items():
        values = [v.strip() for v in str(getattr(args, name)).split(",") if v.strip()]
        if len(values) > 1 and not args.independent:
            raise SystemExit(f"train.py: error: --{name.replace('_', '-')} has a comma list; that needs --independent")
        if len(values) not in (1, count) and args.independent:
            raise SystemExit(
                f"train.py: error: --{name.replace('_', '-')} lists {len(values)} values for {count} local ranks; "
                "give one value or one per local rank"
            )
        value = typ(values[index] if len(values) > 1 else values[0])
        setattr(args, name, value)
        chosen[name] = value
    return chosen


def seed_everything(seed: int) -> None:
    # The same seed on every rank: identical model init (DDP broadcasts rank 0's weights anyway).
    # Per-rank randomness (augmentation, synthetic batches) is seeded by the data sources with
    # (seed, rank, epoch, index) tuples, never seed + rank.
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def param_groups(model: nn.Module, weight_decay: float, no_bn_decay: bool) -> list[dict[str, Any]]:
    if not no_bn_decay:
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for mod in model.modules():
        for name, prm in mod.named_parameters(recurse=False):
            bn = isinstance(mod, nn.modules.batchnorm._BatchNorm)
            (no_decay if bn or name == "bias" else decay).append(prm)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def log(info: tdist.DistInfo, msg: str, tag: str = "") -> None:
    if info.is_main:
        write_line(f"[train{tag}] {msg}")


class Trainer:
    def __init__(self, args: argparse.Namespace, info: tdist.DistInfo, tag: str) -> None:
        self.args, self.info, self.tag = args, info, tag
        self.out = Path(args.out)
        dev = info.device
        cuda = dev.type == "cuda"
        self.amp = args.amp == "bf16" or (args.amp == "auto" and cuda)
        self.channels_last = args.channels_last == "on" or (args.channels_last == "auto" and cuda)
        self.sync = torch.cuda.synchronize if cuda else None
        normalizer = Normalizer(dev, self.channels_last)

        self.eval_source: StagerSource | None = None
        holdout = 0.0
        if args.data == "synthetic":
            self.train_source: StagerSource | SyntheticSource = SyntheticSource(
                batch_size=args.batch_size, rank=info.rank, world_size=info.world_size, image_size=args.image_size,
                num_classes=args.num_classes, num_images=args.synthetic_images, seed=args.seed, normalizer=normalizer,
            )
        else:
            holdout = 0.0 if args.val else args.holdout
            if args.follow_src:
                from stager.prefetch import prepare_dest

                # Every rank: idempotent and atomic, and safe beside a follower that started earlier.
                prepare_dest(args.follow_src, args.data)
            common = dict(rank=info.rank, world_size=info.world_size, image_size=args.image_size,
                          num_workers=args.workers, seed=args.seed, normalizer=normalizer, holdout=holdout,
                          pin_memory=cuda, staged=False if args.follow_src else "auto",
                          composition=args.composition)
            self.train_source = StagerSource(args.data, role="train", batch_size=args.batch_size, **common)
            if args.eval_every > 0:
                self.eval_source = StagerSource(
                    args.val or args.data, role="eval", batch_size=args.eval_batch_size or args.batch_size, **common
                )
        self.holdout = holdout
        num_classes = len(self.train_source.classes)
        stem = args.stem if args.stem != "auto" else ("cifar" if args.image_size <= 40 else "imagenet")

        model = build_model(args.arch, num_classes, width=args.width, stem=stem,
                            zero_init_residual=args.zero_init_residual).to(dev)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        self.raw_model = model
        self.model: nn.Module = model
        if info.distributed and info.backend != "horovod":
            self.model = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if cuda else None)
        self.optimizer = torch.optim.SGD(
            param_groups(model, args.weight_decay, args.no_bn_decay),
            lr=args.lr, momentum=args.momentum, nesterov=args.nesterov,
        )
        if info.backend == "horovod":
            import horovod.torch as hvd

            # Gradients averaged over ranks at the last of accum_steps backward passes (as DDP's no_sync).
            self.optimizer = hvd.DistributedOptimizer(self.optimizer, named_parameters=model.named_parameters(),
                                                      backward_passes_per_step=args.accum_steps)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.global_batch = args.batch_size * info.world_size * args.accum_steps
        self.steps_per_epoch = len(self.train_source) // args.accum_steps
        if self.steps_per_epoch < 1:
            raise SystemExit(
                f"train.py: error: {args.data}: fewer than {args.accum_steps} batches of {args.batch_size} per rank "
                f"with {info.world_size} ranks; lower --batch-size or --accum-steps"
            )
        self.schedule = LRSchedule(
            base_lr=args.lr, peak_lr=scaled_lr(args.lr, self.global_batch), steps_per_epoch=self.steps_per_epoch,
            epochs=args.epochs, warmup_epochs=args.warmup_epochs, decay=args.lr_decay,
            milestones=tuple(float(x) for x in args.lr_milestones.split(",") if x.strip()), gamma=args.lr_gamma,
        )
        self.stats = RunStats()
        self.epoch = 0
        self.step_in_epoch = 0
        self.step = 0
        self.pending_loader_state: Any = None
        self.saved_step, self.saved_epoch = -1, -1
        self.preempted = False
        self.keys_file = None
        self.progress: Any = None  # stager.prefetch.ProgressReporter with --follow-src
        if args.dump_keys:
            Path(args.dump_keys).mkdir(parents=True, exist_ok=True)
            self.keys_file = open(Path(args.dump_keys) / f"keys-rank{info.rank}.jsonl", "a")  # noqa: SIM115
        self.config = {
            "arch": args.arch, "width": args.width, "stem": stem, "num_classes": num_classes,
            "image_size": args.image_size, "batch_size": args.batch_size, "accum_steps": args.accum_steps,
            "global_batch": self.global_batch, "world_size": info.world_size, "peak_lr": self.schedule.peak_lr,
            "base_lr": args.lr, "weight_decay": args.weight_decay, "label_smoothing": args.label_smoothing,
            "seed": args.seed, "amp": "bf16" if self.amp else "off", "channels_last": self.channels_last,
            "device": str(dev), "backend": info.backend, "data": args.data, "val": args.val,
            "holdout": holdout, "steps_per_epoch": self.steps_per_epoch, "epochs": args.epochs,
        }

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, *, loader_state: bool) -> None:
        """Collective: every rank contributes its RNG and loader state; rank 0 writes the file."""
        if self.saved_step == self.step and self.saved_epoch == self.epoch:
            return  # already on disk (e.g. --max-steps hit right after an epoch-end checkpoint)
        self.saved_step, self.saved_epoch = self.step, self.epoch
        rngs = tdist.all_gather_objects(ckpt.rng_state(), self.info)
        loaders = tdist.all_gather_objects(self.train_source.state_dict() if loader_state else None, self.info)
        if self.info.is_main:
            path = ckpt.save(self.out / ckpt.LATEST, {
                "model": self.raw_model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": None,  # bf16 autocast needs no loss scaler
                "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "step": self.step,
                "rng": rngs, "loader": loaders, "world_size": self.info.world_size,
                "config": self.config, "stats": self.stats.__dict__,
            })
            log(self.info, f"checkpoint {path} (epoch {self.epoch}, step {self.step_in_epoch}/{self.steps_per_epoch}, "
                f"global step {self.step})", self.tag)
        tdist.barrier(self.info)

    def restore(self, path: Path) -> None:
        state = ckpt.load(path)
        # The model must match; the global batch too when training continues (it sets the LR and
        # the loader's elastic resume keeps batch_size * world_size constant).
        keys = ("arch", "width", "stem", "num_classes") + (() if self.args.eval_only else ("global_batch",))
        for k in keys:
            if state["config"].get(k) != self.config[k]:
                raise SystemExit(
                    f"train.py: error: {path}: checkpoint has {k}={state['config'].get(k)!r}, "
                    f"this run {self.config[k]!r}; "
                    "resume with the same settings or start a new --out"
                )
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch, self.step_in_epoch, self.step = state["epoch"], state["step_in_epoch"], state["step"]
        self.saved_step, self.saved_epoch = self.step, self.epoch
        same_world = state["world_size"] == self.info.world_size
        idx = self.info.rank if same_world else 0
        if same_world:
            ckpt.set_rng_state(state["rng"][idx])
        loader_state = state["loader"][idx]
        if self.step_in_epoch and loader_state is not None:
            self.pending_loader_state = loader_state
        for k, v in state.get("stats", {}).items():
            if k in ("loss_history", "epoch_loss", "accuracy") and not self.args.eval_only:
                setattr(self.stats, k, list(v))
        log(self.info, f"resumed from {path}: epoch {self.epoch}, step {self.step_in_epoch}/{self.steps_per_epoch}, "
            f"global step {self.step}", self.tag)

    # ------------------------------------------------------------------ steps
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.info.device.type, dtype=torch.bfloat16)

    def loss_of(self, batch: DeviceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean loss over the batch's used samples, and their count (both tensors on the device)."""
        with self.autocast():
            logits = self.model(batch.images)
        per_sample = F.cross_entropy(logits.float(), batch.labels, reduction="none",
                                     label_smoothing=self.args.label_smoothing)
        used = batch.use.to(per_sample.dtype)
        n = used.sum()
        return (per_sample * used).sum() / n.clamp(min=1), n

    def train_epoch(self, timer: StepTimer, log_timer: StepTimer) -> bool:
        """Run (the rest of) ``self.epoch``; returns False when --max-steps stopped it early."""
        a, info = self.args, self.info
        self.train_source.set_epoch(self.epoch)
        if self.pending_loader_state is not None:
            # Mid-epoch resume: the loader continues with the batch after the checkpointed one.
            self.train_source.load_state_dict(self.pending_loader_state)
            self.pending_loader_state = None
        self.model.train()
        it = iter(self.train_source)
        loss_sum = torch.zeros((), device=info.device)
        loss_n = 0
        log_loss = torch.zeros(2, device=info.device)
        while self.step_in_epoch < self.steps_per_epoch:
            if a.max_steps is not None and self.step >= a.max_steps:
                return False
            if self.preempt_check():
                return False
            lr = self.schedule(self.step)
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.zero_grad()  # set_to_none: the default since torch 2.0 (horovod's wrapper takes no argument)
            step_keys: list[str] = []
            masked_keys: list[str] = []
            step_loss = torch.zeros((), device=info.device)
            images = 0
            for micro in range(a.accum_steps):
                timer.mark()
                log_timer.mark()
                batch = next(it)
                timer.data_done()
                log_timer.data_done()
                final = micro == a.accum_steps - 1
                # Non-final micro-steps skip DDP's gradient all-reduce; the final one reduces the sum.
                sync_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
                if isinstance(self.model, nn.parallel.DistributedDataParallel) and not final:
                    sync_ctx = self.model.no_sync()
                with sync_ctx:
                    loss, _ = self.loss_of(batch)
                    (loss / a.accum_steps).backward()
                if final:
                    self.optimizer.step()
                step_loss += loss.detach() / a.accum_steps
                images += batch.size
                step_keys += batch.keys
                if self.keys_file is not None:  # debug only: .tolist() synchronizes the device
                    masked_keys += [k for k, u in zip(batch.keys, batch.use.tolist(), strict=True) if not u]
                timer.compute_done(batch.size)
                log_timer.compute_done(batch.size)
            timer.step_done()
            log_timer.step_done()
            self.step += 1
            self.step_in_epoch += 1
            if self.progress is not None:  # tells `stager stage --follow` which batches are consumed
                self.progress.update(self.epoch, self.step_in_epoch * a.accum_steps)
            loss_sum += step_loss
            loss_n += 1
            log_loss += torch.stack([step_loss, torch.ones((), device=info.device)])
            if self.keys_file is not None:
                self.keys_file.write(json.dumps({"epoch": self.epoch, "step": self.step, "loss": float(step_loss),
                                                 "keys": step_keys, "masked": masked_keys}) + "\n")
                self.keys_file.flush()
            if a.log_every and self.step % a.log_every == 0:
                self.log_interval(log_timer, log_loss, lr)
                log_timer.reset()
                log_loss.zero_()
            if a.checkpoint_every and self.step % a.checkpoint_every == 0 and self.step_in_epoch < self.steps_per_epoch:
                self.save_checkpoint(loader_state=True)
                timer.mark()
        mean = tdist.all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(loss_n), device=info.device)]), info)
        if mean[1] > 0:
            self.stats.epoch_loss.append({"epoch": self.epoch, "loss": round(float(mean[0] / mean[1]), 5)})
        return True

    def preempt_check(self) -> bool:
        """True when a stop signal arrived on any rank; the caller then saves a mid-epoch checkpoint
        and exits cleanly so a resubmitted or requeued job continues with ``--resume``.

        All ranks must agree on the step to stop at, so the flag is MAX-all-reduced every step: one
        4-byte collective, negligible next to the per-step gradient all-reduce and the CUDA sync
        the timing already does.
        """
        flag = torch.tensor([1.0 if _STOP else 0.0], device=self.info.device)
        if float(tdist.all_reduce_max(flag, self.info)[0]) > 0:
            self.preempted = True
            log(self.info, f"stop signal received: checkpointing at global step {self.step} and exiting", self.tag)
            return True
        return False

    def log_interval(self, t: StepTimer, log_loss: torch.Tensor, lr: float) -> None:
        """Collective: per-rank images/s and data-wait share, summed/maxed over ranks, printed by rank 0."""
        info = self.info
        ips = t.images / t.total_s if t.total_s > 0 else 0.0
        per_rank = torch.zeros(info.world_size, 2, dtype=torch.float64)
        per_rank[info.rank] = torch.tensor([ips, t.data_share], dtype=torch.float64)
        loss = log_loss.detach().to("cpu", torch.float64)
        packed = tdist.all_reduce_sum(torch.cat([per_rank.flatten(), loss]).to(info.device), info).cpu()
        per_rank = packed[: 2 * info.world_size].view(info.world_size, 2)
        loss_mean = float(packed[-2] / packed[-1].clamp(min=1))
        total_ips = float(per_rank[:, 0].sum())
        worst_wait = float(per_rank[:, 1].max())
        step_s = t.total_s / max(t.steps, 1)
        self.stats.loss_history.append({"step": self.step, "epoch": self.epoch, "loss": round(loss_mean, 6), "lr": lr})
        ranks = ", ".join(f"{v:.0f}" for v in per_rank[:, 0].tolist())
        log(info, f"epoch {self.epoch} step {self.step_in_epoch}/{self.steps_per_epoch} (global {self.step}) "
            f"loss {loss_mean:.4f} lr {lr:.4g} | {total_ips:.1f} img/s total [{ranks}] per rank | "
            f"step {step_s * 1e3:.0f} ms = data {t.data_s / max(t.steps, 1) * 1e3:.0f} ms ({t.data_share:.0%}) "
            f"+ compute {t.compute_s / max(t.steps, 1) * 1e3:.0f} ms", self.tag)
        if worst_wait > INPUT_BOUND_SHARE:
            self.stats.warnings += 1
            log(info, f"WARNING data wait {worst_wait:.0%} of step time on the slowest rank (> "
                f"{INPUT_BOUND_SHARE:.0%}): {INPUT_BOUND_HINT}", self.tag)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any] | None:
        """Top-1/top-5 over the eval data, every sample counted exactly once across ranks.

        The loader gives every rank the same number of batches by repeating samples on the last
        rank (padding). Each rank writes its per-sample results into dense vectors indexed by the
        sample's global dataset index (``batch["index"]``); an element-wise MAX all-reduce merges
        them, so a padded repeat lands on the same slot as its original instead of being counted
        twice. The counts are then sums over those vectors (identical on every rank). Cost: 3
        int32 vectors of length N per evaluation (0.6 MB for ImageNet val).
        """
        src = self.eval_source
        if src is None:
            return None
        self.model.eval()
        src.set_epoch(0)
        dev = self.info.device
        n = src.num_samples
        hits = torch.zeros(3, n, dtype=torch.int32, device=dev)  # rows: counted, top-1, top-5
        losses = torch.zeros(n, dtype=torch.float32, device=dev)
        for batch in src:
            with self.autocast():
                logits = self.model(batch.images).float()
            assert batch.index is not None
            idx = batch.index[batch.use]
            top = topk_correct(logits, batch.labels)[:, batch.use]
            hits[0, idx] = 1
            hits[1, idx] = top[0].to(torch.int32)
            hits[2, idx] = top[1].to(torch.int32)
            losses[idx] = F.cross_entropy(logits, batch.labels, reduction="none")[batch.use]
        tdist.all_reduce_max(hits, self.info)
        tdist.all_reduce_max(losses, self.info)  # cross-entropy >= 0, so MAX with the zero default is exact
        counted, top1, top5 = (int(v) for v in hits.sum(dim=1, dtype=torch.int64).tolist())
        res = {
            "epoch": self.epoch, "top1": round(top1 / max(counted, 1), 5), "top5": round(top5 / max(counted, 1), 5),
            "loss": round(float(losses.sum()) / max(counted, 1), 5), "samples": counted,
        }
        self.stats.accuracy.append(res)
        log(self.info, f"eval epoch {self.epoch}: top-1 {res['top1']:.2%} top-5 {res['top5']:.2%} "
            f"loss {res['loss']:.4f} over {counted} samples", self.tag)
        return res

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        a, info = self.args, self.info
        resume_path = ckpt.resolve_resume(a.resume, self.out)
        if resume_path is not None:
            self.restore(resume_path)
        log(info, json.dumps({"event": "config", **self.config}), self.tag)
        if isinstance(self.train_source, StagerSource):
            ls = self.train_source.loader_stats()
            log(info, f"reading {a.data} from {ls['reading_from']} (staged: {ls['staged']})", self.tag)
            if self.train_source.mix_summary:
                log(info, self.train_source.mix_summary, self.tag)
        timer = StepTimer(self.sync)
        log_timer = StepTimer(self.sync)
        wall0 = time.perf_counter()
        finished = True
        if a.follow_src and isinstance(self.train_source, StagerSource) and not a.eval_only:
            from stager.prefetch import ProgressReporter

            self.progress = ProgressReporter(a.data, self.train_source.loader, rank=info.rank)
            self.progress.update(self.epoch, self.step_in_epoch * a.accum_steps)  # a resumed position
        try:
            if a.eval_only:
                self.evaluate()
            while self.epoch < a.epochs and not a.eval_only:
                finished = self.train_epoch(timer, log_timer)
                if not finished:
                    break
                if self.progress is not None:  # the whole epoch is consumed (an accumulation remainder too)
                    self.progress.update(self.epoch, len(self.train_source))
                self.step_in_epoch = 0
                if a.eval_every and (self.epoch + 1) % a.eval_every == 0:
                    self.evaluate()
                self.epoch += 1
                self.save_checkpoint(loader_state=False)
            if not finished:
                self.save_checkpoint(loader_state=True)
        except BaseException:
            if self.progress is not None:
                self.progress.finish(failed=True)
            raise
        if self.progress is not None:
            self.progress.finish()  # the follower stops once every rank of the node has finished
        wall = time.perf_counter() - wall0
        self.stats.add(timer)
        ips = self.stats.images / max(timer.total_s, 1e-9)
        share = timer.data_share
        agg = torch.tensor([ips, share, share], dtype=torch.float64)
        tot = tdist.all_reduce_sum(agg.to(info.device), info).cpu()
        summary = summarize(
            self.stats, world_size=info.world_size, global_ips=float(tot[0]),
            data_share=float(tot[1]) / info.world_size,
            baseline_ips=a.baseline_ips,
            extra={"completed": finished, "preempted": self.preempted, "epoch": self.epoch, "global_step": self.step,
                   "wall_s": round(wall, 2),
                   "step_time_s": round(timer.total_s / max(timer.steps, 1), 5),
                   "input_bound_warnings": self.stats.warnings, "launcher": info.launcher, "config": self.config},
        )
        if isinstance(self.train_source, StagerSource):
            ls = self.train_source.loader_stats()
            summary["data_source"] = {k: ls[k] for k in ("source", "reading_from", "staged", "staged_mode", "streams")
                                      if k in ls}
            summary["loader"] = {k: ls[k] for k in ("samples_per_s", "io_seconds", "decode_seconds", "wait_seconds")}
        if self.keys_file is not None:
            self.keys_file.close()
        return summary


_STOP: dict[str, int] = {}  # {"signal": signum} once a stop signal arrived


def _on_stop_signal(signum: int, _frame: Any) -> None:
    _STOP["signal"] = signum


def install_stop_handlers() -> None:
    """SIGUSR1 (``sbatch --signal=USR1@300``: minutes before the time limit) and SIGTERM (scancel,
    preemption; torchrun forwards it to its workers) ask for a checkpoint and a clean exit."""
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _on_stop_signal)


def train(args: argparse.Namespace, info: tdist.DistInfo) -> dict[str, Any]:
    """Run one training (this process's share of it) and return the summary dict."""
    tag = ""
    chosen = resolve_sweep(args, info.local_rank if args.independent else 0, info.local_world_size)
    if args.independent:
        tag = f":run{info.local_rank:02d}"
        args.out = str(Path(args.out) / f"run{info.local_rank:02d}")
        if args.summary_json:
            base, ext = os.path.splitext(args.summary_json)
            args.summary_json = f"{base}.run{info.local_rank:02d}{ext or '.json'}"
        if args.dump_keys:
            args.dump_keys = str(Path(args.dump_keys) / f"run{info.local_rank:02d}")
    seed_everything(args.seed)
    summary = Trainer(args, info, tag).run()
    if args.independent:
        summary["independent"] = {"local_rank": info.local_rank, **chosen}
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if (args.data is None) == (args.mix is None):
        raise SystemExit("train.py: error: give one of --data DATASET or --mix MIX.yaml")
    if args.composition and not args.mix:
        raise SystemExit("train.py: error: --composition applies to --mix")
    if args.mix:
        if args.follow_src:
            raise SystemExit("train.py: error: --follow-src prefetches one dataset; stage a mix with "
                             "`stager stage MIX.yaml DEST`")
        args.data = args.mix
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True
    if args.dist == "horovod":
        if args.independent:
            raise SystemExit("train.py: error: --independent trains without a group; drop --dist horovod")
        info = tdist.setup_horovod(device=args.device)
    else:
        info = tdist.setup(independent=args.independent, device=args.device)
    install_stop_handlers()
    try:
        summary = train(args, info)
        if info.is_main:
            write_line(json.dumps(summary))
            if args.summary_json:
                from stager.fs.atomic import atomic_write_bytes

                Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(args.summary_json, (json.dumps(summary, indent=1) + "\n").encode())
        tdist.barrier(info)
        return 0
    finally:
        # The trainer (and DDP's reducer holding the process group) is gone once train() returned;
        # collect it before tearing the group down, not during interpreter shutdown.
        gc.collect()
        tdist.cleanup(info)


if __name__ == "__main__":
    raise SystemExit(main())

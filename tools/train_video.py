#!/usr/bin/env python3
"""Video frame prediction with a GAN on a stager clip pack: the PRACE guide's first use case, small.

A small conv generator takes 6 past frames (stacked on channels) and predicts the 6 next ones; a
small conv discriminator judges (past, future) pairs. Loss: generator = non-saturating GAN loss +
``--l1`` x L1 to the true future; discriminator = the usual real/fake logistic loss. Frames come
from ``stager.loader.make_loader`` on a clip pack (``stager pack SRC OUT --clip-length 12``), one
random crop and flip per clip (``transform="train"``), as (B, 12, 3, H, W) uint8.

Launch (docs/training.md, "Video clips")::

    python -m tools.datagen video /tmp/v --sequences 16 --frames 60 --size 128
    stager pack /tmp/v/frames /tmp/v/packed --format tar --clip-length 12
    python tools/train_video.py --data /tmp/v/packed --max-steps 100         # one process
    torchrun --nproc-per-node 2 tools/train_video.py --data /tmp/v/packed    # DDP, one node
    srun --ntasks-per-node 2 python tools/train_video.py --data ...          # Slurm (tools/slurm/train_video.sbatch)

Output: a log line every ``--log-every`` steps and one final JSON line ``{"event": "summary", ...}``
from rank 0 with the first and last L1 (averaged over ``--log-every`` steps) and clips/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the usual name)
from torch import nn

from stager.loader import make_loader

PAST, FUTURE = 6, 6


def block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1), nn.GroupNorm(8, cout), nn.LeakyReLU(0.2))


class Generator(nn.Module):
    """(B, PAST*3, H, W) in [-1, 1] -> (B, FUTURE*3, H, W): an encoder-decoder with a skip, plus the
    last past frame repeated (so it learns the motion, not the background)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.e1 = block(PAST * 3, width)
        self.e2 = block(width, width * 2, 2)
        self.e3 = block(width * 2, width * 2, 2)
        self.d2 = block(width * 4, width)
        self.d1 = block(width * 2, width)
        self.out = nn.Conv2d(width, FUTURE * 3, 3, 1, 1)

    def forward(self, past: torch.Tensor) -> torch.Tensor:
        a = self.e1(past)
        b = self.e2(a)
        c = self.e3(b)
        u = F.interpolate(c, size=b.shape[-2:], mode="nearest")
        u = self.d2(torch.cat([u, b], 1))
        u = F.interpolate(u, size=a.shape[-2:], mode="nearest")
        u = self.d1(torch.cat([u, a], 1))
        last = past[:, -3:].repeat(1, FUTURE, 1, 1)
        return torch.tanh(self.out(u) + last)


class Discriminator(nn.Module):
    """(B, (PAST + FUTURE)*3, H, W) -> (B,) logits: is this future real, given the past?"""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            block((PAST + FUTURE) * 3, width, 2), block(width, width * 2, 2), block(width * 2, width * 2, 2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width * 2, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def setup() -> tuple[int, int]:
    """(rank, world size); with more than one process, the gloo/nccl process group from the launcher's
    variables (torchrun's RANK/WORLD_SIZE, or Slurm's SLURM_PROCID/SLURM_NTASKS with MASTER_ADDR/PORT)."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if world > 1:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return rank, world


def to_unit(x: torch.Tensor) -> torch.Tensor:
    return x.float().div_(127.5).sub_(1.0)


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_slurm_scripts.py checks the job scripts' flags against it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a clip pack with clip length >= 12")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="clips per rank")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--l1", type=float, default=100.0, help="weight of the L1 term in the generator loss")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary-json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = setup()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, world)))
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    gen, disc = Generator(args.width).to(dev), Discriminator(args.width).to(dev)
    if world > 1:
        gen = nn.parallel.DistributedDataParallel(gen)
        disc = nn.parallel.DistributedDataParallel(disc)
    opt_g = torch.optim.Adam(gen.parameters(), args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), args.lr, betas=(0.5, 0.999))
    loader = make_loader(args.data, args.batch_size, rank=rank, world_size=world, num_workers=args.workers,
                         transform="train", image_size=args.image_size, seed=args.seed, drop_last=True)
    step, l1s, t0, clips = 0, [], time.perf_counter(), 0
    while step < args.max_steps:
        for batch in loader:
            x = to_unit(batch["image"].to(dev))  # (B, T, 3, H, W)
            if x.shape[1] < PAST + FUTURE:
                raise SystemExit(f"{args.data}: clips of {x.shape[1]} frames; pack with --clip-length 12")
            b = x.shape[0]
            past = x[:, :PAST].reshape(b, -1, *x.shape[-2:])
            future = x[:, PAST : PAST + FUTURE].reshape(b, -1, *x.shape[-2:])
            fake = gen(past)
            d_real = disc(torch.cat([past, future], 1))
            d_fake = disc(torch.cat([past, fake.detach()], 1))
            loss_d = F.softplus(-d_real).mean() + F.softplus(d_fake).mean()
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()
            l1 = (fake - future).abs().mean()
            loss_g = F.softplus(-disc(torch.cat([past, fake], 1))).mean() + args.l1 * l1
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            l1s.append(float(l1))
            clips += b
            step += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"step {step} l1 {sum(l1s[-args.log_every:]) / args.log_every:.4f} "
                      f"loss_d {float(loss_d):.3f} loss_g {float(loss_g):.3f}", flush=True)
            if step >= args.max_steps:
                break
    k = min(args.log_every, max(1, len(l1s) // 2))
    summary = {"event": "summary", "steps": step, "world_size": world, "l1_first": sum(l1s[:k]) / k,
               "l1_last": sum(l1s[-k:]) / k, "clips_per_s": clips * world / (time.perf_counter() - t0)}
    if rank == 0:
        print(json.dumps(summary), flush=True)
        if args.summary_json:
            Path(args.summary_json).write_text(json.dumps(summary))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

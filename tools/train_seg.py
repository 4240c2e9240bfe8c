"""Semantic segmentation with DDP on a packed set with masks: a small U-Net over stager's fields loader.

Run under torchrun or srun (one process per GPU or CPU slot; gloo on CPU)::

    python -m tools.datagen shapes data/shapes --train 400 --val 100 --size 96
    stager pack data/shapes/train.jsonl data/seg-train --format tar --fields mask:mask,boxes:boxes,box_labels:box_labels
    stager pack data/shapes/val.jsonl data/seg-val --format tar --fields mask:mask,boxes:boxes,box_labels:box_labels
    torchrun --nproc-per-node 2 tools/train_seg.py --train data/seg-train --val data/seg-val --epochs 8

Each rank reads its share with ``make_loader(..., fields=["mask"], transform="train")``: one random
crop and flip for the image and its mask. After every epoch the ranks sum one confusion matrix over
the validation set (``transform="eval"``, each sample exactly once across ranks) and rank 0 prints
``{"event": "epoch", "epoch", "loss", "miou", "chance_miou", "per_class_iou"}``; ``chance_miou`` is the
mIoU of predicting the most frequent class everywhere. The last line is ``{"event": "summary", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 (the usual torch alias)
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stager.loader import make_loader  # noqa: E402
from tools.trainlib.distributed import all_reduce_sum, cleanup, setup  # noqa: E402


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    """A ``levels``-level U-Net: (B, 3, H, W) float -> (B, classes, H, W) logits (H, W divisible by 2**(levels-1))."""

    def __init__(self, classes: int, width: int = 16, levels: int = 3) -> None:
        super().__init__()
        chans = [width * 2**i for i in range(levels)]
        self.down = nn.ModuleList([_block(3 if i == 0 else chans[i - 1], c) for i, c in enumerate(chans)])
        self.up = nn.ModuleList(
            [nn.ConvTranspose2d(chans[i], chans[i - 1], 2, stride=2) for i in range(levels - 1, 0, -1)])
        self.dec = nn.ModuleList([_block(chans[i - 1] * 2, chans[i - 1]) for i in range(levels - 1, 0, -1)])
        self.head = nn.Conv2d(chans[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips[:-1]), strict=True):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)


MEAN = torch.tensor([0.45, 0.45, 0.45]).view(1, 3, 1, 1)
STD = torch.tensor([0.25, 0.25, 0.25]).view(1, 3, 1, 1)


def to_input(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    return ((image.to(device).float() / 255.0) - MEAN.to(device)) / STD.to(device)


def confusion(pred: torch.Tensor, target: torch.Tensor, classes: int) -> torch.Tensor:
    """(classes, classes) int64 counts: rows true class, columns predicted."""
    idx = target.reshape(-1).long() * classes + pred.reshape(-1).long()
    return torch.bincount(idx, minlength=classes * classes).reshape(classes, classes)


def iou_per_class(cm: torch.Tensor) -> torch.Tensor:
    tp = cm.diag().double()
    denom = cm.sum(0).double() + cm.sum(1).double() - tp
    return torch.where(denom > 0, tp / denom.clamp(min=1), torch.nan)


def evaluate(model: nn.Module, loader: object, classes: int, info: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The confusion matrix over the validation set (summed over ranks) and its class pixel counts."""
    model.eval()
    cm = torch.zeros(classes, classes, dtype=torch.int64)
    with torch.no_grad():
        for b in loader:  # type: ignore[attr-defined]
            logits = model(to_input(b["image"], torch.device("cpu")))
            cm += confusion(logits.argmax(1), b["mask"], classes)
    all_reduce_sum(cm, info)  # type: ignore[arg-type]
    return cm, cm.sum(1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True, help="packed training set with a mask field")
    p.add_argument("--val", required=True, help="packed validation set with a mask field")
    p.add_argument("--mask-field", default="mask")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: leave)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = setup(device="cpu" if not torch.cuda.is_available() else "auto")
    torch.manual_seed(args.seed)
    dev = info.device
    model: nn.Module = UNet(args.classes, args.width, args.levels).to(dev)
    if info.distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    common = {"rank": info.rank, "world_size": info.world_size, "num_workers": args.workers,
              "image_size": args.image_size, "fields": [args.mask_field], "seed": args.seed}
    train = make_loader(args.train, args.batch_size, transform="train", drop_last=True, **common)
    val = make_loader(args.val, args.batch_size, transform="eval", shuffle=False, **common)
    steps = max(1, args.epochs * len(train))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=steps, pct_start=0.15)
    t0 = time.perf_counter()
    result: dict[str, object] = {}
    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        model.train()
        total, n = 0.0, 0
        for b in train:
            logits = model(to_input(b["image"], dev))
            loss = F.cross_entropy(logits, b[args.mask_field].to(dev).long())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
            n += 1
        cm, counts = evaluate(model, _renamed(val, args.mask_field), args.classes, info)
        ious = iou_per_class(cm)
        chance = iou_per_class(confusion(torch.full((1,), int(counts.argmax())).expand(int(counts.sum())),
                                         torch.repeat_interleave(torch.arange(args.classes), counts), args.classes))
        result = {"event": "epoch", "epoch": epoch, "loss": round(total / max(n, 1), 4),
                  "miou": round(float(torch.nanmean(ious)), 4), "chance_miou": round(float(torch.nanmean(chance)), 4),
                  "per_class_iou": [round(float(x), 4) for x in ious], "seconds": round(time.perf_counter() - t0, 1)}
        if info.is_main:
            print(json.dumps(result), flush=True)
    if info.is_main:
        print(json.dumps({**result, "event": "summary", "world_size": info.world_size}), flush=True)
    cleanup(info)
    return 0


def _renamed(loader: object, field: str) -> object:
    """Batches with the mask field under ``mask`` (what :func:`evaluate` reads)."""
    for b in loader:  # type: ignore[attr-defined]
        yield {**b, "mask": b[field]}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())

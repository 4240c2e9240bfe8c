"""Lightning Fabric over a stager loader, as Fabric's users write it (tests/test_frameworks_lightning.py).

``python fabric_run.py DATA OUT``: ``Fabric(strategy="ddp", devices=2).launch()`` re-runs this script
for local rank 1. Phase ``full``: ``fabric.setup_dataloaders(make_loader(...))``, 3 epochs, a
``fabric.save`` of model, optimizer and loader at step ``MID`` (mid-epoch). Phase ``resumed``: a new
loader, ``fabric.load`` of that checkpoint, training on to the end. Each rank writes
``OUT/fabric-rank<r>.json``: per phase and epoch the ``index`` lists its loop saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from stager.loader import make_loader

DATA, OUT = sys.argv[1], Path(sys.argv[2])
BATCH, EPOCHS, MID = 8, 3, 19


def run(fabric: Fabric, ckpt: Path, resume: bool) -> dict[str, list[list[int]]]:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(make_loader(DATA, BATCH, num_workers=1, image_size=8, transform="eval",
                                                  staged=False, seed=4))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if resume:
        fabric.load(ckpt, state)
    seen: dict[str, list[list[int]]] = {}
    step = state["step"]
    for epoch in range(loader.epoch, EPOCHS):
        for batch in loader:
            seen.setdefault(str(epoch), []).append(batch["index"].tolist())
            loss = model(torch.zeros(1, 1)).sum() * 0.0
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step == MID and not resume:
                state["step"] = step
                fabric.save(ckpt, state)
    return seen


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    ckpt = OUT / "fabric.ckpt"
    out = {"full": run(fabric, ckpt, resume=False)}
    fabric.barrier()
    out["resumed"] = run(fabric, ckpt, resume=True)
    (OUT / f"fabric-rank{fabric.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()

"""Hugging Face Accelerate over stager loaders, as its tutorials write it (tests/test_frameworks_accelerate.py).

``accelerate launch --multi_gpu --num_processes 2 accelerate_run.py DATA OUT`` (torchrun underneath).
Phases, each rank writing ``OUT/<phase>-rank<r>.json``:

* ``train``: ``prepare(model, optimizer, make_loader(...))``, ``gradient_accumulation_steps=3`` with
  ``accumulate()``, 3 epochs; ``save_state`` at the end of epoch 0 and at step ``MID`` (mid-epoch 1);
  records per epoch the ``index`` lists and whether each batch synced gradients;
* ``resume_mid``: a fresh process state (new loader, model, optimizer), ``load_state`` of the mid-epoch
  checkpoint, then the tutorial's loop: ``skip_first_batches(loader, resume_step)`` for the first epoch;
* ``resume_end``: the same from the end-of-epoch-0 checkpoint (no skip);
* ``eval``: ``gather_for_metrics`` of ``index`` over a ``shuffle=False`` loader (padding declared: 1 repeat;
  its persistent worker started before ``prepare``), and of Accelerate's own DataLoader over the sample ids;
* ``sharded``: ``prepare(DataLoader(ShardedDataset(...), batch_size=None, num_workers=1))``, 2 epochs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from stager.loader import ShardedDataset, make_loader

DATA, OUT = sys.argv[1], Path(sys.argv[2])
BATCH, EPOCHS, MID = 8, 3, 19  # 13 batches per epoch and rank: MID is batch 6 of epoch 1
KW: dict[str, Any] = {"image_size": 8, "transform": "eval", "staged": False, "seed": 5}


def setup(accelerator: Accelerator, **kw: Any) -> tuple[Any, Any, Any, Any]:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = make_loader(DATA, BATCH, num_workers=1, **KW, **kw)
    prepared = accelerator.prepare(model, optimizer, loader)
    return (*prepared, loader)


def step(accelerator: Accelerator, model: Any, optimizer: Any) -> None:
    loss = model(torch.zeros(1, 1)).sum() * 0.0
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def train(accelerator: Accelerator, ckpt: Path) -> dict[str, Any]:
    model, optimizer, loader, original = setup(accelerator)
    seen: dict[str, list[list[int]]] = {}
    synced: dict[str, list[bool]] = {}
    n = 0
    for epoch in range(EPOCHS):
        for batch in loader:
            with accelerator.accumulate(model):
                seen.setdefault(str(epoch), []).append(batch["index"].tolist())
                synced.setdefault(str(epoch), []).append(accelerator.sync_gradients)
                step(accelerator, model, optimizer)
            n += 1
            if n == MID:
                accelerator.save_state(str(ckpt / "mid"))
        if epoch == 0:
            accelerator.save_state(str(ckpt / "end"))
    return {"seen": seen, "synced": synced, "adopted": loader is original, "len": len(loader)}


def resume(accelerator: Accelerator, path: Path, overall_step: int) -> dict[str, Any]:
    model, optimizer, loader, _ = setup(accelerator)
    accelerator.load_state(str(path))
    # The tutorial's arithmetic (accelerate's examples/complete_cv_example.py).
    starting_epoch, resume_step = divmod(overall_step, len(loader))
    seen: dict[str, list[list[int]]] = {}
    for epoch in range(starting_epoch, EPOCHS):
        # An epoch's checkpoint needs no skip (the tutorial's resume_step is None there).
        skip = resume_step and epoch == starting_epoch
        active = accelerator.skip_first_batches(loader, resume_step) if skip else loader
        for batch in active:
            seen.setdefault(str(epoch), []).append(batch["index"].tolist())
            step(accelerator, model, optimizer)
    return {"seen": seen}


def evaluate(accelerator: Accelerator) -> dict[str, Any]:
    loader = make_loader(DATA, BATCH, shuffle=False, num_workers=1, **KW)
    for _ in loader:  # a pass before prepare(): its persistent worker holds the plan prepare() changes
        pass
    loader = accelerator.prepare(loader)
    gathered: list[int] = []
    for batch in loader:
        gathered += accelerator.gather_for_metrics(batch["index"]).tolist()
    # Accelerate's own DataLoader over the same sample ids, the same batch size per process.
    theirs = accelerator.prepare(DataLoader(list(range(loader.dataset.samples_in_epoch())), batch_size=BATCH))
    reference: list[int] = []
    for batch in theirs:
        reference += accelerator.gather_for_metrics(batch).tolist()
    return {"gathered": gathered, "accelerate": reference}


def sharded(accelerator: Accelerator) -> dict[str, Any]:
    ds = ShardedDataset(DATA, BATCH, num_workers=None, **KW)
    loader = accelerator.prepare(DataLoader(ds, batch_size=None, num_workers=1))
    seen = {str(e): [b["index"].tolist() for b in loader] for e in range(2)}
    return {"seen": seen, "type": type(loader).__name__}


def main() -> None:
    accelerator = Accelerator(gradient_accumulation_steps=3)
    ckpt = OUT / "ckpt"
    out = {"train": train(accelerator, ckpt)}
    accelerator.wait_for_everyone()
    out["resume_mid"] = resume(Accelerator(gradient_accumulation_steps=3), ckpt / "mid", MID)
    out["resume_end"] = resume(Accelerator(gradient_accumulation_steps=3), ckpt / "end", 13)
    out["eval"] = evaluate(accelerator)
    out["sharded"] = sharded(accelerator)
    (OUT / f"accelerate-rank{accelerator.process_index}.json").write_text(json.dumps(out))
    accelerator.end_training()  # destroys the process group (gloo's threads are not left to the exit)


if __name__ == "__main__":
    main()

"""The Hugging Face ``Trainer`` given a stager dataset, as its users write it (tests/test_frameworks_trainer.py).

``torchrun --nproc-per-node 2 trainer_run.py DATA OUT``: ``Trainer(model, args, train_dataset=SampleDataset(DATA))``
for 3 epochs on CPU, a checkpoint every ``MID`` steps; then a second Trainer resumes from the
checkpoint at step ``MID`` (mid-epoch 1) to the end. Each rank writes ``OUT/trainer-rank<r>.json``: the
``index`` lists its model's ``forward`` received, per run. With a third argument ``loader``, the same with a
Trainer whose ``get_train_dataloader()`` returns ``make_loader(...)`` (the loader batches; the Trainer's
resume skips the consumed batches with accelerate's ``skip_first_batches``), into
``OUT/loader-trainer-rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from stager.loader import SampleDataset, make_loader

DATA, OUT = sys.argv[1], Path(sys.argv[2])
BATCH, EPOCHS, MID = 8, 3, 19


class Tiny(torch.nn.Module):
    """A model whose ``forward`` takes the sample's fields by name, as the Trainer passes them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def forward(self, image: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> dict[str, Any]:
        self.seen.append(index.tolist())
        return {"loss": self.w.sum() * 0.0 + image.float().mean() * 0.0 + labels.float().mean() * 0.0}


class LoaderTrainer(Trainer):
    """A Trainer whose training batches come from a stager Loader (what users write to keep stager's reads)."""

    def get_train_dataloader(self) -> Any:
        loader = make_loader(DATA, BATCH, num_workers=1, image_size=8, transform="train", staged=False, seed=7)
        loader.collate_fn = lambda b: {"image": b["image"], "labels": b["label"], "index": b["index"]}
        return loader


def run(resume: str | None, *, loader: bool = False) -> tuple[list[list[int]], int]:
    out = OUT / ("loader-trainer" if loader else "trainer")
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH,
                             num_train_epochs=EPOCHS, save_strategy="steps", save_steps=MID, report_to="none",
                             use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=7,
                             dataloader_num_workers=1)
    model = Tiny()
    if loader:
        trainer: Trainer = LoaderTrainer(model=model, args=args)
    else:
        trainer = Trainer(model=model, args=args,
                          train_dataset=SampleDataset(DATA, image_size=8, transform="train", staged=False))
    trainer.train(resume_from_checkpoint=None if resume is None else str(out / resume))
    return model.seen, trainer.args.process_index


def main() -> None:
    loader = sys.argv[3:] == ["loader"]
    full, rank = run(None, loader=loader)
    resumed, _ = run(f"checkpoint-{MID}", loader=loader)
    name = "loader-trainer" if loader else "trainer"
    (OUT / f"{name}-rank{rank}.json").write_text(json.dumps({"full": full, "resumed": resumed}))
    # The Trainer leaves its gloo group to the interpreter's exit, where gloo's worker threads can be torn
    # down joinable ("terminate called without an active exception", SIGABRT: seen once on CI); torch's
    # documented shutdown is an explicit destroy_process_group() at the end of main.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

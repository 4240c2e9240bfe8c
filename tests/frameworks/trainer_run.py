"""The Hugging Face ``Trainer`` given a stager dataset, as its users write it (tests/test_frameworks_trainer.py).

``torchrun --nproc-per-node 2 trainer_run.py DATA OUT``: ``Trainer(model, args, train_dataset=SampleDataset(DATA))``
for 3 epochs on CPU, a checkpoint every ``MID`` steps; then a second Trainer resumes from the
checkpoint at step ``MID`` (mid-epoch 1) to the end. Each rank writes ``OUT/trainer-rank<r>.json``:
the ``index`` lists its model's ``forward`` received, per run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from stager.loader import SampleDataset

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


def run(resume: str | None) -> tuple[list[list[int]], int]:
    args = TrainingArguments(output_dir=str(OUT / "trainer"), per_device_train_batch_size=BATCH,
                             num_train_epochs=EPOCHS, save_strategy="steps", save_steps=MID, report_to="none",
                             use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=7,
                             dataloader_num_workers=1)
    model = Tiny()
    trainer = Trainer(model=model, args=args,
                      train_dataset=SampleDataset(DATA, image_size=8, transform="train", staged=False))
    trainer.train(resume_from_checkpoint=resume)
    return model.seen, trainer.args.process_index


def main() -> None:
    full, rank = run(None)
    resumed, _ = run(str(OUT / "trainer" / f"checkpoint-{MID}"))
    (OUT / f"trainer-rank{rank}.json").write_text(json.dumps({"full": full, "resumed": resumed}))


if __name__ == "__main__":
    main()

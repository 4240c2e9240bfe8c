"""Lightning's ``Trainer`` over stager loaders, as its users write it (tests/test_frameworks_lightning.py).

``python lightning_run.py MODE DATA OUT``. Every phase is one ``trainer.fit`` of 2 CPU ranks (gloo); each
rank writes ``OUT/<phase>-rank<r>.json``: per epoch the ``index`` lists of the batches its
``training_step`` saw, the warnings raised, and how the module-level loader resolved its world.

* ``ddp``: ``strategy="ddp"``: Lightning's own launcher re-runs this script for local rank 1 (it exports
  WORLD_SIZE, NODE_RANK and LOCAL_RANK, no RANK). Phases: ``early`` (a loader built at module level,
  before any Trainer: in the first process a world of 1 that must follow the process group), ``full``
  (``make_loader`` in ``LightningDataModule.setup()``, 3 epochs, checkpoints at every epoch's end and at
  step ``MID``), ``resume_end`` and ``resume_mid`` (resumed from those), ``limit``
  (``limit_train_batches=0.5``), ``reload`` (``reload_dataloaders_every_n_epochs=1``).
* ``spawn``: ``strategy="ddp_spawn"`` with the loader built in the DataModule's ``__init__`` (so in the
  parent, as one rank of one) and pickled into both ranks.
* ``srun``: ``num_nodes=2, devices=1`` under Slurm's variables (the test starts both tasks, one per
  "node", as ``srun --ntasks-per-node=1`` would): Lightning's SLURMEnvironment.
"""

from __future__ import annotations

import json
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L  # noqa: N812 (Lightning's own spelling)
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from stager.loader import make_loader

MODE, DATA, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
BATCH, EPOCHS, MID = 8, 3, 19  # MID: a step inside epoch 1 (13 batches per epoch and rank)
KW: dict[str, Any] = {"image_size": 8, "transform": "eval", "staged": False, "seed": 3}

# Built at import, before any Trainer (in the first process no launcher has run yet).
EARLY = make_loader(DATA, BATCH, **KW)
EARLY_WORLD = [EARLY.dataset.rank, EARLY.dataset.world_size, EARLY.dataset.world_source]


class Recorder(L.LightningModule):
    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: dict[int, list[list[int]]] = {}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.setdefault(self.current_epoch, []).append(batch["index"].tolist())
        return self.w.sum() * 0.0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_train_end(self) -> None:
        loader = self.trainer.train_dataloader
        out = {"seen": self.seen, "early_world": EARLY_WORLD, "len": len(loader), "host": socket.gethostname(),
               "world": [loader.dataset.rank, loader.dataset.world_size]}
        (OUT / f"{self.phase}-rank{self.global_rank}.json").write_text(json.dumps(out))


class Data(L.LightningDataModule):
    """The loader built where the DataModule says: in ``setup`` (default), in ``__init__``, or anew per request."""

    def __init__(self, where: str = "setup") -> None:
        super().__init__()
        self.where = where
        self.loader: Any = make_loader(DATA, BATCH, num_workers=1, **KW) if where == "init" else None

    def setup(self, stage: str) -> None:
        if self.where == "setup":
            self.loader = make_loader(DATA, BATCH, num_workers=2, **KW)

    def train_dataloader(self) -> Any:
        return make_loader(DATA, BATCH, num_workers=2, **KW) if self.where == "reload" else self.loader


def fit(phase: str, data: Any, **kw: Any) -> None:
    ckpt = kw.pop("ckpt_path", None)
    kw = {"max_epochs": EPOCHS, "enable_checkpointing": False, **kw}
    if MODE == "srun":
        kw |= {"num_nodes": 2, "devices": 1}
    else:
        kw |= {"devices": 2}
    trainer = L.Trainer(accelerator="cpu", strategy="ddp_spawn" if MODE == "spawn" else "ddp", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=str(OUT / phase), **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if isinstance(data, L.LightningDataModule):
            trainer.fit(Recorder(phase), datamodule=data, ckpt_path=ckpt)
        else:
            trainer.fit(Recorder(phase), train_dataloaders=data, ckpt_path=ckpt)
    if trainer.global_rank == 0:
        (OUT / f"{phase}-warnings.json").write_text(json.dumps([str(w.message) for w in caught]))


def main() -> None:
    ckpt = OUT / "ckpt"
    if MODE == "spawn":
        fit("spawn", Data("init"), max_epochs=2)
        return
    fit("early", EARLY, max_epochs=2)
    if MODE == "srun":
        fit("full", Data(), max_epochs=2)
        return
    fit("full", Data(), enable_checkpointing=True, callbacks=[
        ModelCheckpoint(dirpath=ckpt, filename="end-{epoch}", save_top_k=-1, every_n_epochs=1),
        ModelCheckpoint(dirpath=ckpt, filename="mid-{step}", save_top_k=-1, every_n_train_steps=MID)])
    fit("resume_end", Data(), ckpt_path=str(ckpt / "end-epoch=0.ckpt"))
    fit("resume_mid", Data(), ckpt_path=str(ckpt / f"mid-step={MID}.ckpt"))
    fit("limit", Data(), limit_train_batches=0.5)
    fit("reload", Data("reload"), reload_dataloaders_every_n_epochs=1)


if __name__ == "__main__":
    main()

"""The training frameworks' conventions, met by the stager loader itself (docs/training.md, "Frameworks").

A framework calls a data loader in its own ways; the user writes what the framework's tutorial shows
and these modules make a :class:`~stager.loader.Loader` answer them:

* :mod:`.hooks`: ``loader.sampler`` (:class:`EpochHook`), whose ``set_epoch`` Lightning's fit loop and
  Fabric call every epoch with the epoch they track (restored from a checkpoint, after
  ``limit_train_batches`` or a dataloader reload); :func:`epoch_batches`, the Loader's iteration with
  the frameworks' per-batch duties (device placement, Accelerate's ``end_of_dataloader``);
* :mod:`.accelerate`: ``accelerator.prepare`` adopts a Loader (device, ``save_state``/``load_state``),
  turns a ``DataLoader`` over a ``ShardedDataset`` into one instead of splitting it again,
  ``skip_first_batches`` positions it without reading, ``gather_for_metrics`` drops exactly the padding;
* :mod:`.fabric`: ``fabric.setup_dataloaders`` accepts a Loader;
* :mod:`.resplit`: a ShardedDataset refuses Accelerate's splitting wrappers (when the above is not installed).

This package's ``__init__`` imports none of them: the dataset module imports it, and the modules that
know the Loader must not be imported back from there (no import cycle, type-only ones included).

Accelerate and Fabric only accept their own types there, so :func:`install_present` wraps those few
entry points once, for stager objects only (anything else goes to the framework's own code); it runs
when a Loader is built and the framework is already imported. Nothing here imports a framework.
"""

from __future__ import annotations

import sys

__all__ = ["install_present"]


def install_present() -> None:
    """Install the integrations of the frameworks this process has imported (idempotent, cheap)."""
    if "accelerate" in sys.modules:
        from stager.loader.frameworks import accelerate  # noqa: PLC0415 (imports accelerate's modules)

        accelerate.install()
    if "lightning.fabric" in sys.modules or "lightning_fabric" in sys.modules:
        from stager.loader.frameworks import fabric  # noqa: PLC0415 (imports Fabric)

        fabric.install()

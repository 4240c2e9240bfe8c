"""Lightning Fabric's ``setup_dataloaders`` for a stager Loader (docs/training.md, "Fabric").

Fabric accepts torch DataLoaders only (``TypeError`` otherwise) and wraps them in its
``_FabricDataLoader``, which moves batches to the device and calls ``sampler.set_epoch`` with the
number of passes it has made in this process (0 after a restart, whatever epoch ``fabric.load``
restored). :func:`install` wraps the two steps ``setup_dataloaders`` takes per call
(``_validate_setup_dataloaders``, ``_setup_dataloader``: looked up when the call runs, so a loader
built in the call's own arguments is covered): a stager Loader (or a DataLoader over a ShardedDataset,
:mod:`.convert`) comes back as itself with ``loader.device = fabric.device`` (with ``move_to_device``);
its epochs are its own (the next epoch after a complete pass, ``set_epoch``, or the state
``fabric.load`` restored). Other dataloaders take Fabric's own path.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from stager.loader.frameworks.convert import stager_loader_of

_WRAPPED = "__stager_wrapped__"


def install() -> None:
    """Wrap the dataloader steps of the Fabric classes this process imported (idempotent)."""
    for name in ("lightning.fabric", "lightning_fabric"):
        cls = getattr(sys.modules.get(name), "Fabric", None)
        validate = getattr(cls, "_validate_setup_dataloaders", None)
        setup_one = getattr(cls, "_setup_dataloader", None)
        if cls is None or validate is None or setup_one is None or getattr(setup_one, _WRAPPED, False):
            continue
        cls._validate_setup_dataloaders = _wrap_validate(validate)
        cls._setup_dataloader = _wrap_setup(setup_one)


def _wrap_validate(validate: Any) -> Any:
    @functools.wraps(validate)
    def _validate_setup_dataloaders(self: Any, dataloaders: Any) -> None:
        theirs = [dl for dl in dataloaders if stager_loader_of(dl) is None]
        if theirs or not dataloaders:
            validate(self, theirs or dataloaders)
        else:
            self._validate_launched()

    setattr(_validate_setup_dataloaders, _WRAPPED, True)
    return _validate_setup_dataloaders


def _wrap_setup(setup_one: Any) -> Any:
    @functools.wraps(setup_one)
    def _setup_dataloader(self: Any, dataloader: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        loader = stager_loader_of(dataloader)
        if loader is None:
            return setup_one(self, dataloader, use_distributed_sampler=use_distributed_sampler,
                             move_to_device=move_to_device)
        device = self.device
        loader.device = device if move_to_device and getattr(device, "type", "cpu") != "cpu" else None
        return loader

    setattr(_setup_dataloader, _WRAPPED, True)
    return _setup_dataloader

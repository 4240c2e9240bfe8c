"""Lightning Fabric's ``setup_dataloaders`` for a stager Loader (docs/training.md, "Fabric").

Fabric accepts torch DataLoaders only (``TypeError`` otherwise) and wraps them in its
``_FabricDataLoader``, which moves batches to the device and calls ``sampler.set_epoch`` with the
number of passes it has made in this process (0 after a restart, whatever epoch ``fabric.load``
restored). :func:`install` wraps ``Fabric.setup_dataloaders``: a stager Loader (or a DataLoader over a
ShardedDataset, :mod:`.convert`) is returned as itself with ``loader.device = fabric.device`` (with
``move_to_device``); its epochs are its own (the next epoch after a complete pass, ``set_epoch``, or the
state ``fabric.load`` restores). Other dataloaders go to Fabric's own method.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from stager.loader.frameworks.convert import stager_loader_of

_WRAPPED = "__stager_wrapped__"


def install() -> None:
    """Wrap ``Fabric.setup_dataloaders`` of the Fabric packages this process imported (idempotent)."""
    for name in ("lightning.fabric", "lightning_fabric"):
        mod = sys.modules.get(name)
        cls = getattr(mod, "Fabric", None)
        setup = getattr(cls, "setup_dataloaders", None)
        if cls is None or setup is None or getattr(setup, _WRAPPED, False):
            continue
        wrapped = _wrap(setup)
        setattr(wrapped, _WRAPPED, True)
        cls.setup_dataloaders = wrapped


def _wrap(setup: Any) -> Any:
    @functools.wraps(setup)
    def setup_dataloaders(self: Any, *dataloaders: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        loaders = [stager_loader_of(dl) for dl in dataloaders]
        if all(x is None for x in loaders):
            return setup(self, *dataloaders, use_distributed_sampler=use_distributed_sampler,
                         move_to_device=move_to_device)
        out = []
        for dl, loader in zip(dataloaders, loaders, strict=True):
            if loader is None:
                out.append(setup(self, dl, use_distributed_sampler=use_distributed_sampler,
                                 move_to_device=move_to_device))
                continue
            device = self.device
            loader.device = device if move_to_device and getattr(device, "type", "cpu") != "cpu" else None
            out.append(loader)
        return out[0] if len(out) == 1 else out

    return setup_dataloaders

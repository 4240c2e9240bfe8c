"""The training frameworks' conventions, met by the stager loader itself (docs/training.md, "Frameworks").

A framework calls a data loader in its own ways; the user writes what the framework's tutorial shows
and these modules make a :class:`~stager.loader.Loader` answer them:

* :mod:`.hooks`: ``loader.sampler`` (:class:`EpochHook`), whose ``set_epoch`` Lightning's fit loop and
  Fabric call every epoch with the epoch they track (restored from a checkpoint, after
  ``limit_train_batches`` or a dataloader reload); :func:`epoch_batches`, the Loader's iteration with
  the frameworks' per-batch duties (device placement, Accelerate's ``end_of_dataloader`` and
  ``remainder``: :class:`AcceleratePass`);
* :mod:`.convert`: which objects are stager's (a registry the Loader's and ShardedDataset's modules fill);
* :mod:`.accelerate`: ``accelerator.prepare`` adopts a Loader (device, ``save_state``/``load_state``),
  turns a ``DataLoader`` over a ``ShardedDataset`` into one instead of splitting it again,
  ``skip_first_batches`` positions it without reading (the HF Trainer's resume included);
* :mod:`.fabric`: ``fabric.setup_dataloaders`` accepts a Loader.

Accelerate and Fabric only accept their own types there, so :func:`install_present` wraps those few
entry points once, for stager objects only (anything else goes to the framework's own code). It runs
when a Loader or ShardedDataset is built; a framework imported only after that is installed as soon as
its package has been imported (:class:`_AfterImport`, a ``sys.meta_path`` finder that lets the usual
finders find it and runs :func:`install_present` once its module has executed). Nothing here imports a
framework, and this package's ``__init__`` imports none of its modules at load time.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["install_present"]

# The frameworks' top-level modules whose import installs their integration.
WATCHED = ("accelerate", "lightning.fabric", "lightning_fabric")
_WATCH_LOCK = threading.Lock()


def install_present() -> None:
    """Install the integrations of the frameworks this process has imported (idempotent, cheap), and have
    those it has not imported yet installed when they are."""
    if "accelerate" in sys.modules:
        from stager.loader.frameworks import accelerate  # noqa: PLC0415 (imports accelerate's modules)

        accelerate.install()
    if "lightning.fabric" in sys.modules or "lightning_fabric" in sys.modules:
        from stager.loader.frameworks import fabric  # noqa: PLC0415 (imports Fabric)

        fabric.install()
    if not all(name in sys.modules for name in WATCHED):
        with _WATCH_LOCK:
            if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
                sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a :data:`WATCHED` module it asks the finders after it and wraps the loader
    they found, so that :func:`install_present` runs once the module has executed (a post-import hook)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenInstall(spec.loader)
                return spec
        return None


class _ThenInstall(importlib.abc.Loader):
    """The found loader, then :func:`install_present`. The module keeps its own loader (``__loader__``,
    ``__spec__.loader``: what importlib.resources and reloads use)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        if module.__spec__ is not None and module.__spec__.loader is self:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        install_present()

"""Which objects a framework's set-up call hands to stager: a registry the loader's modules fill.

Accelerate's ``prepare`` and ``skip_first_batches`` and Fabric's ``setup_dataloaders`` are given
whatever the user passes. :func:`stager_loader_of` answers whether it is stager's, as the
:class:`~stager.loader.Loader` that serves it: a Loader is itself (registered by
:mod:`stager.loader.loader`), and a torch ``DataLoader(ShardedDataset(...), batch_size=None)`` is the
Loader ``make_loader`` would have built over the same dataset (registered by
:mod:`stager.loader.sharded`). :func:`is_rank_share` answers whether a dataset is already one rank's
share, which Accelerate's splitting wrappers must not split again.

Each module registers as it is imported, and it is imported before any of its objects exists, so the
registry knows every stager object a process holds. This module imports none of them (they import it):
the frameworks' modules meet the Loader without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stager.loader.frameworks.hooks import FrameworkLoader

Converter = Callable[[Any], "FrameworkLoader | None"]

_CONVERTERS: list[Converter] = []
_RANK_SHARES: list[type] = []


def register(converter: Converter, *, rank_share: type | None = None) -> None:
    """Add ``converter`` (an object -> its Loader, or None when it is not the converter's kind); ``rank_share``:
    a dataset type that is one rank's share already. Idempotent (a module imported twice registers once)."""
    if converter not in _CONVERTERS:
        _CONVERTERS.append(converter)
    if rank_share is not None and rank_share not in _RANK_SHARES:
        _RANK_SHARES.append(rank_share)


def stager_loader_of(obj: Any) -> FrameworkLoader | None:
    """``obj`` as a stager Loader (itself, or the Loader over a DataLoader's ShardedDataset), or None: not stager's."""
    for converter in _CONVERTERS:
        loader = converter(obj)
        if loader is not None:
            return loader
    return None


def is_rank_share(dataset: Any) -> bool:
    """Whether ``dataset`` is a stager dataset that is already one rank's share (a ShardedDataset)."""
    return isinstance(dataset, tuple(_RANK_SHARES))

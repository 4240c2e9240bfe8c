"""Hugging Face Accelerate's conventions for a stager Loader (docs/training.md, "Accelerate").

Accelerate knows torch DataLoaders only: ``prepare`` returns anything else untouched (no device
placement, not in ``save_state``), ``skip_first_batches`` rebuilds a DataLoader from the object's
attributes, and a DataLoader over an ``IterableDataset`` is split across the ranks again (read on rank
0 and dispatched, or every rank's stream cut into ``1/world``): a ShardedDataset is one rank's share
already. So :func:`install` wraps three entry points, for stager objects only:

* ``Accelerator._prepare_one`` (what ``prepare`` calls per object): a Loader, or a DataLoader over a
  ShardedDataset (:mod:`.convert`), is *adopted*: batches go to ``accelerator.device`` when the
  accelerator places data, and the Loader is registered for checkpointing (``save_state`` writes its
  ``state_dict`` once, ``load_state`` restores it on every rank: epoch and position);
* ``skip_first_batches`` (the function and the method): a Loader starts its next pass at that batch
  without reading the ones before it (:meth:`~stager.loader.base.LoaderBase.skip_to`; absolute, so a
  position already restored by ``load_state`` is not skipped twice).

While an Accelerator exists, every pass registers the Loader as Accelerate's active dataloader
(:class:`AcceleratePass`): ``end_of_dataloader`` is True while the last batch is out, so gradient
accumulation syncs at the epoch's end, and ``remainder`` tells ``gather_for_metrics`` how many rows
of the last gathered batch are real (the padding repeats sit at its tail when ``shuffle=False``).
Without the wrappers (accelerate imported after the loader was built), a ShardedDataset still refuses
to be split again (:mod:`.resplit`). Nothing here imports accelerate until it is imported.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from stager.errors import UsageError
from stager.loader.frameworks.convert import stager_loader_of
from stager.loader.frameworks.hooks import FrameworkLoader

if TYPE_CHECKING:
    from collections.abc import Iterator

    from stager.loader.loader import Loader

log = logging.getLogger("stager.loader")

_WRAPPED = "__stager_wrapped__"
_PAD_LOGGED: weakref.WeakSet[Any] = weakref.WeakSet()  # loaders whose unmovable padding was logged


def install() -> None:
    """Wrap ``Accelerator._prepare_one`` and ``skip_first_batches`` for stager loaders (idempotent)."""
    import accelerate  # noqa: PLC0415 (only when the process has imported it)
    import accelerate.accelerator as acc_mod  # noqa: PLC0415
    import accelerate.data_loader as dl_mod  # noqa: PLC0415

    cls = acc_mod.Accelerator
    prepare_one = getattr(cls, "_prepare_one", None)
    if prepare_one is None or getattr(prepare_one, _WRAPPED, False):
        return

    @functools.wraps(prepare_one)
    def _prepare_one(self: Any, obj: Any, first_pass: bool = False, device_placement: bool | None = None) -> Any:
        if first_pass and (loader := stager_loader_of(obj)) is not None:
            return adopt(self, loader, device_placement)
        return prepare_one(self, obj, first_pass=first_pass, device_placement=device_placement)

    skip = dl_mod.skip_first_batches

    @functools.wraps(skip)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        loader = stager_loader_of(dataloader) if not isinstance(dataloader, SkipBatches) else None
        if loader is not None:
            return SkipBatches(loader, num_batches)
        return skip(dataloader, num_batches=num_batches)

    setattr(_prepare_one, _WRAPPED, True)
    setattr(skip_first_batches, _WRAPPED, True)
    cls._prepare_one = _prepare_one
    for mod in (dl_mod, acc_mod, accelerate):
        if getattr(mod, "skip_first_batches", None) is skip:
            mod.skip_first_batches = skip_first_batches


def adopt(accelerator: Any, loader: Loader, device_placement: bool | None) -> Loader:
    """``accelerator.prepare``'s answer for a stager Loader: the Loader itself, placed and checkpointed."""
    placement = accelerator.device_placement if device_placement is None else device_placement
    device = accelerator.device
    loader.device = device if placement and getattr(device, "type", "cpu") != "cpu" else None
    if all(obj is not loader for obj in accelerator._custom_objects):
        accelerator.register_for_checkpointing(loader)
    return loader


class SkipBatches:
    """``skip_first_batches(loader, k)`` of a stager Loader: its next pass from batch ``k`` (no reads before it).

    Iterating it positions the Loader (:meth:`~stager.loader.base.LoaderBase.skip_to`) and iterates the
    Loader itself, so its epoch, position and state move as usual; the next ``iter(loader)`` goes on
    with the next epoch. ``len()``: the batches left. Other attributes are the Loader's.
    """

    def __init__(self, loader: Loader, num_batches: int) -> None:
        self.loader = loader
        self.num_batches = int(num_batches)

    def __iter__(self) -> Iterator[Any]:
        self.loader.skip_to(self.num_batches)
        return iter(self.loader)

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.num_batches)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class AcceleratePass:
    """One pass of a Loader as Accelerate's active dataloader (``GradientState``), while an Accelerator exists."""

    def __init__(self, loader: FrameworkLoader, state: Any) -> None:
        self.loader = loader
        self.state = state
        self.length: int | None = None

    @classmethod
    def begin(cls, loader: FrameworkLoader) -> AcceleratePass | None:
        mod = sys.modules.get("accelerate.state")
        if mod is None or not mod.GradientState._shared_state:
            return None  # no Accelerator in this process
        state = mod.GradientState()
        loader.end_of_dataloader, loader.remainder = False, -1
        state._add_dataloader(loader)
        return cls(loader, state)

    def before_yield(self) -> None:
        """Mark the epoch's last batch before it is handed out (``accumulate`` reads the flag on entry)."""
        if self.length is None:
            self.length = len(self.loader.dataset)
        if self.loader.batches_done >= self.length and not self.loader.end_of_dataloader:
            self.loader.remainder = gather_remainder(self.loader)
            self.loader.end_of_dataloader = True

    def end(self) -> None:
        self.state._remove_dataloader(self.loader)


def gather_remainder(loader: FrameworkLoader) -> int:
    """The real rows of the epoch's last gathered batch (Accelerate's ``remainder``; 0: keep all rows).

    ``gather_for_metrics`` keeps the first ``remainder`` rows of the last batch gathered over the ranks
    (rank 0's rows first). That drops exactly the padding repeats when they all sit at the tail of the
    last rank's last batch, as they do with ``shuffle=False`` (when they fit in that batch). Otherwise
    (shuffled padding lies anywhere in the last rank's share) nothing can be dropped there: 0, logged once.
    """
    ds = loader.dataset
    sizes = ds.batch_sizes()
    world = ds.group.world_size
    pad = world * int(sizes.sum()) - ds.samples_in_epoch()
    if not len(sizes) or pad <= 0:
        return 0
    try:
        last = None if ds.group.node_partitioned else ds.plan(rank=world - 1)
    except UsageError:  # a mix: one plan per stream, its padding anywhere in the layout
        last = None
    if last is not None and _padding_at_tail(last, pad):
        return world * int(sizes[-1]) - pad
    if loader not in _PAD_LOGGED:
        _PAD_LOGGED.add(loader)
        log.info("stager.loader: %d padding repeats of this epoch are not at the end of the last batch, so "
                 "accelerate's gather_for_metrics keeps them; evaluate with shuffle=False (or drop_last=True)", pad)
    return 0


def _padding_at_tail(plan: Any, pad: int) -> bool:
    """All ``pad`` repeats of the epoch in ``plan`` (the last rank's), at the end of its last batch."""
    if int(plan.padded) != pad or not plan.num_batches:
        return False
    nw = len(plan.workers)
    j = plan.num_batches - 1
    w = plan.workers[j % nw]
    is_pad = np.asarray(w.is_pad[w.batch_positions(j // nw)], dtype=bool)
    return len(is_pad) >= pad and bool(is_pad[len(is_pad) - pad :].all()) and int(is_pad.sum()) == pad

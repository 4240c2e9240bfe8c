"""Hugging Face Accelerate's conventions for a stager Loader (docs/training.md, "Accelerate").

Accelerate knows torch DataLoaders only: ``prepare`` returns anything else untouched (no device
placement, not in ``save_state``), ``skip_first_batches`` rebuilds a DataLoader from the object's
attributes, and a DataLoader over an ``IterableDataset`` is split across the ranks again (read on rank
0 and dispatched, or every rank's stream cut into ``1/world``): a ShardedDataset is one rank's share
already. So :func:`install` wraps these entry points, for stager objects only (:mod:`.convert` says
which objects are stager's):

* ``Accelerator._prepare_one`` (what ``prepare`` calls per object): a Loader, or a DataLoader over a
  ShardedDataset, is *adopted*: batches go to ``accelerator.device`` when the accelerator places data,
  and the Loader is registered for checkpointing (``save_state`` writes its ``state_dict`` once,
  ``load_state`` restores it on every rank: epoch and position);
* ``skip_first_batches`` (the function and the method, and the name the Hugging Face Trainer imported
  from accelerate, which its ``resume_from_checkpoint`` calls): a Loader starts its next pass at that
  batch without reading the ones before it (:meth:`~stager.loader.base.LoaderBase.skip_to`; absolute,
  so a position already restored by ``load_state`` is not skipped twice);
* the splitting wrappers ``IterableDatasetShard`` and ``DataLoaderDispatcher`` refuse a ShardedDataset
  in one line (``accelerate.data_loader.prepare_data_loader`` called directly would split it).

While an Accelerator exists, every pass registers the Loader as Accelerate's active dataloader
(:class:`~stager.loader.frameworks.hooks.AcceleratePass`). :func:`install` runs when a loader is built
with accelerate imported, or when accelerate is imported later (:mod:`stager.loader.frameworks`).
Nothing here imports accelerate until it is imported.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

from stager.errors import UsageError
from stager.loader.frameworks.convert import is_rank_share, stager_loader_of

if TYPE_CHECKING:
    from collections.abc import Iterator

    from stager.loader.frameworks.hooks import FrameworkLoader

_WRAPPED = "__stager_wrapped__"
# Accelerate's wrappers that split a dataset across the ranks (a ShardedDataset is one rank's share already).
SPLITTERS = ("IterableDatasetShard", "DataLoaderDispatcher")


def install() -> None:
    """Wrap ``Accelerator._prepare_one``, ``skip_first_batches`` and the splitting wrappers for stager
    objects (idempotent)."""
    import accelerate  # noqa: PLC0415 (only when the process has imported it)
    import accelerate.accelerator as acc_mod  # noqa: PLC0415
    import accelerate.data_loader as dl_mod  # noqa: PLC0415

    for name in SPLITTERS:
        _refuse_rank_shares(getattr(dl_mod, name))
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
    # transformers.trainer holds the function by name (``from accelerate import skip_first_batches``) when it
    # was imported first; imported later, it takes the wrapped one from accelerate.
    holders: tuple[Any, ...] = (dl_mod, acc_mod, accelerate, sys.modules.get("transformers.trainer"))
    for mod in holders:
        if mod is not None and getattr(mod, "skip_first_batches", None) is skip:
            mod.skip_first_batches = skip_first_batches


def _refuse_rank_shares(splitter: Any) -> None:
    """Make ``splitter(dataset, ...)`` refuse a stager dataset that is one rank's share already."""
    init = splitter.__init__
    if getattr(init, _WRAPPED, False):
        return

    @functools.wraps(init)
    def refusing_init(self: Any, *args: Any, **kwargs: Any) -> None:
        dataset = args[0] if args else kwargs.get("dataset")
        if is_rank_share(dataset):
            raise UsageError(
                f"accelerate's {splitter.__name__} would split a {type(dataset).__name__} (already this rank's "
                "share) across the ranks again: pass its DataLoader, or make_loader(...), to accelerator.prepare(), "
                "which adopts it as a stager Loader"
            )
        init(self, *args, **kwargs)

    setattr(refusing_init, _WRAPPED, True)
    splitter.__init__ = refusing_init


def adopt(accelerator: Any, loader: FrameworkLoader, device_placement: bool | None) -> FrameworkLoader:
    """``accelerator.prepare``'s answer for a stager Loader: the Loader itself, placed and checkpointed, and
    with ``shuffle=False`` its batches dealt to the ranks in turn as Accelerate's own DataLoader deals them
    (:meth:`~stager.loader.rank.RankDataset.deal_batches_in_turn`), so ``gather_for_metrics`` returns the
    dataset's order."""
    if loader.dataset.deal_batches_in_turn():
        loader.close()  # persistent workers hold the previous plan's dataset: the next pass starts new ones
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

    def __init__(self, loader: FrameworkLoader, num_batches: int) -> None:
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

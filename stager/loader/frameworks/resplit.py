"""A ShardedDataset's refusal to be split across the ranks again by Accelerate's wrappers.

When stager's Accelerate integration is installed (:mod:`.accelerate`), ``prepare`` turns a DataLoader
over a ShardedDataset into a stager Loader. When it is not (accelerate imported only after the dataset
was built), accelerate wraps the DataLoader in ``DataLoaderDispatcher`` (rank 0 reads, the batch is
dealt out) or its dataset in ``IterableDatasetShard`` (every rank's stream cut into ``1/world``): on
two ranks, half the data, silently. Both call ``dataset.set_epoch`` before every pass, which is where
the dataset sees them (this module imports nothing of stager's loader, so the dataset can import it).
"""

from __future__ import annotations

from types import FrameType

from stager.errors import UsageError

SPLITTERS = ("IterableDatasetShard", "DataLoaderDispatcher")


def refuse_second_split(frame: FrameType | None) -> None:
    """Refuse a ``ShardedDataset.set_epoch`` call from Accelerate's splitting wrappers (``frame``: the caller's)."""
    if frame is None or frame.f_globals.get("__name__") != "accelerate.data_loader":
        return
    owner = type(frame.f_locals.get("self")).__name__
    if owner in SPLITTERS:
        raise UsageError(
            f"accelerate's {owner} would split a ShardedDataset (already this rank's share) across the ranks again: "
            "build the loader after `import accelerate` (stager's integration then adopts it in prepare()), or "
            "pass make_loader(...) to accelerator.prepare()"
        )

"""Shuffled, rank-partitioned, resumable batches for PyTorch DDP, and as numpy arrays for TF/Keras/JAX (docs/loader.md).

``make_loader(path, batch_size, ...)`` reads a packed directory (local path or fsspec URL; any of
the four formats), its staged node-local copy when ``stager stage`` made one, or a plain ImageFolder
tree. It is ``Loader(ShardedDataset(path, LoaderOptions(batch_size, ...)))``.

Modules: :mod:`.options` (``LoaderOptions``: every setting, validated once), :mod:`.dataset_index` /
:mod:`.shard_access` (what to read and from where; shard files held by the schedule's open-file rule),
:mod:`.torch_dataset` (``TorchRankDataset``: one rank's batches, built by each worker from its plan),
:mod:`.sharded` (``ShardedDataset``, the same as a torch ``IterableDataset``),
:mod:`.fetch` (a worker's reads, as the read schedule says, and its payloads), :mod:`.batching` /
:mod:`.shm` (batches in shared memory), :mod:`.transforms`, :mod:`.state` (``LoaderState``),
:mod:`.stats`, :mod:`.loader` (``Loader``), :mod:`.persistent` (DataLoader workers kept across
epochs). The order itself (epoch plan, read schedule) is :mod:`stager.order`'s, pure numpy.

Without torch: :mod:`.rank` (``RankDataset``, the plan-read-decode-assemble core both transports
run), :mod:`.assemble`, :mod:`.base` (``LoaderBase``: epochs, counting, resume, stats), and
:mod:`.numpy_loader` (``make_numpy_loader``: numpy batches from multiprocessing workers), with
:mod:`.keras` (``KerasBatches``, a ``keras.utils.PyDataset``) and :mod:`.tfdata` (``tf_dataset``) on
top. So this package imports torch only when a torch name (``make_loader``, ``Loader``,
``ShardedDataset``) is first used: ``import stager.loader.numpy_loader`` works where torch is absent.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stager.errors import UsageError
from stager.loader.options import BoxFilter, LoaderOptions
from stager.loader.state import LoaderState
from stager.mix import Mix, Stream, is_mix

if TYPE_CHECKING:
    from stager.loader.loader import Loader
    from stager.loader.numpy_loader import NumpyLoader, make_numpy_loader
    from stager.loader.samples import SampleDataset
    from stager.loader.sharded import ShardedDataset

__all__ = ["BoxFilter", "Loader", "LoaderOptions", "LoaderState", "Mix", "NumpyLoader", "SampleDataset",
           "ShardedDataset", "Stream", "make_loader", "make_numpy_loader"]

# The names whose modules import torch (or, for the numpy loader, multiprocessing), loaded on first use.
_LAZY = {"Loader": "stager.loader.loader", "ShardedDataset": "stager.loader.sharded",
         "SampleDataset": "stager.loader.samples",
         "NumpyLoader": "stager.loader.numpy_loader", "make_numpy_loader": "stager.loader.numpy_loader"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stager.loader' has no attribute {name!r}")


def make_loader(
    path: str | os.PathLike[str] | Mix | Sequence[Any],
    batch_size: int,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    num_workers: int = 0,
    seed: int = 0,
    shuffle: bool | str = True,
    decode: str = "uint8",
    transform: Any = None,
    image_size: int = 224,
    drop_last: bool = False,
    on_error: str = "raise",
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    storage_options: dict[str, Any] | None = None,
    staged: bool | str = "auto",
    staging_roots: tuple[str, ...] = (),
    run_bytes: int | str = "auto",
    min_run: int | None = None,
    shuffle_buffer: int | None = None,
    shuffle_buffer_bytes: int = 512 << 20,
    multiprocessing_context: Any = None,
    timeout: float = 0,
    use_mmap: bool = True,
    persistent_workers: bool | None = None,
    fields: Sequence[str] | str | None = None,
    box_filter: BoxFilter | Mapping[str, float] | None = None,
    composition: str | None = None,
) -> Loader:
    """A per-rank iterable of batch dicts ``{"key", "label", "index", "image"}`` (see docs/loader.md).

    ``rank``/``world_size`` default to torch.distributed, then the launcher's environment
    (:meth:`stager.world.World.detect`). ``shuffle``: True (= ``"runs"``), False (manifest order),
    or a mode name (``"runs"``, ``"shards"``, ``"random"``). ``drop_last=False`` pads every rank to
    ``ceil(N / world_size)`` samples by repeating samples (the last batch may be short);
    ``drop_last=True`` keeps ``floor(N / world_size)`` per rank and only full batches. Shuffle
    memory is bounded by ``shuffle_buffer_bytes`` per rank (or ``shuffle_buffer`` samples per
    worker); reads are runs of ~``run_bytes`` (at least ``min_run`` samples); ``"auto"`` is 1 MiB
    (4 samples) on shared file systems and URLs, 256 KiB (2 samples) on node-local storage.
    ``use_mmap``: local shards of encoded formats are mapped and payloads are zero-copy slices of
    the mapping (``False``: one ``pread`` per run into a private buffer). ``persistent_workers``
    (default: True when ``num_workers > 0``): start the worker processes once and reuse them every
    epoch (same batches; :meth:`Loader.close` stops them). ``fields``: on a dataset with fields
    (docs/fields.md), the fields to read (None: all; unnamed fields are not decoded); the batch then
    holds each field by name, transformed with the image (one crop and flip for image, masks, boxes).
    ``box_filter``: which boxes a crop keeps (:class:`~stager.loader.options.BoxFilter`, or a dict of
    its ``min_side``, ``min_area``, ``min_visibility``; default: every box whose visible part is at
    least 1 output pixel wide, high and in area).

    ``path`` may also be a mix of datasets (docs/loader.md, "Mixing datasets"): a list of paths,
    ``(path, weight)`` pairs or :class:`~stager.mix.Stream` objects, a :class:`~stager.mix.Mix`, or a
    YAML/JSON mix file; batches then also hold ``stream`` (int64 (B,)) and ``composition``
    (``"random"``, ``"stratified"``, ``"per_stream"``) overrides the mix's own.
    """
    options = LoaderOptions(
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        seed=seed,
        shuffle=shuffle,
        decode=decode,
        transform=transform,
        image_size=image_size,
        drop_last=drop_last,
        on_error=on_error,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        storage_options=storage_options,
        staged=staged,
        staging_roots=staging_roots,
        run_bytes=run_bytes,
        min_run=min_run,
        shuffle_buffer=shuffle_buffer,
        shuffle_buffer_bytes=shuffle_buffer_bytes,
        multiprocessing_context=multiprocessing_context,
        timeout=timeout,
        use_mmap=use_mmap,
        persistent_workers=persistent_workers,
        fields=None if fields is None else ((fields,) if isinstance(fields, str) else tuple(fields)),
        box_filter=box_filter,
        composition=composition,
    )
    from stager.loader.loader import Loader  # noqa: PLC0415 (as above)
    from stager.loader.torch_dataset import TorchRankDataset  # noqa: PLC0415 (torch only where its loader is used)

    if is_mix(path):
        from stager.loader.mix.torch_dataset import MixTorchRankDataset  # noqa: PLC0415 (as above)

        return Loader(MixTorchRankDataset(path, options))
    if composition is not None:
        raise UsageError(f"composition={composition!r} applies to a mix of datasets; {path} is one dataset")
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"expected a dataset path, a mix file or a list of streams, got {type(path).__name__}")
    return Loader(TorchRankDataset(path, options))

"""``SampleDataset``: a packed dataset as a torch map-style dataset, ``ds[i]`` is sample ``i``.

For code that samples indices itself: the Hugging Face ``Trainer`` (``Trainer(train_dataset=ds)``
builds a DataLoader over it with its own sampler, which Accelerate shards across ranks, pads evenly,
orders per epoch and skips on resume), or any ``DataLoader(ds, sampler=DistributedSampler(ds))``.
The rank partition, shuffle and resume are then theirs; stager serves each index with one read of
that sample's bytes from the packed (or staged, found as the loader finds it) shards, and the same
decoding and transforms as :func:`~stager.loader.make_loader` (docs/loader.md).

Reads are one ``pread`` (or ranged GET) per sample: fine on a staged node-local copy, costlier on a
shared file system than the loader's runs of ~1 MiB (docs/training.md, "Hugging Face Trainer").

A sample is a dict: ``image`` (uint8 tensor (C, H, W); a clip pack's windows (T, C, H, W); ``bytes``
for ``decode="raw"``, a PIL image for ``"pil"``), ``label`` (int), ``key`` (str), ``index`` (int: the
global id, manifest order), plus a sample's fields (docs/fields.md) and a clip's ``sequence`` and
``start_frame``. Augmentation draws come from torch's generator (seeded per DataLoader worker and
epoch by torch), so ``torch.manual_seed`` (the Trainer's ``seed``) makes them reproducible.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stager.errors import UsageError
from stager.loader.fetch import read_isolating
from stager.loader.options import LoaderOptions
from stager.loader.rank import RankDataset
from stager.loader.shard_access import ShardAccess

# Per-sample options of make_loader that a map-style dataset takes (the order and workers are its user's).
SAMPLE_OPTIONS = ("decode", "transform", "image_size", "seed", "storage_options", "staged", "staging_roots",
                  "use_mmap", "fields", "box_filter")


class SampleDataset(Dataset):
    """Map-style view of a packed dataset: ``len(ds)`` samples (windows of a clip pack), ``ds[i]`` one dict.

    ``SampleDataset(path, decode="uint8", transform=None, image_size=224, seed=0, staged="auto",
    storage_options=None, staging_roots=(), use_mmap=True, fields=None, box_filter=None)``: the same meanings as
    :func:`~stager.loader.make_loader`. Picklable: each DataLoader worker opens the shards it reads.
    """

    def __init__(self, path: str | os.PathLike[str], **settings: Any) -> None:
        unknown = set(settings) - set(SAMPLE_OPTIONS)
        if unknown:
            raise UsageError(f"SampleDataset takes {', '.join(SAMPLE_OPTIONS)}; not {', '.join(sorted(unknown))}")
        opts = LoaderOptions(batch_size=1, rank=0, world_size=1, num_workers=0, shuffle=False, **settings)
        self.source = RankDataset(path, opts)
        self._access: ShardAccess | None = None

    def __len__(self) -> int:
        return int(self.source.items.count)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_access": None}

    def _reader(self) -> ShardAccess:
        if self._access is None or self._access._pid != os.getpid():
            self._access = ShardAccess(self.source.resolved, use_mmap=False)
        return self._access

    def __getitem__(self, i: int) -> dict[str, Any]:
        src = self.source
        n = len(self)
        if not -n <= int(i) < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        item = int(i) % n
        access = self._reader()
        if src.field_fn is not None:
            src.field_fn.access = access
        idx = src.index
        payloads: list[Any] = []
        for g in src.items.samples_of(np.array([item], dtype=np.int64))[0].tolist():
            shard = int(idx.shard_of(np.array([g]))[0])
            got, _ = read_isolating(access, shard, np.array([g - int(idx.starts[shard])], dtype=np.int64), "raise")
            payloads += got
        draw = int(torch.randint(0, 2**31 - 1, ()).item())  # the augmentation's stream: torch's, per worker
        batch = src._assemble(payloads, np.array([item], dtype=np.int64), draw, in_worker=False, ring=None)
        return _one(batch)


def _one(batch: dict[str, Any]) -> dict[str, Any]:
    """The single sample of a batch of one: leading dimension dropped, images channels-first tensors."""
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if k.startswith("_"):
            continue
        x = v[0]
        if k == "image" and isinstance(x, np.ndarray) and x.ndim >= 3:
            x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(x, -1, -3)))  # (.., H, W, C) -> (.., C, H, W)
        elif isinstance(x, memoryview):
            x = x.tobytes()
        elif isinstance(x, np.generic):
            x = x.item()
        out[k] = x
    return out

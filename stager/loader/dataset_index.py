"""The loader's view of a dataset: shards and a flat, global per-sample index.

Built from a packed directory's manifest, or from a plain ImageFolder tree (``root/<class>/<file>``,
no manifest) by listing it: then every file is a "shard" of one sample whose extent is the whole
file. That is also the small-file baseline the benchmarks compare against.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from stager.errors import SourceError, SourceNotFoundError
from stager.loader.fields import field_spans, select_fields
from stager.manifest import Manifest

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm", ".gif", ".tif", ".tiff")


@dataclass
class DatasetIndex:
    """Shards plus the global sample index (global id = position in manifest order).

    ``starts``: int64, shape (shards + 1,), global id of each shard's first sample, then N.
    ``labels``/``offsets``/``sizes``: int64, shape (N,). ``offsets``/``sizes`` locate each sample's
    payload inside its shard file (zarr: ``offsets`` is the row). ``shard_bytes``: the size every
    shard file must have (-1: unknown, not checked). ``kind``: "encoded" or "decoded".
    """

    format: str  # tar | hdf5 | record | zarr | folder
    kind: str
    shard_names: list[str]
    shard_bytes: np.ndarray
    starts: np.ndarray
    keys: Sequence[str]
    labels: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    classes: list[str]
    manifest: Manifest | None = None
    image_shape: tuple[int, int, int] | None = None
    span_fields: tuple[str, ...] = ()  # byte fields whose bytes the offsets/sizes span (stager.loader.fields)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A manifest-backed index travels as its manifest (which reopens the mapped sample index in
        # the receiving process); pickling the arrays would copy every per-sample column into it.
        if self.manifest is not None and self.manifest.samples_index is not None:
            return (index_from_manifest, (self.manifest, self.span_fields))
        return super().__reduce_ex__(protocol)

    @property
    def num_samples(self) -> int:
        return int(self.starts[-1])

    @property
    def num_shards(self) -> int:
        return len(self.shard_names)

    @property
    def dataset_id(self) -> str:
        if self.manifest is not None:
            return self.manifest.dataset_id

        h = xxhash.xxh3_64()
        for k, s in zip(self.keys, self.sizes.tolist(), strict=True):
            h.update(f"{k}\0{s}\n".encode())
        return "folder-" + h.hexdigest()

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """Shard index of each global id."""
        return np.searchsorted(self.starts, ids, side="right") - 1

    def payload_bytes(self) -> np.ndarray:
        """Per-shard payload bytes (sum of sample sizes; zarr: rows x H*W*C), shape (shards,)."""
        csum = np.concatenate([[0], np.cumsum(self.sizes)])
        return (csum[self.starts[1:]] - csum[self.starts[:-1]]).astype(np.int64)


def index_from_manifest(m: Manifest, span_fields: Sequence[str] = ()) -> DatasetIndex:
    """The loader's view of ``m``: for a v2 manifest, every per-sample array is a view of the mapped
    sample index (shared by all processes on the node, no heap copy); keys decode on access.

    ``span_fields``: byte fields (docs/fields.md) read with each sample: then ``offsets``/``sizes``
    are each sample's span over its image and those fields (:func:`stager.loader.fields.field_spans`,
    two computed int64 arrays instead of views)."""
    counts = np.array([s.samples for s in m.shards], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    shard_bytes = np.array([s.bytes for s in m.shards], dtype=np.int64)
    offsets, sizes = m.column("offset"), m.column("size")
    if span_fields:
        offsets, sizes = field_spans(m, select_fields(m, list(span_fields)))
    return DatasetIndex(
        format=m.format,
        kind=m.sample_kind,
        shard_names=[s.name for s in m.shards],
        shard_bytes=shard_bytes,
        starts=starts,
        keys=m.keys,
        labels=m.column("label"),
        offsets=offsets,
        sizes=sizes,
        classes=list(m.classes),
        manifest=m,
        image_shape=m.image_shape,
        span_fields=tuple(span_fields),
    )


def index_from_folder(root: str, fs: Any | None = None) -> DatasetIndex:
    """List an ImageFolder tree (local path, or ``root`` on fsspec filesystem ``fs``).

    Classes are the sorted sub-directory names; files are sorted within a class; keys are
    ``<class>/<file stem>``. Raises :class:`SourceNotFoundError` / :class:`SourceError`.
    """
    entries: list[tuple[str, int, int]] = []  # (relative path, label, size)
    if fs is None:
        if not os.path.isdir(root):
            raise SourceNotFoundError(f"{root}: no such directory (expected a packed directory or an ImageFolder tree)")
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        for label, c in enumerate(classes):
            with os.scandir(os.path.join(root, c)) as it:
                files = sorted(
                    (e.name, e.stat().st_size)
                    for e in it
                    if e.is_file() and e.name.lower().endswith(IMAGE_EXTS) and not e.name.startswith(".")
                )
            entries += [(f"{c}/{name}", label, size) for name, size in files]
    else:
        base = root.rstrip("/")
        if not fs.isdir(base):
            raise SourceNotFoundError(f"{root}: no such directory on {type(fs).__name__}")
        found = fs.find(base, detail=True)
        by_class: dict[str, list[tuple[str, int]]] = {}
        stripped = fs._strip_protocol(base)
        for path, info in found.items():
            rel = path[len(stripped) :].lstrip("/") if path.startswith(stripped) else path
            parts = rel.split("/")
            if len(parts) != 2 or not parts[1].lower().endswith(IMAGE_EXTS) or parts[1].startswith("."):
                continue
            by_class.setdefault(parts[0], []).append((parts[1], int(info.get("size") or 0)))
        classes = sorted(by_class)
        for label, c in enumerate(classes):
            entries += [(f"{c}/{name}", label, size) for name, size in sorted(by_class[c])]
    if not entries:
        raise SourceError(f"{root}: no images found (expected {root}/<class>/<image>) and no manifest.json")
    n = len(entries)
    sizes = np.array([e[2] for e in entries], dtype=np.int64)
    return DatasetIndex(
        format="folder",
        kind="encoded",
        shard_names=[e[0] for e in entries],
        shard_bytes=sizes.copy(),
        starts=np.arange(n + 1, dtype=np.int64),
        keys=[os.path.splitext(e[0])[0] for e in entries],
        labels=np.array([e[1] for e in entries], dtype=np.int64),
        offsets=np.zeros(n, dtype=np.int64),
        sizes=sizes,
        classes=classes,
    )

"""LMDB environments (Caffe Datums, pickled samples) adopted in place: the ``data.mdb`` file is the shard.

``stager index`` records each sample's image bytes as a byte range of ``data.mdb``
(:mod:`stager.formats.lmdb_pages`, :mod:`stager.formats.lmdb_values`), so readers need neither
liblmdb nor the lock file: encoded images (Datums with ``encoded``, pickled bytes) are read like tar
members (``pread`` or slices of the mapping, ``sample_kind: "encoded"``), raw Datums are read the
same way and turned from planar BGR into ``(H, W, C)`` RGB arrays by :func:`stager.decode.planar
.planar_batch_to_hwc` (``sample_kind: "decoded"``). A staged ``data.mdb`` is one file; opened by LMDB
itself elsewhere it still is a valid read-only environment (``lmdb.open(dir, readonly=True,
lock=False)``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from stager.decode.planar import planar_batch_to_hwc, planar_rows_to_hwc
from stager.errors import CorruptSampleError, UsageError
from stager.formats.base import ExtentReader, Format, Sample, indexed_samples
from stager.formats.registry import format_spec
from stager.manifest import Manifest, ShardInfo

GAP = 64 << 10  # values further apart than this are read separately (as the loader's MAX_GAP)


def raw_shapes(info: ShardInfo, manifest: Manifest | None) -> np.ndarray:
    """``(samples, 3)`` int64 ``(C, H, W)`` of a raw-Datum shard: its ``shape`` column, else the fixed
    ``image_shape`` (H, W, C) of the manifest."""
    cols = getattr(info, "columns", None) or {}
    if "shape" in cols:
        return np.asarray(cols["shape"], dtype=np.int64).reshape(-1, 3)
    if manifest is None or manifest.image_shape is None:
        raise UsageError(f"{info.name}: raw Datums without a shape column or image_shape; re-run `stager index`")
    h, w, c = manifest.image_shape
    return np.tile(np.array([c, h, w], dtype=np.int64), (info.samples, 1))


class LmdbShardReader(ExtentReader):
    """Payloads at the manifest's byte extents in ``data.mdb``; raw Datums come back as ``(H, W, C)`` RGB."""

    def __init__(self, path: str, info: ShardInfo | None = None, manifest: Manifest | None = None) -> None:
        super().__init__(path, info, manifest)
        self.manifest = manifest
        self.decoded = manifest is not None and manifest.sample_kind == "decoded"
        self._shapes: np.ndarray | None = None

    def read(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        if not self.decoded:
            return super().read(positions)
        assert self.info is not None
        if self._shapes is None:
            self._shapes = raw_shapes(self.info, self.manifest)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        shapes = self._shapes[pos]
        try:
            if len(pos) and (shapes == shapes[0]).all():  # one shape: the whole run as one array
                c, h, w = (int(x) for x in shapes[0])
                return list(planar_rows_to_hwc(self._rows(pos, c * h * w), (c, h, w)))
            return planar_batch_to_hwc(super().read(pos), [tuple(s) for s in shapes.tolist()])
        except CorruptSampleError as exc:
            raise CorruptSampleError(f"{self.path}: {exc}") from exc

    def _rows(self, pos: np.ndarray, size: int) -> np.ndarray:
        """The ``size``-byte payloads at ``pos`` as an ``(n, size)`` array: one ``pread`` per span of
        nearby values, and a strided view of the span where the values lie at one stride (a raw Datum
        over LMDB's size limit fills one overflow page each: a page apart), else one slice each."""
        assert self.info is not None
        offs = self.info.offsets[pos]
        order = np.argsort(offs, kind="stable")
        so = offs[order]
        out = np.empty((len(pos), size), dtype=np.uint8)
        cut = np.flatnonzero(np.diff(so) > size + GAP) + 1
        for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(so)], strict=True):
            start, end = int(so[a]), int(so[b - 1]) + size
            buf = os.pread(self.fd(), end - start, start)
            if len(buf) < end - start:
                raise CorruptSampleError(f"short read: wanted {end - start} bytes at {start}, got {len(buf)}; the "
                                         "data.mdb is truncated: re-stage it")
            arr = np.frombuffer(buf, dtype=np.uint8)
            rel = so[a:b] - start
            steps = np.diff(rel)
            if b - a > 1 and (steps == steps[0]).all():
                rows = np.lib.stride_tricks.as_strided(arr[int(rel[0]) :], (b - a, size), (int(steps[0]), 1))
            else:
                rows = np.stack([arr[r : r + size] for r in rel.tolist()])
            out[order[a:b]] = rows
        return out

    def iter_samples(self) -> Iterator[Sample]:
        """The indexed samples in order, payloads read by :meth:`read` (keys and labels from the index)."""
        return indexed_samples(self, "LMDB")


class LmdbFormat(Format):
    """LMDB ``data.mdb`` files adopted by ``stager index`` (reader only)."""

    spec = format_spec("lmdb")
    reader = LmdbShardReader

    def shard_name(self, index: int) -> str:
        return "data.mdb"  # an environment's one data file


FORMAT = LmdbFormat()

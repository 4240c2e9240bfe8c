"""Samples with fields in a zarr shard (docs/fields.md): one array per field, ragged ones with offsets.

In the shard's group, beside ``images`` (N, H, W, C) and ``labels``::

    fields/<name>/rows       mask: (N, H, W) uint8, decoded class ids, the image's geometry;
                             image: (N, H', W', 3) uint8, decoded (one shape per shard)
    fields/<name>/values     boxes: (M, 4) float32; box_labels: (M,) int64; per_box: (M, *item)
    fields/<name>/data       array / json / bytes: the stored bytes (.npy, UTF-8 JSON, the file), uint8
    fields/<name>/offsets    (N + 1,) int64: sample i's rows / values / bytes are [o[i], o[i+1])

Each ``fields/<name>`` group has the attributes ``kind`` and
``ext``. The manifest's field extents (``field/<name>/offset|size``) are, as for zarr's images, the
row and its byte count for decoded kinds, and the byte range inside ``data`` for byte kinds.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from stager.errors import SourceError
from stager.manifest.fields import FieldSpec

DECODED_KINDS = frozenset({"mask", "image"})


def decode_field(spec: FieldSpec, data: Any, key: str) -> np.ndarray:
    """A mask PNG as (H, W) uint8, another image as (H, W, 3) uint8; SourceError naming ``key``."""
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded)

    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            arr = np.asarray(im if spec.kind == "mask" else im.convert("RGB"))
    except (OSError, SyntaxError, ValueError) as exc:
        raise SourceError(f"{key}: field {spec.name!r}: cannot decode ({exc})") from exc
    if spec.kind == "mask" and arr.ndim == 3:
        arr = arr[..., 0]
    return np.ascontiguousarray(arr, dtype=np.uint8)


class ZarrFields:
    """Collects the fields of a shard's samples, then writes them into its group on close."""

    def __init__(self, specs: Sequence[FieldSpec]) -> None:
        self.specs = list(specs)
        self._values: dict[str, list[Any]] = {s.name: [] for s in specs}
        self._ends: dict[str, int] = {s.name: 0 for s in specs}

    def add(self, key: str, fields: dict[str, Any], row: int, image_hw: tuple[int, int]) -> dict[str, tuple[int, int]]:
        """Keep one sample's fields; the byte fields' extents (row and size, or range in ``data``)."""
        out: dict[str, tuple[int, int]] = {}
        for s in self.specs:
            if s.name not in fields:
                raise SourceError(f"{key}: lacks field {s.name!r}")
            v = fields[s.name]
            vals = self._values[s.name]
            if s.ragged:
                vals.append(np.asarray(v, dtype=s.dtype).reshape((-1, *s.item)))
            elif s.kind in DECODED_KINDS:
                arr = decode_field(s, v, key)
                if s.kind == "mask" and arr.shape[:2] != image_hw:
                    raise SourceError(f"{key}: mask {s.name!r} is {arr.shape[1]}x{arr.shape[0]}, the image "
                                      f"{image_hw[1]}x{image_hw[0]}; zarr stores them decoded, in one geometry")
                if vals and arr.shape != vals[0].shape:
                    raise SourceError(f"{key}: field {s.name!r} has shape {arr.shape}, the shard's {vals[0].shape}; "
                                      "zarr needs one shape per field (pack with --resize)")
                vals.append(arr)
                out[s.name] = (row, arr.size)
            else:
                b = bytes(v)
                vals.append(b)
                out[s.name] = (self._ends[s.name], len(b))
                self._ends[s.name] += len(b)
        return out

    def write(self, group: Any, n: int) -> None:
        """The ``fields/<name>`` arrays (see the module docstring) into the zarr group."""
        for s in self.specs:
            g = group.create_group(f"fields/{s.name}", attributes={"kind": s.kind, "ext": s.ext})
            vals = self._values[s.name]
            if s.ragged:
                arr = np.concatenate(vals) if vals else np.zeros((0, *s.item), dtype=s.dtype)
                _array(g, "values", arr)
                lens = [len(v) for v in vals]
            elif s.kind in DECODED_KINDS:
                arr = np.stack(vals) if vals else np.zeros((0, 1, 1), dtype=np.uint8)
                _array(g, "rows", arr)
                lens = [1] * n
            else:
                _array(g, "data", np.frombuffer(b"".join(vals), dtype=np.uint8))
                lens = [len(v) for v in vals]
            _array(g, "offsets", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
            vals.clear()


def _array(group: Any, name: str, arr: np.ndarray) -> None:
    from zarr.codecs import Crc32cCodec  # noqa: PLC0415 (zarr is imported only for the zarr format)

    chunks = (max(1, arr.shape[0]), *arr.shape[1:]) if arr.ndim else ()
    a = group.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=chunks, filters=None,
                           compressors=[Crc32cCodec()], fill_value=0)
    if arr.size:
        a[...] = arr


def read_field(group: Any, spec_kind: str, name: str, offset: int, size: int) -> Any:
    """One sample's field from a shard's group, by its manifest extent: a decoded row (mask/image) or
    the bytes of a byte field."""
    if spec_kind in DECODED_KINDS:
        return np.asarray(group[f"fields/{name}/rows"][offset])
    return np.asarray(group[f"fields/{name}/data"][offset : offset + size]).tobytes()

"""Batch assembly into caller-given numpy memory: the part both transports share (no torch here).

The torch transport (:mod:`stager.loader.batching`) allocates its buffers as shared tensors or ring
slots, the numpy transport (:mod:`stager.loader.numpy_loader`) as plain arrays; both fill them with
these functions, so a batch's bytes and layout do not depend on the transport.

* :func:`image_shape` / :func:`copy_images`: (H, W, C) uint8 samples (2-D ones get C = 1) into one
  (B, H, W, C) array, one ``memcpy`` per sample;
* :func:`raw_offsets` / :func:`copy_raw`: bytes-like payloads back to back into one uint8 buffer,
  delimited by int64 offsets of shape (B + 1,); :func:`raw_views` slices them apart again.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np


def _hwc(item: Any) -> np.ndarray:
    a = np.asarray(item)
    return a[:, :, None] if a.ndim == 2 else a


def image_shape(items: Sequence[Any]) -> tuple[int, ...]:
    """``(H, W, C)`` of the first sample, or ``(T, H, W, C)`` of the first clip (a clip pack's items):
    the batch's item shape; every item must match it."""
    return tuple(int(x) for x in _hwc(items[0]).shape)


def copy_images(items: Sequence[Any], dst: np.ndarray) -> None:
    """Copy each (H, W, C) sample (or (T, H, W, C) clip) into ``dst[i]`` (``dst``: uint8 (B, H, W, C) or
    (B, T, H, W, C)); a mismatched shape is an error."""
    for i, it in enumerate(items):
        a = _hwc(it)
        if a.shape != dst.shape[1:]:
            raise ValueError(
                f"sample {i} has shape {a.shape}, expected {dst.shape[1:]}: use a transform with a fixed size"
            )
        dst[i] = a


def stack_nhwc(items: Sequence[Any]) -> np.ndarray:
    """The samples as one new uint8 array of shape (B, H, W, C) (clips: (B, T, H, W, C); B = 0: shape
    (0, 0, 0, 3))."""
    if not items:
        return np.zeros((0, 0, 0, 3), dtype=np.uint8)
    out = np.empty((len(items), *image_shape(items)), dtype=np.uint8)
    copy_images(items, out)
    return out


def byte_views(items: Sequence[Any]) -> list[memoryview]:
    """Each payload as a flat unsigned-byte ``memoryview`` (no copy)."""
    views = [it if isinstance(it, memoryview) else memoryview(it) for it in items]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def raw_offsets(views: Sequence[memoryview]) -> np.ndarray:
    """int64 offsets (B + 1,) of the payloads laid back to back."""
    offsets = np.zeros(len(views) + 1, dtype=np.int64)
    np.cumsum([len(v) for v in views], out=offsets[1:])
    return offsets


def copy_raw(views: Sequence[memoryview], offsets: np.ndarray, dst: np.ndarray) -> None:
    """Copy payload ``i`` to ``dst[offsets[i]:offsets[i + 1]]`` (``dst``: flat uint8 of ``offsets[-1]`` bytes)."""
    total = int(offsets[-1])
    out = memoryview(dst.data).cast("B") if total else memoryview(b"")
    for v, a, b in zip(views, offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        out[a:b] = v


def pack_raw_numpy(items: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(data, offsets)``: the payloads in one new uint8 array, and their int64 offsets (B + 1,)."""
    views = byte_views(items)
    offsets = raw_offsets(views)
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    copy_raw(views, offsets, data)
    return data, offsets


def raw_views(data: Any, offsets: Sequence[int] | np.ndarray) -> list[memoryview]:
    """Per-sample ``memoryview`` slices of a raw batch buffer (a uint8 array or anything with ``.numpy()``)."""
    off = np.asarray(offsets).tolist()
    if not off or off[-1] == 0:
        return [memoryview(b"")] * max(0, len(off) - 1)
    arr = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
    mv = memoryview(arr.data).cast("B")
    return [mv[a:b] for a, b in itertools.pairwise(off)]

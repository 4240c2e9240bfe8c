"""Batch assembly inside a worker, into tensors that cross processes through shared memory.

A torch DataLoader worker sends a tensor to the main process by moving its storage into shared
memory and pickling only a handle, while a list of ``bytes`` is pickled byte by byte. So a batch is
built as few large tensors:

* decoded: ``image`` is one preallocated uint8 tensor of shape (B, C, H, W) whose memory is laid out
  channels-last (each sample's (H, W, C) array is one contiguous ``memcpy``; call ``.contiguous()``
  for NCHW memory);
* raw, from a worker: ``data`` is one uint8 tensor holding every payload back to back and
  ``offsets`` (int64, shape (B + 1,)) delimits them; the main process turns them into ``image``, a
  list of ``memoryview`` slices (:func:`raw_views`), without copying. In-process
  (``num_workers=0``) nothing crosses a process boundary, so ``image`` is the list of payload views
  straight from the reads (no copy) and there is no ``data``/``offsets``.

In workers the buffers are allocated in shared memory before they are filled: under
:class:`~stager.loader.Loader`, in the worker's ring of reused slots (:mod:`stager.loader.shm`: the
batch travels as a name and reaches the main process as a tensor over the slot; decoded images
then arrive as ``image_nhwc`` and :func:`finish_batch` permutes them); for a ``ShardedDataset`` in
a user's own DataLoader, as torch shared tensors.

Every batch also carries ``key`` (list[str]) and ``label`` (int64 tensor, shape (B,)). The copying
itself is :mod:`stager.loader.assemble`'s, shared with the numpy transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stager.loader.assemble import byte_views, copy_images, copy_raw, image_shape, raw_offsets, raw_views
from stager.loader.shm import WorkerRing, check_batch

__all__ = ["finish_batch", "pack_raw", "raw_views", "stack_images"]


def _empty(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """A uint8 tensor; with ``shared`` it is allocated in shared memory up front, so sending it from
    a worker moves only a handle (torch would otherwise copy the storage into shared memory)."""
    if not shared:
        return torch.empty(shape, dtype=torch.uint8)
    # Allocate straight in shared memory (share_memory_() on a fresh tensor would copy it there).
    n = int(np.prod(shape)) if shape else 1
    storage = torch.UntypedStorage._new_shared(max(n, 1))
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat[:n].view(shape)


def stack_images(items: Sequence[Any], shared: bool = False, ring: WorkerRing | None = None) -> Any:
    """Stack (H, W, C) uint8 arrays (or tensors) into a (B, C, H, W) uint8 tensor, channels-last memory;
    (T, H, W, C) clips into a (B, T, C, H, W) tensor alike.

    With ``ring``: fill a ring slot instead and return its :class:`~stager.loader.shm.ShmRef`
    (shape (B, H, W, C) or (B, T, H, W, C); the receiver permutes, see :func:`finish_batch`).
    """
    if not items:
        return torch.zeros((0, 3, 0, 0), dtype=torch.uint8)
    shape = (len(items), *image_shape(items))
    ref = None
    if ring is not None:
        flat, ref = ring.acquire(int(np.prod(shape)), shape)
        dst = flat.reshape(shape)
    else:
        out = _empty(shape, shared)
        dst = out.numpy()
    copy_images(items, dst)
    if ref is not None:
        return ref
    return channels_first(out)


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) -> (B, C, H, W), (B, T, H, W, C) -> (B, T, C, H, W): a view, channels-last memory."""
    return x.permute(0, 3, 1, 2) if x.dim() == 4 else x.permute(0, 1, 4, 2, 3)


def pack_raw(items: Sequence[Any], shared: bool = False, ring: WorkerRing | None = None) -> tuple[Any, np.ndarray]:
    """Copy bytes-like payloads (or arrays) into one uint8 buffer; return ``(data, offsets)``.

    ``data``: a uint8 tensor, or with ``ring`` the :class:`~stager.loader.shm.ShmRef` of the ring
    slot holding the payloads (a uint8 tensor once received). ``offsets`` is an int64 array of
    shape (B + 1,) (a tensor only after :func:`finish_batch`). One ``memcpy`` per payload.
    """
    views = byte_views(items)
    offsets = raw_offsets(views)
    total = int(offsets[-1])
    data: Any
    if ring is not None:
        flat, data = ring.acquire(total, (total,))
    else:
        data = _empty((total,), shared)
        flat = data.numpy()
    copy_raw(views, offsets, flat)
    return data, offsets


def finish_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """In the consuming process: small arrays to tensors, raw buffers to per-sample views (a buffer that could
    not be received raises its error here: :func:`stager.loader.shm.check_batch`)."""
    check_batch(batch)
    for k in ("label", "index", "offsets", "stream"):
        if isinstance(batch.get(k), np.ndarray):
            batch[k] = torch.from_numpy(batch[k])
    if "image_nhwc" in batch:
        batch["image"] = channels_first(batch.pop("image_nhwc"))
    if "data" in batch:
        batch["image"] = raw_views(batch["data"], batch["offsets"])
    for name, kind in batch.pop("_fields", {}).items():
        batch[name] = field_tensors(batch[name], kind)
    return batch


def field_tensors(value: Any, kind: str) -> Any:
    """A field's batch entry as tensors (docs/fields.md): stacked arrays -> one tensor (images (B, 3, H, W)),
    lists of arrays -> lists of tensors; JSON objects and bytes unchanged."""
    if isinstance(value, np.ndarray):
        t = torch.from_numpy(value)
        if kind == "image" and t.ndim in (4, 5):  # (B, H, W, 3), or a clip's (B, T, H, W, 3)
            return t.movedim(-1, -3)
        return t
    if kind in ("boxes", "box_labels", "per_box", "array"):
        # A clip pack's per-frame values are a list of B lists of T arrays (docs/clips.md).
        return [field_tensors(v, kind) if isinstance(v, list) else torch.from_numpy(np.ascontiguousarray(v))
                for v in value]
    return value

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

In workers the tensors are allocated in shared memory before they are filled.

Every batch also carries ``key`` (list[str]) and ``label`` (int64 tensor, shape (B,)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


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


def stack_images(items: Sequence[Any], shared: bool = False) -> torch.Tensor:
    """Stack (H, W, C) uint8 arrays (or tensors) into a (B, C, H, W) uint8 tensor, channels-last memory."""
    if not items:
        return torch.zeros((0, 3, 0, 0), dtype=torch.uint8)
    first = np.asarray(items[0])
    if first.ndim == 2:
        first = first[:, :, None]
    h, w, c = first.shape
    out = _empty((len(items), h, w, c), shared)
    dst = out.numpy()
    for i, it in enumerate(items):
        a = np.asarray(it)
        if a.ndim == 2:
            a = a[:, :, None]
        if a.shape != (h, w, c):
            raise ValueError(f"sample {i} has shape {a.shape}, expected {(h, w, c)}: use a transform with a fixed size")
        dst[i] = a
    return out.permute(0, 3, 1, 2)


def pack_raw(items: Sequence[Any], shared: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """Copy bytes-like payloads (or arrays) into one uint8 tensor; return ``(data, offsets)``.

    ``offsets`` is an int64 array of shape (B + 1,) (a tensor only after :func:`finish_batch`).
    """
    lens = [memoryview(it).nbytes for it in items]
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    data = _empty((int(offsets[-1]),), shared)
    dst = data.numpy()
    for i, it in enumerate(items):
        dst[offsets[i] : offsets[i + 1]] = np.frombuffer(memoryview(it).cast("B"), dtype=np.uint8)
    return data, offsets


def finish_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """In the consuming process: small arrays to tensors, raw buffers to per-sample views."""
    for k in ("label", "index", "offsets"):
        if isinstance(batch.get(k), np.ndarray):
            batch[k] = torch.from_numpy(batch[k])
    if "data" in batch:
        batch["image"] = raw_views(batch["data"], batch["offsets"])
    return batch


def raw_views(data: torch.Tensor, offsets: torch.Tensor) -> list[memoryview]:
    """Per-sample ``memoryview`` slices of a raw batch buffer (no copy)."""
    mv = memoryview(data.numpy().data).cast("B")
    off = offsets.tolist()
    return [mv[off[i] : off[i + 1]] for i in range(len(off) - 1)]

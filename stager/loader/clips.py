"""Clip packs in the loader (docs/clips.md): the item space of windows and the clip function.

:func:`item_space` gives :class:`~stager.loader.rank.RankDataset` what its plan deals out: samples
(:class:`~stager.order.items.SampleItems`) or, for a pack with a ``clips`` entry, the windows derived
from its ``clip/seq`` and ``clip/frame`` columns (:class:`~stager.order.windows.Windows`). A worker
then reads frames and hands each window's T payloads, in frame order, to :class:`ClipFn`, which
returns one ``(T, H, W, 3)`` uint8 array: ``transform="train"`` draws one random-resized crop and one
flip per clip and applies them to every frame (``stager.decode.decode_clip_random_resized_crop``:
one draw, each frame decoded only as far as the box needs); ``"eval"`` center-crops every frame;
``None`` gives the frames at their stored size; a callable gets the ``(T, H, W, 3)`` array and the
generator. :func:`clip_meta` adds ``sequence`` (list[str]) and ``start_frame`` (int64 (B,)) to a batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.loader.dataset_index import DatasetIndex
from stager.loader.transforms import SampleFn
from stager.manifest.clips import FRAME_COLUMN, clip_columns, clip_spec, shard_groups
from stager.order.items import ItemSpace, SampleItems
from stager.order.windows import find_windows


def item_space(index: DatasetIndex) -> ItemSpace:
    """The items of ``index``: its windows for a clip pack, else its samples."""
    m = index.manifest
    spec = clip_spec(m) if m is not None else None
    if m is None or spec is None:
        return SampleItems(index.starts)
    seq, frame = clip_columns(m)
    return find_windows(
        seq, frame, index.starts, length=spec.length, stride=spec.stride, step=spec.frame_step
    )


def item_shard_groups(index: DatasetIndex) -> np.ndarray | None:
    """Shards that must stay on one node together (a clip pack's continued sequences), or None."""
    return shard_groups(index.manifest) if index.manifest is not None else None


class ClipFn:
    """``f(payloads, rng) -> (T, H, W, 3) uint8``: one window's T frame payloads decoded alike."""

    def __init__(self, sample_fn: SampleFn) -> None:
        if sample_fn.decode != "uint8":
            raise UsageError(f"clip packs are read with decode='uint8', got decode={sample_fn.decode!r}")
        self.transform = sample_fn.transform
        self.frame_fn = SampleFn("uint8", "eval" if sample_fn.transform == "eval" else None,
                                 sample_fn.size, sample_fn.kind)
        self.train_fn = SampleFn("uint8", "train", sample_fn.size, sample_fn.kind)
        self._raw = SampleFn("uint8", _full_frame, sample_fn.size, sample_fn.kind)

    def __call__(self, payloads: list[Any], rng: np.random.Generator) -> np.ndarray:
        t = self.transform
        if t == "train":
            # One crop geometry and one flip for the whole clip, drawn once (decoded frame by frame
            # as far as the box needs, straight into one (T, S, S, 3) array).
            mod = self.train_fn._decoder()
            if mod and self.train_fn.kind == "encoded":
                return mod.decode_clip_random_resized_crop(payloads, self.train_fn.size, rng)
            state = int(rng.integers(0, 2**63 - 1))  # fallbacks: every frame replays one generator state
            frames = [self.train_fn(p, np.random.default_rng(state)) for p in payloads]
        elif t == "eval":
            frames = [self.frame_fn(p, rng) for p in payloads]
        else:
            frames = [self._raw(p, rng) for p in payloads]
        clip = np.stack(frames)
        return t(clip, rng) if callable(t) else clip


def _full_frame(arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The decoded frame at its stored size (transform=None)."""
    return arr


def clip_meta(index: DatasetIndex, first_frames: np.ndarray) -> dict[str, Any]:
    """A clip batch's ``sequence`` names (from the keys ``[<class>/]<sequence>/<frame>``) and
    ``start_frame`` numbers (int64 (B,)) of each window's first frame (global sample ids)."""
    m = index.manifest
    assert m is not None
    keys = index.keys
    take = getattr(keys, "take", None)
    names = take(first_frames.tolist()) if take is not None else [keys[i] for i in first_frames.tolist()]
    frames = np.asarray(m.extra_columns()[FRAME_COLUMN])[first_frames].astype(np.int64)
    return {"sequence": [k.rsplit("/", 1)[0] for k in names], "start_frame": frames}

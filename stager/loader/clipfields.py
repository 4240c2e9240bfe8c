"""Clip packs with fields per frame (docs/clips.md, "Fields per frame"): one geometry per clip.

A window's T frames each carry the pack's fields (a class-id mask, boxes and their labels, ...), as
any sample with fields does (:mod:`stager.loader.fields`). :class:`ClipFieldsFn` reads each frame's
image and raw fields with the dataset's :class:`~stager.loader.fields.FieldsSampleFn`, takes **one**
geometry for the clip (``transform="train"``: one random-resized crop box and one flip coin, drawn
from the first frame's size; frames of a sequence share one size, checked at pack time) and applies it
to every frame, its masks and its boxes. The clip's dict holds:

* ``image``: (T, S, S, 3) uint8; masks and other ``image`` fields: (T, S, S) / (T, S, S, 3) uint8;
* ``boxes``, ``box_labels``, ``per_box``, arrays, JSON and bytes: a list of T per-frame values
  (boxes clipped to the crop and dropped with their per-box entries as for images).

Batched by :func:`~stager.loader.fields.assemble_fields`: masks (B, T, S, S), boxes a list of B lists
of T float32 (n, 4) arrays. A callable transform receives the clip decoded and untransformed
(``image`` (T, H, W, 3), masks (T, H, W), boxes a list of T (n, 4) arrays, ...) and the generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.loader.fields import FieldsSampleFn


class ClipFieldsFn:
    """``f(payloads, rng, frame_ids) -> dict``: one window's T frames with their fields, one geometry."""

    def __init__(self, fields_fn: FieldsSampleFn) -> None:
        # transform=None is the fields' convention (the eval resize + center crop, docs/fields.md), not
        # the plain clips' stored size: masks and boxes need one output size to batch.
        self.fields_fn = fields_fn
        self.stacked = {"image"} | {s.name for s in fields_fn.specs if s.kind in ("mask", "image")}

    def __call__(self, payloads: Sequence[Any], rng: np.random.Generator, frame_ids: Sequence[int]) -> dict[str, Any]:
        fn = self.fields_fn
        frames = [fn.raw(p, int(gid)) for p, gid in zip(payloads, frame_ids, strict=True)]
        if callable(fn.transform):
            return dict(fn.transform(stack_clip([fn._decoded(im, raw) for im, raw in frames], self.stacked), rng))
        g, _ = fn.geometry(frames[0][0], rng)
        return stack_clip([fn.with_geometry(im, raw, g) for im, raw in frames], self.stacked)


def stack_clip(frames: Sequence[dict[str, Any]], stacked: set[str]) -> dict[str, Any]:
    """Per-frame sample dicts -> one clip dict: the ``stacked`` names (image, masks, other images)
    as (T, ...) arrays, every other field a list of T values."""
    if not frames:
        raise UsageError("a clip has no frames")
    return {name: np.stack([f[name] for f in frames]) if name in stacked else [f[name] for f in frames]
            for name in frames[0]}

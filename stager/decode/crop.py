"""Crop geometry shared by every decode backend: pure functions of image size and an RNG.

Boxes are ``(top, left, height, width)`` in pixels of the *original* image. Keeping the geometry
separate from decoding is what lets a backend pick the crop from the header alone and then decode
only what the crop needs (a reduced-size DCT scale, the rows above the crop's bottom edge).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from stager.errors import UsageError

Box = tuple[int, int, int, int]  # (top, left, height, width)


def check_crop_args(size: int, scale: Sequence[float], ratio: Sequence[float]) -> None:
    """Raise UsageError for parameters torchvision's RandomResizedCrop would also reject."""
    if int(size) != size or size <= 0:
        raise UsageError(f"crop size must be a positive integer, got {size!r}")
    if len(scale) != 2 or not 0 < scale[0] <= scale[1]:
        raise UsageError(f"scale must be (min, max) with 0 < min <= max, got {tuple(scale)!r}")
    if len(ratio) != 2 or not 0 < ratio[0] <= ratio[1]:
        raise UsageError(f"ratio must be (min, max) with 0 < min <= max, got {tuple(ratio)!r}")


def random_resized_crop_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> Box:
    """torchvision ``RandomResizedCrop.get_params`` on an ``height x width`` image, drawn from ``rng``.

    Up to 10 attempts: area fraction ~ U(scale), log aspect (w/h) ~ U(log ratio); the first box that
    fits is placed uniformly. Otherwise the central fallback: the whole image, clamped to the ratio
    range. Each attempt consumes two draws, a success two more, so a given ``rng`` state always
    yields the same box.
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w = width
        h = max(1, round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        h = height
        w = max(1, round(h * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_shape(height: int, width: int, resize: int) -> tuple[int, int]:
    """Shape after torchvision ``Resize(resize)``: shorter side -> ``resize``, longer side truncated."""
    if height <= width:
        return resize, int(resize * width / height)
    return int(resize * height / width), resize


def center_crop_box(height: int, width: int, size: int, resize: int) -> tuple[float, float, float, float]:
    """Source region of ``Resize(resize)`` then ``CenterCrop(size)``, in original pixels (floats).

    Returns ``(top, left, box_height, box_width)``; resizing exactly that region to ``size x size``
    equals resizing the whole image and then center-cropping, up to interpolation at the edges.
    """
    rh, rw = resized_shape(height, width, resize)
    top = round((rh - size) / 2.0)
    left = round((rw - size) / 2.0)
    sy, sx = height / rh, width / rw
    return top * sy, left * sx, size * sy, size * sx


def default_resize(size: int) -> int:
    """The standard ImageNet eval ratio: shorter side resized to ``round(size / 0.875)`` (224 -> 256)."""
    return round(size / 0.875)

"""Per-sample decoding and augmentation, wrapping :mod:`stager.decode`.

``make_sample_fn(decode, transform, image_size, kind)`` returns ``f(payload, rng) -> item``:

* ``decode="raw"``: the payload's bytes untouched (no decoding, no transform);
* ``decode="pil"``: a ``PIL.Image`` in RGB (``transform``, if callable, is applied to it);
* ``decode="uint8"``: an ``(H, W, 3)`` uint8 array of a fixed shape so batches can be stacked:
  ``transform="train"`` = random-resized crop + flip to ``image_size``; ``"eval"`` = resize to
  ``round(image_size / 0.875)`` then center crop; ``None`` = ``"eval"`` for encoded datasets and the
  stored arrays unchanged for decoded ones (zarr; the packer fixed their shape); a callable gets the
  decoded ``(H, W, 3)`` uint8 array and an ``numpy.random.Generator`` and returns an array (or
  tensor) of one fixed ``(H, W, C)`` shape.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from stager.errors import UsageError

DECODE_MODES = ("uint8", "raw", "pil")


def _decode_module() -> Any:
    try:
        from stager import decode as mod  # noqa: PLC0415 (decoders load PIL/OpenCV: only in processes that decode)
    except ImportError:
        return None
    return mod


def _pil_rgb(data: Any) -> Any:
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB") if img.mode != "RGB" else img


def _resize_center_crop(img: Any, size: int, resize: int | None = None) -> np.ndarray:
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    resize = resize or round(size / 0.875)
    w, h = img.size
    scale = resize / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.asarray(img.crop((left, top, left + size, top + size)))


def _random_resized_crop(
    img: Any,
    size: int,
    rng: np.random.Generator,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
) -> np.ndarray:
    """torchvision's RandomResizedCrop (10 tries, then a center crop of clamped ratio) on a PIL image."""
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

    w, h = img.size
    area = w * h
    box = None
    for _ in range(10):
        target = area * rng.uniform(*scale)
        ar = float(np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1]))))
        cw, ch = round((target * ar) ** 0.5), round((target / ar) ** 0.5)
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            box = (x, y, x + cw, y + ch)
            break
    if box is None:
        in_ratio = w / h
        if in_ratio < ratio[0]:
            cw, ch = w, round(w / ratio[0])
        elif in_ratio > ratio[1]:
            cw, ch = round(h * ratio[1]), h
        else:
            cw, ch = w, h
        x, y = (w - cw) // 2, (h - ch) // 2
        box = (x, y, x + cw, y + ch)
    out = img.resize((size, size), Image.Resampling.BILINEAR, box=box)
    if flip and rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def decoder_backend() -> str:
    mod = _decode_module()
    return str(mod.backend()) if mod is not None else "PIL (stager.loader fallback)"


class SampleFn:
    """Picklable per-sample function (workers may be started with spawn/forkserver)."""

    def __init__(self, decode: str, transform: Any, image_size: int, kind: str) -> None:
        self.decode, self.transform, self.size, self.kind = decode, transform, image_size, kind
        self._mod: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_mod": None}

    @property
    def passes_through(self) -> bool:
        """Whether every payload comes out unchanged (raw bytes; stored arrays without a transform),
        so that a batch needs no per-sample call at all."""
        return self.decode == "raw" or (self.kind == "decoded" and self.decode == "uint8" and self.transform is None)

    def _decoder(self) -> Any:
        if self._mod is None:
            self._mod = _decode_module() or False
        return self._mod

    def __call__(self, payload: Any, rng: np.random.Generator) -> Any:
        t, size = self.transform, self.size
        if self.decode == "raw":
            return payload
        if self.kind == "decoded":
            if t is None and self.decode == "uint8":  # the stored arrays as they are: no import per sample
                return payload
            from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or re-encoded)

            if self.decode == "pil":
                img = Image.fromarray(payload)
                return t(img) if callable(t) else img
            if t is None:
                return payload
            if t == "train":
                return _random_resized_crop(Image.fromarray(payload), size, rng)
            if t == "eval":
                return _resize_center_crop(Image.fromarray(payload), size)
            return t(payload, rng)
        if self.decode == "pil":
            img = _pil_rgb(payload)
            return t(img) if callable(t) else img
        mod = self._decoder()
        if t == "train":
            if mod:
                return mod.decode_random_resized_crop(bytes(payload), size, rng)
            return _random_resized_crop(_pil_rgb(payload), size, rng)
        if t is None or t == "eval":
            if mod:
                return mod.decode_center_crop(bytes(payload), size)
            return _resize_center_crop(_pil_rgb(payload), size)
        arr = mod.decode_rgb(bytes(payload)) if mod else np.asarray(_pil_rgb(payload))
        return t(arr, rng)


def make_sample_fn(decode: str, transform: Any, image_size: int, kind: str) -> SampleFn:
    """Build the per-sample function (see module docstring). ``kind``: "encoded" or "decoded"."""
    if decode not in DECODE_MODES:
        raise UsageError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
    if transform not in (None, "train", "eval") and not callable(transform):
        raise UsageError(f"transform must be None, 'train', 'eval' or a callable, got {transform!r}")
    if image_size < 1:
        raise UsageError(f"image_size must be >= 1, got {image_size}")
    return SampleFn(decode, transform, image_size, kind)

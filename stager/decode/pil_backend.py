"""The reference backend: Pillow, step for step what torchvision's PIL transforms do.

Reads everything Pillow reads (JPEG of any flavour incl. CMYK/YCCK, PNG with alpha or a palette,
16-bit grayscale, GIF, TIFF, WebP, BMP ...) and always returns RGB uint8. It is also the fallback
the fast backend uses for anything that is not a plain 8-bit YCbCr/gray JPEG.

Pixels are not rotated by EXIF orientation and alpha is dropped, not composited, exactly as
``Image.open(f).convert("RGB")`` in torchvision's ``default_loader``.
"""

from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
from PIL import Image

from stager.decode.base import Probe
from stager.decode.crop import Box, resized_shape
from stager.errors import CorruptSampleError

# Pillow warns between MAX_IMAGE_PIXELS and twice that and only raises above; we want an error at the
# limit itself. A process-wide filter (not catch_warnings, which is not thread-safe) does that for
# every Image.open in the process; check_pixels() below enforces it even if someone resets filters.
warnings.filterwarnings("error", category=Image.DecompressionBombWarning)

# Anything Pillow's plugins raise on damaged input; mapped to CorruptSampleError.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    struct.error,
    zlib.error,
    Image.DecompressionBombWarning,
)


def describe(data: bytes | bytearray | memoryview) -> str:
    """A short identification of a payload for error messages: size and leading bytes."""
    return f"{len(data)}-byte image starting {bytes(data[:8]).hex()}"


def corrupt(data: bytes | bytearray | memoryview, why: object) -> CorruptSampleError:
    """The one-line error every backend raises for undecodable bytes; the caller adds shard/key."""
    return CorruptSampleError(
        f"cannot decode {describe(data)}: {why}; the sample is damaged: "
        "repack it from the source or load with on_error='skip'"
    )


def check_pixels(data: bytes | bytearray | memoryview, height: int, width: int) -> None:
    """Refuse images larger than ``Image.MAX_IMAGE_PIXELS`` (Pillow's bomb limit) before allocating them."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > limit:
        raise corrupt(
            data,
            f"declares {width}x{height} = {height * width} pixels, over the decompression-bomb limit "
            f"PIL.Image.MAX_IMAGE_PIXELS={limit} (raise that limit if such images are legitimate)",
        )


def open_image(data: bytes | bytearray | memoryview) -> Image.Image:
    """Open (header only, lazy) with the bomb limit enforced as an error; raise CorruptSampleError."""
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise corrupt(data, e) from None
    except DECODE_ERRORS as e:
        raise corrupt(data, f"{type(e).__name__}: {e}") from None
    check_pixels(data, im.height, im.width)
    return im


def load_rgb(im: Image.Image, data: bytes | bytearray | memoryview) -> Image.Image:
    """Decode ``im`` fully and convert to mode RGB (alpha dropped, palette expanded)."""
    try:
        im.load()
        if im.mode == "RGB":
            return im
        if im.mode == "P" and "transparency" in im.info:
            im = im.convert("RGBA")  # avoids Pillow's palette-transparency warning; alpha dropped next
        return im.convert("RGB")
    except DECODE_ERRORS as e:
        raise corrupt(data, f"{type(e).__name__}: {e}") from None


def pil_size(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(height, width)`` from the header via Pillow (lazy open, nothing decoded)."""
    im = open_image(data)
    return im.height, im.width


def pil_decode_rgb(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Full decode to a C-contiguous ``(H, W, 3)`` uint8 array."""
    return np.asarray(load_rgb(open_image(data), data))


class PilDecoder:
    """torchvision-equivalent decode + crop + resize (bilinear, antialiased as Pillow resamples)."""

    name = "pil"

    def probe(self, data: bytes) -> Probe:
        im = open_image(data)
        return Probe(im.height, im.width, im)

    def _image(self, data: bytes, probe: Probe) -> Image.Image:
        im = probe.handle if isinstance(probe.handle, Image.Image) else open_image(data)
        return load_rgb(im, data)

    def decode_rgb(self, data: bytes) -> np.ndarray:
        return pil_decode_rgb(data)

    def crop_resize(self, data: bytes, probe: Probe, box: Box, size: int) -> np.ndarray:
        """``img.crop(box).resize((size, size), BILINEAR)``: torchvision ``F.resized_crop`` on PIL."""
        im = self._image(data, probe)
        top, left, h, w = box
        return np.asarray(im.crop((left, top, left + w, top + h)).resize((size, size), Image.Resampling.BILINEAR))

    def center_crop(self, data: bytes, probe: Probe, size: int, resize: int) -> np.ndarray:
        """``Resize(resize)`` then ``CenterCrop(size)`` as torchvision does it on PIL images."""
        im = self._image(data, probe)
        rh, rw = resized_shape(im.height, im.width, resize)
        im = im.resize((rw, rh), Image.Resampling.BILINEAR)
        top = round((rh - size) / 2.0)
        left = round((rw - size) / 2.0)
        return np.asarray(im.crop((left, top, left + size, top + size)))

    def flip(self, arr: np.ndarray) -> np.ndarray:
        # Pillow's transpose is a C loop; numpy's negative-stride copy of 3-byte pixels is ~10x slower.
        return np.asarray(Image.fromarray(arr).transpose(Image.Transpose.FLIP_LEFT_RIGHT))

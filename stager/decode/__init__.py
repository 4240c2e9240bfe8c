"""Image decoding and the built-in train/eval transforms, as fast as the installed libraries allow.

Public API (the loader calls these per sample)::

    decode_rgb(data) -> (H, W, 3) uint8
    image_size(data) -> (height, width)             # header only, nothing decoded
    decode_random_resized_crop(data, size, rng, scale=(0.08, 1.0), ratio=(3/4, 4/3), flip=True)
        -> (size, size, 3) uint8                    # torchvision RandomResizedCrop + RandomHorizontalFlip
    decode_center_crop(data, size, resize=None) -> (size, size, 3) uint8   # Resize(round(size/0.875)) + CenterCrop
    decode_clip_random_resized_crop(frames, size, rng, ...) -> (T, size, size, 3) uint8   # one crop + flip for T frames
    backend() -> str                                # the backend in use, e.g. "simplejpeg+cv2"

All arrays are C-contiguous RGB uint8 whatever the input (gray, CMYK, palette, alpha). Undecodable
bytes and images over ``PIL.Image.MAX_IMAGE_PIXELS`` raise :class:`stager.errors.CorruptSampleError`.

Backends (registry ``BACKENDS``): ``"fast"`` (simplejpeg/libjpeg-turbo with DCT scaling and row
truncation, cv2 resize), ``"fast-approx"`` (the same with fast IDCT/upsampling) and ``"pil"``
(Pillow, step for step torchvision's PIL transforms). The default is the first importable of
``fast``, ``pil``; override with ``STAGER_DECODE_BACKEND=pil``
(read when the default decoder is first used), :func:`set_backend`, or the ``decoder=`` argument of each function
(:func:`get_decoder` builds one). See docs/decoding.md for the measurements behind the choice.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from stager.decode.base import Decoder, Probe
from stager.decode.crop import Box, check_crop_args, default_resize, random_resized_crop_box
from stager.errors import CorruptSampleError, UsageError, install_hint

__all__ = [
    "BACKENDS",
    "Decoder",
    "Probe",
    "backend",
    "decode_center_crop",
    "decode_clip_random_resized_crop",
    "decode_random_resized_crop",
    "decode_rgb",
    "default_decoder",
    "get_decoder",
    "image_size",
    "set_backend",
]


def _pil() -> Decoder:
    from stager.decode.pil_backend import PilDecoder  # noqa: PLC0415 (Pillow only when a decoder is built)

    return PilDecoder()


def _fast() -> Decoder:
    from stager.decode.fast_backend import FastJpegDecoder  # noqa: PLC0415 (the fast backend needs the optional simplejpeg/OpenCV)

    return FastJpegDecoder()


def _fast_approx() -> Decoder:
    from stager.decode.fast_backend import FastJpegDecoder  # noqa: PLC0415 (the fast backend needs the optional simplejpeg/OpenCV)

    return FastJpegDecoder(fast_dct=True, fast_upsample=True)


# name -> factory; factories raise ImportError when their library is missing. "fast-approx" adds
# libjpeg-turbo's IFAST IDCT and fast upsampling: measured 0-12% faster, twice the deviation from
# the reference path, so it is opt-in (docs/decoding.md).
BACKENDS: dict[str, Callable[[], Decoder]] = {"fast": _fast, "fast-approx": _fast_approx, "pil": _pil}
_PREFERENCE = ("fast", "pil")
ENV_VAR = "STAGER_DECODE_BACKEND"


def get_decoder(name: str = "auto") -> Decoder:
    """A decoder by registry name, or ``"auto"``: the first of fast, pil whose libraries import."""
    if name == "auto":
        for candidate in _PREFERENCE:
            try:
                return BACKENDS[candidate]()
            except ImportError:
                continue
        raise AssertionError("unreachable: the pil backend needs only Pillow")  # pragma: no cover
    if name not in BACKENDS:
        raise UsageError(f"unknown decode backend {name!r}; expected one of auto, {', '.join(BACKENDS)}")
    try:
        return BACKENDS[name]()
    except ImportError as e:
        raise UsageError(
            f"decode backend {name!r} needs a missing library ({e}); install it with "
            f"`{install_hint('simplejpeg opencv-python-headless')}` or choose another backend"
        ) from None


class _Default:
    """Holder of the process-wide default decoder (rebound by set_backend). Built on first use, not
    at import: importing ``stager.decode`` (``pack`` does, for the JPEG header checks) must not load
    OpenCV and Pillow (~25 ms of every ``stager pack``)."""

    _decoder: Decoder | None = None

    @classmethod
    def get(cls) -> Decoder:
        if cls._decoder is None:
            cls._decoder = get_decoder(os.environ.get(ENV_VAR, "auto") or "auto")
        return cls._decoder


def set_backend(name: str) -> str:
    """Switch the process-wide default decoder; returns its :func:`backend` name.

    Loader worker processes started with ``fork`` inherit it; with ``spawn`` set the environment
    variable instead, which every process reads when it first decodes.
    """
    _Default._decoder = get_decoder(name)
    return _Default._decoder.name


def default_decoder() -> Decoder:
    """The process-wide default decoder (what the module functions use without ``decoder=``)."""
    return _Default.get()


def backend() -> str:
    """Name of the default decoder: ``"simplejpeg+cv2"``, ``"simplejpeg+pil"`` or ``"pil"``."""
    return _Default.get().name


def _as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    return data if isinstance(data, bytes) else bytes(data)


def decode_rgb(data: bytes, *, decoder: Decoder | None = None) -> np.ndarray:
    """Decode the whole image to a C-contiguous ``(H, W, 3)`` uint8 RGB array."""
    return (decoder or _Default.get()).decode_rgb(_as_bytes(data))


def image_size(data: bytes, *, decoder: Decoder | None = None) -> tuple[int, int]:
    """``(height, width)`` from the header without decoding; refuses decompression bombs."""
    p = (decoder or _Default.get()).probe(_as_bytes(data))
    return p.height, p.width


def decode_random_resized_crop(  # noqa: PLR0917 (positional signature fixed by the loader contract)
    data: bytes,
    size: int,
    rng: np.random.Generator,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    flip: bool = True,
    *,
    decoder: Decoder | None = None,
) -> np.ndarray:
    """torchvision ``RandomResizedCrop(size, scale, ratio)`` then ``RandomHorizontalFlip()``.

    The crop box and then (when ``flip``) the flip coin (p=0.5) are drawn from ``rng``, so the same
    generator state gives the same output on every backend's geometry. Returns ``(size, size, 3)``
    uint8, C-contiguous.
    """
    dec = decoder or _Default.get()
    data = _as_bytes(data)
    probe, box, do_flip = _draw_crop(dec, data, size, rng, scale, ratio, flip)
    out = dec.crop_resize(data, probe, box, int(size))
    return dec.flip(out) if do_flip else out


def _draw_crop(dec: Decoder, data: bytes, size: int, rng: np.random.Generator,  # noqa: PLR0917 (the public signature's)
               scale: Sequence[float], ratio: Sequence[float], flip: bool) -> tuple[Probe, Box, bool]:
    """What :func:`decode_random_resized_crop` and its clip form draw, in this order: the box from ``data``'s
    header, then the flip coin (p=0.5, when ``flip``); ``(probe, box, flip it)``."""
    check_crop_args(size, scale, ratio)
    probe = dec.probe(data)
    box = random_resized_crop_box(probe.height, probe.width, rng, scale, ratio)
    return probe, box, flip and rng.random() < 0.5


def decode_clip_random_resized_crop(  # noqa: PLR0917 (the same positional signature as decode_random_resized_crop)
    frames: Sequence[bytes | bytearray | memoryview],
    size: int,
    rng: np.random.Generator,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    flip: bool = True,
    *,
    decoder: Decoder | None = None,
) -> np.ndarray:
    """:func:`decode_random_resized_crop` for a clip: one box and one flip coin, drawn from ``rng``
    exactly as there (so frame 0 is what that function gives for the same generator state), applied
    to every frame. Returns ``(T, size, size, 3)`` uint8, C-contiguous.

    All frames must have the first frame's size (a pack's sequence does): raises
    :class:`~stager.errors.CorruptSampleError` otherwise. Each frame still has its own header probed
    (its layout, not its size, may differ) and is decoded only as far as the box needs.
    """
    dec = decoder or _Default.get()
    datas = [_as_bytes(d) for d in frames]
    if not datas:
        check_crop_args(size, scale, ratio)
        raise UsageError("a clip needs at least one frame")
    first, box, do_flip = _draw_crop(dec, datas[0], size, rng, scale, ratio, flip)
    out = np.empty((len(datas), int(size), int(size), 3), np.uint8)
    for i, data in enumerate(datas):
        probe = first if i == 0 else dec.probe(data)
        if (probe.height, probe.width) != (first.height, first.width):
            raise CorruptSampleError(f"frame {i} is {probe.height}x{probe.width} but frame 0 is "
                                     f"{first.height}x{first.width}: a clip's frames share one size")
        out[i] = dec.crop_resize(data, probe, box, int(size))
    if do_flip:  # the T frames' rows as one (T*size, size, 3) image: one mirror call for the clip
        out = dec.flip(out.reshape(-1, int(size), 3)).reshape(out.shape)
    return out


def decode_center_crop(
    data: bytes, size: int, resize: int | None = None, *, decoder: Decoder | None = None
) -> np.ndarray:
    """The standard eval transform: shorter side to ``resize`` (default ``round(size / 0.875)``,
    256 for 224), then the central ``(size, size, 3)`` uint8."""
    check_crop_args(size, (1.0, 1.0), (1.0, 1.0))
    resize = default_resize(int(size)) if resize is None else resize
    if int(resize) != resize or resize < size:
        raise UsageError(f"resize must be an integer >= size ({size}), got {resize!r}")
    dec = decoder or _Default.get()
    data = _as_bytes(data)
    return dec.center_crop(data, dec.probe(data), int(size), int(resize))

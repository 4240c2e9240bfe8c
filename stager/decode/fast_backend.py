"""The fast backend: libjpeg-turbo via simplejpeg, resize with OpenCV (Pillow if cv2 is absent).

For a crop it decodes only what the crop needs and resizes in one pass:

1. the crop is drawn from the header alone (:mod:`stager.decode.jpeg_header`);
2. *DCT scaling*: when the crop is at least 2x/4x/8x the output on both sides, libjpeg decodes at
   1/2, 1/4, 1/8 scale. Only these power-of-two scales are used: libjpeg-turbo's other N/8 scales
   have no SIMD IDCT and measured slower than a full decode;
3. *row truncation*: for single-scan sequential JPEGs (nearly all camera and web JPEGs) the frame
   height is rewritten so libjpeg stops one MCU row below the crop's bottom edge. Huffman decoding
   dominates the cost of a ~100 KB photo, and it is the only step libjpeg cannot skip, so not
   reaching the rows below the crop is the saving that matters (see docs/decoding.md);
4. the crop is a view of the decoded array, resized with ``cv2.resize`` (bilinear; area averaging
   when a >2x reduction remains) straight into the output; flips use ``cv2.flip``.

Anything else (PNG, CMYK/YCCK or 12-bit JPEG, a JPEG libjpeg rejects in strict mode) goes through
Pillow (:mod:`stager.decode.pil_backend`), then the same crop/resize; what Pillow also cannot read
raises CorruptSampleError.
"""

from __future__ import annotations

import math
import threading
from types import ModuleType

import numpy as np
from PIL import Image

from stager.decode.base import Probe
from stager.decode.crop import Box, center_crop_box
from stager.decode.jpeg_header import HeaderError, JpegHeader, is_jpeg, parse_jpeg_header, with_height
from stager.decode.pil_backend import check_pixels, corrupt, load_rgb, open_image, pil_decode_rgb

_EXTRANEOUS = "extraneous bytes before marker 0xd9"
# DCT scaling is skipped for tiny images, where libjpeg's N/8 output sizes can tie and the decoder
# might pick a scale other than the one we computed the buffer for.
_MIN_SCALABLE = 64


def _import_cv2() -> ModuleType | None:
    try:
        import cv2  # noqa: PLC0415 (OpenCV is optional (fast decode backend))
    except ImportError:
        return None
    return cv2


class FastJpegDecoder:
    """simplejpeg decoding with DCT scaling and row truncation; see the module docstring.

    ``fast_dct``/``fast_upsample`` select libjpeg-turbo's IFAST IDCT and nearest-neighbour chroma
    upsampling (a few percent faster, slightly less accurate). ``dct_scale`` and ``truncate`` turn
    the two partial-decode techniques off, for benchmarks and comparisons.
    """

    def __init__(
        self,
        *,
        fast_dct: bool = False,
        fast_upsample: bool = False,
        dct_scale: bool = True,
        truncate: bool = True,
        use_cv2: bool = True,
    ) -> None:
        import simplejpeg  # noqa: PLC0415 (simplejpeg is optional (fast decode backend))

        self._sj = simplejpeg
        self._cv2 = _import_cv2() if use_cv2 else None
        self.fast_dct = fast_dct
        self.fast_upsample = fast_upsample
        self.dct_scale = dct_scale
        self.truncate = truncate
        self.use_cv2 = use_cv2
        self.name = "simplejpeg+cv2" if self._cv2 is not None else "simplejpeg+pil"
        # Per-thread scratch for decodes that are cropped and resized at once: reusing the memory
        # saves the page faults of a fresh ~0.5 MB allocation per image (~10% measured).
        self._local = threading.local()

    def __getstate__(self) -> dict[str, bool]:
        """Options only, so a decoder can be sent to spawned loader workers."""
        keys = ("fast_dct", "fast_upsample", "dct_scale", "truncate", "use_cv2")
        return {k: getattr(self, k) for k in keys}

    def __setstate__(self, state: dict[str, bool]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _scratch(self, shape: tuple[int, int, int]) -> np.ndarray:
        n = shape[0] * shape[1] * shape[2]
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1 << 20), np.uint8)
            self._local.buf = buf
        return buf[:n].reshape(shape)

    # -- header -----------------------------------------------------------------------------------
    def probe(self, data: bytes) -> Probe:
        """Size from the header; ``handle`` is the JpegHeader when libjpeg can take the fast path."""
        if is_jpeg(data):
            try:
                hdr = parse_jpeg_header(data)
            except HeaderError as e:
                raise corrupt(data, f"bad JPEG header: {e}") from None
            if hdr.height > 0:
                check_pixels(data, hdr.height, hdr.width)
                fast = hdr.precision == 8 and hdr.components in (1, 3)
                return Probe(hdr.height, hdr.width, hdr if fast else None)
        im = open_image(data)  # non-JPEG, or a JPEG whose height comes later (DNL marker)
        return Probe(im.height, im.width, im)

    # -- decoding ---------------------------------------------------------------------------------
    def _sj_decode(self, data: bytes, **kw: object) -> np.ndarray:
        out: np.ndarray = self._sj.decode_jpeg(
            data, "RGB", fastdct=self.fast_dct, fastupsample=self.fast_upsample, strict=True, **kw
        )
        return out

    def decode_rgb(self, data: bytes) -> np.ndarray:
        hdr = self.probe(data).handle
        if isinstance(hdr, JpegHeader):
            try:
                return self._sj_decode(data)
            except ValueError:
                pass  # libjpeg is strict about warnings; Pillow decides whether the file is usable
        return pil_decode_rgb(data)

    def _decode_partial(self, data: bytes, hdr: JpegHeader, bottom: float, denom: int) -> np.ndarray | None:
        """Decode at scale ``1/denom``, stopping below row ``bottom`` when possible; None on failure."""
        rows = hdr.height
        if self.truncate and hdr.single_scan:
            mcu = hdr.mcu_height
            keep = (math.ceil(bottom / mcu) + 1) * mcu  # one MCU row of upsampling context below
            rows = min(rows, keep)
        shape = (-(-rows // denom), -(-hdr.width // denom), 3)
        buf = self._scratch(shape)
        kw: dict[str, object] = {"buffer": buf}
        if denom > 1:
            kw.update(min_height=shape[0], min_width=shape[1])
        try:
            if rows == hdr.height:
                arr = self._sj_decode(data, **kw)
                return arr if arr.shape == shape else None
            # libjpeg reports the entropy data we told it not to decode only after writing every
            # row; a sentinel in the last row proves that it did.
            sentinel = (np.arange(buf[-1].size, dtype=np.uint32) * 37 + 11) % 251
            buf[-1] = sentinel.astype(np.uint8).reshape(buf[-1].shape)
            try:
                self._sj_decode(with_height(data, hdr, rows), **kw)
            except ValueError as e:
                if _EXTRANEOUS not in str(e) or np.array_equal(buf[-1].reshape(-1), sentinel):
                    raise
            return buf
        except ValueError:
            return None

    def _decode_region(
        self, data: bytes, probe: Probe, box: tuple[float, float, float, float], out_h: int, out_w: int
    ) -> tuple[np.ndarray, tuple[float, float, float, float]]:
        """Decode enough of ``data`` to cover ``box`` (top, left, height, width in original pixels).

        Returns the decoded array and the box in its coordinates; the array may be a reduced-scale
        and/or top-rows-only decode, and may live in this thread's scratch buffer, which the next
        call overwrites: resize it before decoding again.
        """
        hdr = probe.handle
        top, left, bh, bw = box
        if isinstance(hdr, JpegHeader):
            denom = 1
            if self.dct_scale and min(hdr.height, hdr.width) >= _MIN_SCALABLE:
                for d in (8, 4, 2):
                    if bh / d >= out_h and bw / d >= out_w:
                        denom = d
                        break
            arr = self._decode_partial(data, hdr, top + bh, denom)
            if arr is None and denom > 1:
                denom = 1
                arr = self._decode_partial(data, hdr, top + bh, 1)
            if arr is not None:
                return arr, (top / denom, left / denom, bh / denom, bw / denom)
        im = probe.handle if isinstance(probe.handle, Image.Image) else open_image(data)
        return np.asarray(load_rgb(im, data)), box

    # -- resizing ---------------------------------------------------------------------------------
    def _resize(self, arr: np.ndarray, box: tuple[float, float, float, float], out_h: int, out_w: int) -> np.ndarray:
        top, left, bh, bw = box
        cv2 = self._cv2
        if cv2 is None:
            im = Image.fromarray(arr).resize(
                (out_w, out_h), Image.Resampling.BILINEAR, box=(left, top, left + bw, top + bh)
            )
            return np.asarray(im)
        h, w = arr.shape[:2]
        y0 = min(max(round(top), 0), h - 1)
        x0 = min(max(round(left), 0), w - 1)
        y1 = min(max(round(top + bh), y0 + 1), h)
        x1 = min(max(round(left + bw), x0 + 1), w)
        # Bilinear samples 2x2 neighbours and aliases past a 2x reduction; DCT scaling keeps most
        # crops under 2x, area averaging handles the rest (large, very anisotropic crops).
        interp = cv2.INTER_AREA if (y1 - y0) > 2 * out_h or (x1 - x0) > 2 * out_w else cv2.INTER_LINEAR
        out: np.ndarray = cv2.resize(arr[y0:y1, x0:x1], (out_w, out_h), interpolation=interp)
        return out

    def flip(self, arr: np.ndarray) -> np.ndarray:
        """Horizontal mirror, C-contiguous."""
        if self._cv2 is not None:
            out: np.ndarray = self._cv2.flip(arr, 1)
            return out
        return np.ascontiguousarray(arr[:, ::-1])

    # -- transforms -------------------------------------------------------------------------------
    def crop_resize(self, data: bytes, probe: Probe, box: Box, size: int) -> np.ndarray:
        fbox = (float(box[0]), float(box[1]), float(box[2]), float(box[3]))
        arr, b = self._decode_region(data, probe, fbox, size, size)
        return self._resize(arr, b, size, size)

    def center_crop(self, data: bytes, probe: Probe, size: int, resize: int) -> np.ndarray:
        box = center_crop_box(probe.height, probe.width, size, resize)
        arr, b = self._decode_region(data, probe, box, size, size)
        return self._resize(arr, b, size, size)

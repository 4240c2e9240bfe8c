"""Raw channel-planar pixels (Caffe's unencoded Datums) to the loader's ``(H, W, C)`` RGB arrays.

Caffe stores an unencoded image as ``channels x height x width`` uint8, one plane per channel, in
OpenCV's BGR order. :func:`planar_to_hwc` turns such bytes into what every decoded sample is in
stager (zarr rows, :func:`stager.decode.decode_rgb`): a C-contiguous ``(H, W, C)`` uint8 array with
the colour channels in RGB order. One copy (the transpose); the channel flip is a view.
"""

from __future__ import annotations

import numpy as np

from stager.errors import CorruptSampleError


def planar_to_hwc(data: bytes | memoryview, shape: tuple[int, int, int], *, bgr: bool = True) -> np.ndarray:
    """``(C, H, W)`` planar uint8 ``data`` -> ``(H, W, C)`` C-contiguous uint8, BGR(A) turned RGB(A).

    ``shape`` is ``(C, H, W)``. One or two channels (gray, gray + alpha) stay as they are. Raises
    :class:`CorruptSampleError` when ``data`` does not hold ``C * H * W`` bytes.
    """
    c, h, w = shape
    if len(data) != c * h * w:
        raise CorruptSampleError(f"{len(data)} bytes of planar pixels, expected {c} x {h} x {w} = {c * h * w}")
    planes = np.frombuffer(data, dtype=np.uint8).reshape(c, h, w)
    if bgr and c in (3, 4):
        planes = planes[[2, 1, 0, 3][:c]]
    return np.ascontiguousarray(planes.transpose(1, 2, 0))

"""Raw channel-planar pixels (Caffe's unencoded Datums) to the loader's ``(H, W, C)`` RGB arrays.

Caffe stores an unencoded image as ``channels x height x width`` uint8, one plane per channel, in
OpenCV's BGR order. :func:`planar_to_hwc` turns such bytes into what every decoded sample is in
stager (zarr rows, :func:`stager.decode.decode_rgb`): a C-contiguous ``(H, W, C)`` uint8 array with
the colour channels in RGB order. One copy (the transpose); the channel flip is a view.
:func:`planar_batch_to_hwc` does a run of samples at once: one join and one transpose per shape.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def planar_batch_to_hwc(data: Sequence[bytes | memoryview], shapes: Sequence[tuple[int, int, int]], *,
                        bgr: bool = True) -> list[np.ndarray]:
    """:func:`planar_to_hwc` of every item, in order. Items of one shape are joined and transposed as
    one ``(n, C, H, W)`` array (per-sample work is a slice, not a transpose): the returned arrays of
    one shape are views of one ``(n, H, W, C)`` array."""
    out: list[np.ndarray] = [np.empty(0, np.uint8)] * len(data)
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, s in enumerate(shapes):
        groups.setdefault(tuple(s), []).append(i)  # type: ignore[arg-type]
    for (c, h, w), idx in groups.items():
        bad = next((i for i in idx if len(data[i]) != c * h * w), None)
        if bad is not None:
            raise CorruptSampleError(f"{len(data[bad])} bytes of planar pixels, expected {c} x {h} x {w} = {c * h * w}")
        rows = np.frombuffer(b"".join(data[i] for i in idx), dtype=np.uint8).reshape(len(idx), -1)
        hwc = planar_rows_to_hwc(rows, (c, h, w), bgr=bgr)
        if len(idx) == len(data):
            return list(hwc)
        for j, i in enumerate(idx):
            out[i] = hwc[j]
    return out


def planar_rows_to_hwc(rows: np.ndarray, shape: tuple[int, int, int], *, bgr: bool = True) -> np.ndarray:
    """``(n, C * H * W)`` uint8 rows of planar pixels -> a new ``(n, H, W, C)`` array, BGR(A) turned RGB(A)."""
    c, h, w = shape
    planes = rows.reshape(len(rows), c, h, w)
    order = [2, 1, 0, 3][:c] if bgr and c in (3, 4) else list(range(c))
    hwc = np.empty((len(rows), h, w, c), dtype=np.uint8)
    for k, src in enumerate(order):  # one strided copy per channel: ~3x numpy's 4-d transpose here
        hwc[..., k] = planes[:, src]
    return hwc

"""Vectorised helpers over byte buffers: little-endian structs and rows of bytes at arbitrary byte
offsets, and prefix sums of ragged lengths.

The listing of an image with a million files decodes its inode and directory tables with these
instead of one ``struct.unpack`` per field per file (docs/benchmarks.md, "SquashFS codec").
"""

from __future__ import annotations

import numpy as np

PAD = 320  # zero bytes after a table's buffer, so that a gather near its end (a name: 256) stays in bounds


class ByteView:
    """Unaligned views of a uint8 buffer of ``n`` bytes followed by :data:`PAD` zero bytes:
    ``rows(pos, width)`` gathers the ``width`` bytes at each byte offset in ``pos`` (int64 array) with
    one copy per row, and ``records(pos, dtype)`` the same rows as little-endian structs (all fields
    at once). Callers check ``pos + what they use <= n``; the padding keeps a wider gather (a short
    inode at the table's end read as a long one, a name read at its pass's widest width) in bounds."""

    def __init__(self, padded: np.ndarray, n: int) -> None:
        self.buf = padded
        self.n = n
        self._views: dict[int, np.ndarray] = {}

    def rows(self, pos: np.ndarray, width: int) -> np.ndarray:
        """The ``width`` bytes at each offset in ``pos``: a uint8 array of shape ``(len(pos), width)``
        (``width`` at most :data:`PAD` past what the caller checked)."""
        rows = self._views.get(width)
        if rows is None:
            rows = np.lib.stride_tricks.as_strided(self.buf, shape=(max(len(self.buf) - width + 1, 0), width),
                                                   strides=(1, 1), writeable=False)
            self._views[width] = rows
        return rows[pos]

    def scalars(self, dtype: np.dtype) -> np.ndarray:
        """The buffer as overlapping little-endian scalars of ``dtype``, one starting at every byte:
        ``scalars(u4)[p]`` is the u32 at byte ``p`` (a gather of them costs a third of :meth:`rows`)."""
        key = -dtype.itemsize
        got = self._views.get(key)
        if got is None:
            got = np.ndarray(shape=(max(len(self.buf) - dtype.itemsize + 1, 0),), dtype=dtype, buffer=self.buf,
                             strides=(1,))
            self._views[key] = got
        return got

    def records(self, pos: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The structs of ``dtype`` at byte offsets ``pos``: a structured array of shape ``(len(pos),)``."""
        return self.rows(pos, dtype.itemsize).view(dtype).reshape(-1)


def segment_starts(lengths: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each of the consecutive segments of ``lengths`` starts (int64,
    shape ``(n + 1,)``, last = total)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out

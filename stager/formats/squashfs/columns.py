"""Vectorised helpers over byte buffers: little-endian integers at arbitrary byte offsets, and ragged
ranges gathered into one buffer.

The listing of an image with a million files decodes its inode and directory tables with these
instead of one ``struct.unpack`` per field per file (docs/benchmarks.md, "SquashFS codec").
"""

from __future__ import annotations

import numpy as np

_CHUNK = 1 << 22  # bytes gathered per pass: bounds the int64 index arrays to 32 MiB


PAD = 320  # zero bytes after a table's buffer, so that a gather near its end (a name: 256) stays in bounds


class ByteView:
    """Unaligned little-endian views of a uint8 buffer of ``n`` bytes followed by :data:`PAD` zero
    bytes: ``u16(pos)`` etc. gather the integers that start at each byte offset in ``pos`` (int64
    array); ``records(pos, dtype)`` gathers whole little-endian structs (one copy of their bytes, all
    fields at once). Callers check ``pos + width <= n``; the padding only keeps a struct wider than
    what its type uses (a short inode at the table's end) in bounds."""

    def __init__(self, padded: np.ndarray, n: int) -> None:
        self.buf = padded
        self.n = n
        self._views: dict[object, np.ndarray] = {}

    def rows(self, pos: np.ndarray, width: int) -> np.ndarray:
        """The ``width`` bytes at each offset in ``pos``: a uint8 array of shape ``(len(pos), width)``
        (``width`` at most :data:`PAD` past what the caller checked)."""
        rows = self._views.get(width)
        if rows is None:
            rows = np.lib.stride_tricks.as_strided(self.buf, shape=(max(len(self.buf) - width + 1, 0), width),
                                                   strides=(1, 1), writeable=False)
            self._views[width] = rows
        return rows[pos]

    def records(self, pos: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The structs of ``dtype`` at byte offsets ``pos``: a structured array of shape ``(len(pos),)``."""
        return self.rows(pos, dtype.itemsize).view(dtype).reshape(-1)

    def _view(self, dtype: str, width: int) -> np.ndarray:
        v = self._views.get(dtype)
        if v is None:
            count = max(self.n - width + 1, 0)
            v = np.ndarray(shape=(count,), dtype=dtype, buffer=self.buf, offset=0, strides=(1,))
            self._views[dtype] = v
        return v

    def u16(self, pos: np.ndarray) -> np.ndarray:
        return self._view("<u2", 2)[pos].astype(np.int64)

    def i16(self, pos: np.ndarray) -> np.ndarray:
        return self._view("<i2", 2)[pos].astype(np.int64)

    def u32(self, pos: np.ndarray) -> np.ndarray:
        return self._view("<u4", 4)[pos].astype(np.int64)

    def u64(self, pos: np.ndarray) -> np.ndarray:
        """As int64: values past 2**63 come out negative, which every caller treats as out of range."""
        return self._view("<u8", 8)[pos].view(np.int64)


def segment_starts(lengths: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each of the consecutive segments of ``lengths`` starts (int64,
    shape ``(n + 1,)``, last = total)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def ragged_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The flat positions ``starts[i] + 0 .. starts[i] + lengths[i] - 1``, concatenated (int64, or
    int32 when every position fits: half the memory traffic)."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    first = segment_starts(lengths)[:-1]
    small = len(starts) == 0 or (int(starts.max()) + int(lengths.max()) < 1 << 31 and total < 1 << 31)
    dt = np.int32 if small else np.int64
    idx = np.repeat((starts - first).astype(dt), lengths)
    idx += np.arange(total, dtype=dt)
    return idx


def ragged_gather(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([src[s:s+l] for s, l in zip(starts, lengths)])``, a chunk of rows at a time."""
    total = int(lengths.sum())
    out = np.empty(total, dtype=src.dtype)
    ends = segment_starts(lengths)
    i, n = 0, len(lengths)
    while i < n:
        j = int(np.searchsorted(ends, ends[i] + _CHUNK, side="right"))
        j = min(max(j - 1, i + 1), n)
        out[ends[i] : ends[j]] = src.take(ragged_index(starts[i:j], lengths[i:j]))
        i = j
    return out


def ragged_copy(dst: np.ndarray, dst_starts: np.ndarray, src: np.ndarray, src_starts: np.ndarray,
                lengths: np.ndarray) -> None:
    """``dst[dst_starts[i]:+lengths[i]] = src[src_starts[i]:+lengths[i]]`` for every ``i``, a chunk of
    rows at a time (bounded index arrays)."""
    ends = segment_starts(lengths)
    i, n = 0, len(lengths)
    while i < n:
        j = int(np.searchsorted(ends, ends[i] + _CHUNK, side="right"))
        j = min(max(j - 1, i + 1), n)
        dst[ragged_index(dst_starts[i:j], lengths[i:j])] = src.take(ragged_index(src_starts[i:j], lengths[i:j]))
        i = j


def range_mask(n: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A bool mask of shape ``(n,)``, true on every ``[starts[i], starts[i] + lengths[i])`` (ranges
    must not overlap; empty ones are allowed)."""
    delta = np.zeros(n + 1, dtype=np.int8)
    np.add.at(delta, starts, 1)  # add.at, not fancy assignment: an empty range starts where one ends
    np.add.at(delta, starts + lengths, -1)
    return np.cumsum(delta[:n], dtype=np.int8) > 0

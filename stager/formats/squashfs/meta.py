"""Metadata blocks: reading a table's blocks into one uncompressed buffer, and writing them.

A metadata table (inodes, directories) is a run of blocks ``[u16 header][bytes]``; the reader
decompresses a whole table at once (:func:`read_table`, in a thread pool when it is large: zlib,
lzma and zstandard release the GIL) into one buffer and keeps each block's position on disk and in
the buffer, so a reference ``(block, offset)`` becomes one buffer offset (:meth:`MetaTable.locate`),
and a structure that runs across blocks is read as if the table were one array.

The fragment, export and id tables are records in metadata blocks found through a raw u64 index
(:func:`read_indexed`), checked as the kernel checks it: the blocks sit just before their index,
each at most one metadata block after the previous one, and the index before the next table.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from stager.errors import SourceError
from stager.formats.squashfs.columns import PAD, ByteView
from stager.formats.squashfs.compress import Compress, Decompress, DecompressError
from stager.formats.squashfs.layout import META_SIZE_MASK, META_STORED, METADATA_SIZE

_PARALLEL_BLOCKS = 64  # decompress tables of more blocks than this in a thread pool
_MAX_GAP = METADATA_SIZE + 2  # a block's bytes on disk, at most


def pread_exact(fd: int, size: int, offset: int, image: str, what: str) -> bytes:
    """``size`` bytes at ``offset``, or a one-line :class:`SourceError` naming a truncated image."""
    buf = os.pread(fd, size, offset)
    if len(buf) != size:
        raise SourceError(f"{image}: truncated: {what} at byte {offset} needs {size} bytes, the file ends "
                          f"{len(buf)} bytes later; re-copy the image or re-make it with mksquashfs")
    return buf


def _split_blocks(raw: bytes, image: str, what: str,
                  base: int) -> tuple[list[int], list[bytes | memoryview], list[bool]]:
    """The blocks of a run of metadata blocks: disk starts (relative), payloads, stored flags."""
    starts: list[int] = []
    payloads: list[bytes | memoryview] = []
    stored: list[bool] = []
    view = memoryview(raw)
    p, n = 0, len(raw)
    while p < n:
        if p + 2 > n:
            raise SourceError(f"{image}: damaged {what}: a metadata block header at byte {base + p} runs past "
                              "the table's end; the image is damaged: re-copy or re-make it")
        (hdr,) = struct.unpack_from("<H", raw, p)
        size = hdr & META_SIZE_MASK
        if size == 0 or p + 2 + size > n or (hdr & META_STORED and size > METADATA_SIZE):
            raise SourceError(f"{image}: damaged {what}: metadata block at byte {base + p} claims {size} bytes "
                              f"(table ends {n - p - 2} bytes later); the image is damaged: re-copy or re-make it")
        starts.append(p)
        payloads.append(view[p + 2 : p + 2 + size])
        stored.append(bool(hdr & META_STORED))
        p += 2 + size
    return starts, payloads, stored


def decompress_blocks(payloads: Sequence[bytes | memoryview], stored: Sequence[bool], decompress: Decompress, *,
                      image: str, what: str, starts: Sequence[int], base: int) -> tuple[np.ndarray, list[int]]:
    """The metadata blocks' uncompressed bytes back to back in one buffer (at most 8 KiB a block, then
    :data:`PAD` zero bytes), and each block's uncompressed length."""
    n = len(payloads)
    # A numpy buffer (zero-filled lazily, in huge pages where the kernel allows): a million files' tables
    # are ~80 MB, and faulting them in 4 KiB pages costs more than decompressing them.
    out = np.zeros(n * METADATA_SIZE + PAD, dtype=np.uint8)
    view = memoryview(out)  # type: ignore[arg-type]
    sizes = [0] * n

    def one(i: int) -> None:
        if stored[i]:
            data: bytes | memoryview = payloads[i]
        else:
            try:
                data = decompress(payloads[i], METADATA_SIZE)
            except DecompressError as exc:
                raise SourceError(f"{image}: damaged {what}: metadata block at byte {base + starts[i]}: {exc}; "
                                  "the image is damaged: re-copy or re-make it") from exc
        sizes[i] = len(data)
        view[i * METADATA_SIZE : i * METADATA_SIZE + len(data)] = data

    workers = min(8, os.cpu_count() or 1)
    if n <= _PARALLEL_BLOCKS or workers == 1:
        for i in range(n):
            one(i)
    else:  # one task per contiguous share (a future per 8 KiB block would cost more than the block)
        cuts = [n * k // (2 * workers) for k in range(2 * workers + 1)]

        def share(k: int) -> None:
            for i in range(cuts[k], cuts[k + 1]):
                one(i)

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(share, range(2 * workers)))
    # Every block but the last is full (the caller checks), so the blocks are already back to back,
    # and the last block's unused slot is zeros: the padding.
    return out, sizes


class MetaTable:
    """A metadata table decompressed into one buffer.

    ``data``: the concatenated uncompressed blocks (a uint8 array: ``size`` bytes, then at least
    :data:`PAD` zero bytes); ``array``: the ``size`` bytes; ``disk``: int64 block starts relative to the
    table's start on disk, shape ``(blocks,)``; ``mem``: int64 offsets of the same blocks in
    ``data``. Every block but the last holds exactly 8 KiB (checked), which is what lets a structure
    run across a block boundary.
    """

    def __init__(self, data: np.ndarray, size: int, *, disk: np.ndarray, mem: np.ndarray, image: str,
                 what: str) -> None:
        self.data = data
        self.size = size
        self.disk = disk
        self.mem = mem
        self.image = image
        self.what = what
        self.padded = data
        self.array = data[:size]
        self.buffer = data.data  # a memoryview, for struct.unpack_from

    def view(self) -> ByteView:
        """A :class:`ByteView` of the table's bytes."""
        return ByteView(self.padded, self.size)

    def locate(self, block: int, offset: int) -> int:
        """The buffer offset of reference ``(block, offset)``."""
        k = int(np.searchsorted(self.disk, block))
        if k >= len(self.disk) or block < 0 or int(self.disk[k]) != block or offset >= METADATA_SIZE:
            raise SourceError(f"{self.image}: damaged {self.what}: a reference to block {block} offset {offset} "
                              "points at no metadata block; the image is damaged: re-copy or re-make it")
        pos = int(self.mem[k]) + offset
        if pos >= self.size:
            raise SourceError(f"{self.image}: damaged {self.what}: reference ({block}, {offset}) is past the "
                              "table's end; the image is damaged: re-copy or re-make it")
        return pos

    def locate_many(self, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """:meth:`locate` of arrays of references (int64 in, int64 out)."""
        if len(self.disk) == 0:
            if len(blocks):
                self.locate(int(blocks[0]), int(offsets[0]))  # raises the one-line error
            return np.zeros(0, dtype=np.int64)
        k = np.searchsorted(self.disk, blocks)
        kc = np.minimum(k, len(self.disk) - 1)
        bad = (k >= len(self.disk)) | (self.disk[kc] != blocks) | (offsets >= METADATA_SIZE)
        pos = self.mem[kc] + offsets
        bad |= pos >= self.size
        if bad.any():
            i = int(np.argmax(bad))
            self.locate(int(blocks[i]), int(offsets[i]))  # raises the one-line error
        return pos


def read_table(fd: int, start: int, end: int, *, decompress: Decompress, image: str, what: str) -> MetaTable:
    """The metadata table occupying bytes ``[start, end)`` of the image, decompressed."""
    if end < start:
        raise SourceError(f"{image}: damaged superblock: the {what} would end before it starts "
                          f"({start} > {end}); the image is damaged: re-copy or re-make it")
    raw = pread_exact(fd, end - start, start, image, what)
    starts, payloads, stored = _split_blocks(raw, image, what, start)
    data, block_sizes = decompress_blocks(payloads, stored, decompress, image=image, what=what, starts=starts,
                                          base=start)
    sizes = np.asarray(block_sizes, dtype=np.int64)
    if len(sizes) > 1 and (sizes[:-1] != METADATA_SIZE).any():
        i = int(np.argmax(sizes[:-1] != METADATA_SIZE))
        raise SourceError(f"{image}: damaged {what}: metadata block at byte {start + starts[i]} holds "
                          f"{sizes[i]} bytes, not {METADATA_SIZE}; the image is damaged: re-copy or re-make it")
    mem = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], out=mem[1:])
    return MetaTable(data, int(sizes.sum()), disk=np.asarray(starts, dtype=np.int64), mem=mem, image=image, what=what)


def read_index(fd: int, index_start: int, nbytes: int, *, next_table: int, image: str, what: str) -> np.ndarray:
    """The u64 block positions of an indexed table of ``nbytes`` record bytes at ``index_start``,
    checked as the kernel checks them (before ``next_table``, blocks just before their index)."""
    n = -(-nbytes // METADATA_SIZE)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if index_start + 8 * n > next_table:
        raise SourceError(f"{image}: damaged superblock: the {what} index at byte {index_start} runs into the "
                          f"next table at {next_table}; the image is damaged or truncated: re-copy or re-make it")
    idx = np.frombuffer(pread_exact(fd, 8 * n, index_start, image, f"{what} index"), dtype="<u8").astype(np.int64)
    ends = np.append(idx[1:], index_start)
    if (idx < 0).any() or (idx >= ends).any() or (ends - idx > _MAX_GAP).any():
        raise SourceError(f"{image}: damaged {what} index at byte {index_start}: its block positions are out of "
                          "order or out of bounds; the image is damaged: re-copy or re-make it")
    return idx


def read_indexed(fd: int, index: np.ndarray, index_start: int, *, nbytes: int, decompress: Decompress,
                 image: str, what: str) -> bytes:
    """``nbytes`` of records of an indexed table whose block positions are ``index``."""
    if len(index) == 0:
        return b""
    first = int(index[0])
    raw = pread_exact(fd, index_start - first, first, image, what)
    starts, payloads, stored = _split_blocks(raw, image, what, first)
    if [first + s for s in starts] != index.tolist():
        raise SourceError(f"{image}: damaged {what}: its index does not match its metadata blocks; the image is "
                          "damaged: re-copy or re-make it")
    buf, sizes = decompress_blocks(payloads, stored, decompress, image=image, what=what, starts=starts, base=first)
    if len(sizes) > 1 and min(sizes[:-1]) != METADATA_SIZE:
        raise SourceError(f"{image}: damaged {what}: a metadata block before the last holds less than "
                          f"{METADATA_SIZE} bytes; the image is damaged: re-copy or re-make it")
    data = buf[: sum(sizes)].tobytes()
    if len(data) < nbytes:
        raise SourceError(f"{image}: damaged {what}: {len(data)} bytes of records, {nbytes} expected; the image "
                          "is damaged: re-copy or re-make it")
    return data[:nbytes]


# ---- writing ------------------------------------------------------------------------------------


def metadata_block(data: bytes, compress: Compress | None) -> bytes:
    """One metadata block on disk: header + payload, compressed when that is smaller."""
    if compress is not None:
        c = compress(data)
        if len(c) < len(data):
            return struct.pack("<H", len(c)) + c
    return struct.pack("<H", len(data) | META_STORED) + data


class MetaWriter:
    """Builds a metadata table: bytes are appended, full 8 KiB blocks are compressed as they fill.

    :meth:`ref` gives the reference ``(block start relative to the table, offset)`` of any
    uncompressed position already written or about to be: blocks before it are final, so their
    compressed sizes are known.
    """

    def __init__(self, compress: Compress | None) -> None:
        self._compress = compress
        self._out: list[bytes] = []
        self._disk = 0  # bytes of finished blocks on disk
        self._starts: list[int] = []  # disk start of each finished block
        self._buf = bytearray()
        self.written = 0  # uncompressed bytes appended so far

    def ref(self, pos: int | None = None) -> tuple[int, int]:
        """``(block, offset)`` of uncompressed position ``pos`` (default: the next byte)."""
        pos = self.written if pos is None else pos
        k, off = divmod(pos, METADATA_SIZE)
        return (self._starts[k] if k < len(self._starts) else self._disk), off

    def write(self, data: bytes) -> None:
        self._buf += data
        self.written += len(data)
        while len(self._buf) >= METADATA_SIZE:
            self._flush(bytes(self._buf[:METADATA_SIZE]))
            del self._buf[:METADATA_SIZE]

    def _flush(self, block: bytes) -> None:
        b = metadata_block(block, self._compress)
        self._starts.append(self._disk)
        self._out.append(b)
        self._disk += len(b)

    def finish(self) -> bytes:
        """The table's bytes on disk (the partial last block flushed)."""
        if self._buf:
            self._flush(bytes(self._buf))
            self._buf = bytearray()
        return b"".join(self._out)


def indexed_table(records: bytes, compress: Compress | None, at: int) -> tuple[bytes, bytes]:
    """An indexed table whose blocks start at image byte ``at``: ``(blocks, u64 index)``."""
    blocks, index, pos = [], [], at
    for i in range(0, len(records), METADATA_SIZE):
        b = metadata_block(records[i : i + METADATA_SIZE], compress)
        index.append(pos)
        blocks.append(b)
        pos += len(b)
    return b"".join(blocks), struct.pack(f"<{len(index)}Q", *index)

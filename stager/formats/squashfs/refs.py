"""Files read by inode reference, many at once: :func:`read_by_refs` (what the loader does for a run of
an image's compressed samples, whose sample index keeps each one's inode reference).

A run of thousands of small files costs per *block*, not per file: the inode-table blocks the
references point into are read and decompressed once each (with the block after, for inodes that run
on), every inode is decoded in one vectorised pass (:func:`~.inodes.decode_inodes`), and the files are
grouped by where their bytes are: tails in a fragment block (the small files) are sliced out of that
block, decompressed once; stored contiguous files are read with one ``pread`` per run of neighbours;
the rest (files with compressed blocks of their own) one by one. Inodes too long for the two blocks
read (a file of thousands of blocks) are decoded alone (:meth:`SquashImage.ref_pieces`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from stager.errors import CorruptSampleError, SourceError
from stager.formats.base import pread_runs
from stager.formats.squashfs.columns import PAD, ByteView, segment_starts
from stager.formats.squashfs.inodes import Inodes, decode_inodes
from stager.formats.squashfs.layout import (
    HEAD_DTYPE,
    LREG,
    LREG_DTYPE,
    LREG_INODE,
    METADATA_SIZE,
    NO_FRAGMENT,
    REG,
    REG_DTYPE,
    REG_INODE,
    Superblock,
    split_ref,
)
from stager.formats.squashfs.listing import ImageListing, Piece, raw_offsets
from stager.manifest.table import Ragged, Strings


class RefImage(Protocol):
    """What the reads by reference use of :class:`~stager.formats.squashfs.reader.SquashImage` (which
    imports this module: a protocol, not an import, keeps the two out of a cycle)."""

    name: str
    superblock: Superblock
    fragments: np.ndarray

    @property
    def block_size(self) -> int: ...

    def fd(self) -> int: ...

    def meta_block(self, rel: int, what: str) -> tuple[bytes, int]: ...

    def read_ref(self, ref: int) -> bytes: ...

    def read_pieces(self, pieces: Sequence[Piece], size: int, what: str) -> bytes: ...

    def fragment_block(self, p: Piece, what: str) -> bytes: ...


def _windows(im: RefImage, blocks: np.ndarray) -> tuple[np.ndarray, dict[int, int], dict[int, int]]:
    """The inode-table blocks at ``blocks`` (table-relative disk offsets, unique), each followed by the
    block after it, back to back in one padded buffer: ``(buffer, {block: its start in the buffer},
    {block: its window's length})``."""
    parts: list[bytes] = []
    base: dict[int, int] = {}
    size: dict[int, int] = {}
    at = 0
    end = im.superblock.directory_table_start - im.superblock.inode_table_start
    for b in blocks.tolist():
        data, nxt = im.meta_block(b, "inode reference")
        window = data + (im.meta_block(nxt, "inode reference")[0] if len(data) == METADATA_SIZE and nxt < end else b"")
        base[b], size[b] = at, len(window)
        parts.append(window)
        at += len(window)
    buf = np.frombuffer(b"".join(parts) + bytes(PAD), dtype=np.uint8)
    return buf, base, size


def decode_refs(im: RefImage, refs: np.ndarray) -> tuple[ImageListing, np.ndarray]:
    """The regular files whose inodes are at ``refs`` as an :class:`ImageListing` (their bytes: its
    ``pieces``/``raw_offset``), and a bool mask of those whose inode ran past the two blocks read
    (to be decoded alone)."""
    blk = refs >> 16
    off = refs & 0xFFFF
    uniq = np.unique(blk)
    buf, base, size = _windows(im, uniq)
    start = np.asarray([base[b] for b in blk.tolist()], dtype=np.int64)
    limit = start + np.asarray([size[b] for b in blk.tolist()], dtype=np.int64)
    pos = start + off
    if (pos + 16 > limit).any():
        k = int(np.argmax(pos + 16 > limit))
        raise CorruptSampleError(f"{im.name}: inode {int(refs[k]):#x} lies past its block's end; the index does not "
                                 "match the image: re-index it")
    long = _too_long(ByteView(buf, len(buf) - PAD), pos, limit, im.block_size)
    keep = np.flatnonzero(~long)
    n = len(refs)
    try:
        part = decode_inodes(ByteView(buf, len(buf) - PAD), pos[keep], np.full(len(keep), REG, dtype=np.int64),
                             block_size=im.block_size, image=im.name)
    except SourceError as exc:
        raise CorruptSampleError(f"{exc}; the index does not match the image: re-index it") from exc
    ino = _spread(part, keep, n)
    frag = ino.fragment
    if (frag >= len(im.fragments)).any():
        k = int(np.argmax((frag >= len(im.fragments)) & ~long))
        raise CorruptSampleError(f"{im.name}: inode {int(refs[k]):#x} names fragment {int(frag[k])} of "
                                 f"{len(im.fragments)}; the image is damaged: re-copy or re-make it")
    blank = Strings(Ragged(np.zeros(0, np.uint8), np.zeros(n + 1, np.int64)))
    zeros = np.zeros(n, dtype=np.int64)
    lst = ImageListing(blank, np.where(long, 0, 2), zeros - 1, zeros, ino.size, ino.mode, ino.nlink, ino.number, refs,
                       ino.start_block, ino.block_ptr, ino.block_words, frag, ino.frag_offset, zeros - 1,
                       im.fragments, im.block_size)
    lst.raw_offset = raw_offsets(lst)
    return lst, long


def _too_long(v: ByteView, pos: np.ndarray, limit: np.ndarray, block_size: int) -> np.ndarray:
    """Which inodes at ``pos`` (REG or LREG, as the caller expects) run past ``limit``, their window's end:
    from their fixed part alone (type, size, fragment), before anything decodes their block lists."""
    itype = v.records(pos, HEAD_DTYPE)["type"].astype(np.int64)
    reg = v.records(pos, REG_DTYPE)
    lreg = v.records(pos, LREG_DTYPE)
    is_l = itype == LREG
    size = np.where(is_l, lreg["size"].view(np.int64), reg["size"].astype(np.int64))
    frag = np.where(is_l, lreg["fragment"], reg["fragment"]).astype(np.int64)
    nb = np.where(frag == NO_FRAGMENT, -(-size // block_size), size // block_size)
    fixed = np.where(is_l, LREG_INODE.size, REG_INODE.size)
    return (pos + fixed > limit) | (pos + fixed + 4 * np.maximum(nb, 0) > limit) | (size < 0)


def _spread(part: Inodes, rows: np.ndarray, n: int) -> Inodes:
    """``part`` (the inodes of ``rows``) as ``n`` rows; the others empty (no blocks, no fragment)."""
    def col(a: np.ndarray, fill: int = 0) -> np.ndarray:
        out = np.full(n, fill, dtype=np.int64)
        out[rows] = a
        return out

    nb = np.zeros(n, dtype=np.int64)
    nb[rows] = np.diff(part.block_ptr)
    return Inodes(col(part.itype), col(part.mode), col(part.number), col(part.nlink, 1), col(part.start_block),
                  col(part.size), col(part.fragment, -1), col(part.frag_offset), segment_starts(nb), part.block_words,
                  np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def read_by_refs(im: RefImage, refs: np.ndarray) -> list[bytes]:
    """The bytes of the regular files whose inodes are at ``refs`` (int64), in that order."""
    refs = np.asarray(refs, dtype=np.int64).reshape(-1)
    out: list[bytes] = [b""] * len(refs)
    if not len(refs):
        return out
    lst, long = decode_refs(im, refs)
    for k in np.flatnonzero(long).tolist():
        out[k] = im.read_ref(int(refs[k]))
    todo = ~long
    raw = todo & (lst.raw_offset >= 0)
    if raw.any():
        where = np.flatnonzero(raw)
        try:
            got = pread_runs(im.fd(), lst.raw_offset[where], lst.size[where])
        except EOFError as exc:
            raise CorruptSampleError(f"{im.name}: {exc}; the image is truncated: re-copy it") from exc
        for k, b in zip(where.tolist(), got, strict=True):
            out[k] = b
    nb = np.diff(lst.block_ptr)
    tails = todo & ~raw & (nb == 0) & (lst.fragment >= 0)
    _read_tails(im, lst, np.flatnonzero(tails), refs, out)
    for k in np.flatnonzero(todo & ~raw & ~tails).tolist():
        out[k] = im.read_pieces(lst.pieces(k), int(lst.size[k]), f"inode {int(refs[k]):#x}")
    return out


def _read_tails(im: RefImage, lst: ImageListing, rows: np.ndarray, refs: np.ndarray, out: list[bytes]) -> None:
    """Files that are only a tail in a fragment block: each block decompressed once, the files sliced."""
    if not len(rows):
        return
    order = rows[np.argsort(lst.fragment[rows], kind="stable")]
    frags = lst.fragment[order].tolist()
    skips = lst.frag_offset[order].tolist()
    sizes = lst.size[order].tolist()
    block = b""
    current = -1
    for k, f, skip, size in zip(order.tolist(), frags, skips, sizes, strict=True):
        if f != current:
            start, word = (int(x) for x in im.fragments[f])
            block = im.fragment_block(Piece(start, word & 0xFFFFFF, not word & (1 << 24), 0, 0, True),
                                      f"inode {int(refs[k]):#x}")
            current = f
        if skip + size > len(block):
            raise CorruptSampleError(f"{im.name}: inode {int(refs[k]):#x}: its fragment holds {len(block)} bytes, not "
                                     f"{skip + size}; the image is damaged: re-copy or re-make it")
        out[k] = block[skip : skip + size]


__all__ = ["decode_refs", "read_by_refs", "split_ref"]

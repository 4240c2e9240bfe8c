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

import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from stager.errors import CorruptSampleError, SourceError
from stager.formats.base import pread_runs
from stager.formats.squashfs.columns import PAD, ByteView, segment_starts
from stager.formats.squashfs.inodes import Inodes, decode_inodes
from stager.formats.squashfs.layout import (
    DATA_SIZE_MASK,
    DATA_STORED,
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


def _windows(im: RefImage, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inode-table blocks at ``blocks`` (table-relative disk offsets, unique, ascending), each
    followed by the block after it, back to back in one padded buffer: ``(buffer, each window's start
    in it, each window's length)``."""
    parts: list[bytes] = []
    starts = np.zeros(len(blocks), dtype=np.int64)
    sizes = np.zeros(len(blocks), dtype=np.int64)
    at = 0
    end = im.superblock.directory_table_start - im.superblock.inode_table_start
    for i, b in enumerate(blocks.tolist()):
        data, nxt = im.meta_block(b, "inode reference")
        window = data + (im.meta_block(nxt, "inode reference")[0] if len(data) == METADATA_SIZE and nxt < end else b"")
        starts[i], sizes[i] = at, len(window)
        parts.append(window)
        at += len(window)
    buf = np.frombuffer(b"".join(parts) + bytes(PAD), dtype=np.uint8)
    return buf, starts, sizes


def _locate(im: RefImage, refs: np.ndarray) -> tuple[ByteView, np.ndarray, np.ndarray]:
    """The inode-table windows holding ``refs`` (:func:`_windows`) as a :class:`ByteView`, each inode's
    position in it and its window's end; a position past its block's end is a one-line error."""
    blk = refs >> 16
    if len(blk) < 2 or (blk[1:] >= blk[:-1]).all():  # a run of neighbours (the loader's): no sort
        uniq = blk[np.flatnonzero(np.diff(blk, prepend=-1))]
    else:
        uniq = np.unique(blk)
    buf, wstart, wsize = _windows(im, uniq)
    k = np.searchsorted(uniq, blk)
    start = wstart[k]
    limit = start + wsize[k]
    pos = start + (refs & 0xFFFF)
    if (pos + 16 > limit).any():
        i = int(np.argmax(pos + 16 > limit))
        raise CorruptSampleError(f"{im.name}: inode {int(refs[i]):#x} lies past its block's end; the index does not "
                                 "match the image: re-index it")
    return ByteView(buf, len(buf) - PAD), pos, limit


def decode_refs(im: RefImage, refs: np.ndarray) -> tuple[ImageListing, np.ndarray]:
    """The regular files whose inodes are at ``refs`` as an :class:`ImageListing` (their bytes: its
    ``pieces``/``raw_offset``), and a bool mask of those whose inode ran past the two blocks read
    (to be decoded alone)."""
    v, pos, limit = _locate(im, refs)
    long = _too_long(v, pos, limit, im.block_size)
    keep = np.flatnonzero(~long)
    n = len(refs)
    try:
        part = decode_inodes(v, pos[keep], np.full(len(keep), REG, dtype=np.int64), block_size=im.block_size,
                             image=im.name)
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


def _tails_only(im: RefImage, v: ByteView, pos: np.ndarray,
                limit: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(fragment, offset in it, size)`` of each inode at ``pos`` when every one is a basic regular file
    whose bytes are a tail in a fragment block alone (an image's small files: what a run of the loader
    reads), from one gather of their 32-byte inodes; else None (:func:`decode_refs` decodes them)."""
    if (pos + REG_INODE.size > limit).any() or not (v.scalars(_U16)[pos] == REG).all():
        return None
    r = v.records(pos, REG_DTYPE)
    frag, size = r["fragment"].astype(np.int64), r["size"].astype(np.int64)
    if (frag >= len(im.fragments)).any() or (size >= im.block_size).any():  # NO_FRAGMENT is >= too
        return None
    return frag, r["offset"].astype(np.int64), size


_U16 = np.dtype("<u2")


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
    v, pos, limit = _locate(im, refs)
    tails = _tails_only(im, v, pos, limit)
    if tails is not None:  # the usual run of small files: no listing, straight to their fragment blocks
        _read_tails(im, tails, np.arange(len(refs)), refs, out)
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
    tails_mask = todo & ~raw & (nb == 0) & (lst.fragment >= 0)
    rows = np.flatnonzero(tails_mask)
    _read_tails(im, (lst.fragment[rows], lst.frag_offset[rows], lst.size[rows]), rows, refs, out)
    for k in np.flatnonzero(todo & ~raw & ~tails_mask).tolist():
        out[k] = im.read_pieces(lst.pieces(k), int(lst.size[k]), f"inode {int(refs[k]):#x}")
    return out


def _read_tails(im: RefImage, tails: tuple[np.ndarray, np.ndarray, np.ndarray], rows: np.ndarray, refs: np.ndarray,
                out: list[bytes]) -> None:
    """Files ``rows`` of ``out`` that are only a tail in a fragment block (``tails``: each one's
    fragment, offset in it and size): each block decompressed once (fragment blocks in a small
    cache), the files sliced."""
    if not len(rows):
        return
    frag, skip, size = tails
    order = np.argsort(frag, kind="stable") if (np.diff(frag) < 0).any() else np.arange(len(frag))
    ends = skip + size
    fr = frag[order]
    cuts = [*np.flatnonzero(np.diff(fr, prepend=-1)).tolist(), len(fr)]
    table = im.fragments
    for a, b in itertools.pairwise(cuts):  # one fragment block per group
        f = int(fr[a])
        idx = order[a:b]
        start, word = int(table[f, 0]), int(table[f, 1])
        what = f"inode {int(refs[rows[idx[0]]]):#x}"
        block = im.fragment_block(Piece(start, word & DATA_SIZE_MASK, not word & DATA_STORED, 0, 0, True), what)
        if int(ends[idx].max()) > len(block):
            k = int(idx[np.argmax(ends[idx])])
            raise CorruptSampleError(f"{im.name}: inode {int(refs[rows[k]]):#x}: its fragment holds {len(block)} "
                                     f"bytes, not {int(ends[k])}; the image is damaged: re-copy or re-make it")
        for k, lo, hi in zip(rows[idx].tolist(), skip[idx].tolist(), ends[idx].tolist(), strict=True):
            out[k] = block[lo:hi]


__all__ = ["decode_refs", "read_by_refs", "split_ref"]

"""An image's entries as columns (:class:`ImageListing`), and where a file's bytes are (:class:`Piece`).

A file's bytes are its data blocks, consecutive from ``start_block``, then an optional tail in a
fragment block. :meth:`ImageListing.pieces` says, per piece, which bytes of the image to read, whether
to decompress them, and which of the resulting bytes belong to the file. ``raw_offset`` is the
shortcut the loader wants: where a file's bytes are one uncompressed range of the image (every block
stored, no fragment, or a tail in a stored fragment block that directly follows), the offset of that
range, read with one ``pread`` as a tar member is; else -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stager.errors import UnsafeArchiveError
from stager.formats.squashfs.layout import DATA_SIZE_MASK, DATA_STORED, DIR, KIND_NAMES, REG
from stager.manifest.table import Strings


class Piece(NamedTuple):
    """A run of a file's bytes: read ``stored`` bytes at image ``offset`` (``offset`` -1: a sparse
    block, zeros), decompress them if ``compressed``, then keep ``length`` bytes from ``skip``.
    ``fragment``: the piece is a tail in a fragment block (shared with other files)."""

    offset: int
    stored: int
    compressed: bool
    skip: int
    length: int
    fragment: bool = False


@dataclass
class ImageListing:
    """Every entry of an image but the root, breadth-first: the root's entries, then those of each
    directory in the order the directories were found; each directory's entries in name order (the
    order SquashFS keeps them). For an ImageFolder image that is class by class, files sorted.

    Columns (shape ``(n,)``, int64 unless said): ``paths`` (:class:`Strings`, ``/``-separated, relative
    to the root), ``kind`` (basic inode type: 1 directory, 2 regular file, 3 symlink, 4/5 block/char
    device, 6 FIFO, 7 socket), ``parent`` (entry index of the directory holding it; -1 at the top),
    ``top`` (the top-level entry it is under; itself at the top: an ImageFolder's class),
    ``size`` (file bytes), ``mode``, ``nlink``, ``inode_number``, ``inode_ref`` (block << 16 | offset
    in the inode table), ``start_block``, ``block_ptr`` (shape ``(n + 1,)``) into ``block_words``
    (uint32 size words of each file's data blocks), ``fragment`` (-1: none), ``frag_offset``,
    ``raw_offset`` (-1 unless the file is one stored range). ``fragments`` is the fragment table:
    shape ``(fragments, 2)``, rows ``(start, size word)``.
    """

    paths: Strings
    kind: np.ndarray
    parent: np.ndarray
    top: np.ndarray
    size: np.ndarray
    mode: np.ndarray
    nlink: np.ndarray
    inode_number: np.ndarray
    inode_ref: np.ndarray
    start_block: np.ndarray
    block_ptr: np.ndarray
    block_words: np.ndarray
    fragment: np.ndarray
    frag_offset: np.ndarray
    raw_offset: np.ndarray
    fragments: np.ndarray
    block_size: int

    def __len__(self) -> int:
        return len(self.kind)

    def files(self) -> np.ndarray:
        """Entry indices of the regular files (int64)."""
        return np.flatnonzero(self.kind == REG)

    def index_of(self) -> dict[str, int]:
        """``{path: entry index}`` (built on demand: a million paths cost a few hundred MB as a dict)."""
        return {p: i for i, p in enumerate(self.paths)}

    def pieces(self, i: int) -> list[Piece]:
        """Where file ``i``'s bytes are, in order (empty for an empty file)."""
        words = self.block_words[int(self.block_ptr[i]) : int(self.block_ptr[i + 1])].tolist()
        return file_pieces(int(self.size[i]), int(self.start_block[i]), words, fragment=int(self.fragment[i]),
                           frag_offset=int(self.frag_offset[i]), fragments=self.fragments, block_size=self.block_size)

    def problems(self) -> list[str]:
        """What keeps this image from being a set of samples: entries that are neither regular files
        nor directories (symlinks, devices, FIFOs, sockets) and hard links (a file whose inode more
        than one entry shares), as one line each: ``"<path>: <what>"``."""
        out = []
        other = np.flatnonzero((self.kind != REG) & (self.kind != DIR))
        out += [f"{self.paths[int(i)]}: a {KIND_NAMES.get(int(self.kind[i]), 'special file')}" for i in other]
        files = self.files()
        shared = files[self.nlink[files] > 1]
        refs, counts = np.unique(self.inode_ref[files], return_counts=True)
        dup = files[np.isin(self.inode_ref[files], refs[counts > 1])]
        out += [f"{self.paths[int(i)]}: a hard link ({int(self.nlink[i])} names for one inode)"
                for i in np.union1d(shared, dup)]
        return out

    def check_samples(self, image: str) -> None:
        """Raise :class:`UnsafeArchiveError` naming the first problem (:meth:`problems`) and how many."""
        found = self.problems()
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise UnsafeArchiveError(f"{image}: {found[0]}{more}, where samples must be regular files; re-make "
                                     "the image from a tree of plain files (mksquashfs SRC IMG)")


def file_pieces(size: int, start: int, words: list[int], *, fragment: int, frag_offset: int, fragments: np.ndarray,
                block_size: int) -> list[Piece]:
    """The :class:`Piece` list of a file of ``size`` bytes whose data blocks start at ``start`` with
    size ``words``, and whose tail (``fragment`` >= 0) is at ``frag_offset`` in that fragment block
    (``fragments``: the fragment table, rows ``(start, size word)``)."""
    out, pos = [], start
    for k, w in enumerate(words):
        n = w & DATA_SIZE_MASK
        length = min(block_size, size - k * block_size)
        out.append(Piece(pos if n else -1, n, not w & DATA_STORED and n > 0, 0, length))
        pos += n
    if fragment >= 0:
        fstart, fw = (int(x) for x in fragments[fragment])
        out.append(Piece(fstart, fw & DATA_SIZE_MASK, not fw & DATA_STORED, frag_offset,
                         size - len(words) * block_size, fragment=True))
    return out


def block_totals(stored: np.ndarray, block_ptr: np.ndarray) -> np.ndarray:
    """Per entry, the sum of its blocks' ``stored`` bytes (int64; ``block_ptr`` as in :class:`ImageListing`)."""
    cs = np.zeros(len(stored) + 1, dtype=np.int64)
    np.cumsum(stored, out=cs[1:])
    return cs[block_ptr[1:]] - cs[block_ptr[:-1]]


def raw_offsets(lst: ImageListing) -> np.ndarray:
    """Each entry's ``raw_offset`` (see :class:`ImageListing`): -1 but for files stored as one range."""
    kind, size, start, block_ptr = lst.kind, lst.size, lst.start_block, lst.block_ptr
    fragment, frag_offset, fragments, block_size = lst.fragment, lst.frag_offset, lst.fragments, lst.block_size
    n = len(kind)
    nb = np.diff(block_ptr)
    not_raw = kind != REG
    out = np.where(nb > 0, start, 0)
    block_bytes = np.zeros(0, dtype=np.int64)
    if len(lst.block_words):
        owner = np.repeat(np.arange(n, dtype=np.int64), nb)
        w = lst.block_words.astype(np.int64)
        stored = w & DATA_SIZE_MASK
        # The bytes a stored block must hold: a full block, or the file's remainder for its last block.
        k = np.arange(len(w), dtype=np.int64) - block_ptr[owner]
        expect = np.minimum(block_size, size[owner] - k * block_size)
        bad = ((w & DATA_STORED) == 0) | (stored != expect)
        not_raw[owner[bad]] = True
        block_bytes = block_totals(stored, block_ptr)
    has = fragment >= 0
    if has.any():  # over every row, kept where there is a tail (no gather of those rows: most have one)
        frag = np.maximum(fragment, 0)  # a valid fragment index (checked) where there is one, 0 elsewhere
        fstart = np.ascontiguousarray(fragments[:, 0])[frag]  # 1-d gathers: ~10x a 2-d row's
        fstart += frag_offset
        fword = np.ascontiguousarray(fragments[:, 1])[frag]
        only_tail = nb == 0
        # Raw where the fragment block is stored and (after any blocks) the tail directly follows them.
        tail_raw = (fword & DATA_STORED) != 0
        if not only_tail.all():
            tail_raw &= only_tail | (fstart == start + (block_bytes if len(block_bytes) else 0))
        not_raw |= has & ~tail_raw
        only_tail &= has
        np.copyto(out, fstart, where=only_tail)
    out[not_raw] = -1
    return out

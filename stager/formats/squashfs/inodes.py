"""Inodes, decoded in bulk: given the buffer positions of many inodes, their fields as int64 columns.

Layouts (after the common 16-byte header: type, mode, uid index, gid index, mtime, inode number):

* regular file (2): start_block u32, fragment u32, fragment offset u32, file_size u32, then the
  block list (u32 size words); extended (9): start_block u64, file_size u64, sparse u64, nlink u32,
  fragment u32, fragment offset u32, xattr u32, then the block list. A file has
  ``file_size // block_size`` blocks when it has a fragment (the tail lives there), else
  ``ceil(file_size / block_size)``.
* directory (1): start_block u32 (of its listing, in the directory table), nlink u32, file_size
  u16 (listing bytes + 3), offset u16, parent inode u32; extended (8): nlink u32, file_size u32,
  start_block u32, parent u32, index count u16, offset u16, xattr u32, then index entries
  ``(listing offset u32, directory-table block u32, name size - 1 u32, name)``.
* symlinks, devices, FIFOs and sockets carry nlink at byte 16; stager reports them and reads none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stager.errors import SourceError
from stager.formats.squashfs.columns import ByteView, segment_starts
from stager.formats.squashfs.layout import (
    DIR,
    DIR_DTYPE,
    DIR_INDEX,
    HEAD_DTYPE,
    LDIR,
    LDIR_DTYPE,
    LREG,
    LREG_DTYPE,
    MAX_NAME,
    NO_FRAGMENT,
    REG,
    REG_DTYPE,
    basic_type,
)


@dataclass
class Inodes:
    """Decoded inodes, int64 columns of shape ``(n,)``; fields that a type lacks are 0 (``fragment``:
    -1). Files: ``start_block`` (image offset of the first data block), ``size``, ``fragment``,
    ``frag_offset``, and the block list as ``block_ptr`` (shape ``(n + 1,)``) into ``block_words``
    (uint32 size words). Directories: ``dir_block``/``dir_offset`` (listing reference),
    ``listing`` (listing bytes, ``file_size - 3``), ``index_pos``/``index_count`` (extended)."""

    itype: np.ndarray
    mode: np.ndarray
    number: np.ndarray
    nlink: np.ndarray
    start_block: np.ndarray
    size: np.ndarray
    fragment: np.ndarray
    frag_offset: np.ndarray
    block_ptr: np.ndarray
    block_words: np.ndarray
    dir_block: np.ndarray
    dir_offset: np.ndarray
    listing: np.ndarray
    index_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    index_count: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def _damaged(image: str, what: str) -> SourceError:
    return SourceError(f"{image}: damaged inode table: {what}; the image is damaged: re-copy or re-make it")


_CHUNK = 1 << 18  # inodes decoded per pass: bounds the temporaries (a million files' structs are ~40 MB)
_COLUMNS = ("itype", "mode", "number", "nlink", "start_block", "size", "fragment", "frag_offset", "dir_block",
            "dir_offset", "listing", "index_pos", "index_count")


def decode_inodes(v: ByteView, pos: np.ndarray, entry_types: np.ndarray, *, block_size: int, image: str,
                  name_of: Callable[[int], str] | None = None, into: dict[str, np.ndarray] | None = None) -> Inodes:
    """Decode the inodes at buffer positions ``pos`` whose directory entries say ``entry_types``
    (basic types). ``name_of(i)`` (optional) names entry ``i`` in messages; otherwise positions do.
    ``into`` (optional): int64 arrays of ``len(pos)`` for the first eight columns (``itype`` to
    ``frag_offset``), written in place (the listing's own columns: no copy of them later)."""
    n = len(pos)

    def where(i: int) -> str:
        return repr(name_of(i)) if name_of is not None else f"inode at table byte {int(pos[i])}"

    if n and (pos.min() < 0 or pos.max() + 16 > v.n):
        i = int(np.argmax((pos < 0) | (pos + 16 > v.n)))
        raise _damaged(image, f"{where(i)} lies past the table's end")
    # Directory columns only where there are directories (a level of a million files has none).
    nd = n if (entry_types == DIR).any() else 0
    # The first eight columns are filled per chunk (_decode): a chunk of plain files writes every one of
    # them, so only the others are cleared to their defaults first (no pass over a million rows for naught).
    cols = {c: np.empty(n if k < 8 else nd, dtype=np.int64) if into is None or k >= 8 else into[c]
            for k, c in enumerate(_COLUMNS)}
    for c in _COLUMNS[8:]:
        cols[c][:] = 0
    out = Inodes(block_ptr=np.zeros(n + 1, dtype=np.int64), block_words=np.zeros(0, dtype=np.uint32), **cols)
    nb = np.empty(n, dtype=np.int64)
    words: list[np.ndarray] = []
    for a in range(0, n, _CHUNK):  # each chunk writes into its slice of the columns
        b = min(n, a + _CHUNK)
        part = Inodes(block_ptr=out.block_ptr, block_words=out.block_words,
                      **{c: col[a:b] if len(col) else col for c, col in cols.items()})
        _decode(v, pos[a:b], entry_types[a:b], part, nb=nb[a:b], words=words, block_size=block_size, image=image,
                where=lambda i, a=a: where(a + i))  # type: ignore[misc]
    out.block_ptr = segment_starts(nb)
    out.block_words = np.concatenate(words) if words else np.zeros(0, dtype=np.uint32)
    return out


def _decode(v: ByteView, q: np.ndarray, entry_types: np.ndarray, out: Inodes, *, nb: np.ndarray,
            words: list[np.ndarray], block_size: int, image: str, where: Callable[[int], str]) -> None:
    """One chunk of :func:`decode_inodes`, written into ``out`` (views of the columns' slices, the
    first eight uninitialised: every one is written here)."""
    out.nlink[:] = 1
    if (entry_types == REG).all() and (v.scalars(_U16)[q] == REG).all():
        _plain_files(v, q, out, nb, words, block_size=block_size, image=image, where=where)
        return
    for c in ("start_block", "size", "frag_offset"):  # what a type without them leaves 0
        getattr(out, c)[:] = 0
    out.fragment[:] = -1
    head = v.records(q, HEAD_DTYPE)
    itype = out.itype
    itype[:] = head["type"]
    mismatch = (itype < 1) | (itype > 14) | (np.where(itype > 7, itype - 7, itype) != entry_types)
    if mismatch.any():
        i = int(np.argmax(mismatch))
        raise _damaged(image, f"{where(i)}: its directory entry says type {int(entry_types[i])}, the inode "
                              f"{int(itype[i])}")
    out.mode[:] = head["mode"]
    out.number[:] = head["number"]
    need = np.where(itype == REG, 32, np.where(itype == LREG, 56, np.where(itype == LDIR, 40,
                    np.where(itype == DIR, 32, 20))))
    if (q + need > v.n).any():
        i = int(np.argmax(q + need > v.n))
        raise _damaged(image, f"{where(i)} runs past the table's end")
    other = (itype != REG) & (itype != LREG) & (itype != DIR)
    out.nlink[other] = head["nlink"][other]  # LDIR, symlinks, devices, IPC: nlink at byte 16
    _files(v, q, out, nb, words, block_size=block_size, image=image, where=where)
    _dirs(v, q, out, image=image, where=where)


def _plain_files(v: ByteView, q: np.ndarray, out: Inodes, nb: np.ndarray, words: list[np.ndarray], *,
                 block_size: int, image: str, where: Callable[[int], str]) -> None:
    """:func:`_decode` of a chunk of basic regular files only (a class folder's photos): one gather of
    their 32-byte inodes, no per-type masks. 32-bit sizes and starts cannot be out of range."""
    over = q + REG_DTYPE.itemsize > v.n
    if over.any():
        raise _damaged(image, f"{where(int(np.argmax(over)))} runs past the table's end")
    r = v.records(q, REG_DTYPE)
    out.itype[:] = REG
    out.mode[:], out.number[:] = r["mode"], r["number"]
    out.start_block[:], out.frag_offset[:], out.size[:] = r["start"], r["offset"], r["size"]
    out.fragment[:] = _fragments(r["fragment"])
    log = block_size.bit_length() - 1  # a power of two
    size = out.size
    nb[:] = np.where(out.fragment >= 0, size >> log, (size + (block_size - 1)) >> log)
    if not nb.any():  # every file a tail in a fragment block (small photos): no block lists
        return
    lists = q + REG_DTYPE.itemsize
    over = lists + 4 * nb > v.n
    if over.any():
        i = int(np.argmax(over))
        raise _damaged(image, f"{where(i)}: a file of {int(size[i])} bytes needs {int(nb[i])} block sizes, "
                              "past the table's end")
    if (nb == 1).all():
        words.append(v.scalars(_WORD)[lists].astype(np.uint32))
        return
    first = segment_starts(nb)[:-1]
    idx = np.repeat(lists - 4 * first, nb) + 4 * np.arange(int(nb.sum()), dtype=np.int64)
    words.append(v.scalars(_WORD)[idx].astype(np.uint32))


def _fragments(col: np.ndarray) -> np.ndarray:
    return np.where(col == NO_FRAGMENT, -1, col.astype(np.int64))


def _files(v: ByteView, q: np.ndarray, out: Inodes, nb: np.ndarray, words: list[np.ndarray], *, block_size: int,
           image: str, where: Callable[[int], str]) -> None:
    reg, lreg = out.itype == REG, out.itype == LREG
    if reg.all():  # the usual case: every entry a plain file
        r = v.records(q, REG_DTYPE)
        out.start_block[:], out.fragment[:] = r["start"], _fragments(r["fragment"])
        out.frag_offset[:], out.size[:] = r["offset"], r["size"]
    elif reg.any():
        r = v.records(q[reg], REG_DTYPE)
        out.start_block[reg], out.fragment[reg] = r["start"], _fragments(r["fragment"])
        out.frag_offset[reg], out.size[reg] = r["offset"], r["size"]
    if lreg.any():
        r = v.records(q[lreg], LREG_DTYPE)
        out.start_block[lreg] = r["start"].view(np.int64)  # past 2**63: negative, refused below
        out.size[lreg] = r["size"].view(np.int64)
        out.nlink[lreg], out.fragment[lreg], out.frag_offset[lreg] = r["nlink"], _fragments(r["fragment"]), r["offset"]
    files = reg | lreg
    size = out.size
    if (size[files] < 0).any() or (out.start_block[files] < 0).any():
        i = int(np.argmax(files & ((size < 0) | (out.start_block < 0))))
        raise _damaged(image, f"{where(i)}: file size or start out of range")
    nb[:] = np.where(out.fragment >= 0, size // block_size, -(-size // block_size))
    nb[~files] = 0
    lists = q + np.where(out.itype == REG, 32, 56)
    over = files & (lists + 4 * nb > v.n)
    if over.any():
        i = int(np.argmax(over))
        raise _damaged(image, f"{where(i)}: a file of {int(size[i])} bytes needs {int(nb[i])} block sizes, "
                              "past the table's end")
    if files.all() and (nb == 1).all():  # one block each (most photos at 128 KiB blocks): a plain gather
        words.append(v.records(lists, _WORD).astype(np.uint32))
        return
    fnb = nb[files]
    first = segment_starts(fnb)[:-1]
    idx = np.repeat(lists[files] - 4 * first, fnb) + 4 * np.arange(int(fnb.sum()), dtype=np.int64)
    words.append(v.records(idx, _WORD).astype(np.uint32))


_WORD = np.dtype("<u4")
_U16 = np.dtype("<u2")


def _dirs(v: ByteView, q: np.ndarray, out: Inodes, *, image: str, where: Callable[[int], str]) -> None:
    d, ld = out.itype == DIR, out.itype == LDIR
    if d.any():
        r = v.records(q[d], DIR_DTYPE)
        out.dir_block[d], out.nlink[d], out.dir_offset[d] = r["start"], r["nlink"], r["offset"]
        out.listing[d] = r["size"].astype(np.int64) - 3
    if ld.any():
        r = v.records(q[ld], LDIR_DTYPE)
        out.listing[ld] = r["size"].astype(np.int64) - 3
        out.dir_block[ld], out.index_count[ld], out.dir_offset[ld] = r["start"], r["count"], r["offset"]
        out.index_pos[ld] = q[ld] + 40
    if not (d.any() or ld.any()):
        return
    bad = (d | ld) & (out.listing < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise _damaged(image, f"{where(i)}: a directory of {int(out.listing[i]) + 3} bytes (at least 3)")


def dir_index(v: ByteView, table: memoryview, pos: int, *, count: int, image: str, name: str) -> list[int]:
    """The listing offsets of an extended directory's ``count`` index entries at buffer ``pos``."""
    offsets = []
    for _ in range(count):
        if pos + DIR_INDEX.size > v.n:
            raise _damaged(image, f"the directory index of {name!r} runs past the table's end")
        index, _block, size = DIR_INDEX.unpack_from(table, pos)
        if size + 1 > MAX_NAME:
            raise _damaged(image, f"the directory index of {name!r} has a name of {size + 1} bytes")
        offsets.append(index)
        pos += DIR_INDEX.size + size + 1
    return offsets


__all__ = ["Inodes", "basic_type", "decode_inodes", "dir_index"]

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
    DIR_INDEX,
    LDIR,
    LREG,
    MAX_NAME,
    NO_FRAGMENT,
    REG,
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


def decode_inodes(v: ByteView, pos: np.ndarray, entry_types: np.ndarray, *, block_size: int, image: str,
                  name_of: Callable[[int], str] | None = None) -> Inodes:
    """Decode the inodes at buffer positions ``pos`` whose directory entries say ``entry_types``
    (basic types). ``name_of(i)`` (optional) names entry ``i`` in messages; otherwise positions do."""
    n = len(pos)

    def where(i: int) -> str:
        return repr(name_of(i)) if name_of is not None else f"inode at table byte {int(pos[i])}"

    if n and (pos.min() < 0 or pos.max() + 16 > v.n):
        i = int(np.argmax((pos < 0) | (pos + 16 > v.n)))
        raise _damaged(image, f"{where(i)} lies past the table's end")
    q = pos
    itype = v.u16(q)
    mismatch = (itype < 1) | (itype > 14) | (np.where(itype > 7, itype - 7, itype) != entry_types)
    if mismatch.any():
        i = int(np.argmax(mismatch))
        raise _damaged(image, f"{where(i)}: its directory entry says type {int(entry_types[i])}, the inode "
                              f"{int(itype[i])}")
    z = np.zeros(n, dtype=np.int64)
    out = Inodes(itype, v.u16(q + 2), v.u32(q + 12), np.ones(n, dtype=np.int64), z.copy(), z.copy(),
                 np.full(n, -1, dtype=np.int64), z.copy(), np.zeros(n + 1, dtype=np.int64),
                 np.zeros(0, dtype=np.uint32), z.copy(), z.copy(), z.copy(), z.copy(), z.copy())
    need = np.where(itype == REG, 32, np.where(itype == LREG, 56, np.where(itype == LDIR, 40,
                    np.where(itype == DIR, 32, 20))))
    if (q + need > v.n).any():
        i = int(np.argmax(q + need > v.n))
        raise _damaged(image, f"{where(i)} runs past the table's end")
    other = (itype != REG) & (itype != LREG) & (itype != DIR)
    out.nlink[other] = v.u32(q[other] + 16)  # LDIR, symlinks, devices, IPC: nlink at byte 16
    _files(v, q, out, block_size=block_size, image=image, where=where)
    _dirs(v, q, out, image=image, where=where)
    return out


def _files(v: ByteView, q: np.ndarray, out: Inodes, *, block_size: int, image: str,
           where: Callable[[int], str]) -> None:
    reg, lreg = out.itype == REG, out.itype == LREG
    rq, lq = q[reg], q[lreg]
    out.start_block[reg] = v.u32(rq + 16)
    frag = v.u32(rq + 20)
    out.fragment[reg] = np.where(frag == NO_FRAGMENT, -1, frag)
    out.frag_offset[reg] = v.u32(rq + 24)
    out.size[reg] = v.u32(rq + 28)
    out.start_block[lreg] = v.u64(lq + 16)
    out.size[lreg] = v.u64(lq + 24)
    out.nlink[lreg] = v.u32(lq + 40)
    frag = v.u32(lq + 44)
    out.fragment[lreg] = np.where(frag == NO_FRAGMENT, -1, frag)
    out.frag_offset[lreg] = v.u32(lq + 48)
    files = reg | lreg
    size = out.size
    if (size[files] < 0).any() or (out.start_block[files] < 0).any():
        i = int(np.argmax(files & ((size < 0) | (out.start_block < 0))))
        raise _damaged(image, f"{where(i)}: file size or start out of range")
    nb = np.where(out.fragment >= 0, size // block_size, -(-size // block_size))
    nb[~files] = 0
    lists = q + np.where(out.itype == REG, 32, 56)
    if (files & (lists + 4 * nb > v.n)).any():
        i = int(np.argmax(files & (lists + 4 * nb > v.n)))
        raise _damaged(image, f"{where(i)}: a file of {int(size[i])} bytes needs {int(nb[i])} block sizes, "
                              "past the table's end")
    out.block_ptr = segment_starts(nb)
    fnb = nb[files]
    first = segment_starts(fnb)[:-1]
    idx = np.repeat(lists[files] - 4 * first, fnb) + 4 * np.arange(int(fnb.sum()), dtype=np.int64)
    out.block_words = v.u32(idx).astype(np.uint32)


def _dirs(v: ByteView, q: np.ndarray, out: Inodes, *, image: str, where: Callable[[int], str]) -> None:
    d, ld = out.itype == DIR, out.itype == LDIR
    dq, lq = q[d], q[ld]
    out.dir_block[d] = v.u32(dq + 16)
    out.nlink[d] = v.u32(dq + 20)
    out.listing[d] = v.u16(dq + 24) - 3
    out.dir_offset[d] = v.u16(dq + 26)
    out.listing[ld] = v.u32(lq + 20) - 3
    out.dir_block[ld] = v.u32(lq + 24)
    out.index_count[ld] = v.u16(lq + 32)
    out.dir_offset[ld] = v.u16(lq + 34)
    out.index_pos[ld] = lq + 40
    bad = (d | ld) & (out.listing < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise _damaged(image, f"{where(i)}: a directory of {int(out.listing[i]) + 3} bytes (at least 3)")


def dir_index(v: ByteView, table: bytes, pos: int, *, count: int, image: str, name: str) -> list[int]:
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

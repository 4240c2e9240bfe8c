"""SquashFS 4.0 on-disk structures and constants (little-endian), as the Linux kernel reads them.

The reference is the kernel's ``fs/squashfs/squashfs_fs.h`` and squashfs-tools' ``squashfs_fs.h``;
this module restates what stager needs, in its own words (docs/formats.md, "squashfs"):

* A 96-byte **superblock** at offset 0 (:class:`Superblock`), then, when the flag ``COMP_OPT`` is
  set, the compressor's options as one uncompressed metadata block.
* **Data blocks** of up to ``block_size`` bytes. A file's blocks are consecutive from its
  ``start_block``; each has a 32-bit size word whose bit 24 (:data:`DATA_STORED`) means "stored
  uncompressed" and whose low 24 bits are the bytes on disk (0: a sparse block of zeros).
* **Fragment blocks**: data blocks holding the tails of several files back to back; a file names
  one by index and an offset into its uncompressed bytes.
* **Metadata blocks** of at most 8 KiB uncompressed, each preceded by a 16-bit header whose bit 15
  (:data:`META_STORED`) means "stored" and whose low 15 bits are the bytes that follow. The inode
  and directory tables are streams of such blocks; a *reference* into them is
  ``(block start relative to the table) << 16 | offset in the uncompressed block``. Every block but
  a table's last holds exactly 8 KiB, so a structure may run across blocks.
* The fragment, export (inode lookup) and id tables are arrays of fixed-size records in metadata
  blocks, found through a raw array of u64 block positions at the table's start field.

Tables follow the data in this order, each table's blocks just before its own index, which the
kernel checks: inode table < directory table < fragment blocks < fragment index < export blocks <
export index < id blocks < id index (< xattr tables) <= ``bytes_used``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

import numpy as np

MAGIC = 0x73717368  # b"hsqs" read as a little-endian u32
SUPERBLOCK = struct.Struct("<IIIIIHHHHHHQQQQQQQQ")
SUPERBLOCK_SIZE = SUPERBLOCK.size  # 96
assert SUPERBLOCK_SIZE == 96

METADATA_SIZE = 8192  # uncompressed bytes of a full metadata block
META_STORED = 1 << 15  # metadata header: block stored uncompressed
META_SIZE_MASK = META_STORED - 1
DATA_STORED = 1 << 24  # data block / fragment size word: stored uncompressed
DATA_SIZE_MASK = DATA_STORED - 1
INVALID_TABLE = 0xFFFF_FFFF_FFFF_FFFF  # an absent table (export, xattr)
NO_FRAGMENT = 0xFFFF_FFFF
NO_XATTR = 0xFFFF_FFFF
MIN_BLOCK_LOG, MAX_BLOCK_LOG = 12, 20  # 4 KiB .. 1 MiB data blocks
MAX_NAME = 256  # bytes of a directory entry's name (the kernel's SQUASHFS_NAME_LEN)
DIR_COUNT = 256  # entries under one directory header, at most
PAD = 4096  # images are padded to a multiple of this (mksquashfs's default)

# Superblock flags (bit numbers of squashfs_fs.h's SQUASHFS_NOI...).
FLAG_NOI = 1 << 0  # inodes (metadata) uncompressed
FLAG_NOD = 1 << 1  # data uncompressed
FLAG_CHECK = 1 << 2
FLAG_NOF = 1 << 3  # fragments uncompressed
FLAG_NO_FRAG = 1 << 4  # no fragments
FLAG_ALWAYS_FRAG = 1 << 5  # tails of large files in fragments too
FLAG_DUPLICATES = 1 << 6  # duplicate files share data
FLAG_EXPORT = 1 << 7  # export (inode lookup) table present
FLAG_NOX = 1 << 8  # xattrs uncompressed
FLAG_NO_XATTR = 1 << 9  # no xattrs
FLAG_COMP_OPT = 1 << 10  # compressor options follow the superblock
FLAG_NOID = 1 << 11  # id table uncompressed

# Inode types; the extended ("L") variants carry nlink/xattr and 64-bit fields.
DIR, REG, SYMLINK, BLKDEV, CHRDEV, FIFO, SOCKET = 1, 2, 3, 4, 5, 6, 7
LDIR, LREG, LSYMLINK, LBLKDEV, LCHRDEV, LFIFO, LSOCKET = 8, 9, 10, 11, 12, 13, 14
KIND_NAMES = {DIR: "directory", REG: "regular file", SYMLINK: "symlink", BLKDEV: "block device",
              CHRDEV: "character device", FIFO: "FIFO", SOCKET: "socket"}


def basic_type(t: int) -> int:
    """The basic inode type (1..7) of a basic or extended type (1..14)."""
    return t - 7 if t > 7 else t


# Inode layouts: offsets of the fields this package reads, after the 16-byte common header
# (type u16, mode u16, uid index u16, gid index u16, mtime u32, inode number u32).
INODE_HEADER = struct.Struct("<HHHHII")
REG_INODE = struct.Struct("<HHHHIIIIII")  # + start_block u32, fragment u32, offset u32, file_size u32
LREG_INODE = struct.Struct("<HHHHIIQQQIIII")  # + start u64, size u64, sparse u64, nlink, fragment, offset, xattr
DIR_INODE = struct.Struct("<HHHHIIIIHHI")  # + start_block u32, nlink u32, file_size u16, offset u16, parent u32
LDIR_INODE = struct.Struct("<HHHHIIIIIIHHI")  # + nlink, file_size u32, start, parent, i_count u16, offset u16, xattr
DIR_INDEX = struct.Struct("<III")  # index (listing offset), start_block (dir table), name size - 1; then the name
DIR_HEADER = struct.Struct("<III")  # count - 1, start_block (inode table), base inode number
DIR_ENTRY = struct.Struct("<HhHH")  # offset (in inode block), inode number delta, type, name size - 1; then the name
FRAGMENT_ENTRY = struct.Struct("<QII")  # start, size word, unused
assert (REG_INODE.size, LREG_INODE.size, DIR_INODE.size, LDIR_INODE.size) == (32, 56, 32, 40)

# The same layouts as numpy dtypes, for decoding many at once (stager.formats.squashfs.inodes).
_COMMON = [("type", "<u2"), ("mode", "<u2"), ("uid", "<u2"), ("gid", "<u2"), ("mtime", "<u4"), ("number", "<u4")]
HEAD_DTYPE = np.dtype([*_COMMON, ("nlink", "<u4")])  # nlink: every type but REG and DIR has it here
REG_DTYPE = np.dtype([*_COMMON, ("start", "<u4"), ("fragment", "<u4"), ("offset", "<u4"), ("size", "<u4")])
LREG_DTYPE = np.dtype([*_COMMON, ("start", "<u8"), ("size", "<u8"), ("sparse", "<u8"), ("nlink", "<u4"),
                       ("fragment", "<u4"), ("offset", "<u4"), ("xattr", "<u4")])
DIR_DTYPE = np.dtype([*_COMMON, ("start", "<u4"), ("nlink", "<u4"), ("size", "<u2"), ("offset", "<u2"),
                      ("parent", "<u4")])
LDIR_DTYPE = np.dtype([*_COMMON, ("nlink", "<u4"), ("size", "<u4"), ("start", "<u4"), ("parent", "<u4"),
                       ("count", "<u2"), ("offset", "<u2"), ("xattr", "<u4")])
ENTRY_DTYPE = np.dtype([("offset", "<u2"), ("delta", "<i2"), ("type", "<u2"), ("size", "<u2")])
HEADER_DTYPE = np.dtype([("count", "<u4"), ("start", "<u4"), ("number", "<u4")])
assert (REG_DTYPE.itemsize, LREG_DTYPE.itemsize, DIR_DTYPE.itemsize, LDIR_DTYPE.itemsize) == (32, 56, 32, 40)

# Compressor ids (the superblock's ``compression``).
GZIP, LZMA, LZO, XZ, LZ4, ZSTD = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Superblock:
    """The 96-byte superblock, field for field (names as in squashfs_fs.h)."""

    magic: int
    inodes: int
    mkfs_time: int
    block_size: int
    fragments: int
    compression: int
    block_log: int
    flags: int
    no_ids: int
    major: int
    minor: int
    root_inode: int
    bytes_used: int
    id_table_start: int
    xattr_id_table_start: int
    inode_table_start: int
    directory_table_start: int
    fragment_table_start: int
    lookup_table_start: int

    @classmethod
    def unpack(cls, raw: bytes) -> Superblock:
        return cls(*SUPERBLOCK.unpack_from(raw))

    def pack(self) -> bytes:
        return SUPERBLOCK.pack(*(getattr(self, f.name) for f in fields(self)))

    def has(self, flag: int) -> bool:
        return bool(self.flags & flag)


def inode_ref(block: int, offset: int) -> int:
    """A reference into a metadata table: the block's start relative to the table, and the offset."""
    return (block << 16) | offset


def split_ref(ref: int) -> tuple[int, int]:
    """``(block start relative to the table, offset in its uncompressed bytes)`` of a reference."""
    return ref >> 16, ref & 0xFFFF

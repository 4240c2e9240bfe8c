"""Read a SquashFS image without mounting it: :class:`SquashImage`.

Opening checks what the kernel checks before it mounts (magic, version 4.0, block size, compressor,
``bytes_used`` against the file's length, every table inside the image and in the kernel's order)
and reads the small tables (ids, fragments). :meth:`SquashImage.listing` decodes the inode and
directory tables in bulk into an :class:`~.listing.ImageListing`; :meth:`SquashImage.read` and
:meth:`~SquashImage.read_many` return files' bytes: a stored contiguous file with one ``pread`` (and
neighbours coalesced into one, as tar shards are read), compressed blocks decompressed in process,
fragment blocks through a small LRU so the tails of many small files cost one decompression.

Every problem is a one-line stager error naming the image: :class:`~stager.errors.SourceError` for
a file that is not SquashFS, a truncated or damaged one; :class:`~stager.errors.MissingBackendError`
for a compressor whose Python package is absent; :class:`~stager.errors.UnsafeArchiveError` for
names that are not file names. Reading a damaged block of one file raises
:class:`~stager.errors.CorruptSampleError`. The descriptor is reopened after ``fork()``.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from stager.errors import CorruptSampleError, SourceError, SourceNotFoundError
from stager.formats.base import pread_runs
from stager.formats.squashfs.compress import CODECS, Codec, DecompressError, codec_by_id, decompressor
from stager.formats.squashfs.layout import (
    DATA_SIZE_MASK,
    FLAG_COMP_OPT,
    INVALID_TABLE,
    KIND_NAMES,
    LREG,
    LREG_INODE,
    MAGIC,
    MAX_BLOCK_LOG,
    META_SIZE_MASK,
    META_STORED,
    METADATA_SIZE,
    MIN_BLOCK_LOG,
    NO_FRAGMENT,
    REG,
    REG_INODE,
    SUPERBLOCK_SIZE,
    Superblock,
    basic_type,
    split_ref,
)
from stager.formats.squashfs.listing import ImageListing, Piece, file_pieces
from stager.formats.squashfs.meta import MetaTable, pread_exact, read_index, read_indexed, read_table
from stager.formats.squashfs.refs import read_by_refs
from stager.formats.squashfs.walk import walk

_FRAGMENT_CACHE = 32  # decompressed fragment blocks kept (4 MiB at the default 128 KiB block size)
_META_CACHE = 64  # decompressed inode-table blocks kept (512 KiB) for reads by inode reference


def image_codec(path: str) -> Codec | None:
    """The compressor the superblock of the image at ``path`` names, from its first 96 bytes; None
    when ``path`` is no regular file starting with a SquashFS superblock of a known compressor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw = os.pread(fd, SUPERBLOCK_SIZE, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < SUPERBLOCK_SIZE or struct.unpack_from("<I", raw)[0] != MAGIC:
        return None
    return CODECS.get(Superblock.unpack(raw).compression)


def _damaged(image: str, what: str) -> SourceError:
    return SourceError(f"{image}: {what}; the image is damaged or truncated: re-copy it or re-make it with mksquashfs")


class SquashImage:
    """An open SquashFS 4.0 image.

    ``SquashImage(path)`` opens and checks it; ``name`` (default: ``path``) names it in messages.
    ``superblock``, ``codec`` (:class:`~.compress.Codec`), ``block_size``, ``ids`` (uid/gid table)
    and ``fragments`` (shape ``(n, 2)``: start, size word) are read at once; the listing when first
    asked for. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], *, name: str | None = None) -> None:
        self.path = os.fspath(path)
        self.name = name or self.path
        self._fd: int | None = None
        self._pid = 0
        self._map: memoryview | None = None
        self._map_pid = 0
        self._listing: ImageListing | None = None
        self._inode_table: MetaTable | None = None
        self._frag_cache: OrderedDict[int, bytes] = OrderedDict()
        self._meta_cache: OrderedDict[int, tuple[bytes, int]] = OrderedDict()
        fd = self.fd()
        try:
            self.file_size = os.fstat(fd).st_size
            self.superblock = self._check_superblock(fd)
            self.codec: Codec = codec_by_id(self.superblock.compression, self.name)
            self._decompress = decompressor(self.codec, self.name)
            self._read_tables(fd)
        except BaseException:
            self.close()
            raise

    # ---- opening --------------------------------------------------------------------------------

    def fd(self) -> int:
        """This process's descriptor (reopened after ``fork()``)."""
        if self._fd is None or self._pid != os.getpid():
            try:  # O_NONBLOCK: a FIFO planted under the image's name must not block the open
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"{self.name}: no such image") from exc
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
                os.close(fd)
                what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
                raise SourceError(f"{self.name}: {what}, not a SquashFS image; name an image file")
            self._fd = fd
            self._pid = os.getpid()
        return self._fd

    def mapping(self) -> memoryview:
        """The whole image as a read-only ``memoryview`` of one ``mmap`` in this process (mapped again
        after ``fork()``): stored files are zero-copy slices of it, as a mapped tar shard's members are.
        :meth:`close` drops it; the mapping itself goes with the last slice handed out."""
        if self._map is None or self._map_pid != os.getpid():
            mm = mmap.mmap(self.fd(), self.file_size, prot=mmap.PROT_READ) if self.file_size else None
            self._map = memoryview(mm) if mm is not None else memoryview(b"")
            self._map_pid = os.getpid()
        return self._map

    def _check_superblock(self, fd: int) -> Superblock:
        raw = os.pread(fd, SUPERBLOCK_SIZE, 0)
        if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != MAGIC:
            raise SourceError(f"{self.name}: not a SquashFS image (no 'hsqs' magic at byte 0); expected an image "
                              "made by mksquashfs, gensquashfs or stager pack --format squashfs")
        if len(raw) < SUPERBLOCK_SIZE:
            raise _damaged(self.name, f"truncated: {len(raw)} bytes, shorter than a superblock")
        sb = Superblock.unpack(raw)
        if (sb.major, sb.minor) != (4, 0):
            raise SourceError(f"{self.name}: SquashFS {sb.major}.{sb.minor}; stager reads 4.0 images only: re-make it "
                              "with mksquashfs 4.x")
        if not (MIN_BLOCK_LOG <= sb.block_log <= MAX_BLOCK_LOG and sb.block_size == 1 << sb.block_log):
            raise _damaged(self.name, f"block size {sb.block_size} (log {sb.block_log}) is not a power of two "
                           "from 4 KiB to 1 MiB")
        if sb.bytes_used > self.file_size:
            raise SourceError(f"{self.name}: truncated: the superblock says {sb.bytes_used} bytes, the file has "
                              f"{self.file_size}; re-copy the image")
        if not SUPERBLOCK_SIZE <= sb.inode_table_start < sb.directory_table_start < sb.bytes_used:
            raise _damaged(self.name, "the inode and directory tables are out of order or outside the image")
        if split_ref(sb.root_inode)[0] >= sb.directory_table_start - sb.inode_table_start:
            raise _damaged(self.name, "the root inode lies outside the inode table")
        return sb

    def _read_tables(self, fd: int) -> None:
        """Check the table layout as the kernel does; read the id and fragment tables."""
        sb, name = self.superblock, self.name
        nxt = sb.bytes_used
        if sb.xattr_id_table_start != INVALID_TABLE:
            if sb.xattr_id_table_start + 16 > nxt:
                raise _damaged(name, "the xattr table lies outside the image")
            kv_start, _ids = struct.unpack("<QI", pread_exact(fd, 12, sb.xattr_id_table_start, name, "xattr table"))
            if kv_start >= sb.xattr_id_table_start:
                raise _damaged(name, "the xattr table is out of order")
            nxt = kv_start
        if sb.no_ids == 0:
            raise _damaged(name, "the id table is empty")
        idx = read_index(fd, sb.id_table_start, 4 * sb.no_ids, next_table=nxt, image=name, what="id table")
        self.ids = np.frombuffer(read_indexed(fd, idx, sb.id_table_start, nbytes=4 * sb.no_ids,
                                              decompress=self._decompress, image=name, what="id table"), dtype="<u4")
        nxt = int(idx[0])
        if sb.lookup_table_start != INVALID_TABLE:
            idx = read_index(fd, sb.lookup_table_start, 8 * sb.inodes, next_table=nxt, image=name, what="export table")
            nxt = int(idx[0]) if len(idx) else nxt
        self.fragments = np.zeros((0, 2), dtype=np.int64)
        if sb.fragments:
            idx = read_index(fd, sb.fragment_table_start, 16 * sb.fragments, next_table=nxt, image=name,
                             what="fragment table")
            raw = read_indexed(fd, idx, sb.fragment_table_start, nbytes=16 * sb.fragments,
                               decompress=self._decompress, image=name, what="fragment table")
            rec = np.frombuffer(raw, dtype=np.dtype([("start", "<u8"), ("size", "<u4"), ("unused", "<u4")]))
            self.fragments = np.stack([rec["start"].astype(np.int64), rec["size"].astype(np.int64)], axis=1)
            st, sz = self.fragments[:, 0], self.fragments[:, 1] & DATA_SIZE_MASK
            if ((st < SUPERBLOCK_SIZE) | (st + sz > sb.inode_table_start) | (sz > sb.block_size)
                    | (self.fragments[:, 1] >> 25 != 0)).any():
                raise _damaged(name, "a fragment block lies outside the data area")
            nxt = int(idx[0])
        if sb.directory_table_start > nxt:
            raise _damaged(name, "the directory table overlaps the tables after it")
        self._dir_end = nxt
        if sb.flags & FLAG_COMP_OPT:
            (hdr,) = struct.unpack("<H", pread_exact(fd, 2, SUPERBLOCK_SIZE, name, "compressor options"))
            if not hdr & META_STORED or SUPERBLOCK_SIZE + 2 + (hdr & META_SIZE_MASK) > sb.inode_table_start:
                raise _damaged(name, "the compressor options block is malformed")

    @property
    def block_size(self) -> int:
        return self.superblock.block_size

    # ---- listing --------------------------------------------------------------------------------

    def inode_table(self) -> MetaTable:
        if self._inode_table is None:
            sb = self.superblock
            self._inode_table = read_table(self.fd(), sb.inode_table_start, sb.directory_table_start,
                                           decompress=self._decompress, image=self.name, what="inode table")
        return self._inode_table

    def listing(self) -> ImageListing:
        """Every entry of the image (decoded once, then cached)."""
        if self._listing is None:
            sb = self.superblock
            dir_t = read_table(self.fd(), sb.directory_table_start, self._dir_end, decompress=self._decompress,
                               image=self.name, what="directory table")
            self._listing = walk(self.inode_table(), dir_t, sb.root_inode, block_size=sb.block_size,
                                 fragments=self.fragments, data_end=sb.inode_table_start, image=self.name,
                                 entries=sb.inodes - 1)
        return self._listing

    # ---- reading files --------------------------------------------------------------------------

    def ref_pieces(self, ref: int) -> tuple[int, list[Piece]]:
        """``(size, pieces)`` of the regular file whose inode is at reference ``ref``
        (``ImageListing.inode_ref``), from the inode-table blocks that hold that inode alone (kept in a
        small LRU): no directory walk and no whole table, so a reader that kept each sample's reference
        (a loader) starts at once on an image of a million files."""
        what = f"inode {ref:#x}"
        rel, off = split_ref(ref)
        head = self._meta_bytes(rel, off, REG_INODE.size, what)
        itype = struct.unpack_from("<H", head)[0]
        if itype == REG:
            *_c, start, frag, frag_off, size = REG_INODE.unpack_from(head)
        elif itype == LREG:
            head = self._meta_bytes(rel, off, LREG_INODE.size, what)
            *_c, start, size, _sparse, _nlink, frag, frag_off, _xattr = LREG_INODE.unpack_from(head)
        else:
            raise CorruptSampleError(f"{self.name}: {what} is a {KIND_NAMES.get(basic_type(itype), 'damaged inode')}, "
                                     "not a regular file; the index does not match the image: re-index it")
        fragment = -1 if frag == NO_FRAGMENT else frag
        nb = size // self.block_size if fragment >= 0 else -(-size // self.block_size)
        fixed = REG_INODE.size if itype == REG else LREG_INODE.size
        words = struct.unpack_from(f"<{nb}I", self._meta_bytes(rel, off, fixed + 4 * nb, what), fixed) if nb else ()
        if fragment >= len(self.fragments) or start + sum(w & DATA_SIZE_MASK for w in words) > \
                self.superblock.inode_table_start:
            raise CorruptSampleError(f"{self.name}: {what}: its data or fragment lies outside the data area; the "
                                     "image is damaged: re-copy or re-make it")
        return size, file_pieces(size, start, list(words), fragment=fragment, frag_offset=frag_off,
                                 fragments=self.fragments, block_size=self.block_size)

    def _meta_bytes(self, rel: int, offset: int, n: int, what: str) -> bytes:
        """``n`` uncompressed bytes of the inode table from reference ``(rel, offset)``: the block that
        starts ``rel`` bytes into the table on disk, then as many following blocks as they run into."""
        data, nxt = self.meta_block(rel, what)
        if offset + n <= len(data):
            return data[offset : offset + n]
        out = bytearray(data[offset:])
        while len(out) < n:
            if len(data) != METADATA_SIZE:
                raise CorruptSampleError(f"{self.name}: {what} runs past the inode table's end; the image is "
                                         "damaged: re-copy or re-make it")
            data, nxt = self.meta_block(nxt, what)
            out += data
        return bytes(out[:n])

    def meta_block(self, rel: int, what: str) -> tuple[bytes, int]:
        """The uncompressed inode-table block ``rel`` bytes into the table (kept in a small LRU), and
        where the next one starts; :class:`CorruptSampleError` naming ``what`` if there is none."""
        got = self._meta_cache.get(rel)
        if got is not None:
            self._meta_cache.move_to_end(rel)
            return got
        start, end = self.superblock.inode_table_start + rel, self.superblock.directory_table_start
        bad = f"{self.name}: {what}: no inode-table block at byte {start}; the image is damaged: re-copy or re-make it"
        if rel < 0 or start + 2 > end:
            raise CorruptSampleError(bad)
        (hdr,) = struct.unpack("<H", self._pread(2, start, what))
        size = hdr & META_SIZE_MASK
        if size == 0 or start + 2 + size > end or (hdr & META_STORED and size > METADATA_SIZE):
            raise CorruptSampleError(bad)
        raw = self._pread(size, start + 2, what)
        try:
            data = raw if hdr & META_STORED else self._decompress(raw, METADATA_SIZE)
        except DecompressError as exc:
            raise CorruptSampleError(f"{bad} ({exc})") from exc
        got = (data, rel + 2 + size)
        self._meta_cache[rel] = got
        if len(self._meta_cache) > _META_CACHE:
            self._meta_cache.popitem(last=False)
        return got

    def read_ref(self, ref: int) -> bytes:
        """The bytes of the regular file whose inode is at reference ``ref`` (see :meth:`ref_pieces`)."""
        size, pieces = self.ref_pieces(ref)
        return self.read_pieces(pieces, size, f"inode {ref:#x}")

    def read_refs(self, refs: Sequence[int] | np.ndarray) -> list[bytes]:
        """:meth:`read_ref` of many references, in the order given, a block at a time: each inode-table
        and fragment block they share is read and decompressed once (:func:`~.refs.read_by_refs`)."""
        return read_by_refs(self, np.asarray(refs, dtype=np.int64))

    def read(self, i: int) -> bytes:
        """The bytes of listing entry ``i`` (a regular file)."""
        lst = self.listing()
        if lst.kind[i] != 2:
            raise CorruptSampleError(f"{self.name}: {lst.paths[i]!r} is not a regular file")
        off, size = int(lst.raw_offset[i]), int(lst.size[i])
        if off >= 0:
            return self._pread(size, off, lst.paths[i])
        return self.read_pieces(lst.pieces(i), size, lst.paths[i])

    def read_many(self, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """:meth:`read` of many entries, in the order given; stored contiguous files are fetched with
        one ``pread`` per run of neighbours (:func:`~stager.formats.base.pread_runs`)."""
        lst = self.listing()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        out: list[bytes] = [b""] * len(idx)
        raw = (lst.raw_offset[idx] >= 0) & (lst.kind[idx] == 2)
        where = np.flatnonzero(raw)
        if len(where):
            try:
                got = pread_runs(self.fd(), lst.raw_offset[idx[where]], lst.size[idx[where]])
            except EOFError as exc:
                raise CorruptSampleError(f"{self.name}: {exc}; the image is truncated: re-copy it") from exc
            for k, b in zip(where.tolist(), got, strict=True):
                out[k] = b
        for k in np.flatnonzero(~raw).tolist():
            out[k] = self.read(int(idx[k]))
        return out

    def read_pieces(self, pieces: Sequence[Piece], size: int, what: str) -> bytes:
        """A file's bytes from its :class:`Piece` list (``size`` bytes in all)."""
        blocks = [p for p in pieces if not p.fragment and p.offset >= 0]
        span, lo = b"", 0
        if blocks:  # a file's data blocks are consecutive on disk: one pread for all of them
            lo = blocks[0].offset
            span = self._pread(blocks[-1].offset + blocks[-1].stored - lo, lo, what)
        out = bytearray()
        for p in pieces:
            if p.fragment:
                block = self.fragment_block(p, what)
                if p.skip + p.length > len(block):
                    raise CorruptSampleError(f"{self.name}: {what!r}: its fragment holds {len(block)} bytes, not "
                                             f"{p.skip + p.length}; the image is damaged: re-copy or re-make it")
                out += block[p.skip : p.skip + p.length]
            elif p.offset < 0:
                out += bytes(p.length)
            else:
                out += self._block(span[p.offset - lo : p.offset - lo + p.stored], p, what)
        if len(out) != size:
            raise CorruptSampleError(f"{self.name}: {what!r}: read {len(out)} bytes, the inode says {size}; the image "
                                     "is damaged: re-copy or re-make it")
        return bytes(out)

    def _block(self, stored: bytes, p: Piece, what: str) -> bytes:
        if not p.compressed:
            data = stored
        else:
            try:
                data = self._decompress(stored, self.block_size)
            except DecompressError as exc:
                raise CorruptSampleError(f"{self.name}: {what!r}: a data block at byte {p.offset} does not "
                                         f"decompress ({exc}); the image is damaged: re-copy or re-make it") from exc
        if len(data) != p.length:
            raise CorruptSampleError(f"{self.name}: {what!r}: a data block at byte {p.offset} holds {len(data)} "
                                     f"bytes, not {p.length}; the image is damaged: re-copy or re-make it")
        return data

    def fragment_block(self, p: Piece, what: str) -> bytes:
        """The uncompressed fragment block of piece ``p`` (kept in a small LRU)."""
        block = self._frag_cache.get(p.offset)
        if block is not None:
            self._frag_cache.move_to_end(p.offset)
            return block
        stored = self._pread(p.stored, p.offset, what)
        if p.compressed:
            try:
                block = self._decompress(stored, self.block_size)
            except DecompressError as exc:
                raise CorruptSampleError(f"{self.name}: {what!r}: the fragment block at byte {p.offset} does not "
                                         f"decompress ({exc}); the image is damaged: re-copy or re-make it") from exc
        else:
            block = stored
        self._frag_cache[p.offset] = block
        if len(self._frag_cache) > _FRAGMENT_CACHE:
            self._frag_cache.popitem(last=False)
        return block

    def _pread(self, size: int, offset: int, what: str) -> bytes:
        buf = os.pread(self.fd(), size, offset)
        if len(buf) != size:
            raise CorruptSampleError(f"{self.name}: {what!r}: {size} bytes at {offset}, the image ends earlier; it "
                                     "is truncated: re-copy it")
        return buf

    # ---- life -----------------------------------------------------------------------------------

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None
        self._map = None  # unmapped when the last slice of it dies

    def __enter__(self) -> SquashImage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


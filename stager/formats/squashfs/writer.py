"""Write a SquashFS 4.0 image from a stream of ``(path in image, bytes)``: :class:`SquashWriter`.

Layout (docs/formats.md, "squashfs"): the superblock, the compressor options when mksquashfs would
write them, the files' data in the order they were added, then the inode, directory, fragment,
export and id tables, padded to 4 KiB. What it holds is a pure function of the files added and the
options: fixed mtimes, uid/gid 0, modes 0644/0755, sorted listings, and compression jobs written in
arrival order whatever the thread pool does.

Already-compressed files (by extension: JPEG, PNG, WebP, video, archives; :data:`PRECOMPRESSED`)
are stored, not recompressed, and get no fragment: each is one contiguous stored range, so
:meth:`SquashWriter.add_file` returns its offset at once, and the loader reads it with ``pread`` as it
reads a tar member. With ``compression="none"`` every file is stored that way. Other files are cut
into blocks compressed on every core (a thread pool: zlib, lzma, zstandard and lz4 release the
GIL); a block is kept compressed only when that is smaller, a block of zeros becomes a sparse block,
and a file shorter than a block (or, with ``always_fragments``, any file's tail) goes into a shared
fragment block, as mksquashfs does by default.
"""

from __future__ import annotations

import os
import re
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, NamedTuple

from stager.errors import UsageError
from stager.formats.squashfs.compress import PRECOMPRESSED, Compress, codec_by_name, compressor, options_block
from stager.formats.squashfs.layout import (
    DATA_STORED,
    FLAG_ALWAYS_FRAG,
    FLAG_COMP_OPT,
    FLAG_EXPORT,
    FLAG_NO_FRAG,
    FLAG_NO_XATTR,
    FLAG_NOD,
    FLAG_NOF,
    FLAG_NOI,
    FLAG_NOID,
    FLAG_NOX,
    FRAGMENT_ENTRY,
    GZIP,
    INVALID_TABLE,
    MAGIC,
    MAX_BLOCK_LOG,
    MAX_NAME,
    META_STORED,
    MIN_BLOCK_LOG,
    PAD,
    SUPERBLOCK_SIZE,
    Superblock,
)
from stager.formats.squashfs.meta import indexed_table
from stager.formats.squashfs.tables import FIXED_MTIME, Files, Tree, build_tables
from stager.fs.writeback import start_writeback

_WINDOW = 32 << 20  # input bytes of compression jobs in flight before the oldest is written (fixed: determinism)
_FLUSH = 4 << 20  # bytes queued before a write
_NO_COPY = 16 << 10  # pieces this large (and immutable) are written from where they are, not copied
_IOV_MAX = 512  # pieces per writev (Linux allows 1024)


class AddedFile(NamedTuple):
    """What :meth:`SquashWriter.add_file` knows at once: the file's id (its order of addition),
    ``size``, and ``raw_offset``: the image offset of its bytes when they are stored as one
    contiguous range (a stored file), else -1 (its blocks are placed when compressed)."""

    file_id: int
    size: int
    raw_offset: int


@dataclass
class _Job:
    """Blocks of one file (``fid`` >= 0) or one fragment block (``fragment`` >= 0) being compressed:
    each future gives ``(bytes to write, size word)``."""

    fid: int
    fragment: int
    futures: list[Future[tuple[bytes, int]]]
    nbytes: int


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_relpath(relpath: str) -> list[str]:
    """The components of ``relpath``, checked: plain names of at most 255 bytes, no control characters."""
    if not isinstance(relpath, str) or not relpath:
        raise UsageError(f"a path in a SquashFS image must be a non-empty str, got {relpath!r}")
    parts = relpath.split("/")
    if ("" in parts or "." in parts or ".." in parts or _CONTROL.search(relpath) is not None
            or (max(map(len, parts)) > 63  # 63 characters are at most 252 bytes: encode only longer names
                and max(len(p.encode("utf-8", "surrogateescape")) for p in parts) > MAX_NAME - 1)):
        raise UsageError(f"{relpath!r} is not a relative path of plain names (no empty, '.' or '..' parts, no "
                         "control characters, at most 255 bytes a name)")
    return parts


class SquashWriter:
    """One SquashFS image at ``target`` (a path, created or truncated; or a writable binary file
    object positioned at 0, which the writer does not close).

    Options: ``compression`` (``none``, ``gzip``, ``zstd``, ``xz``, ``lz4``), ``block_size`` (a power of
    two from 4 KiB to 1 MiB), ``level`` (the compressor's; None: mksquashfs's default), ``fragments``
    (pack small files' tails together), ``always_fragments`` (tails of large files too),
    ``compress_precompressed`` (also compress JPEG/PNG/...), ``exportable`` (write the NFS export
    table, as mksquashfs does by default), ``threads`` (compression threads; None: every core),
    ``fsync`` (fsync before :meth:`close` returns).
    """

    def __init__(self, target: str | os.PathLike[str] | BinaryIO, *, compression: str = "gzip",
                 block_size: int = 128 << 10, level: int | None = None, fragments: bool = True,
                 always_fragments: bool = False, compress_precompressed: bool = False, exportable: bool = True,
                 threads: int | None = None, fsync: bool = False) -> None:
        if block_size & (block_size - 1) or not 1 << MIN_BLOCK_LOG <= block_size <= 1 << MAX_BLOCK_LOG:
            raise UsageError(f"SquashFS block size must be a power of two from 4 KiB to 1 MiB, got {block_size}")
        self.block_size = block_size
        self.compression = compression
        self._none = compression == "none"
        codec = codec_by_name("gzip" if self._none else compression)
        self._codec_id = GZIP if self._none else codec.id
        self._compress: Compress | None = None if self._none else compressor(codec, level, block_size)
        self._options = None if self._none else options_block(codec, level)
        self._fragments = fragments and not self._none
        self._always = always_fragments
        self._precompressed = not compress_precompressed
        self._exportable = exportable
        self._fsync = fsync
        self._threads = threads or os.cpu_count() or 1
        self._pool: ThreadPoolExecutor | None = None
        if isinstance(target, (str, os.PathLike)):
            self.name = os.fspath(target)
            self._f: BinaryIO | None = open(self.name, "wb", buffering=0)  # noqa: SIM115 - closed in close()/abort()
            self._own = True
        else:
            self.name = getattr(target, "name", "<image>")
            self._f = target
            self._own = False
        self.files = Files()
        self.tree = Tree()
        self._buf = bytearray(SUPERBLOCK_SIZE)  # the superblock's place; written last
        if self._options is not None:
            self._buf += (len(self._options) | META_STORED).to_bytes(2, "little") + self._options
        self._pos = len(self._buf)  # image offset of the next data byte
        self._flushed = 0  # bytes written to the file so far (in order, from offset 0)
        self._pieces: list[bytes | bytearray | memoryview] = []  # queued for the file, in order; _buf follows them
        self._pending = len(self._buf)
        self._jobs: deque[_Job] = deque()
        self._pending = 0
        self._frag_entries: list[tuple[int, int]] = []  # (start, size word) per fragment block
        self._frag_buf = bytearray()
        self._nfrag = 0  # fragment blocks closed so far (written or in flight)
        self._zero = bytes(block_size)
        self._closed = False
        self.file_refs: array | None = None  # after close(): each file's inode reference, by file id

    # ---- adding files ---------------------------------------------------------------------------

    def add_file(self, relpath: str, data: bytes | bytearray | memoryview, *, store: bool = False) -> AddedFile:
        """Add a regular file at ``relpath`` (``/``-separated, relative, parents created). ``store``: keep
        it as one stored contiguous range whatever its type (``raw_offset`` >= 0), as a JPEG is."""
        if self._closed:
            raise UsageError(f"{self.name}: add_file after close")
        parts = _check_relpath(relpath)
        view = memoryview(data).cast("B")
        fid = self.files.add(len(view))
        self.tree.add(parts, fid, self.name)
        dot = parts[-1].rfind(".")
        ext = parts[-1][dot + 1 :].lower() if dot > 0 else ""
        if store or self._none or (self._precompressed and ext in PRECOMPRESSED):
            return AddedFile(fid, len(view), self._store(fid, view))
        self._add_compressed(fid, view)
        return AddedFile(fid, len(view), -1)

    def _store(self, fid: int, view: memoryview) -> int:
        bs, n = self.block_size, len(view)
        words = [min(bs, n - a) | DATA_STORED for a in range(0, n, bs)]
        start = self._pos
        self.files.set_blocks(fid, start if n else 0, words)
        self._write(view)
        return start

    def _add_compressed(self, fid: int, view: memoryview) -> None:
        bs, n = self.block_size, len(view)
        use_frag = self._fragments and n % bs and (n < bs or self._always)
        whole = n - n % bs if use_frag else n
        if whole:
            pool = self._get_pool()
            compress = self._compress
            assert compress is not None
            futures = [pool.submit(_block_job, compress, bytes(view[a : min(a + bs, whole)]), self._zero)
                       for a in range(0, whole, bs)]
            self._jobs.append(_Job(fid, -1, futures, whole))
            self._pending += whole
        if use_frag:
            tail = view[whole:]
            if len(self._frag_buf) + len(tail) > bs:
                self._close_fragment()
            self.files.fragment[fid] = self._nfrag
            self.files.frag_offset[fid] = len(self._frag_buf)
            self._frag_buf += tail
        if not whole and not use_frag:  # an empty file
            self.files.set_blocks(fid, 0, [])
        self._drain(_WINDOW)

    def _close_fragment(self) -> None:
        if not self._frag_buf:
            return
        index = self._nfrag
        self._nfrag += 1
        data = bytes(self._frag_buf)
        compress = self._compress
        assert compress is not None
        fut = self._get_pool().submit(_block_job, compress, data, None)
        self._jobs.append(_Job(-1, index, [fut], len(data)))
        self._pending += len(data)
        self._frag_buf = bytearray()

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="sqfs-compress")
        return self._pool

    def _drain(self, limit: int) -> None:
        """Write the oldest jobs while more than ``limit`` input bytes are in flight (waiting for them)."""
        while self._jobs and self._pending > limit:
            job = self._jobs.popleft()
            self._pending -= job.nbytes
            results = [f.result() for f in job.futures]
            start = self._pos
            for data, _word in results:
                self._write(data)
            words = [w for _d, w in results]
            if job.fid >= 0:
                sparse = sum(min(self.block_size, self.files.size[job.fid] - k * self.block_size)
                             for k, w in enumerate(words) if w == 0)
                self.files.set_blocks(job.fid, start, words, sparse)
            else:
                assert job.fragment == len(self._frag_entries)
                self._frag_entries.append((start, words[0]))

    def _write(self, data: bytes | memoryview) -> None:
        """Queue ``data`` at the image's next offset. Small pieces are gathered into one buffer; a large
        immutable one (a stored photo's bytes) is queued as it is, with no copy, and the queue reaches the
        file in ``_FLUSH``-sized ``writev`` calls."""
        n = len(data)
        self._pos += n
        if n >= _NO_COPY and isinstance(data.obj if isinstance(data, memoryview) else data, bytes):
            if self._buf:
                self._pieces.append(self._buf)
                self._buf = bytearray()
            self._pieces.append(data)
        else:
            self._buf += data
        self._pending += n
        if self._pending > _FLUSH:
            self._flush()

    def _flush(self) -> None:
        if self._buf:
            self._pieces.append(self._buf)
            self._buf = bytearray()
        if self._pieces:
            nbytes = sum(len(p) for p in self._pieces)
            self._write_all(self._pieces)
            if self._own and self._f is not None:  # the disk starts now, so the pack's fsync has little left
                start_writeback(self._f.fileno(), self._flushed, nbytes)
            self._flushed += nbytes
        self._pieces = []
        self._pending = 0

    def _write_all(self, pieces: list[bytes | bytearray | memoryview]) -> None:
        """Write ``pieces`` in order: ``os.writev`` on a file of our own, ``write`` on a caller's object."""
        assert self._f is not None
        views = [memoryview(p).cast("B") for p in pieces]
        if not self._own:
            for view in views:
                done = 0
                while done < len(view):
                    done += self._f.write(view[done:]) or 0
            return
        fd = self._f.fileno()
        while views:
            done = os.writev(fd, views[:_IOV_MAX])
            while views and done >= len(views[0]):
                done -= len(views[0])
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]

    # ---- finishing ------------------------------------------------------------------------------

    def close(self) -> int:
        """Write the tables and the superblock; return the image's length (padded to 4 KiB)."""
        if self._closed:
            raise UsageError(f"{self.name}: closed twice")
        try:
            self._close_fragment()
            self._drain(-1)
            length = self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._shutdown()
        return length

    def _finish(self) -> int:
        meta_compress = self._compress
        tables = build_tables(self.tree, self.files, self.block_size, meta_compress)
        self.file_refs = tables.file_refs
        sb: dict[str, int] = {}
        sb["inode_table_start"] = self._pos
        self._write(tables.inode_table)
        sb["directory_table_start"] = self._pos
        self._write(tables.dir_table)
        frag_start = self._pos  # mksquashfs's value for an empty fragment table too
        if self._frag_entries:
            records = b"".join(FRAGMENT_ENTRY.pack(s, w, 0) for s, w in self._frag_entries)
            blocks, index = indexed_table(records, meta_compress, self._pos)
            self._write(blocks)
            frag_start = self._pos
            self._write(index)
        lookup = INVALID_TABLE
        if self._exportable:
            blocks, index = indexed_table(tables.refs.tobytes(), meta_compress, self._pos)
            self._write(blocks)
            lookup = self._pos
            self._write(index)
        blocks, index = indexed_table(b"\0\0\0\0", meta_compress, self._pos)  # one id: 0 (root)
        self._write(blocks)
        id_start = self._pos
        self._write(index)
        bytes_used = self._pos
        self._write(bytes(-bytes_used % PAD))
        self._flush()
        flags = self._flags()
        block_log = self.block_size.bit_length() - 1
        superblock = Superblock(MAGIC, tables.inodes, FIXED_MTIME, self.block_size, len(self._frag_entries),
                                self._codec_id, block_log, flags, 1, 4, 0, tables.root_ref, bytes_used, id_start,
                                INVALID_TABLE, sb["inode_table_start"], sb["directory_table_start"],
                                frag_start, lookup)
        assert self._f is not None
        self._f.seek(0)
        self._write_all([superblock.pack()])
        self._f.seek(self._pos)
        if self._fsync:
            self._f.flush()
            os.fsync(self._f.fileno())
        if self._own:
            self._f.close()
        self._f = None
        return self._pos

    def _flags(self) -> int:
        flags = FLAG_NO_XATTR | FLAG_NOX
        if self._none:
            flags |= FLAG_NOI | FLAG_NOD | FLAG_NOF | FLAG_NOID
        if not self._fragments:
            flags |= FLAG_NO_FRAG
        if self._always:
            flags |= FLAG_ALWAYS_FRAG
        if self._exportable:
            flags |= FLAG_EXPORT
        if self._options is not None:
            flags |= FLAG_COMP_OPT
        return flags

    def abort(self) -> None:
        """Stop after an error: no tables, the file closed (the caller removes it)."""
        self._closed = True
        for job in self._jobs:
            for f in job.futures:
                f.cancel()
        self._jobs.clear()
        self._shutdown()
        if self._f is not None and self._own:
            self._f.close()
        self._f = None

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> SquashWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def _block_job(compress: Callable[[bytes], bytes], block: bytes, zero: bytes | None) -> tuple[bytes, int]:
    """``(bytes to write, size word)`` of one data block: sparse (nothing written) when all zeros and
    ``zero`` is given, compressed when that is smaller, else stored."""
    if zero is not None and block == zero[: len(block)]:
        return b"", 0
    c = compress(block)
    if len(c) < len(block):
        return c, len(c)
    return block, len(block) | DATA_STORED


__all__ = ["PRECOMPRESSED", "AddedFile", "SquashWriter"]

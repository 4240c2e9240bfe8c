"""The compressor table: a SquashFS compressor id -> how to compress and decompress its blocks.

Each :class:`Codec` names the Python module it needs and the package that provides it; the module is
imported on first use, so an image in gzip never imports ``zstandard``, and a missing one is a
one-line :class:`~stager.errors.MissingBackendError` naming the package to install (fsspec's
registry does the same for URL schemes).

What a block holds, per compressor (as mksquashfs and the kernel write and read them):

====  =====  ==========================================================================================
id    name   block contents; mksquashfs's defaults, which :func:`options_block` reproduces
====  =====  ==========================================================================================
1     gzip   a zlib stream (deflate with the 2-byte header); level 9, window 15; options only if not
2     lzma   an LZMA "alone" stream (read only: the kernel cannot mount these)
3     lzo    raw LZO1X (read only here; ``python-lzo`` needs liblzo2 to build)
4     xz     an .xz stream (LZMA2, CRC32 check, dictionary = block size, BCJ filters as the options
             say: the stream header carries its filter chain, so any mksquashfs -Xbcj image reads)
5     lz4    a raw LZ4 block; an options block (version 1 = legacy, flags: 1 = HC) is always present
6     zstd   a zstd frame with its content size; level 15; options only if not
====  =====  ==========================================================================================

Decompression is bounded: a block may not expand past its limit (8 KiB for metadata, the block
size for data), so a damaged or hostile image cannot make the reader allocate without bound.
Compressors and decompressors release the GIL (zlib, lzma, zstandard, lz4), so a thread pool
compresses on every core.
"""

from __future__ import annotations

import functools
import importlib
import lzma
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stager.errors import MissingBackendError, SourceError, UsageError
from stager.formats.squashfs.layout import GZIP, LZ4, LZMA, LZO, XZ, ZSTD

Compress = Callable[[bytes], bytes]
Decompress = Callable[[bytes | memoryview, int], bytes]


class DecompressError(ValueError):
    """A block did not decompress (damaged, or larger than its limit); callers name the image."""


@dataclass(frozen=True)
class Codec:
    """One compressor: its id and name, the module it needs and the package providing that."""

    id: int
    name: str
    module: str | None  # None: in the standard library
    package: str | None
    writable: bool
    default_level: int | None

    def require(self, image: str) -> Any:
        """The compressor's module, or a one-line error naming the package that provides it."""
        if self.module is None:
            return None
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:
            extra = "" if self.name == "lzo" else " or pip install 'stager[squashfs]'"
            raise MissingBackendError(
                f"{image}: compressed with {self.name}, which needs the Python package {self.package}: "
                f"pip install {self.package}{extra}" + (" (it builds against liblzo2-dev: apt-get install "
                                                         "liblzo2-dev)" if self.name == "lzo" else "")
            ) from exc


CODECS: dict[int, Codec] = {
    GZIP: Codec(GZIP, "gzip", None, None, True, 9),
    LZMA: Codec(LZMA, "lzma", None, None, False, None),
    LZO: Codec(LZO, "lzo", "lzo", "python-lzo", False, None),
    XZ: Codec(XZ, "xz", None, None, True, 6),
    LZ4: Codec(LZ4, "lz4", "lz4.block", "lz4", True, None),
    ZSTD: Codec(ZSTD, "zstd", "zstandard", "zstandard", True, 15),
}
BY_NAME = {c.name: c for c in CODECS.values()}
WRITE_NAMES = ("none", *(c.name for c in CODECS.values() if c.writable))


def codec_by_id(cid: int, image: str) -> Codec:
    if cid not in CODECS:
        raise SourceError(f"{image}: unknown SquashFS compressor id {cid}; expected one of "
                          f"{', '.join(f'{c.id} ({c.name})' for c in CODECS.values())}: the image is damaged "
                          "or from a newer squashfs-tools")
    return CODECS[cid]


def codec_by_name(name: str) -> Codec:
    if name not in BY_NAME or not BY_NAME[name].writable:
        raise UsageError(f"unknown SquashFS compression {name!r}; expected one of {', '.join(WRITE_NAMES)}")
    return BY_NAME[name]


# File types stored as they are by default (already compressed: compressing them again gains nothing);
# by extension, lower case. The writer's rule, and the pack's size estimate's.
PRECOMPRESSED = frozenset((
    "jpg", "jpeg", "jpe", "jfif", "png", "gif", "webp", "avif", "heic", "heif", "jp2", "jxl",  # images
    "mp4", "m4v", "mov", "mkv", "webm", "avi", "mp3", "aac", "ogg", "opus", "flac",  # audio and video
    "zip", "gz", "tgz", "bz2", "xz", "zst", "lz4", "7z", "rar", "npz", "parquet",  # archives
))


# ---- decompression ------------------------------------------------------------------------------

_local = threading.local()


def _zstd_dctx(zstd: Any) -> Any:
    d = getattr(_local, "zstd_d", None)
    if d is None:
        d = _local.zstd_d = zstd.ZstdDecompressor()
    return d


def decompressor(codec: Codec, image: str) -> Decompress:
    """``f(data, limit) -> bytes``: the block's uncompressed bytes, at most ``limit`` of them, or
    :class:`DecompressError`."""
    mod = codec.require(image)
    if codec.id == GZIP:
        inflate = inflate_module()
        return lambda data, limit: _gunzip(data, limit, inflate)
    if codec.id in (XZ, LZMA):
        fmt = lzma.FORMAT_XZ if codec.id == XZ else lzma.FORMAT_ALONE
        return lambda data, limit: _unxz(data, limit, fmt)
    if codec.id == LZ4:
        return lambda data, limit: _call(mod.decompress, data, uncompressed_size=limit)
    if codec.id == LZO:
        return lambda data, limit: _call(mod.decompress, bytes(data), False, limit)  # python-lzo: bytes only
    zstd = mod

    def unzstd(data: bytes | memoryview, limit: int) -> bytes:
        try:
            size = zstd.frame_content_size(data)
        except zstd.ZstdError as exc:
            raise DecompressError(f"zstd: {exc}") from exc
        if size > limit:
            raise DecompressError(f"zstd frame of {size} bytes, more than the {limit} a block holds")
        try:
            return bytes(_zstd_dctx(zstd).decompress(data, max_output_size=limit))
        except zstd.ZstdError as exc:
            raise DecompressError(f"zstd: {exc}") from exc

    return unzstd


def _call(fn: Callable[..., bytes], *args: Any, **kw: Any) -> bytes:
    try:
        return bytes(fn(*args, **kw))
    except Exception as exc:  # lz4/lzo raise their own error types (or ValueError) for damaged blocks
        raise DecompressError(f"{type(exc).__name__}: {exc}") from exc


@functools.cache
def inflate_module() -> Any:
    """The zlib-compatible module that inflates gzip blocks: python-isal's ``isal_zlib`` (ISA-L, about
    twice zlib's speed; the same streams and API) where installed, else the standard ``zlib``."""
    try:
        return importlib.import_module("isal.isal_zlib")
    except ImportError:
        return zlib


def _gunzip(data: bytes | memoryview, limit: int, inflate: Any = zlib) -> bytes:
    """A zlib stream's bytes, at most ``limit`` (``inflate``: :func:`inflate_module`'s module)."""
    d = inflate.decompressobj()
    try:
        out = d.decompress(data, limit)
    except inflate.error as exc:
        raise DecompressError(f"zlib: {exc}") from exc
    if not d.eof:  # isal keeps the rest of an over-long block inside instead of in unconsumed_tail
        raise DecompressError(f"block expands past {limit} bytes" if d.unconsumed_tail or len(out) >= limit
                              else "truncated zlib stream")
    return out


def _unxz(data: bytes | memoryview, limit: int, fmt: int) -> bytes:
    d = lzma.LZMADecompressor(format=fmt)
    try:
        out = d.decompress(data, max_length=limit)
    except lzma.LZMAError as exc:
        raise DecompressError(f"xz: {exc}") from exc
    if not d.eof:
        raise DecompressError(f"truncated xz stream or block past {limit} bytes")
    return out


# ---- compression --------------------------------------------------------------------------------


def compressor(codec: Codec, level: int | None, block_size: int) -> Compress:
    """``f(data) -> compressed bytes`` for blocks of at most ``block_size`` bytes (thread-safe)."""
    mod = codec.require("the writer")
    lvl = codec.default_level if level is None else level
    if codec.id == GZIP:
        glevel = int(lvl or 0)
        if not 1 <= glevel <= 9:
            raise UsageError(f"gzip level must be 1..9, got {lvl}")
        return lambda data: zlib.compress(data, glevel)
    if codec.id == XZ:
        if not 0 <= int(lvl or 0) <= 9:
            raise UsageError(f"xz level must be 0..9, got {lvl}")
        filters = [{"id": lzma.FILTER_LZMA2, "preset": lvl, "dict_size": block_size}]
        return lambda data: lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, filters=filters)
    if codec.id == LZ4:
        if level is not None:
            raise UsageError("lz4 takes no level (mksquashfs's default lz4, not HC)")
        return lambda data: mod.compress(data, mode="default", store_size=False)
    if not 1 <= int(lvl or 0) <= 22:
        raise UsageError(f"zstd level must be 1..22, got {lvl}")
    zstd = mod

    def zcompress(data: bytes) -> bytes:
        c = getattr(_local, "zstd_c", None)
        if c is None or _local.zstd_level != lvl:
            c = _local.zstd_c = zstd.ZstdCompressor(level=lvl, write_content_size=True)
            _local.zstd_level = lvl
        return bytes(c.compress(data))

    return zcompress


def options_block(codec: Codec, level: int | None) -> bytes | None:
    """The compressor options mksquashfs writes after the superblock for these settings, or None
    (defaults need none, except lz4, whose options the kernel requires)."""
    if codec.id == LZ4:
        return struct.pack("<II", 1, 0)
    if level is None or level == codec.default_level or codec.id == XZ:
        return None  # xz's options are the dictionary size and filters, which stay at their defaults
    if codec.id == GZIP:
        return struct.pack("<IHH", level, 15, 0)
    return struct.pack("<I", level)  # zstd

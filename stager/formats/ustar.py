"""The POSIX ustar codec: tar headers built and parsed, and nothing about what the members mean.

Writing (:func:`member_header`, and the constant header pieces the tar writer's per-sample fast path
joins): fixed mtime, mode 0644, uid/gid 0, empty uname/gname, so identical members give identical
bytes. A name longer than the 100-byte name field is split into the 155-byte ``prefix`` field at a
``/``; a name that cannot be split (or is not ASCII) gets a preceding PAX ``x`` header with a
``path`` record, and a size beyond 11 octal digits a PAX ``size`` record. An archive ends with two
zero blocks.

Reading (:func:`walk_headers`, :func:`iter_members`): the one tar header parser of stager, used by
the tar format's reader, by ``stager index``'s tar scanner and by ``stage --unpack``, so they accept
exactly the same archives. Checksums, sizes against the file length and member types are checked, so
a damaged or hostile archive raises :class:`~stager.errors.CorruptSampleError` or
:class:`~stager.errors.UnsafeArchiveError` naming it, never a stray exception. The webdataset layout
on top (keys, ``.cls``, fields) is :mod:`stager.formats.tar`'s.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from typing import BinaryIO

from stager.errors import CorruptSampleError, UnsafeArchiveError

BLOCK = 512
FIXED_MTIME = 946684800  # 2000-01-01T00:00:00Z: fixed for reproducibility, yet "plausible" to GNU tar
FILE_MODE = 0o644
MAX_USTAR_SIZE = (1 << 33) - 1  # 11 octal digits
ZERO_BLOCK = bytes(BLOCK)
END_OF_ARCHIVE = ZERO_BLOCK * 2
PADS = [bytes(n) for n in range(BLOCK)]  # PADS[-size % BLOCK]: the padding after a member of ``size`` bytes
NULS = [bytes(n) for n in range(101)]  # NUL runs that fill the 100-byte name field


def _pad(n: int) -> bytes:
    return PADS[-n % BLOCK]


def _header_template() -> tuple[bytes, int]:
    """A ustar header with every field that never varies filled in; also its byte sum.

    The variable fields (name, size, typeflag, checksum, prefix) are left as NULs; the checksum field
    counts as eight spaces when summing, per POSIX.
    """
    h = bytearray(BLOCK)
    h[100:108] = b"%07o\0" % FILE_MODE
    h[108:116] = b"0000000\0"  # uid
    h[116:124] = b"0000000\0"  # gid
    h[136:148] = b"%011o\0" % FIXED_MTIME
    h[148:156] = b"        "
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[329:337] = b"0000000\0"  # devmajor
    h[337:345] = b"0000000\0"  # devminor
    base_sum = sum(h)
    h[148:156] = bytes(8)
    return bytes(h), base_sum


_TEMPLATE, _TEMPLATE_SUM = _header_template()
# Constant pieces of a regular-file header with an empty prefix, for a writer's per-sample fast path:
# name field, MODE_IDS, size field, MTIME, checksum, REGULAR_TAIL. REGULAR_SUM is their byte sum with
# the checksum field counted as spaces (add the name's and the size field's sums for the checksum).
MODE_IDS = _TEMPLATE[100:124]  # mode, uid, gid
MTIME = _TEMPLATE[136:148]
REGULAR_TAIL = b"0" + _TEMPLATE[157:]  # typeflag '0', linkname, magic..devminor, empty prefix, padding
REGULAR_SUM = _TEMPLATE_SUM + ord("0")


SIZE_FIELDS: dict[int, tuple[bytes, int]] = {}  # size_field's cache (a writer's fast path looks here first)


def size_field(size: int) -> tuple[bytes, int]:
    """``(size field, its byte sum)``, cached for sizes below 16 KiB (``.cls``/``.json`` members,
    small images: ~0.3 us a sample saved on CIFAR-sized PNGs)."""
    got = SIZE_FIELDS.get(size)
    if got is None:
        sz = b"%011o\0" % size
        got = (sz, sum(sz))
        if size < 16384:
            SIZE_FIELDS[size] = got
    return got


def ustar_header(name: bytes, size: int, typeflag: bytes = b"0", prefix: bytes = b"") -> bytes:
    """One ustar header block of member ``name`` (at most 100 bytes; ``prefix`` at most 155)."""
    h = bytearray(_TEMPLATE)
    h[0 : len(name)] = name
    sz = b"%011o\0" % size
    h[124:136] = sz
    h[156] = typeflag[0]
    if prefix:
        h[345 : 345 + len(prefix)] = prefix
    chk = _TEMPLATE_SUM + sum(name) + sum(sz) + typeflag[0] + sum(prefix)
    h[148:156] = b"%06o\0 " % chk
    return bytes(h)


def _pax_record(keyword: str, value: bytes) -> bytes:
    body = b" " + keyword.encode() + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:  # the length field counts its own digits
        n = len(str(n)) + len(body)
    return str(n).encode() + body


def member_header(name: str, size: int) -> bytes:
    """Header block(s) for a regular file ``name`` of ``size`` bytes (ustar, PAX when needed)."""
    raw = name.encode("utf-8")
    pax: list[bytes] = []
    ustar_name = raw
    prefix = b""
    if size > MAX_USTAR_SIZE:
        pax.append(_pax_record("size", str(size).encode()))
    if len(raw) > 100 or not raw.isascii():
        split = _ustar_split(raw) if raw.isascii() else None
        if split is None:
            pax.append(_pax_record("path", raw))
            # Readers without PAX support see a truncated, still ASCII name.
            ustar_name = raw[-100:].decode("ascii", "replace").encode("ascii", "replace")[-100:]
        else:
            prefix, ustar_name = split
    if not pax:
        return ustar_header(ustar_name, size, b"0", prefix)
    data = b"".join(pax)
    return (
        ustar_header(b"././@PaxHeader", len(data), b"x")
        + data
        + _pad(len(data))
        # With a PAX size record the ustar size field is ignored by readers; tarfile writes 0 there.
        + ustar_header(ustar_name, size if size <= MAX_USTAR_SIZE else 0, b"0", prefix)
    )


def _ustar_split(raw: bytes) -> tuple[bytes, bytes] | None:
    """Split ``raw`` at a ``/`` into (prefix <= 155 bytes, name <= 100 bytes), or None."""
    i = raw.find(b"/", max(0, len(raw) - 101))
    while i != -1:
        if i <= 155 and len(raw) - i - 1 <= 100 and i > 0:
            return raw[:i], raw[i + 1 :]
        i = raw.find(b"/", i + 1)
    return None


def _parse_number(field: bytes) -> int:
    if field and field[0] & 0x80:  # GNU base-256
        v = int.from_bytes(field, "big") & ~(0x80 << (8 * (len(field) - 1)))
        return v
    s = field.split(b"\0", 1)[0].strip()
    return int(s, 8) if s else 0


def _parse_pax(data: bytes, where: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp == -1:
            if not data[pos:].strip(b"\0"):
                break
            raise CorruptSampleError(f"{where}: malformed PAX header record")
        try:
            n = int(data[pos:sp])
        except ValueError as exc:
            raise CorruptSampleError(f"{where}: malformed PAX header record length") from exc
        rec = data[sp + 1 : pos + n]
        if n <= sp - pos or pos + n > len(data) or not rec.endswith(b"\n") or b"=" not in rec:
            raise CorruptSampleError(f"{where}: malformed PAX header record")
        k, v = rec[:-1].split(b"=", 1)
        out[k.decode("utf-8", "replace")] = v
        pos += n
    return out


def _safe_member_name(name: str, where: str) -> str:
    if name.startswith("./"):
        name = name[2:]
    parts = name.split("/")
    if not name or name.startswith("/") or ".." in parts or "\0" in name:
        raise UnsafeArchiveError(f"{where}: unsafe member name {name!r}; refusing this shard")
    return name


_REGULAR = (b"0", b"\0", b"7")


def header_sum(hdr: bytes) -> int:
    """``sum(hdr)`` of a 512-byte header, 8x faster: adler32's low half is ``1 + sum mod 65521``,
    exact for 256 bytes (at most 65,280)."""
    return (zlib.adler32(hdr[:256]) & 0xFFFF) + (zlib.adler32(hdr[256:]) & 0xFFFF) - 2


def padded_size(size: int) -> int:
    """A member's data size rounded up to whole 512-byte blocks."""
    return size + (-size % BLOCK)


def walk_headers(
    take: Callable[[int], bytes | memoryview], skip: Callable[[int], object], file_size: int, where: str
) -> Iterator[tuple[str, int, int]]:
    """Check every header of a tar stream; yield ``(name, data offset, size)`` per regular member.

    The one tar header parser (used by :func:`iter_members` and by ``stager.stage.unpack.walk_tar``, so
    pack, verify and unpack accept exactly the same archives). ``take(n)`` returns the next ``n``
    bytes of the stream, ``skip(n)`` passes over them. After each yield the caller must consume
    exactly ``padded_size(size)`` bytes (with ``take`` or ``skip``) before asking for the next member.

    Raises :class:`CorruptSampleError` for bad checksums, truncation or a missing end marker, and
    :class:`UnsafeArchiveError` for links, devices, FIFOs and unsafe names. Directories are skipped.
    """
    pos = 0
    long_name: str | None = None
    pax: dict[str, bytes] = {}
    while True:
        hdr = bytes(take(BLOCK))
        if len(hdr) < BLOCK:
            raise CorruptSampleError(
                f"{where}: truncated at byte {pos} (no end-of-archive marker); re-pack or re-stage this shard"
            )
        if hdr == ZERO_BLOCK:
            if bytes(take(BLOCK)) != ZERO_BLOCK:
                raise CorruptSampleError(f"{where}: damaged end-of-archive marker at byte {pos}")
            if long_name is not None or pax:
                raise CorruptSampleError(f"{where}: extended header without a member at byte {pos}")
            return
        stored = _parse_checksum(hdr, where, pos)
        unsigned = header_sum(hdr) - sum(hdr[148:156]) + 256  # the checksum field counts as 8 spaces
        # Some historic writers summed signed chars; accept either, as GNU tar does.
        if stored != unsigned and stored != unsigned - 256 * sum(1 for b in hdr[:148] + hdr[156:] if b > 127):
            raise CorruptSampleError(
                f"{where}: bad tar header checksum at byte {pos} (stored {stored}, computed {unsigned}); "
                "the shard is damaged: re-pack or re-stage it"
            )
        try:
            size = _parse_number(hdr[124:136])
        except ValueError as exc:
            raise CorruptSampleError(f"{where}: bad size field in tar header at byte {pos}") from exc
        typeflag = hdr[156:157]
        if "size" in pax and typeflag in _REGULAR:
            try:
                size = int(pax["size"])
            except ValueError as exc:
                raise CorruptSampleError(f"{where}: bad PAX size at byte {pos}") from exc
        data_start = pos + BLOCK
        if size < 0 or data_start + size > file_size:
            raise CorruptSampleError(
                f"{where}: member at byte {pos} claims {size} bytes but the file has {file_size}; "
                "the shard is truncated: re-pack or re-stage it"
            )
        padded = padded_size(size)
        pos = data_start + padded
        if typeflag in (b"x", b"g", b"L"):
            ext = bytes(take(padded))[:size]
            if len(ext) < size:
                raise CorruptSampleError(f"{where}: truncated extended header at byte {data_start - BLOCK}")
            if typeflag == b"x":
                pax = _parse_pax(ext, where)
            elif typeflag == b"L":
                long_name = ext.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if typeflag == b"5":  # directory: no data, nothing to yield
            skip(padded)
            long_name, pax = None, {}
            continue
        if typeflag not in _REGULAR:
            kind = {b"1": "hard link", b"2": "symlink", b"3": "char device", b"4": "block device", b"6": "FIFO"}
            raise UnsafeArchiveError(
                f"{where}: member at byte {data_start - BLOCK} is a {kind.get(typeflag, f'type {typeflag!r}')}, "
                "not a regular file; refusing this shard"
            )
        if "path" in pax:
            name = pax["path"].decode("utf-8", "surrogateescape")
        elif long_name is not None:
            name = long_name
        else:
            raw = hdr[:100].split(b"\0", 1)[0]
            if hdr[257:262] == b"ustar" and hdr[345] != 0:
                raw = hdr[345:500].split(b"\0", 1)[0] + b"/" + raw
            name = raw.decode("utf-8", "surrogateescape")
        yield _safe_member_name(name, where), data_start, size
        long_name, pax = None, {}


def iter_members(f: BinaryIO, file_size: int, where: str) -> Iterator[tuple[str, int, bytes]]:
    """Yield ``(name, data offset, data)`` for each regular file of the tar stream ``f``.

    Header checks and errors as in :func:`walk_headers`.
    """
    for name, start, size in walk_headers(f.read, lambda n: f.seek(n, os.SEEK_CUR), file_size, where):
        padded = padded_size(size)
        data = f.read(padded)
        if len(data) < size:
            raise CorruptSampleError(f"{where}: truncated member {name!r} at byte {start - BLOCK}")
        yield name, start, data[:size] if padded != size else data


def _parse_checksum(hdr: bytes, where: str, pos: int) -> int:
    try:
        return int(hdr[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError as exc:
        raise CorruptSampleError(f"{where}: not a tar header at byte {pos} (bad checksum field)") from exc


"""Just enough of Parquet's file layout to find values' bytes: the Thrift compact protocol (page
headers) and the RLE/bit-packed hybrid encoding (definition levels, dictionary indices).

Field ids follow ``parquet.thrift`` (apache/parquet-format): ``PageHeader`` {1 type, 2
uncompressed_page_size, 3 compressed_page_size, 4 crc, 5 data_page_header, 7 dictionary_page_header,
8 data_page_header_v2}; ``DataPageHeader`` {1 num_values, 2 encoding, ...}; ``DictionaryPageHeader``
{1 num_values, 2 encoding}; ``DataPageHeaderV2`` {1 num_values, 2 num_nulls, 3 num_rows, 4 encoding,
5 definition_levels_byte_length, 6 repetition_levels_byte_length, 7 is_compressed}.
"""

from __future__ import annotations

from typing import Any

PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY = 0, 2, 8
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = 0, 1, 2, 3


class ThriftError(ValueError):
    """Bytes that are not a well-formed Thrift compact struct (or run past their buffer)."""


def uvarint(buf: Any, pos: int, end: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= end:
            raise ThriftError(f"truncated varint at byte {pos}")
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7
        if shift > 63:
            raise ThriftError(f"varint too long at byte {pos}")


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def read_struct(buf: Any, pos: int, end: int, depth: int = 0) -> tuple[dict[int, Any], int]:
    """Decode a compact-protocol struct at ``pos``: ``({field id: value}, position after it)``.

    Integers, booleans, binaries and nested structs are kept; lists, sets and maps are skipped."""
    if depth > 16:
        raise ThriftError("structs nested too deeply")
    out: dict[int, Any] = {}
    fid = 0
    while True:
        if pos >= end:
            raise ThriftError(f"truncated struct at byte {pos}")
        head = buf[pos]
        pos += 1
        if head == 0:
            return out, pos
        delta, ftype = head >> 4, head & 0x0F
        if delta:
            fid += delta
        else:
            raw, pos = uvarint(buf, pos, end)
            fid = _zigzag(raw)
        out[fid], pos = _value(buf, pos, end, ftype, depth)


def _value(buf: Any, pos: int, end: int, ftype: int, depth: int) -> tuple[Any, int]:
    if ftype in (1, 2):
        return ftype == 1, pos
    if ftype == 3:
        if pos >= end:
            raise ThriftError("truncated byte")
        return buf[pos], pos + 1
    if ftype in (4, 5, 6):
        raw, pos = uvarint(buf, pos, end)
        return _zigzag(raw), pos
    if ftype == 7:
        return None, pos + 8
    if ftype == 8:
        n, pos = uvarint(buf, pos, end)
        if pos + n > end:
            raise ThriftError("binary runs past its buffer")
        return bytes(buf[pos : pos + n]), pos + n
    if ftype in (9, 10):
        head = buf[pos]
        pos += 1
        size, etype = head >> 4, head & 0x0F
        if size == 15:
            size, pos = uvarint(buf, pos, end)
        for _ in range(size):
            _, pos = _value(buf, pos, end, etype, depth + 1) if etype not in (1, 2) else (None, pos + 1)
        return None, pos
    if ftype == 11:
        size, pos = uvarint(buf, pos, end)
        if size:
            kinds = buf[pos]
            pos += 1
            for _ in range(size):
                _, pos = _value(buf, pos, end, kinds >> 4, depth + 1)
                _, pos = _value(buf, pos, end, kinds & 0x0F, depth + 1)
        return None, pos
    if ftype == 12:
        return read_struct(buf, pos, end, depth + 1)
    raise ThriftError(f"unknown compact type {ftype} at byte {pos}")


def rle_hybrid(buf: Any, pos: int, end: int, bit_width: int, count: int) -> list[int]:
    """Decode ``count`` values of Parquet's RLE/bit-packed hybrid encoding from ``buf[pos:end]``."""
    if bit_width == 0:
        return [0] * count
    out: list[int] = []
    mask = (1 << bit_width) - 1
    width_bytes = (bit_width + 7) // 8
    while len(out) < count:
        header, pos = uvarint(buf, pos, end)
        if header & 1:  # bit-packed: groups of 8 values
            n = (header >> 1) * 8
            nbytes = (header >> 1) * bit_width
            if pos + nbytes > end:
                raise ThriftError("bit-packed run past its buffer")
            chunk = int.from_bytes(buf[pos : pos + nbytes], "little")
            pos += nbytes
            out.extend((chunk >> (k * bit_width)) & mask for k in range(n))
        else:
            if pos + width_bytes > end:
                raise ThriftError("RLE run past its buffer")
            v = int.from_bytes(buf[pos : pos + width_bytes], "little")
            pos += width_bytes
            out.extend([v] * (header >> 1))
    return out[:count]

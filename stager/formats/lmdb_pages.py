"""LMDB's on-disk page format, read from a mapped ``data.mdb``: where every value's bytes are.

Values of an LMDB sit at fixed byte ranges of ``data.mdb``: small ones inside their leaf page, large
ones (``F_BIGDATA``) in a run of contiguous overflow pages. A read-only copy never moves them, so
``stager index`` records each value's range once and the loader reads it with ``pread`` or a slice of
the mapping, like a tar member, with no LMDB library and no lock file in the loader at all.

Structures (liblmdb ``mdb.c``, 64-bit builds; little endian)::

    page header (16 bytes): u64 pgno | u16 pad | u16 flags | u16 lower | u16 upper   (overflow: u32 pages)
    meta (pages 0 and 1, at byte 16 of the page): u32 magic 0xBEEFC0DE | u32 version | u64 address
        | u64 mapsize | MDB_db free | MDB_db main | u64 last_pg | u64 txnid
    MDB_db (48 bytes): u32 pad (the page size, in the free DB's) | u16 flags | u16 depth
        | u64 branch_pages | u64 leaf_pages | u64 overflow_pages | u64 entries | u64 root
    node: u16 lo | u16 hi | u16 flags | u16 ksize | key | data    (leaf: size = lo | hi << 16;
        branch: child pgno = lo | hi << 16 | flags << 32)

The meta page with the larger txnid is the current one. The walk visits the main database's B-tree
in key order (branch children left to right), and is cross-checked against liblmdb itself by
:mod:`stager.index.lmdb` (py-lmdb) when indexing.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from stager.errors import CorruptSampleError

META_MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGEHDRSZ = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_DUPSORT = 0x04
P_INVALID = (1 << 64) - 1
_NODE = struct.Struct("<HHHH")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_META_AT = PAGEHDRSZ  # the meta struct's place in its page
_MAIN_DB_AT = _META_AT + 24 + _DB.size  # after magic, version, address, mapsize and the free DB
_TXNID_AT = _MAIN_DB_AT + _DB.size + 8


class LmdbError(CorruptSampleError):
    """A damaged or unsupported ``data.mdb``: exit 3 (the message names the file and the page or key)."""

    exit_code = 3


def is_lmdb(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts with an LMDB meta page."""
    return (len(head) >= _META_AT + 8 and _U16.unpack_from(head, 10)[0] & P_META != 0
            and _U32.unpack_from(head, _META_AT)[0] == META_MAGIC)


def _meta(view: memoryview, at: int, path: str) -> tuple[int, tuple[int, ...], int]:
    """``(page size, main DB fields, txnid)`` of the meta page at byte ``at``."""
    if at + _TXNID_AT + 8 > len(view):
        raise LmdbError(f"{path}: {len(view)} bytes, too short for LMDB's two meta pages; the data.mdb is "
                        "truncated")
    flags = _U16.unpack_from(view, at + 10)[0]
    magic, version = struct.unpack_from("<II", view, at + _META_AT)
    if not flags & P_META or magic != META_MAGIC:
        raise LmdbError(f"{path}: no LMDB meta page at byte {at} (magic 0x{magic:08x}); not an LMDB data.mdb")
    if version != DATA_VERSION:
        raise LmdbError(f"{path}: LMDB data version {version}, expected {DATA_VERSION}; written by an unsupported "
                        "liblmdb build")
    psize = _U32.unpack_from(view, _MAIN_DB_AT - _DB.size + at)[0]
    return psize, _DB.unpack_from(view, at + _MAIN_DB_AT), _U64.unpack_from(view, at + _TXNID_AT)[0]


def main_db(view: memoryview, path: str) -> tuple[int, int, int]:
    """``(page size, root page or P_INVALID, entries)`` of the main database, from the newer meta page."""
    psize, db0, txn0 = _meta(view, 0, path)
    if psize < 512 or psize & (psize - 1) or psize > 1 << 16:
        raise LmdbError(f"{path}: page size {psize} in the meta page is not a power of two; the data.mdb is damaged")
    _, db1, txn1 = _meta(view, psize, path)
    db = db1 if txn1 > txn0 else db0
    flags, root, entries = db[1], db[7], db[6]
    if flags & MDB_DUPSORT:
        raise LmdbError(f"{path}: the main database is DUPSORT (several values per key); stager reads one value "
                        "per key")
    return psize, root, entries


def _page(view: memoryview, pgno: int, psize: int, path: str, what: str) -> tuple[int, int]:
    """``(byte offset, flags)`` of page ``pgno``, checked to lie in the file."""
    at = pgno * psize
    if pgno == P_INVALID or at + psize > len(view):
        raise LmdbError(f"{path}: {what} points at page {pgno}, past the file's {len(view) // psize} pages; the "
                        "data.mdb is truncated or damaged")
    return at, _U16.unpack_from(view, at + 10)[0]


def _nodes(view: memoryview, at: int, psize: int, path: str, pgno: int) -> list[int]:
    lower = _U16.unpack_from(view, at + 12)[0]
    if lower < PAGEHDRSZ or lower > psize:
        raise LmdbError(f"{path}: page {pgno}: bad node count; the data.mdb is damaged")
    n = (lower - PAGEHDRSZ) >> 1
    ptrs = struct.unpack_from(f"<{n}H", view, at + PAGEHDRSZ)
    for p in ptrs:
        if p < PAGEHDRSZ or p + _NODE.size > psize:
            raise LmdbError(f"{path}: page {pgno}: node offset {p} outside the page; the data.mdb is damaged")
    return [at + p for p in ptrs]


def walk(view: memoryview, path: str) -> Iterator[tuple[bytes, int, int]]:
    """``(key, value offset, value size)`` of every entry of the main database, in key order.

    Raises :class:`LmdbError` for a file that is not an LMDB, a page or value past the end of the file
    (truncated), named databases (``F_SUBDATA``) or several values per key, naming the page or key.
    """
    psize, root, _entries = main_db(view, path)
    if root == P_INVALID:
        return
    stack = [(root, 0)]
    pages = len(view) // psize
    while stack:
        pgno, depth = stack.pop()
        if depth > 64:
            raise LmdbError(f"{path}: page {pgno}: the B-tree is deeper than 64 levels (a cycle); the data.mdb is "
                            "damaged")
        at, flags = _page(view, pgno, psize, path, "the B-tree")
        nodes = _nodes(view, at, psize, path, pgno)
        if flags & P_BRANCH:
            kids = []
            for node in nodes:
                lo, hi, fl, _ks = _NODE.unpack_from(view, node)
                kids.append((lo | hi << 16 | fl << 32, depth + 1))
            if any(k >= pages for k, _ in kids):
                raise LmdbError(f"{path}: branch page {pgno} points past the file's {pages} pages; the data.mdb is "
                                "truncated")
            stack.extend(reversed(kids))
        elif flags & P_LEAF and not flags & P_LEAF2:
            yield from _leaf(view, nodes, psize, path, pgno)
        else:
            raise LmdbError(f"{path}: page {pgno} has flags 0x{flags:x}, expected a branch or leaf page; the "
                            "data.mdb is damaged")


def _leaf(view: memoryview, nodes: list[int], psize: int, path: str, pgno: int) -> Iterator[tuple[bytes, int, int]]:
    for node in nodes:
        lo, hi, fl, ks = _NODE.unpack_from(view, node)
        key = bytes(view[node + 8 : node + 8 + ks])
        size = lo | hi << 16
        data = node + 8 + ks
        if fl & (F_SUBDATA | F_DUPDATA):
            raise LmdbError(f"{path}: key {key[:64]!r} is a named database or holds several values; stager reads "
                            "one value per key in the main database")
        if fl & F_BIGDATA:
            ov = _U64.unpack_from(view, data)[0]
            at, oflags = _page(view, ov, psize, path, f"key {key[:64]!r}")
            npages = _U32.unpack_from(view, at + 12)[0]
            if not oflags & P_OVERFLOW or size > npages * psize - PAGEHDRSZ or at + PAGEHDRSZ + size > len(view):
                raise LmdbError(f"{path}: key {key[:64]!r}: its {size}-byte value at page {ov} runs past the file or "
                                "its overflow pages; the data.mdb is truncated or damaged")
            yield key, at + PAGEHDRSZ, size
        else:
            if data - (data // psize) * psize + size > psize:
                raise LmdbError(f"{path}: page {pgno}: key {key[:64]!r}: value runs past its page; the data.mdb is "
                                "damaged")
            yield key, data, size

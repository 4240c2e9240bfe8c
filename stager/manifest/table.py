"""A columnar table file: named numpy columns, fixed-shape or ragged, read through a memory map.

The per-sample index of a manifest v2 dataset lives in one such file beside ``manifest.json``
(docs/formats.md, "The sample index"). It is built for two readers: stager, which maps it once per
process so that every rank and worker on a node shares the same page-cache pages (no per-process
heap copy of per-sample arrays), and anyone else, who can read it with ``json`` and ``numpy``.

Layout (all integers little-endian)::

    offset 0   8 bytes   magic b"STGTABLE"
    offset 8   uint32    format version (1)
    offset 12  uint32    header length H
    offset 16  H bytes   header: compact UTF-8 JSON
               ...       zero padding to a multiple of 64
               columns   each column's C-ordered bytes, each starting at a multiple of 64

The header is ``{"rows": N, "columns": [{"name", "dtype", "shape", "offset", "nbytes"}, ...],
"ragged": [names], "meta": {...}}`` (``meta`` optional: the owner's facts, e.g. a pack's
done-record). ``dtype`` is a numpy type string with explicit byte order (``"<i8"``,
``"|u1"``, ``"<f4"``); ``offset`` is from the start of the file. A *ragged* column ``X`` (a
variable-length list per row: keys as UTF-8, boxes, per-box labels) is stored CSR-style as two
columns: ``X/values`` (all rows' items back to back, shape ``(M, ...)``) and ``X/starts`` (int64,
shape ``(N + 1,)``, row ``i`` is ``values[starts[i]:starts[i + 1]]``), and ``X`` is listed in
``ragged``. Column names are free-form strings (``/`` is allowed: they are not file names).
"""

from __future__ import annotations

import functools
import itertools
import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, TypeAlias, overload

from stager.errors import ManifestError
from stager.lazy import on_first_use

if TYPE_CHECKING:
    import numpy as np
else:  # the index is numpy columns; a plain stage never opens it: no numpy (stager/lazy.py)
    np = on_first_use("numpy", globals(), "np")

MAGIC = b"STGTABLE"
VERSION = 1
ALIGN = 64  # columns start on cache-line boundaries: any dtype is aligned, views need no copy
_PREFIX = struct.Struct("<8sII")
MAX_HEADER = 64 << 20


class Ragged:
    """A variable-length list per row, CSR-style: row ``i`` is ``values[starts[i]:starts[i+1]]``.

    ``values``: shape ``(M, ...)``; ``starts``: int64, shape ``(N + 1,)``, non-decreasing, from 0 to
    ``M``. Slicing rows (``r[a:b]``) returns a :class:`Ragged` view (no copy of ``values``).
    """

    __slots__ = ("starts", "values")

    def __init__(self, values: np.ndarray, starts: np.ndarray) -> None:
        self.values = values
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts) - 1

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> Ragged: ...
    def __getitem__(self, i: int | slice) -> np.ndarray | Ragged:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                raise ValueError("ragged columns slice with step 1 only")
            b = max(a, b)
            starts = self.starts[a : b + 1]
            base = int(starts[0]) if len(starts) else 0
            end = int(starts[-1]) if len(starts) else 0
            return Ragged(self.values[base:end], starts - base)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        return self.values[int(self.starts[i]) : int(self.starts[i + 1])]

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def lengths(self) -> np.ndarray:
        """int64 (N,): each row's number of items."""
        return np.diff(self.starts)

    @classmethod
    def from_rows(cls, rows: Iterable[Any], dtype: Any, item_shape: tuple[int, ...] = ()) -> Ragged:
        """Build from per-row sequences (each convertible to ``(n_i, *item_shape)`` of ``dtype``)."""
        arrs = [np.asarray(r, dtype=dtype).reshape((-1, *item_shape)) for r in rows]
        starts = np.zeros(len(arrs) + 1, dtype=np.int64)
        if arrs:
            np.cumsum([len(a) for a in arrs], out=starts[1:])
            values = np.concatenate(arrs) if starts[-1] else np.zeros((0, *item_shape), dtype=dtype)
        else:
            values = np.zeros((0, *item_shape), dtype=dtype)
        return cls(values, starts)

    @classmethod
    def concat(cls, parts: Sequence[Ragged]) -> Ragged:
        if not parts:
            raise ValueError("nothing to concatenate")
        if len(parts) == 1 and int(parts[0].starts[0]) == 0 and parts[0].starts.dtype == np.int64:
            # One part (one shard: an adopted image of a million keys) is already the result: no copies.
            return cls(parts[0].values[: int(parts[0].starts[-1])], parts[0].starts)
        starts = [np.zeros(1, np.int64)]
        base = 0
        for p in parts:
            starts.append(p.starts[1:] - p.starts[0] + base)
            base += int(p.starts[-1] - p.starts[0])
        values = np.concatenate([p.values[int(p.starts[0]) : int(p.starts[-1])] for p in parts])
        return cls(values, np.concatenate(starts))


_TAKE_CHUNK = 2048  # rows per byte gather in Strings.take
_HASH_P = 0x100000001B3  # odd: invertible modulo 2**64
_HASH_CHUNK = 1 << 16  # bytes hashed per pass: the temporaries stay in the CPU cache


@functools.cache
def _hash_powers() -> tuple[np.ndarray, np.ndarray]:
    """``P**k`` and ``P**-k`` modulo 2**64 for ``k < _HASH_CHUNK + 1`` (uint64)."""
    pw = np.full(_HASH_CHUNK + 1, _HASH_P, dtype=np.uint64)
    pw[0] = 1
    inv = np.full(_HASH_CHUNK + 1, pow(_HASH_P, -1, 1 << 64), dtype=np.uint64)
    inv[0] = 1
    return np.cumprod(pw), np.cumprod(inv)


def _row_hashes(raw: Ragged) -> np.ndarray:
    """uint64 (N,): each row's ``sum((byte[k] + 1) * P**k) ^ (length * C)`` modulo 2**64, computed a
    chunk of rows at a time with powers from the chunk's start, each row's sum shifted back by P's inverse.
    A row longer than a chunk is hashed alone, piece by piece."""
    starts = raw.starts
    n = len(starts) - 1
    out = np.zeros(n, dtype=np.uint64)
    values = raw.values
    pw, inv = _hash_powers()
    a = 0
    while a < n:
        base = int(starts[a])
        b = min(n, max(a + 1, int(np.searchsorted(starts, base + _HASH_CHUNK, side="right")) - 1))
        end = int(starts[b])
        if end - base > _HASH_CHUNK:  # one long row (Python ints: numpy scalars warn when they wrap)
            acc = 0
            for c in range(base, end, _HASH_CHUNK):
                part = values[c : min(end, c + _HASH_CHUNK)].astype(np.uint64) + np.uint64(1)
                piece = int(np.add.reduce(part * pw[: len(part)], dtype=np.uint64))
                acc = (acc + piece * pow(_HASH_P, c - base, 1 << 64)) % (1 << 64)
            out[a] = acc
        elif end > base:
            terms = (values[base:end].astype(np.uint64) + np.uint64(1)) * pw[: end - base]
            rel = starts[a:b] - base
            nonempty = starts[a + 1 : b + 1] > starts[a:b]
            sums = np.zeros(b - a, dtype=np.uint64)
            sums[nonempty] = np.add.reduceat(terms, rel[nonempty])
            out[a:b] = sums * inv[rel]
        out[a:b] ^= np.diff(starts[a : b + 1]).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        a = b
    return out


class Strings(Sequence[str]):
    """A column of strings as UTF-8 bytes plus row starts (a :class:`Ragged` of ``uint8``).

    Behaves as a read-only ``Sequence[str]``; a string is decoded only when asked for, so a million
    keys cost their bytes in a shared mapping instead of a million Python objects per process.
    """

    __slots__ = ("_raw",)

    def __init__(self, raw: Ragged) -> None:
        self._raw = raw

    @classmethod
    def from_strings(cls, items: Iterable[str]) -> Strings:
        texts = items if isinstance(items, list) else list(items)
        starts = np.zeros(len(texts) + 1, dtype=np.int64)
        joined = "".join(texts)
        if joined.isascii():  # the usual case: one encode, and a character is a byte (~5x faster)
            if texts:
                np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), out=starts[1:])
            return cls(Ragged(np.frombuffer(joined.encode(), dtype=np.uint8), starts))
        encoded = [s.encode() for s in texts]
        np.cumsum([len(b) for b in encoded], out=starts[1:])
        values = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        return cls(Ragged(values, starts))

    @property
    def raw(self) -> Ragged:
        return self._raw

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Strings: ...
    def __getitem__(self, i: int | slice) -> str | Strings:
        if isinstance(i, slice):
            return Strings(self._raw[i])
        return self._raw[int(i)].tobytes().decode()

    def __iter__(self) -> Iterator[str]:
        starts = self._raw.starts.tolist()
        data = self._raw.values
        base = starts[0] if starts else 0
        blob = data[base : starts[-1]].tobytes() if starts else b""
        for a, b in itertools.pairwise(starts):
            yield blob[a - base : b - base].decode()

    def take(self, rows: Iterable[int]) -> list[str]:
        """The strings at ``rows`` (any order), decoded. One gather of their bytes into one ``bytes``
        object, then a slice and decode each (a numpy slice and ``tobytes`` per string cost ~3x)."""
        r = np.fromiter(rows, dtype=np.int64) if not isinstance(rows, np.ndarray) else rows.astype(np.int64)
        if not len(r):
            return []
        if len(r) > _TAKE_CHUNK:  # the byte gather's temporaries stay in cache: ~2x faster a string at 16k rows
            out: list[str] = []
            for i in range(0, len(r), _TAKE_CHUNK):
                out += self.take(r[i : i + _TAKE_CHUNK])
            return out
        s, v = self._raw.starts, self._raw.values
        a = s[r]
        n = s[r + 1] - a
        ends = np.cumsum(n)
        begins = ends - n
        blob = v[np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(begins - a, n)].tobytes()
        return [blob[i:j].decode() for i, j in zip(begins.tolist(), ends.tolist(), strict=True)]

    def first_repeat(self) -> tuple[int, int] | None:
        """``(i, j)``, ``i < j``, of the first string ``j`` equal to an earlier one ``i``; None when all
        differ. Vectorised (a million keys in a fraction of a second, no Python string made): each row's
        64-bit polynomial hash of its bytes and length, rows of equal hashes compared exactly."""
        h = _row_hashes(self._raw)
        ordered = np.sort(h)
        if not (ordered[1:] == ordered[:-1]).any():
            return None
        order = np.argsort(h, kind="stable")
        hs = h[order]
        group = np.flatnonzero(np.diff(hs) != 0) + 1  # where each run of equal hashes starts
        bounds = np.concatenate([[0], group, [len(hs)]])
        best: tuple[int, int] | None = None
        for g in np.flatnonzero(np.diff(bounds) > 1).tolist():  # runs of two or more: compare exactly
            first: dict[bytes, int] = {}
            for r in sorted(order[bounds[g] : bounds[g + 1]].tolist()):
                i = first.setdefault(bytes(self._raw[r]), r)
                if i != r and (best is None or r < best[1]):
                    best = (i, r)
                    break
        return best

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Strings, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"Strings([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"


# A name for annotations only (a string: evaluating np.ndarray here would import numpy, stager/lazy.py).
Column: TypeAlias = "np.ndarray | Ragged | Strings"


def _pad(n: int) -> int:
    return -n % ALIGN


def _le(a: np.ndarray) -> np.ndarray:
    """``a`` with an explicit little-endian (or byte-order-free) dtype, as the file stores."""
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and not np.little_endian):
        return a.astype(a.dtype.newbyteorder("<"))
    return a


def write_table(f: BinaryIO, rows: int, columns: Mapping[str, Column | Sequence[Column]],
                meta: Mapping[str, Any] | None = None) -> int:
    """Write a table to the open binary file ``f`` (at its current position 0); return bytes written.

    Each value of ``columns`` is one column, or a sequence of *parts* (per-shard pieces, written back
    to back without being concatenated in memory: pack and index hand over one part per shard).
    Every column must have ``rows`` rows. ``f`` is written sequentially (a hashing wrapper works).
    ``meta``: a JSON object stored in the header (``Table.meta``), for the table's owner.
    """
    layout: list[tuple[str, list[np.ndarray]]] = []
    ragged: list[str] = []
    for name, value in columns.items():
        parts: list[Column] = list(value) if isinstance(value, (list, tuple)) else [value]  # type: ignore[list-item]
        if not parts:
            raise ValueError(f"column {name!r}: no parts")
        n = sum(len(p) for p in parts)
        if n != rows:
            raise ValueError(f"column {name!r} has {n} rows, table has {rows}")
        if isinstance(parts[0], (Ragged, Strings)):
            ragged.append(name)
            merged = _merge_ragged(parts)
            layout += [(f"{name}/{sub}", [arr]) for sub, arr in merged]
        else:
            layout.append((name, [_le(np.ascontiguousarray(p)) for p in parts]))
    entries: list[dict[str, Any]] = []
    pos = 0  # relative to the data start, fixed up below
    for name, arrs in layout:
        dt = arrs[0].dtype
        if any(a.dtype != dt or a.shape[1:] != arrs[0].shape[1:] for a in arrs):
            raise ValueError(f"column {name!r}: parts differ in dtype or item shape")
        shape = [sum(len(a) for a in arrs), *arrs[0].shape[1:]]
        nbytes = sum(a.nbytes for a in arrs)
        entries.append({"name": name, "dtype": dt.str, "shape": shape, "offset": pos, "nbytes": nbytes})
        pos += nbytes + _pad(nbytes)
    header: dict[str, Any] = {"rows": rows, "columns": entries, "ragged": ragged}
    if meta:
        header["meta"] = dict(meta)
    # The data start depends on the header's length, which depends on the offsets written in it:
    # iterate until the padded length is stable (it changes at most once or twice).
    data_start = 0
    for _ in range(8):
        for e, base in zip(entries, _relative(entries), strict=True):
            e["offset"] = data_start + base
        hb = json.dumps(header, separators=(",", ":")).encode()
        start = _PREFIX.size + len(hb)
        start += _pad(start)
        if start == data_start:
            break
        data_start = start
    written = 0
    for chunk in (_PREFIX.pack(MAGIC, VERSION, len(hb)), hb, b"\0" * _pad(_PREFIX.size + len(hb))):
        f.write(chunk)
        written += len(chunk)
    for (_, arrs), e in zip(layout, entries, strict=True):
        assert written == e["offset"], (written, e)
        for a in arrs:
            f.write(a.data.cast("B") if a.nbytes else b"")
            written += a.nbytes
        pad = _pad(int(e["nbytes"]))
        f.write(b"\0" * pad)
        written += pad
    return written


def _relative(entries: list[dict[str, Any]]) -> list[int]:
    out, pos = [], 0
    for e in entries:
        out.append(pos)
        pos += e["nbytes"] + _pad(e["nbytes"])
    return out


def _merge_ragged(parts: Sequence[Column]) -> list[tuple[str, np.ndarray]]:
    """A ragged column's ``values`` and ``starts`` from its parts (starts rebased, values joined)."""
    raws = [p.raw if isinstance(p, Strings) else p for p in parts]
    if not all(isinstance(r, Ragged) for r in raws):
        raise ValueError("a ragged column's parts must all be ragged")
    merged = Ragged.concat(raws)  # type: ignore[arg-type]
    return [("values", _le(np.ascontiguousarray(merged.values))), ("starts", merged.starts.astype("<i8", copy=False))]


@dataclass
class Table:
    """An opened table: ``rows`` and every column as a (memory-mapped) numpy view.

    ``columns`` maps a plain column's name to its array and a ragged column's name to a
    :class:`Ragged` (use :meth:`strings` for UTF-8 string columns). The views keep the mapping open.
    """

    rows: int
    columns: dict[str, np.ndarray | Ragged]
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.columns

    def array(self, name: str) -> np.ndarray:
        col = self.columns[name]
        if isinstance(col, Ragged):
            raise TypeError(f"column {name!r} is ragged")
        return col

    def ragged(self, name: str) -> Ragged:
        col = self.columns[name]
        if not isinstance(col, Ragged):
            raise TypeError(f"column {name!r} is not ragged")
        return col

    def strings(self, name: str) -> Strings:
        return Strings(self.ragged(name))


def parse_table(buf: Any, where: str) -> Table:
    """Parse a table from a buffer (an ``mmap``, ``bytes``); column arrays are views into it.

    Raises :class:`ManifestError` naming ``where`` for anything malformed (bad magic, a header or
    column outside the buffer, ragged starts that do not run from 0 to the values' length)."""
    size = len(buf)
    if size < _PREFIX.size:
        raise ManifestError(f"{where}: {size} bytes, too short for a sample index; restore it or re-run the pack")
    magic, version, hlen = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ManifestError(f"{where}: not a stager sample index (bad magic); restore it or re-run the pack")
    if version != VERSION:
        raise ManifestError(f"{where}: sample index version {version}, this stager reads {VERSION}; upgrade stager")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > size:
        raise ManifestError(f"{where}: sample index header runs past the file's {size} bytes; restore it")
    try:
        header = json.loads(bytes(buf[_PREFIX.size : _PREFIX.size + hlen]))
        rows = int(header["rows"])
        cols: dict[str, np.ndarray] = {}
        for e in header["columns"]:
            dt = np.dtype(e["dtype"])
            shape = tuple(int(v) for v in e["shape"])
            off, nb = int(e["offset"]), int(e["nbytes"])
            count = int(np.prod(shape)) if shape else 1
            if off < 0 or nb != count * dt.itemsize or off + nb > size or dt.hasobject:
                raise ManifestError(f"{where}: column {e['name']!r} does not fit the file; restore it")
            cols[str(e["name"])] = np.frombuffer(buf, dtype=dt, count=count, offset=off).reshape(shape)
        out: dict[str, np.ndarray | Ragged] = {}
        ragged = set(header.get("ragged", []))
        for name in ragged:
            values, starts = cols.pop(f"{name}/values"), cols.pop(f"{name}/starts")
            if (starts.ndim != 1 or len(starts) != rows + 1 or (rows + 1 and int(starts[0]) != 0)
                    or int(starts[-1]) != len(values) or not _non_decreasing(starts)):
                raise ManifestError(f"{where}: ragged column {name!r} has inconsistent row starts; restore it")
            out[name] = Ragged(values, starts)
        for name, arr in cols.items():
            if arr.ndim == 0 or len(arr) != rows:
                raise ManifestError(f"{where}: column {name!r} has {len(arr) if arr.ndim else 0} rows, not {rows}")
            out[name] = arr
    except ManifestError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: malformed sample index header ({exc}); restore it or re-run the pack") from exc
    meta = header.get("meta") or {}
    if not isinstance(meta, dict):
        raise ManifestError(f"{where}: sample index header's meta must be an object")
    return Table(rows, out, size, meta)


def _non_decreasing(a: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether ``a`` never decreases, checked in chunks (no temporary of ``a``'s size)."""
    for i in range(0, max(0, len(a) - 1), chunk):
        piece = a[i : i + chunk + 1]
        if bool((piece[1:] < piece[:-1]).any()):
            return False
    return True


def open_table(path: str | os.PathLike[str], where: str | None = None) -> Table:
    """Map a local table file read-only and parse it (pages are shared by every process mapping it)."""
    where = where or os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return parse_table(b"", where)
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    return parse_table(mm, where)

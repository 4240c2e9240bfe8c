"""MXNet RecordIO (``.rec`` + ``.idx``), read in place (read-only: stager never writes RecordIO).

Layout (dmlc-core ``RecordIOWriter``, what ``mx.recordio`` and ``im2rec`` write; docs/formats.md)::

    uint32 magic 0xced7230a | uint32 lrecord | data[length] | zero padding to a 4-byte boundary

with ``length = lrecord & (2**29 - 1)`` and ``cflag = lrecord >> 29``: 0 a whole record; 1, 2, 3 the
start, middle and end of a record the writer split where its data held the magic at a 4-byte-aligned
offset. That copy of the magic became the next part's header, so joining the parts puts the 4 magic
bytes back between them. A record's data is ``mx.recordio.pack``'s: the 24-byte IRHeader (struct
``IfQQ``: flag, float label, id, id2), then ``flag`` float32 labels when ``flag > 0`` (array labels; the
header's label is then 0), then the payload (the image file's bytes).

:func:`walk_records` parses a mapped file once and returns every record's place and header;
:class:`RecordIOShardReader` reads payloads. A payload is a contiguous byte range of the file unless
its record was split inside it; a file holding such a record is indexed with ``extents: "records"``
(``offsets`` = the record's first byte, ``sizes`` = its framed length) and read through
:meth:`RecordIOShardReader.read`, which joins the parts. A split needs the 4-byte magic at an aligned
offset of a payload: about one record in ``2**32 / (payload bytes / 4)``, so it is rare but real.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stager.errors import CorruptSampleError
from stager.formats.base import ExtentReader, Format, Sample, indexed_samples, pread_runs
from stager.formats.registry import format_spec

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)
LEN_MASK = (1 << 29) - 1
IR_HEADER = struct.Struct("<IfQQ")  # flag, label, id, id2: 24 bytes, as mx.recordio's "IfQQ" on x86/arm
_HEAD = struct.Struct("<II")


class RecordIOError(CorruptSampleError):
    """A damaged ``.rec`` or ``.idx``: exit 3 (the message names the file and the record)."""

    exit_code = 3


@dataclass
class RecEntry:
    """One record: where it is framed in the file and what its IRHeader says.

    ``start``/``end``: its framed byte range (first magic to the end of its last part's padding).
    ``payload``: ``(offset, size)`` of the payload in the file when contiguous, else None (split inside
    it). ``labels``: the float32 array labels (``flag > 0``) or None; ``label`` the header's label
    (the first array value for array labels).
    """

    start: int
    end: int
    payload: tuple[int, int] | None
    size: int  # payload length (joined)
    label: float
    labels: list[float] | None
    id: int
    id2: int


@dataclass
class RecScan:
    """A ``.rec`` file's records in file order, and the ``.idx`` keys when one was given."""

    entries: list[RecEntry] = field(default_factory=list)
    idx_keys: list[str] | None = None


def _parts(view: memoryview, pos: int, size: int, path: str, n: int) -> tuple[list[tuple[int, int]], int]:
    """The ``(data offset, length)`` parts of the record framed at ``pos``, and where the next record starts."""
    parts: list[tuple[int, int]] = []
    while True:
        if pos + 8 > size:
            raise RecordIOError(f"{path}: record {n} at byte {pos}: truncated header (the file ends at {size}); "
                                "the .rec is truncated: restore it")
        magic, lrec = _HEAD.unpack_from(view, pos)
        if magic != MAGIC:
            raise RecordIOError(f"{path}: record {n} at byte {pos}: bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}); "
                                "not an MXNet RecordIO file, or damaged")
        length, cflag = lrec & LEN_MASK, lrec >> 29
        want_first = not parts
        if (want_first and cflag not in (0, 1)) or (not want_first and cflag not in (2, 3)) or cflag > 3:
            raise RecordIOError(f"{path}: record {n} at byte {pos}: continuation flag {cflag} out of sequence; "
                                "the file is damaged")
        end = pos + 8 + length + (-length % 4)
        if pos + 8 + length > size:
            raise RecordIOError(f"{path}: record {n} at byte {pos}: length {length} runs past the end of the file "
                                f"({size} bytes); the .rec is truncated: restore it")
        parts.append((pos + 8, length))
        pos = end
        if cflag in (0, 3):
            return parts, min(pos, size)


def _joined(view: memoryview, parts: list[tuple[int, int]], upto: int) -> bytes:
    """The first ``upto`` bytes of a record's data, its parts joined with the magic put back."""
    out = bytearray()
    for i, (off, length) in enumerate(parts):
        if i:
            out += MAGIC_BYTES
        out += view[off : off + length]
        if len(out) >= upto:
            break
    return bytes(out[:upto])


def _locate(parts: list[tuple[int, int]], start: int, size: int) -> tuple[int, int] | None:
    """The file range of data bytes ``[start, start + size)`` if they lie within one part, else None."""
    logical = 0
    for off, length in parts:
        if logical <= start and start + size <= logical + length:
            return off + start - logical, size
        logical += length + 4  # the magic put back between parts
    return None


def _entry(view: memoryview, start: int, end: int, parts: list[tuple[int, int]], *, path: str, n: int) -> RecEntry:
    total = sum(length for _, length in parts) + 4 * (len(parts) - 1)
    if total < IR_HEADER.size:
        raise RecordIOError(f"{path}: record {n} at byte {start}: {total} bytes, shorter than the 24-byte IRHeader; "
                            "not written by mx.recordio.pack")
    head = _joined(view, parts, IR_HEADER.size) if len(parts) > 1 else view[parts[0][0] : parts[0][0] + 24]
    flag, label, rid, rid2 = IR_HEADER.unpack(head)
    skip = IR_HEADER.size + 4 * flag
    if flag > LEN_MASK or skip > total:
        raise RecordIOError(f"{path}: record {n} at byte {start}: IRHeader flag {flag} says {flag} float labels, more "
                            f"than the record's {total} bytes hold; the file is damaged")
    labels: list[float] | None = None
    if flag:
        raw = _joined(view, parts, skip)[IR_HEADER.size :] if len(parts) > 1 else view[
            parts[0][0] + 24 : parts[0][0] + skip]
        labels = np.frombuffer(raw, dtype="<f4").astype(float).tolist()
        label = labels[0]
    return RecEntry(start, end, _locate(parts, skip, total - skip), total - skip, float(label), labels, rid, rid2)


def walk_records(view: memoryview, path: str) -> list[RecEntry]:
    """Every record of the mapped ``.rec`` file ``view``, in file order (see the module docstring).

    Raises :class:`RecordIOError` naming the file, the record number and its byte for a bad magic, a
    length past the end (truncated), a continuation out of sequence or a header that does not fit.
    """
    out: list[RecEntry] = []
    size = len(view)
    pos = 0
    while pos < size:
        parts, nxt = _parts(view, pos, size, path, len(out))
        out.append(_entry(view, pos, nxt, parts, path=path, n=len(out)))
        pos = nxt
    return out


def idx_path_of(rec_path: str) -> str:
    """MXNet's companion index of ``x.rec``: ``x.idx``."""
    stem, ext = os.path.splitext(rec_path)
    return (stem if ext.lower() == ".rec" else rec_path) + ".idx"


def read_idx(path: str, rec_path: str, entries: Sequence[RecEntry]) -> list[str]:
    """The keys of an MXNet ``.idx`` (``key\\toffset`` per record), checked against the walked records.

    Every record must be listed once at its first byte; raises :class:`RecordIOError` naming the
    ``.idx`` line and the record otherwise (delete the ``.idx`` to index by a scan, or regenerate it).
    """
    by_start = {e.start: i for i, e in enumerate(entries)}
    keys: list[str | None] = [None] * len(entries)
    fix = f"; the .idx disagrees with {os.path.basename(rec_path)}: delete it (a scan rebuilds it) or regenerate it"
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                key, off = parts[0].decode(), int(parts[1])
                if len(parts) != 2:
                    raise ValueError
            except (ValueError, IndexError, UnicodeDecodeError):
                raise RecordIOError(f"{path}: line {lineno}: expected '<key>\\t<offset>'{fix}") from None
            i = by_start.get(off)
            if i is None:
                raise RecordIOError(f"{path}: line {lineno}: key {key} at byte {off}: no record of {rec_path} starts "
                                    f"there{fix}")
            if keys[i] is not None:
                raise RecordIOError(f"{path}: line {lineno}: key {key}: record {i} at byte {off} is listed twice{fix}")
            keys[i] = key
    missing = next((i for i, k in enumerate(keys) if k is None), None)
    if missing is not None:
        raise RecordIOError(f"{path}: record {missing} at byte {entries[missing].start} of {rec_path} is not "
                            f"listed ({sum(k is not None for k in keys)} of {len(entries)} records are){fix}")
    return [k for k in keys if k is not None]


def join_record(buf: bytes | memoryview, where: str) -> bytes:
    """The payload of one framed record ``buf`` (its parts joined, IRHeader and array labels dropped)."""
    view = memoryview(buf)
    parts, _ = _parts(view, 0, len(view), where, 0)
    data = _joined(view, parts, 1 << 62)
    (flag,) = struct.unpack_from("<I", data)
    return data[IR_HEADER.size + 4 * flag :]


class RecordIOShardReader(ExtentReader):
    """Payloads by the manifest's extents: byte ranges (one ``pread`` per run), or, for a file with
    ``extents: "records"``, whole framed records joined by :func:`join_record`."""

    def read(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        if self.info is None or self.info.extents != "records":
            return super().read(positions)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        try:
            framed = pread_runs(self.fd(), self.info.offsets[pos], self.info.sizes[pos])
        except EOFError as exc:
            raise CorruptSampleError(f"{self.path}: {exc}; the .rec is truncated: re-stage it") from exc
        return [join_record(b, f"{self.path} (sample {int(p)})") for b, p in zip(framed, pos.tolist(), strict=True)]

    def iter_samples(self) -> Iterator[Sample]:
        """The indexed samples in order, payloads read by :meth:`read` (keys and labels from the index)."""
        return indexed_samples(self, "RecordIO")


class RecordIOFormat(Format):
    """MXNet RecordIO files adopted by ``stager index`` (reader only)."""

    spec = format_spec("recordio")
    reader = RecordIOShardReader


FORMAT = RecordIOFormat()

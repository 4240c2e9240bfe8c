"""record shards: TFRecord files of ``tf.train.Example`` messages (docs/formats.md, "record").

Framing of each record, exactly as TensorFlow's ``TFRecordWriter`` writes it::

    uint64 length (little endian) | uint32 masked_crc32c(length bytes) | payload | uint32 masked_crc32c(payload)

with ``masked_crc(c) = ((c >> 15 | c << 17) + 0xa282ead8) mod 2**32`` over CRC-32C (Castagnoli).
The payload is a ``tf.train.Example`` with the conventional ImageNet feature keys, serialised in
sorted key order (what ``SerializeToString(deterministic=True)`` gives)::

    image/class/label  int64  the label (-1 when unlabeled)
    image/class/text   bytes  the class name (UTF-8; empty when unlabeled)
    image/encoded      bytes  the image file's bytes, unchanged
    image/filename     bytes  the sample key (UTF-8)
    image/format       bytes  b"JPEG", b"PNG", ... (upper-cased extension; jpg -> JPEG)

Each shard ``shard-00000.tfrecord`` has a companion index ``shard-00000.tfrecord.idx`` with one line
``<record offset> <record size>\\n`` per record, as DALI's ``tfrecord2idx`` writes it (also what the
``tfrecord`` package reads). The manifest extent of a sample is the offset/size of its
``image/encoded`` bytes inside the shard file, so the loader reads images with ``pread`` and never
parses protobuf.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from stager.errors import CorruptSampleError, UsageError
from stager.formats.base import (
    BufferedShardFile,
    Extent,
    ExtentReader,
    Format,
    Sample,
    SizeInputs,
    ascii_lengths,
    varint_lengths,
)
from stager.formats.example_pb import ExampleDecodeError, bytes_feature, decode_example, int64_feature, varint
from stager.formats.record_fields import encode_fields_example, field_extents
from stager.formats.registry import format_spec
from stager.fs.atomic import partial_path
from stager.fs.safe import open_exclusive
from stager.lazy import on_first_use
from stager.manifest.fields import FieldSpec

if TYPE_CHECKING:
    import crc32c as _crc32c
else:  # its import reads package metadata: ~30 ms that every `stager index` would pay, whatever it indexes
    _crc32c = on_first_use("crc32c", globals(), "_crc32c")

RECORD_SPEC = format_spec("record")
_MASK_DELTA = 0xA282EAD8
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
MAX_RECORD = 1 << 34  # refuse absurd lengths from a damaged header before allocating
_FORMATS = {"jpg": b"JPEG", "jpeg": b"JPEG", "png": b"PNG", "tif": b"TIFF"}
_EXTS = {b"JPEG": "jpg", b"PNG": "png", b"TIFF": "tif"}

K_LABEL = "image/class/label"
K_TEXT = "image/class/text"
K_ENCODED = "image/encoded"
K_FILENAME = "image/filename"
K_FORMAT = "image/format"


def masked_crc(data: bytes | bytearray | memoryview) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    c = _crc32c.crc32c(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def image_format(ext: str) -> bytes:
    """The ``image/format`` value for a file extension: ``jpg`` -> ``b"JPEG"``, ``png`` -> ``b"PNG"``."""
    e = ext.lower()
    return _FORMATS.get(e, e.upper().encode())


def ext_of_format(fmt: bytes) -> str:
    """Inverse of :func:`image_format` (``b"JPEG"`` -> ``jpg``)."""
    return _EXTS.get(fmt.upper(), fmt.decode("ascii", "replace").lower())


def _entry(name: str, kind_tag: int, list_body: bytes) -> bytes:
    """One ``Features.feature`` map entry holding a Feature whose list message is ``list_body``."""
    key = name.encode()
    feature = bytes([kind_tag]) + varint(len(list_body)) + list_body
    inner = b"\x0a" + varint(len(key)) + key + b"\x12" + varint(len(feature)) + feature
    return b"\x0a" + varint(len(inner)) + inner


def _bytes_entry(name: str, value: bytes) -> bytes:
    return _entry(name, 0x0A, b"\x0a" + varint(len(value)) + value)


def encode_image_example(
    key: str, label: int, cls: str, data: bytes | bytearray | memoryview, fmt: bytes
) -> tuple[bytes, int]:
    """Serialised Example for one image and the offset of ``image/encoded``'s bytes inside it.

    Byte-identical to protobuf's deterministic serialisation of the same features (tested).
    """
    packed = varint(label & 0xFFFFFFFFFFFFFFFF)
    head = _entry(K_LABEL, 0x1A, b"\x0a" + varint(len(packed)) + packed) + _bytes_entry(K_TEXT, cls.encode())
    # image/encoded, built around the image so it is copied once, by the final join.
    key_b = K_ENCODED.encode()
    blist_head = b"\x0a" + varint(len(data))
    blist_len = len(blist_head) + len(data)
    feat_head = b"\x0a" + varint(blist_len)
    feat_len = len(feat_head) + blist_len
    inner_head = b"\x0a" + varint(len(key_b)) + key_b + b"\x12" + varint(feat_len)
    entry_head = b"\x0a" + varint(len(inner_head) + feat_len) + inner_head + feat_head + blist_head
    tail = _bytes_entry(K_FILENAME, key.encode()) + _bytes_entry(K_FORMAT, fmt)
    body_len = len(head) + len(entry_head) + len(data) + len(tail)
    top = b"\x0a" + varint(body_len)
    offset = len(top) + len(head) + len(entry_head)
    return b"".join((top, head, entry_head, data, tail)), offset


def _bytes_entry_lengths(name_len: int, value_len: np.ndarray) -> np.ndarray:
    """Lengths of :func:`_bytes_entry` for a ``name_len``-byte name and values of ``value_len`` bytes."""
    body = 1 + varint_lengths(value_len) + value_len
    feature = 1 + varint_lengths(body) + body
    inner = 2 + len(varint(name_len)) + name_len + varint_lengths(feature) + feature
    return 1 + varint_lengths(inner) + inner


def sample_disk_bytes(inputs: SizeInputs) -> tuple[np.ndarray, int]:
    """``(bytes of each sample's record, 0)`` in a TFRecord shard (its ``.idx`` companion aside):
    exact for files that pass through unchanged, the arithmetic of :func:`encode_image_example`
    plus the 16 bytes of framing."""
    sizes = inputs.sizes.astype(np.int64, copy=False)
    classes = inputs.classes
    uniq, which = np.unique(inputs.labels, return_inverse=True)
    heads = []
    for label in uniq.tolist():  # the label and class-name entries, once per label
        cls = classes[label] if 0 <= label < len(classes) else ""
        packed = varint(label & 0xFFFFFFFFFFFFFFFF)
        heads.append(len(_entry(K_LABEL, 0x1A, b"\x0a" + varint(len(packed)) + packed)) + len(
            _bytes_entry(K_TEXT, cls.encode())))
    head = np.asarray(heads, dtype=np.int64)[which.reshape(-1)]
    blist = 1 + varint_lengths(sizes) + sizes
    feat = 1 + varint_lengths(blist) + blist
    inner = 2 + len(varint(len(K_ENCODED))) + len(K_ENCODED) + varint_lengths(feat) + feat
    encoded = 1 + varint_lengths(inner) + inner
    kinds = set(inputs.exts)
    if len(kinds) == 1:
        fmt_len = np.full(len(sizes), len(image_format(kinds.pop())), dtype=np.int64)
    else:
        fmts = {e: len(image_format(e)) for e in kinds}
        fmt_len = np.asarray([fmts[e] for e in inputs.exts], dtype=np.int64)
    tail = _bytes_entry_lengths(len(K_FILENAME), ascii_lengths(inputs.keys)) + _bytes_entry_lengths(
        len(K_FORMAT), fmt_len)
    body = head + encoded + tail
    return 16 + 1 + varint_lengths(body) + body, 0


class RecordShardWriter(BufferedShardFile):
    """Writes one TFRecord shard and, on close, its DALI-style ``.idx`` companion.

    Records are accumulated and written in ``flush_bytes`` chunks; ``fsync``, ``hasher`` (fed every
    byte of the shard as it is written; the ``.idx`` companion is not included) and ``writeback`` as
    for the tar writer.
    """

    def __init__(
        self, path: str, *, shard_name: str, classes: Sequence[str], fields: Sequence[FieldSpec] = (), **options: Any,
    ) -> None:
        super().__init__(path, shard_name=shard_name, classes=classes, **options)
        self._fields = list(fields)
        self._index: list[bytes] = []
        self._idx_tmp: str | None = None

    def write(self, sample: Sample) -> Extent:
        self._check_open()
        data = sample.data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(
                f"{self.shard_name}: record stores encoded image files; got {type(data).__name__} for {sample.key!r}"
            )
        label = int(sample.label)
        if not -(1 << 63) <= label < (1 << 63):
            raise UsageError(f"{self.shard_name}: label {label} of {sample.key!r} does not fit int64")
        cls = self.classes[label] if 0 <= label < len(self.classes) else ""
        field_offsets: dict[str, list[int]] = {}
        if self._fields:
            image = {K_LABEL: int64_feature(label), K_TEXT: bytes_feature(cls.encode()), K_ENCODED: bytes_feature(data),
                     K_FILENAME: bytes_feature(sample.key.encode()), K_FORMAT: bytes_feature(image_format(sample.ext))}
            hw = (int(sample.meta.get("height", 0)), int(sample.meta.get("width", 0)))
            payload, field_offsets = encode_fields_example(image, sample.fields, self._fields, hw, sample.key)
            off = field_offsets[K_ENCODED][0]
        else:
            payload, off = encode_image_example(sample.key, label, cls, data, image_format(sample.ext))
        n = len(payload)
        length = _U64.pack(n)
        start = self._written + len(self._buf)
        buf = self._buf
        buf += length
        buf += _U32.pack(masked_crc(length))
        buf += payload
        buf += _U32.pack(masked_crc(payload))
        self._index.append(RECORD_SPEC.companion_line % (start, n + 16))
        if len(buf) >= self._flush_bytes:
            self._flush()
        extents = field_extents(field_offsets, sample.fields, self._fields, start + 12) if self._fields else None
        return Extent(start + 12 + off, len(data), extents)

    def close(self) -> list[tuple[str, str]]:
        """Flush the shard and write ``<shard_name>.idx`` next to it; return ``[(idx name, temp path)]``."""
        if self.closed:
            return []
        self._finish()
        final = RECORD_SPEC.companion_name(self.shard_name)
        assert final is not None
        tmp = str(partial_path(os.path.join(os.path.dirname(os.path.abspath(self.path)), final)))
        self._idx_tmp = tmp
        with open_exclusive(tmp) as f:
            f.write(b"".join(self._index))
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        return [(final, tmp)]

    def abort(self) -> None:
        super().abort()
        if self._idx_tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._idx_tmp)


def iter_records(f: BinaryIO, file_size: int, where: str) -> Iterator[tuple[int, bytes]]:
    """Yield ``(payload file offset, payload)`` for each record, checking both CRCs.

    Raises :class:`CorruptSampleError` on truncation or a CRC mismatch.
    """
    pos = 0
    while pos < file_size:
        head = f.read(12)
        if len(head) < 12:
            raise CorruptSampleError(f"{where}: truncated record header at byte {pos}; re-pack or re-stage this shard")
        (n,) = _U64.unpack_from(head)
        (crc,) = _U32.unpack_from(head, 8)
        if masked_crc(head[:8]) != crc:
            raise CorruptSampleError(f"{where}: record length CRC mismatch at byte {pos}; the shard is damaged")
        if n > MAX_RECORD or pos + 16 + n > file_size:
            raise CorruptSampleError(
                f"{where}: record at byte {pos} claims {n} bytes but the file has {file_size}; the shard is truncated"
            )
        payload = f.read(n)
        tail = f.read(4)
        if len(payload) < n or len(tail) < 4:
            raise CorruptSampleError(f"{where}: truncated record at byte {pos}")
        if masked_crc(payload) != _U32.unpack(tail)[0]:
            raise CorruptSampleError(
                f"{where}: record data CRC mismatch at byte {pos}; the shard is damaged: re-pack or re-stage it"
            )
        yield pos + 12, payload
        pos += 16 + n


def example_to_sample(payload: bytes, index: int, where: str) -> Sample:
    """Interpret a serialised Example with the ImageNet keys as a :class:`Sample`."""
    try:
        feats = decode_example(payload)
    except ExampleDecodeError as exc:
        raise CorruptSampleError(f"{where}: record {index}: not a tf.train.Example ({exc})") from exc
    enc = feats.get(K_ENCODED)
    if enc is None or enc.kind != "bytes" or len(enc.values) != 1:
        raise CorruptSampleError(f"{where}: record {index}: expected exactly one {K_ENCODED} bytes value")
    lab = feats.get(K_LABEL)
    label = int(lab.values[0]) if lab is not None and lab.kind == "int64" and lab.values else -1
    fn = feats.get(K_FILENAME)
    key = f"{index:08d}"
    if fn is not None and fn.kind == "bytes" and fn.values and isinstance(fn.values[0], bytes):
        try:
            key = fn.values[0].decode()
        except UnicodeDecodeError as exc:
            raise CorruptSampleError(f"{where}: record {index}: {K_FILENAME} is not UTF-8") from exc
    fm = feats.get(K_FORMAT)
    ext = "jpg"
    if fm is not None and fm.kind == "bytes" and fm.values and isinstance(fm.values[0], bytes):
        ext = ext_of_format(fm.values[0])
    data = enc.values[0]
    assert isinstance(data, bytes)
    return Sample(key=key, label=label, data=data, ext=ext)


class RecordShardReader(ExtentReader):
    """Reads one record shard: ``iter_samples`` parses it; ``read`` uses the manifest's extents."""

    def iter_samples(self) -> Iterator[Sample]:
        """Every sample in physical order; framing, both CRCs and the Example are checked."""
        with self.scanned() as (f, size):
            for i, (_off, payload) in enumerate(iter_records(f, size, self.path)):
                yield example_to_sample(payload, i, self.path)


def read_index(path: str) -> np.ndarray:
    """Parse a ``.idx`` companion: int64 array of shape (records, 2) = (offset, size) per record."""
    rows = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if len(parts) != 2:
                raise CorruptSampleError(f"{path}:{lineno}: expected '<offset> <size>'")
            try:
                off, size = int(parts[0]), int(parts[1])
            except ValueError as exc:
                raise CorruptSampleError(f"{path}:{lineno}: expected two integers") from exc
            if not (0 <= off < 1 << 63 and 0 <= size < 1 << 63):
                raise CorruptSampleError(f"{path}:{lineno}: offset/size out of range")
            rows.append((off, size))
    return np.array(rows, dtype=np.int64).reshape(-1, 2)


class RecordFormat(Format):
    """TFRecord shards of ``tf.train.Example`` (``shard-00000.tfrecord`` + ``.idx``)."""

    spec = RECORD_SPEC
    reader = RecordShardReader
    writer = RecordShardWriter

    def disk_bytes(self, inputs: SizeInputs) -> tuple[np.ndarray, int]:
        """Each sample's record bytes in a shard file (:func:`sample_disk_bytes`); no fixed part."""
        return sample_disk_bytes(inputs)


FORMAT = RecordFormat()

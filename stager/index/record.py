"""Index TFRecord files of ``tf.train.Example`` (TensorFlow's ``TFRecordWriter``, the ``tfrecord`` package).

Each record's framing and both masked CRC-32Cs are checked (``stager.formats.record``'s rules), the
Example is parsed by stager's protobuf-free codec, and the manifest extent of a sample is the byte
range of its ``image_key`` bytes value inside the file, so the loader reads it with one ``pread``
(or a slice of the mapped file) exactly as for a stager record pack. The label is the ``label_key``
feature: an int64 (plus ``label_offset``) or a bytes class name. The key is ``image/filename`` when
the records carry it, else the record's position. The DALI index lines (record offset, framed size)
come out of the same pass.
"""

from __future__ import annotations

import struct
from typing import Any

from stager.formats.example_pb import ExampleDecodeError, decode_example
from stager.formats.record import K_FILENAME, MAX_RECORD, masked_crc
from stager.index.scan import DamagedShardError, ShardScan, mapped

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def scan_record(path: str, name: str, image_key: str | None, label_key: str | None, algo: str) -> ShardScan:
    """Index one TFRecord file; raises CorruptSampleError naming the file and the record's byte."""
    image_key = image_key or "image/encoded"
    with mapped(path, algo) as (view, digest, st):
        out = ShardScan(name, st.st_size, digest, st.st_mtime_ns, records=[])
        size = len(view)
        pos = 0
        while pos < size:
            if pos + 12 > size:
                raise DamagedShardError(f"{path}: truncated record header at byte {pos}; the file is damaged")
            (n,) = _U64.unpack_from(view, pos)
            if masked_crc(view[pos : pos + 8]) != _U32.unpack_from(view, pos + 8)[0]:
                raise DamagedShardError(f"{path}: record length CRC mismatch at byte {pos}; not a TFRecord file "
                                         "or damaged (compressed TFRecords are not supported: decompress them)")
            if n > MAX_RECORD or pos + 16 + n > size:
                raise DamagedShardError(f"{path}: record at byte {pos} claims {n} bytes but the file has {size}; "
                                         "the file is truncated")
            payload = view[pos + 12 : pos + 12 + n]
            if masked_crc(payload) != _U32.unpack_from(view, pos + 12 + n)[0]:
                raise DamagedShardError(f"{path}: record data CRC mismatch at byte {pos}; the file is damaged")
            _sample(out, payload, pos, image_key=image_key, label_key=label_key, path=path)
            del payload
            out.records.append((pos, n + 16))  # type: ignore[union-attr]
            pos += 16 + n
    return out


def _sample(out: ShardScan, payload: memoryview, pos: int, *, image_key: str, label_key: str | None, path: str) -> None:
    i = len(out.keys)
    try:
        feats = decode_example(payload)
    except ExampleDecodeError as exc:
        raise DamagedShardError(f"{path}: record {i} at byte {pos}: not a tf.train.Example ({exc})") from exc
    img = feats.get(image_key)
    if img is None or img.kind != "bytes" or len(img.values) != 1:
        have = ", ".join(sorted(k for k, f in feats.items() if f.kind == "bytes"))
        raise DamagedShardError(f"{path}: record {i} at byte {pos}: no single bytes feature {image_key!r} "
                                 f"(bytes features: {have}); pass --image-key")
    out.offsets.append(pos + 12 + img.offsets[0])
    value = img.values[0]
    assert isinstance(value, bytes)
    out.sizes.append(len(value))
    out.labels.append(_label(feats, label_key, i, pos, path))
    fn = feats.get(K_FILENAME)
    key = f"{out.name}/{i:08d}"
    if fn is not None and fn.kind == "bytes" and len(fn.values) == 1:
        raw = fn.values[0]
        assert isinstance(raw, bytes)
        key = raw.decode("utf-8", "replace") or key
    out.keys.append(key)


def _label(feats: dict[str, Any], label_key: str | None, i: int, pos: int, path: str) -> Any:
    if label_key is None:
        return None
    f = feats.get(label_key)
    if f is None or not f.values:
        return None
    if len(f.values) != 1 or f.kind == "float":
        raise DamagedShardError(f"{path}: record {i} at byte {pos}: {label_key!r} holds {len(f.values)} "
                                 f"{f.kind} values; expected one int64 or one class name")
    v = f.values[0]
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return int(v)

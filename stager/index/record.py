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

import numpy as np

from stager.errors import UsageError
from stager.formats.example_pb import ExampleDecodeError, decode_example
from stager.formats.record import K_FILENAME, MAX_RECORD, masked_crc
from stager.formats.record_fields import K_BBOX, K_BOX_LABEL, K_HEIGHT, K_SEG, K_SEG_FORMAT, K_WIDTH
from stager.index.fields import FieldRows, Found
from stager.index.scan import DamagedShardError, ShardScan, mapped
from stager.manifest.fields import MASK_HINTS, FieldSpec

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")


def scan_record(path: str, name: str, image_key: str | None, label_key: str | None, algo: str, *,
              fields: bool = True) -> ShardScan:
    """Index one TFRecord file; raises CorruptSampleError naming the file and the record's byte."""
    image_key = image_key or "image/encoded"
    with mapped(path, algo) as (view, digest, st):
        out = ShardScan(name, st.st_size, digest, st.st_mtime_ns, records=[])
        rows = FieldRows(out, path)
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
            feats = _sample(out, payload, pos, image_key=image_key, label_key=label_key, path=path)
            if fields:
                where = f"{path}: record {len(out.keys) - 1}"
                rows.add(out.keys[-1], _fields(feats, pos + 12, image_key, label_key, where))
            del payload
            out.records.append((pos, n + 16))  # type: ignore[union-attr]
            pos += 16 + n
    return out


def _sample(out: ShardScan, payload: memoryview, pos: int, *, image_key: str, label_key: str | None, path: str
            ) -> dict[str, Any]:
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
    return feats


def _fields(feats: dict[str, Any], base: int, image_key: str, label_key: str | None, where: str) -> list[Found]:
    """The Object Detection API keys of an Example as fields, the schema stager's record writer uses
    (:mod:`stager.formats.record_fields`): ``boxes`` from ``image/object/bbox/*`` (back to pixels with
    ``image/height``/``width``), ``box_labels`` from ``image/object/class/label``, other numeric
    ``image/object/<name>`` lists as per-box fields, ``mask`` from ``image/segmentation/class/encoded``,
    and single bytes values under a plain name (``meta``, ``depth``) typed by their first bytes."""
    found: list[Found] = []
    if all(k in feats for k in K_BBOX):
        h, w = (_one_int(feats, k, where) for k in (K_HEIGHT, K_WIDTH))
        cols = [np.asarray(feats[k].values, dtype=np.float64) * (w if j % 2 == 0 else h) for j, k in enumerate(K_BBOX)]
        if len({len(c) for c in cols}) != 1:
            raise DamagedShardError(f"{where}: image/object/bbox/* lists of different lengths")
        boxes = np.stack(cols, axis=1).astype(np.float32)
        found.append(Found(FieldSpec("boxes", "boxes"), values=boxes.reshape(-1).tolist()))
        for k, f in feats.items():
            if not k.startswith("image/object/") or k.startswith("image/object/bbox/") or f.kind == "bytes":
                continue
            name = "box_labels" if k == K_BOX_LABEL else k[len("image/object/"):].replace("/", "_")
            kind = "box_labels" if k == K_BOX_LABEL else "per_box"
            n, m = len(boxes), len(f.values)
            item = () if kind == "box_labels" or m == n or not n or m % n else (m // n,)
            try:
                spec = FieldSpec(name, kind, dtype="int64" if f.kind == "int64" else "float32", item=item)
            except UsageError:
                continue
            found.append(Found(spec, values=list(f.values)))
    for k, f in feats.items():
        if f.kind != "bytes" or len(f.values) != 1 or k in (image_key, label_key):
            continue
        bspec = _bytes_spec(k, f.values[0], feats)
        if bspec is not None:
            found.append(Found(bspec, extent=(base + f.offsets[0], len(f.values[0]))))
    return found


def _bytes_spec(key: str, value: bytes, feats: dict[str, Any]) -> FieldSpec | None:
    """The field a single bytes feature holds: the segmentation mask, or a plain-named field by its magic."""
    if key == K_SEG:
        fmt = feats.get(K_SEG_FORMAT)
        ext = fmt.values[0].decode("ascii", "replace").lower() if fmt is not None and fmt.values else "png"
        return FieldSpec("mask", "mask", ext)
    if "/" in key:
        return None
    if value.startswith(b"\x93NUMPY"):
        kind, ext = "array", "npy"
    elif value.startswith(b"\x89PNG"):
        kind, ext = ("mask" if any(h in key for h in MASK_HINTS) else "image"), "png"
    elif value.startswith(b"\xff\xd8"):
        kind, ext = "image", "jpg"
    elif value[:1] in (b"{", b"["):
        kind, ext = "json", "json"
    else:
        kind, ext = "bytes", "bin"
    try:
        return FieldSpec(key, kind, ext)
    except UsageError:
        return None


def _one_int(feats: dict[str, Any], key: str, where: str) -> int:
    f = feats.get(key)
    if f is None or f.kind != "int64" or len(f.values) != 1:
        raise DamagedShardError(f"{where}: has image/object/bbox/* but no single int64 {key!r} to scale them "
                                "to pixels")
    return int(f.values[0])


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

"""A minimal, dependency-free encoder/decoder for ``tf.train.Example`` protobuf messages.

Only the three message types a TFRecord image dataset needs are handled (field numbers from
``tensorflow/core/example/{example,feature}.proto``)::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }      # map entry: key = 1, value = 2
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }
    Int64List { repeated int64 value = 1 [packed = true]; }

Encoding is deterministic (map entries sorted by key, packed numeric lists: exactly what protobuf's
``SerializeToString(deterministic=True)`` emits), so identical features give identical bytes.
Decoding follows protobuf semantics (unknown fields skipped, packed and unpacked numeric lists both
accepted, the last duplicate map entry wins) and checks every length against the buffer, raising
:class:`ExampleDecodeError` instead of reading past it. We hand-roll this to keep ``protobuf`` out
of the package's dependencies and because a specialised encoder is several times faster than
building message objects per sample.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["bytes", "int64", "float"]
_KIND_TAG = {"bytes": 0x0A, "float": 0x12, "int64": 0x1A}  # Feature.oneof field tags (LEN wire type)
_TAG_KIND = {1: "bytes", 2: "float", 3: "int64"}
_MASK64 = (1 << 64) - 1


class ExampleDecodeError(ValueError):
    """The buffer is not a well-formed ``tf.train.Example``."""


@dataclass(frozen=True)
class Feature:
    """One feature: ``kind`` and its ``values``.

    For ``bytes`` features ``offsets`` holds, per value, the byte offset of the value inside the
    buffer it was decoded from (or encoded into); it is empty for numeric kinds.
    """

    kind: Kind
    values: tuple[bytes, ...] | tuple[int, ...] | tuple[float, ...]
    offsets: tuple[int, ...] = ()


def bytes_feature(*values: bytes) -> Feature:
    return Feature("bytes", tuple(bytes(v) for v in values))


def int64_feature(*values: int) -> Feature:
    for v in values:
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"int64 feature value {v} out of range")
    return Feature("int64", tuple(int(v) for v in values))


def float_feature(*values: float) -> Feature:
    return Feature("float", tuple(float(v) for v in values))


# ---- encoding ----------------------------------------------------------------------------------
_SMALL_VARINTS = [bytes([i]) for i in range(128)]


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (negative int64: pass ``n & 2**64-1``)."""
    if n < 128:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_feature_value(f: Feature) -> tuple[bytes, list[int]]:
    """Serialised ``Feature`` message and the offsets of its bytes values inside it."""
    offsets: list[int] = []
    if f.kind == "bytes":
        parts = []
        pos = 0
        for v in f.values:
            assert isinstance(v, bytes)
            head = b"\x0a" + varint(len(v))
            parts.append(head)
            parts.append(v)
            offsets.append(pos + len(head))
            pos += len(head) + len(v)
        body = b"".join(parts)
    elif f.kind == "int64":
        packed = b"".join(varint(int(v) & _MASK64) for v in f.values)
        body = b"\x0a" + varint(len(packed)) + packed if f.values else b""
    elif f.kind == "float":
        packed = struct.pack(f"<{len(f.values)}f", *f.values)
        body = b"\x0a" + varint(len(packed)) + packed if f.values else b""
    else:
        raise ValueError(f"unknown feature kind {f.kind!r}")
    head = bytes([_KIND_TAG[f.kind]]) + varint(len(body))
    return head + body, [o + len(head) for o in offsets]


def encode_example(features: Mapping[str, Feature]) -> tuple[bytes, dict[str, list[int]]]:
    """Serialise an ``Example`` with entries sorted by key.

    Returns ``(payload, offsets)`` where ``offsets[name]`` lists the byte offset inside ``payload``
    of each value of the bytes feature ``name`` (so a writer can record where an image lives).
    """
    if not features:
        return b"", {}  # protobuf omits an empty (unset) ``features`` message
    entries = []
    entry_offsets: list[tuple[str, int, list[int]]] = []
    pos = 0
    for name in sorted(features):
        key = name.encode()
        fbytes, foffs = encode_feature_value(features[name])
        inner = b"\x0a" + varint(len(key)) + key + b"\x12" + varint(len(fbytes))
        entry_len = len(inner) + len(fbytes)
        head = b"\x0a" + varint(entry_len)
        entries.append(head + inner)
        entries.append(fbytes)
        entry_offsets.append((name, pos + len(head) + len(inner), foffs))
        pos += len(head) + entry_len
    feats = b"".join(entries)
    top = b"\x0a" + varint(len(feats))
    offsets = {name: [len(top) + base + o for o in foffs] for name, base, foffs in entry_offsets if foffs}
    return top + feats, offsets


# ---- decoding ----------------------------------------------------------------------------------
def _read_varint(buf: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise ExampleDecodeError(f"truncated varint at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise ExampleDecodeError(f"varint longer than 10 bytes at byte {pos}")


def _fields(buf: bytes | memoryview, pos: int, end: int) -> list[tuple[int, int, int, int]]:
    """Top-level fields of the message in ``buf[pos:end]``: ``(field, wire type, value/start, end)``.

    For LEN fields the tuple holds the payload's ``start`` and ``end``; for varints the value and
    -1; fixed32/fixed64 give their start and end.
    """
    out = []
    while pos < end:
        tag, pos = _read_varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise ExampleDecodeError(f"field number 0 at byte {pos}")
        if wire == 0:
            value, pos = _read_varint(buf, pos, end)
            out.append((field, 0, value, -1))
        elif wire == 2:
            n, pos = _read_varint(buf, pos, end)
            if n > end - pos:
                raise ExampleDecodeError(f"length {n} at byte {pos} runs past the end of its message")
            out.append((field, 2, pos, pos + n))
            pos += n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if n > end - pos:
                raise ExampleDecodeError(f"truncated fixed{n * 8} at byte {pos}")
            out.append((field, wire, pos, pos + n))
            pos += n
        else:
            raise ExampleDecodeError(f"unsupported wire type {wire} at byte {pos}")
    return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _decode_feature(buf: bytes | memoryview, start: int, end: int) -> Feature:
    kind: Kind | None = None
    values: list = []
    offsets: list[int] = []
    for field, wire, a, b in _fields(buf, start, end):
        if field not in _TAG_KIND or wire != 2:
            continue  # unknown field: skipped, as protobuf does
        new_kind = _TAG_KIND[field]
        if new_kind != kind:  # oneof: a later member replaces an earlier one
            kind = new_kind  # type: ignore[assignment]
            values, offsets = [], []
        for f2, w2, c, d in _fields(buf, a, b):
            if f2 != 1:
                continue
            if kind == "bytes":
                if w2 != 2:
                    raise ExampleDecodeError(f"BytesList value with wire type {w2}")
                values.append(bytes(buf[c:d]))
                offsets.append(c)
            elif kind == "int64":
                if w2 == 0:
                    values.append(_signed(c))
                elif w2 == 2:
                    p = c
                    while p < d:
                        v, p = _read_varint(buf, p, d)
                        values.append(_signed(v))
                else:
                    raise ExampleDecodeError(f"Int64List value with wire type {w2}")
            elif w2 == 5:
                values.append(struct.unpack_from("<f", buf, c)[0])
            elif w2 == 2:
                if (d - c) % 4:
                    raise ExampleDecodeError("packed FloatList length is not a multiple of 4")
                values.extend(struct.unpack_from(f"<{(d - c) // 4}f", buf, c))
            else:
                raise ExampleDecodeError(f"FloatList value with wire type {w2}")
    if kind is None:
        return Feature("bytes", ())  # an empty Feature (no kind set)
    return Feature(kind, tuple(values), tuple(offsets))


def decode_example(buf: bytes | memoryview) -> dict[str, Feature]:
    """Parse a serialised ``Example``; return its features by name.

    Bytes features carry the offsets of their values inside ``buf``. Raises
    :class:`ExampleDecodeError` on malformed input (never reads outside ``buf``).
    """
    features: dict[str, Feature] = {}
    end = len(buf)
    for field, wire, a, b in _fields(buf, 0, end):
        if field != 1 or wire != 2:
            continue
        for f2, w2, c, d in _fields(buf, a, b):
            if f2 != 1 or w2 != 2:
                continue
            name: str | None = None
            feature = Feature("bytes", ())
            for f3, w3, e, g in _fields(buf, c, d):
                if f3 == 1 and w3 == 2:
                    try:
                        name = bytes(buf[e:g]).decode()
                    except UnicodeDecodeError as exc:
                        raise ExampleDecodeError(f"feature name is not UTF-8: {exc}") from exc
                elif f3 == 2 and w3 == 2:
                    feature = _decode_feature(buf, e, g)
            features[name or ""] = feature
    return features

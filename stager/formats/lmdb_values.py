"""What an LMDB value holds, per layout: where its image bytes are, its label, its shape.

Two layouts (docs/index.md, "LMDB"):

* ``caffe``: a serialised ``caffe.Datum`` (protobuf: ``channels = 1``, ``height = 2``, ``width = 3``,
  ``data = 4`` bytes, ``label = 5`` int32, ``float_data = 6``, ``encoded = 7`` bool), as Caffe's
  ``convert_imageset`` writes it. ``encoded``: ``data`` holds the image file's bytes (JPEG/PNG); raw:
  ``channels x height x width`` uint8, channel-planar, BGR (OpenCV's order).
* ``pickle``: ``pickle.dumps((image bytes, label))`` per sample plus ``__keys__``/``__len__``
  entries (the Efficient-PyTorch ``folder2lmdb`` style); protocol 3 or later, so the image is one
  BINBYTES run inside the value.

Both put the image in one contiguous byte range of the value: :func:`parse_datum` and
:func:`parse_pickled` return it (relative to the value) so the manifest extent is a range of
``data.mdb``. The pickle is loaded with no globals allowed, so no code in a value runs.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, NamedTuple

LAYOUTS = ("auto", "caffe", "pickle")
META_KEYS = (b"__keys__", b"__len__")  # folder2lmdb's bookkeeping entries, not samples


class Value(NamedTuple):
    """A parsed value: image bytes at ``offset`` (relative to the value) of ``size``; ``label`` (None
    when absent); ``shape`` ``(C, H, W)`` for raw (not encoded) Datums, else None."""

    offset: int
    size: int
    label: int | None
    shape: tuple[int, int, int] | None


class BadValueError(ValueError):
    """A value that does not hold what its layout says (the scanner names the file and key)."""


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise BadValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def parse_datum(buf: bytes | memoryview) -> Value:
    """The image range, label and raw shape of a serialised ``caffe.Datum`` (see the module docstring).

    ``buf`` may be a view of the mapped file: only the field headers are read (``data`` is skipped by
    its length), so a large value is never copied.

    Raises ``ValueError`` for a value that is not a Datum, a float Datum (``float_data``), or raw data
    whose size is not ``channels * height * width``.
    """
    fields: dict[int, int] = {}
    data: tuple[int, int] | None = None
    floats = False
    pos, n = 0, len(buf)
    while pos < n:
        tag, pos = _varint(buf, pos)
        num, wire = tag >> 3, tag & 7
        if wire == 0:
            v, pos = _varint(buf, pos)
            fields[num] = v
        elif wire == 2:
            ln, pos = _varint(buf, pos)
            if pos + ln > n:
                raise BadValueError(f"field {num} runs past the value's {n} bytes")
            if num == 4:
                data = (pos, ln)
            floats |= num == 6 and ln > 0
            pos += ln
        elif wire == 5:
            pos += 4
            floats |= num == 6
        elif wire == 1:
            pos += 8
        else:
            raise BadValueError(f"protobuf wire type {wire} (field {num})")
        if pos > n or num == 0:
            raise BadValueError("not a protobuf message")
    if floats:
        raise BadValueError("a float Datum (float_data); stager reads uint8 and encoded Datums")
    if data is None:
        raise BadValueError("no data field (4)")
    label = fields.get(5)
    if label is not None:
        label = label - (1 << 64) if label >= 1 << 63 else label
    if fields.get(7):
        return Value(data[0], data[1], label, None)
    c, h, w = fields.get(1, 0), fields.get(2, 0), fields.get(3, 0)
    if c * h * w != data[1] or not c * h * w:
        raise BadValueError(f"raw Datum of channels {c} x height {h} x width {w} = {c * h * w} bytes holds {data[1]} "
                            "bytes of data")
    return Value(data[0], data[1], label, (c, h, w))


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise BadValueError(f"the pickle refers to {module}.{name}; stager loads only (bytes, int) tuples")


_BYTES_OPS = ((b"C", 1), (b"B", 4), (b"\x8e", 8))  # SHORT_BINBYTES, BINBYTES, BINBYTES8 + length width


def parse_pickled(buf: bytes) -> Value:
    """The image range and label of a ``pickle.dumps((image bytes, label))`` value.

    The tuple is loaded with no globals allowed, then the image's BINBYTES run is located in the
    value (the opcode and length just before it must match), so the range is exact.
    """
    try:
        obj = _NoGlobals(io.BytesIO(buf)).load()
    except BadValueError:
        raise
    except Exception as exc:  # UnpicklingError, EOFError, ...: anything a damaged value raises
        raise BadValueError(f"not a pickle ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(obj, tuple) and len(obj) >= 1 and isinstance(obj[0], bytes)):
        raise BadValueError(f"expected a pickled (image bytes, label) tuple, got {type(obj).__name__}")
    img = obj[0]
    label = obj[1] if len(obj) > 1 else None
    if label is not None and (isinstance(label, bool) or not isinstance(label, int)):
        raise BadValueError(f"label is {type(label).__name__}, expected an integer")
    at = buf.find(img)
    while at >= 0:
        for op, width in _BYTES_OPS:
            h = at - width - 1
            if h >= 0 and buf[h : h + 1] == op and int.from_bytes(buf[h + 1 : at], "little") == len(img):
                return Value(at, len(img), label, None)
        at = buf.find(img, at + 1)
    raise BadValueError("the image bytes are not one BINBYTES run (pickle protocol 2 or older?); re-pickle with "
                        "protocol 3 or later")


def parse_value(buf: memoryview, layout: str) -> Value:
    """The value ``buf`` (a view) parsed by ``layout``: a pickle is loaded from a copy, a Datum in place."""
    return parse_pickled(bytes(buf)) if layout == "pickle" else parse_datum(buf)


def sniff_layout(first: bytes, keys: set[bytes]) -> str:
    """``pickle`` when the LMDB has folder2lmdb's meta keys or its first value is a pickle, else ``caffe``."""
    if keys & set(META_KEYS) or first[:1] == b"\x80":
        return "pickle"
    return "caffe"


def decode_len(buf: bytes) -> int | None:
    """folder2lmdb's ``__len__`` value (a pickled int), or None when it is not one."""
    try:
        n = _NoGlobals(io.BytesIO(buf)).load()
    except Exception:  # any damage: the caller reports the count it found
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None

"""tar shards, laid out as webdataset expects them (docs/formats.md, section "tar").

Each sample is two consecutive regular-file members, three with the writer option ``json_member``
(``stager pack --tar-json``)::

    <key>.<ext>    the image file's bytes, unchanged (ext lower-cased: jpg, png, ...)
    <key>.cls      the label as ASCII decimal (``-1`` when unlabeled)
    <key>.json     only with json_member: {"class": ..., "key": ..., "label": ..., **meta} with sorted
                   keys, compact

Without ``.json`` (the default) a sample of a ~1 KB image takes 2.5 KB on disk instead of 3.6 KB; what
it held stays in the manifest (keys, labels, class names) and in the key itself (the source's relative
path without its extension). :func:`sample_disk_bytes` gives a sample's exact footprint, which the pack
plan uses to cut shards at ``--shard-size`` file bytes.

Headers are POSIX ustar written by hand (``tarfile`` costs ~30 us per member): fixed mtime, mode
0644, uid/gid 0, empty uname/gname, so identical samples give identical bytes. A name longer than
the 100-byte name field is split into the 155-byte ``prefix`` field at a ``/``; a name that cannot
be split (or is not ASCII) gets a preceding PAX ``x`` header with a ``path`` record. The archive
ends with two zero blocks. The manifest extent of a sample is the offset/size of the image
member's data.

Keys may contain ``/`` but no ``.`` in their last component (webdataset splits a member name at
the first dot of its last component), must not start with ``/`` or ``__`` and must not contain
``..`` components.

The reader parses headers itself (checksums, sizes against the file length, member types) so that a
damaged or hostile shard raises :class:`~stager.errors.CorruptSampleError` or
:class:`~stager.errors.UnsafeArchiveError` naming the shard, never a stray exception.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, BinaryIO

import numpy as np

from stager.errors import CorruptSampleError, ShardMissingError, UnsafeArchiveError, UsageError
from stager.formats.base import (
    BufferedShardFile,
    Extent,
    ExtentReader,
    Sample,
    SizeInputs,
    ascii_lengths,
    field_payload,
)
from stager.manifest import Manifest, ShardInfo
from stager.manifest.fields import FieldSpec, sample_fields, specs_from_json

BLOCK = 512
FIXED_MTIME = 946684800  # 2000-01-01T00:00:00Z: fixed for reproducibility, yet "plausible" to GNU tar
FILE_MODE = 0o644
MAX_USTAR_SIZE = (1 << 33) - 1  # 11 octal digits
FLUSH_BYTES = 4 << 20  # accumulate this much before one write() call
RESERVED_EXTS = frozenset({"cls", "json"})
_RESERVED_META = frozenset({"class", "key", "label"})
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "pbm", "bmp", "tif", "tiff", "gif", "jp2", "jxl", "avif")
_ZERO_BLOCK = bytes(BLOCK)
_PADS = [bytes(n) for n in range(BLOCK)]
_EXT_RE = re.compile(r"^[a-z0-9_][a-z0-9_.-]{0,31}$")
# '/'-separated non-empty parts without NUL or backslash; no part is '.' or '..'; the last part has
# no '.'; no leading '__' (webdataset's skip_meta pattern).
_KEY_RE = re.compile(r"(?!__)(?:(?!\.\.?/)[^/\\\0]+/)*[^./\\\0]+")
_KEY_BODY = r"(?!__)(?:(?!\.\.?/)[^/\\\0\n]+/)*[^./\\\0\n]+"
_KEYS_RE = re.compile(f"{_KEY_BODY}(?:\n{_KEY_BODY})*")  # newline-joined keys, each matching _KEY_RE


def _pad(n: int) -> bytes:
    return _PADS[-n % BLOCK]


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
# Constant pieces of a regular-file header with an empty prefix, for the per-sample fast path.
_MID1 = _TEMPLATE[100:124]  # mode, uid, gid
_MID2 = _TEMPLATE[136:148]  # mtime
_REG_TAIL = b"0" + _TEMPLATE[157:]  # typeflag '0', linkname, magic..devminor, empty prefix, padding
_REG_SUM = _TEMPLATE_SUM + ord("0")
_NULS = [bytes(n) for n in range(101)]


_SIZE_FIELDS: dict[int, tuple[bytes, int]] = {}


def _size_field(size: int) -> tuple[bytes, int]:
    """``(size field, its byte sum)``, cached for the small sizes of ``.cls``/``.json`` members."""
    got = _SIZE_FIELDS.get(size)
    if got is None:
        sz = b"%011o\0" % size
        got = (sz, sum(sz))
        if size < 4096:
            _SIZE_FIELDS[size] = got
    return got


def _ustar_header(name: bytes, size: int, typeflag: bytes = b"0", prefix: bytes = b"") -> bytes:
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
        return _ustar_header(ustar_name, size, b"0", prefix)
    data = b"".join(pax)
    return (
        _ustar_header(b"././@PaxHeader", len(data), b"x")
        + data
        + _pad(len(data))
        # With a PAX size record the ustar size field is ignored by readers; tarfile writes 0 there.
        + _ustar_header(ustar_name, size if size <= MAX_USTAR_SIZE else 0, b"0", prefix)
    )


def _ustar_split(raw: bytes) -> tuple[bytes, bytes] | None:
    """Split ``raw`` at a ``/`` into (prefix <= 155 bytes, name <= 100 bytes), or None."""
    i = raw.find(b"/", max(0, len(raw) - 101))
    while i != -1:
        if i <= 155 and len(raw) - i - 1 <= 100 and i > 0:
            return raw[:i], raw[i + 1 :]
        i = raw.find(b"/", i + 1)
    return None


def check_keys(keys: Sequence[str], where: str = "") -> None:
    """Validate many keys at once (what :func:`check_key` checks for each, and uniqueness).

    One regular-expression pass over the joined keys instead of one call per key: ``stager pack``
    validates a whole plan this way before writing anything, then opens writers with
    ``keys_checked=True``. Raises :class:`UsageError` naming the first bad or repeated key.
    """
    if not keys:
        return
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        for k in keys:
            if k in seen:
                raise UsageError(f"{where}duplicate sample key {k!r}")
            seen.add(k)
    try:
        joined = "\n".join(keys)
    except TypeError:  # a key is not a string: the loop below names it
        joined = "\n" * len(keys)
    if joined.count("\n") == len(keys) - 1 and _KEYS_RE.fullmatch(joined):  # no key holds a newline
        return
    for k in keys:  # find and name the first offender
        check_key(k, where)


def check_key(key: object, where: str = "") -> str:
    """Return ``key`` if webdataset will group its members back under exactly this key."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise UsageError(
            f"{where}invalid sample key {key!r}: expected '/'-separated non-empty parts, no '.' in the last "
            "part, no '.' or '..' part, not starting with '__' (webdataset splits member names at the first dot)"
        )
    return key


def _json_meta(key: str, label: int, cls: str, meta: dict[str, Any]) -> bytes:
    """Compact, sorted-key JSON of ``{**meta, class, key, label}``, byte-identical to
    ``json.dumps(..., sort_keys=True, separators=(",", ":"))`` but several times cheaper for flat
    metadata: the sorted field order is computed once per set of metadata keys, and str/int values
    are encoded directly (anything else goes through ``json.dumps`` per value)."""
    if not meta:
        return (
            f'{{"class":{encode_basestring_ascii(cls)},"key":{encode_basestring_ascii(key)},"label":{label}}}'.encode()
        )
    if len(meta) == 1 and type(meta.get("source")) is str:  # what `stager pack` writes
        return (
            f'{{"class":{encode_basestring_ascii(cls)},"key":{encode_basestring_ascii(key)},"label":{label},'
            f'"source":{encode_basestring_ascii(meta["source"])}}}'
        ).encode()
    values = {**meta, "class": cls, "key": key, "label": label}
    parts = []
    for k, prefix in _json_plan(tuple(meta), key):
        v = values[k]
        t = type(v)
        if t is str:
            parts.append(prefix + encode_basestring_ascii(v))
        elif t is int:
            parts.append(prefix + int.__repr__(v))
        else:
            parts.append(prefix + json.dumps(v, sort_keys=True, separators=(",", ":")))
    return ("{" + ",".join(parts) + "}").encode()


_PLANS: dict[tuple[Any, ...], tuple[tuple[str, str], ...]] = {}


def _json_plan(meta_keys: tuple[Any, ...], key: str) -> tuple[tuple[str, str], ...]:
    """``(field, '"field":')`` pairs in sorted field order for samples whose meta has ``meta_keys``."""
    plan = _PLANS.get(meta_keys)
    if plan is None:
        for k in meta_keys:
            if not isinstance(k, str):
                raise UsageError(f"sample {key!r}: metadata keys must be strings, got {k!r}")
        names = sorted({*meta_keys, *_RESERVED_META})
        plan = tuple((k, encode_basestring_ascii(k) + ":") for k in names)
        if len(_PLANS) < 4096:  # bounded: metadata key sets are few in practice
            _PLANS[meta_keys] = plan
    return plan


def _padded(n: np.ndarray) -> np.ndarray:
    return (n + (BLOCK - 1)) // BLOCK * BLOCK


def sample_disk_bytes(inputs: SizeInputs) -> tuple[np.ndarray, int]:
    """``(bytes of each sample's members, the two end blocks)`` in a tar shard: exact for image files
    that pass through unchanged (see :class:`~stager.formats.base.SizedFormat`).

    A sample is a 512-byte header per member, its image padded to 512 and one block of ``.cls`` data
    (+ the padded ``.json`` with ``json_member``). Keys too long for the name field (or not ASCII) get
    their exact PAX/prefix headers from :func:`member_header`.
    """
    sizes = inputs.sizes.astype(np.int64, copy=False)
    keys = inputs.keys
    out = 3 * BLOCK + _padded(sizes)  # image header, .cls header + data block
    if not "".join(keys).isascii():
        odd: Sequence[int] = range(len(keys))
    elif max(map(len, keys), default=0) <= 95:  # every name fits the name field (the usual case)
        odd = []
    else:
        odd = np.flatnonzero(ascii_lengths(keys) > 95).tolist()
    for i in odd:  # names too long for the name field, or not ASCII: exact headers
        key, ext, size = keys[i], inputs.exts[i], int(sizes[i])
        out[i] = len(member_header(f"{key}.{ext}", size)) + -(-size // BLOCK) * BLOCK
        out[i] += len(member_header(f"{key}.cls", 1)) + BLOCK
    if inputs.options.get("json_member"):
        classes = inputs.classes
        labels = inputs.labels.tolist()
        for i, (key, ext) in enumerate(zip(keys, inputs.exts, strict=True)):
            label = labels[i]
            cls = classes[label] if 0 <= label < len(classes) else ""
            # The meta `stager pack` writes: {"source": <relative path>}, i.e. the key plus the extension.
            js = len(_json_meta(key, label, cls, {"source": f"{key}.{ext}"}))
            out[i] += len(member_header(f"{key}.json", js)) + -(-js // BLOCK) * BLOCK
    return out, 2 * BLOCK


class TarShardWriter(BufferedShardFile):
    """Writes one tar shard; see the module docstring for the layout.

    Members are accumulated in a buffer and written in ``flush_bytes`` chunks, so a shard of small
    images costs a handful of ``write`` calls rather than several per sample.

    Options: ``flush_bytes`` (buffer size before a write), ``fsync`` (fsync in ``close()``; off by
    default because the caller, ``stager.pack``, fsyncs and hashes the file before renaming it),
    ``keys_checked`` (the caller has already validated every key with :func:`check_keys` and
    guarantees they are unique: the per-sample key checks are skipped), ``hasher`` (an object with
    ``update(bytes)``, e.g. an xxh3 hasher: every byte of the shard is fed to it as it is written, so
    the caller need not read the file back to hash it), ``writeback`` (start the kernel's writeback
    of each chunk as it is written, see :mod:`stager.writeback`, so that the caller's fsync is
    short), ``json_member`` (also write each sample's ``<key>.json`` member). Unknown options are
    ignored so that one option set can be passed to every format.
    """

    def __init__(
        self,
        path: str,
        *,
        shard_name: str,
        classes: Sequence[str],
        flush_bytes: int = FLUSH_BYTES,
        fsync: bool = False,
        keys_checked: bool = False,
        hasher: Any = None,
        writeback: bool = False,
        json_member: bool = False,
        fields: Sequence[FieldSpec] = (),
        **options: Any,
    ) -> None:
        super().__init__(path, flush_bytes=flush_bytes, fsync=fsync, hasher=hasher, writeback=writeback)
        self.shard_name = shard_name
        self.classes = list(classes)
        self._fields = {f.name: f for f in fields}
        self._keys_checked = keys_checked
        self._json = json_member
        self._keys: set[str] = set()
        self._exts_ok: dict[str, tuple[str, bytes, int]] = {}  # extension -> (lower, b".lower", byte sum)
        self._labels: dict[Any, tuple[int, str, tuple[bytes, bytes], bytes, int]] = {}

    def write(self, sample: Sample) -> Extent:
        if self._closed():
            raise UsageError(f"{self.shard_name}: write() after close()")
        key = sample.key
        if not self._keys_checked:
            if key in self._keys:
                raise UsageError(f"{self.shard_name}: duplicate sample key {key!r} in one shard")
            check_key(key, f"{self.shard_name}: ")
        data = sample.data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(
                f"{self.shard_name}: tar stores encoded image files; got {type(data).__name__} for {key!r}"
            )
        ext_entry = self._exts_ok.get(sample.ext)
        if ext_entry is None:
            ext_entry = self._ext_entry(sample.ext, key)
        ext, dot_ext, ext_sum = ext_entry
        per_label = self._labels.get(sample.label)
        if per_label is None:
            per_label = self._label_entry(sample.label)
        label, cls, cls_member, cls_sz, cls_zs = per_label
        if not self._keys_checked:
            self._keys.add(key)  # only once the sample is known to be writable

        size = len(data)
        kb = key.encode()
        nk = len(kb)
        buf = self._buf
        if nk <= 95 and nk + len(dot_ext) <= 100 and kb.isascii():  # all the names fit the name field
            # One join builds the sample's members, headers from constant pieces with the key's byte
            # sum computed once for every checksum (the checksum field counts as spaces).
            ks = _REG_SUM + sum(kb)
            sz = b"%011o\0" % size
            offset = self._written + len(buf) + BLOCK
            buf += b"".join(
                (
                    kb, dot_ext, _NULS[100 - nk - len(dot_ext)], _MID1, sz, _MID2,
                    b"%06o\0 " % (ks + ext_sum + sum(sz)), _REG_TAIL, data, _PADS[-size % BLOCK],
                    kb, b".cls", _NULS[96 - nk], _MID1, cls_sz, _MID2, b"%06o\0 " % (ks + 368 + cls_zs), _REG_TAIL,
                    cls_member[0],
                )
            )  # fmt: skip
            if self._json:
                js = _json_meta(key, label, cls, sample.meta)
                nj = len(js)
                jz, jzs = _SIZE_FIELDS.get(nj) or _size_field(nj)
                buf += b"".join(
                    (kb, b".json", _NULS[95 - nk], _MID1, jz, _MID2, b"%06o\0 " % (ks + 488 + jzs), _REG_TAIL,
                     js, _PADS[-nj % BLOCK])
                )  # fmt: skip
        else:
            buf += member_header(f"{key}.{ext}", size)
            offset = self._written + len(buf)
            buf += data
            buf += _PADS[-size % BLOCK]
            buf += member_header(f"{key}.cls", len(cls_member[1]))
            buf += cls_member[0]
            if self._json:
                js = _json_meta(key, label, cls, sample.meta)
                buf += member_header(f"{key}.json", len(js))
                buf += js
                buf += _PADS[-len(js) % BLOCK]
        extents = self._write_fields(key, sample.fields) if sample.fields else None
        if len(self._buf) >= self._flush_bytes:
            self._flush()
        return Extent(offset, size, extents)

    def _write_fields(self, key: str, values: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """Append one ``KEY.<name>.<ext>`` member per field (schema order); their data extents."""
        out: dict[str, tuple[int, int]] = {}
        buf = self._buf
        for name, spec in self._fields.items():
            if name not in values:
                raise UsageError(f"{self.shard_name}: sample {key!r} lacks field {name!r}")
            data = field_payload(spec, values[name])
            buf += member_header(f"{key}.{spec.member_suffix}", len(data))
            out[name] = (self._written + len(buf), len(data))
            buf += data
            buf += _PADS[-len(data) % BLOCK]
        return out

    def _closed(self) -> bool:
        return self._f is None

    def _ext_entry(self, ext: str, key: str) -> tuple[str, bytes, int]:
        low = ext.lower()
        if not _EXT_RE.match(low) or low in RESERVED_EXTS:
            raise UsageError(f"{self.shard_name}: invalid image extension {ext!r} for {key!r}")
        dot = b"." + low.encode()
        entry = self._exts_ok[ext] = (low, dot, sum(dot))
        return entry

    def _label_entry(self, label: Any) -> tuple[int, str, tuple[bytes, bytes], bytes, int]:
        """``(int label, class name, (padded .cls data, .cls data), .cls size field, its byte sum)``
        for ``label``, cached per label."""
        value = int(label)
        cls = self.classes[value] if 0 <= value < len(self.classes) else ""
        text = b"%d" % value
        sz, zs = _size_field(len(text))
        entry = (value, cls, (text + _PADS[-len(text) % BLOCK], text), sz, zs)
        self._labels[label] = entry
        return entry

    def close(self) -> list[tuple[str, str]]:
        if self._f is None:
            return []
        self._buf += _ZERO_BLOCK * 2
        self._finish()
        return []


class TarFragmentWriter(TarShardWriter):
    """Builds a run of samples' tar members in memory, without the end-of-archive marker.

    Tar members do not record their position, so a shard is the concatenation of the fragments of
    consecutive runs of its samples followed by two zero blocks, byte-identical to what
    :class:`TarShardWriter` writes for the same samples. ``stager pack --workers N`` builds
    fragments of one shard in parallel and writes each at its offset. ``write`` returns extents
    relative to the fragment's start; :meth:`take` returns the bytes.
    """

    def __init__(
        self, *, shard_name: str, classes: Sequence[str], keys_checked: bool = False, json_member: bool = False,
        fields: Sequence[FieldSpec] = (), **options: Any,
    ) -> None:
        self.path = ""
        self.shard_name = shard_name
        self.classes = list(classes)
        self._json = json_member
        self._fields = {f.name: f for f in fields}
        self._flush_bytes = 1 << 62  # never flushed: the caller takes the bytes
        self._fsync = False
        self._keys_checked = keys_checked
        self._hasher = None
        self._writeback = False
        self._f = None
        self._open = True
        self._buf = bytearray()
        self._written = 0
        self._keys = set()
        self._exts_ok = {}
        self._labels = {}

    def _closed(self) -> bool:
        return not self._open

    def take(self) -> bytearray:
        """The fragment's bytes; the writer is finished afterwards."""
        self._open = False
        buf, self._buf = self._buf, bytearray()
        return buf

    def close(self) -> list[tuple[str, str]]:
        self._open = False
        return []

    def abort(self) -> None:
        self._open = False
        self._buf = bytearray()


# ---- reading -----------------------------------------------------------------------------------
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


def split_member_name(name: str) -> tuple[str, str]:
    """webdataset's rule: split at the first ``.`` of the last path component -> (key, ext)."""
    head, _, last = name.rpartition("/")
    base, dot, ext = last.partition(".")
    if not dot or not base:
        return name, ""
    return (f"{head}/{base}" if head else base), ext


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
        if hdr == _ZERO_BLOCK:
            if bytes(take(BLOCK)) != _ZERO_BLOCK:
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


def _choose_image(members: dict[str, bytes]) -> str | None:
    for ext in members:
        if ext.lower() in IMAGE_EXTS:
            return ext
    for ext in members:
        if ext.lower() not in RESERVED_EXTS and ext.lower() not in ("txt", "__key__"):
            return ext
    return None


def _to_sample(key: str, members: dict[str, bytes], where: str) -> Sample:
    ext = _choose_image(members)
    if ext is None:
        raise CorruptSampleError(f"{where}: sample {key!r} has no image member (members: {sorted(members)})")
    meta: dict[str, Any] = {}
    label = -1
    if "json" in members:
        try:
            info = json.loads(members["json"])
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CorruptSampleError(f"{where}: sample {key!r}: bad JSON metadata ({exc})") from exc
        if isinstance(info, dict):
            if isinstance(info.get("label"), int):
                label = info["label"]
            meta = {k: v for k, v in info.items() if k not in ("class", "key", "label")}
    if "cls" in members:
        try:
            label = int(members["cls"].strip())
        except ValueError as exc:
            raise CorruptSampleError(f"{where}: sample {key!r}: .cls is not an integer") from exc
    return Sample(key=key, label=label, data=members[ext], ext=ext, meta=meta)


class TarShardReader(ExtentReader):
    """Reads one tar shard: ``iter_samples`` parses it; ``read`` uses the manifest's extents.

    With the manifest of a pack with fields, ``iter_samples`` yields each sample's fields too
    (``KEY.<name>.<ext>`` members: bytes, or the ragged kinds' arrays parsed from their JSON)."""

    def __init__(self, path: str, info: ShardInfo | None = None, manifest: Manifest | None = None) -> None:
        super().__init__(path, info, manifest)
        self._specs = specs_from_json(sample_fields(manifest.fields)) if manifest is not None else []

    def iter_samples(self) -> Iterator[Sample]:
        """Every sample in physical order, grouped by key (members of one sample are consecutive)."""
        where = self.path
        try:
            f = open(self.path, "rb", buffering=1 << 20)  # noqa: SIM115 - closed in finally
        except FileNotFoundError as exc:
            raise ShardMissingError(f"{self.path}: shard missing; re-stage or re-pack") from exc
        try:
            size = os.fstat(f.fileno()).st_size
            key: str | None = None
            members: dict[str, bytes] = {}
            seen: set[str] = set()
            for name, _off, data in iter_members(f, size, where):
                k, ext = split_member_name(name)
                if not ext:
                    raise CorruptSampleError(f"{where}: member {name!r} has no extension (expected <key>.<ext>)")
                ext = ext.lower()
                if k != key:
                    if key is not None:
                        yield self._with_fields(_to_sample(key, members, where), members, where)
                    if k in seen:
                        raise CorruptSampleError(
                            f"{where}: members of sample {k!r} are not consecutive; re-pack this shard"
                        )
                    seen.add(k)
                    key, members = k, {}
                if ext in members:
                    raise CorruptSampleError(f"{where}: sample {k!r} has two {ext!r} members")
                members[ext] = data
            if key is not None:
                yield self._with_fields(_to_sample(key, members, where), members, where)
        finally:
            f.close()

    def _with_fields(self, sample: Sample, members: dict[str, bytes], where: str) -> Sample:
        for spec in self._specs:
            data = members.get(spec.member_suffix)
            if data is None:
                raise CorruptSampleError(f"{where}: sample {sample.key!r} lacks its {spec.member_suffix!r} member")
            if spec.ragged:
                import numpy as np  # noqa: PLC0415 (only readers of ragged fields need it)

                try:
                    value = json.loads(data)
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                    raise CorruptSampleError(f"{where}: sample {sample.key!r}: bad JSON in "
                                             f"{spec.member_suffix!r} ({exc})") from exc
                arr = np.asarray(value if value else [], dtype=spec.dtype)
                sample.fields[spec.name] = arr.reshape((-1, *spec.item))
            else:
                sample.fields[spec.name] = data
        return sample


class TarFormat:
    """webdataset-compatible tar shards (``shard-00000.tar``)."""

    name = "tar"
    suffix = ".tar"
    sample_kind = "encoded"
    hashes_while_writing = True  # the writer feeds every byte to an optional ``hasher``
    END_MARKER = _ZERO_BLOCK * 2  # what follows the concatenated fragments of a shard

    def open_fragment(self, *, shard_name: str, classes: Sequence[str], **options: Any) -> TarFragmentWriter:
        """An in-memory writer for a run of a shard's samples (see :class:`TarFragmentWriter`)."""
        return TarFragmentWriter(shard_name=shard_name, classes=classes, **options)

    def check_keys(self, keys: Sequence[str], where: str = "") -> None:
        """Validate a whole plan's keys before anything is written (see :func:`check_keys`)."""
        check_keys(keys, where)

    def shard_name(self, index: int) -> str:
        return f"shard-{index:05d}.tar"

    def disk_bytes(self, inputs: SizeInputs) -> tuple[np.ndarray, int]:
        """Each sample's bytes in a shard file, and the end blocks (:func:`sample_disk_bytes`)."""
        return sample_disk_bytes(inputs)

    def open_writer(self, path: str, *, shard_name: str, classes: Sequence[str], **options: Any) -> TarShardWriter:
        return TarShardWriter(path, shard_name=shard_name, classes=classes, **options)

    def open_reader(self, path: str, info: ShardInfo, manifest: Manifest) -> TarShardReader:
        return TarShardReader(path, info, manifest)


FORMAT = TarFormat()

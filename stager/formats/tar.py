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

Headers are POSIX ustar written by hand (``tarfile`` costs ~30 us per member) by the codec in
:mod:`stager.formats.ustar`, which also parses them: identical samples give identical bytes. The
manifest extent of a sample is the offset/size of the image member's data.

Keys may contain ``/`` but no ``.`` in their last component (webdataset splits a member name at
the first dot of its last component), must not start with ``/`` or ``__`` and must not contain
``..`` components.

The reader walks the members with the codec's parser (checksums, sizes against the file length,
member types), so a damaged or hostile shard raises :class:`~stager.errors.CorruptSampleError` or
:class:`~stager.errors.UnsafeArchiveError` naming the shard, never a stray exception.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any
from zlib import adler32

import numpy as np

from stager.errors import CorruptSampleError, UsageError
from stager.formats.base import (
    BY_REFERENCE,
    BufferedShardFile,
    Extent,
    ExtentReader,
    Format,
    FragmentsDone,
    Lines,
    Sample,
    SizeInputs,
    all_ascii,
    ascii_lengths,
    field_payload,
)
from stager.formats.registry import format_spec
from stager.formats.ustar import (
    BLOCK,
    END_OF_ARCHIVE,
    MODE_IDS,
    MTIME,
    NULS,
    PADS,
    REGULAR_SUM,
    REGULAR_TAIL,
    SIZE_FIELDS,
    iter_members,
    member_header,
    size_field,
)
from stager.manifest import Manifest, ShardInfo
from stager.manifest.fields import FieldSpec, sample_fields, specs_from_json

RESERVED_EXTS = frozenset({"cls", "json"})
_CLS_SUM = sum(b".cls")
_JSON_SUM = REGULAR_SUM - 1 + sum(b".json")  # the .json header's constant byte sum less adler32's 1
_RESERVED_META = frozenset({"class", "key", "label"})
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "pbm", "bmp", "tif", "tiff", "gif", "jp2", "jxl", "avif")
_EXT_RE = re.compile(r"^[a-z0-9_][a-z0-9_.-]{0,31}$")
# '/'-separated non-empty parts without NUL or backslash; no part is '.' or '..'; the last part has
# no '.'; no leading '__' (webdataset's skip_meta pattern).
_KEY_RE = re.compile(r"(?!__)(?:(?!\.\.?/)[^/\\\0]+/)*[^./\\\0]+")


def check_keys(keys: Sequence[str], where: str = "") -> None:
    """Validate many keys at once (what :func:`check_key` checks for each, and uniqueness).

    A few substring searches over the newline-joined keys instead of one call per key (~40 ns a key:
    :func:`_keys_text_ok`); ``stager pack`` validates a whole plan this way before writing anything,
    then opens writers with ``keys_checked=True``. ``keys`` may be :class:`~stager.formats.base.Lines`
    (a listing's keys, joined already; its ``unique`` skips the repeat check). Raises
    :class:`UsageError` naming the first bad or repeated key.
    """
    if not keys:
        return
    unique = isinstance(keys, Lines) and keys.unique
    if not unique and len(set(keys)) != len(keys):
        seen: set[str] = set()
        for k in keys:
            if k in seen:
                raise UsageError(f"{where}duplicate sample key {k!r}")
            seen.add(k)
    if isinstance(keys, Lines):
        joined = keys.text
    else:
        try:
            joined = "\n".join(keys)
        except TypeError:  # a key is not a string: the loop below names it
            joined = "\n" * len(keys)
    if joined.count("\n") == len(keys) - 1 and _keys_text_ok(joined):  # no key holds a newline
        return
    for k in keys:  # find and name the first offender
        check_key(k, where)


_LAST_PART_DOT = re.compile(r"\.[^/\n]*(?:\n|\Z)")  # a '.' with no '/' after it in its line


def _keys_text_ok(text: str) -> bool:
    """Whether every line of ``text`` (keys joined by newlines, none holding one) matches
    :data:`_KEY_RE`. Each way to fail it is a substring (or, for the last part's dot, a short regular
    expression with a literal start) that ``str`` finds at memchr speed; failing none is matching."""
    t = f"\n{text}\n"  # every key between two newlines: a line start or end is a newline here
    return not (
        "\\" in t or "\0" in t  # a backslash or NUL anywhere
        or "\n__" in t  # a key starting with '__'
        or "//" in t or "\n/" in t or "/\n" in t or "\n\n" in t  # an empty part, or an empty key
        or "/./" in t or "/../" in t or "\n./" in t or "\n../" in t  # a '.' or '..' part (the last has no '.')
        or ("." in t and _LAST_PART_DOT.search(t) is not None)  # a '.' in the last part
    )


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
    that pass through unchanged (see :meth:`~stager.formats.base.Format.disk_bytes`).

    A sample is a 512-byte header per member, its image padded to 512 and one block of ``.cls`` data
    (+ the padded ``.json`` with ``json_member``). Keys too long for the name field (or not ASCII) get
    their exact PAX/prefix headers from :func:`member_header`.
    """
    sizes = inputs.sizes.astype(np.int64, copy=False)
    keys = inputs.keys
    out = 3 * BLOCK + _padded(sizes)  # image header, .cls header + data block
    if not all_ascii(keys):
        odd: Sequence[int] = range(len(keys))
    else:  # a name that fits the name field (the usual case) has a header of constant pieces
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
    ignored so that one option set can be passed to every format. ``path`` None builds the members in
    memory (:class:`TarFragmentWriter`).
    """

    def __init__(
        self, path: str | None, *, shard_name: str, classes: Sequence[str], keys_checked: bool = False,
        json_member: bool = False, fields: Sequence[FieldSpec] = (), **options: Any,
    ) -> None:
        super().__init__(path, shard_name=shard_name, classes=classes, **options)
        self._fields = {f.name: f for f in fields}
        self._keys_checked = keys_checked
        self._json = json_member
        self._keys: set[str] = set()
        self._exts_ok: dict[str, tuple[str, bytes, int]] = {}  # extension -> (lower, b".lower", byte sum)
        self._labels: dict[Any, tuple[int, str, tuple[bytes, bytes], bytes, int]] = {}

    def write(self, sample: Sample) -> Extent:
        if not self._open:
            self._check_open()
        key = sample.key
        if not self._keys_checked:
            if key in self._keys:
                raise UsageError(f"{self.shard_name}: duplicate sample key {key!r} in one shard")
            check_key(key, f"{self.shard_name}: ")
        data = sample.data
        if type(data) is not bytes and not isinstance(data, (bytearray, memoryview)):
            raise UsageError(
                f"{self.shard_name}: tar stores encoded image files; got {type(data).__name__} for {key!r}"
            )
        ext_entry = self._exts_ok.get(sample.ext)
        if ext_entry is None:
            ext_entry = self._ext_entry(sample.ext, key)
        ext, dot_ext, image_sum = ext_entry
        per_label = self._labels.get(sample.label)
        if per_label is None:
            per_label = self._label_entry(sample.label)
        label, cls, cls_member, cls_sz, cls_sum = per_label
        if not self._keys_checked:
            self._keys.add(key)  # only once the sample is known to be writable

        size = len(data)
        kb = key.encode()
        nk = len(kb)
        buf = self._buf
        if nk <= 95 and nk + len(dot_ext) <= 100 and kb.isascii():  # all the names fit the name field
            # One join builds the sample's members, headers from constant pieces. A checksum is the
            # constant pieces' byte sum plus the name's and the size field's: the key's is taken once
            # for every member, with adler32 (its low 16 bits are 1 + the byte sum below 65521 and a
            # name has at most 100 bytes), a few times cheaper than sum() in Python.
            ks = adler32(kb) & 0xFFFF
            got = SIZE_FIELDS.get(size)
            sz, zs = got if got is not None else size_field(size)
            offset = self._written + len(buf) + BLOCK
            if size < BY_REFERENCE or type(data) is not bytes:
                buf += b"".join(
                    (
                        kb, dot_ext, NULS[100 - nk - len(dot_ext)], MODE_IDS, sz, MTIME,
                        b"%06o\0 " % (ks + image_sum + zs), REGULAR_TAIL, data, PADS[-size % BLOCK],
                        kb, b".cls", NULS[96 - nk], MODE_IDS, cls_sz, MTIME, b"%06o\0 " % (ks + cls_sum),
                        REGULAR_TAIL, cls_member[0],
                    )
                )  # fmt: skip
            else:  # a large image is queued as it is: its bytes are copied once, by the kernel
                buf += b"".join(
                    (kb, dot_ext, NULS[100 - nk - len(dot_ext)], MODE_IDS, sz, MTIME,
                     b"%06o\0 " % (ks + image_sum + zs), REGULAR_TAIL)
                )  # fmt: skip
                self._put(data)
                buf = self._buf
                buf += b"".join(
                    (PADS[-size % BLOCK], kb, b".cls", NULS[96 - nk], MODE_IDS, cls_sz, MTIME,
                     b"%06o\0 " % (ks + cls_sum), REGULAR_TAIL, cls_member[0])
                )  # fmt: skip
            if self._json:
                js = _json_meta(key, label, cls, sample.meta)
                nj = len(js)
                jz, jzs = size_field(nj)
                buf += b"".join(
                    (kb, b".json", NULS[95 - nk], MODE_IDS, jz, MTIME, b"%06o\0 " % (ks + _JSON_SUM + jzs),
                     REGULAR_TAIL, js, PADS[-nj % BLOCK])
                )  # fmt: skip
        else:
            buf += member_header(f"{key}.{ext}", size)
            offset = self._written + len(buf)
            buf += data
            buf += PADS[-size % BLOCK]
            buf += member_header(f"{key}.cls", len(cls_member[1]))
            buf += cls_member[0]
            if self._json:
                js = _json_meta(key, label, cls, sample.meta)
                buf += member_header(f"{key}.json", len(js))
                buf += js
                buf += PADS[-len(js) % BLOCK]
        if len(buf) + self._parted >= self._flush_bytes:
            self._flush()
        if sample.fields:
            return Extent(offset, size, self._write_fields(key, sample.fields))
        return Extent(offset, size)

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
            buf += PADS[-len(data) % BLOCK]
        return out

    def _ext_entry(self, ext: str, key: str) -> tuple[str, bytes, int]:
        """``(lower-case extension, b".ext", the image header's constant byte sum)`` for ``ext``: the
        checksum is that plus ``1 + sum(key bytes)`` (adler32's low half) and the size field's sum."""
        low = ext.lower()
        if not _EXT_RE.match(low) or low in RESERVED_EXTS:
            raise UsageError(f"{self.shard_name}: invalid image extension {ext!r} for {key!r}")
        dot = b"." + low.encode()
        entry = self._exts_ok[ext] = (low, dot, REGULAR_SUM - 1 + sum(dot))
        return entry

    def _label_entry(self, label: Any) -> tuple[int, str, tuple[bytes, bytes], bytes, int]:
        """``(int label, class name, (padded .cls data, .cls data), .cls size field, the .cls header's
        byte sum less the key's)`` for ``label``, cached per label."""
        value = int(label)
        cls = self.classes[value] if 0 <= value < len(self.classes) else ""
        text = b"%d" % value
        sz, zs = size_field(len(text))
        entry = (value, cls, (text + PADS[-len(text) % BLOCK], text), sz, REGULAR_SUM - 1 + _CLS_SUM + zs)
        self._labels[label] = entry
        return entry

    def close(self) -> list[tuple[str, str]]:
        if self.closed:
            return []
        self._buf += END_OF_ARCHIVE
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

    def __init__(self, *, shard_name: str, classes: Sequence[str], **options: Any) -> None:
        super().__init__(None, shard_name=shard_name, classes=classes, **options)  # never flushed: nothing hashed

    def close(self) -> list[tuple[str, str]]:
        self._open = False
        return []

    def extra(self) -> None:
        """Nothing: a tar shard is finished by its end marker alone."""
        return None


# ---- reading -----------------------------------------------------------------------------------
def split_member_name(name: str) -> tuple[str, str]:
    """webdataset's rule: split at the first ``.`` of the last path component -> (key, ext)."""
    head, _, last = name.rpartition("/")
    base, dot, ext = last.partition(".")
    if not dot or not base:
        return name, ""
    return (f"{head}/{base}" if head else base), ext


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
        with self.scanned() as (f, size):
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


class TarFormat(Format):
    """webdataset-compatible tar shards (``shard-00000.tar``)."""

    spec = format_spec("tar")
    reader = TarShardReader
    writer = TarShardWriter

    def fragment_base(self) -> int:
        """Where a shard's first fragment goes: the archive has no header."""
        return 0

    def open_fragment(self, *, shard_name: str, classes: Sequence[str], **options: Any) -> TarFragmentWriter:
        """An in-memory writer for a run of a shard's samples (see :class:`TarFragmentWriter`)."""
        return TarFragmentWriter(shard_name=shard_name, classes=classes, **options)

    def finish_fragments(self, path: str, end: int, done: FragmentsDone) -> list[tuple[str, str]]:
        """End the archive whose fragments fill ``[0, end)`` of ``path``: the end-of-archive marker."""
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            os.pwrite(fd, END_OF_ARCHIVE, end)
        finally:
            os.close(fd)
        return []

    def check_keys(self, keys: Sequence[str], where: str = "") -> None:
        """Validate a whole plan's keys before anything is written (see :func:`check_keys`)."""
        check_keys(keys, where)

    def disk_bytes(self, inputs: SizeInputs) -> tuple[np.ndarray, int]:
        """Each sample's bytes in a shard file, and the end blocks (:func:`sample_disk_bytes`)."""
        return sample_disk_bytes(inputs)


FORMAT = TarFormat()

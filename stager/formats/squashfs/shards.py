"""SquashFS images as stager shards (docs/formats.md, "squashfs"): written by ``stager pack --format
squashfs``, adopted by ``stager index``, read by the loader without mounting.

Each shard is one SquashFS 4.0 image holding an ImageFolder tree: a sample is the file
``<class>/<stem>.<ext>`` (``<class>`` from :func:`~stager.manifest.class_dir_name`, ``<stem>`` the key
less its class folder with ``/`` as ``_``: :func:`~stager.manifest.unpacked_stem`, the names ``stage
--unpack`` writes; ``<ext>`` the source file's own, ``JPEG`` for ImageNet's: :func:`source_ext`), so an
ImageFolder source keeps its file names; and each of its fields a sidecar file beside it,
``<stem>.<field>.<ext>`` as tar names its members (``n0001.mask.png``, ``n0001.boxes.json``). So the
image mounts (squashfuse, the kernel, ``apptainer -B shard.sqfs:/data:image-src=/``) as a directory
torchvision's ImageFolder reads.

The sample index locates each payload. JPEG, PNG and the other compressed types, and every field's
sidecar, are stored contiguous (never recompressed): ``offset``/``size`` are a byte range of the image,
read with one ``pread`` as a tar member is. A payload the writer compressed (BMP, TIFF, PPM... under
``--compression`` other than ``none``) has no byte range; its ``offset`` is :data:`INODE` plus its
inode's reference, and such a shard says ``extents: "inodes"``: the loader reads it through
:class:`SquashShardReader`, which ``pread``\\ s the byte ranges and reads the others by their inodes
(their blocks decompressed in process, fragment blocks kept in a small cache). An image made by
``mksquashfs`` and adopted by ``stager index`` is indexed the same way (:mod:`stager.index.squashfs`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from stager.errors import (
    CorruptSampleError,
    MissingBackendError,
    ShardMissingError,
    SourceError,
    SourceNotFoundError,
    StagerError,
    UnsafeArchiveError,
    UsageError,
)
from stager.formats.base import Extent, Format, Sample, SizeInputs, ascii_lengths, field_payload
from stager.formats.registry import format_spec
from stager.formats.squashfs.compress import PRECOMPRESSED, decompressor
from stager.formats.tar import check_key, check_keys
from stager.manifest import Manifest, ShardInfo, check_entry_name, class_dir_name, unpacked_stem
from stager.manifest.fields import FieldSpec, sample_fields, specs_from_json

if TYPE_CHECKING:  # each side is imported where it is used: a pack never loads the reader, a loader the writer
    from stager.formats.squashfs.listing import ImageListing
    from stager.formats.squashfs.reader import SquashImage

SPEC = format_spec("squashfs")
INODE = 1 << 62  # an ``inodes`` offset at or above this is INODE + the file's inode reference
BLOCK_SIZE = 128 << 10  # mksquashfs's default
_EXT_RE = re.compile(r"^[a-z0-9_][a-z0-9_-]{0,31}$")
_NO_FIELD_BASES: Mapping[str, int] = MappingProxyType({})
_READ_BATCH = 256  # samples read at once by iter_samples


def sample_path(key: str, label: int, classes: Sequence[str], ext: str) -> tuple[str, str]:
    """``(class folder, file stem)`` of a sample in an image: ``<class>/<stem>.<ext>`` is its file,
    ``<class>/<stem>.<field suffix>`` its fields' (the names ``stage --unpack`` writes)."""
    cls = class_dir_name(classes, label)
    return cls, unpacked_stem(key, cls)


_SOURCE_EXT = re.compile(r"^[A-Za-z0-9_]{1,32}$")


def source_ext(source: object, stem: str) -> str | None:
    """The extension of the source file a sample came from, spelled as there (``JPEG`` for ImageNet's
    ``n01440764_10026.JPEG``), when ``source`` (its relative path, ``Sample.meta["source"]``) names the
    file ``stem`` was made from; else None (the sniffed type's extension is used)."""
    if not isinstance(source, str):
        return None
    head, dot, ext = source.rpartition("/")[2].rpartition(".")
    if not dot or not head or not _SOURCE_EXT.match(ext) or not stem.endswith(head.replace(".", "_")):
        return None
    return ext


def _open_image(path: str) -> SquashImage:
    """``path`` opened as a shard: a missing file is :class:`ShardMissingError`, anything that is no
    readable image :class:`CorruptSampleError` naming it (a missing compressor package stays a
    :class:`MissingBackendError` naming the package)."""
    from stager.formats.squashfs.reader import SquashImage  # noqa: PLC0415 (reading only)

    try:
        return SquashImage(path, name=path)
    except SourceNotFoundError as exc:
        raise ShardMissingError(f"{path}: shard missing; re-stage the dataset or re-run `stager pack`") from exc
    except (MissingBackendError, UnsafeArchiveError):
        raise
    except SourceError as exc:
        raise CorruptSampleError(str(exc)) from exc


class SquashShardWriter:
    """Writes one image (a :class:`~stager.formats.squashfs.writer.SquashWriter`) of samples and their
    fields; see the module docstring for the tree.

    Options: ``compression`` (one of the registry entry's ``compressions``; None: its default,
    gzip, as mksquashfs), ``fields`` (the pack's field schema), ``fsync``, ``threads`` (compression
    threads; the bytes do not depend on it), ``keys_checked`` (the plan's keys passed
    :func:`check_keys`). Unknown options are ignored, so one option set serves every format.
    """

    def __init__(self, path: str, *, shard_name: str, classes: Sequence[str], compression: str | None = None,
                 fields: Sequence[FieldSpec] = (), fsync: bool = False, threads: int | None = None,
                 keys_checked: bool = False, **options: Any) -> None:
        comp = compression or SPEC.compressions[0]
        if comp not in SPEC.compressions:
            raise UsageError(f"unknown SquashFS compression {comp!r}; expected one of {', '.join(SPEC.compressions)}")
        self.shard_name = shard_name
        self.classes = list(classes)
        self._fields = tuple(fields)
        self._keys_checked = keys_checked
        from stager.formats.squashfs.writer import SquashWriter  # noqa: PLC0415 (writing only)

        self._w = SquashWriter(path, compression=comp, block_size=BLOCK_SIZE, fsync=fsync, threads=threads)
        self._paths: dict[str, str] = {}  # path in the image -> the key of the sample it belongs to
        self._moved: list[int] = []  # file ids of payloads placed only at close (provisional offset -1 - k)
        self._final: list[int] = []
        self._closed = False

    @property
    def field_bases(self) -> Mapping[str, int]:
        """Fields are stored as written: nothing to add."""
        return _NO_FIELD_BASES

    @property
    def extents(self) -> str:
        """``"inodes"`` when a payload was compressed (known after ``close()``), else ``"bytes"``."""
        return "inodes" if self._moved else "bytes"

    def final_offset(self, offset: int) -> int:
        """The manifest offset of a payload ``write`` returned ``offset`` for (after ``close()``)."""
        return offset if offset >= 0 else self._final[-1 - offset]

    def write(self, sample: Sample) -> Extent:
        if self._closed:
            raise UsageError(f"{self.shard_name}: write() after close()")
        data = sample.data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(f"{self.shard_name}: SquashFS shards store encoded image files; got "
                             f"{type(data).__name__} for {sample.key!r}")
        if not self._keys_checked:
            check_key(sample.key, f"{self.shard_name}: ")
        ext = sample.ext.lower()
        if not _EXT_RE.match(ext):
            raise UsageError(f"{self.shard_name}: invalid image extension {sample.ext!r} for {sample.key!r}")
        cls, stem = sample_path(sample.key, int(sample.label), self.classes, ext)
        ext = source_ext(sample.meta.get("source"), stem) or ext
        check_entry_name(cls, "class folder name")
        added = self._w.add_file(self._claim(cls, f"{stem}.{ext}", sample.key), data)
        offset = added.raw_offset
        if offset < 0:
            self._moved.append(added.file_id)
            offset = -len(self._moved)
        extents = self._write_fields(cls, stem, sample) if self._fields else None
        return Extent(offset, len(data), extents)

    def _claim(self, cls: str, name: str, key: str) -> str:
        """``<cls>/<name>``, checked as a file name and claimed for ``key``: two samples never share a path."""
        check_entry_name(name, f"sample file name (key {key!r})")
        path = f"{cls}/{name}"
        other = self._paths.setdefault(path, key)
        if other != key:
            raise UsageError(f"{self.shard_name}: samples {other!r} and {key!r} both map to {path!r} in the image; "
                             "keys must map to distinct file names per class: rename one")
        return path

    def _write_fields(self, cls: str, stem: str, sample: Sample) -> dict[str, tuple[int, int]]:
        """One sidecar file per field, stored contiguous (a byte range); their extents."""
        out: dict[str, tuple[int, int]] = {}
        for spec in self._fields:
            if spec.name not in sample.fields:
                raise UsageError(f"{self.shard_name}: sample {sample.key!r} lacks field {spec.name!r}")
            payload = field_payload(spec, sample.fields[spec.name])
            added = self._w.add_file(self._claim(cls, f"{stem}.{spec.member_suffix}", sample.key), payload, store=True)
            out[spec.name] = (added.raw_offset, len(payload))
        return out

    def close(self) -> list[tuple[str, str]]:
        if self._closed:
            return []
        self._closed = True
        self._w.close()
        refs = self._w.file_refs
        assert refs is not None
        self._final = [INODE + refs[fid] for fid in self._moved]
        return []

    def abort(self) -> None:
        self._closed = True
        self._w.abort()


class SquashShardReader:
    """Reads one image: ``read(positions)`` by the manifest's extents (byte ranges as zero-copy
    ``memoryview`` slices of the image's mapping, the rest by inode), ``iter_samples()`` from the
    image's own listing (checked against the manifest when one is given; else the image read as an
    ImageFolder). The image is opened on first use, and again
    in a forked process (:class:`SquashImage` keeps a descriptor per process)."""

    def __init__(self, path: str, info: ShardInfo | None = None, manifest: Manifest | None = None) -> None:
        self.path = path
        self.info = info
        self.manifest = manifest
        self._image: SquashImage | None = None
        self._specs = specs_from_json(sample_fields(manifest.fields)) if manifest is not None else []

    def image(self) -> SquashImage:
        if self._image is None:
            self._image = _open_image(self.path)
        return self._image

    def read(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        """Payloads of in-shard ``positions`` (manifest order), in the order given. The loader calls this
        once per run of a few samples: one pass over Python ints (a dozen numpy calls would cost more
        than the slices they find)."""
        info = self.info
        if info is None:
            raise UsageError(f"{self.path}: read() needs the shard's manifest entry")
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= info.samples):
            raise UsageError(f"{self.path}: sample positions must be in 0..{info.samples - 1}")
        offs, sizes = info.offsets[pos].tolist(), info.sizes[pos].tolist()
        out: list[Any] = [b""] * len(offs)
        im = self.image()
        view: memoryview | None = None
        by_inode: list[int] = []  # indices into ``out`` of the samples read by inode
        for k, (a, n) in enumerate(zip(offs, sizes, strict=True)):
            if a >= INODE:
                by_inode.append(k)
                continue
            if a + n > im.file_size:  # stored samples: zero-copy slices of the image's mapping, as tar members are read
                raise CorruptSampleError(f"{self.path}: a sample ends at byte {a + n}, the image has "
                                         f"{im.file_size}; it is truncated: re-stage or re-pack it")
            if view is None:
                view = im.mapping()
            out[k] = view[a : a + n]
        if by_inode:
            refs = np.asarray([offs[k] - INODE for k in by_inode], dtype=np.int64)
            for k, data in zip(by_inode, im.read_refs(refs), strict=True):
                if len(data) != sizes[k]:
                    raise CorruptSampleError(f"{self.path}: sample {info.keys[int(pos[k])]!r} is {len(data)} bytes, "
                                             f"the index says {sizes[k]}; re-index or re-pack the shard")
                out[k] = data
        return out

    def iter_samples(self) -> Iterator[Sample]:
        """Every sample, in manifest order (else the image's ImageFolder order), parsed from the image.
        With the manifest, the file must have its size (the padding after ``bytes_used`` is no
        structure a parse would miss)."""
        im = self.image()
        if self.info is not None and im.file_size != self.info.bytes:
            raise CorruptSampleError(f"{self.path}: {im.file_size} bytes, the manifest says {self.info.bytes} "
                                     "(truncated or replaced); re-stage or re-pack it")
        try:
            lst = im.listing()
        except SourceError as exc:
            raise CorruptSampleError(str(exc)) from exc
        if self.info is None or self.manifest is None:
            yield from self._folder_samples(lst)
            return
        yield from self._manifest_samples(lst, self.info, self.manifest)

    def _folder_samples(self, lst: ImageListing) -> Iterator[Sample]:
        from stager.formats.squashfs.folder import image_folder  # noqa: PLC0415 (reading only)

        im = self.image()
        found = image_folder(lst, self.path)
        for a in range(0, len(found), _READ_BATCH):
            files = found.files[a : a + _READ_BATCH]
            for j, data in enumerate(im.read_many(files)):
                k = a + j
                path = lst.paths[int(found.files[k])]
                yield Sample(found.keys[k], int(found.label[k]), data, path.rpartition(".")[2].lower())

    def _manifest_samples(self, lst: ImageListing, info: ShardInfo, m: Manifest) -> Iterator[Sample]:
        """The manifest's samples located in the listing (each offset is a file's byte range or inode);
        a stager pack's image must hold them at their paths, and nothing else."""
        files = lst.files()
        by_raw = {int(o): int(i) for o, i in zip(lst.raw_offset[files].tolist(), files.tolist(), strict=True) if o >= 0}
        by_ref = {INODE + int(r): int(i) for r, i in zip(lst.inode_ref[files].tolist(), files.tolist(), strict=True)}
        entries = np.empty(info.samples, dtype=np.int64)
        for j, (off, size) in enumerate(zip(info.offsets.tolist(), info.sizes.tolist(), strict=True)):
            i = (by_ref if off >= INODE else by_raw).get(off, -1)
            if i < 0 or int(lst.size[i]) != size:
                at = f"inode {off - INODE:#x}" if off >= INODE else f"byte {off}"
                raise CorruptSampleError(f"{self.path}: sample {info.keys[j]!r}: no file of {size} bytes at {at} of "
                                         "the image; it does not match its manifest: re-stage or re-pack it")
            entries[j] = i
        # An adopted image (stager index) is someone else's tree: its other files are no concern of ours.
        sidecars = self._check_tree(lst, entries, info, m) if not m.indexed else [{}] * info.samples
        specs = self._specs if not m.indexed else []
        im = self.image()
        for a in range(0, info.samples, _READ_BATCH):
            rows = range(a, min(a + _READ_BATCH, info.samples))
            for j, data in zip(rows, im.read_many(entries[a : rows.stop]), strict=True):
                path = lst.paths[int(entries[j])]
                fields = {s.name: self._field(s, im.read(sidecars[j][s.name]), info.keys[j]) for s in specs}
                yield Sample(info.keys[j], int(info.labels[j]), data, path.rpartition(".")[2].lower(), {}, fields)

    def _check_tree(self, lst: ImageListing, entries: np.ndarray, info: ShardInfo,
                    m: Manifest) -> list[dict[str, int]]:
        """A pack's image holds each sample at ``<class>/<stem>.<ext>``, its fields beside it, and no
        other file; each sample's ``{field: listing entry}``."""
        index = lst.index_of()
        claimed = np.zeros(len(lst), dtype=bool)
        out: list[dict[str, int]] = []
        for j, key in enumerate(info.keys):
            cls, stem = sample_path(key, int(info.labels[j]), m.classes, "")
            path = lst.paths[int(entries[j])]
            if path.rpartition(".")[0] != f"{cls}/{stem}":
                raise CorruptSampleError(f"{self.path}: sample {key!r} is the file {path!r}, expected "
                                         f"{cls}/{stem}.<ext>; the image does not match its manifest: re-pack it")
            claimed[entries[j]] = True
            got = {}
            for s in self._specs:
                i = index.get(f"{cls}/{stem}.{s.member_suffix}", -1)
                if i < 0:
                    raise CorruptSampleError(f"{self.path}: sample {key!r} lacks its {s.member_suffix!r} file")
                got[s.name] = i
                claimed[i] = True
            out.append(got)
        extra = lst.files()[~claimed[lst.files()]]
        if len(extra):
            raise CorruptSampleError(f"{self.path}: holds {lst.paths[int(extra[0])]!r} (and {len(extra) - 1} more), "
                                     "which its manifest does not list; re-pack the shard")
        return out

    def _field(self, spec: FieldSpec, data: bytes, key: str) -> Any:
        if not spec.ragged:
            return data
        try:
            value = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CorruptSampleError(f"{self.path}: sample {key!r}: bad JSON in {spec.member_suffix!r} "
                                     f"({exc})") from exc
        return np.asarray(value if value else [], dtype=spec.dtype).reshape((-1, *spec.item))

    def close(self) -> None:
        if self._image is not None:
            self._image.close()
        self._image = None

    def __enter__(self) -> SquashShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sample_disk_bytes(inputs: SizeInputs) -> tuple[np.ndarray, int]:
    """``(each sample's bytes in an image, what every image has)``: its data (exact for a stored file;
    the source size, an upper bound in practice, for one the writer compresses), its inode with one
    size word a block, its directory entry and export-table slot (metadata counted uncompressed), and
    the superblock, tables' headers and the padding to 4 KiB."""
    sizes = inputs.sizes.astype(np.int64, copy=False)
    blocks = -(-sizes // BLOCK_SIZE)
    names = ascii_lengths(inputs.keys) + ascii_lengths(inputs.exts) + 1
    per = sizes + 32 + 4 * blocks + 8 + names + 8
    if (inputs.options.get("compression") or SPEC.compressions[0]) != "none":
        stored = np.fromiter((e.lower() in PRECOMPRESSED for e in inputs.exts), dtype=bool, count=len(sizes))
        per[~stored] = sizes[~stored] + 32 + 4 * (sizes[~stored] // BLOCK_SIZE) + 8 + names[~stored] + 8
    return per, 96 + 64 + 4096


class SquashFormat(Format):
    """SquashFS images (``shard-00000.sqfs``): an ImageFolder tree per shard, read without mounting."""

    spec = SPEC
    reader = SquashShardReader
    writer = SquashShardWriter

    def check_keys(self, keys: Sequence[str], where: str = "") -> None:
        """A key's last part becomes a file's stem, whose first dot separates a sample from its fields'
        files (``n0001.mask.png``): the tar format's rule (:func:`stager.formats.tar.check_keys`)."""
        check_keys(keys, where)

    def disk_bytes(self, inputs: SizeInputs) -> tuple[np.ndarray, int]:
        return sample_disk_bytes(inputs)

    def warm_readers(self, paths: Sequence[str]) -> None:
        """Import the decompressors of the images at ``paths`` (each superblock's compressor): a
        worker forked afterwards finds ``zstandard`` (or isal, lz4...) loaded instead of importing it
        before its first sample (5-40 ms a worker). A missing package is left to the reader that needs
        it, which names it."""
        from stager.formats.squashfs.reader import image_codec  # noqa: PLC0415 (reading only)

        for codec in {c.id: c for c in map(image_codec, paths) if c is not None}.values():
            with contextlib.suppress(StagerError):
                decompressor(codec, "")


FORMAT = SquashFormat()

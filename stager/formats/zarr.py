"""Zarr shards: decoded fixed-shape uint8 images, one zarr v3 group per ``shard-NNNNN.zarr.zip``.

Each shard is a single file (a zip archive, ``ZIP_STORED`` so members can be read by byte range)
holding a zarr v3 group (normative description: docs/formats.md, section "zarr"):

* ``images``: uint8, shape ``(n, H, W, C)``, written with the sharding codec: the whole array is
  ONE zarr shard (key ``images/c/0/0/0/0``) whose inner chunks hold ``rows_per_chunk`` images
  (default 1), each stored raw (``bytes`` codec) followed by a ``crc32c`` checksum, so any image
  can be read alone and damage is detected when it is read;
* ``labels``: int64, shape ``(n,)``;
* group attributes: ``stager_format`` (``"stager.zarr/1"``), ``num_samples``, ``image_shape``
  (``[H, W, C]`` or null when empty), ``classes``, and per-sample ``keys``, ``exts`` and ``meta``.

Manifest extents for zarr are not byte ranges: ``offset`` is the row in ``images`` and ``size`` is
``H*W*C``. The loader reads runs of consecutive rows with :meth:`ZarrReader.read_rows`: one
``(k, H, W, C)`` array per run, fetched by :class:`DirectRows` (one ``preadv`` per run, every
image's crc32c checked) when the shard has exactly this layout, else by one zarr slice.
:class:`RangeZipStore` makes zarr's own byte-range reads O(1) on Python versions whose zipfile
seeks by reading.

Determinism: the hierarchy is built in a :class:`zarr.storage.MemoryStore` and the zip written here
with entries sorted by name, fixed timestamps (1980-01-01) and fixed permissions, so identical
samples give byte-identical files.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import google_crc32c  # a zarr dependency (its crc32c codec)
import numpy as np
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.storage import ZipStore

from stager.errors import CorruptSampleError, ShardMissingError, SourceError, StagerError, UnsuitableSourceError
from stager.formats.base import Extent, Format, PlacedAsWritten, Sample, SizeInputs, ascii_lengths
from stager.formats.registry import format_spec
from stager.formats.zarr_fields import ZarrFields, read_field
from stager.manifest import Manifest, ShardInfo
from stager.manifest.fields import FieldSpec

FORMAT_VERSION = "stager.zarr/1"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
READ_BLOCK_BYTES = 32 << 20  # iter_samples reads this many bytes of rows per zarr call


def write_zip(path: str, members: MutableMapping[str, Any]) -> None:
    """Write ``members`` (name -> zarr Buffer or bytes) as a deterministic stored zip at ``path``."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name in sorted(members):
            value = members[name]
            data = value if isinstance(value, (bytes, bytearray)) else value.to_bytes()
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3  # unix, so external_attr means the same everywhere
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)


ZIP_AND_GROUP_BYTES = 2400  # zip headers and directory, zarr.json of the group and arrays, labels' header
ATTR_LAYOUT_BYTES = 40  # per sample: the indentation, commas and newlines of three attribute lists


def sample_disk_bytes(inputs: SizeInputs) -> tuple[np.ndarray, int]:
    """``(bytes of each sample, fixed bytes)`` in a zarr shard (one row per chunk), within ~0.5%.

    A sample is its decoded row (H*W*3, plus a 4-byte CRC and a 16-byte shard index entry), its
    label (8) and its key, extension and metadata (assumed ``{"source": "<key>.<ext>"}``) in the
    group's ``zarr.json``. Rows that are all zeros are not stored by zarr: the estimate counts them.
    """
    h, w, c = inputs.image_shape or (0, 0, 3)
    nk = ascii_lengths(inputs.keys)
    ne = ascii_lengths(inputs.exts)
    per = h * w * c + 4 + 16 + 8 + (nk + 2) + (ne + 2) + (nk + ne + 17) + ATTR_LAYOUT_BYTES
    return per, ZIP_AND_GROUP_BYTES + len(json.dumps(list(inputs.classes)))


class ZarrWriter(PlacedAsWritten):
    """Collects decoded ``(H, W, C)`` uint8 images and writes one zarr-in-zip shard on close."""

    def __init__(self, path: str, *, shard_name: str, classes: Sequence[str], rows_per_chunk: int = 1,
                 fields: Sequence[FieldSpec] = (), **options: Any) -> None:
        if rows_per_chunk < 1:
            raise StagerError(f"rows_per_chunk must be >= 1, got {rows_per_chunk}")
        self.path = path
        self.shard_name = shard_name
        self.classes = list(classes)
        self.rows_per_chunk = rows_per_chunk
        self._shape: tuple[int, int, int] | None = None
        self._rows: list[np.ndarray] = []
        self._labels: list[int] = []
        self._keys: list[str] = []
        self._exts: list[str] = []
        self._meta: list[dict[str, Any]] = []
        self._fields = ZarrFields(fields) if fields else None  # docs/fields.md: one array per field
        self._closed = False
        self.field_bases: dict[str, int] = {}  # field extents are rows: nothing to add after close()

    def write(self, sample: Sample) -> Extent:
        """Append ``sample``; its extent is ``(row, H*W*C)``. All samples must share one shape."""
        if self._closed:
            raise StagerError(f"{self.shard_name}: write() after close()")
        arr = sample.data
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 3:
            what = f"{arr.dtype} array of shape {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise SourceError(f"{sample.key}: the zarr format stores decoded (H, W, C) uint8 arrays, got {what}")
        shape = (int(arr.shape[0]), int(arr.shape[1]), int(arr.shape[2]))
        if self._shape is None:
            self._shape = shape
        elif shape != self._shape:
            h, w, _ = self._shape
            raise UnsuitableSourceError(
                f"{sample.key}: image shape {shape} differs from the shard's {self._shape}; zarr needs one "
                f"shape per dataset: pack with --resize {h}x{w} (or make the sources uniform)"
            )
        try:
            # Round-trip through JSON now so that bad metadata names its sample, not the shard later.
            meta = json.loads(json.dumps(sample.meta, sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise SourceError(f"{sample.key}: sample metadata is not JSON-serialisable ({exc})") from exc
        row = len(self._rows)
        self._rows.append(arr)
        self._labels.append(int(sample.label))
        self._keys.append(sample.key)
        self._exts.append(sample.ext)
        self._meta.append(meta)
        extents = self._fields.add(sample.key, sample.fields, row, shape[:2]) if self._fields else None
        return Extent(row, arr.size, extents)

    def close(self) -> list[tuple[str, str]]:
        """Build the group in memory and write the zip at ``path``; no companion files."""
        if self._closed:
            raise StagerError(f"{self.shard_name}: close() called twice")
        self._closed = True
        from zarr.codecs import Crc32cCodec  # noqa: PLC0415 (zarr is imported only for the zarr format)
        from zarr.storage import MemoryStore  # noqa: PLC0415 (zarr is imported only for the zarr format)

        members: dict[str, Any] = {}
        store = MemoryStore(members)
        n = len(self._rows)
        attrs = {
            "stager_format": FORMAT_VERSION,
            "num_samples": n,
            "image_shape": list(self._shape) if self._shape else None,
            "classes": self.classes,
            "keys": self._keys,
            "exts": self._exts,
            "meta": self._meta,
        }
        group = zarr.create_group(store=store, attributes=attrs, zarr_format=3)
        if n:
            assert self._shape is not None
            k = min(self.rows_per_chunk, n)
            # The shard shape must be a multiple of the chunk shape; rounding n up keeps the whole
            # array inside one zarr shard (the part past n is never written).
            shard_rows = -(-n // k) * k
            images = group.create_array(
                "images",
                shape=(n, *self._shape),
                dtype="uint8",
                chunks=(k, *self._shape),
                shards=(shard_rows, *self._shape),
                filters=None,
                compressors=[Crc32cCodec()],
                fill_value=0,
            )
            images[...] = np.stack(self._rows)
        else:
            group.create_array("images", shape=(0, 1, 1, 1), dtype="uint8", chunks=(1, 1, 1, 1), fill_value=0)
        labels = group.create_array(
            "labels", shape=(n,), dtype="int64", chunks=(max(n, 1),), filters=None, compressors=None, fill_value=0
        )
        if n:
            labels[...] = np.asarray(self._labels, dtype=np.int64)
        if self._fields is not None:
            self._fields.write(group, n)
        self._rows.clear()
        write_zip(self.path, members)
        return []

    def abort(self) -> None:
        self._closed = True
        self._rows.clear()


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length (30 bytes)


class RangeZipStore(ZipStore):
    """A read-only :class:`zarr.storage.ZipStore` whose byte-range reads of stored members are one pread.

    zipfile on Python 3.11 implements ``seek`` inside a member by reading up to the target, so
    every partial read through the plain ZipStore (the shard index at the member's end, one image
    in the middle) costs reading the whole shard. For ``ZIP_STORED`` members the bytes sit
    verbatim in the archive, so this store reads ``[start, end)`` directly at the member's data
    offset. Whole-member reads, and anything compressed, still go through zipfile (with its CRC
    check); partial reads are covered by zarr's own crc32c on the shard index and on every chunk.
    """

    def __init__(self, path: str) -> None:
        super().__init__(path, mode="r")
        with zipfile.ZipFile(path) as zf:
            self._members = {i.filename: i for i in zf.infolist()}
        self._fd = os.open(path, os.O_RDONLY)
        self._data_start: dict[str, int] = {}

    def _member_range(self, key: str) -> tuple[int, int] | None:
        """``(absolute data offset, size)`` of a stored, unencrypted member, else None."""
        info = self._members.get(key)
        if info is None or info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
            return None
        start = self._data_start.get(key)
        if start is None:
            header = os.pread(self._fd, _LOCAL_HEADER.size, info.header_offset)
            if len(header) != _LOCAL_HEADER.size:
                raise zipfile.BadZipFile(f"truncated local header of {key!r}")
            magic, name_len, extra_len = _LOCAL_HEADER.unpack(header)
            if magic != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"bad local header of {key!r}")
            start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            self._data_start[key] = start
        return start, info.file_size

    def _pread(self, key: str, byte_range: Any) -> bytes | None:
        where = self._member_range(key)
        if where is None:
            return None
        start, size = where
        if isinstance(byte_range, RangeByteRequest):
            lo, hi = byte_range.start, byte_range.end
        elif isinstance(byte_range, OffsetByteRequest):
            lo, hi = byte_range.offset, size
        elif isinstance(byte_range, SuffixByteRequest):
            lo, hi = max(0, size - byte_range.suffix), size
        else:
            return None
        lo, hi = min(max(lo, 0), size), min(max(hi, 0), size)
        data = os.pread(self._fd, hi - lo, start + lo)
        if len(data) != hi - lo:
            raise EOFError(f"{self.path}: short read of {key!r} ({len(data)} of {hi - lo} bytes)")
        return data

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        if byte_range is not None and key in self._members:
            data = self._pread(key, byte_range)
            if data is not None:
                return prototype.buffer.from_bytes(data)
        return await super().get(key, prototype, byte_range)

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list[Any]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    def close(self) -> None:
        if self._is_open:
            super().close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_IOV_MAX = 1024  # POSIX minimum is 16, Linux and macOS allow 1024 buffers per preadv
_NO_CHUNK = 2**64 - 1  # zarr's shard-index marker of an absent (all fill value) chunk
IMAGES_SHARD_KEY = "images/c/0/0/0/0"


class DirectRows:
    """Reads rows of ``images`` straight from the one zarr shard with ``pread``: the loader's fast path.

    Valid only for the layout this module writes (checked by :meth:`plan`): the sharding codec with
    inner chunks of ``k`` whole images encoded as ``bytes`` + ``crc32c``, the index (also
    ``bytes`` + ``crc32c``) at the end of the single shard, fill value 0. It applies zarr's own
    rules (index entries of ``2**64-1`` mean an all-zero chunk; every chunk's crc32c is checked)
    but reads a run of rows with one ``pread`` instead of one zarr request per inner chunk.
    """

    def __init__(
        self, store: RangeZipStore, path: str, *, data_start: int, index: np.ndarray, k: int, shape: tuple[int, ...]
    ) -> None:
        self.store, self.path, self.data_start, self.index, self.k, self.shape = (
            store,
            path,
            data_start,
            index,
            k,
            shape,
        )
        self.chunk_bytes = k * int(np.prod(shape))

    @classmethod
    def plan(cls, store: RangeZipStore, images: Any, path: str) -> DirectRows | None:
        """A reader for ``images`` if it has exactly our layout, else None (zarr then reads it)."""
        from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec, ShardingCodecIndexLocation  # noqa: PLC0415 (zarr is imported only for the zarr format)

        meta = images.metadata
        codecs: tuple[Any, ...] = tuple(getattr(meta, "codecs", ()))
        if len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec) or images.fill_value != 0:
            return None
        sc = codecs[0]
        expected = [BytesCodec, Crc32cCodec]
        if [type(c) for c in sc.codecs] != expected or [type(c) for c in sc.index_codecs] != expected:
            return None
        n, shape = images.shape[0], tuple(images.shape[1:])
        k = int(sc.chunk_shape[0])
        shard_rows = int(meta.chunk_grid.chunk_shape[0])
        if sc.index_location != ShardingCodecIndexLocation.end or tuple(sc.chunk_shape[1:]) != shape:
            return None
        if shard_rows < n or shard_rows % k or tuple(meta.chunk_grid.chunk_shape[1:]) != shape:
            return None
        where = store._member_range(IMAGES_SHARD_KEY)
        if where is None:
            return None
        start, size = where
        nchunks = shard_rows // k
        index_bytes = 16 * nchunks + 4
        if size < index_bytes:
            raise _corrupt(path, f"{IMAGES_SHARD_KEY} is {size} bytes, shorter than its {index_bytes}-byte index")
        raw = os.pread(store._fd, index_bytes, start + size - index_bytes)
        if len(raw) != index_bytes or _crc32c(raw[:-4]) != raw[-4:]:
            raise _corrupt(path, "the shard index of images fails its crc32c")
        index = np.frombuffer(raw[:-4], dtype="<u8").reshape(nchunks, 2)
        present = index[:, 0] != _NO_CHUNK
        ends = index[present, 0] + index[present, 1]
        if np.any(index[present, 1] != k * int(np.prod(shape)) + 4) or (ends.size and ends.max() > size - index_bytes):
            raise _corrupt(path, "the shard index of images points outside the shard")
        return cls(store, path, data_start=start, index=index, k=k, shape=shape)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (already bounds-checked) as a ``(stop-start, *shape)`` uint8 array.

        Chunks that lie back to back in the file are read with one ``preadv`` that scatters each
        chunk's payload straight into its row of the result and its 4-byte crc32c into a side
        array: no intermediate buffers, then one checksum pass.
        """
        k = self.k
        c0, c1 = start // k, (stop - 1) // k + 1
        out = np.zeros(((c1 - c0) * k, *self.shape), dtype=np.uint8)
        flat = out.reshape(c1 - c0, self.chunk_bytes)
        crcs = np.zeros((c1 - c0, 4), dtype=np.uint8)
        entries = self.index[c0:c1]
        present = np.flatnonzero(entries[:, 0] != _NO_CHUNK)
        fd = self.store._fd
        i = 0
        while i < len(present):
            # A segment: consecutive chunks stored back to back, at most _IOV_MAX // 2 of them.
            j = i + 1
            while (
                j < len(present)
                and j - i < _IOV_MAX // 2
                and int(entries[present[j], 0]) == int(entries[present[j - 1], 0]) + self.chunk_bytes + 4
            ):
                j += 1
            bufs: list[Any] = []
            for c in present[i:j]:
                bufs += [flat[c], crcs[c]]
            want = (j - i) * (self.chunk_bytes + 4)
            got = os.preadv(fd, bufs, self.data_start + int(entries[present[i], 0]))
            if got != want:
                raise _corrupt(self.path, f"short read in images ({got} of {want} bytes); the file is truncated")
            i = j
        for c in present:
            if google_crc32c.value(flat[c]) != int.from_bytes(crcs[c].tobytes(), "little"):
                row = (c0 + int(c)) * k
                raise _corrupt(self.path, f"images rows {row}:{row + k} fail their crc32c")
        lo = start - c0 * k
        return out[lo : lo + stop - start]


def _crc32c(data: bytes) -> bytes:
    """zarr's crc32c codec checksum: CRC-32C as 4 little-endian bytes."""
    return int(google_crc32c.value(data)).to_bytes(4, "little")


def _corrupt(path: str, what: str) -> CorruptSampleError:
    return CorruptSampleError(f"{path}: damaged zarr shard ({what}); run `stager verify` and re-stage or re-pack it")


# What zarr/zipfile raise on damaged input (zarr's own errors derive from ValueError/KeyError/OSError).
_DAMAGE = (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError)


class ZarrReader:
    """Reads one zarr shard through zarr's ZipStore; rows come back as ``(H, W, C)`` uint8 arrays."""

    def __init__(self, path: str, info: ShardInfo | None = None, manifest: Manifest | None = None) -> None:
        self.path = path
        self.info = info
        self._store: Any = None
        self._images: Any = None
        self._labels: Any = None
        self._direct: DirectRows | None = None
        self._attrs: dict[str, Any] = {}
        self._pid = 0
        self._group: tuple[Any, Any] | None = None  # (store, its group): fields are read through it

    def _open(self) -> Any:
        # A zip handle inherited through fork() shares its file position with the parent: reopen.
        if self._images is not None and self._pid == os.getpid():
            return self._images
        if not os.path.exists(self.path):
            raise ShardMissingError(f"{self.path}: shard missing; re-stage the dataset or re-run `stager pack`")
        store = None
        try:
            store = RangeZipStore(self.path)
            group = zarr.open_group(store, mode="r", zarr_format=3)
            attrs = group.attrs.asdict()
            images = group["images"]
            labels = group["labels"]
            self._validate(attrs, images, labels)
            direct = DirectRows.plan(store, images, self.path)
        except BaseException as exc:
            if store is not None:
                store.close()
            if isinstance(exc, _DAMAGE) and not isinstance(exc, CorruptSampleError):
                raise _corrupt(self.path, f"cannot open: {type(exc).__name__}: {exc}") from exc
            raise
        self._store, self._images, self._attrs, self._pid = store, images, attrs, os.getpid()
        self._direct = direct
        self._labels = labels
        return images

    def _validate(self, attrs: dict[str, Any], images: Any, labels: Any) -> None:
        if attrs.get("stager_format") != FORMAT_VERSION:
            raise _corrupt(self.path, f"stager_format is {attrs.get('stager_format')!r}, expected {FORMAT_VERSION!r}")
        n = attrs.get("num_samples")
        if not isinstance(n, int) or n < 0:
            raise _corrupt(self.path, f"num_samples is {n!r}")
        for name in ("keys", "exts", "meta"):
            if not isinstance(attrs.get(name), list) or len(attrs[name]) != n:
                raise _corrupt(self.path, f"attribute {name!r} must list {n} entries")
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] != n:
            raise _corrupt(self.path, f"images is {images.dtype} {images.shape}, expected uint8 ({n}, H, W, C)")
        shape = attrs.get("image_shape")
        if n and list(images.shape[1:]) != shape:
            raise _corrupt(self.path, f"images rows are {images.shape[1:]}, image_shape attribute says {shape}")
        if labels.shape != (n,) or labels.dtype != np.int64:
            raise _corrupt(self.path, f"labels is {labels.dtype} {labels.shape}, expected int64 ({n},)")

    @property
    def direct(self) -> bool:
        """Whether rows are read by :class:`DirectRows` (stager's layout) rather than through zarr."""
        self._open()
        return self._direct is not None

    @property
    def num_samples(self) -> int:
        return int(self._open().shape[0])

    def read_rows(self, start: int, stop: int, *, via_zarr: bool = False) -> np.ndarray:
        """Rows ``start:stop`` of ``images`` as one ``(stop-start, H, W, C)`` uint8 array.

        One ``pread`` for the run (:class:`DirectRows`) when the shard has stager's layout, else
        (or with ``via_zarr=True``) one zarr array slice; both check every image's crc32c.
        """
        images = self._open()
        if not 0 <= start <= stop <= images.shape[0]:
            raise IndexError(f"{self.path}: rows {start}:{stop} outside 0:{images.shape[0]}")
        try:
            if self._direct is not None and not via_zarr:
                if start == stop:
                    return np.zeros((0, *images.shape[1:]), dtype=np.uint8)
                return self._direct.read(start, stop)
            return np.asarray(images[start:stop])
        except CorruptSampleError:
            raise
        except _DAMAGE as exc:
            raise _corrupt(self.path, f"rows {start}:{stop}: {type(exc).__name__}: {exc}") from exc

    def iter_samples(self) -> Iterator[Sample]:
        """Every sample in row order, read through zarr in blocks of rows (validates the group first)."""
        images = self._open()
        n = images.shape[0]
        try:
            labels = np.asarray(self._labels[...], dtype=np.int64)
        except CorruptSampleError:
            raise
        except _DAMAGE as exc:
            raise _corrupt(self.path, f"labels: {type(exc).__name__}: {exc}") from exc
        keys, exts, metas = self._attrs["keys"], self._attrs["exts"], self._attrs["meta"]
        row_bytes = max(1, int(np.prod(images.shape[1:])))
        step = max(1, READ_BLOCK_BYTES // row_bytes)
        for start in range(0, n, step):
            block = self.read_rows(start, min(n, start + step))
            for i, row in enumerate(block):
                k = start + i
                yield Sample(key=keys[k], label=int(labels[k]), data=row, ext=exts[k], meta=metas[k])

    def read(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        """``(H, W, C)`` uint8 arrays of in-shard rows ``positions`` (in that order).

        Runs of consecutive ascending rows are fetched with one :meth:`read_rows` call each.
        """
        pos = np.asarray(positions, dtype=np.int64)
        out: list[Any] = [None] * len(pos)
        i = 0
        while i < len(pos):
            j = i + 1
            while j < len(pos) and pos[j] == pos[j - 1] + 1:
                j += 1
            block = self.read_rows(int(pos[i]), int(pos[j - 1]) + 1)
            out[i:j] = list(block)
            i = j
        return out

    def read_field(self, kind: str, name: str, offset: int, size: int) -> Any:
        """A sample's field by its manifest extent (:func:`stager.formats.zarr_fields.read_field`)."""
        self._open()
        try:
            if self._group is None or self._group[0] is not self._store:
                self._group = (self._store, zarr.open_group(self._store, mode="r", zarr_format=3))
            return read_field(self._group[1], kind, name, offset, size)
        except CorruptSampleError:
            raise
        except _DAMAGE as exc:
            raise _corrupt(self.path, f"field {name!r}: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self._store is not None and self._pid == os.getpid():
            self._store.close()
        self._store = self._images = self._direct = None


class ZarrFormat(Format):
    """The ``zarr`` format: decoded fixed-shape images in a zarr v3 group per zip file."""

    spec = format_spec("zarr")
    reader = ZarrReader
    writer = ZarrWriter

    def disk_bytes(self, inputs: SizeInputs) -> tuple[np.ndarray, int]:
        """Each sample's bytes in a shard file and the fixed bytes (:func:`sample_disk_bytes`)."""
        return sample_disk_bytes(inputs)


FORMAT = ZarrFormat()

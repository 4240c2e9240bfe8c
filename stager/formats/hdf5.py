"""HDF5 shards: one ``shard-NNNNN.h5`` per shard, images as one contiguous uint8 dataset.

File layout (normative description: docs/formats.md, section "hdf5"):

* ``/images``: uint8, shape ``(total_bytes,)``, contiguous (no chunking, no filters): the encoded
  image files' bytes concatenated in sample order. Because the storage is contiguous and
  uncompressed, sample ``i`` is the ``offsets[i+1] - offsets[i]`` bytes at file offset
  ``images.id.get_offset() + offsets[i]``; the manifest stores exactly that, so the loader reads
  images with ``os.pread`` and never imports h5py.
* ``/offsets``: int64, shape ``(n+1,)``: sample boundaries inside ``/images`` (``offsets[0] == 0``,
  ``offsets[n] == total_bytes``).
* ``/labels``: int64 ``(n,)``; ``/keys``, ``/exts``, ``/meta``: variable-length UTF-8 strings
  ``(n,)`` (``meta`` holds each sample's metadata as canonical JSON).
* root attributes: ``stager_format`` (``"stager.hdf5/1"``), ``layout`` (``"contiguous-uint8"``),
  ``num_samples``, ``classes`` (JSON list of class names).

Why contiguous rather than a variable-length uint8 dataset: tools/bench/bench_hdf5_layout.py
measures both with plain h5py; docs/bench/hdf5_layout.md has the figures and the reasoning.

Determinism: no object timestamps (``track_times=False``), fixed ``libver=("v110", "v110")`` (files
open with HDF5 >= 1.10), and the writer lays the file out in a fixed order, so identical samples
give byte-identical files.

The writer writes each image's bytes straight to where they end up in the file, a few MB at a time
(``pwrite`` at ``images_data_offset() + offset``, with the kernel's writeback started so the disk
works while samples are read and the final fsync is short), and writes the metadata around them in
``close()``: ``write()`` must return each sample's final file offset before the dataset's size is
known. That works because ``/images`` is created first with early allocation, so its data always
starts at the same file offset whatever its size; :func:`images_data_offset` measures that offset
once on an in-memory file and ``close()`` checks the built file agrees.

HDF5 never writes to the shard path. ``close()`` builds the file's metadata in memory through
h5py's file-object driver, into a :class:`_GapFile` that keeps what HDF5 writes below ``/images``
and after it and nothing for the ``/images`` region itself (allocated, never written there), then
writes those two pieces to ``path`` with plain ``os.pwrite``. Reason: when libhdf5 itself hits a
write error (EFBIG under ``RLIMIT_FSIZE``, ENOSPC, EDQUOT), h5py/libhdf5 can crash with SIGSEGV
while closing the file, so a full disk killed ``stager pack`` instead of giving exit 4. Our own
writes raise a plain ``OSError`` that ``stager.pack`` turns into
:class:`~stager.errors.OutOfSpaceError`. Why not HDF5's in-memory "core" driver (used before): it
fills the whole address space with zeros, ``/images`` included, and copies it out again, ~0.3 s
and twice the shard's size in memory for a 256 MB shard, as long as the rest of packing it; the
file-object driver does not aggregate metadata into 2 KiB blocks as the POSIX and core drivers do,
so ``/images`` starts at a smaller offset (measured by :func:`images_data_offset` on the same driver).
"""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

import numpy as np

from stager.errors import CorruptSampleError, ShardMissingError, SourceError, StagerError, UsageError
from stager.formats.base import (
    Extent,
    ExtentReader,
    Format,
    FragmentsDone,
    PlacedAsWritten,
    Sample,
    SizeInputs,
    ascii_lengths,
    write_parts,
)
from stager.formats.registry import format_spec
from stager.fs.writeback import start_writeback
from stager.manifest.fields import FieldSpec

FORMAT_VERSION = "stager.hdf5/1"
LAYOUT = "contiguous-uint8"
LIBVER = ("v110", "v110")
FLUSH_BYTES = 4 << 20  # image bytes buffered before one pwrite
COPY_BLOCK = 8 << 20  # bytes moved per h5py write / read when building or scanning a shard


def _h5py() -> Any:
    try:
        import h5py  # noqa: PLC0415 (h5py loads libhdf5: only for the hdf5 format)
    except ImportError as exc:  # pragma: no cover - h5py is a dependency; kept for slim installs
        raise StagerError("the hdf5 format needs h5py: pip install h5py") from exc
    return h5py


def _create_images(h5file: Any, nbytes: int) -> Any:
    """Create ``/images`` (uint8, contiguous, allocated now) in ``h5file``; return its DatasetID.

    Early allocation with no fill makes HDF5 place the raw data right after the metadata created so
    far, so the data offset does not depend on ``nbytes``.
    """
    h5py = _h5py()
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    space = h5py.h5s.create_simple((nbytes,), (nbytes,))
    return h5py.h5d.create(h5file.id, b"images", h5py.h5t.NATIVE_UINT8, space, dcpl=dcpl)


def _open_new(target: _GapFile) -> Any:
    return _h5py().File(target, "w", libver=LIBVER, track_order=False, locking=False)


class _GapFile(io.RawIOBase):
    """The file HDF5 writes a shard's metadata into, in memory, less the ``/images`` region.

    h5py's file-object driver reads and writes through it. Bytes below ``gap_start`` are kept in
    ``head``, bytes from ``gap_start + gap_len`` on in ``tail``; the gap (``/images``, whose bytes are
    in the shard file already) is never written by HDF5 (a write there is a :class:`StagerError`)
    and reads as zeros. ``size`` is the file's length (HDF5 sets it with ``truncate``).
    """

    def __init__(self, gap_start: int = 1 << 62, gap_len: int = 0) -> None:
        super().__init__()
        self.gap_start = gap_start
        self.gap_end = gap_start + gap_len
        self.head = bytearray()
        self.tail = bytearray()
        self.size = 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        n = len(data)
        a, e = self._pos, self._pos + n
        if e <= self.gap_start:
            part, at = self.head, a
        elif a >= self.gap_end:
            part, at = self.tail, a - self.gap_end
        else:
            raise StagerError(f"HDF5 wrote {n} bytes at {a}, inside /images [{self.gap_start}, {self.gap_end}); "
                              "this h5py/HDF5 build lays files out differently: report it with `h5py.version.info`")
        if len(part) < at + n:
            part.extend(bytes(at + n - len(part)))
        part[at : at + n] = data
        self._pos = e
        self.size = max(self.size, e)
        return n

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.size - self._pos))
        a = self._pos
        out = memoryview(buf).cast("B")
        out[:n] = bytes(n)
        if a < self.gap_start:  # the part of [a, a + n) in head
            got = self.head[a : min(a + n, self.gap_start)]
            out[: len(got)] = got
        if a + n > self.gap_end:  # the part in tail
            s = max(a, self.gap_end)
            got = self.tail[s - self.gap_end : a + n - self.gap_end]
            out[s - a : s - a + len(got)] = got
        self._pos += n
        return n

    def truncate(self, size: int | None = None) -> int:
        self.size = self._pos if size is None else size
        return self.size

    def pieces(self) -> tuple[bytes, bytes]:
        """``(the file's bytes before the gap, its bytes after it)``, zero-padded to their full lengths."""
        head = bytes(self.head[: self.gap_start]).ljust(min(self.gap_start, self.size), b"\0")
        tail = bytes(self.tail).ljust(max(0, self.size - self.gap_end), b"\0")
        return head, tail


@functools.lru_cache(maxsize=1)
def images_data_offset() -> int:
    """File offset at which ``/images`` data starts in every shard this writer produces (the same
    driver, the same first objects: only the superblock and the root group precede it)."""
    offset = None
    with _open_new(_GapFile()) as f:
        offset = _create_images(f, 1).get_offset()
    if offset is None:  # pragma: no cover - only if HDF5 changes its allocation strategy
        raise StagerError("HDF5 did not allocate /images early; this h5py/HDF5 build is unsupported")
    return int(offset)


def _heap_object(n: np.ndarray) -> np.ndarray:
    """Bytes of a variable-length string of ``n`` bytes: a 16-byte reference in its dataset plus a
    global-heap object (16-byte header, data padded to 8)."""
    return 32 + (n + 7) // 8 * 8


# What every shard has besides its samples: the 2 KiB before /images, the datasets' object headers and
# attributes, and the unused tails of the global-heap collections holding the strings, which depend on
# the count in steps of a collection (measured 2-33 KB for 1-8,000 samples; this is their mean).
FIXED_BYTES = 12_000


def sample_disk_bytes(inputs: SizeInputs) -> tuple[np.ndarray, int]:
    """``(bytes of each sample, fixed bytes)`` in an hdf5 shard: within ~20 KB of the real file
    (1% of a shard of 2 MB or more).

    A sample is its image bytes, 8 + 8 in ``/offsets`` and ``/labels`` and three variable-length
    strings (key, extension, metadata JSON, assumed ``{"source": "<key>.<EXT>"}`` as ``stager pack``
    writes it for an ImageFolder); the fixed part is :data:`FIXED_BYTES` plus the ``classes``
    attribute.
    """
    nk = ascii_lengths(inputs.keys)
    ne = ascii_lengths(inputs.exts)
    per = inputs.sizes.astype(np.int64) + 16 + _heap_object(nk) + _heap_object(ne) + _heap_object(14 + nk + ne)
    return per, FIXED_BYTES + len(json.dumps(list(inputs.classes)))


def _meta_json(meta: dict[str, Any]) -> str:
    """``json.dumps(meta, sort_keys=True, separators=(",", ":"))``, directly for ``{"source": str}``
    (what ``stager pack`` writes: ~8x cheaper)."""
    if len(meta) == 1 and type(meta.get("source")) is str:
        return '{"source":' + encode_basestring_ascii(meta["source"]) + "}"
    return json.dumps(meta, sort_keys=True, separators=(",", ":"))


class _Columns(NamedTuple):
    """A shard's per-sample datasets besides ``/images`` (``bounds``: ``/offsets``, n + 1 entries)."""

    keys: Sequence[str]
    labels: Sequence[int]
    exts: Sequence[str]
    metas: Sequence[str]
    bounds: Sequence[int] | np.ndarray


_FieldsWriter = Callable[[Any, dict[str, Any]], list[tuple[str, Any]]]  # (h5py file, dataset options) -> located


def _write_metadata(fd: int, path: str, columns: _Columns, classes: Sequence[str],
                    write_fields: _FieldsWriter | None = None) -> dict[str, int]:
    """Write the HDF5 file around the image bytes already in ``fd`` at ``[base, base + bounds[-1])``
    (``base``: :func:`images_data_offset`): what precedes ``/images`` and everything after it, built in
    a :class:`_GapFile`. ``write_fields(file, dataset options)`` adds the fields' datasets and returns
    the byte ones to locate. Returns each byte field's data offset (``field_bases``)."""
    h5py = _h5py()
    base = images_data_offset()
    total = int(columns.bounds[-1])
    strings = h5py.string_dtype("utf-8")
    image = _GapFile(base, total)
    with _open_new(image) as f:
        dsid = _create_images(f, total)
        offset = dsid.get_offset()
        if total and offset != base:  # an empty /images has no storage at all
            raise StagerError(
                f"{path}: HDF5 placed /images at byte {offset}, expected {base}; "
                "this HDF5 build lays files out differently: report it with `h5py.version.info`"
            )
        # /images is allocated but never written here: its bytes are already in the file.
        n = len(columns.keys)
        opts: dict[str, Any] = {"track_times": False}
        f.create_dataset("offsets", data=np.asarray(columns.bounds, dtype=np.int64), **opts)
        f.create_dataset("labels", data=np.asarray(columns.labels, dtype=np.int64), **opts)
        f.create_dataset("keys", shape=(n,), dtype=strings, data=columns.keys, **opts)
        f.create_dataset("exts", shape=(n,), dtype=strings, data=columns.exts, **opts)
        f.create_dataset("meta", shape=(n,), dtype=strings, data=columns.metas, **opts)
        located = write_fields(f, opts) if write_fields is not None else []
        f.attrs["stager_format"] = FORMAT_VERSION
        f.attrs["layout"] = LAYOUT
        f.attrs["num_samples"] = np.int64(n)
        f.attrs["classes"] = json.dumps(list(classes))
        f.flush()
        field_bases = {name: int(d.get_offset()) for name, d in located}
    # Closed: what HDF5 wrote on closing (the superblock's end of file and clean-close state) is in
    # ``image`` too. Everything but the image bytes: what precedes /images and the rest.
    head, tail = image.pieces()
    _write_at(fd, memoryview(head), 0)
    _write_at(fd, memoryview(tail), base + total)
    return field_bases


def _image_bytes(sample: Sample) -> bytes:
    """The sample's encoded image bytes (immutable), or :class:`SourceError` for anything else."""
    data = sample.data
    if isinstance(data, np.ndarray) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise SourceError(
            f"{sample.key}: the hdf5 format stores encoded image bytes, got {type(data).__name__}; "
            "use --format zarr for decoded arrays"
        )
    return data if type(data) is bytes else bytes(data)


def _sample_meta(sample: Sample) -> str:
    try:
        return _meta_json(sample.meta)
    except (TypeError, ValueError) as exc:
        raise SourceError(f"{sample.key}: sample metadata is not JSON-serialisable ({exc})") from exc


class Hdf5Writer(PlacedAsWritten):
    """Writes one HDF5 shard at ``path`` (see the module docstring for the layout)."""

    def __init__(self, path: str, *, shard_name: str, classes: Sequence[str], fields: Sequence[FieldSpec] = (),
                 **options: Any) -> None:
        self.path = path
        self._fields = list(fields)
        self._field_values: dict[str, list[Any]] = {f.name: [] for f in fields}
        self._field_ends: dict[str, int] = {f.name: 0 for f in fields}
        self.field_bases: dict[str, int] = {}  # after close(): file offset of each byte field's data
        self.shard_name = shard_name
        self.classes = list(classes)
        self._base = images_data_offset()
        # Image bytes go straight to their final place in the file (base + offset), a few MB at a
        # time with the kernel's writeback started, so the disk works while samples are read; close()
        # adds the metadata around them.
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._parts: list[bytes | bytearray | memoryview] = []  # image bytes not yet written, in order
        self._queued = 0  # their length
        self._flushed = 0  # image bytes already written to the file
        self._bounds: list[int] = [0]
        self._keys: list[str] = []
        self._labels: list[int] = []
        self._exts: list[str] = []
        self._meta: list[str] = []

    def write(self, sample: Sample) -> Extent:
        """Append ``sample`` (encoded bytes); return where its bytes will sit in the final file."""
        if self._fd is None:
            raise StagerError(f"{self.shard_name}: write() after close()")
        data = _image_bytes(sample)
        meta = _sample_meta(sample)
        start = self._bounds[-1]
        size = len(data)
        # Queued as they are (immutable bytes), written by one pwritev a few MB at a time: never
        # copied in user space.
        self._parts.append(data)
        self._queued += size
        if self._queued >= FLUSH_BYTES:
            self._flush()
        self._bounds.append(start + size)
        self._keys.append(sample.key)
        self._labels.append(int(sample.label))
        self._exts.append(sample.ext)
        self._meta.append(meta)
        extents = self._add_fields(sample) if self._fields else None
        return Extent(self._base + start, size, extents)

    def _add_fields(self, sample: Sample) -> dict[str, tuple[int, int]]:
        """Keep the sample's fields for close(); byte fields' extents relative to their dataset
        (``field_bases`` makes them absolute once the file is laid out)."""
        out = {}
        for f in self._fields:
            if f.name not in sample.fields:
                raise SourceError(f"{sample.key}: lacks field {f.name!r}")
            v = sample.fields[f.name]
            if f.ragged:
                self._field_values[f.name].append(np.asarray(v, dtype=f.dtype).reshape((-1, *f.item)))
            else:
                b = bytes(v)
                self._field_values[f.name].append(b)
                out[f.name] = (self._field_ends[f.name], len(b))
                self._field_ends[f.name] += len(b)
        return out

    def _write_fields(self, f: Any, opts: dict[str, Any]) -> list[tuple[str, Any]]:
        """``/fields/<name>/data`` (uint8, contiguous) or ``/values`` (ragged: (M, *item)) plus ``/offsets``
        (int64, n + 1) per field; returns the byte datasets to locate after the flush."""
        h5py = _h5py()
        located = []
        for spec in self._fields:
            g = f.create_group(f"fields/{spec.name}", track_order=False)
            g.attrs["kind"] = spec.kind
            g.attrs["ext"] = spec.ext
            vals = self._field_values[spec.name]
            if spec.ragged:
                arr = np.concatenate(vals) if vals else np.zeros((0, *spec.item), dtype=spec.dtype)
                g.create_dataset("values", data=arr, **opts)
                lens = [len(v) for v in vals]
            else:
                blob = np.frombuffer(b"".join(vals), dtype=np.uint8)
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                dcpl.set_obj_track_times(False)
                space = h5py.h5s.create_simple((max(1, len(blob)),))
                dsid = h5py.h5d.create(g.id, b"data", h5py.h5t.STD_U8LE, space, dcpl=dcpl)
                ds = h5py.Dataset(dsid)
                if len(blob):
                    ds[: len(blob)] = blob
                located.append((spec.name, dsid))
                lens = [len(v) for v in vals]
            g.create_dataset("offsets", data=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), **opts)
        return located

    def _flush(self) -> None:
        """Write the queued image bytes at their place in the file and start their writeback."""
        assert self._fd is not None
        at = self._base + self._flushed
        done = write_parts(self._fd, self._parts, at)
        start_writeback(self._fd, at, done)
        self._flushed += done
        self._parts, self._queued = [], 0

    def close(self) -> list[tuple[str, str]]:
        """Write the HDF5 metadata around the image bytes already in the file; no companion files."""
        if self._fd is None:
            raise StagerError(f"{self.shard_name}: close() called twice")
        self._flush()
        try:
            columns = _Columns(self._keys, self._labels, self._exts, self._meta, self._bounds)
            self.field_bases = _write_metadata(self._fd, self.path, columns, self.classes, self._write_fields)
        finally:
            os.close(self._fd)
            self._fd = None
        return []

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._parts, self._queued = [], 0


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset``, in COPY_BLOCK pieces (errors propagate as OSError)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done : done + COPY_BLOCK], offset + done)
        start_writeback(fd, offset + done, n)
        done += n


def _corrupt(path: str, what: str) -> CorruptSampleError:
    return CorruptSampleError(f"{path}: damaged HDF5 shard ({what}); run `stager verify` and re-stage or re-pack it")


class Hdf5Reader(ExtentReader):
    """Reads one HDF5 shard: ``iter_samples`` through h5py, ``read`` with ``os.pread`` (no h5py)."""

    # ---- container scan (convert, deep verify) ------------------------------------------
    def iter_samples(self) -> Iterator[Sample]:
        """Every sample of the shard in order, parsed with h5py; validates the layout first."""
        h5py = _h5py()
        try:
            f = h5py.File(self.path, "r", locking=False)
        except FileNotFoundError as exc:
            raise ShardMissingError(
                f"{self.path}: shard missing; re-stage the dataset or re-run `stager pack`"
            ) from exc
        except (OSError, ValueError) as exc:
            raise _corrupt(self.path, f"cannot open: {exc}") from exc
        with f:
            try:
                bounds, labels, keys, exts, metas, images = self._validate(f)
                n = len(keys)
                i = 0
                while i < n:
                    # One h5py read per block of whole samples, not one per sample.
                    j = int(np.searchsorted(bounds, bounds[i] + COPY_BLOCK, side="right")) - 1
                    j = min(max(j, i + 1), n)
                    base = int(bounds[i])
                    block = images[base : int(bounds[j])].tobytes()
                    for k in range(i, j):
                        yield Sample(
                            key=keys[k],
                            label=int(labels[k]),
                            data=block[int(bounds[k]) - base : int(bounds[k + 1]) - base],
                            ext=exts[k],
                            meta=json.loads(metas[k]) if metas is not None else {},
                        )
                    i = j
            except CorruptSampleError:
                raise
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise _corrupt(self.path, str(exc)) from exc

    def _validate(self, f: Any) -> tuple[np.ndarray, np.ndarray, list[str], list[str], list[str] | None, Any]:
        fmt = f.attrs.get("stager_format")
        if isinstance(fmt, bytes):
            fmt = fmt.decode()
        if fmt != FORMAT_VERSION:
            raise _corrupt(self.path, f"stager_format attribute is {fmt!r}, expected {FORMAT_VERSION!r}")
        layout = f.attrs.get("layout")
        if isinstance(layout, bytes):
            layout = layout.decode()
        if layout != LAYOUT:
            raise _corrupt(self.path, f"layout {layout!r}, expected {LAYOUT!r}")
        for name in ("images", "offsets", "labels", "keys", "exts"):
            if name not in f:
                raise _corrupt(self.path, f"missing dataset /{name}")
        images = f["images"]
        if images.dtype != np.uint8 or images.ndim != 1 or images.chunks is not None or images.compression:
            raise _corrupt(self.path, "/images must be a contiguous 1-D uint8 dataset")
        bounds = np.asarray(f["offsets"][...], dtype=np.int64)
        labels = np.asarray(f["labels"][...], dtype=np.int64)
        keys = [k.decode() if isinstance(k, bytes) else str(k) for k in f["keys"][...]]
        exts = [e.decode() if isinstance(e, bytes) else str(e) for e in f["exts"][...]]
        metas = None
        if "meta" in f:
            metas = [m.decode() if isinstance(m, bytes) else str(m) for m in f["meta"][...]]
        n = int(f.attrs.get("num_samples", -1))
        if not (len(keys) == len(exts) == len(labels) == n and len(bounds) == n + 1):
            raise _corrupt(self.path, f"index lengths disagree with num_samples={n}")
        if metas is not None and len(metas) != n:
            raise _corrupt(self.path, f"/meta has {len(metas)} entries, expected {n}")
        if bounds[0] != 0 or bounds[-1] != images.shape[0] or (n and np.any(np.diff(bounds) < 0)):
            raise _corrupt(self.path, "/offsets is not a non-decreasing 0..len(/images) sequence")
        return bounds, labels, keys, exts, metas, images


class Hdf5FragmentWriter:
    """A run of a shard's samples built in memory, for ``pack --workers``: their image bytes (parts,
    uncopied) and what ``/keys``, ``/exts`` and ``/meta`` need of them (:meth:`extra`). A shard is its
    fragments' bytes written one after the other from :func:`images_data_offset` on, then
    :meth:`Hdf5Format.finish_fragments`: byte for byte what :class:`Hdf5Writer` writes. Samples with
    fields are not written in fragments (their datasets are laid out at the end)."""

    def __init__(self, *, shard_name: str, classes: Sequence[str], **options: Any) -> None:
        if options.get("fields"):
            raise UsageError(f"{shard_name}: hdf5 fields are written per shard, not in fragments")
        self.shard_name = shard_name
        self._parts: list[bytes] = []
        self._size = 0
        self._exts: list[str] = []
        self._metas: list[str] = []

    def write(self, sample: Sample) -> Extent:
        """Append ``sample``; its extent is relative to the fragment's first byte."""
        data = _image_bytes(sample)
        meta = _sample_meta(sample)
        if sample.fields:
            raise UsageError(f"{self.shard_name}: hdf5 fields are written per shard, not in fragments")
        start = self._size
        self._parts.append(data)
        self._size += len(data)
        self._exts.append(sample.ext)
        self._metas.append(meta)
        return Extent(start, len(data))

    def take(self) -> list[bytes]:
        """The fragment's image bytes, as parts in order."""
        parts, self._parts = self._parts, []
        return parts

    def extra(self) -> tuple[list[str], list[str]]:
        """``(exts, metas)`` of the fragment's samples, for :meth:`Hdf5Format.finish_fragments`."""
        return self._exts, self._metas


class Hdf5Format(Format):
    """The ``hdf5`` format: encoded images in one contiguous HDF5 dataset per shard."""

    spec = format_spec("hdf5")
    reader = Hdf5Reader
    writer = Hdf5Writer

    def fragment_base(self) -> int:
        """Where a shard's first fragment goes: ``/images``'s first byte."""
        return images_data_offset()

    def open_fragment(self, *, shard_name: str, classes: Sequence[str], **options: Any) -> Hdf5FragmentWriter:
        """An in-memory writer for a run of a shard's samples (see :class:`Hdf5FragmentWriter`)."""
        return Hdf5FragmentWriter(shard_name=shard_name, classes=classes, **options)

    def finish_fragments(self, path: str, end: int, done: FragmentsDone) -> list[tuple[str, str]]:
        """Write the metadata of the shard at ``path`` whose fragments fill ``[fragment_base(), end)``."""
        exts = [e for x in done.extras for e in x[0]]
        metas = [m for x in done.extras for m in x[1]]
        bounds = np.zeros(len(done.sizes) + 1, dtype=np.int64)
        np.cumsum(np.asarray(done.sizes, dtype=np.int64), out=bounds[1:])
        if int(bounds[-1]) != end - images_data_offset():
            raise StagerError(f"{path}: fragments end at {end}, their samples at {int(bounds[-1])} image bytes")
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            _write_metadata(fd, path, _Columns(done.keys, done.labels, exts, metas, bounds), done.classes)
        finally:
            os.close(fd)
        return []

    def disk_bytes(self, inputs: SizeInputs) -> tuple[np.ndarray, int]:
        """Each sample's bytes in a shard file and the fixed bytes (:func:`sample_disk_bytes`)."""
        return sample_disk_bytes(inputs)


FORMAT = Hdf5Format()

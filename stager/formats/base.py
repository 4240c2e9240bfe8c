"""The writer/reader protocol every shard format implements.

A *format* turns a stream of :class:`Sample` objects into one shard file (plus optional companion
files such as a record shard's index) and reads them back. Formats know nothing about sharding
plans, checksums or atomic renames: ``stager.pack`` owns those, so every format gets them right
the same way. What a format can do is declared in its registry entry (:mod:`stager.formats.registry`),
which its :class:`Format` class carries as ``spec``.

Contract (tested for every format by :class:`stager.testing.formats.FormatTests`):

* ``Format.open_writer(path, ...)`` writes exactly one shard at ``path`` (a ``.partial`` name chosen
  by the caller); ``ShardWriter.write(sample)`` returns the :class:`Extent` of the sample's payload
  inside the final file (docs/formats.md says what offsets mean per format);
  ``ShardWriter.close()`` flushes and returns the companion files it wrote as ``(final_name,
  temp_path)`` pairs, which the caller hashes and renames together with the shard.
* Output is a pure function of the samples written and the writer options: identical input gives
  identical bytes (fixed tar mtimes, no timestamps in HDF5/zarr metadata).
* ``Format.disk_bytes(inputs)`` says how many bytes each sample takes in a shard file; the pack plan
  cuts shards with it so that ``--shard-size`` bounds file bytes, not payload bytes.
* ``Format.open_reader(path, info, manifest)`` gives ``iter_samples()`` (parse the container itself,
  independent of the manifest index: used by convert and deep verify) and ``read(positions)``
  (payloads of the given in-shard positions using the manifest index: used by the loader).
* A read-only format (``spec.writable`` false) implements ``open_reader`` only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, BinaryIO, ClassVar, NamedTuple, Protocol

import numpy as np

from stager.errors import CorruptSampleError, ShardMissingError, UsageError
from stager.formats.registry import FORMAT_NAMES, FormatSpec
from stager.fs.writeback import start_writeback
from stager.manifest import Manifest, ShardInfo
from stager.manifest.fields import FieldSpec

FLUSH_BYTES = 4 << 20  # what a buffered writer accumulates before one write() call
_NO_FIELD_BASES: Mapping[str, int] = MappingProxyType({})


@dataclass(slots=True)
class Sample:
    """One training example.

    ``data`` is the encoded image file's bytes (``ext`` names its type: ``jpg``, ``png``, ...) for
    encoded formats, or an ``(H, W, C)`` uint8 array for decoded ones. ``meta`` is small
    JSON-serialisable metadata (source path, original size). ``fields`` holds the sample's named
    fields (schema: :mod:`stager.manifest.fields`): encoded bytes for the byte kinds (mask, image,
    array as ``.npy``, json as UTF-8, bytes), numpy arrays for the ragged kinds (boxes ``(n, 4)``
    float32, box_labels ``(n,)`` int64, per_box ``(n, ...)``); empty for image + label samples.

    Treated as immutable (``dataclasses.replace`` makes a changed copy) but not ``frozen``: pack builds
    one per sample, and a frozen dataclass's ``__init__`` costs 2.9 us against 0.8 us for this one
    (docs/benchmarks.md, "Packing small sets").
    """

    key: str
    label: int
    data: bytes | np.ndarray
    ext: str = "jpg"
    meta: dict[str, Any] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)


class Extent(NamedTuple):
    """Where a sample's payload lives inside its shard file: ``size`` bytes at ``offset``.

    ``fields``: ``{name: (offset, size)}`` of each byte field stored in the shard (same file).
    A named tuple: writers return one per sample (0.6 us to build against 1.6 us for a frozen dataclass)."""

    offset: int
    size: int
    fields: dict[str, tuple[int, int]] | None = None


class FragmentsDone(NamedTuple):
    """What finishing a shard written as fragments needs (``Format.finish_fragments``, formats whose
    entry declares ``fragments``): its samples' rows in shard order and each fragment's ``extra()``
    in order (what the format keeps of its samples besides their bytes; None for tar)."""

    shard_name: str
    classes: Sequence[str]
    keys: Sequence[str]
    labels: Sequence[int]
    sizes: Sequence[int]
    extras: list[Any]


class ShardWriter(Protocol):
    def write(self, sample: Sample) -> Extent: ...

    @property
    def field_bases(self) -> Mapping[str, int]:
        """After ``close()``: ``{field name: file offset}`` to add to the field extents ``write`` returned,
        for a writer that places field data only when it lays the file out (hdf5); empty otherwise."""
        ...

    def close(self) -> list[tuple[str, str]]:
        """Finish the shard; return ``[(companion final name, companion temp path), ...]``."""
        ...

    @property
    def extents(self) -> str:
        """After ``close()``: the shard's ``extents`` kind (:data:`~stager.formats.registry.EXTENT_KINDS`):
        ``"bytes"`` unless the writer placed payloads that are no byte ranges (squashfs: ``"inodes"``)."""
        ...

    def final_offset(self, offset: int) -> int:
        """After ``close()``: the manifest offset of a payload for which ``write`` returned ``offset``. A
        writer that learns where a payload is only when it lays the file out (a squashfs file that is
        compressed) returns a provisional one; the identity for every other writer."""
        ...

    def abort(self) -> None:
        """Close without finishing after an error (the caller removes the files)."""
        ...


class ShardReader(Protocol):
    def iter_samples(self) -> Iterator[Sample]: ...

    def read(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        """Payloads (bytes, or arrays for decoded formats) of in-shard ``positions``, in that order."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SizeInputs:
    """What a pack plan knows of its samples before writing, for :meth:`Format.disk_bytes`.

    Columns in plan order: ``keys``, ``labels`` (int64), ``sizes`` (int64 source file bytes: the
    payload when files pass through unchanged, an estimate when re-encoded) and ``exts`` (the
    lower-case extension each file will be stored under, as far as the listing tells). ``classes``
    names labels; ``image_shape`` is the fixed (H, W, 3) of a decoded format; ``options`` are the
    writer options that change a sample's footprint (``json_member`` for tar).
    """

    keys: Sequence[str]
    labels: np.ndarray
    sizes: np.ndarray
    exts: Sequence[str]
    classes: Sequence[str]
    image_shape: tuple[int, int, int] | None = None
    options: dict[str, Any] = field(default_factory=dict)


def varint_lengths(x: np.ndarray) -> np.ndarray:
    """Bytes of the protobuf varint of each non-negative value in ``x`` (int64 array)."""
    n = np.ones(len(x), dtype=np.int64)
    for bits in range(7, 64, 7):
        n += x >= (1 << bits)
    return n


class Lines(Sequence[str]):
    """Strings without a newline, held as one newline-joined ``text`` (a listing's column decoded in
    one go, :meth:`stager.pack.sources.columns.StrColumn.lines`), with each one's UTF-8 byte length
    (``lengths``, int64); ``unique``: known to hold no string twice.

    What the pack plan hands to :meth:`Format.check_keys` and, in :class:`SizeInputs`, to
    :meth:`Format.disk_bytes`: they check and measure a million keys with a few passes over ``text``
    (:func:`all_ascii`, :func:`ascii_lengths`) instead of a Python call per key. The strings themselves
    are split out only when indexed (an odd key to report or to size exactly).
    """

    __slots__ = ("_split", "lengths", "text", "unique")

    def __init__(self, text: str, lengths: np.ndarray, *, unique: bool = False) -> None:
        self.text = text
        self.lengths = lengths
        self.unique = unique
        self._split: list[str] | None = None

    @classmethod
    def of(cls, texts: Sequence[str]) -> Lines:
        """The strings ``texts`` as lines (:class:`ValueError` if one holds a newline)."""
        text = "\n".join(texts)
        if text.count("\n") != max(len(texts) - 1, 0):
            raise ValueError("a string holds a newline")
        return cls(text, ascii_lengths(list(texts)))

    def _lines(self) -> list[str]:
        if self._split is None:
            self._split = self.text.split("\n") if len(self.lengths) else []
        return self._split

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: Any) -> Any:
        return self._lines()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lines())


def all_ascii(texts: Sequence[str]) -> bool:
    """Whether every string in ``texts`` is ASCII (one pass over a :class:`Lines` text)."""
    return texts.text.isascii() if isinstance(texts, Lines) else "".join(texts).isascii()


def ascii_lengths(texts: Sequence[str]) -> np.ndarray:
    """UTF-8 byte length of each string (int64): ``len`` when they are all ASCII (the usual case)."""
    if isinstance(texts, Lines):
        return texts.lengths
    if "".join(texts).isascii():
        return np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    return np.fromiter((len(t.encode()) for t in texts), dtype=np.int64, count=len(texts))


class Format:
    """A shard format. Subclasses set ``spec`` (their registry entry, :mod:`stager.formats.registry`)
    and ``reader`` (called as ``reader(path, info, manifest)``); writable ones also ``writer`` (called
    as ``writer(path, shard_name=..., classes=..., **options)``) and ``disk_bytes``, and those whose
    entry declares it ``check_keys`` (``named_keys``) or ``open_fragment`` (``fragments``).

    ``name``, ``suffix`` and ``sample_kind`` are the entry's. A format object is a module-level
    singleton (``FORMAT``), found by :func:`stager.formats.get_format`.
    """

    spec: ClassVar[FormatSpec]
    reader: ClassVar[Callable[..., ShardReader]]
    writer: ClassVar[Callable[..., ShardWriter] | None] = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def suffix(self) -> str:
        return self.spec.suffix

    @property
    def sample_kind(self) -> str:
        """``"encoded"`` or ``"decoded"``: what its shards hold (a manifest may say otherwise: LMDB)."""
        return self.spec.sample_kind

    def shard_name(self, index: int) -> str:
        """The file name of shard ``index``: ``shard-00000<suffix>``, zero-padded so names sort as numbers."""
        return f"shard-{index:05d}{self.suffix}"

    def check_keys(self, keys: Sequence[str], where: str = "") -> None:
        """Refuse keys the format cannot store, all at once (``spec.named_keys``); others store any key."""

    def disk_bytes(self, inputs: SizeInputs) -> tuple[np.ndarray, int]:
        """``(per_sample, fixed)``: an int64 array with each sample's bytes in a shard file (headers,
        framing, padding, per-sample metadata included) and the bytes every shard file has whatever
        it holds (end blocks, file headers). A shard of samples ``S`` then takes ``fixed +
        per_sample[S].sum()`` bytes: exactly for tar and record when files pass through unchanged,
        within a fraction of a percent for hdf5 and zarr."""
        raise self._read_only()

    def open_writer(self, path: str, *, shard_name: str, classes: Sequence[str], **options: Any) -> ShardWriter:
        """A writer of one shard at ``path``; options a format does not know are ignored."""
        writer = type(self).writer
        if writer is None:
            raise self._read_only()
        return writer(path, shard_name=shard_name, classes=classes, **options)

    def open_reader(self, path: str, info: ShardInfo, manifest: Manifest) -> ShardReader:
        return type(self).reader(path, info, manifest)

    def warm_readers(self, paths: Sequence[str]) -> None:
        """Load in this process what readers of the local shard files ``paths`` load on first use
        (a compressor's module), so that worker processes forked afterwards inherit it instead of each
        loading it before its first sample. Best effort and cheap (a few small reads); a shard that
        cannot be read is left to the reader that opens it, which reports it. Default: nothing."""

    def _read_only(self) -> UsageError:
        return UsageError(f"stager does not write {self.spec.what}; `stager index` adopts it in place, and `stager "
                          f"pack` converts it to {', '.join(FORMAT_NAMES[:-1])} or {FORMAT_NAMES[-1]}")


def field_payload(spec: FieldSpec, value: Any) -> bytes:
    """The bytes a file-per-field container (tar, hdf5 byte datasets) stores for ``value``: byte kinds
    as they are, the ragged kinds (arrays) as compact JSON lists (what webdataset's ``.json`` decoder
    reads back)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if spec.ragged:
        arr = np.asarray(value)
        rows = arr.tolist()
        return json.dumps(rows, separators=(",", ":")).encode()
    raise UsageError(f"field {spec.name!r}: expected encoded bytes, got {type(value).__name__}")


_MAGIC = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG\r\n\x1a\n", "png"), (b"GIF87a", "gif"), (b"GIF89a", "gif"),
          (b"II*\x00", "tiff"), (b"MM\x00*", "tiff"), (b"BM", "bmp"))


def image_ext(data: bytes | memoryview) -> str:
    """The image type of encoded bytes from their magic number (``jpg``, ``png``, ...), else ``bin``:
    for payloads whose container does not name their type (adopted TFRecord/parquet files)."""
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _MAGIC if head.startswith(magic)), "bin")


def pread_runs(fd: int, offsets: np.ndarray, sizes: np.ndarray, max_gap: int = 1 << 20) -> list[bytes]:
    """Read payloads at ``offsets``/``sizes`` from ``fd``, coalescing nearby ones into single reads.

    Payloads whose gap to the previous one is below ``max_gap`` bytes are fetched in one ``pread``
    and sliced (zero-copy ``memoryview`` slices turned into ``bytes`` once). Order is preserved.
    """
    out: list[bytes] = [b""] * len(offsets)
    if len(offsets) == 0:
        return out
    order = np.argsort(offsets, kind="stable")
    i = 0
    n = len(order)
    while i < n:
        j = i
        start = int(offsets[order[i]])
        end = start + int(sizes[order[i]])
        while j + 1 < n and int(offsets[order[j + 1]]) - end <= max_gap:
            j += 1
            end = max(end, int(offsets[order[j]]) + int(sizes[order[j]]))
        buf = os.pread(fd, end - start, start)
        if len(buf) < end - start:
            raise EOFError(f"short read: wanted {end - start} bytes at {start}, got {len(buf)}")
        view = memoryview(buf)
        for k in range(i, j + 1):
            o = int(offsets[order[k]]) - start
            out[order[k]] = bytes(view[o : o + int(sizes[order[k]])])
        i = j + 1
    return out


def indexed_samples(reader: Any, what: str) -> Iterator[Sample]:
    """``iter_samples`` of a reader whose samples are known only through their manifest entry (an adopted
    container: parquet, RecordIO, LMDB): keys and labels from the index, payloads by ``reader.read``
    256 at a time. A decoded payload (an array) is yielded as it is, an encoded one as bytes."""
    info = reader.info
    if info is None:
        raise UsageError(f"{reader.path}: {what} files are read through their manifest entry")
    for a in range(0, info.samples, 256):
        pos = np.arange(a, min(a + 256, info.samples))
        for j, data in zip(pos.tolist(), reader.read(pos), strict=True):
            if isinstance(data, np.ndarray):
                yield Sample(info.keys[j], int(info.labels[j]), data, "png")
            else:
                b = bytes(data)
                yield Sample(info.keys[j], int(info.labels[j]), b, image_ext(b))


class ExtentReader:
    """Shared plumbing of readers whose payloads sit at the manifest's byte extents (tar, record, hdf5).

    ``read(positions)`` fetches payloads with :func:`pread_runs` through one descriptor per process
    (reopened after ``fork()``, so a reader inherited by a DataLoader worker never closes its
    parent's descriptor). Subclasses add ``iter_samples`` (their own container parser).
    """

    def __init__(self, path: str, info: ShardInfo | None = None, manifest: Manifest | None = None) -> None:
        self.path = path
        self.info = info
        self._fd: int | None = None
        self._pid = 0

    def fd(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise ShardMissingError(
                    f"{self.path}: shard missing; re-stage the dataset or re-run `stager pack`"
                ) from exc
            self._pid = os.getpid()
        return self._fd

    @contextlib.contextmanager
    def scanned(self) -> Iterator[tuple[BinaryIO, int]]:
        """``(file, size)``: the shard opened for a sequential parse (a 1 MiB buffer), closed on exit
        (an ``iter_samples``); :class:`ShardMissingError` when it is absent."""
        try:
            f = open(self.path, "rb", buffering=1 << 20)  # noqa: SIM115 - closed by the with below
        except FileNotFoundError as exc:
            raise ShardMissingError(
                f"{self.path}: shard missing; re-stage the dataset or re-run `stager pack`"
            ) from exc
        with f:
            yield f, os.fstat(f.fileno()).st_size

    def read(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        """Payloads of in-shard ``positions`` (manifest order), in the order given."""
        if self.info is None:
            raise UsageError(f"{self.path}: read() needs the shard's manifest entry")
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if len(pos) and (pos.min() < 0 or pos.max() >= self.info.samples):
            raise UsageError(f"{self.path}: sample positions must be in 0..{self.info.samples - 1}")
        try:
            return pread_runs(self.fd(), self.info.offsets[pos], self.info.sizes[pos])
        except EOFError as exc:
            raise CorruptSampleError(f"{self.path}: {exc}; the shard is truncated: re-stage or re-pack it") from exc

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __enter__(self) -> ExtentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


BY_REFERENCE = 8 << 10  # payloads from this size on are queued as they are, not copied into the buffer
_IOV_MAX = 1024  # the iovecs of one writev (POSIX's minimum IOV_MAX is 16; Linux and macOS: 1024)


def write_parts(fd: int, parts: Sequence[bytes | bytearray | memoryview], offset: int | None = None) -> int:
    """Write ``parts`` (bytes-like, in order) to ``fd`` with ``writev`` (at ``offset`` with ``pwritev``),
    up to :data:`_IOV_MAX` at a time, so that large payloads reach the kernel without being joined
    first (one copy of the bytes less); return the byte count. A short write is continued; an error
    (a full disk) raises :class:`OSError`."""
    todo = [p for p in parts if len(p)]  # an empty part would make a write of nothing look stuck
    total = 0
    while todo:
        batch = todo[:_IOV_MAX]
        n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + total)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        total += n
        done = 0
        for p in batch:  # drop what went out; keep the rest of a part written in part
            size = memoryview(p).nbytes
            if n < size:
                todo[done] = memoryview(p).cast("B")[n:]
                break
            n -= size
            done += 1
        del todo[:done]
    return total


class PlacedAsWritten:
    """The :class:`ShardWriter` answers of a writer whose ``write`` extents are final byte ranges (every
    format but squashfs): ``extents`` is ``"bytes"``, ``final_offset`` the identity."""

    @property
    def extents(self) -> str:
        return "bytes"

    def final_offset(self, offset: int) -> int:
        return offset


class BufferedShardFile(PlacedAsWritten):
    """Shared plumbing of writers that stream one shard file sequentially (tar, record).

    Bytes accumulate in ``self._buf`` and reach the file in ``flush_bytes`` chunks (a few syscalls
    per MB, not several per sample); a payload of :data:`BY_REFERENCE` bytes or more is queued as it
    is (:meth:`_put`) and written with the buffers around it by one ``writev``, so it is never
    copied in user space. Every byte is fed once to ``hasher`` (so pack hashes while writing, no
    re-read) and, with ``writeback``, the kernel starts writing each chunk at once so the final
    fsync is short. ``bytes_written`` counts queued bytes too, so it is the offset of the next
    byte: what writers return in :class:`Extent` (``self._written + len(self._buf)``). With ``path``
    None the bytes are built in memory and never flushed: the caller takes them with :meth:`take`
    (a fragment of a shard). Unknown ``options`` are ignored, so that one option set can be passed
    to every format.
    """

    def __init__(
        self, path: str | None, *, shard_name: str, classes: Sequence[str], flush_bytes: int = FLUSH_BYTES,
        fsync: bool = False, hasher: Any = None, writeback: bool = False, **options: Any,
    ) -> None:
        self.path = path or ""
        self.shard_name = shard_name
        self.classes = list(classes)
        self._flush_bytes = flush_bytes if path is not None else 1 << 62
        self._fsync = fsync
        self._hasher = hasher
        self._writeback = writeback
        # Closed in _finish()/abort().
        self._f: BinaryIO | None = None if path is None else open(path, "wb", buffering=0)  # noqa: SIM115
        self._open = True
        self._buf = bytearray()
        self._parts: list[bytes | bytearray] = []  # queued before _buf, in file order
        self._parted = 0  # bytes in _parts
        self._written = 0  # bytes before _buf: handed to the OS or queued in _parts
        self._flushed = 0  # bytes handed to the OS

    @property
    def field_bases(self) -> Mapping[str, int]:
        """Field extents are final as written: nothing to add."""
        return _NO_FIELD_BASES

    @property
    def closed(self) -> bool:
        return not self._open

    def _check_open(self) -> None:
        if not self._open:
            raise UsageError(f"{self.shard_name}: write() after close()")

    def _put(self, data: bytes) -> None:
        """Queue ``data`` (immutable) after the buffer without copying it; ``self._buf`` is a new,
        empty buffer afterwards (a writer holding the old one must take it again)."""
        buf = self._buf
        if buf:
            self._parts.append(buf)
            self._buf = bytearray()
        self._parts.append(data)
        n = len(buf) + len(data)
        self._parted += n
        self._written += n

    def _pending(self) -> int:
        """Bytes queued or buffered, not yet handed to the OS."""
        return self._parted + len(self._buf)

    def _take_parts(self) -> list[bytes | bytearray]:
        parts = self._parts
        if self._buf:
            parts.append(self._buf)
            self._written += len(self._buf)
        self._parts, self._buf, self._parted = [], bytearray(), 0
        return parts

    def _flush(self) -> None:
        assert self._f is not None
        parts = self._take_parts()
        if self._hasher is not None:
            for p in parts:
                self._hasher.update(p)
        n = write_parts(self._f.fileno(), parts)
        if self._writeback:
            start_writeback(self._f.fileno(), self._flushed, n)
        self._flushed += n

    def _finish(self) -> None:
        """Flush what is buffered, fsync if asked, close the file."""
        assert self._f is not None
        self._flush()
        if self._fsync:
            os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        self._open = False

    def take(self) -> list[bytes | bytearray]:
        """The bytes built in memory (``path`` None), as parts in order; the writer is finished afterwards."""
        self._open = False
        return self._take_parts()

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._open = False
        self._buf = bytearray()
        self._parts, self._parted = [], 0

    @property
    def bytes_written(self) -> int:
        """Bytes of the shard so far (including buffered ones)."""
        return self._written + len(self._buf)

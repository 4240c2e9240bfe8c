"""Writing one planned shard: samples in, a renamed, fsynced shard and its done-record out.

The layer both the pack driver (:mod:`stager.pack.api`) and the pack workers
(:mod:`stager.pack.workers`) build on. :func:`write_shard` writes ``<name>.<uuid>.partial`` with
one format writer, hashes it (while writing for formats that can, else by reading it back), fsyncs
it and renames it together with its companion files, companions first; :func:`record_done` then
publishes its done-record (:mod:`stager.pack.state`: its rows, skipped samples and plan
fingerprint; atomic but not fsynced: a hint a rerun verifies). Nothing is ever left under a final
name unfinished. A shard's bytes depend only on its planned samples and the options, so the output
does not depend on which process writes it or on how the workers cut it into segments.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import numpy as np

from stager.checksum import new_hasher
from stager.errors import SourceError, StagerError, translated
from stager.formats import get_format
from stager.formats.base import FragmentsDone, Sample
from stager.fs.atomic import partial_path, space_error
from stager.manifest import AuxFile, ShardInfo, Strings
from stager.manifest.fields import FieldSpec, build_field_columns, offset_column, size_column, values_column
from stager.pack.fields import prepare_fields
from stager.pack.read_order import PATH_SOURCES, load_batch, load_batches
from stager.pack.sources.checks import check_encoded, prepare_sample
from stager.pack.state import ShardDone, Uploader, done_record_path, write_hint

if TYPE_CHECKING:
    from stager.formats.base import Extent, Format
    from stager.pack.options import PackOptions
    from stager.pack.plan import PlannedShard
    from stager.pack.sources.base import SampleRef, Source
    from stager.progress import Progress



class SampleSink(Protocol):
    """Where :func:`write_samples` puts samples: a format's shard writer or a fragment writer."""

    def write(self, sample: Sample) -> Extent: ...


class FragmentWriter(SampleSink, Protocol):
    def take(self) -> list[bytes | bytearray]:
        """The fragment's bytes, as parts in order (large payloads uncopied); the writer is finished afterwards."""
        ...

    def extra(self) -> Any:
        """What the format's ``finish_fragments`` needs of this fragment's samples besides their rows."""
        ...


class FragmentFormat(Protocol):
    """A format whose shards the workers write in parallel segments (tar, hdf5): a shard is its
    segments' fragments, each built in memory without knowing its offset, written one after the
    other from ``fragment_base()``, then finished by ``finish_fragments`` (tar's end marker, HDF5's
    metadata), which may also write companion files."""

    def fragment_base(self) -> int: ...

    def open_fragment(self, *, shard_name: str, classes: Sequence[str], **options: Any) -> FragmentWriter: ...

    def finish_fragments(self, path: str, end: int, done: FragmentsDone) -> list[tuple[str, str]]: ...


def fragmentable(fmt: Format, fields: Sequence[FieldSpec] = ()) -> TypeGuard[FragmentFormat]:
    """Whether ``fmt`` shards of samples with ``fields`` can be written in parallel segments (its
    entry's ``fragments``; with fields only where they ``span``: a separate field's data is laid out
    at the end)."""
    return fmt.spec.fragments and (not fields or fmt.spec.fields == "span")


@dataclass(frozen=True)
class ShardJob:
    """Everything one process needs to write one planned shard (picklable)."""

    out: str
    shard: PlannedShard
    options: PackOptions  # the writer reads format, resize, quality, on_error and hash_algo
    classes: tuple[str, ...]
    target_kind: str  # "encoded" | "decoded": what the format stores
    image_shape: tuple[int, int, int] | None  # the fixed (H, W, 3) of a decoded format
    keys_checked: bool = False  # the plan's keys passed the format's check_keys (writers skip it)
    remote: Uploader | None = None  # OUT is a URL: ``out`` is the local spool, each shard goes up when done
    fields: tuple[FieldSpec, ...] = ()  # the source's field schema (empty: image + label samples)


def fsync_and_hash(path: str | os.PathLike[str], algo: str) -> tuple[int, str]:
    """Hash a just-written file and fsync it through the same descriptor: ``(bytes, hex digest)``.

    The file is hashed through a read-only memory map (no copy out of the page cache: ~3 ms for
    85 MB against ~6-13 ms with ``read``), or read in 8 MB chunks where it cannot be mapped.
    """
    h = new_hasher(algo)
    fd = os.open(path, os.O_RDONLY)
    try:
        total = os.fstat(fd).st_size
        try:
            if total:
                with mmap.mmap(fd, total, access=mmap.ACCESS_READ) as mm:
                    mm.madvise(mmap.MADV_SEQUENTIAL)
                    with memoryview(mm) as v:
                        h.update(v)
        except (OSError, ValueError, AttributeError):  # not mappable here: read it
            h = new_hasher(algo)
            total = 0
            buf = bytearray(8 << 20)
            view = memoryview(buf)
            while n := os.preadv(fd, [buf], total):
                h.update(view[:n])
                total += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return total, h.hexdigest()


def write_shard(job: ShardJob, source: Source, progress: Progress | None = None, *,
                ready: Callable[[], None] | None = None) -> ShardDone:
    """Write ``job.shard`` from ``source`` into ``job.out`` atomically; return its ShardInfo.

    Per-sample source failures raise :class:`SourceError` (``on_error="raise"``) or are skipped and
    listed (``"skip"``). Disk-full errors become :class:`OutOfSpaceError`. Nothing is left under a
    final name on failure: the writer's ``.partial`` files are removed.

    Formats that hash while writing (``spec.hashes_while_writing``: tar, record) are handed the hasher, so
    the shard is not read back: it is only fsynced before the rename. ``ready()``, when given, is
    waited for before the rename (the run's ``plan.json`` must be durable first).
    """
    opts = job.options
    fmt = get_format(opts.format)
    out = Path(job.out)
    sh = job.shard
    final = out / sh.name
    tmp = partial_path(final)
    rows = SampleRows()
    companions: list[tuple[str, str]] = []
    writer = None
    hasher = new_hasher(opts.hash_algo) if fmt.spec.hashes_while_writing else None
    try:
        writer = fmt.open_writer(
            str(tmp),
            shard_name=sh.name,
            classes=list(job.classes),
            keys_checked=job.keys_checked,
            hasher=hasher,
            writeback=True,
            fields=job.fields,
            json_member=opts.tar_json,
            compression=opts.compression,
        )
        write_samples(writer, sh.refs, source, job, rows, progress=progress)
        companions = writer.close()
        rows.rebase_fields(writer.field_bases)  # hdf5: field data placed at close()
        rows.extents = writer.extents
        if rows.extents != "bytes":  # squashfs: compressed files are found by inodes, known at close()
            rows.offsets = [writer.final_offset(o) for o in rows.offsets]
        writer = None
        aux = []
        for cname, ctmp in companions:
            cbytes, chash = fsync_and_hash(ctmp, opts.hash_algo)
            aux.append(AuxFile(cname, cbytes, chash))
        if hasher is not None:
            nbytes_total = fsync_file(tmp)
            digest = hasher.hexdigest()
        else:
            nbytes_total, digest = fsync_and_hash(tmp, opts.hash_algo)
        # Companions first: a shard under its final name always has its companions beside it. The
        # data are fsynced; the renames become durable with the directory fsync that publishes the
        # manifest (a crash before it loses at most renames, and a rerun rewrites those shards).
        if ready is not None:
            ready()
        for cname, ctmp in companions:
            os.replace(ctmp, out / cname)
        os.replace(tmp, final)
    except BaseException as exc:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.abort()
        tmp.unlink(missing_ok=True)
        for _, ctmp in companions:
            Path(ctmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, StagerError):
            err = space_error(exc, final)
            if err is not None:
                raise err from exc
        raise
    return finish_done(job, [c for c, _ in companions], rows, nbytes=nbytes_total, digest=digest, aux=aux)


def finish_done(job: ShardJob, companions: list[str], rows: SampleRows, *, nbytes: int, digest: str,
                aux: list[AuxFile]) -> ShardDone:
    """After a shard's rename: upload it (companions first) when OUT is a URL, then its done-record."""
    etags = job.remote.upload_files(job.out, [*companions, job.shard.name]) if job.remote is not None else {}
    done = record_done(Path(job.out), job.shard, rows, nbytes=nbytes, digest=digest, aux=aux, fields=job.fields)
    if job.remote is not None:
        job.remote.record_done(done, etags)
    return done


@dataclass
class SampleRows:
    """The index rows of the samples written so far (manifest order), and those skipped."""

    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    payload: int = 0  # bytes of the samples written (for throughput)
    # Extra per-sample columns of fields (stager.manifest.fields): offsets/sizes lists, or arrays per row.
    columns: dict[str, list[Any]] = field(default_factory=dict)
    extents: str = "bytes"  # the shard's extents kind, as its writer says after close()

    def extend(self, other: SampleRows, base: int) -> None:
        """Append ``other``'s rows, whose offsets are relative to ``base``."""
        self.keys += other.keys
        self.labels += other.labels
        self.offsets += [o + base for o in other.offsets]
        self.sizes += other.sizes
        self.skipped += other.skipped
        self.payload += other.payload
        for name, vals in other.columns.items():
            shift = base if name.endswith("/offset") else 0
            self.columns.setdefault(name, []).extend([v + shift for v in vals] if shift else vals)

    def add_fields(self, specs: Sequence[FieldSpec], sample: Sample, extent: Extent) -> None:
        """Append one sample's field columns: byte fields' extents, ragged fields' values."""
        cols, ext = self.columns, extent.fields or {}
        for s in specs:
            if s.ragged:
                cols.setdefault(values_column(s.name), []).append(sample.fields[s.name])
            else:
                off, size = ext[s.name]
                cols.setdefault(offset_column(s.name), []).append(off)
                cols.setdefault(size_column(s.name), []).append(size)

    def rebase_fields(self, bases: Mapping[str, int]) -> None:
        """Make byte fields' offsets absolute: ``bases[name]`` is where the writer put the field's data."""
        for name, base in bases.items():
            col = self.columns.get(offset_column(name))
            if col is not None:
                self.columns[offset_column(name)] = [o + base for o in col]

    def built_columns(self, specs: Sequence[FieldSpec]) -> dict[str, Any]:
        """The field columns as index columns (int64 arrays, :class:`Ragged`), one row per sample."""
        return build_field_columns(specs, self.columns)


def record_done(
    out: Path, sh: PlannedShard, rows: SampleRows, *, nbytes: int, digest: str, aux: list[AuxFile],
    fields: Sequence[FieldSpec] = (),
) -> ShardDone:
    """The finished shard's :class:`ShardDone`, also written as its done-record (for resume)."""
    info = ShardInfo(
        sh.name,
        nbytes,
        digest,
        Strings.from_strings(rows.keys),  # compact: the driver holds every shard's rows until it publishes
        np.asarray(rows.labels, dtype=np.int64),
        np.asarray(rows.offsets, dtype=np.int64),
        np.asarray(rows.sizes, dtype=np.int64),
        aux,
        rows.extents,
        columns=rows.built_columns(fields) if fields else None,
    )
    done = ShardDone(info, rows.skipped, rows.payload, sh.fingerprint)
    write_hint(done_record_path(out, sh.name), done.to_bytes())
    return done


def write_samples(
    writer: SampleSink,
    refs: Sequence[SampleRef],
    source: Source,
    job: ShardJob,
    rows: SampleRows,
    *,
    progress: Progress | None,
) -> None:
    """Load, check/re-encode and write ``refs`` in order with ``writer``, appending to ``rows``.

    Per-sample source failures raise :class:`SourceError` (``on_error="raise"``) or are recorded in
    ``rows.skipped``.
    """
    # Encoded files that pass through unchanged need only the cheap structure check: done inline (the
    # loop below costs ~1 us a sample: it is most of what pack adds to reading and writing bytes).
    fast = job.options.passes_through(job.target_kind) and not job.fields
    for batch, loaded in _batches(source, refs):  # read in file-system order, written in plan order (read_order.py)
        before, payload = len(rows.keys), rows.payload
        if fast:
            _write_passthrough(writer, batch, loaded, source, job=job, rows=rows)
        else:
            for ref, res in zip(batch, loaded, strict=True):
                _write_one(writer, ref, res, source, job=job, rows=rows)
        if progress is not None:
            progress.update(len(rows.keys) - before, rows.payload - payload)


def _batches(source: Source, refs: Sequence[SampleRef]) -> Iterator[tuple[Sequence[SampleRef],
                                                                         list[Sample | BaseException]]]:
    """:func:`load_batch` of each batch in turn. A tree of files (``PATH_SOURCES``: reads only, no reader
    state) has its next batch read on a thread while the caller writes this one, so reading the
    source and writing the shard overlap (one batch ahead: at most two batches in memory)."""
    cuts = list(load_batches(refs))
    if source.kind not in PATH_SOURCES or len(cuts) < 2:
        for a, b in cuts:
            yield load_batch(source, refs, a, b)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="pack-read") as pool:
        ahead = pool.submit(load_batch, source, refs, *cuts[0])
        for k in range(len(cuts)):
            got = ahead.result()
            if k + 1 < len(cuts):
                ahead = pool.submit(load_batch, source, refs, *cuts[k + 1])
            yield got


def _write_passthrough(writer: SampleSink, batch: Sequence[SampleRef], loaded: list[Sample | BaseException],
                       source: Source, *, job: ShardJob, rows: SampleRows) -> None:
    """:func:`_write_one` for encoded files written unchanged, without fields: the same results."""
    write = writer.write
    keys, labels, offsets, sizes = rows.keys, rows.labels, rows.offsets, rows.sizes
    nbytes = 0
    for i, res in enumerate(loaded):
        if type(res) is not Sample or type(res.data) is not bytes:  # an error, or another payload
            _write_one(writer, batch[i], res, source, job=job, rows=rows)
            continue
        data = res.data
        try:
            ext = check_encoded(data, "")
        except SourceError:
            _write_one(writer, batch[i], res, source, job=job, rows=rows)  # raises or skips, naming the file
            continue
        if ext != res.ext:
            res = Sample(res.key, res.label, data, ext, res.meta, res.fields)
        offset, size, _ = write(res)
        keys.append(res.key)
        labels.append(res.label)
        offsets.append(offset)
        sizes.append(size)
        nbytes += len(data)
    rows.payload += nbytes


def _write_one(writer: SampleSink, ref: SampleRef, res: Sample | BaseException, source: Source, *, job: ShardJob,
               rows: SampleRows) -> None:
    """Check or re-encode one loaded sample and write it, appending its row; or raise or skip (``on_error``)."""
    opts = job.options
    specs = job.fields
    try:
        if isinstance(res, BaseException):
            raise _as_source_error(res, source.path_of(ref))
        if specs:
            res = prepare_fields(res, specs, source.where_of(ref), opts.resize)
        data = res.data
        if opts.passes_through(job.target_kind) and type(data) is bytes:
            try:
                ext = check_encoded(data, "")
            except SourceError:
                check_encoded(data, source.path_of(ref))  # raises, naming the file
                raise
            sample = res if ext == res.ext else Sample(res.key, res.label, data, ext, res.meta, res.fields)
        else:
            sample = prepare_sample(
                res,
                target_kind=job.target_kind,
                where=source.path_of(ref),
                resize=opts.resize,
                quality=opts.quality,
                image_shape=job.image_shape,
            )
    except SourceError as exc:
        if opts.on_error != "skip":
            raise
        rows.skipped.append({"key": ref.key, "path": source.path_of(ref), "error": str(exc), "shard": job.shard.name})
        return
    ext_ = writer.write(sample)
    if specs:
        rows.add_fields(specs, sample, ext_)
    rows.keys.append(sample.key)
    rows.labels.append(sample.label)
    rows.offsets.append(ext_.offset)
    rows.sizes.append(ext_.size)
    d = sample.data
    rows.payload += d.nbytes if isinstance(d, np.ndarray) else len(d)


def fsync_file(path: str | os.PathLike[str]) -> int:
    """fsync the file at ``path``; return its size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _as_source_error(exc: BaseException, where: str) -> SourceError:
    if isinstance(exc, SourceError):
        return exc
    if isinstance(exc, OSError):
        err = translated(exc, f"{where}: cannot read ({exc.strerror or exc}); fix it or use --on-error skip",
                         SourceError)
        return err if isinstance(err, SourceError) else SourceError(str(err))  # skippable, whatever the errno
    return SourceError(f"{where}: {exc}")

"""``stager pack``: turn a source (ImageFolder, CIFAR batches, list file, another pack) into shards.

Three steps, each with one job:

1. **Plan** (:func:`plan_shards`, pure): order the source's samples (a seeded permutation from
   ``numpy.random.default_rng((seed, PLAN_STREAM))`` unless ``keep_order``) and cut them into
   shards by ``samples_per_shard`` and/or ``shard_size`` bytes (estimated from source sizes; a shard
   ends when it would exceed either limit). Each shard gets a fingerprint over its samples' keys,
   labels, source sizes and mtimes and the output-affecting options; the plan fingerprint covers
   them all.
2. **Write** (:func:`write_shard`, or :mod:`stager.pack_workers` with ``workers > 1``: tar shards
   in parallel segments, other formats one process per shard): each shard is written as
   ``<name>.<uuid>.partial``, hashed, fsynced, then renamed with its companion files; a done-record
   ``.stager-pack/<name>.json`` (its ShardInfo and fingerprint; a hint, not fsynced) is written
   atomically after the rename. Because a shard's bytes depend only on its planned samples, the
   output is byte-identical whatever ``workers`` is.
3. **Publish**: ``manifest.json`` is written last, atomically (its directory fsync also makes the
   shard renames durable), and the state directory removed.

Resume: a rerun with the same plan (after kill -9, a full disk, ...) keeps every shard whose
done-record fingerprint matches the plan and whose size and hash still match, and rewrites the
rest; stale ``*.partial`` files are removed. A completed pack rerun with the same plan is left
untouched (its shards are re-hashed).
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from stager.checksum import ALGOS, new_hasher
from stager.errors import DestinationError, ManifestError, SourceError, StagerError, UsageError
from stager.formats import get_format
from stager.formats.base import Sample
from stager.fs.atomic import atomic_write_bytes, fsync_dir, partial_path, remove_stale_partials, space_error
from stager.manifest import MANIFEST_NAME, AuxFile, Manifest, ShardInfo, load_manifest
from stager.pack.sources import SampleRef, Source, check_encoded, open_source, prepare_sample, probe_hw
from stager.progress import Progress

PLAN_STREAM = 0x5EED_9AC4  # second element of the shuffle seed tuple: the "plan" random stream
STATE_DIR = ".stager-pack"
PLAN_SCHEMA = "stager.pack-plan/1"
LOAD_BATCH = 64  # samples materialised per source call (lets pack sources coalesce reads)
ON_ERROR = ("raise", "skip")


# ---- plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedShard:
    index: int
    name: str
    refs: tuple[SampleRef, ...]
    est_bytes: int
    fingerprint: str


@dataclass
class Plan:
    """The shards to write: a pure function of the source listing and the options."""

    format: str
    shards: list[PlannedShard]
    fingerprint: str
    options: dict[str, Any]

    @property
    def samples(self) -> int:
        return sum(len(s.refs) for s in self.shards)

    @property
    def est_bytes(self) -> int:
        return sum(s.est_bytes for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "shards": len(self.shards),
            "samples": self.samples,
            "est_bytes": self.est_bytes,
            "plan": self.fingerprint,
            "shard_table": [{"name": s.name, "samples": len(s.refs), "est_bytes": s.est_bytes} for s in self.shards],
        }


def plan_order(n: int, *, seed: int = 0, keep_order: bool = False) -> np.ndarray:
    """int64 permutation of ``range(n)``: identity with ``keep_order``, else seeded shuffle."""
    if keep_order:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng((seed, PLAN_STREAM)).permutation(n).astype(np.int64)


def cut_shards(sizes: np.ndarray, *, samples_per_shard: int | None, shard_size: int | None) -> list[tuple[int, int]]:
    """Split a sequence with per-item ``sizes`` into ``[start, stop)`` runs.

    A run ends before the item that would make it exceed ``samples_per_shard`` items or
    ``shard_size`` bytes; every run holds at least one item (an oversized item is a shard alone).
    """
    runs: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, sz in enumerate(sizes.tolist()):
        n = i - start
        if n and (
            (samples_per_shard is not None and n >= samples_per_shard)
            or (shard_size is not None and acc + sz > shard_size)
        ):
            runs.append((start, i))
            start, acc = i, 0
        acc += sz
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def _digest(obj: Any) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def plan_shards(
    refs: Sequence[SampleRef],
    fmt_name: str,
    shard_name: Any,
    *,
    classes: Sequence[str],
    options: dict[str, Any],
    samples_per_shard: int | None,
    shard_size: int | None,
    seed: int,
    keep_order: bool,
) -> Plan:
    """Order and cut ``refs`` into shards named ``shard_name(i)``; see the module docstring.

    ``options`` are the output-affecting options (format, resize, quality, hash, ...); they enter
    every shard fingerprint, so changing any of them invalidates all completed shards.
    """
    order = plan_order(len(refs), seed=seed, keep_order=keep_order)
    ordered = [refs[i] for i in order.tolist()]
    # Columns of the ordered refs, transposed at C speed (SampleRef is a tuple); the fingerprints
    # hash them per shard as whole columns rather than one formatted line per sample.
    keys, labels, _, sizes_t, mtimes = zip(*ordered, strict=True) if ordered else ((),) * 5
    sizes = np.asarray(sizes_t, dtype=np.int64)
    labels_a = np.asarray(labels, dtype=np.int64)
    mtimes_a = np.asarray(mtimes, dtype=np.int64)
    base = _digest({"format": fmt_name, "classes": list(classes), "options": options})
    shards = []
    for idx, (a, b) in enumerate(cut_shards(sizes, samples_per_shard=samples_per_shard, shard_size=shard_size)):
        name = shard_name(idx)
        h = xxhash.xxh3_128()
        h.update(f"{base}\0{idx}\0{name}\0{b - a}\0".encode())
        h.update(json.dumps(keys[a:b]).encode())
        for col in (labels_a, sizes, mtimes_a):
            h.update(col[a:b].tobytes())
        shards.append(PlannedShard(idx, name, tuple(ordered[a:b]), int(sizes[a:b].sum()), h.hexdigest()))
    fp = _digest({"base": base, "shards": [s.fingerprint for s in shards]})
    return Plan(fmt_name, shards, fp, options)


# ---- writing one shard -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardJob:
    """Everything one process needs to write one planned shard (picklable)."""

    out: str
    format: str
    shard: PlannedShard
    classes: tuple[str, ...]
    target_kind: str
    image_shape: tuple[int, int, int] | None
    resize: tuple[int, int] | None
    quality: int | None
    on_error: str
    hash_algo: str
    keys_checked: bool = False  # the plan's keys passed the format's check_keys (writers skip it)


@dataclass
class ShardDone:
    info: ShardInfo
    skipped: list[dict[str, str]]
    payload_bytes: int  # bytes of the samples written (for throughput)
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "info": self.info.to_json(), "skipped": self.skipped}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardDone:
        info = _info_from_json(d["info"])
        return cls(info, list(d.get("skipped", [])), 0, str(d["fingerprint"]))


def _info_from_json(j: dict[str, Any]) -> ShardInfo:
    idx = j["index"]
    return ShardInfo(
        str(j["name"]),
        int(j["bytes"]),
        str(j["hash"]),
        [str(k) for k in idx["keys"]],
        np.asarray(idx["labels"], dtype=np.int64),
        np.asarray(idx["offsets"], dtype=np.int64),
        np.asarray(idx["sizes"], dtype=np.int64),
        [AuxFile(str(a["name"]), int(a["bytes"]), str(a["hash"])) for a in j.get("aux", [])],
    )


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


def _unlink(p: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)


def write_shard(job: ShardJob, source: Source, progress: Progress | None = None) -> ShardDone:
    """Write ``job.shard`` from ``source`` into ``job.out`` atomically; return its ShardInfo.

    Per-sample source failures raise :class:`SourceError` (``on_error="raise"``) or are skipped and
    listed (``"skip"``). Disk-full errors become :class:`OutOfSpaceError`. Nothing is left under a
    final name on failure: the writer's ``.partial`` files are removed.

    Formats that hash while writing (``Format.hashes_while_writing``, tar) are handed the hasher, so
    the shard is not read back: it is only fsynced before the rename.
    """
    fmt = get_format(job.format)
    out = Path(job.out)
    sh = job.shard
    final = out / sh.name
    tmp = partial_path(final)
    rows = SampleRows()
    companions: list[tuple[str, str]] = []
    writer = None
    hasher = new_hasher(job.hash_algo) if getattr(fmt, "hashes_while_writing", False) else None
    try:
        writer = fmt.open_writer(
            str(tmp),
            shard_name=sh.name,
            classes=list(job.classes),
            keys_checked=job.keys_checked,
            hasher=hasher,
            writeback=True,
        )
        write_samples(writer, sh.refs, source, job, rows, progress=progress)
        companions = writer.close()
        writer = None
        aux = []
        for cname, ctmp in companions:
            cbytes, chash = fsync_and_hash(ctmp, job.hash_algo)
            aux.append(AuxFile(cname, cbytes, chash))
        if hasher is not None:
            nbytes_total = fsync_file(tmp)
            digest = hasher.hexdigest()
        else:
            nbytes_total, digest = fsync_and_hash(tmp, job.hash_algo)
        # Companions first: a shard under its final name always has its companions beside it. The
        # data are fsynced; the renames become durable with the directory fsync that publishes the
        # manifest (a crash before it loses at most renames, and a rerun rewrites those shards).
        for cname, ctmp in companions:
            os.replace(ctmp, out / cname)
        os.replace(tmp, final)
    except BaseException as exc:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.abort()
        _unlink(tmp)
        for _, ctmp in companions:
            _unlink(ctmp)
        if isinstance(exc, OSError) and not isinstance(exc, StagerError):
            err = space_error(exc, final)
            if err is not None:
                raise err from exc
        raise
    return record_done(out, sh, rows, nbytes=nbytes_total, digest=digest, aux=aux)


@dataclass
class SampleRows:
    """The index rows of the samples written so far (manifest order), and those skipped."""

    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    payload: int = 0  # bytes of the samples written (for throughput)

    def extend(self, other: SampleRows, base: int) -> None:
        """Append ``other``'s rows, whose offsets are relative to ``base``."""
        self.keys += other.keys
        self.labels += other.labels
        self.offsets += [o + base for o in other.offsets]
        self.sizes += other.sizes
        self.skipped += other.skipped
        self.payload += other.payload


def record_done(
    out: Path, sh: PlannedShard, rows: SampleRows, *, nbytes: int, digest: str, aux: list[AuxFile]
) -> ShardDone:
    """The finished shard's :class:`ShardDone`, also written as its done-record (for resume)."""
    info = ShardInfo(
        sh.name,
        nbytes,
        digest,
        rows.keys,
        np.asarray(rows.labels, dtype=np.int64),
        np.asarray(rows.offsets, dtype=np.int64),
        np.asarray(rows.sizes, dtype=np.int64),
        aux,
    )
    done = ShardDone(info, rows.skipped, rows.payload, sh.fingerprint)
    write_hint(out / STATE_DIR / f"{sh.name}.json", json.dumps(done.to_json()).encode())
    return done


def write_hint(final: Path, data: bytes) -> None:
    """Publish a done-record atomically (partial + rename) but without fsync.

    A done-record is a hint that a rerun verifies (the shard's size and hash must match), so losing
    one in a crash costs a rewrite, never a wrong pack; an fsync per shard would cost more than the
    shard's own.
    """
    tmp = partial_path(final)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, final)
    except OSError as exc:
        _unlink(tmp)
        err = space_error(exc, final)  # a full disk is exit 4 with one line, not a traceback
        if err is not None:
            raise err from exc
        raise
    except BaseException:
        _unlink(tmp)
        raise


def write_samples(
    writer: Any,
    refs: Sequence[SampleRef],
    source: Source,
    job: ShardJob,
    rows: SampleRows,
    *,
    progress: Progress | None,
) -> None:
    """Load, check/re-encode and write ``refs`` in order with ``writer``, appending to ``rows``.

    Per-sample source failures raise :class:`SourceError` (``job.on_error == "raise"``) or are
    recorded in ``rows.skipped``.
    """
    sh_name = job.shard.name
    keys, labels, offsets, sizes = rows.keys, rows.labels, rows.offsets, rows.sizes
    # Encoded files that pass through unchanged need only the cheap structure check: done inline, with
    # the error message (naming the file) built only when the check fails.
    passthrough = job.target_kind == "encoded" and not job.resize and not job.quality
    write = writer.write
    for a in range(0, len(refs), LOAD_BATCH):
        batch = refs[a : a + LOAD_BATCH]
        loaded = source.load_many(batch)
        nbytes = 0
        before = len(keys)
        for ref, res in zip(batch, loaded, strict=True):
            try:
                if isinstance(res, BaseException):
                    raise _as_source_error(res, source.path_of(ref))
                data = res.data
                if passthrough and type(data) is bytes:
                    try:
                        ext = check_encoded(data, "")
                    except SourceError:
                        check_encoded(data, source.path_of(ref))  # raises, naming the file
                        raise
                    sample = res if ext == res.ext else Sample(res.key, res.label, data, ext, res.meta)
                else:
                    sample = prepare_sample(
                        res,
                        target_kind=job.target_kind,
                        where=source.path_of(ref),
                        resize=job.resize,
                        quality=job.quality,
                        image_shape=job.image_shape,
                    )
            except SourceError as exc:
                if job.on_error != "skip":
                    raise
                rows.skipped.append({"key": ref.key, "path": source.path_of(ref), "error": str(exc), "shard": sh_name})
                continue
            ext_ = write(sample)
            keys.append(sample.key)
            labels.append(sample.label)
            offsets.append(ext_.offset)
            sizes.append(ext_.size)
            d = sample.data
            nbytes += d.nbytes if isinstance(d, np.ndarray) else len(d)
        rows.payload += nbytes
        if progress is not None:
            progress.update(len(keys) - before, nbytes)


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
        return SourceError(f"{where}: cannot read ({exc.strerror or exc}); fix it or use --on-error skip")
    return SourceError(f"{where}: {exc}")


# ---- the output directory ------------------------------------------------------------------------


@dataclass
class OutState:
    """What a previous run left in OUT: its manifest, its plan file and its completed shards."""

    manifest: Manifest | None = None
    plan: dict[str, Any] | None = None
    done: dict[str, ShardDone] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  # files a previous pack wrote
    foreign: list[str] = field(default_factory=list)
    damaged_manifest: str | None = None


def survey_out(out: Path, shard_prefix: str) -> OutState:
    """Classify OUT's entries into a previous pack's files and anything else (``foreign``)."""
    st = OutState()
    if not out.exists():
        return st
    if not out.is_dir():
        raise DestinationError(f"{out}: exists and is not a directory; choose a directory for the pack")
    names = sorted(os.listdir(out))
    if MANIFEST_NAME in names:
        try:
            st.manifest = load_manifest(out)
            st.owned.update(n for n, _, _ in st.manifest.files())
        except ManifestError as exc:
            st.damaged_manifest = str(exc)
    state = out / STATE_DIR
    if state.is_dir():
        try:
            st.plan = json.loads((state / "plan.json").read_text())
            st.owned.update(st.plan.get("names", []))
        except (OSError, ValueError):
            st.plan = None
        for p in state.glob("*.json"):
            if p.name == "plan.json":
                continue
            try:
                d = ShardDone.from_json(json.loads(p.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            st.done[d.info.name] = d
            st.owned.add(d.info.name)
            st.owned.update(a.name for a in d.info.aux)
    for n in names:
        if n in (MANIFEST_NAME, STATE_DIR) or n in st.owned or n.endswith(".partial"):
            continue
        if shard_prefix and n.startswith(shard_prefix) and st.plan is not None:
            continue  # a shard renamed before its done-record was written
        st.foreign.append(n)
    return st


def _file_matches(path: Path, nbytes: int, digest: str, algo: str) -> bool:
    try:
        if path.stat().st_size != nbytes:
            return False
        return fsync_and_hash(path, algo) == (nbytes, digest)
    except OSError:
        return False


def _reusable(out: Path, info: ShardInfo, algo: str) -> bool:
    return _file_matches(out / info.name, info.bytes, info.hash, algo) and all(
        _file_matches(out / a.name, a.bytes, a.hash, algo) for a in info.aux
    )


# ---- the entry point ------------------------------------------------------------------------------


@dataclass
class PackResult:
    """Outcome of :func:`pack`; ``manifest`` is None for a dry run."""

    manifest: Manifest | None
    out: str
    seconds: float
    samples: int
    bytes: int
    skipped: list[dict[str, str]]
    shards: int = 0
    reused: int = 0
    dry_run: bool = False
    plan: Plan | None = None
    payload_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        dt = max(self.seconds, 1e-9)
        d: dict[str, Any] = {
            "ok": True,
            "out": self.out,
            "dry_run": self.dry_run,
            "shards": self.shards,
            "samples": self.samples,
            "bytes": self.bytes,
            "skipped": len(self.skipped),
            "skipped_samples": self.skipped,
            "reused_shards": self.reused,
            "seconds": round(self.seconds, 4),
            "samples_per_s": round(self.samples / dt, 1),
            "mb_per_s": round(self.payload_bytes / dt / 1e6, 2),
        }
        if self.manifest is not None:
            d["format"] = self.manifest.format
            d["dataset_id"] = self.manifest.dataset_id
            d["manifest"] = os.path.join(self.out, MANIFEST_NAME)
        if self.plan is not None:
            d["format"] = self.plan.format
            d["plan"] = self.plan.fingerprint
            if self.dry_run:
                d["shard_table"] = self.plan.to_json()["shard_table"]
        return d


def _check_args(
    *,
    format: str,
    samples_per_shard: int | None,
    shard_size: int | None,
    workers: int,
    resize: Any,
    quality: Any,
    on_error: str,
    hash_algo: str,
) -> None:
    if samples_per_shard is not None and samples_per_shard < 1:
        raise UsageError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    if shard_size is not None and shard_size < 1:
        raise UsageError(f"shard_size must be >= 1 byte, got {shard_size}")
    if workers < 1:
        raise UsageError(f"workers must be >= 1, got {workers}")
    if resize is not None and (len(resize) != 2 or min(resize) < 1):
        raise UsageError(f"resize must be (H, W) positive integers, got {resize!r}")
    if quality is not None and not 1 <= quality <= 100:
        raise UsageError(f"quality must be in 1..100, got {quality}")
    if on_error not in ON_ERROR:
        raise UsageError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if hash_algo not in ALGOS:
        raise UsageError(f"unknown hash {hash_algo!r}; expected one of {', '.join(ALGOS)}")


def _prepare_dir(out: Path, plan: Plan, stripe_count: int | None, stripe_size: int | None) -> None:
    try:
        from stager.fs import lustre
    except ImportError:  # stager.lustre lands separately; until then striping is skipped
        return
    lustre.prepare_pack_dir(
        out,
        total_bytes=plan.est_bytes,
        num_shards=len(plan.shards),
        stripe_count=stripe_count,
        stripe_size=stripe_size,
        quiet=True,
    )


def pack(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    format: str = "tar",
    *,
    samples_per_shard: int | None = None,
    shard_size: int | None = 256 << 20,
    workers: int = 1,
    seed: int = 0,
    keep_order: bool = False,
    resize: tuple[int, int] | None = None,
    quality: int | None = None,
    on_error: str = "raise",
    overwrite: bool = False,
    dry_run: bool = False,
    quiet: bool = True,
    hash_algo: str = "xxh3_128",
    stripe_count: int | None = None,
    stripe_size: int | None = None,
    split: str | None = None,
) -> PackResult:
    """Pack ``src`` into ``format`` shards under ``out`` (see the module docstring and docs/pack.md).

    Returns a :class:`PackResult`. Raises :class:`UsageError` (bad options, unknown format),
    :class:`SourceNotFoundError`/:class:`SourceError` (missing, empty or damaged source),
    :class:`DestinationError` (OUT holds something else and ``overwrite`` is false),
    :class:`OutOfSpaceError` (disk full; completed shards are kept for a rerun).
    """
    pool = None
    if workers > 1:
        from stager.pack.workers import PackPool

        pool = PackPool(workers)  # started on first use; reused from listing to writing
    try:
        t0 = time.perf_counter()
        _check_args(
            format=format,
            samples_per_shard=samples_per_shard,
            shard_size=shard_size,
            workers=workers,
            resize=resize,
            quality=quality,
            on_error=on_error,
            hash_algo=hash_algo,
        )
        fmt = get_format(format)
        # With workers, an ImageFolder lists its class folders on the pool (the only source that starts it
        # this early); other sources leave it to start at writing time and so be inherited by fork.
        source = open_source(src, split=split, map_fn=pool.map if pool is not None else None)
        out_p = Path(os.path.abspath(os.fspath(out)))
        if source.kind == "pack" and out_p == source.root:
            raise UsageError(f"{out_p}: output is the source pack itself; choose another directory")
        # Keys are checked once for the whole plan (one pass), so writers need not check each one.
        check_keys = getattr(fmt, "check_keys", None)
        keys_checked = check_keys is not None
        if check_keys is not None:
            check_keys([r.key for r in source.refs], f"{source.root}: ")
        resize_t = (int(resize[0]), int(resize[1])) if resize else None
        target_kind = fmt.sample_kind
        image_shape: tuple[int, int, int] | None = None
        if target_kind == "decoded":
            if resize_t:
                image_shape = (resize_t[0], resize_t[1], 3)
            elif source.image_shape is not None:
                image_shape = source.image_shape
            else:
                h, w = probe_hw(source, source.refs, skip_bad=on_error == "skip")
                image_shape = (h, w, 3)
        options = {
            "resize": list(resize_t) if resize_t else None,
            "quality": quality,
            "hash_algo": hash_algo,
            "image_shape": list(image_shape) if image_shape else None,
        }
        plan = plan_shards(
            source.refs,
            format,
            fmt.shard_name,
            classes=source.classes,
            options=options,
            samples_per_shard=samples_per_shard,
            shard_size=shard_size,
            seed=seed,
            keep_order=keep_order,
        )
        if dry_run:
            return PackResult(
                None,
                str(out_p),
                time.perf_counter() - t0,
                plan.samples,
                plan.est_bytes,
                [],
                len(plan.shards),
                dry_run=True,
                plan=plan,
            )

        st = survey_out(out_p, re.match(r"\D*", fmt.shard_name(0)).group())  # type: ignore[union-attr]
        _check_destination(out_p, st, source, plan, overwrite)
        reuse = _find_reusable(out_p, st, plan, hash_algo)
        manifest_opts = {
            "seed": seed,
            "keep_order": keep_order,
            "samples_per_shard": samples_per_shard,
            "shard_size": shard_size,
            "resize": options["resize"],
            "quality": quality,
            "on_error": on_error,
            "plan": plan.fingerprint,
            # Per-shard fingerprints let a rerun after a source change keep the shards it did not touch.
            "shard_plans": [sh.fingerprint for sh in plan.shards],
        }
        if (
            st.manifest is not None
            and st.manifest.options.get("plan") == plan.fingerprint
            and len(reuse) == len(plan.shards)
        ):
            m = st.manifest  # the identical pack is already complete: leave its shards untouched
            # A run killed between publishing the manifest and removing its state leaves both behind.
            shutil.rmtree(out_p / STATE_DIR, ignore_errors=True)
            remove_stale_partials(out_p)
            return PackResult(
                m,
                str(out_p),
                time.perf_counter() - t0,
                m.num_samples,
                m.num_bytes,
                [],
                len(m.shards),
                reused=len(m.shards),
                plan=plan,
            )

        # From here on OUT changes: the old manifest goes first so it never describes replaced shards.
        out_p.mkdir(parents=True, exist_ok=True)
        _unlink(out_p / MANIFEST_NAME)
        state = out_p / STATE_DIR
        state.mkdir(exist_ok=True)
        names = [s.name for s in plan.shards]
        atomic_write_bytes(
            state / "plan.json",
            json.dumps(
                {
                    "schema": PLAN_SCHEMA,
                    "plan": plan.fingerprint,
                    "source": source.describe(),
                    "format": format,
                    "names": names,
                }
            ).encode(),
        )
        remove_stale_partials(out_p)
        keep = set()
        for d in reuse.values():
            keep.add(d.info.name)
            keep.update(a.name for a in d.info.aux)
        for n in sorted(st.owned - keep):
            _unlink(out_p / n)
        for p in state.glob("*.json"):
            if p.name != "plan.json" and p.name[: -len(".json")] not in reuse:
                _unlink(p)
        for d in reuse.values():  # re-record shards reused from a complete manifest
            atomic_write_bytes(state / f"{d.info.name}.json", json.dumps(d.to_json()).encode())
        _prepare_dir(out_p, plan, stripe_count, stripe_size)
        _check_free_space(out=out_p, plan=plan, reuse=reuse, target_kind=target_kind, resize=resize_t, quality=quality)

        todo = [s for s in plan.shards if s.name not in reuse]
        jobs = [
            ShardJob(
                str(out_p),
                format,
                s,
                tuple(source.classes),
                target_kind,
                image_shape,
                resize_t,
                quality,
                on_error,
                hash_algo,
                keys_checked,
            )
            for s in todo
        ]
        progress = Progress(f"pack {format}", total_items=sum(len(s.refs) for s in todo), quiet=quiet)
        done: dict[str, ShardDone] = dict(reuse)
        try:
            if pool is None or not jobs or (len(jobs) == 1 and not hasattr(fmt, "open_fragment")):
                for job in jobs:
                    done[job.shard.name] = write_shard(job, source, progress)
            else:
                for d in pool.run(jobs, source, progress, state):
                    done[d.info.name] = d
        except BaseException:
            remove_stale_partials(out_p)
            raise
        finally:
            source.close()
        progress.close()

        results = [done[n] for n in names]
        skipped = [s for d in results for s in d.skipped]
        m = Manifest(
            format=format,
            classes=list(source.classes),
            shards=[d.info for d in results],
            source=source.describe(),
            options=manifest_opts,
            hash_algo=hash_algo,
            sample_kind=target_kind,
            image_shape=image_shape,
            skipped=skipped,
        )
        m.write(out_p)
        shutil.rmtree(state, ignore_errors=True)
        fsync_dir(out_p)
        return PackResult(
            m,
            str(out_p),
            time.perf_counter() - t0,
            m.num_samples,
            m.num_bytes,
            skipped,
            len(m.shards),
            reused=len(reuse),
            plan=plan,
            payload_bytes=sum(d.payload_bytes for d in results),
        )
    finally:
        if pool is not None:
            pool.close()


def _check_destination(out: Path, st: OutState, source: Source, plan: Plan, overwrite: bool) -> None:
    if overwrite:
        return
    desc = source.describe()
    if st.foreign:
        shown = ", ".join(st.foreign[:3]) + (f" and {len(st.foreign) - 3} more" if len(st.foreign) > 3 else "")
        raise DestinationError(
            f"{out}: holds files that are not part of a stager pack ({shown}); choose an empty directory "
            "or pass --overwrite (only files a previous pack wrote are removed)"
        )
    if st.damaged_manifest:
        raise DestinationError(
            f"{out}: holds a damaged manifest ({st.damaged_manifest}); pass --overwrite to replace it"
        )
    prev = None
    same_plan = False
    if st.manifest is not None:
        prev = st.manifest.source
        same_plan = st.manifest.options.get("plan") == plan.fingerprint
    elif st.plan is not None:
        prev = st.plan.get("source") or {}
        same_plan = st.plan.get("plan") == plan.fingerprint
    if prev is not None and not same_plan and (prev.get("kind"), prev.get("path")) != (desc["kind"], desc["path"]):
        raise DestinationError(
            f"{out}: holds a pack of another source ({prev.get('kind')} {prev.get('path')}); "
            "choose another directory or pass --overwrite"
        )


def _find_reusable(out: Path, st: OutState, plan: Plan, algo: str) -> dict[str, ShardDone]:
    """Completed shards of a previous run that match this plan (name, fingerprint, size, hash)."""
    cands: dict[str, ShardDone] = {}
    if st.manifest is not None and st.manifest.hash_algo == algo:
        by_shard: dict[str, list[dict[str, str]]] = {}
        for s in st.manifest.skipped:
            by_shard.setdefault(s.get("shard", ""), []).append(s)
        old = st.manifest.options.get("shard_plans") or []
        for p, info, fp in zip(plan.shards, st.manifest.shards, old, strict=False):
            if p.name == info.name and p.fingerprint == fp:
                cands[p.name] = ShardDone(info, by_shard.get(info.name, []), 0, p.fingerprint)
    for p in plan.shards:  # done-records of an interrupted run (hash_algo is part of the fingerprint)
        d = st.done.get(p.name)
        if d is not None and d.fingerprint == p.fingerprint:
            cands.setdefault(p.name, d)
    return {n: d for n, d in cands.items() if _reusable(out, d.info, algo)}


def _check_free_space(
    *, out: Path, plan: Plan, reuse: dict[str, ShardDone], target_kind: str, resize: Any, quality: Any
) -> None:
    # Only when sizes are known in advance (files pass through unchanged); re-encoding changes them.
    if target_kind != "encoded" or resize or quality:
        return
    need = sum(s.est_bytes for s in plan.shards if s.name not in reuse)
    free = shutil.disk_usage(out).free
    if need > free:
        from stager.errors import OutOfSpaceError

        raise OutOfSpaceError(
            f"{out}: needs about {need / 1e9:.2f} GB but only {free / 1e9:.2f} GB is free; "
            "free space or choose another destination"
        )


def format_plan(plan: Plan, out: str, limit: int = 20) -> str:
    """Human-readable plan for ``--dry-run``."""
    buf = io.StringIO()
    buf.write(
        f"plan: {len(plan.shards)} {plan.format} shards, {plan.samples} samples, "
        f"~{plan.est_bytes / 1e6:,.1f} MB (source sizes) -> {out} [plan {plan.fingerprint[:16]}]\n"
    )
    for s in plan.shards[:limit]:
        buf.write(f"  {s.name:<28} {len(s.refs):>8} samples {s.est_bytes / 1e6:>10,.1f} MB\n")
    if len(plan.shards) > limit:
        buf.write(f"  ... {len(plan.shards) - limit} more shards\n")
    return buf.getvalue()


def format_result(r: PackResult) -> str:
    if r.dry_run and r.plan is not None:
        return format_plan(r.plan, r.out)
    js = r.to_json()
    line = (
        f"packed {r.samples} samples into {r.shards} {js.get('format', '')} shards ({r.bytes / 1e6:,.1f} MB) "
        f"at {r.out} in {r.seconds:.1f}s ({js['samples_per_s']:,.0f} samples/s, {js['mb_per_s']:,.1f} MB/s)"
    )
    if r.reused:
        line += f"; kept {r.reused} complete shards from a previous run"
    if r.skipped:
        line += f"; skipped {len(r.skipped)} bad samples (listed in manifest.skipped)"
    return line

"""``stager index``: a manifest for shards that already exist, without rewriting a byte of them.

Phases: **discover** SRC's shards (:mod:`stager.index.discover`); **resume** what an interrupted run
saved (``OUT/.stager-index/<shard>.json`` per scanned shard, reused while the file's size and mtime
and the options are unchanged); **scan** the rest, one process per shard with ``workers`` (each
shard is mapped, hashed and parsed in one pass: :mod:`stager.index.tar`, ``record``, ``parquet``,
``recordio``, ``lmdb``); **check** across shards (a tar sample split over a shard boundary, repeated
keys); write index files (DALI's for TFRecords, MXNet's ``.idx`` for a RecordIO file without one);
**label** (:func:`stager.index.labels.resolve_labels`) and the extra columns
(:mod:`stager.index.columns`); **publish** ``OUT/manifest.json`` atomically, then drop the state
directory.

OUT defaults to SRC's directory (the manifest sits beside the shards). With another OUT (a read-only,
shared SRC) the manifest's ``shard_root`` names SRC's directory, and stage, verify and the loader
read the shards there.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stager.checksum import hash_bytes
from stager.errors import CorruptSampleError, DestinationError, UsageError, translated
from stager.formats import FORMAT_SPECS
from stager.fs.atomic import atomic_write_bytes, remove_partials
from stager.fs.open import is_url, join
from stager.fs.pool import end_with_parent, ended_workers, kill_workers, lost_worker_error, signals_held
from stager.index import remote
from stager.index.columns import extra_columns, sample_kind
from stager.index.discover import STATE_DIR, discover
from stager.index.fields import compare_fields
from stager.index.labels import resolve_labels
from stager.index.lmdb import scan_lmdb
from stager.index.options import IndexOptions
from stager.index.parquet import scan_parquet
from stager.index.record import scan_record
from stager.index.recordio import scan_recordio
from stager.index.scan import DamagedShardError, ShardScan
from stager.index.squashfs import scan_squashfs
from stager.index.tar import scan_tar
from stager.manifest import INDEX_PARTIAL_BASE, MANIFEST_NAME, AuxFile, Manifest, ShardInfo, load_manifest
from stager.manifest.table import Ragged, Strings
from stager.progress import Progress

# scan(path, name, image_key, label_key, hash algo, **IndexOptions.scan_extras(kind)) -> ShardScan: one per
# format the registry says `stager index` adopts (tests/test_format_registry.py checks that they agree).
Scanner = Callable[..., ShardScan]
SCANNERS: dict[str, Scanner] = {"tar": scan_tar, "record": scan_record, "parquet": scan_parquet,
                                "recordio": scan_recordio, "lmdb": scan_lmdb, "squashfs": scan_squashfs}


@dataclass
class IndexResult:
    """What :func:`index_dataset` did: where the manifest is, and counts."""

    manifest_path: str
    kind: str
    shards: int
    samples: int
    bytes: int
    classes: int
    scanned: int
    resumed: int
    seconds: float
    dataset_id: str
    shard_root: str | None
    dali_index: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, **self.__dict__, "seconds": round(self.seconds, 4),
                "gbps": round(self.bytes / max(self.seconds, 1e-9) / 1e9, 3),
                "samples_per_s": round(self.samples / max(self.seconds, 1e-9), 1)}


def index_dataset(src: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                  options: IndexOptions | None = None, *, quiet: bool = True) -> IndexResult:
    """Index SRC's shards into ``OUT/manifest.json`` (see the module docstring)."""
    opts = options or IndexOptions()
    t0 = time.perf_counter()
    directory, names, kind = discover(os.fspath(src), opts.format, opts.storage_options)
    if out is None and is_url(directory):
        raise UsageError(f"{src}: a URL; pass --out DIR for the manifest (it names the shards where they are)")
    out_dir = Path(os.path.abspath(out if out is not None else directory))
    in_place = out_dir == Path(directory)
    created = not out_dir.exists()
    _check_out(out_dir, in_place, directory)
    state = out_dir / STATE_DIR
    state.mkdir(exist_ok=True)
    try:
        remote.remove_stale_downloads(str(state))
        fp = opts.fingerprint(kind)
        scans: dict[str, ShardScan] = _resume(state, directory, names, fp, opts.storage_options)
        todo = [n for n in names if n not in scans]
        resumed = len(scans)
        progress = Progress("index", quiet=quiet)
        for n, scan in enumerate(_scan_all(directory, todo, kind, opts, progress, spool=str(state)), 1):
            scans[scan.name] = scan
            if n < len(todo):  # the last one's result goes into the manifest at once: nothing to resume
                atomic_write_bytes(state / f"{scan.name}.json",
                                   json.dumps({"fp": fp, "scan": scan.to_json()}).encode())
        progress.close()
        ordered = [scans[n] for n in names]
        _check_boundaries(ordered, directory)
        dali, dali_paths = (_write_dali_index(ordered, directory, out_dir, in_place, algo=opts.hash_algo, kind=kind)
                            if FORMAT_SPECS[kind].companion and opts.dali_index else ({}, []))
        m = _manifest(ordered, directory, kind, opts, dali, shard_root=None if in_place else directory)
        path = m.write(out_dir)
    except BaseException:
        remote.remove_stale_downloads(str(state))  # a killed worker's copy of an object
        _leave_nothing_new(state, out_dir if created else None)
        raise
    shutil.rmtree(state, ignore_errors=True)
    return IndexResult(path, kind, len(ordered), m.num_samples, sum(s.bytes for s in ordered), len(m.classes),
                       len(todo), resumed, time.perf_counter() - t0, m.dataset_id, m.shard_root, dali_paths)


def _manifest(ordered: list[ShardScan], directory: str, kind: str, opts: IndexOptions,
              aux: dict[str, list[AuxFile]], *, shard_root: str | None) -> Manifest:
    """The manifest of the scanned shards: keys made unique, labels resolved, companions listed."""
    _unique_keys(ordered, kind, directory)
    labels, classes = resolve_labels(ordered, opts.label_offset, directory)
    for s in ordered:
        if s.companion is not None and not is_url(directory):
            aux[s.name] = [_companion(directory, s.companion, opts.hash_algo)]
    kind_of_samples, image_shape = sample_kind(ordered, directory)
    columns, fields = extra_columns(ordered, directory)
    shards = [ShardInfo(s.name, s.bytes, s.hash, s.keys, lab, *s.arrays(), aux=aux.get(s.name, []), extents=s.extents,
                        columns=cols) for s, lab, cols in zip(ordered, labels, columns, strict=True)]
    return Manifest(format=kind, classes=classes, shards=shards, hash_algo=opts.hash_algo,
                    source={"kind": "index", "path": directory, "input": kind},
                    options={"index": {**opts.fingerprint(kind), "label_offset": opts.label_offset}},
                    shard_root=shard_root, sample_kind=kind_of_samples, image_shape=image_shape, fields=fields)


def adopt_in_memory(src: str | os.PathLike[str], options: IndexOptions | None = None) -> Manifest:
    """The manifest ``stager index`` would write for the local SRC, built in memory: nothing is written
    (no state, no index files). ``stager pack`` converts a RecordIO or LMDB source through it."""
    opts = options or IndexOptions()
    directory, names, kind = discover(os.fspath(src), opts.format)
    scan = functools.partial(SCANNERS[kind], **opts.scan_extras(kind))
    ordered = [scan(join(directory, n), n, opts.image_key_for(kind), opts.label_key_for(kind), opts.hash_algo)
               for n in names]
    _check_boundaries(ordered, directory)
    return _manifest(ordered, directory, kind, opts, {}, shard_root=directory)


def _leave_nothing_new(state: Path, created: Path | None) -> None:
    """After a failed run: the state directory when it holds no scan to resume from, and OUT when this
    run created it and it is empty again (a first run refused at its first shard leaves nothing)."""
    with contextlib.suppress(OSError):
        state.rmdir()  # only when empty: saved scans are kept for the next run
    if created is not None:
        with contextlib.suppress(OSError):
            created.rmdir()


def _check_out(out_dir: Path, in_place: bool, directory: str) -> None:
    """OUT must be writable and hold no stager pack (an index replaces only an index)."""
    if in_place and not os.access(directory, os.W_OK):
        raise DestinationError(f"{directory}: not writable (a shared, read-only dataset?); pass --out DIR to "
                               "write the manifest there, naming the shards where they are")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise translated(exc, f"{out_dir}: cannot create the output directory ({exc.strerror})",
                         DestinationError) from exc
    if (out_dir / MANIFEST_NAME).exists():
        try:
            prev = load_manifest(out_dir)
        except Exception:  # a damaged manifest of ours is replaced; anything else is named below
            prev = None
        if prev is not None and not prev.indexed:
            raise DestinationError(f"{out_dir}: holds a `stager pack` output; index into another directory (--out)")
    remove_partials(out_dir, [MANIFEST_NAME, INDEX_PARTIAL_BASE])


def _identity(path: str, storage_options: dict[str, Any] | None) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a shard file; for an object, its size and :func:`remote.stamp`."""
    if is_url(path):
        return remote.stamp(path, storage_options)
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _resume(state: Path, directory: str, names: list[str], fp: dict[str, object],
            storage_options: dict[str, Any] | None) -> dict[str, ShardScan]:
    """Scans an interrupted run saved whose file still has the same size and mtime, and the same options."""
    got: dict[str, ShardScan] = {}
    for n in names:
        try:
            d = json.loads((state / f"{n}.json").read_bytes())
            scan = ShardScan.from_json(d["scan"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if d.get("fp") == fp and (scan.bytes, scan.mtime_ns) == _identity(join(directory, n), storage_options):
            got[n] = scan
    return got


@dataclass(frozen=True)
class _Job:
    """One shard to scan (picklable: sent to a worker process)."""

    path: str  # file path or object URL
    name: str
    kind: str
    image_key: str | None
    label_key: str | None
    algo: str
    spool: str  # where an object is copied down to be scanned
    storage_options: dict[str, Any] | None
    extra: dict[str, Any] = field(default_factory=dict)  # IndexOptions.scan_extras(kind)


def _scan_one(job: _Job) -> ShardScan:
    scan = functools.partial(SCANNERS[job.kind], **job.extra)
    if not is_url(job.path):
        return scan(job.path, job.name, job.image_key, job.label_key, job.algo)
    size, ident = remote.stamp(job.path, job.storage_options)
    # Exactly ``size`` bytes are read (ranged GETs): an object replaced meanwhile leaves a hash that
    # matches neither version, which ``verify`` reports (exit 3).
    with remote.local_copy(job.path, job.spool, job.storage_options, size) as local:
        found = scan(local, job.name, job.image_key, job.label_key, job.algo)
    found.mtime_ns = ident
    return found


def _scan_all(directory: str, todo: list[str], kind: str, opts: IndexOptions, progress: Progress, *, spool: str
              ) -> Iterator[ShardScan]:
    """Scan ``todo`` (in parallel with ``opts.workers``); yield each shard's scan as it completes."""
    jobs = [_Job(join(directory, n), n, kind, opts.image_key_for(kind), opts.label_key_for(kind), opts.hash_algo,
                 spool, opts.storage_options, opts.scan_extras(kind)) for n in todo]
    if opts.workers <= 1 or len(jobs) <= 1:
        for j in jobs:
            scan = _scan_one(j)
            progress.update(len(scan.keys), scan.bytes)
            yield scan
        return
    import multiprocessing as mp  # noqa: PLC0415 (a one-shard index, an image, never starts a process: ~15 ms)
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415 (imports multiprocessing)

    ctx = mp.get_context("fork" if threading.active_count() == 1 and "fork" in mp.get_all_start_methods()
                         else "spawn")
    # No ``with``: an interrupt while the pool starts (inside ``submit``) leaves its manager thread created
    # but not started, and ``shutdown(wait=True)`` then raises RuntimeError ("cannot join thread before it is
    # started") instead of the interrupt, or, the workers never told to stop, Python's exit waits on them.
    ex = ProcessPoolExecutor(max_workers=min(opts.workers, len(jobs)), mp_context=ctx,
                             initializer=end_with_parent)  # stager killed: its workers go too
    pending: set[Future[ShardScan]] = set()
    interrupted = False
    try:
        it = iter(jobs)
        for j in it:  # at most 2 jobs per worker in flight: results are kept and saved in order of completion
            with signals_held():  # submit starts workers: a signal inside fork would be lost
                pending.add(ex.submit(_scan_one, j))
            if len(pending) >= 2 * opts.workers:
                break
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                scan = fut.result()
                progress.update(len(scan.keys), scan.bytes)
                yield scan
                nxt = next(it, None)
                if nxt is not None:
                    with signals_held():
                        pending.add(ex.submit(_scan_one, nxt))
    except BrokenExecutor:  # BrokenProcessPool: a worker ended on its own (the OOM killer): end the rest, one line
        ended = ended_workers(ex)
        kill_workers(ex)
        raise lost_worker_error(ended, "index", "rerun with fewer -j; the index resumes where it stopped") from None
    except (KeyboardInterrupt, GeneratorExit):  # Ctrl-C, SIGTERM, or the caller failed: abandon what runs
        interrupted = True
        kill_workers(ex)  # a worker blocked on a stalled server would keep the pool's shutdown waiting
        raise
    finally:
        for fut in pending:
            fut.cancel()
        with contextlib.suppress(RuntimeError):  # (the manager thread not started: nothing to join)
            ex.shutdown(wait=not interrupted, cancel_futures=True)


def _check_boundaries(scans: list[ShardScan], directory: str) -> None:
    """A webdataset sample whose members continue in the next shard (a tar split by size) is refused."""
    def tail(s: ShardScan) -> str | None:
        return next((k for e, k, _ in s.edges if e == 1), s.keys[-1] if s.keys else None)

    def head(s: ShardScan) -> str | None:
        return next((k for e, k, _ in s.edges if e == 0), s.keys[0] if s.keys else None)

    for a, b in itertools.pairwise(scans):
        if tail(a) is not None and tail(a) == head(b):
            raise DamagedShardError(
                f"{join(directory, b.name)}: sample {head(b)!r} continues from {a.name} (its members are "
                "split across the shard boundary); rewrite the shards so each sample is inside one tar "
                "(webdataset's ShardWriter never splits one; `tar`/`split` by size can)")
    for s in scans:
        for _, key, fields in s.edges:
            raise DamagedShardError(f"{join(directory, s.name)}: sample {key!r} has no image member "
                                     f"(fields: {fields}); pass --image-key FIELD (e.g. jpg or 'jpg;png')")


def _unique_keys(scans: list[ShardScan], kind: str, directory: str) -> None:
    """Keys must be unique in the dataset: a repeat where keys are the container's member names (tar: the
    format's ``named_keys``) is refused; record/parquet, whose keys are file names that may repeat (one per
    class folder), then key every sample by its position instead."""
    dup = _first_repeat(scans)
    if dup is None:
        return
    if FORMAT_SPECS[kind].named_keys:
        raise DamagedShardError(f"{directory}: sample key {dup[0]!r} appears twice ({dup[1]}); keys must be "
                                 "unique across the shards")
    for t in scans:
        t.keys = [f"{t.name}/{i:08d}" for i in range(len(t.keys))]


def _first_repeat(scans: list[ShardScan]) -> tuple[str, str] | None:
    """The first key seen twice and where, else None (vectorised over all keys: Strings.first_repeat)."""
    if len(scans) == 1 and scans[0].keys_unique:
        return None
    parts = [s.keys.raw if isinstance(s.keys, Strings) else Strings.from_strings(s.keys).raw for s in scans]
    if not parts:
        return None
    keys = Strings(Ragged.concat(parts))
    found = keys.first_repeat()
    if found is None:
        return None
    starts = np.cumsum([0] + [len(s.keys) for s in scans])
    a, b = (scans[int(np.searchsorted(starts, x, side="right")) - 1] for x in found)
    return keys[found[1]], (f"in {a.name} and {b.name}" if a.name != b.name else f"twice in {b.name}")


def _write_dali_index(scans: list[ShardScan], directory: str, out_dir: Path, in_place: bool,
                      *, algo: str, kind: str) -> tuple[dict[str, list[AuxFile]], list[str]]:
    """Index files for the shards whose scan made ``records``: the companion the format's registry entry
    names (TFRecord ``<file>.idx`` in DALI's ``<offset> <size>`` lines, RecordIO ``x.rec`` -> ``x.idx``
    in MXNet's and DALI's ``<key>\t<offset>``): ``(companions by shard, paths)``.

    In place they sit beside their file and are listed as its companion (staged and verified with it);
    an existing ``.idx`` that differs (someone's own) is left alone and not listed. With ``--out`` they
    go into OUT, are not companions (the shards are elsewhere), and DALI is given them by path."""
    aux: dict[str, list[AuxFile]] = {}
    paths: list[str] = []
    spec = FORMAT_SPECS[kind]
    for s in scans:
        if s.records is None:  # a RecordIO file with its own, checked .idx (a companion already)
            continue
        data = b"".join(spec.companion_line % r for r in s.records)
        target = (Path(directory) if in_place else out_dir) / str(spec.companion_name(s.name))
        try:
            have: bytes | None = target.read_bytes()
        except FileNotFoundError:
            have = None
        if have is not None and have != data and in_place:
            continue
        if have != data:
            atomic_write_bytes(target, data)
        paths.append(str(target))
        if in_place:
            aux[s.name] = [AuxFile(target.name, len(data), hash_bytes(data, algo))]
    return aux, paths


def _companion(directory: str, name: str, algo: str) -> AuxFile:
    """An index file the scan checked against its shard (RecordIO's own ``.idx``), listed as its companion."""
    data = Path(directory, name).read_bytes()
    return AuxFile(name, len(data), hash_bytes(data, algo))


def rescan_shard(path: str, info: ShardInfo, m: Manifest) -> str | None:
    """``stager verify --deep`` for an indexed set: index the shard again with the manifest's recorded
    options and compare with its entry; a reason, or None when it holds exactly the indexed samples."""
    o = m.options.get("index") or {}
    kind = str(o.get("kind") or m.source.get("input") or m.format)
    if kind not in SCANNERS:
        return f"unknown indexed input kind {kind!r}"
    extra: dict[str, Any] = {"layout": str(o["layout"])} if "layout" in o else {}
    if o.get("fields") is False:
        extra["fields"] = False
    try:
        scan = SCANNERS[kind](path, info.name, o.get("image_key"), o.get("label_key"), m.hash_algo, **extra)
    except (CorruptSampleError, UsageError, OSError) as exc:
        return f"cannot be indexed again ({exc})"
    if len(scan.keys) != info.samples:
        return f"holds {len(scan.keys)} samples, index says {info.samples}"
    offsets, sizes = scan.arrays()
    if scan.extents != info.extents or not (offsets == info.offsets).all() or not (sizes == info.sizes).all():
        j = int(((offsets != info.offsets) | (sizes != info.sizes)).argmax())
        return f"sample {j} ({info.keys[j]}): at {offsets[j]}+{sizes[j]}, index says {info.offsets[j]}+{info.sizes[j]}"
    lookup = {c: i for i, c in enumerate(m.classes)}
    off = int(o.get("label_offset") or 0)
    for j, v in enumerate(scan.raw_labels()):
        want = -1 if v is None else (lookup.get(v, -2) if isinstance(v, str) else int(v) + off)
        if want != int(info.labels[j]):
            return f"sample {j} ({info.keys[j]}): label {want}, index says {int(info.labels[j])}"
    return compare_fields(scan, info.columns)

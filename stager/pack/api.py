"""``stager pack``: turn a source (ImageFolder, CIFAR batches, list file, another pack) into shards.

:func:`pack` runs six phases, each a method of :class:`PackRun` whose docstring states its
contract:

1. **check**: the options (:class:`~stager.pack.options.PackOptions`, checked when built) and the
   format name; nothing is read or written.
2. **list**: open and list the source (:mod:`stager.pack.sources`) and settle what its samples
   become (image files, or decoded arrays of one shape); keys are checked once for the whole pack.
3. **plan** (pure, :mod:`stager.pack.plan`): which sample goes to which shard, in which order, with
   fingerprints. A dry run stops here.
4. **resume** (:mod:`stager.pack.resume`): what a previous run left in OUT; refuse someone else's
   files, keep the shards this plan can reuse, remove the rest.
5. **write** (:mod:`stager.pack.shard`, or :mod:`stager.pack.workers` with ``workers > 1``): every
   other planned shard, each renamed into place complete and followed by its done-record.
6. **publish**: ``manifest.json`` written last, atomically (its directory fsync also makes the
   shard renames durable), and the state directory removed.

The output is a pure function of the source listing and the output-affecting options: the same
bytes whatever ``workers`` is and however often the pack was interrupted and resumed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stager.errors import OutOfSpaceError, UsageError
from stager.formats import FIELD_FORMATS, get_writer_format
from stager.fs import lustre
from stager.fs.atomic import fsync_dir, remove_partials
from stager.fs.kernel import release_free_heap
from stager.fs.open import join, local_path_of
from stager.manifest import MANIFEST_NAME, Manifest
from stager.pack.options import PackOptions
from stager.pack.plan import PackPlan, format_plan, plan_shards
from stager.pack.remote import (
    RemoteOut,
    clean_state,
    clear_remote,
    find_reusable_remote,
    make_spool,
    publish_remote,
    remove_spool,
    survey_remote,
)
from stager.pack.resume import Kept, check_destination, clear_out, find_reusable, holds_complete_pack, survey_out
from stager.pack.shard import ShardJob, fragmentable, write_shard
from stager.pack.sources.checks import check_names, check_out_place, probe_hw
from stager.pack.sources.columns import ListingRefs
from stager.pack.sources.frames import FrameSource, clip_shards
from stager.pack.sources.select import open_source
from stager.pack.state import STATE_DIR, ShardDone
from stager.progress import Progress

if TYPE_CHECKING:
    from stager.formats.base import Format
    from stager.pack.plan import PlannedShard
    from stager.pack.sources.base import Source
    from stager.pack.workers import PackPool


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
    plan: PackPlan | None = None
    payload_bytes: int = 0
    # Seconds spent in each phase (list, plan, resume, write, publish; docs/benchmarks.md profiles them),
    # wall-clock and this process's CPU time (user + system; pool workers not included).
    phases: dict[str, float] = field(default_factory=dict)
    phases_cpu: dict[str, float] = field(default_factory=dict)
    # With workers writing in segments: the CPU seconds each pool process had used (by pid), listing included.
    workers_cpu: dict[int, float] = field(default_factory=dict)

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
            d["manifest"] = join(self.out, MANIFEST_NAME)
        if self.plan is not None:
            d["format"] = self.plan.format
            d["plan"] = self.plan.fingerprint
            if self.dry_run:
                d["shard_table"] = self.plan.to_json()["shard_table"]
        return d


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
    tar_json: bool = False,
    compression: str | None = None,
    storage_options: dict[str, Any] = {},  # noqa: B006 - never mutated (PackOptions copies it)
    fields: str | None = None,
    clip_length: int | None = None,
    clip_stride: int = 1,
    frame_step: int = 1,
    frame_format: str = "jpg",
    allow_empty_classes: bool = False,
) -> PackResult:
    """Pack ``src`` into ``format`` shards under ``out`` (see the module docstring and docs/pack.md).

    The keywords are those of :class:`~stager.pack.options.PackOptions`. Returns a
    :class:`PackResult`. Raises :class:`UsageError` (bad options, unknown format),
    :class:`SourceNotFoundError`/:class:`SourceError` (missing, empty or damaged source),
    :class:`DestinationError` (OUT holds something else and ``overwrite`` is false),
    :class:`OutOfSpaceError` (disk full; completed shards are kept for a rerun).

    ``out`` may be a URL (``s3://bucket/prefix``, any fsspec URL): the shards are uploaded as they
    are finished and the manifest last (:mod:`stager.pack.remote`), opened with ``storage_options``.
    """
    started = time.perf_counter()
    options = PackOptions(
        format=format,
        samples_per_shard=samples_per_shard,
        shard_size=shard_size,
        workers=workers,
        seed=seed,
        keep_order=keep_order,
        resize=resize,
        quality=quality,
        on_error=on_error,
        overwrite=overwrite,
        dry_run=dry_run,
        quiet=quiet,
        hash_algo=hash_algo,
        stripe_count=stripe_count,
        stripe_size=stripe_size,
        split=split,
        tar_json=tar_json,
        compression=compression,
        storage_options=storage_options,
        fields=fields,
        clip_length=clip_length,
        clip_stride=clip_stride,
        frame_step=frame_step,
        frame_format=frame_format,
        allow_empty_classes=allow_empty_classes,
    )
    with _worker_pool(options.workers) as pool, PackRun(out, options, pool, started) as run:
        result = _run_phases(run, src)
        result.seconds = run.elapsed()  # after the last phase: the phases fit in it
        result.phases, result.phases_cpu = dict(run.phases), dict(run.phases_cpu)
        result.workers_cpu = dict(pool.workers_cpu) if pool is not None else {}
        return result


def _run_phases(run: PackRun, src: str | os.PathLike[str]) -> PackResult:
    """The phases of :func:`pack`, each timed (``PackResult.phases``), as far as this run goes."""
    with run.phase("list"):
        listing = run.list_source(src, run.check())
    with run.phase("plan"):
        plan = run.plan(listing)
    if run.options.dry_run:
        return run.planned(plan)
    with run.phase("resume"):
        kept = run.resume(listing, plan)
    if kept.complete:
        return run.publish_complete(plan, kept)
    with run.phase("write"):
        done = run.write(listing, plan, kept)
    with run.phase("publish"):
        return run.publish(listing, plan, kept, done)


@contextmanager
def _worker_pool(workers: int) -> Iterator[PackPool | None]:
    """The pool of ``workers`` processes (None for one): started on first use, reused from listing
    to writing, closed on the way out."""
    if workers == 1:
        yield None
        return
    # Imported only here: multiprocessing and concurrent.futures cost ~13 ms that one process never needs.
    from stager.pack.workers import PackPool  # noqa: PLC0415 (multiprocessing only with --workers > 1)

    with PackPool(workers) as pool:
        yield pool


@dataclass(frozen=True)
class Listing:
    """What the list phase settled: the opened source and what its samples become in the shards."""

    source: Source  # open until the write phase ends (it closes it)
    fmt: Format
    target_kind: str  # the format's sample kind: "encoded" (image files) or "decoded" (arrays)
    image_shape: tuple[int, int, int] | None  # the one (H, W, 3) a decoded format stores, else None
    keys_checked: bool  # every key passed the format's check_keys: writers skip the per-key check


class PackRun:
    """One call of :func:`pack`: its phases, sharing OUT (absolute), the options and the worker pool.

    Each phase is a method that takes what earlier phases returned; none keeps state on ``self``
    (but for ``phases``, the seconds each took).
    """

    def __init__(
        self, out: str | os.PathLike[str], options: PackOptions, pool: PackPool | None, started: float
    ) -> None:
        local = local_path_of(out)
        # A URL-looking OUT is never a local path: it goes to its store (or is refused), and the local
        # ``out`` is then a spool directory for the shards being written.
        self.remote = RemoteOut(os.fspath(out), options.storage_options) if local is None else None
        self.out = Path(make_spool() if self.remote is not None else os.path.abspath(local or out))
        self.out_name = self.remote.url if self.remote is not None else str(self.out)
        self.options = options
        self.pool = pool
        self.started = started
        self.phases: dict[str, float] = {}
        self.phases_cpu: dict[str, float] = {}

    def __enter__(self) -> PackRun:
        return self

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the seconds the ``with`` block takes to ``self.phases[name]`` (wall) and
        ``self.phases_cpu[name]`` (this process's CPU time): a run's profile."""
        t, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t
            self.phases_cpu[name] = self.phases_cpu.get(name, 0.0) + time.process_time() - c

    def __exit__(self, *exc: object) -> None:
        if self.remote is not None:
            remove_spool(str(self.out))

    def check(self) -> Format:
        """Check: the format the options name (:class:`UsageError` if there is none).

        The options themselves were checked when :class:`PackOptions` was built. Reads and writes
        nothing.
        """
        return get_writer_format(self.options.format)

    def list_source(self, src: str | os.PathLike[str], fmt: Format) -> Listing:
        """List: open and list ``src`` and settle what its samples become in ``fmt`` shards.

        Raises :class:`SourceNotFoundError`/:class:`SourceError` (missing, empty or unreadable
        source; for a decoded format without ``resize``, images of different sizes) and
        :class:`UsageError` (OUT is the source pack; keys the format cannot store). Writes nothing.
        """
        pool = self.pool
        if self.remote is None:
            check_out_place(src, self.out)  # before listing: OUT inside SRC would be listed as a class
        # With workers, an ImageFolder lists its class folders on the pool (the only source that starts it
        # this early); other sources leave it to start at writing time and so be inherited by fork.
        source = open_source(
            src, split=self.options.split, map_fn=pool.map if pool is not None else None, options=self.options
        )
        if source.fields and not fmt.spec.fields:
            raise UsageError(f"{src}: samples with fields are packed to {', '.join(FIELD_FORMATS)}; "
                             f"--format {fmt.name} stores one image and a label")
        if source.kind == "pack" and self.remote is None and self.out == source.root:
            raise UsageError(f"{self.out}: output is the source pack itself; choose another directory")
        check_names(source)  # every name `stage --unpack` creates is refused here or never
        # Keys are checked once for the whole plan (one pass), so writers need not check each one.
        keys_checked = fmt.spec.named_keys
        if keys_checked:
            if isinstance(source.refs, ListingRefs):
                # A chunk at a time, each one text (Lines: no Python string per key); a columnar
                # listing's keys are unique by construction (the source contract), across chunks too.
                for chunk in source.refs.key_chunks():
                    fmt.check_keys(chunk, f"{source.root}: ")
            else:
                fmt.check_keys([r.key for r in source.refs], f"{source.root}: ")
        image_shape = self._image_shape(source) if fmt.sample_kind == "decoded" else None
        return Listing(source, fmt, fmt.sample_kind, image_shape, keys_checked=keys_checked)

    def _image_shape(self, source: Source) -> tuple[int, int, int]:
        """The one (H, W, 3) a decoded format stores: ``resize``, else the source's own fixed shape,
        else the common size in the images' headers (:func:`probe_hw`: SourceError if they differ)."""
        if self.options.resize:
            return (self.options.resize[0], self.options.resize[1], 3)
        if source.image_shape is not None:
            return source.image_shape
        h, w = probe_hw(source, source.refs, skip_bad=self.options.on_error == "skip")
        return (h, w, 3)

    def plan(self, listing: Listing) -> PackPlan:
        """Plan (pure): order and cut the listed samples into shards (:func:`plan_shards`)."""
        source = listing.source
        plan = plan_shards(
            source.refs,
            self.options,
            listing.fmt.shard_name,
            classes=source.classes,
            image_shape=listing.image_shape,
            groups=getattr(source, "groups", None),  # a clip source's sequences stay whole and in order
        )
        release_free_heap()  # the plan's temporaries (whole-listing arrays) would otherwise stay resident
        return plan

    def planned(self, plan: PackPlan) -> PackResult:
        """The result of a dry run: the plan and its estimated size; nothing was written."""
        return PackResult(
            None,
            self.out_name,
            self.elapsed(),
            plan.samples,
            plan.est_bytes,
            [],
            len(plan.shards),
            dry_run=True,
            plan=plan,
        )

    def resume(self, listing: Listing, plan: PackPlan) -> Kept:
        """Resume: what OUT holds from a previous run, and what of it this plan keeps.

        Raises :class:`DestinationError` when OUT holds files no pack wrote, a damaged manifest or
        another source's pack (unless ``overwrite``). Every reusable shard is re-hashed. When OUT
        already holds this very pack, complete, nothing is changed (``Kept.complete``). Otherwise,
        on return OUT holds no manifest, no partial file and no file of a previous pack except the
        kept shards, and ``.stager-pack/`` holds this plan and the kept shards' done-records.
        """
        shard_prefix = re.split(r"\d", listing.fmt.shard_name(0), maxsplit=1)[0]
        if self.remote is not None:
            return self._resume_remote(listing, plan, shard_prefix)
        found = survey_out(self.out, shard_prefix)
        check_destination(self.out, found, listing.source, plan, self.options.overwrite)
        reusable = find_reusable(self.out, found, plan, self.options.hash_algo)
        complete = holds_complete_pack(found, plan, reusable)
        if complete:
            return Kept(found, reusable, complete)
        # From here on OUT changes: the old manifest goes first so it never describes replaced shards.
        record = clear_out(self.out, found, reusable, plan, listing.source)
        return Kept(found, reusable, complete, record)

    def _resume_remote(self, listing: Listing, plan: PackPlan, shard_prefix: str) -> Kept:
        """:meth:`resume` for a URL OUT (:mod:`stager.pack.remote`): the same checks, on objects."""
        remote = self.remote
        assert remote is not None
        state = survey_remote(remote, shard_prefix)
        check_destination(remote.url, state.found, listing.source, plan, self.options.overwrite)
        reusable = find_reusable_remote(remote, state, plan, self.options.hash_algo)
        complete = holds_complete_pack(state.found, plan, reusable)
        if not complete:
            clear_remote(remote, state, reusable, plan, listing.source)
        (self.out / STATE_DIR).mkdir(parents=True, exist_ok=True)  # the spool's (workers' job files)
        return Kept(state.found, reusable, complete)

    def write(self, listing: Listing, plan: PackPlan, kept: Kept) -> dict[str, ShardDone]:
        """Write: every planned shard not kept; return every shard's :class:`ShardDone` by name.

        OUT first gets its Lustre layout (when it is on Lustre) and, where shard sizes are known in
        advance, a free-space check (:class:`OutOfSpaceError`). Each shard is renamed into place
        complete, then gets its done-record, so a failure at any point leaves completed shards for a
        rerun; the partial files are removed on the way out. The source is closed.
        """
        opts = self.options
        source = listing.source
        todo = [s for s in plan.shards if s.name not in kept.shards]
        if getattr(source, "encodes_frames", False):
            # Decoded video frames were encoded with --resize/--quality already: written unchanged.
            opts = replace(opts, resize=None, quality=None)
        if self.remote is None:
            _stripe(self.out, plan, opts)
            _check_free_space(self.out, todo, passes_through=opts.passes_through(listing.target_kind))
        if isinstance(source.refs, ListingRefs) and todo:
            # From here on the listing is read from a mapped file (workers map the same one), not the heap.
            source.refs.spill(str(self.out / STATE_DIR / f"listing-{uuid.uuid4().hex[:12]}"))
        jobs = [
            ShardJob(
                str(self.out),
                s,
                opts,
                tuple(source.classes),
                listing.target_kind,
                listing.image_shape,
                listing.keys_checked,
                self.remote,
                tuple(source.fields),
            )
            for s in todo
        ]
        progress = Progress(f"pack {opts.format}", total_items=sum(len(s.refs) for s in todo), quiet=opts.quiet)
        done: dict[str, ShardDone] = dict(kept.shards)
        try:
            for d in self._write_jobs(jobs, listing, progress, kept.ready):
                done[d.info.name] = d
            kept.ready()  # plan.json is durable (and its thread done) whatever was written
        except BaseException:
            with contextlib.suppress(BaseException):  # its thread is done before the state is touched
                kept.ready()
            remove_partials(self.out)
            raise
        finally:
            source.close()
        progress.close()
        release_free_heap()  # the written samples' rows, freed: publishing needs the room
        return done

    def _write_jobs(self, jobs: list[ShardJob], listing: Listing, progress: Progress,
                    ready: Callable[[], None]) -> Iterable[ShardDone]:
        """Write ``jobs`` here, one after the other, or on the pool (not worth it for one whole shard).
        ``ready()`` returns once shards may be renamed into place (:meth:`Kept.ready`)."""
        pool = self.pool
        if pool is None or not jobs or (len(jobs) == 1 and not fragmentable(listing.fmt, listing.source.fields)):
            return (write_shard(job, listing.source, progress, ready=ready) for job in jobs)
        return pool.run(jobs, listing.source, progress, self.out / STATE_DIR, ready=ready)

    def publish(self, listing: Listing, plan: PackPlan, kept: Kept, done: dict[str, ShardDone]) -> PackResult:
        """Publish: ``manifest.json`` (atomic, last) lists the shards in plan order; then the state
        directory is removed and OUT fsynced, which also makes the shards' renames durable.

        OUT is a complete pack from the manifest's rename on.
        """
        opts = self.options
        source = listing.source
        shards = [done[s.name] for s in plan.shards]
        skipped = [s for d in shards for s in d.skipped]
        infos = [d.info for d in shards]
        clips = None
        if isinstance(source, FrameSource):
            infos, clips = clip_shards(source, infos)
            skipped = source.skipped + skipped
        m = Manifest(
            format=opts.format,
            classes=list(source.classes),
            shards=infos,
            source=source.describe(),
            options=self._manifest_options(plan),
            hash_algo=opts.hash_algo,
            sample_kind=listing.target_kind,
            image_shape=listing.image_shape,
            skipped=skipped,
            fields=[f.to_json() for f in source.fields],
            clips=clips,
        )
        if self.remote is not None:
            publish_remote(self.remote, m, self.out)
        else:
            m.write(self.out)
            shutil.rmtree(self.out / STATE_DIR, ignore_errors=True)
            fsync_dir(self.out)
        return PackResult(
            m,
            self.out_name,
            self.elapsed(),
            m.num_samples,
            m.num_bytes,
            skipped,
            len(m.shards),
            reused=len(kept.shards),
            plan=plan,
            payload_bytes=sum(d.payload_bytes for d in shards),
        )

    def _manifest_options(self, plan: PackPlan) -> dict[str, Any]:
        """The manifest's ``options``: how the pack was made, and the fingerprints a rerun compares."""
        opts = self.options
        return {
            "seed": opts.seed,
            "keep_order": opts.keep_order,
            "samples_per_shard": opts.samples_per_shard,
            "shard_size": opts.shard_size,
            "resize": plan.options["resize"],
            "quality": opts.quality,
            "on_error": opts.on_error,
            "plan": plan.fingerprint,
            # Per-shard fingerprints let a rerun after a source change keep the shards it did not touch.
            "shard_plans": [sh.fingerprint for sh in plan.shards],
        }

    def publish_complete(self, plan: PackPlan, kept: Kept) -> PackResult:
        """Publish when OUT already held this very pack: its manifest and shards stay untouched.

        A run killed between publishing the manifest and its cleanup leaves the state directory
        and maybe partial files behind: they are removed.
        """
        m = kept.found.manifest
        assert m is not None, "a complete pack has a manifest"
        if self.remote is not None:
            clean_state(self.remote)
        shutil.rmtree(self.out / STATE_DIR, ignore_errors=True)
        remove_partials(self.out)
        return PackResult(
            m,
            self.out_name,
            self.elapsed(),
            m.num_samples,
            m.num_bytes,
            [],
            len(m.shards),
            reused=len(m.shards),
            plan=plan,
        )

    def elapsed(self) -> float:
        """Seconds since :func:`pack` was called."""
        return time.perf_counter() - self.started


def _stripe(out: Path, plan: PackPlan, options: PackOptions) -> None:
    """Give OUT the recommended Lustre layout for the plan's shards (``stripe_*`` override it) before
    any is created; does nothing elsewhere (:func:`stager.fs.lustre.prepare_pack_dir`)."""
    lustre.prepare_pack_dir(
        out,
        total_bytes=plan.est_bytes,
        num_shards=len(plan.shards),
        stripe_count=options.stripe_count,
        stripe_size=options.stripe_size,
        quiet=True,
    )


def _check_free_space(out: Path, todo: list[PlannedShard], *, passes_through: bool) -> None:
    """:class:`OutOfSpaceError` when the shards still to write cannot fit in OUT's free space."""
    # Only when sizes are known in advance (files pass through unchanged); re-encoding changes them.
    if not passes_through:
        return
    need = sum(s.est_bytes for s in todo)
    free = shutil.disk_usage(out).free
    if need > free:
        raise OutOfSpaceError(
            f"{out}: needs about {need / 1e9:.2f} GB but only {free / 1e9:.2f} GB is free; "
            "free space or choose another destination"
        )


def format_result(r: PackResult) -> str:
    """The CLI's line for ``r`` (the plan's table for a dry run)."""
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

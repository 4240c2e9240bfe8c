"""``stager pack``: turn a source (ImageFolder, CIFAR batches, list file, another pack) into shards.

Three steps, each with one job:

1. **Plan** (:func:`plan_shards`, pure): order the source's samples (a seeded permutation from
   ``stager.order.streams.pack_order(seed)`` unless ``keep_order``) and cut them into
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

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stager.errors import UsageError
from stager.formats import get_format
from stager.fs import lustre
from stager.fs.atomic import atomic_write_bytes, fsync_dir, remove_partials
from stager.manifest import MANIFEST_NAME, Manifest
from stager.pack.options import PackOptions
from stager.pack.plan import PackPlan, format_plan, plan_shards
from stager.pack.resume import PLAN_SCHEMA, check_destination, find_reusable, survey_out
from stager.pack.shard import STATE_DIR, ShardDone, ShardJob, write_shard
from stager.pack.sources.checks import probe_hw
from stager.pack.sources.select import open_source
from stager.progress import Progress


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


def _prepare_dir(out: Path, plan: PackPlan, stripe_count: int | None, stripe_size: int | None) -> None:
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
    opts = PackOptions(
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
    )
    pool = None
    if opts.workers > 1:
        from stager.pack.workers import PackPool

        pool = PackPool(opts.workers)  # started on first use; reused from listing to writing
    try:
        t0 = time.perf_counter()
        fmt = get_format(opts.format)
        # With workers, an ImageFolder lists its class folders on the pool (the only source that starts it
        # this early); other sources leave it to start at writing time and so be inherited by fork.
        source = open_source(src, split=opts.split, map_fn=pool.map if pool is not None else None)
        out_p = Path(os.path.abspath(os.fspath(out)))
        if source.kind == "pack" and out_p == source.root:
            raise UsageError(f"{out_p}: output is the source pack itself; choose another directory")
        # Keys are checked once for the whole plan (one pass), so writers need not check each one.
        check_keys = getattr(fmt, "check_keys", None)
        keys_checked = check_keys is not None
        if check_keys is not None:
            check_keys([r.key for r in source.refs], f"{source.root}: ")
        resize_t = opts.resize
        target_kind = fmt.sample_kind
        image_shape: tuple[int, int, int] | None = None
        if target_kind == "decoded":
            if resize_t:
                image_shape = (resize_t[0], resize_t[1], 3)
            elif source.image_shape is not None:
                image_shape = source.image_shape
            else:
                h, w = probe_hw(source, source.refs, skip_bad=opts.on_error == "skip")
                image_shape = (h, w, 3)
        options = {
            "resize": list(resize_t) if resize_t else None,
            "quality": opts.quality,
            "hash_algo": opts.hash_algo,
            "image_shape": list(image_shape) if image_shape else None,
        }
        plan = plan_shards(
            source.refs,
            opts.format,
            fmt.shard_name,
            classes=source.classes,
            options=options,
            samples_per_shard=opts.samples_per_shard,
            shard_size=opts.shard_size,
            seed=opts.seed,
            keep_order=opts.keep_order,
        )
        if opts.dry_run:
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
        check_destination(out_p, st, source, plan, opts.overwrite)
        reuse = find_reusable(out_p, st, plan, opts.hash_algo)
        manifest_opts = {
            "seed": opts.seed,
            "keep_order": opts.keep_order,
            "samples_per_shard": opts.samples_per_shard,
            "shard_size": opts.shard_size,
            "resize": options["resize"],
            "quality": opts.quality,
            "on_error": opts.on_error,
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
            remove_partials(out_p)
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
        (out_p / MANIFEST_NAME).unlink(missing_ok=True)
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
                    "format": opts.format,
                    "names": names,
                }
            ).encode(),
        )
        remove_partials(out_p)
        keep = set()
        for d in reuse.values():
            keep.add(d.info.name)
            keep.update(a.name for a in d.info.aux)
        for n in sorted(st.owned - keep):
            (out_p / n).unlink(missing_ok=True)
        for p in state.glob("*.json"):
            if p.name != "plan.json" and p.name[: -len(".json")] not in reuse:
                p.unlink(missing_ok=True)
        for d in reuse.values():  # re-record shards reused from a complete manifest
            atomic_write_bytes(state / f"{d.info.name}.json", json.dumps(d.to_json()).encode())
        _prepare_dir(out_p, plan, opts.stripe_count, opts.stripe_size)
        _check_free_space(out=out_p, plan=plan, reuse=reuse, passes_through=opts.passes_through(target_kind))

        todo = [s for s in plan.shards if s.name not in reuse]
        jobs = [
            ShardJob(
                str(out_p),
                s,
                opts,
                tuple(source.classes),
                target_kind,
                image_shape,
                keys_checked,
            )
            for s in todo
        ]
        progress = Progress(f"pack {opts.format}", total_items=sum(len(s.refs) for s in todo), quiet=opts.quiet)
        done: dict[str, ShardDone] = dict(reuse)
        try:
            if pool is None or not jobs or (len(jobs) == 1 and not hasattr(fmt, "open_fragment")):
                for job in jobs:
                    done[job.shard.name] = write_shard(job, source, progress)
            else:
                for d in pool.run(jobs, source, progress, state):
                    done[d.info.name] = d
        except BaseException:
            remove_partials(out_p)
            raise
        finally:
            source.close()
        progress.close()

        results = [done[n] for n in names]
        skipped = [s for d in results for s in d.skipped]
        m = Manifest(
            format=opts.format,
            classes=list(source.classes),
            shards=[d.info for d in results],
            source=source.describe(),
            options=manifest_opts,
            hash_algo=opts.hash_algo,
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


def _check_free_space(*, out: Path, plan: PackPlan, reuse: dict[str, ShardDone], passes_through: bool) -> None:
    # Only when sizes are known in advance (files pass through unchanged); re-encoding changes them.
    if not passes_through:
        return
    need = sum(s.est_bytes for s in plan.shards if s.name not in reuse)
    free = shutil.disk_usage(out).free
    if need > free:
        from stager.errors import OutOfSpaceError

        raise OutOfSpaceError(
            f"{out}: needs about {need / 1e9:.2f} GB but only {free / 1e9:.2f} GB is free; "
            "free space or choose another destination"
        )


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

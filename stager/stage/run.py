"""The engine of ``stager stage``: :func:`stage` (the documented API) and :func:`run_stage` as named phases.

1. **Plan** (:func:`~stager.stage.plan.plan_stage`): SRC's manifest is read and the plan made.
2. **Fast path**: a receipt that matches the plan and whose files all have the manifest's sizes
   means "done": return at once, no data read. Otherwise take the node lock
   (:class:`~stager.fs.lock.NodeLock`); whoever waited checks the receipt again, so of N concurrent
   callers exactly one copies. A receipt of a ``--no-fsync`` copy of this boot, asked for durably,
   is upgraded instead (one ``syncfs``, :func:`~stager.stage.dest.make_durable`).
3. **Claim and resume** (under the lock): refuse another dataset's DEST, remove stale
   ``<file>.<uuid>.partial`` files of this plan, read the journal and keep the files it lists that
   still have the right size; check free space for the rest (OutOfSpaceError: needed vs free).
4. **Copy** (:class:`~stager.stage.copier.Copier`): parallel streams, ordered for the source file
   system (:func:`~stager.stage.plan.order_for_streams`); meanwhile the main thread prepares the
   staged ``manifest.json``, published once every file is in place.
5. **Unpack** (``--unpack``, :func:`~stager.stage.unpack.run_unpack`): the ImageFolder tree; with
   ``--unpack only`` the shards are streamed from SRC and none is kept.
6. **Seal**: files kept from a ``--no-fsync`` run of this boot are flushed before a durable
   receipt; in shared mode this node writes its done marker and waits for every node's
   (:func:`~stager.stage.dest.shared_barrier`); the receipt (:mod:`stager.receipt`) is written last,
   atomically.

Shared mode: each node copies its byte-balanced share, writes ``.stager-done.node<i>-of-<n>.json``
and waits for every node's marker; then the receipt (mode ``shared``) lists every shard.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from stager.cache.history import record_stage
from stager.errors import UsageError
from stager.formats import format_spec
from stager.fs.atomic import fsync_dir
from stager.fs.copy import CopyTuning
from stager.fs.info import detect_fs
from stager.fs.kernel import syncfs
from stager.fs.lock import NodeLock
from stager.fs.open import is_url
from stager.manifest import Manifest
from stager.progress import Progress
from stager.receipt import RECEIPT_NAME
from stager.redact import redact
from stager.stage.copier import Copier
from stager.stage.dest import (
    StagedManifest,
    begin_journal,
    check_free_space,
    claim_dest,
    confirm_staged,
    kept_files,
    make_dest_dir,
    make_durable,
    receipt_done,
    shared_barrier,
    write_receipt,
)
from stager.stage.journal import Journal
from stager.stage.options import DEFAULT_UNPACK_DIR, NodeOptions, StageOptions, unpack_mode
from stager.stage.plan import DEFAULT_BLOCK, FileTask, StagePlan, order_for_streams, plan_stage, read_src_manifest
from stager.stage.result import StageResult

REMOTE_STREAMS = 8  # default copy streams when SRC is a URL


def stage(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    *,
    workers: int | None = None,
    unpack: bool | str = False,
    partition: bool = False,
    shared: bool | None = None,
    node: int | None = None,
    num_nodes: int | None = None,
    ranks_per_node: int | None = None,
    seed: int = 0,
    json: bool = False,
    quiet: bool = True,
    timeout: float | None = None,
    unpack_dir: str = DEFAULT_UNPACK_DIR,
    storage_options: dict[str, Any] | None = None,
    tuning: CopyTuning | None = None,
    fsync: bool = True,
    repair: bool = False,
    mount: bool = False,
) -> StageResult:
    """Stage SRC (packed dir or its manifest.json; local or fsspec URL) into DEST; see module doc.

    ``unpack``: False, True/"also" (shards and an ImageFolder tree) or "only" (tree only).
    ``timeout`` bounds the wait for the node lock and for peers in shared mode (None: no limit).
    ``tuning`` overrides the copy engine's block size, write-behind window and finisher threads
    (:class:`~stager.fs.copy.CopyTuning`; benchmarks).
    ``fsync=False`` (``--no-fsync``): verified copies are renamed without fsync and the call returns
    with the data possibly still in the page cache, as ``cp`` and ``dcp`` do; journal and receipt
    are marked with the boot id, so after a reboot the copy is not trusted and is staged again.
    Shared DEST always fsyncs (other nodes read what this one wrote).
    ``repair=True`` (``--repair``): hash DEST's copies again and copy again what differs
    (:mod:`stager.stage.repair`); without it a receipt that covers the plan means "done" (sizes only).
    ``mount=True`` (``--mount``): then mount each staged image read-only under ``DEST/mnt``
    (:mod:`stager.stage.mount`); ``stager clean`` unmounts them.
    Raises StagerError subclasses (exit codes in stager.errors).
    """
    del json  # output formatting belongs to the CLI; accepted for API symmetry
    options = StageOptions(
        workers=workers, unpack=unpack_mode(unpack), unpack_dir=unpack_dir, partition=partition, shared=shared,
        node=NodeOptions(node, num_nodes, ranks_per_node), seed=seed, timeout=timeout, quiet=quiet,
        storage_options=storage_options or {}, tuning=tuning, fsync=fsync, repair=repair, mount=mount,
    )
    return run_stage(src, dest, options)


def run_stage(src: str | os.PathLike[str], dest: str | os.PathLike[str] | None, options: StageOptions
              ) -> StageResult:
    """:func:`stage` with its options in one object (the CLI's entry, and the collective's fallback)."""
    plan, result = _run_stage(src, dest, options)
    if options.mount and plan is not None:  # after the verified copy, or when DEST already held it
        with NodeLock(plan.lock_path, timeout=options.timeout):
            from stager.stage.mount import mount_staged  # noqa: PLC0415 (only with --mount)

            mount_staged(plan, result)
    return result


def _run_stage(src: str | os.PathLike[str], dest: str | os.PathLike[str] | None, options: StageOptions
               ) -> tuple[StagePlan | None, StageResult]:
    """Phases 1 to 6; the plan (None for ``--cache-only``: no DEST) and the result."""
    t0 = time.perf_counter()
    _ignore_sigxfsz()
    manifest, manifest_bytes = read_src_manifest(src, options.storage_options)
    if options.cache is not None and options.cache.only:
        return None, _fill_cache_only(src, manifest, manifest_bytes, options, t0)
    plan = plan_stage(src, manifest, manifest_bytes, dest, options)
    if options.mount:
        from stager.stage.mount import check_mountable  # noqa: PLC0415 (only with --mount: subprocess, mounts)

        check_mountable(plan)  # before anything is copied
    result = _new_result(plan)
    if plan.mode == "shared" and options.cache is not None:
        raise UsageError(f"{plan.dest}: a shared (BeeOND) DEST is not node-local: stage it without --cache")
    if plan.dest_note:
        result.warnings.append(plan.dest_note)
    if plan.mode == "shared" and not options.fsync:
        options = replace(options, fsync=True)
        result.warnings.append("--no-fsync ignored: a shared DEST is always fsynced (other nodes read it)")
    result.durable = options.fsync
    if options.cache is not None and options.cache.quota is not None:
        options.cache.quota.check_fits(options.cache.dir, "--cache-quota")  # refused before DEST or the cache is made
    # First: a DEST that is not the user's is refused even when it looks staged. From here on DEST is
    # its real path, reached through no link anyone else could point elsewhere (docs/security.md).
    result.phases["plan"] = time.perf_counter() - t0
    with result.timed("dest"):
        plan = replace(plan, dest=make_dest_dir(plan))
        result.dest, result.receipt = str(plan.dest), str(plan.dest / RECEIPT_NAME)
        staged = _already_staged(plan, options, result, t0, locked=False)
    if staged:
        confirm_staged(plan)
        return plan, result
    with contextlib.ExitStack() as held:
        with result.timed("lock"):
            lock = held.enter_context(NodeLock(plan.lock_path, timeout=options.timeout,
                                               on_wait=None if options.quiet else _waiting(plan)))
        result.waited_s = lock.waited
        result.lock_takeover = lock.took_over
        if not _already_staged(plan, options, result, t0, locked=True):
            _stage_locked(plan, options, result, t0)
        with result.timed("finish"):
            confirm_staged(plan)  # ok only when DEST holds the verified manifest
            held.close()  # the node lock released
    with result.timed("finish"):
        _remember(plan, result)
    return plan, result


def _waiting(plan: StagePlan) -> Callable[[dict[str, Any]], None]:
    """Said once on stderr when the node lock is still held after a few seconds: never wait silently."""
    def tell(holder: dict[str, Any]) -> None:
        print(f"stager stage: waiting for {plan.lock_path}, held by pid {holder.get('pid', '?')} on "
              f"{holder.get('host', '?')} (another stage of this DEST; --timeout bounds the wait)",
              file=sys.stderr, flush=True)
    return tell


def _fill_cache_only(src: str | os.PathLike[str], manifest: Manifest, manifest_bytes: bytes,
                     options: StageOptions, t0: float) -> StageResult:
    """``--cache-only``: fill the cache with the plan's files, no DEST (:func:`stager.stage.cached.fill_only`)."""
    from stager.stage import cached  # noqa: PLC0415 (only with --cache)

    assert options.cache is not None
    plan = plan_stage(src, manifest, manifest_bytes, options.cache.dir, options)
    result = _new_result(plan)
    result.dest, result.receipt, result.mode = "", "", "cache-only"
    cached.fill_only(plan, options, result)
    result.seconds = time.perf_counter() - t0
    result.gbps = result.bytes_copied / max(result.seconds, 1e-9) / 1e9
    return result


def _remember(plan: StagePlan, result: StageResult) -> None:
    """One line of this user's staging history (``stager hints``: would a cache pay?)."""
    record_stage({"dataset_id": plan.manifest.dataset_id, "source": redact(plan.src), "bytes_total": result.bytes_total,
                  "bytes_copied": result.bytes_copied, "seconds": round(result.seconds, 3),
                  "already_staged": result.already_staged, "cache": (result.cache or {}).get("dir")})


def _ignore_sigxfsz() -> None:
    # With RLIMIT_FSIZE set, exceeding it kills the process with SIGXFSZ unless ignored; ignored,
    # the write fails with EFBIG and becomes a clean OutOfSpaceError.
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _new_result(plan: StagePlan) -> StageResult:
    return StageResult(
        ok=True, source=plan.src, dest=str(plan.dest), mode=plan.mode, dataset_id=plan.manifest.dataset_id,
        already_staged=False, files_total=len(plan.tasks), bytes_total=sum(t.bytes for t in plan.tasks),
        partition=plan.partition_info, node_source=plan.node_origin, receipt=str(plan.dest / RECEIPT_NAME),
    )


def _already_staged(plan: StagePlan, options: StageOptions, result: StageResult, t0: float, *,
                    locked: bool) -> bool:
    """The fast path: True (``result`` filled in) if DEST's receipt already covers the plan.

    Without the lock a receipt of a ``--no-fsync`` copy does not count for a durable run; with the
    lock held such a receipt is upgraded (flushed and marked durable) instead of copying again.
    """
    done = None if options.repair else receipt_done(plan)
    if done is None or (not locked and options.fsync and not done.durable):
        return False
    if locked and options.fsync and not done.durable:
        make_durable(plan, done)  # a --no-fsync copy of this boot, now asked for durably
    result.already_staged = True
    result.durable = options.fsync or done.durable
    result.seconds = time.perf_counter() - t0
    return True


def _stage_locked(plan: StagePlan, options: StageOptions, result: StageResult, t0: float) -> None:
    """Phases 3 to 6 of the module docstring, with the node lock held."""
    with result.timed("claim"):
        result.removed_partials = claim_dest(plan, keep_receipt=plan.mode == "shared")
        journal = Journal(plan.journal_path, plan.manifest.digest, volatile=not options.fsync)
        begin_journal(plan, journal)
    try:
        with result.timed("claim"):
            if options.repair:
                from stager.stage.repair import remove_damaged  # noqa: PLC0415 (only with --repair)

                result.repaired = remove_damaged(plan, options.copy_streams)
            kept = kept_files(plan, journal)
            todo = [t for t in plan.tasks if t.name not in kept]
            result.files_kept = len(plan.tasks) - len(todo)
            if options.cache is not None:
                from stager.stage import cached  # noqa: PLC0415 (only with --cache: a plain stage does not load the cache)

                todo = cached.place(plan, options, journal, todo, result)  # links and fills; the rest is copied below
            check_free_space(plan.dest, _space_needed(plan, journal, todo))
        both = _copied_while_unpacked(plan, options, journal, todo)
        with result.timed("copy"):
            staged = _copy(plan, options, journal, [t for t in todo if t.name not in both], result,
                           publish=not both)
        try:
            if plan.unpack:
                with result.timed("unpack"):
                    _unpack(plan, options, journal, result, both)
            if staged is not None and staged.publish() and options.fsync:
                fsync_dir(plan.dest)  # the manifest, once the shards the unpack phase copied are in place too
        finally:
            if staged is not None:
                staged.discard()
    finally:
        with result.timed("seal"):
            journal.close()
    with result.timed("seal"):
        _seal(plan, options, journal, result, t0)


def _space_needed(plan: StagePlan, journal: Journal, todo: list[FileTask]) -> int:
    """Bytes this run writes into DEST: the files to copy (kept with ``--unpack only``: one shard at a
    time, unless the format streams its members: tar), the unpacked tree (file bytes plus a 4 KiB block
    per file), the manifest."""
    m = plan.manifest
    unpack_bytes = 0
    if plan.unpack:
        for i in plan.shard_indices:
            s = m.shards[i]
            if s.name not in journal.unpacked:
                unpack_bytes += int(s.sizes.sum()) + 4096 * s.samples
    keep_shards = plan.unpack != "only"
    need = (sum(t.bytes for t in todo) if keep_shards else 0) + unpack_bytes + len(plan.manifest_bytes)
    if plan.unpack == "only" and not format_spec(m.format).stream_unpack:
        need += max((t.bytes for t in todo), default=0)  # one shard at a time passes through DEST
    return need


def _copied_while_unpacked(plan: StagePlan, options: StageOptions, journal: Journal, todo: list[FileTask]
                           ) -> set[str]:
    """The shard files of ``todo`` that the unpack phase copies as it unpacks them: ``--unpack`` of tar
    shards (one read of SRC writes the verified copy and the tree: :func:`stager.stage.unpack.run_unpack`).
    Not through a cache, nor with ``--direct`` (the copy streams' O_DIRECT writes); files the tree no
    longer needs (already unpacked) are copied by the copy streams."""
    if (plan.unpack != "also" or options.cache is not None or (options.tuning and options.tuning.direct)
            or not format_spec(plan.manifest.format).stream_unpack):
        return set()
    from stager.stage.unpack import shards_to_unpack  # noqa: PLC0415 (numpy: only with --unpack)

    names = {s.name for s in shards_to_unpack(plan, journal)}
    return {t.name for t in todo if t.name in names}


def _copy(plan: StagePlan, options: StageOptions, journal: Journal, todo: list[FileTask],
          result: StageResult, *, publish: bool = True) -> StagedManifest | None:
    """Copy ``todo`` with the copy streams and publish the staged manifest once they are all in place;
    with ``publish=False`` return it prepared instead, for the caller to publish once the files the
    unpack phase copies are in place too (None: published)."""
    src_fs = None if is_url(plan.src_dir) else detect_fs(plan.src_dir)
    result.source_fs = src_fs.fstype if src_fs else plan.src_dir.split("://", 1)[0]
    result.dest_fs = detect_fs(plan.dest).fstype
    block = (options.tuning and options.tuning.block) or DEFAULT_BLOCK
    ordered, result.ordering, result.block_size = order_for_streams(todo, src_fs, block)
    # From an object store the streams wait on the network, not the CPU: 8 by default (aws s3 cp: 10).
    result.workers = options.workers or (REMOTE_STREAMS if is_url(plan.src_dir) else options.copy_streams)
    staged_manifest = StagedManifest(plan)
    if not ordered or (plan.unpack == "only" and format_spec(plan.manifest.format).stream_unpack):
        # Nothing to copy (tar shards of --unpack only are streamed from SRC by the unpack phase).
        staged_manifest.prepare()
        if not publish:
            return staged_manifest
        if staged_manifest.publish():
            fsync_dir(plan.dest)
        return None
    progress = Progress("stage", total_items=len(ordered), total_bytes=sum(t.bytes for t in ordered),
                        unit="files", quiet=options.quiet)
    copier = Copier(plan, block=result.block_size, workers=result.workers, journal=journal, progress=progress,
                    warnings=result.warnings, tuning=options.tuning, fsync=options.fsync)
    try:
        copier.run(ordered, meanwhile=staged_manifest.prepare)
        if publish:
            staged_manifest.publish()
    except BaseException:
        staged_manifest.discard()
        raise
    finally:
        if publish:
            staged_manifest.discard()
        if copier.copied and options.fsync:
            fsync_dir(plan.dest)  # one directory fsync for every rename above
        progress.close()
    result.files_copied += copier.copied
    result.bytes_copied += copier.bytes
    result.io = ("direct" if copier.direct_files == len(ordered) else
                 "buffered" if copier.direct_files == 0 else "mixed")
    return None if publish else staged_manifest


def _unpack(plan: StagePlan, options: StageOptions, journal: Journal, result: StageResult,
            both: set[str]) -> None:
    """Write the ImageFolder tree (copying the shard files named in ``both`` as they are unpacked:
    :func:`_copied_while_unpacked`); with ``--unpack only`` remove the shards it was made from."""
    from stager.stage.unpack import run_unpack  # noqa: PLC0415 (numpy and the tar walk: only with --unpack)

    counts = run_unpack(plan, journal, workers=options.copy_streams, quiet=options.quiet, fsync=options.fsync,
                        keep=both)
    result.unpacked_files = counts.files
    result.bytes_copied += counts.streamed_bytes + counts.copied_bytes
    result.files_copied += counts.copied_files
    result.warnings += [w for w in counts.warnings if w not in result.warnings]
    result.unpacked = str(plan.dest / plan.unpack_dir)
    if plan.unpack == "only":
        for t in plan.tasks:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(plan.dest / t.name)


def _seal(plan: StagePlan, options: StageOptions, journal: Journal, result: StageResult, t0: float) -> None:
    """Make what the run keeps durable, wait for the other nodes (shared mode), write the receipt."""
    if options.fsync and journal.has_volatile:
        # Files kept from a --no-fsync run of this boot were never fsynced: one flush before a
        # receipt that calls them durable.
        syncfs(plan.dest)
    if plan.mode == "shared":
        result.waited_s += shared_barrier(plan, options.timeout)
    result.seconds = time.perf_counter() - t0
    result.gbps = result.bytes_copied / max(result.seconds, 1e-9) / 1e9
    stats = {
        "files_copied": result.files_copied,
        "bytes_copied": result.bytes_copied,
        "files_kept": result.files_kept,
        "workers": result.workers,
        "block_size": result.block_size,
        "ordering": result.ordering,
        "source_fs": result.source_fs,
        "dest_fs": result.dest_fs,
        "unpacked_files": result.unpacked_files,
        "seconds": round(result.seconds, 3),
        "created_dest": not plan.explicit_dest,
    }
    # How each file was verified: hashed while copied now, unless cache.files says it was linked from the
    # cache ("cached, verified <time>": its seal, or a re-hash by this stage; stager/cache/seal.py).
    cache = result.cache and {**{k: result.cache[k] for k in ("dir", "kind", "links")},
                              "files": result.cache.get("verified", {})}
    verified = f"{plan.manifest.hash_algo} while copying" + ("; cached files: see cache.files" if cache else "")
    write_receipt(plan, verified=verified, stats=stats, durable=result.durable, cache=cache)


__all__ = ["run_stage", "stage"]

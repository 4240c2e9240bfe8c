"""``stager stage``: copy a packed dataset onto node-local storage, verified, resumable, once per node.

Plan (:func:`plan_stage`, pure): which files this node copies (all; its
:func:`~stager.partition.assign_shards_to_nodes` share with ``--partition``; its share of a shared
BeeOND namespace in ``shared`` mode), into which DEST, in which mode.

Engine (:func:`stage`):

1. A receipt that matches the plan and whose files all have the manifest's sizes means "done":
   return at once (no data read). Otherwise take the node lock (:class:`~stager.lock.NodeLock`);
   whoever waited re-checks the receipt, so of N concurrent callers exactly one copies.
2. Remove stale ``<file>.<uuid>.partial`` files of this plan; read the journal
   (``.stager-journal*.jsonl``: one line per verified file) and keep files that it lists and that
   still have the right size; check free space for the rest (OutOfSpaceError: needed vs free).
3. Copy with ``workers`` threads, each reading big blocks (a multiple of the Lustre stripe size on
   Lustre, else 8 MiB), hashing them (the manifest's algorithm) and writing them to
   ``<name>.<uuid>.partial``; size and hash are compared with the manifest at EOF (no second read),
   then fsync, chmod (the source's mode minus what it does not grant), chgrp, rename, journal.
   From Lustre, the order interleaves files by first OST so simultaneous streams hit different OSTs.
4. ``manifest.json`` is copied verbatim, ``--unpack`` writes the ImageFolder tree, and the receipt
   (:mod:`stager.receipt`) is written last, atomically.

Shared mode: each node copies its byte-balanced share, writes ``.stager-done.node<i>-of-<n>.json``
and waits for every node's marker; then the receipt (mode ``shared``) lists every shard.

``$STAGER_TEST_THROTTLE_BPS`` (test-only) limits each copy stream to that many bytes/s so that
tests can kill a run mid-copy; ``$STAGER_TEST_FREE_BYTES`` (test-only) overrides the free-space
figure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from stager.errors import DestinationError, OutOfSpaceError, UsageError
from stager.fs.access import chgrp_quiet, size_or_missing, source_access
from stager.fs.atomic import atomic_write_bytes, commit_partial, fsync_dir, remove_partials
from stager.fs.copy import CopyTuning
from stager.fs.info import detect_fs
from stager.fs.kernel import syncfs
from stager.fs.lock import NodeLock
from stager.manifest import MANIFEST_NAME, manifest_path
from stager.progress import Progress
from stager.receipt import RECEIPT_NAME
from stager.stage.copier import _Copier
from stager.stage.dest import (
    _free_bytes,
    _gb,
    _make_durable,
    _manifest_mode,
    _mkdir_dest,
    _read_quiet,
    _receipt_done,
    _shared_barrier,
    _write_partial,
    _write_receipt,
    load_receipt_quiet,
)
from stager.stage.journal import Journal
from stager.stage.plan import (
    DEFAULT_BLOCK,
    DEFAULT_UNPACK_DIR,
    StagePlan,
    order_for_streams,
    plan_stage,
    read_source_manifest,
)
from stager.stage.result import StageResult


def _ignore_sigxfsz() -> None:
    # With RLIMIT_FSIZE set, exceeding it kills the process with SIGXFSZ unless ignored; ignored,
    # the write fails with EFBIG and becomes a clean OutOfSpaceError.
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


# ---- the command ------------------------------------------------------------------------------------
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
) -> StageResult:
    """Stage SRC (packed dir or its manifest.json; local or fsspec URL) into DEST; see module doc.

    ``unpack``: False, True/"also" (shards and an ImageFolder tree) or "only" (tree only).
    ``timeout`` bounds the wait for the node lock and for peers in shared mode (None: no limit).
    ``tuning`` overrides the copy engine's block size, write-behind window and finisher threads
    (:class:`~stager.copyengine.CopyTuning`; benchmarks).
    ``fsync=False`` (``--no-fsync``): verified copies are renamed without fsync and the call returns
    with the data possibly still in the page cache, as ``cp`` and ``dcp`` do; journal and receipt
    are marked with the boot id, so after a reboot the copy is not trusted and is staged again.
    Shared DEST always fsyncs (other nodes read what this one wrote).
    Raises StagerError subclasses (exit codes in stager.errors).
    """
    del json  # output formatting belongs to the CLI; accepted for API symmetry
    t0 = time.perf_counter()
    _ignore_sigxfsz()
    src = os.fspath(src)
    unpack_mode = {False: None, None: None, True: "also", "also": "also", "only": "only"}.get(unpack, unpack)
    if "://" not in src and not os.path.exists(src):
        from stager.errors import SourceNotFoundError

        raise SourceNotFoundError(f"{src}: no such packed dataset; give the `stager pack` output directory")
    manifest, mbytes = read_source_manifest(src, storage_options)
    plan = plan_stage(src, manifest, mbytes, dest, partition=partition, shared=shared, node=node,
                      num_nodes=num_nodes, ranks_per_node=ranks_per_node, seed=seed,
                      unpack=unpack_mode if isinstance(unpack_mode, str) or unpack_mode is None else "also",
                      unpack_dir=unpack_dir, storage_options=storage_options)
    result = StageResult(
        ok=True, source=plan.source, dest=str(plan.dest), mode=plan.mode, dataset_id=manifest.dataset_id,
        already_staged=False, files_total=len(plan.tasks), bytes_total=sum(t.bytes for t in plan.tasks),
        partition=plan.partition_info, node_source=plan.node_source,
        receipt=str(plan.dest / RECEIPT_NAME),
    )
    if plan.mode == "shared" and not fsync:
        fsync = True
        result.warnings.append("--no-fsync ignored: a shared DEST is always fsynced (other nodes read it)")
    result.durable = fsync
    done = _receipt_done(plan)
    if done is not None and (done.durable or not fsync):
        result.already_staged = True
        result.durable = done.durable
        result.seconds = time.perf_counter() - t0
        return result
    _mkdir_dest(plan.dest, plan.src_root)
    with NodeLock(plan.lock_path, timeout=timeout) as lock:
        result.waited_s = lock.waited
        result.lock_takeover = lock.took_over
        done = _receipt_done(plan)
        if done is not None:
            if fsync and not done.durable:
                _make_durable(plan, done)  # a --no-fsync copy of this boot, now asked for durably
            result.already_staged = True
            result.durable = fsync or done.durable
            result.seconds = time.perf_counter() - t0
            return result
        _stage_locked(plan, result, t0=t0, workers=workers, quiet=quiet, timeout=timeout, tuning=tuning,
                      fsync=fsync)
    return result


def _stage_locked(plan: StagePlan, result: StageResult, *, t0: float, workers: int | None, quiet: bool,
                  timeout: float | None, tuning: CopyTuning | None = None, fsync: bool = True) -> None:
    dest = plan.dest
    m = plan.manifest
    existing = load_receipt_quiet(dest)
    if existing is not None and existing.dataset_id != m.dataset_id and not existing.manifest_digest.endswith(
        m.digest
    ):
        raise DestinationError(
            f"{dest}: already holds another staged dataset ({existing.source}, id {existing.dataset_id}); "
            f"run `stager clean {dest}` first or choose another DEST"
        )
    if existing is not None and plan.mode != "shared":
        # The old receipt no longer describes DEST once we start changing it.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest / RECEIPT_NAME)
    names = {t.name for t in plan.tasks} | {plan.journal_path.name}
    if plan.mode != "shared":
        # On a shared DEST another node may be writing the manifest or receipt right now: its
        # partial files are not stale, so only a node-private DEST cleans them up.
        names |= {MANIFEST_NAME, RECEIPT_NAME}
    result.removed_partials = remove_partials(dest, names)
    journal = Journal(plan.journal_path, m.digest, volatile=not fsync)
    try:
        keep = {t.name for t in plan.tasks
                if journal.files.get(t.name) == t.bytes and size_or_missing(dest / t.name) == t.bytes}
        todo = [t for t in plan.tasks if t.name not in keep]
        result.files_kept = len(plan.tasks) - len(todo)
        unpack_bytes = 0
        if plan.unpack:
            for i in plan.mine:
                s = m.shards[i]
                if s.name not in journal.unpacked:
                    unpack_bytes += int(s.sizes.sum()) + 4096 * s.samples
        keep_shards = plan.unpack != "only"
        need = (sum(t.bytes for t in todo) if keep_shards else 0) + unpack_bytes + len(plan.manifest_bytes)
        if plan.unpack == "only" and m.format != "tar":
            need += max((t.bytes for t in todo), default=0)  # one shard at a time passes through DEST
        free = _free_bytes(dest)
        if need > free:
            raise OutOfSpaceError(
                f"{dest}: staging needs {_gb(need)} but only {_gb(free)} is free; free space, stage a "
                "--partition share, or choose another DEST"
            )
        src_fs = detect_fs(plan.src_root) if "://" not in plan.src_root else None
        result.source_fs = src_fs.fstype if src_fs else plan.src_root.split("://", 1)[0]
        result.dest_fs = detect_fs(dest).fstype
        ordered, how, block = order_for_streams(todo, src_fs, (tuning and tuning.block) or DEFAULT_BLOCK)
        nworkers = workers or min(8, max(2, os.cpu_count() or 2))
        if nworkers < 1:
            raise UsageError(f"--workers must be >= 1, got {nworkers}")
        result.ordering, result.workers, result.block_size = how, nworkers, block
        tar_stream_only = plan.unpack == "only" and m.format == "tar"
        # The manifest, verbatim (it is what makes DEST a packed directory for the loader): written and
        # fsynced by the main thread while the streams copy, renamed only once every shard is in
        # place, so a failed run never leaves a manifest that promises missing shards.
        mpath = dest / MANIFEST_NAME
        mtmp: list[Path | None] = [None]

        def prepare_manifest() -> None:
            if mtmp[0] is None and _read_quiet(mpath) != plan.manifest_bytes:
                tmp = _write_partial(mpath, plan.manifest_bytes, _manifest_mode(plan))
                chgrp_quiet(tmp, source_access(manifest_path(plan.source))[1])  # the source's group
                mtmp[0] = tmp

        if not tar_stream_only and ordered:
            progress = Progress("stage", total_items=len(ordered), total_bytes=sum(t.bytes for t in ordered),
                                unit="files", quiet=quiet)
            copier = _Copier(plan, block=block, workers=nworkers, journal=journal, progress=progress,
                             warnings=result.warnings, tuning=tuning, fsync=fsync)
            try:
                copier.run(ordered, meanwhile=prepare_manifest)
                if mtmp[0] is not None:
                    tmp, mtmp[0] = mtmp[0], None
                    try:
                        os.replace(tmp, mpath)
                    except FileNotFoundError:
                        # Shared DEST: another node starting up removed it as a stale partial.
                        if _read_quiet(mpath) != plan.manifest_bytes:
                            atomic_write_bytes(mpath, plan.manifest_bytes, mode=_manifest_mode(plan))
            finally:
                if mtmp[0] is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(mtmp[0])
                if copier.copied and fsync:
                    fsync_dir(dest)  # one directory fsync for every rename above
                progress.close()
            result.files_copied, result.bytes_copied = copier.copied, copier.bytes
            result.io = ("direct" if copier.direct_files == len(ordered) else
                         "buffered" if copier.direct_files == 0 else "mixed")
        else:
            prepare_manifest()
            if mtmp[0] is not None:
                commit_partial(mtmp[0], mpath)
        if plan.unpack:
            from stager.stage.unpack import run_unpack

            result.unpacked_files = run_unpack(plan, journal, nworkers, quiet, result, fsync=fsync)
            result.unpacked = str(dest / plan.unpack_dir)
            if plan.unpack == "only":
                for t in plan.tasks:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(dest / t.name)
    finally:
        journal.close()
    if fsync and journal.has_volatile:
        # Files kept from a --no-fsync run of this boot were never fsynced: one flush before a
        # receipt that calls them durable.
        syncfs(dest)
    if plan.mode == "shared":
        _shared_barrier(plan, result, timeout)
    result.seconds = time.perf_counter() - t0
    result.gbps = result.bytes_copied / max(result.seconds, 1e-9) / 1e9
    _write_receipt(plan, result)


__all__ = ["stage"]

"""``stager stage --collective``: every node ends with the dataset, the shared file system serves it once.

Launched with one process per node (``srun --ntasks-per-node=1``, ``torchrun --nnodes N
--nproc-per-node 1``, ``mpirun -N 1``), the processes form a ``torch.distributed`` group
(:mod:`~stager.stage.collective.group`) and, in :func:`run_collective`'s phases:

1. agree on what is already verified (each node's journal, as a bitmap over the manifest's files:
   files every node has are not sent again; a file only the reader has is read from its DEST);
2. split the remaining shards into disjoint, byte-balanced *read shares*
   (:func:`~stager.stage.collective.plan.assign_read_shares`; OST-balanced on Lustre, node 0 asks
   ``lfs`` once and shares the answer);
3. exchange (:class:`~stager.stage.collective.exchange.Exchange`): at step ``s`` every node reads
   chunk ``s`` of its share from SRC and ``all_gather``\\ s it; each node's chunk is streamed into
   ``<name>.<uuid>.partial`` files, hashed while written, and a file is renamed once its size and
   checksum match the manifest (:mod:`~stager.stage.collective.io`). Memory: 2 send chunks and 2
   receive buffers of ``N`` chunks; the chunk shrinks as ``N`` grows to stay within ``memory_bytes``;
4. writes the manifest and the receipt (mode ``full``, verified "<algo> while copying (collective)").

So SRC serves each byte once in total (not once per node) and each node's NIC carries the dataset
once. With ``partition=True`` a node needs only its own share, which it reads directly (a plain
``--partition`` stage): no exchange, SRC bytes are still 1x; the group then only sums the statistics
and fails together.

Resume and locking are the plain stage's (:mod:`stager.stage.dest`): the same node lock, journal,
stale-partial cleanup, free-space check, staged manifest and receipt, written with SRC's access, so a
rerun, collective or not, keeps every verified file. If the group cannot form within ``timeout``
seconds, ``fallback="direct"`` stages from SRC without peers and ``"none"`` fails with exit code 5.
A node that dies or stalls makes every node exit with code 5 within the timeout, naming it (see
:mod:`~stager.stage.collective.group`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from stager.errors import StagerError
from stager.fs import lustre
from stager.fs.atomic import fsync_dir
from stager.fs.info import detect_fs
from stager.fs.lock import NodeLock
from stager.fs.open import is_url
from stager.progress import Progress
from stager.receipt import RECEIPT_NAME
from stager.stage.collective.exchange import Exchange
from stager.stage.collective.group import Group, RendezvousError, resolve_endpoint
from stager.stage.collective.io import IoCounters, ShareReader, StreamSink
from stager.stage.collective.plan import FileEntry, StreamLayout, assign_read_shares, chunk_size_for, stream_layouts
from stager.stage.collective.result import CollectiveResult, node_stats, totals
from stager.stage.dest import (
    StagedManifest,
    begin_journal,
    check_free_space,
    claim_dest,
    kept_files,
    make_dest_dir,
    receipt_done,
    write_receipt,
)
from stager.stage.journal import Journal
from stager.stage.options import CollectiveOptions, NodeOptions, StageOptions
from stager.stage.plan import StagePlan, plan_stage, read_src_manifest
from stager.stage.result import StageResult
from stager.stage.run import run_stage


def stage_collective(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str] | None = None,
    *,
    partition: bool = False,
    node: int | None = None,
    num_nodes: int | None = None,
    ranks_per_node: int | None = None,
    seed: int = 0,
    timeout: float = 300.0,
    fallback: str = "direct",
    backend: str = "gloo",
    chunk_bytes: int = 8 << 20,
    memory_bytes: int = 256 << 20,
    master_addr: str | None = None,
    master_port: int | None = None,
    quiet: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> CollectiveResult:
    """Stage SRC into every node's DEST, reading each byte from SRC once (see module docstring).

    Run by exactly one process per node, all with the same arguments. ``timeout`` bounds the
    rendezvous and every collective. Raises :class:`~stager.errors.StagerTimeoutError` (exit 5) when
    a peer fails or the group cannot form and ``fallback="none"``.
    """
    stage_options = StageOptions(partition=partition, node=NodeOptions(node, num_nodes, ranks_per_node), seed=seed,
                                 timeout=timeout, quiet=quiet, storage_options=storage_options or {})
    options = CollectiveOptions(stage=stage_options, fallback=fallback, backend=backend, chunk_bytes=chunk_bytes,
                                memory_bytes=memory_bytes, master_addr=master_addr, master_port=master_port)
    return run_collective(src, dest, options)


def run_collective(src: str | os.PathLike[str], dest: str | os.PathLike[str] | None, options: CollectiveOptions,
                   *, group: Group | None = None) -> CollectiveResult:
    """:func:`stage_collective` with its options in one object (the CLI's entry). ``group``: a group already
    formed by :func:`form_group` (staging a mix's streams one after another); it is left open."""
    t0 = time.perf_counter()
    manifest, manifest_bytes = read_src_manifest(src, options.stage.storage_options)
    identity = options.stage.node.resolve()  # the group's rank is the node index, even for a full copy
    options = replace(options, stage=replace(options.stage, node=NodeOptions.of(identity)))
    plan = plan_stage(src, manifest, manifest_bytes, dest, options.stage)
    res = CollectiveResult(
        ok=True, source=plan.src, dest=str(plan.dest), mode=plan.mode, node=identity.node,
        num_nodes=identity.num_nodes, dataset_id=manifest.dataset_id, dataset_bytes=manifest.num_bytes,
        backend=options.backend, receipt=str(plan.dest / RECEIPT_NAME),
    )
    if plan.dest_note:
        res.warnings.append(plan.dest_note)
    if identity.num_nodes == 1:
        return _without_peers(src, dest, options.stage, res, t0=t0, reason="single node")
    own = group is None
    if group is None:
        group = _form_group(options, identity.node, identity.num_nodes, res)
    if group is None:
        return _without_peers(src, dest, options.stage, res, t0=t0, reason="direct")
    res.group_s = time.perf_counter() - t0  # includes importing torch and waiting for the last node
    failed = True
    try:
        t_data = time.perf_counter()
        if plan.mode == "partition":
            # A node's partition share is read straight from SRC: nothing to exchange.
            _record_plain_stage(res, run_stage(src, dest, options.stage))
            res.share_shards = len(plan.shard_indices)
        else:
            plan = replace(plan, dest=make_dest_dir(plan))  # its real path: no link anyone else can re-point
            with NodeLock(plan.lock_path, timeout=options.timeout):
                _stage_full(plan, group, res, options)
        res.exchange_s = time.perf_counter() - t_data
        res.seconds = time.perf_counter() - t0
        res.gbps = res.written_bytes / max(res.seconds, 1e-9) / 1e9
        res.totals = _gather_totals(group, res)
        failed = False
    except StagerError as exc:
        group.fail(f"failed: {exc}")
        raise
    except BaseException as exc:
        group.fail(f"failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        if own or failed:
            group.close(failed=failed)
    return res


def form_group(options: CollectiveOptions) -> tuple[Group | None, list[str]]:
    """The group of this node's collective stage, formed once for several datasets (a mix's streams):
    ``(group, warnings)``; None on a single node, or when it cannot form and ``fallback="direct"`` (the
    reason in the warnings; ``"none"`` raises). Close it with ``group.close()``."""
    identity = options.stage.node.resolve()
    if identity.num_nodes == 1:
        return None, []
    res = CollectiveResult(ok=True, source="", dest="", mode="", node=identity.node, num_nodes=identity.num_nodes,
                           dataset_id="", dataset_bytes=0, backend=options.backend, receipt="")
    group = _form_group(options, identity.node, identity.num_nodes, res)
    return group, res.warnings


# ---- without an exchange ----------------------------------------------------------------------------
def _without_peers(src: str | os.PathLike[str], dest: str | os.PathLike[str] | None, options: StageOptions,
                   res: CollectiveResult, *, t0: float, reason: str) -> CollectiveResult:
    """A plain stage from SRC (one node, or the group did not form and ``fallback="direct"``)."""
    _record_plain_stage(res, run_stage(src, dest, options))
    res.collective, res.fallback = False, reason
    res.seconds = time.perf_counter() - t0
    res.gbps = res.written_bytes / max(res.seconds, 1e-9) / 1e9
    res.totals = totals([node_stats(res)])
    return res


def _record_plain_stage(res: CollectiveResult, sr: StageResult) -> None:
    res.dest = sr.dest
    res.files_written, res.files_kept = sr.files_copied, sr.files_kept
    res.src_bytes = res.written_bytes = sr.bytes_copied
    res.warnings += sr.warnings
    res.cache = sr.cache


def _form_group(options: CollectiveOptions, node: int, num_nodes: int, res: CollectiveResult) -> Group | None:
    """The formed group, or None when it could not form and ``fallback="direct"`` (the reason warned)."""
    addr, port = resolve_endpoint(master_addr=options.master_addr, master_port=options.master_port)
    group = Group(node, num_nodes, addr=addr, port=port, timeout=options.timeout, backend=options.backend)
    try:
        group.form()
    except RendezvousError as exc:
        if options.fallback == "none":
            raise
        res.warnings.append(str(exc))
        return None
    return group


def _gather_totals(group: Group, res: CollectiveResult) -> dict[str, Any]:
    import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)

    everyone: list[Any] = [None] * group.num_nodes
    group.collective(dist.all_gather_object, everyone, node_stats(res))
    return totals(everyone)


# ---- the full copy, exchanged ---------------------------------------------------------------------
def _stage_full(plan: StagePlan, group: Group, res: CollectiveResult, options: CollectiveOptions) -> None:
    """Phases 1 to 4 of the module docstring, with the node lock held."""
    claim_dest(plan, keep_receipt=receipt_done(plan) is not None)
    journal = Journal(plan.journal_path, plan.manifest.digest)
    begin_journal(plan, journal)
    cache_run, lease = None, None
    try:
        if options.stage.cache is not None:
            from stager.stage import cached  # noqa: PLC0415 (only with --cache)

            # Cached files are linked into DEST and journaled first: the exchange then counts them as held.
            cache_run, lease = cached.link_hits(plan, options.stage, journal, res.warnings)
        have = kept_files(plan, journal)  # grows as the sinks verify files
        res.files_kept = len(have)
        files = [FileEntry(t.name, t.bytes, t.hash, t.shard) for t in plan.tasks]
        check_free_space(plan.dest, sum(f.bytes for f in files if f.name not in have) + len(plan.manifest_bytes))
        layouts = _read_shares(plan, group, _held_by_every_node(group, files, have), res)
        chunk = chunk_size_for(group.num_nodes, options.chunk_bytes, options.memory_bytes)
        res.steps, res.chunk_bytes = max(lay.steps(chunk) for lay in layouts), chunk
        counters = _exchange(plan, group, journal, layouts=layouts, have=have, res=res, quiet=options.stage.quiet)
        missing = [f.name for f in files if f.name not in have]
        if missing:
            raise StagerError(f"{plan.dest}: internal error: {len(missing)} files not received (first: "
                              f"{missing[0]}); rerun")
        res.src_bytes, res.local_bytes = counters.src_bytes, counters.local_bytes
        res.exchange_bytes, res.written_bytes = counters.received_bytes, counters.written_bytes
        res.files_written = counters.files_written
        manifest = StagedManifest(plan)
        manifest.prepare()
        if manifest.publish():
            fsync_dir(plan.dest)
        if cache_run is not None:
            from stager.stage import cached  # noqa: PLC0415 (only with --cache)

            res.cache = cached.adopt(cache_run)  # what this node received (and the sample index), into its cache
    finally:
        if lease is not None:
            lease.release()
        journal.close()
    stats = {"collective": True, "num_nodes": res.num_nodes, "node": res.node, "src_bytes": res.src_bytes,
             "exchange_bytes": res.exchange_bytes, "files_written": res.files_written,
             "files_kept": res.files_kept, "chunk_bytes": res.chunk_bytes, "steps": res.steps,
             "created_dest": not plan.explicit_dest}
    cache = res.cache and {**{k: res.cache[k] for k in ("dir", "kind", "links")},
                           "files": res.cache.get("verified", {})}
    verified = f"{plan.manifest.hash_algo} while copying (collective)" + ("; cached files: see cache.files"
                                                                            if cache else "")
    write_receipt(plan, verified=verified, stats=stats, cache=cache)


def _held_by_every_node(group: Group, files: list[FileEntry], have: set[str]) -> set[str]:
    """Phase 1: the files every node already holds verified (one bitmap per node, all-gathered)."""
    import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)

    mine = np.packbits(np.array([f.name in have for f in files], dtype=bool)).tobytes()
    bitmaps: list[Any] = [None] * group.num_nodes
    group.collective(dist.all_gather_object, bitmaps, mine)
    held = np.ones(len(files), dtype=bool)
    for b in bitmaps:
        held &= np.unpackbits(np.frombuffer(b, dtype=np.uint8), count=len(files)).astype(bool)
    return {f.name for f, h in zip(files, held, strict=True) if h}


def _read_shares(plan: StagePlan, group: Group, skip: set[str], res: CollectiveResult) -> list[StreamLayout]:
    """Phase 2: every node's read share as a stream layout, without the files in ``skip``."""
    import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)

    osts_box: list[Any] = [_shard_osts(plan) if group.node == 0 else None]
    group.collective(dist.broadcast_object_list, osts_box, src=0)
    shares = assign_read_shares(plan.manifest, group.num_nodes, plan.seed, osts_box[0])
    res.share_shards = len(shares[group.node])
    return stream_layouts(plan.manifest, shares, skip)


def _exchange(plan: StagePlan, group: Group, journal: Journal, *, layouts: list[StreamLayout], have: set[str],
              res: CollectiveResult, quiet: bool) -> IoCounters:
    """Phase 3: read this node's share, receive everyone's, write and journal verified files."""
    dest = plan.dest
    counters = IoCounters()

    def verified(entry: FileEntry) -> None:
        journal.add_file(entry.name, entry.bytes)

    reader = ShareReader(plan.src_dir, dest, layouts[group.node], counters=counters, local_have=set(have),
                         storage_options=plan.storage_options)
    sinks = [
        StreamSink(dest, lay, algo=plan.manifest.hash_algo, counters=counters, have=have, on_verified=verified,
                   origin=f" from node {lay.node}", from_peer=lay.node != group.node,
                   access=plan.src_access)  # the plain stage's rule, given before the rename
        for lay in layouts
    ]
    progress = Progress("stage --collective", total_items=res.steps, total_bytes=None, unit="steps", quiet=quiet)
    try:
        Exchange(group, reader, sinks=sinks, steps=res.steps, chunk=res.chunk_bytes, progress=progress).run()
    finally:
        for s in sinks:
            s.abort()
        progress.close()
    fsync_dir(dest)
    return counters


def _shard_osts(plan: StagePlan) -> list[int] | None:
    """First OST of every shard when SRC is on Lustre and ``lfs`` is available, else None."""

    if is_url(plan.src_dir) or not lustre.lfs_path() or not detect_fs(plan.src_dir).is_lustre:
        return None

    def index(name: str) -> int:
        try:
            return lustre.stripe_index(os.path.join(plan.src_dir, name))
        except lustre.LfsError:
            return -1

    with ThreadPoolExecutor(8) as ex:
        return list(ex.map(index, [s.name for s in plan.manifest.shards]))


__all__ = ["CollectiveResult", "run_collective", "stage_collective"]

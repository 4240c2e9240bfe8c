"""``stager stage --collective``: every node ends with the dataset, the shared file system serves it once.

Launched with one process per node (``srun --ntasks-per-node=1``, ``torchrun --nnodes N
--nproc-per-node 1``, ``mpirun -N 1``), the processes form a ``torch.distributed`` group
(:mod:`stager.collective_group`) and:

1. agree on what is already verified (each node's journal, as a bitmap over the manifest's files:
   files every node has are not sent again; a file only the reader has is read from its DEST);
2. split the remaining shards into disjoint, byte-balanced *read shares*
   (:func:`stager.collective_plan.assign_read_shares`; OST-balanced on Lustre, node 0 asks ``lfs``
   once and shares the answer);
3. exchange: at step ``s`` every node reads chunk ``s`` of its share from SRC (a reader thread stays
   one chunk ahead) and ``all_gather``\\ s it; a writer thread streams each node's chunk into
   ``<name>.<uuid>.partial`` files, hashing as it writes, and renames a file once its size and
   checksum match the manifest (:mod:`stager.collective_io`). Memory: 2 send chunks and 2 receive
   buffers of ``N`` chunks; the chunk shrinks as ``N`` grows to stay within ``memory_bytes``;
4. writes the manifest and the receipt (mode ``full``, verified "<algo> while copying (collective)").

So SRC serves each byte once in total (not once per node) and each node's NIC carries the dataset
once. With ``partition=True`` a node needs only its own share, which it can read directly: no
exchange, SRC bytes are still 1x; the group then only sums the statistics and fails together.

Resume and locking are the plain stage's (:mod:`stager.stage`): the same node lock, journal and
receipt, so a rerun, collective or not, keeps every verified file. If the group cannot form within
``timeout`` seconds, ``fallback="direct"`` stages from SRC without peers and ``"none"`` fails with
exit code 5. A node that dies or stalls makes every node exit with code 5 within the timeout,
naming it (see :mod:`stager.collective_group`).

``$STAGER_TEST_COLLECTIVE_KILL=<node>:<step>`` (test-only) makes that node SIGKILL itself at that
exchange step, so tests can kill a node mid-exchange deterministically.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import DestinationError, OutOfSpaceError, StagerError, UsageError
from stager.fs.access import chgrp_quiet, size_or_missing, source_access
from stager.fs.atomic import atomic_write_bytes, fsync_dir, remove_partials
from stager.fs.lock import NodeLock
from stager.manifest import MANIFEST_NAME, Manifest, manifest_path
from stager.progress import Progress
from stager.receipt import RECEIPT_NAME, Receipt
from stager.stage.collective.group import Group, RendezvousError, resolve_endpoint
from stager.stage.collective.io import IoCounters, ShareReader, StreamSink
from stager.stage.collective.plan import FileEntry, assign_read_shares, chunk_size_for, plan_streams
from stager.stage.dest import _free_bytes, _receipt_done, load_receipt_quiet
from stager.stage.dest import _mkdir_dest as mkdir_dest
from stager.stage.journal import Journal
from stager.stage.plan import StagePlan, plan_stage, read_source_manifest, resolve_node
from stager.stage.run import stage as stage_node

KILL_ENV = "STAGER_TEST_COLLECTIVE_KILL"
FALLBACKS = ("direct", "none")


@dataclass
class CollectiveResult:
    """What one node did, plus ``totals`` summed over all nodes (identical on every node).

    ``src_bytes``: bytes this node read from SRC; ``exchange_bytes``: payload bytes it received
    from peers; ``totals["src_bytes"]`` equals the bytes that had to be staged (1x the dataset on a
    fresh run), whatever the node count.
    """

    ok: bool
    source: str
    dest: str
    mode: str
    node: int
    num_nodes: int
    dataset_id: str
    dataset_bytes: int
    collective: bool = True
    fallback: str | None = None
    files_written: int = 0
    files_kept: int = 0
    src_bytes: int = 0
    local_bytes: int = 0
    exchange_bytes: int = 0
    written_bytes: int = 0
    steps: int = 0
    chunk_bytes: int = 0
    group_s: float = 0.0
    exchange_s: float = 0.0
    seconds: float = 0.0
    gbps: float = 0.0
    backend: str = ""
    share_shards: int = 0
    receipt: str = ""
    totals: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        t = self.totals
        if self.fallback:
            head = f"node {self.node}/{self.num_nodes}: no peers, staged directly from SRC ({self.fallback})"
        else:
            head = f"node {self.node}/{self.num_nodes}: collective stage [{self.mode}] to {self.dest}"
        lines = [
            head,
            f"  this node: read {_gb(self.src_bytes)} from SRC, received {_gb(self.exchange_bytes)} from peers, "
            f"wrote {self.files_written} files ({_gb(self.written_bytes)}), kept {self.files_kept}, "
            f"{self.seconds:.2f} s, {self.gbps:.2f} GB/s",
        ]
        if t:
            ratio = t["src_bytes"] / self.dataset_bytes if self.dataset_bytes else 0.0
            lines.append(
                f"  all {self.num_nodes} nodes: SRC bytes read {_gb(t['src_bytes'])} ({ratio:.2f}x the dataset's "
                f"{_gb(self.dataset_bytes)}), exchanged {_gb(t['exchange_bytes'])}, slowest node {t['seconds']:.2f} s, "
                f"aggregate {t['gbps']:.2f} GB/s written"
            )
        return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


# ---- public wrappers of the plain stage's helpers (one implementation of resume and receipts) --------
def receipt_satisfies(plan: StagePlan) -> bool:
    """True if DEST's receipt already covers ``plan`` (sizes checked, nothing hashed)."""
    return _receipt_done(plan) is not None


def remove_stale_partials(plan: StagePlan) -> list[str]:
    """Delete ``<file>.<uuid>.partial`` leftovers of this plan's files in DEST."""
    names = {t.name for t in plan.tasks} | {MANIFEST_NAME, RECEIPT_NAME, plan.journal_path.name}
    return remove_partials(plan.dest, names)


def free_bytes(dest: Path) -> int:
    return _free_bytes(dest)


# ---- the command ------------------------------------------------------------------------------------
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
    if fallback not in FALLBACKS:
        raise UsageError(f"--fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if backend not in ("gloo", "nccl"):
        raise UsageError(f"backend must be gloo or nccl, got {backend!r}")
    t0 = time.perf_counter()
    src = os.fspath(src)
    if "://" not in src and not os.path.exists(src):
        from stager.errors import SourceNotFoundError

        raise SourceNotFoundError(f"{src}: no such packed dataset; give the `stager pack` output directory")
    manifest, mbytes = read_source_manifest(src, storage_options)
    n_idx, n_nodes, rpn, _ = resolve_node(node, num_nodes, ranks_per_node)
    plan = plan_stage(src, manifest, mbytes, dest, partition=partition, shared=False, node=n_idx,
                             num_nodes=n_nodes, ranks_per_node=rpn, seed=seed, storage_options=storage_options)
    res = CollectiveResult(
        ok=True, source=plan.source, dest=str(plan.dest), mode=plan.mode, node=n_idx, num_nodes=n_nodes,
        dataset_id=manifest.dataset_id, dataset_bytes=manifest.num_bytes, backend=backend,
        receipt=str(plan.dest / RECEIPT_NAME),
    )

    def direct(reason: str) -> CollectiveResult:
        sr = stage_node(src, dest, partition=partition, shared=False, node=n_idx, num_nodes=n_nodes,
                          ranks_per_node=rpn, seed=seed, quiet=quiet, timeout=timeout, storage_options=storage_options)
        res.collective, res.fallback = False, reason
        res.dest = sr.dest
        res.files_written, res.files_kept = sr.files_copied, sr.files_kept
        res.src_bytes = res.written_bytes = sr.bytes_copied
        res.seconds = time.perf_counter() - t0
        res.gbps = sr.bytes_copied / max(res.seconds, 1e-9) / 1e9
        res.warnings += sr.warnings
        res.totals = _totals([_stats(res)])
        return res

    if n_nodes == 1:
        return direct("single node")
    addr, port = resolve_endpoint(master_addr=master_addr, master_port=master_port)
    group = Group(n_idx, n_nodes, addr=addr, port=port, timeout=timeout, backend=backend)
    try:
        group.form()
    except RendezvousError as exc:
        if fallback == "none":
            raise
        res.warnings.append(str(exc))
        return direct("direct")
    res.group_s = time.perf_counter() - t0  # includes importing torch and waiting for the last node
    failed = True
    try:
        t_data = time.perf_counter()
        if partition:
            # A node's partition share is read straight from SRC: nothing to exchange.
            sr = stage_node(src, dest, partition=True, shared=False, node=n_idx, num_nodes=n_nodes,
                              ranks_per_node=rpn, seed=seed, quiet=quiet, timeout=timeout,
                              storage_options=storage_options)
            res.files_written, res.files_kept = sr.files_copied, sr.files_kept
            res.src_bytes = res.written_bytes = sr.bytes_copied
            res.share_shards = len(plan.mine)
            res.warnings += sr.warnings
        else:
            _mkdir_dest(plan)
            with NodeLock(plan.lock_path, timeout=timeout):
                _run_full(plan, group, res, chunk_bytes=chunk_bytes, memory_bytes=memory_bytes, quiet=quiet)
        res.exchange_s = time.perf_counter() - t_data
        res.seconds = time.perf_counter() - t0
        res.gbps = res.written_bytes / max(res.seconds, 1e-9) / 1e9
        import torch.distributed as dist

        everyone: list[Any] = [None] * n_nodes
        group.collective(dist.all_gather_object, everyone, _stats(res))
        res.totals = _totals(everyone)
        failed = False
    except StagerError as exc:
        group.fail(f"failed: {exc}")
        raise
    except BaseException as exc:
        group.fail(f"failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        group.close(failed=failed)
    return res


def _mkdir_dest(plan: StagePlan) -> None:
    mkdir_dest(plan.dest, plan.src_root)


def _stats(res: CollectiveResult) -> dict[str, Any]:
    return {"node": res.node, "src_bytes": res.src_bytes, "exchange_bytes": res.exchange_bytes,
            "written_bytes": res.written_bytes, "seconds": res.seconds, "local_bytes": res.local_bytes,
            "exchange_s": res.exchange_s}


def _totals(per_node: list[Any]) -> dict[str, Any]:
    secs = max(float(s["seconds"]) for s in per_node)
    written = sum(int(s["written_bytes"]) for s in per_node)
    return {
        "src_bytes": sum(int(s["src_bytes"]) for s in per_node),
        "exchange_bytes": sum(int(s["exchange_bytes"]) for s in per_node),
        "local_bytes": sum(int(s["local_bytes"]) for s in per_node),
        "written_bytes": written,
        "seconds": secs,
        "exchange_s": max(float(s.get("exchange_s", 0.0)) for s in per_node),
        "gbps": written / max(secs, 1e-9) / 1e9,
        "per_node": per_node,
    }


def _run_full(plan: StagePlan, group: Group, res: CollectiveResult, *, chunk_bytes: int,
              memory_bytes: int, quiet: bool) -> None:
    import torch.distributed as dist

    m = plan.manifest
    dest = plan.dest
    existing = load_receipt_quiet(dest)
    if existing is not None and existing.dataset_id != m.dataset_id:
        raise DestinationError(
            f"{dest}: already holds another staged dataset ({existing.source}, id {existing.dataset_id}); "
            f"run `stager clean {dest}` first or choose another DEST"
        )
    done_before = receipt_satisfies(plan)
    if existing is not None and not done_before:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest / RECEIPT_NAME)
    remove_stale_partials(plan)
    journal = Journal(plan.journal_path, m.digest)
    try:
        all_files = [FileEntry(t.name, t.bytes, t.hash, t.shard) for t in plan.tasks]
        have = {f.name for f in all_files
                if journal.files.get(f.name) == f.bytes and size_or_missing(dest / f.name) == f.bytes}
        res.files_kept = len(have)
        need = sum(f.bytes for f in all_files if f.name not in have) + len(plan.manifest_bytes)
        free = free_bytes(dest)
        if need > free:
            raise OutOfSpaceError(
                f"{dest}: staging needs {_gb(need)} but only {_gb(free)} is free; free space, stage a "
                "--partition share, or choose another DEST"
            )
        # 1. What does everyone already hold? (a bitmap per node over the manifest's files)
        mine_bits = np.packbits(np.array([f.name in have for f in all_files], dtype=bool)).tobytes()
        bitmaps: list[Any] = [None] * group.num_nodes
        group.collective(dist.all_gather_object, bitmaps, mine_bits)
        held = np.ones(len(all_files), dtype=bool)
        for b in bitmaps:
            held &= np.unpackbits(np.frombuffer(b, dtype=np.uint8), count=len(all_files)).astype(bool)
        skip = {f.name for f, h in zip(all_files, held, strict=True) if h}
        # 2. Who reads what (node 0 asks Lustre for OST indices once; everyone gets the same answer).
        osts_box: list[Any] = [_shard_osts(plan) if group.node == 0 else None]
        group.collective(dist.broadcast_object_list, osts_box, src=0)
        shares = assign_read_shares(m, group.num_nodes, plan.seed, osts_box[0])
        layouts = plan_streams(m, shares, skip)
        res.share_shards = len(shares[group.node])
        chunk = chunk_size_for(group.num_nodes, chunk_bytes, memory_bytes)
        steps = max(lay.steps(chunk) for lay in layouts)
        res.steps, res.chunk_bytes = steps, chunk
        counters = IoCounters()
        mode, gid = source_access(manifest_path(plan.source))  # the plain stage's rule

        def verified(entry: FileEntry) -> None:
            os.chmod(dest / entry.name, mode)
            chgrp_quiet(dest / entry.name, gid)
            journal.add_file(entry.name, entry.bytes)

        reader = ShareReader(plan.src_root, dest, layouts[group.node], counters=counters, local_have=set(have))
        sinks = [
            StreamSink(dest, lay, algo=m.hash_algo, counters=counters, have=have, on_verified=verified,
                       origin=f" from node {lay.node}", from_peer=lay.node != group.node)
            for lay in layouts
        ]
        progress = Progress("stage --collective", total_items=steps, total_bytes=None, unit="steps", quiet=quiet)
        try:
            _exchange(group, reader, sinks=sinks, steps=steps, chunk=chunk, progress=progress)
        finally:
            for s in sinks:
                s.abort()
            progress.close()
        fsync_dir(dest)
        missing = [f.name for f in all_files if f.name not in have]
        if missing:
            raise StagerError(f"{dest}: internal error: {len(missing)} files not received (first: {missing[0]}); rerun")
        res.src_bytes, res.local_bytes = counters.src_bytes, counters.local_bytes
        res.exchange_bytes, res.written_bytes = counters.received_bytes, counters.written_bytes
        res.files_written = counters.files_written
        mpath = dest / MANIFEST_NAME
        if _read_quiet(mpath) != plan.manifest_bytes:
            atomic_write_bytes(mpath, plan.manifest_bytes, mode=mode)
    finally:
        journal.close()
    _write_receipt(plan, res)


def _exchange(group: Group, reader: ShareReader, *, sinks: list[StreamSink], steps: int, chunk: int,
              progress: Progress) -> None:
    """The pipelined loop: reader thread -> all_gather (this thread) -> writer thread."""
    n = group.num_nodes
    transport = _Transport(group, chunk)
    free_send: queue.Queue[bytearray] = queue.Queue()
    full_send: queue.Queue[bytearray | BaseException] = queue.Queue()
    free_recv: queue.Queue[bytearray] = queue.Queue()
    to_write: queue.Queue[bytearray | None] = queue.Queue()
    for _ in range(2):
        free_send.put(bytearray(chunk))
        free_recv.put(bytearray(n * chunk))
    stop = threading.Event()
    errors: list[BaseException] = []
    kill_at = _kill_step(group.node)

    def read_loop() -> None:
        try:
            for _ in range(steps):
                buf = _get(free_send, stop)
                if buf is None:
                    return
                reader.fill(memoryview(buf))
                full_send.put(buf)
        except BaseException as exc:
            full_send.put(exc)
        finally:
            reader.close()

    def write_loop() -> None:
        while True:
            buf = to_write.get()
            if buf is None:
                return
            try:
                view = memoryview(buf)
                for j, sink in enumerate(sinks):
                    sink.feed(view[j * chunk : (j + 1) * chunk])
            except BaseException as exc:
                errors.append(exc)
                stop.set()
                return
            finally:
                free_recv.put(buf)

    threads = [threading.Thread(target=read_loop, name="stager-read", daemon=True),
               threading.Thread(target=write_loop, name="stager-write", daemon=True)]
    for t in threads:
        t.start()
    try:
        for step in range(steps):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            item = _get(full_send, stop, group)
            if errors:
                raise errors[0]
            if isinstance(item, BaseException):
                raise item
            assert item is not None
            recv = _get(free_recv, stop, group)
            if errors:
                raise errors[0]
            assert recv is not None
            group.collective(transport.all_gather, item, recv)
            free_send.put(item)
            to_write.put(recv)
            group.set_progress(step + 1, steps)
            progress.update(1, n * chunk)
        to_write.put(None)
        threads[1].join()
        if errors:
            raise errors[0]
        for sink in sinks:
            sink.feed(memoryview(b""))  # trailing empty files of a stream
    finally:
        stop.set()
        to_write.put(None)
        for t in threads:
            t.join(timeout=5)


def _get(q: queue.Queue[Any], stop: threading.Event, group: Group | None = None) -> Any:
    """``q.get()`` that gives up when ``stop`` is set and raises when the group aborted."""
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if group is not None:
                group.check()
            if stop.is_set():
                return None


class _Transport:
    """All-gather of fixed-size byte chunks over the group's backend (host memory for gloo, GPU for NCCL)."""

    def __init__(self, group: Group, chunk: int) -> None:
        import torch

        self.group = group
        self.chunk = chunk
        self.device = None
        if group.backend == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            self.dev_send = torch.empty(chunk, dtype=torch.uint8, device=self.device)
            self.dev_recv = torch.empty(group.num_nodes * chunk, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _gather(out: Any, inp: Any) -> None:
        import torch.distributed as dist

        # torch >= 2.10 names it all_gather_single; all_gather_into_tensor before that.
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, inp)

    def all_gather(self, send: bytearray, recv: bytearray) -> None:
        import torch

        s = torch.frombuffer(send, dtype=torch.uint8)
        r = torch.frombuffer(recv, dtype=torch.uint8)
        if self.device is None:
            self._gather(r, s)
            return
        self.dev_send.copy_(s)
        self._gather(self.dev_recv, self.dev_send)
        r.copy_(self.dev_recv.cpu())


def _kill_step(node: int) -> int:
    spec = os.environ.get(KILL_ENV, "")
    if ":" in spec:
        who, step = spec.split(":", 1)
        if who.strip() == str(node):
            return int(step)
    return -1


def _shard_osts(plan: StagePlan) -> list[int] | None:
    """First OST of every shard when SRC is on Lustre and ``lfs`` is available, else None."""
    from stager.fs import lustre
    from stager.fs.info import detect_fs

    if "://" in plan.src_root or not lustre.lfs_path() or not detect_fs(plan.src_root).is_lustre:
        return None
    from concurrent.futures import ThreadPoolExecutor

    def index(name: str) -> int:
        try:
            return lustre.stripe_index(os.path.join(plan.src_root, name))
        except lustre.LfsError:
            return -1

    with ThreadPoolExecutor(8) as ex:
        return list(ex.map(index, [s.name for s in plan.manifest.shards]))


def _read_quiet(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None


def _write_receipt(plan: StagePlan, res: CollectiveResult) -> None:
    m: Manifest = plan.manifest
    files = [*sorted(plan.expected_files()), MANIFEST_NAME, plan.journal_path.name, RECEIPT_NAME]
    rec = Receipt(
        dataset_id=m.dataset_id,
        manifest_digest=plan.receipt_digest,
        source=plan.source,
        dest=str(plan.dest),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        verified=f"{m.hash_algo} while copying (collective)",
        mode=plan.mode,
        partition=plan.partition_info,
        shards=plan.receipt_shards(),
        files=files,
        stats={"collective": True, "num_nodes": res.num_nodes, "node": res.node, "src_bytes": res.src_bytes,
               "exchange_bytes": res.exchange_bytes, "files_written": res.files_written,
               "files_kept": res.files_kept, "chunk_bytes": res.chunk_bytes, "steps": res.steps,
               "created_dest": not plan.explicit_dest},
    )
    rec.write(plan.dest, *source_access(manifest_path(plan.source)))  # as the plain stage's receipt


__all__ = ["CollectiveResult", "free_bytes", "receipt_satisfies", "remove_stale_partials", "stage_collective"]

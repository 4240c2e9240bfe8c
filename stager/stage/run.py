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
import datetime as _dt
import json
import os
import re
import signal
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from stager.checksum import new_hasher
from stager.errors import (
    DestinationError,
    OutOfSpaceError,
    ShardMissingError,
    StagerError,
    StagerTimeoutError,
    UsageError,
    VerificationError,
)
from stager.fs import lustre
from stager.fs.atomic import (
    atomic_write_bytes,
    boot_id,
    commit_partial,
    fsync_dir,
    partial_path,
    space_error,
    syncfs,
)
from stager.fs.copy import (
    DIRECT_ALIGN,
    CopyTuning,
    WriteBehind,
    aligned_buffer,
    copy_hashed,
    copy_hashed_direct,
    open_partial,
    write_all,
)
from stager.fs.info import FsInfo, detect_fs
from stager.fs.lock import NodeLock
from stager.manifest import MANIFEST_NAME, Manifest, dataset_root, manifest_path
from stager.order.partition import assign_shards_to_nodes
from stager.progress import Progress
from stager.receipt import RECEIPT_NAME, STAGING_ROOT_VARS, Receipt, chgrp_quiet, load_receipt, source_access
from stager.world import World, parse_tasks_per_node

THROTTLE_ENV = "STAGER_TEST_THROTTLE_BPS"
FREE_BYTES_ENV = "STAGER_TEST_FREE_BYTES"
DEFAULT_BLOCK = 8 << 20
DEFAULT_UNPACK_DIR = "unpacked"
UNPACK_ONLY_PREFIX = "unpack-only:"
_PARTIAL_RE = re.compile(r"^(?P<base>.+)\.[0-9a-f]{12}\.partial$")


# ---- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileTask:
    """One file to stage: manifest ``name``, expected ``bytes`` and ``hash``, source path or URL."""

    name: str
    bytes: int
    hash: str
    src: str
    shard: int


@dataclass
class StagePlan:
    source: str
    src_root: str
    dest: Path
    manifest: Manifest
    manifest_bytes: bytes
    mode: str  # "full" | "partition" | "shared"
    node: int
    num_nodes: int
    ranks_per_node: int
    seed: int
    node_source: str
    mine: list[int]  # shard indices this node copies
    tasks: list[FileTask]
    unpack: str | None  # None | "also" | "only"
    unpack_dir: str
    explicit_dest: bool

    @property
    def suffix(self) -> str:
        return f".node{self.node}" if self.mode == "shared" else ""

    @property
    def lock_path(self) -> Path:
        return self.dest / f".stager-lock{self.suffix}"

    @property
    def journal_path(self) -> Path:
        return self.dest / f".stager-journal{self.suffix}.jsonl"

    def marker_name(self, node: int) -> str:
        return f".stager-done.node{node}-of-{self.num_nodes}.json"

    @property
    def receipt_digest(self) -> str:
        d = self.manifest.digest
        return UNPACK_ONLY_PREFIX + d if self.unpack == "only" else d

    @property
    def partition_info(self) -> dict[str, int] | None:
        if self.mode == "full":
            return None
        return {"num_nodes": self.num_nodes, "node": self.node, "seed": self.seed,
                "ranks_per_node": self.ranks_per_node}

    def receipt_shards(self) -> list[str]:
        """Shards the receipt promises are in DEST."""
        if self.unpack == "only":
            return []
        idx = range(len(self.manifest.shards)) if self.mode == "shared" else self.mine
        return [self.manifest.shards[i].name for i in idx]

    def expected_files(self) -> dict[str, int]:
        """Every data file the finished DEST holds (name -> bytes), for the fast-path check."""
        if self.unpack == "only":
            return {}
        idx = range(len(self.manifest.shards)) if self.mode == "shared" else self.mine
        out = {}
        for i in idx:
            s = self.manifest.shards[i]
            out[s.name] = s.bytes
            for a in s.aux:
                out[a.name] = a.bytes
        return out


def resolve_node(
    node: int | None, num_nodes: int | None, ranks_per_node: int | None, env: Mapping[str, str] | None = None
) -> tuple[int, int, int, str]:
    """Node identity ``(node, num_nodes, ranks_per_node, source)``: flags, else Slurm, else torchrun."""
    env = dict(os.environ if env is None else env)  # a copy: World.detect then skips importing torch

    def _int(name: str) -> int | None:
        v = env.get(name)
        try:
            return int(v) if v not in (None, "") else None
        except ValueError as exc:
            raise UsageError(f"environment variable {name}={v!r} is not an integer") from exc

    def _rpn(n: int) -> int:
        if ranks_per_node is not None:
            return ranks_per_node
        tpn = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if tpn:
            counts = parse_tasks_per_node(tpn)
            return counts[n] if n < len(counts) else counts[-1]
        lws = _int("LOCAL_WORLD_SIZE")
        return lws or 1

    if node is not None or num_nodes is not None:
        if node is None or num_nodes is None:
            raise UsageError("--node and --num-nodes must be given together")
        if not 0 <= node < num_nodes:
            raise UsageError(f"--node {node} out of range for --num-nodes {num_nodes}")
        return node, num_nodes, _rpn(node), "flags"
    s_node, s_nodes = _int("SLURM_NODEID"), _int("SLURM_NNODES") or _int("SLURM_JOB_NUM_NODES")
    if s_node is not None and s_nodes is not None:
        if not 0 <= s_node < s_nodes:
            raise UsageError(f"SLURM_NODEID={s_node} out of range for {s_nodes} nodes")
        return s_node, s_nodes, _rpn(s_node), "slurm"
    w = World.detect(env=env)
    return w.node, w.num_nodes, ranks_per_node or w.local_world_size, w.source


def default_dest_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    for var in STAGING_ROOT_VARS:
        if env.get(var):
            return Path(env[var])
    raise UsageError(
        "no destination: give DEST, or set $STAGER_DEST (or run inside Slurm, which sets $SLURM_TMPDIR/$TMPDIR)"
    )


def read_source_manifest(src: str, storage_options: dict[str, Any] | None = None) -> tuple[Manifest, bytes]:
    """Load SRC's manifest and return it with its exact bytes (DEST gets a verbatim copy)."""
    mp = manifest_path(src)
    try:
        if "://" in mp:
            import fsspec

            with fsspec.open(mp, "rb", **(storage_options or {})) as f:
                data = f.read()
        else:
            data = Path(mp).read_bytes()
    except FileNotFoundError as exc:
        raise ShardMissingError(f"{mp}: no manifest; is SRC a `stager pack` output directory?") from exc
    except IsADirectoryError as exc:
        raise ShardMissingError(f"{mp}: is a directory, expected manifest.json") from exc
    return Manifest.from_bytes(data, mp), data


def plan_stage(
    src: str,
    manifest: Manifest,
    manifest_bytes: bytes,
    dest: str | os.PathLike[str] | None,
    *,
    partition: bool = False,
    shared: bool | None = None,
    node: int | None = None,
    num_nodes: int | None = None,
    ranks_per_node: int | None = None,
    seed: int = 0,
    unpack: str | None = None,
    unpack_dir: str = DEFAULT_UNPACK_DIR,
    env: Mapping[str, str] | None = None,
) -> StagePlan:
    """Decide what this node stages where. ``shared`` None means: detect (DEST on BeeGFS)."""
    if unpack not in (None, "also", "only"):
        raise UsageError(f"--unpack must be 'also' or 'only', got {unpack!r}")
    if unpack_dir in ("", ".", "..") or "/" in unpack_dir:
        raise UsageError(f"--unpack-dir must be a plain directory name, got {unpack_dir!r}")
    explicit = dest is not None
    dest_path = Path(dest) if dest is not None else default_dest_root(env) / f"stager-{manifest.dataset_id}"
    dest_path = Path(os.path.abspath(dest_path))
    if "://" not in src:
        src = os.path.abspath(src)
    if shared is None:
        shared = detect_fs(dest_path).is_beegfs
    mode = "shared" if shared else ("partition" if partition else "full")
    n_idx, n_nodes, rpn, nsrc = 0, 1, ranks_per_node or 1, "default"
    if mode != "full":
        n_idx, n_nodes, rpn, nsrc = resolve_node(node, num_nodes, ranks_per_node, env)
    if mode == "full":
        mine = list(range(len(manifest.shards)))
    else:
        mine = assign_shards_to_nodes(manifest, n_nodes, seed)[n_idx]
    root = dataset_root(src)
    join = (lambda n: root.rstrip("/") + "/" + n) if "://" in root else (lambda n: os.path.join(root, n))
    tasks = []
    for i in mine:
        s = manifest.shards[i]
        tasks.append(FileTask(s.name, s.bytes, s.hash, join(s.name), i))
        tasks += [FileTask(a.name, a.bytes, a.hash, join(a.name), i) for a in s.aux]
    return StagePlan(src, root, dest_path, manifest, manifest_bytes, mode, n_idx, n_nodes, rpn, seed, nsrc, mine,
                     tasks, unpack, unpack_dir, explicit)


def order_for_streams(tasks: list[FileTask], src_fs: FsInfo | None, block: int = DEFAULT_BLOCK
                      ) -> tuple[list[FileTask], str, int]:
    """Order files for parallel streams; return ``(tasks, how, block size)`` (``block`` is the target).

    From Lustre (with ``lfs``): interleave files by first OST (``lfs getstripe -i``), so the streams
    running at once read from different OSTs, and read blocks that are a multiple of the stripe
    size. Elsewhere: largest first, so the streams finish together.
    """
    if src_fs is not None and src_fs.is_lustre and lustre.lfs_path() and tasks:
        from concurrent.futures import ThreadPoolExecutor

        def index(t: FileTask) -> int:
            try:
                return lustre.stripe_index(t.src)
            except lustre.LfsError:
                return -1

        with ThreadPoolExecutor(8) as ex:
            osts = list(ex.map(index, tasks))
        groups: dict[int, list[FileTask]] = {}
        for t, o in zip(tasks, osts, strict=True):
            groups.setdefault(o, []).append(t)
        keys = sorted(groups)
        ordered: list[FileTask] = []
        for k in range(max(len(g) for g in groups.values())):
            ordered += [groups[o][k] for o in keys if k < len(groups[o])]
        try:
            ssize = lustre.stripe_size(tasks[0].src)
        except lustre.LfsError:
            ssize = 0
        return ordered, "ost-round-robin", ssize * max(1, block // ssize) if ssize > 0 else block
    return sorted(tasks, key=lambda t: -t.bytes), "largest-first", block


# ---- the result -----------------------------------------------------------------------------------
@dataclass
class StageResult:
    ok: bool
    source: str
    dest: str
    mode: str
    dataset_id: str
    already_staged: bool
    files_total: int
    bytes_total: int
    files_copied: int = 0
    bytes_copied: int = 0
    files_kept: int = 0
    seconds: float = 0.0
    gbps: float = 0.0
    waited_s: float = 0.0
    lock_takeover: dict[str, Any] | None = None
    removed_partials: list[str] = field(default_factory=list)
    ordering: str = ""
    workers: int = 0
    block_size: int = 0
    io: str = ""  # "direct" (O_DIRECT writes), "buffered", or "mixed"
    durable: bool = True  # False with --no-fsync: data may still be in the page cache
    unpacked: str | None = None
    unpacked_files: int = 0
    partition: dict[str, int] | None = None
    node_source: str = ""
    receipt: str = ""
    dest_fs: str = ""
    source_fs: str = ""
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        if self.already_staged:
            return (f"{self.dest}: already staged ({self.files_total} files, {self.bytes_total / 1e9:.2f} GB, "
                    f"mode {self.mode}); nothing to do")
        s = (f"staged {self.files_copied} files, {self.bytes_copied / 1e9:.3f} GB in {self.seconds:.2f} s "
             f"({self.gbps:.2f} GB/s, verified{', ' + self.io + ' I/O' if self.io else ''}"
             f"{'' if self.durable else ', not fsynced'}) to {self.dest} "
             f"[mode {self.mode}]")
        if self.files_kept:
            s += f"; kept {self.files_kept} verified files from an earlier run"
        if self.unpacked:
            s += f"; unpacked {self.unpacked_files} files to {self.unpacked}"
        return s


# ---- journal ----------------------------------------------------------------------------------------
class Journal:
    """Append-only record of verified files (and unpacked shards) of one dataset in DEST.

    Line 1 is ``{"journal": 1, "digest": <manifest digest>}``; then ``{"f": name, "b": bytes}`` per
    verified file and ``{"u": shard name}`` per unpacked shard. A journal of another dataset is reset.
    Appends are single ``write`` calls on an ``O_APPEND`` fd, so a kill -9 loses at most a line.
    ``volatile`` (``--no-fsync``): the files were not fsynced, so each line also carries
    ``"v": <boot id>`` and is ignored after a reboot (the file is copied again).
    """

    def __init__(self, path: Path, digest: str, *, volatile: bool = False) -> None:
        self.path = path
        this_boot = boot_id()
        self._mark = {"v": this_boot} if volatile else {}
        self.files: dict[str, int] = {}
        self.unpacked: set[str] = set()
        self.has_volatile = False  # a trusted line came from a --no-fsync run of this boot
        self._lock = threading.Lock()
        valid = False
        with contextlib.suppress(FileNotFoundError):
            lines = path.read_bytes().splitlines()
            if lines:
                with contextlib.suppress(ValueError, RecursionError):
                    head = json.loads(lines[0])
                    valid = isinstance(head, dict) and head.get("digest") == digest
            for line in lines[1:] if valid else []:
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # a torn last line
                # A damaged line is ignored: its file is then copied (and verified) again.
                if not isinstance(rec, dict) or rec.get("v", this_boot) != this_boot:
                    continue  # damaged, or unsynced before a reboot: not trusted
                self.has_volatile |= "v" in rec
                if isinstance(rec.get("f"), str) and type(rec.get("b")) is int:
                    self.files[rec["f"]] = rec["b"]
                elif isinstance(rec.get("u"), str):
                    self.unpacked.add(rec["u"])
        self._digest = digest
        # A fresh header is written (atomically, fsynced) by the first append or by close(), not here:
        # during a copy that is a finisher thread, so its two fsyncs overlap the copy streams. Until
        # then an old journal stays as it was; it does not match the digest, so it is ignored.
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND) if valid else -1

    def _open(self) -> int:
        """The append fd, writing a fresh header first if needed (call with ``_lock`` held)."""
        if self._fd == -2:
            raise ValueError(f"{self.path}: journal already closed")
        if self._fd < 0:
            header = (json.dumps({"journal": 1, "digest": self._digest}) + "\n").encode()
            atomic_write_bytes(self.path, header, mode=0o600)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return self._fd

    def _append(self, rec: dict[str, Any]) -> None:
        with self._lock:
            os.write(self._open(), (json.dumps(rec) + "\n").encode())

    def add_file(self, name: str, nbytes: int) -> None:
        self._append({"f": name, "b": nbytes, **self._mark})
        self.files[name] = nbytes

    def add_unpacked(self, shard: str) -> None:
        self._append({"u": shard, **self._mark})
        self.unpacked.add(shard)

    def close(self) -> None:
        with self._lock:
            fd = self._open()
            self._fd = -2  # closed: a later append fails instead of silently recreating the header
        with contextlib.suppress(OSError):
            os.fsync(fd)
        os.close(fd)


# ---- copying ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Verified:
    """A copy whose size and hash matched, still open as ``fd`` under its partial name ``tmp``."""

    task: FileTask
    fd: int
    tmp: Path
    final: Path
    mode: int
    gid: int | None


class _Copier:
    """Runs the copy streams; the first error cancels the others and is re-raised.

    ``workers`` threads each take the next file and copy it with :func:`~stager.copyengine.copy_hashed`
    (one reused buffer per stream, write-back started per block). A verified copy is then handed to
    one of ``tuning.sync_threads`` finisher threads (fchmod, fchown, fsync, rename, journal), so a
    stream goes on with its next file while the disk absorbs the last one; 0 finishes inline.
    """

    def __init__(self, plan: StagePlan, *, block: int, workers: int, journal: Journal, progress: Progress,
                 warnings: list[str], tuning: CopyTuning | None = None, fsync: bool = True) -> None:
        self.plan = plan
        self.fsync = fsync
        self.tuning = tuning or CopyTuning()
        self.block = block
        self.workers = workers
        self.journal = journal
        self.progress = progress
        self.warnings = warnings
        self.cancel = threading.Event()
        self.errors: list[BaseException] = []
        self.copied = 0
        self.bytes = 0
        self.direct_files = 0  # copies written with O_DIRECT (the rest went through the page cache)
        self._lock = threading.Lock()
        self._next = 0
        self._throttle = float(os.environ.get(THROTTLE_ENV) or 0)
        self._warned_group = False
        self._finishers: ThreadPoolExecutor | None = None
        # Bounds the verified copies waiting for a finisher (each holds an open fd).
        self._pending = threading.BoundedSemaphore(max(1, self.tuning.sync_threads) + workers)

    def run(self, tasks: list[FileTask], meanwhile: Callable[[], None] | None = None) -> None:
        """Copy ``tasks``; ``meanwhile()`` runs on the calling thread while the streams copy."""
        self._tasks = tasks
        if self.tuning.sync_threads > 0:
            self._finishers = ThreadPoolExecutor(self.tuning.sync_threads, thread_name_prefix="stage-sync")
        threads = [threading.Thread(target=self._worker, name=f"stage-{i}", daemon=True)
                   for i in range(min(self.workers, len(tasks)))]
        try:
            for t in threads:
                t.start()
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException as exc:
                    self._fail(exc)
            for t in threads:
                t.join()
        finally:
            if self._finishers is not None:
                self._finishers.shutdown(wait=True)
        if self.errors:
            raise self.errors[0]

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(exc)
        self.cancel.set()

    def _worker(self) -> None:
        buf = aligned_buffer(self.block)  # page-aligned: usable for O_DIRECT writes
        while not self.cancel.is_set():
            with self._lock:
                if self._next >= len(self._tasks):
                    return
                task = self._tasks[self._next]
                self._next += 1
            try:
                self._copy(task, buf)
            except BaseException as exc:
                self._fail(exc)
                return

    def _source_meta(self, task: FileTask) -> tuple[int, int | None]:
        """(mode for the copy, gid to give it or None) from the source file."""
        if "://" in task.src:
            return 0o600, None
        st = os.stat(task.src)
        # Owner read/write always; group/other only what the source grants (never more).
        return (stat.S_IMODE(st.st_mode) & 0o644) | 0o600, st.st_gid

    def _on_block(self, start: float, done: list[int]) -> Any:
        def on_block(n: int) -> None:
            if self.cancel.is_set():
                raise _CancelledError()
            self.progress.update(0, n)
            if self._throttle > 0:
                done[0] += n
                lag = done[0] / self._throttle - (time.perf_counter() - start)
                if lag > 0:
                    time.sleep(lag)
        return on_block

    def _copy(self, task: FileTask, buf: memoryview) -> None:
        """Copy and verify ``task`` into a partial file, then finish it (inline or on a finisher)."""
        final = self.plan.dest / task.name
        tmp = self.plan.dest / f"{task.name}.{uuid.uuid4().hex[:12]}.partial"
        mode, gid = self._source_meta(task)
        hasher = new_hasher(self.plan.manifest.hash_algo)
        fd, direct = open_partial(tmp, direct=self.tuning.direct and self.block % DIRECT_ALIGN == 0)
        if direct:
            with self._lock:
                self.direct_files += 1
        try:
            with _open_source(task.src) as f:
                on_block = self._on_block(time.perf_counter(), [0])
                if direct:
                    total = copy_hashed_direct(f, fd, buf, hasher, limit=task.bytes, on_block=on_block)
                else:
                    # Write-behind waits for the disk: only worth it when the fsync would wait anyway.
                    wb = WriteBehind(fd, self.tuning.window) if self.fsync and self.tuning.window >= 0 else None
                    total = copy_hashed(f, fd, buf, hasher, limit=task.bytes, write_behind=wb, on_block=on_block)
            if total > task.bytes:
                raise VerificationError(
                    f"{task.name}: source {task.src} is larger than the manifest's {task.bytes} bytes; "
                    "the source changed after packing: re-pack or restore it (no copy kept)"
                )
            got = hasher.hexdigest()
            if total != task.bytes or got != task.hash:
                raise VerificationError(
                    f"{task.name}: verification failed copying {task.src} (expected {task.bytes} bytes "
                    f"{self.plan.manifest.hash_algo} {task.hash}, got {total} bytes {got}); the source shard is "
                    "damaged: restore it or re-pack (no copy kept)"
                )
        except BaseException as exc:
            _discard_partial(fd, tmp, final, exc)
        done = _Verified(task, fd, tmp, final, mode, gid)
        if self._finishers is None:
            self._finish(done)
            return
        self._pending.acquire()
        try:
            self._finishers.submit(self._finish_async, done)
        except BaseException as exc:
            self._pending.release()
            _discard_partial(fd, tmp, final, exc)

    def _finish_async(self, done: _Verified) -> None:
        try:
            self._finish(done)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._pending.release()

    def _finish(self, done: _Verified) -> None:
        """Permissions, group, fsync, rename, journal line; closes the fd (removes the partial on error)."""
        task, fd, tmp, final, mode, gid = done.task, done.fd, done.tmp, done.final, done.mode, done.gid
        try:
            if self.cancel.is_set():
                raise _CancelledError()
            os.fchmod(fd, mode)
            if gid is not None and gid != os.getegid():
                try:
                    os.fchown(fd, -1, gid)
                except PermissionError:
                    with self._lock:
                        if not self._warned_group:
                            self._warned_group = True
                            self.warnings.append(f"cannot give staged files the source's group {gid} (EPERM)")
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final)
        except BaseException as exc:
            _discard_partial(fd, tmp, final, exc)
        self.journal.add_file(task.name, task.bytes)
        with self._lock:
            self.copied += 1
            self.bytes += task.bytes
        self.progress.update(1, 0)



def _discard_partial(fd: int, tmp: Path, final: Path, exc: BaseException) -> NoReturn:
    """Close ``fd`` (if open), remove ``tmp`` and re-raise ``exc`` (disk-full errors made one-line)."""
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    if isinstance(exc, OSError) and not isinstance(exc, StagerError):
        err = space_error(exc, final)
        if err is not None:
            raise err from exc
    raise exc


def _write_partial(final: Path, data: bytes, mode: int) -> Path:
    """Write ``data`` to a fsynced ``<final>.<uuid>.partial`` with ``mode``; return its path (not renamed)."""
    tmp = partial_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        write_all(fd, memoryview(data))
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException as exc:
        _discard_partial(fd, tmp, final, exc)
    os.close(fd)
    return tmp


def _manifest_mode(plan: StagePlan) -> int:
    """The staged manifest's mode: the source manifest's, masked like the shards' (0o644 for URLs)."""
    if "://" in plan.src_root:
        return 0o644
    with contextlib.suppress(OSError):
        return (stat.S_IMODE(os.stat(manifest_path(plan.source)).st_mode) & 0o644) | 0o600
    return 0o644


class _CancelledError(Exception):
    """Another stream failed; this one stops quietly."""


def _open_source(src: str) -> Any:
    if "://" in src:
        import fsspec

        return fsspec.open(src, "rb").open()
    try:
        f = open(src, "rb", buffering=0)  # noqa: SIM115 - returned to a with-statement
    except FileNotFoundError as exc:
        raise ShardMissingError(f"{src}: shard listed in the manifest is missing; restore it or re-pack") from exc
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return f


# ---- helpers ----------------------------------------------------------------------------------------
def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return -1


def _receipt_done(plan: StagePlan) -> Receipt | None:
    """The existing receipt if it already satisfies ``plan`` (cheap: stats only)."""
    try:
        rec = load_receipt(plan.dest)
    except StagerError:
        return None
    if rec is None or rec.manifest_digest != plan.receipt_digest or rec.mode != plan.mode or not rec.trusted():
        return None
    if plan.mode == "partition" and rec.partition != plan.partition_info:
        return None
    if sorted(rec.shards) != sorted(plan.receipt_shards()):
        return None
    if plan.unpack and (rec.unpacked != str(plan.dest / plan.unpack_dir) or not (plan.dest / plan.unpack_dir).is_dir()):
        return None
    if any(_size(plan.dest / n) != b for n, b in plan.expected_files().items()):
        return None
    return rec


def _remove_stale_partials(dest: Path, names: set[str]) -> list[str]:
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(dest):
            m = _PARTIAL_RE.match(entry.name)
            if m and m.group("base") in names and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                removed.append(entry.name)
    return removed


def _free_bytes(dest: Path) -> int:
    override = os.environ.get(FREE_BYTES_ENV)
    if override:
        return int(override)
    st = os.statvfs(dest)
    return st.f_bavail * st.f_frsize


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _mkdir_dest(dest: Path, src_root: str) -> None:
    if dest.is_dir():
        return
    if dest.exists():
        raise DestinationError(f"{dest}: exists and is not a directory; choose another DEST")
    mode = 0o700
    if "://" not in src_root:
        with contextlib.suppress(OSError):
            mode |= stat.S_IMODE(os.stat(src_root).st_mode) & 0o055
    try:
        dest.mkdir(parents=True, exist_ok=True)
        os.chmod(dest, mode)
    except OSError as exc:
        err = space_error(exc, dest)
        if err is not None:
            raise err from exc
        raise DestinationError(f"{dest}: cannot create the destination ({exc.strerror}); choose another DEST") from exc


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
                      unpack_dir=unpack_dir)
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
    result.removed_partials = _remove_stale_partials(dest, names)
    journal = Journal(plan.journal_path, m.digest, volatile=not fsync)
    try:
        keep = {t.name for t in plan.tasks if journal.files.get(t.name) == t.bytes and _size(dest / t.name) == t.bytes}
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


def load_receipt_quiet(dest: Path) -> Receipt | None:
    try:
        return load_receipt(dest)
    except StagerError:
        return None


def _read_quiet(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None


def _shared_barrier(plan: StagePlan, result: StageResult, timeout: float | None) -> None:
    """Write this node's done marker, then wait until every node's marker names this manifest."""
    dest = plan.dest
    marker = {"digest": plan.manifest.digest, "node": plan.node, "num_nodes": plan.num_nodes,
              "host": socket.gethostname(), "files": [t.name for t in plan.tasks]}
    atomic_write_bytes(dest / plan.marker_name(plan.node), (json.dumps(marker) + "\n").encode(), mode=0o644)
    start = time.monotonic()
    while True:
        missing = []
        for n in range(plan.num_nodes):
            try:
                rec = json.loads((dest / plan.marker_name(n)).read_bytes())
                if rec.get("digest") != plan.manifest.digest:
                    missing.append(n)
            except (OSError, ValueError):
                missing.append(n)
        if not missing:
            break
        if timeout is not None and time.monotonic() - start > timeout:
            raise StagerTimeoutError(
                f"{dest}: nodes {missing[:8]} of {plan.num_nodes} did not finish their share within {timeout:g}s; "
                "check their logs and rerun (finished shards are kept)"
            )
        time.sleep(0.1)
    result.waited_s += time.monotonic() - start
    bad = [n for n, b in plan.expected_files().items() if _size(dest / n) != b]
    if bad:
        raise VerificationError(f"{dest}: every node reported done but {bad[0]} is missing or has the wrong size; "
                                "rerun stage on all nodes")


def _make_durable(plan: StagePlan, rec: Receipt) -> None:
    """Flush a ``--no-fsync`` copy of this boot to disk (one ``syncfs``), then mark its receipt durable."""
    syncfs(plan.dest)
    rec.durable, rec.boot_id = True, ""
    rec.write(plan.dest, *source_access(manifest_path(plan.source)))


def _write_receipt(plan: StagePlan, result: StageResult) -> None:
    dest = plan.dest
    files = sorted(plan.expected_files())
    files += [MANIFEST_NAME]
    if plan.mode == "shared":
        files += [f".stager-journal.node{n}.jsonl" for n in range(plan.num_nodes)]
        files += [plan.marker_name(n) for n in range(plan.num_nodes)]
    else:
        files += [plan.journal_path.name]
    if plan.unpack:
        files.append(plan.unpack_dir)
    files.append(RECEIPT_NAME)
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
    rec = Receipt(
        dataset_id=plan.manifest.dataset_id,
        manifest_digest=plan.receipt_digest,
        source=plan.source,
        dest=str(dest),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        verified=f"{plan.manifest.hash_algo} while copying",
        mode=plan.mode,
        partition=plan.partition_info,
        shards=plan.receipt_shards(),
        unpacked=str(dest / plan.unpack_dir) if plan.unpack else None,
        files=files,
        stats=stats,
        durable=result.durable,
        boot_id="" if result.durable else boot_id(),
    )
    rec.write(dest, *source_access(manifest_path(plan.source)))


__all__ = ["StagePlan", "StageResult", "plan_stage", "resolve_node", "stage"]

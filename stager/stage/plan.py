"""What this node stages where: :func:`plan_stage` and the :class:`StagePlan` it returns.

The plan is decided before anything is written and does not change during a run: which shards this
node holds (all; its :func:`~stager.order.partition.assign_shards_to_nodes` share with
``--partition``; its share of a shared BeeOND DEST in ``shared`` mode, where the other nodes write
the rest), the files that makes (:class:`FileTask`: each shard and its companion files), DEST (given,
or :func:`default_dest` under the first staging root set), the mode, and the names of the
bookkeeping files. Its only I/O: SRC's manifest is read by :func:`read_src_manifest` beforehand,
``shared=None`` asks whether DEST is on BeeGFS, node identity may come from the environment, and
the default DEST looks at what its name holds.
:func:`order_for_streams` then orders the files still to copy for the parallel copy streams.

Names: SRC is what the user named (a packed directory or its ``manifest.json``, a path or an fsspec
URL): :attr:`StagePlan.src`. The directory holding the shards is :attr:`StagePlan.src_dir` (SRC's
directory, or the manifest's ``shard_root`` for an index written with ``stager index --out``); a file's
place in it is :attr:`FileTask.src_path`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from stager.errors import ShardMissingError, SourceNotFoundError, UnsafeArchiveError, UsageError
from stager.fs.access import source_access
from stager.fs.info import FsInfo, detect_fs
from stager.fs.open import is_url, join, read_bytes
from stager.fs.safe import check_chain, describe, problem, trusted_uids
from stager.manifest import Manifest, bytes_for_copy, dataset_root, manifest_path, not_a_pack, shard_root
from stager.manifest.clips import shard_groups
from stager.receipt import STAGING_ROOT_VARS
from stager.stage.names import journal_name, lock_name, marker_name
from stager.stage.options import StageOptions

DEFAULT_BLOCK = 8 << 20  # bytes per read of a copy stream (off Lustre)
UNPACK_ONLY_PREFIX = "unpack-only:"  # receipt digest of an --unpack only DEST: never taken for a shard copy


@dataclass(frozen=True)
class FileTask:
    """One file to stage: its manifest ``name`` (also its name in DEST), expected ``bytes`` and
    ``hash``, ``src_path`` (where it is in SRC: a path or URL), and the index of the ``shard`` it
    belongs to (a companion file carries its shard's index)."""

    name: str
    bytes: int
    hash: str
    src_path: str
    shard: int


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """What one node stages where (see the module docstring); built by :func:`plan_stage`.

    ``mode``: ``"full"`` (every shard), ``"partition"`` (this node's share only) or ``"shared"``
    (this node writes its share into a DEST every node sees, then waits for the others).
    ``node``/``num_nodes``/``ranks_per_node``/``node_origin``: this node's identity (0 of 1, origin
    ``"default"``, in full mode, where it does not matter). ``shard_indices``: the manifest's shards
    this node writes, ``tasks`` their files. ``unpack``: None, ``"also"`` or ``"only"``.
    ``explicit_dest``: DEST was given (else stage created it, and ``clean`` may remove it).
    """

    src: str
    src_dir: str
    dest: Path
    manifest: Manifest
    manifest_bytes: bytes
    mode: str
    node: int
    num_nodes: int
    ranks_per_node: int
    node_origin: str
    seed: int
    shard_indices: list[int]
    tasks: list[FileTask]
    unpack: str | None
    unpack_dir: str
    explicit_dest: bool
    storage_options: dict[str, Any] = field(default_factory=dict)  # for every open of SRC
    # Why the default DEST is not ``stager-<id>`` (another user holds that name), for the run's warnings.
    dest_note: str | None = None
    # The sample index (manifest v2): every node copies it with the manifest, from beside SRC's manifest.
    index_task: FileTask | None = None

    @property
    def src_manifest(self) -> str:
        """Path or URL of SRC's ``manifest.json``."""
        return manifest_path(self.src)

    @cached_property
    def src_access(self) -> tuple[int, int | None]:
        """``(mode, gid)`` for what stage writes about SRC (staged manifest, receipt, unpacked files,
        collective copies): the source manifest's, by :func:`~stager.fs.access.source_access` (stat'ed once)."""
        return source_access(self.src_manifest)

    @property
    def shared_node(self) -> int | None:
        """This node's index where its bookkeeping files are per node (shared mode), else None."""
        return self.node if self.mode == "shared" else None

    @property
    def lock_path(self) -> Path:
        return self.dest / lock_name(self.shared_node)

    @property
    def journal_path(self) -> Path:
        return self.dest / journal_name(self.shared_node)

    def marker_name(self, node: int) -> str:
        return marker_name(node, self.num_nodes)

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

    def _dest_shards(self) -> range | list[int]:
        """The shards the finished DEST holds: all of them on a shared DEST, else this node's."""
        return range(len(self.manifest.shards)) if self.mode == "shared" else self.shard_indices

    def receipt_shards(self) -> list[str]:
        """Shards the receipt promises are in DEST."""
        if self.unpack == "only":
            return []
        return [self.manifest.shards[i].name for i in self._dest_shards()]

    def expected_files(self) -> dict[str, int]:
        """Every data file the finished DEST holds (name -> bytes), for the fast-path check: this
        node's shards and their companions, and the sample index."""
        if self.unpack == "only":
            return {}
        out = {}
        if self.index_task is not None:
            out[self.index_task.name] = self.index_task.bytes
        for i in self._dest_shards():
            s = self.manifest.shards[i]
            out[s.name] = s.bytes
            for a in s.aux:
                out[a.name] = a.bytes
        return out


def default_dest_root(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    for var in STAGING_ROOT_VARS:
        if env.get(var):
            return Path(env[var])
    raise UsageError(
        "no destination: give DEST, or set $STAGER_DEST (or run inside Slurm, which sets $SLURM_TMPDIR/$TMPDIR)"
    )


def default_dest(root: Path, dataset_id: str) -> tuple[Path, str | None]:
    """DEST when none is given: ``root/stager-<dataset id>``, unless someone else holds that name.

    A staging root is often shared (``/tmp``), so the predictable name may have been taken by another
    user (a directory of theirs, a symlink, a file). Then an earlier copy of ours
    (``stager-<id>.<8 hex>``, owned by us) is reused, else a fresh unpredictable name is chosen, and
    the returned note says why; the loader finds any of them by their receipts. Never blocks, never
    uses what is not ours. Returns ``(DEST, note or None)``; raises
    :class:`~stager.errors.UnsafePathError` when the root itself can be changed by others (not sticky).
    """
    name = f"stager-{dataset_id}"
    check_chain(root, what="staging root", fix="set $STAGER_DEST to a directory only you can write, or give DEST")
    try:
        st = os.lstat(root / name)
    except FileNotFoundError:
        return root / name, None
    except NotADirectoryError:
        return root / name, None  # the root is not a directory: creating DEST reports it
    if st.st_uid in trusted_uids():
        return root / name, None  # ours (or root's): used if it is a fit DEST, else a refusal saying why
    with contextlib.suppress(OSError):
        for other in sorted(os.listdir(root)):
            if other.startswith(name + ".") and len(other) == len(name) + 9:
                ost = os.lstat(root / other)
                if problem(ost, expect="dir") is None:
                    return root / other, None
    fresh = root / f"{name}.{os.urandom(4).hex()}"
    return fresh, (f"{root / name} is {describe(st)}, not a directory of yours: staged into {fresh} instead "
                   "(the loader finds it)")


def read_src_manifest(src: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
                      ) -> tuple[Manifest, bytes]:
    """Load SRC's manifest and return it with its exact bytes (DEST gets a verbatim copy)."""
    src = os.fspath(src)
    if not is_url(src) and not os.path.exists(src):
        raise SourceNotFoundError(f"{src}: no such packed dataset; give the `stager pack` output directory")
    mp = manifest_path(src)
    try:
        data = read_bytes(mp, storage_options)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise not_a_pack(src) from exc
    except IsADirectoryError as exc:
        raise ShardMissingError(f"{mp}: is a directory, expected manifest.json") from exc
    return Manifest.from_bytes(data, mp, storage_options=storage_options), data


def plan_stage(
    src: str | os.PathLike[str],
    manifest: Manifest,
    manifest_bytes: bytes,
    dest: str | os.PathLike[str] | None,
    options: StageOptions | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> StagePlan:
    """Decide what this node stages where. ``options.shared`` None means: detect (DEST on BeeGFS)."""
    options = options or StageOptions()
    src = os.fspath(src)
    note = None
    if dest is not None:
        dest_path = Path(os.path.abspath(dest))
    else:
        dest_path, note = default_dest(Path(os.path.abspath(default_dest_root(env))), manifest.dataset_id)
    if not is_url(src):
        src = os.path.abspath(src)
    shared = detect_fs(dest_path).is_beegfs if options.shared is None else options.shared
    mode = "shared" if shared else ("partition" if options.partition else "full")
    if mode == "full":
        node, num_nodes, ranks_per_node, origin = 0, 1, options.node.ranks_per_node or 1, "default"
        shard_indices = list(range(len(manifest.shards)))
    else:
        from stager.order.partition import assign_shards_to_nodes  # noqa: PLC0415 (numpy: not for a full stage)

        node, num_nodes, ranks_per_node, origin = options.node.resolve(env)
        # A clip pack's sequence continued across shards stays on one node (docs/clips.md, partition).
        groups = shard_groups(manifest)
        shard_indices = assign_shards_to_nodes(manifest.shard_bytes, num_nodes, options.seed, groups)[node]
    src_dir = shard_root(src, manifest)  # beside the manifest, or where an index's shard_root says
    tasks = []
    for i in shard_indices:
        s = manifest.shards[i]
        tasks.append(FileTask(s.name, s.bytes, s.hash, join(src_dir, s.name), i))
        tasks += [FileTask(a.name, a.bytes, a.hash, join(src_dir, a.name), i) for a in s.aux]
    index_task = None
    if manifest.index is not None:
        ix = manifest.index
        index_task = FileTask(ix.name, ix.bytes, ix.hash, join(dataset_root(src), ix.name), -1)
    listed = {s.name for s in manifest.shards} | {a.name for s in manifest.shards for a in s.aux}
    if manifest.index is not None:
        listed.add(manifest.index.name)
    if options.unpack and options.unpack_dir in listed:
        raise UnsafeArchiveError(f"{manifest_path(src)}: lists a file named {options.unpack_dir!r}, the unpack "
                                 "directory; choose another --unpack-dir")
    return StagePlan(
        src=src, src_dir=src_dir, dest=dest_path, manifest=manifest, index_task=index_task,
        manifest_bytes=bytes_for_copy(manifest, manifest_bytes), mode=mode,
        node=node, num_nodes=num_nodes, ranks_per_node=ranks_per_node, node_origin=origin, seed=options.seed,
        shard_indices=shard_indices, tasks=tasks, unpack=options.unpack, unpack_dir=options.unpack_dir,
        explicit_dest=dest is not None, storage_options=dict(options.storage_options), dest_note=note,
    )


def order_for_streams(tasks: list[FileTask], src_fs: FsInfo | None, block: int = DEFAULT_BLOCK
                      ) -> tuple[list[FileTask], str, int]:
    """Order files for parallel streams; return ``(tasks, how, block size)`` (``block`` is the target).

    From Lustre (with ``lfs``): interleave files by first OST (``lfs getstripe -i``), so the streams
    running at once read from different OSTs, and read blocks that are a multiple of the stripe
    size. Elsewhere: largest first, so the streams finish together.
    """
    if src_fs is not None and src_fs.is_lustre and tasks:
        ordered = _order_by_ost(tasks, block)
        if ordered is not None:
            return ordered
    return sorted(tasks, key=lambda t: -t.bytes), "largest-first", block


def _order_by_ost(tasks: list[FileTask], block: int) -> tuple[list[FileTask], str, int] | None:
    """:func:`order_for_streams` from Lustre; None without ``lfs``. (Imported here: ``lfs`` runs as a
    subprocess, which a stage from elsewhere never loads.)"""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from stager.fs import lustre  # noqa: PLC0415

    if not lustre.lfs_path():
        return None

    def index(t: FileTask) -> int:
        try:
            return lustre.stripe_index(t.src_path)
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
        ssize = lustre.stripe_size(tasks[0].src_path)
    except lustre.LfsError:
        ssize = 0
    return ordered, "ost-round-robin", ssize * max(1, block // ssize) if ssize > 0 else block

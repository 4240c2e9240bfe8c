"""What this node stages where (:func:`plan_stage`, pure): the files (all; this node's
:func:`~stager.order.partition.assign_shards_to_nodes` share with ``--partition``; its share of a
shared BeeOND namespace in ``shared`` mode), DEST, the mode, and the order the copy streams take.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stager.errors import ShardMissingError, UsageError
from stager.fs import lustre
from stager.fs.info import FsInfo, detect_fs
from stager.fs.open import read_bytes
from stager.manifest import Manifest, dataset_root, manifest_path
from stager.order.partition import assign_shards_to_nodes
from stager.receipt import STAGING_ROOT_VARS
from stager.world import resolve_node

DEFAULT_BLOCK = 8 << 20


DEFAULT_UNPACK_DIR = "unpacked"


UNPACK_ONLY_PREFIX = "unpack-only:"


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
    storage_options: dict[str, Any] = field(default_factory=dict)  # for every open of SRC

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
        data = read_bytes(mp, storage_options)
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
    storage_options: dict[str, Any] | None = None,
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
        mine = assign_shards_to_nodes(manifest.shard_bytes, n_nodes, seed)[n_idx]
    root = dataset_root(src)
    join = (lambda n: root.rstrip("/") + "/" + n) if "://" in root else (lambda n: os.path.join(root, n))
    tasks = []
    for i in mine:
        s = manifest.shards[i]
        tasks.append(FileTask(s.name, s.bytes, s.hash, join(s.name), i))
        tasks += [FileTask(a.name, a.bytes, a.hash, join(a.name), i) for a in s.aux]
    return StagePlan(src, root, dest_path, manifest, manifest_bytes, mode, n_idx, n_nodes, rpn, seed, nsrc, mine,
                     tasks, unpack, unpack_dir, explicit, dict(storage_options or {}))


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

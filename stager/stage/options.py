"""What a caller asks of a stage run, in one frozen object validated once.

:func:`stager.stage.stage` (17 keyword arguments) and
:func:`stager.stage.collective.stage_collective` (16) keep their keyword signatures, which docs/ and
job scripts use; each builds one :class:`StageOptions` (a :class:`CollectiveOptions` around one for
the collective) and everything below them (planning, the engine, the collective's fallback to a
plain stage, the CLI) passes that object instead of copying the keywords again. Construction
validates every field that does not need the file system or the environment (a :class:`UsageError`,
exit 2, before anything is read); node identity is checked where it is resolved
(:func:`stager.world.resolve_node`), because a full copy never resolves it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from stager.errors import UsageError
from stager.fs.copy import CopyTuning
from stager.manifest import RESERVED_NAMES, UNPACK_DIR_NAME, entry_name_problem
from stager.world import NodeIdentity, resolve_node

if TYPE_CHECKING:
    from stager.cache.config import CacheOptions

DEFAULT_UNPACK_DIR = UNPACK_DIR_NAME
UNPACK_MODES = ("also", "only")
FALLBACKS = ("direct", "none")
BACKENDS = ("gloo", "nccl")
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


def unpack_mode(unpack: bool | str | None) -> str | None:
    """``stage(unpack=...)`` as a mode: False/None -> None, True -> ``"also"``; strings unchanged."""
    if isinstance(unpack, str):
        return unpack
    return "also" if unpack else None


@dataclass(frozen=True)
class NodeOptions:
    """This node's identity as the caller gave it (``--node``, ``--num-nodes``, ``--ranks-per-node``).

    None means "detect": :meth:`resolve` asks :func:`stager.world.resolve_node` (flags, then Slurm,
    then torchrun). Only ``--partition``, a shared DEST and collective staging need it.
    """

    node: int | None = None
    num_nodes: int | None = None
    ranks_per_node: int | None = None

    def resolve(self, env: Mapping[str, str] | None = None) -> NodeIdentity:
        return resolve_node(self.node, self.num_nodes, self.ranks_per_node, env)

    @classmethod
    def of(cls, identity: NodeIdentity) -> NodeOptions:
        """Options that resolve to ``identity`` (with origin ``"flags"``)."""
        return cls(identity.node, identity.num_nodes, identity.ranks_per_node)


@dataclass(frozen=True)
class StageOptions:
    """Everything :func:`stager.stage.stage` takes besides SRC and DEST (see its docstring).

    ``unpack``: None, ``"also"`` or ``"only"`` (:func:`unpack_mode` maps the API's booleans);
    ``workers``: copy streams, None or 0 for :attr:`copy_streams`' default; ``shared``: None detects a
    BeeGFS DEST; ``timeout``: seconds for the node lock and for peers (None: no limit);
    ``storage_options``: passed to every open of SRC (fsspec URLs); ``tuning``: the copy engine's
    knobs; ``fsync=False``: ``--no-fsync``; ``repair``: ``--repair``; ``cache``: stage through a
    shard cache (``--cache DIR``, :mod:`stager.stage.cached`); ``mount``: mount the staged images
    read-only under DEST (``--mount``, :mod:`stager.stage.mount`).
    """

    workers: int | None = None
    unpack: str | None = None
    unpack_dir: str = DEFAULT_UNPACK_DIR
    partition: bool = False
    shared: bool | None = None
    node: NodeOptions = field(default_factory=NodeOptions)
    seed: int = 0
    timeout: float | None = None
    quiet: bool = True
    storage_options: dict[str, Any] = field(default_factory=dict)
    tuning: CopyTuning | None = None
    fsync: bool = True
    cache: CacheOptions | None = None
    repair: bool = False  # --repair: hash DEST's copies again, stage again what differs (stager.stage.repair)
    mount: bool = False  # --mount: squashfuse each staged image under DEST/mnt (stager.stage.mount)

    def __post_init__(self) -> None:
        if self.cache is not None and (self.unpack == "only" or self.shared):
            raise UsageError("--cache cannot be combined with --unpack only (no shard is kept) or --shared (a "
                             "BeeOND DEST lives as long as the job): the cache is node-local")
        if self.mount and self.cache is not None and self.cache.only:
            raise UsageError("--mount mounts the images of a DEST: --cache-only stages none")
        if self.unpack is not None and self.unpack not in UNPACK_MODES:
            raise UsageError(f"--unpack must be 'also' or 'only', got {self.unpack!r}")
        if self.unpack_dir in ("", ".", "..") or "/" in self.unpack_dir:
            raise UsageError(f"--unpack-dir must be a plain directory name, got {self.unpack_dir!r}")
        if entry_name_problem(self.unpack_dir) is not None or self.unpack_dir.startswith(".stager") or (
                self.unpack_dir != UNPACK_DIR_NAME and self.unpack_dir in RESERVED_NAMES) or \
                self.unpack_dir.endswith(".partial"):
            # Checked before DEST is touched: stage's own files (manifest, receipt, journal, lock) under
            # that name made the run fail after the copy, with advice that could not work.
            raise UsageError(f"--unpack-dir {self.unpack_dir!r} is the name of one of stager's own files (or not "
                             f"a name a directory may have); choose another, e.g. the default {UNPACK_DIR_NAME!r}")
        if self.workers is not None and self.workers < 0:
            raise UsageError(f"--workers must be >= 1, got {self.workers}")
        # A private copy: the caller's dict may change after the call, the plan's must not.
        object.__setattr__(self, "storage_options", dict(self.storage_options))

    @property
    def copy_streams(self) -> int:
        """Parallel copy streams (and unpack threads): ``workers``, else ``min(8, max(2, cores))``."""
        return self.workers or min(8, max(2, os.cpu_count() or 2))


@dataclass(frozen=True)
class CollectiveOptions:
    """What :func:`stager.stage.collective.stage_collective` takes besides SRC and DEST.

    ``stage``: the options it shares with a plain stage (partition, node, seed, timeout, quiet,
    storage options; DEST is never shared), also what a fallback to a plain stage runs with; its
    ``timeout`` (default :data:`DEFAULT_COLLECTIVE_TIMEOUT`) bounds the rendezvous and every
    collective. ``fallback``: what to do when the group cannot form (``"direct"``: stage from SRC
    without peers; ``"none"``: fail, exit 5). ``backend``: ``"gloo"`` or ``"nccl"``.
    ``chunk_bytes``/``memory_bytes``: the exchange's preferred chunk and its memory budget.
    ``master_addr``/``master_port``: node 0's rendezvous store (default: the environment).
    """

    stage: StageOptions = field(default_factory=StageOptions)
    fallback: str = "direct"
    backend: str = "gloo"
    chunk_bytes: int = 8 << 20
    memory_bytes: int = 256 << 20
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise UsageError(f"--fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if self.backend not in BACKENDS:
            raise UsageError(f"backend must be gloo or nccl, got {self.backend!r}")
        timeout = DEFAULT_COLLECTIVE_TIMEOUT if self.stage.timeout is None else self.stage.timeout
        object.__setattr__(self, "stage", replace(self.stage, shared=False, timeout=timeout))

    @property
    def timeout(self) -> float:
        """Seconds for the rendezvous, every collective and the node lock."""
        assert self.stage.timeout is not None  # set in __post_init__
        return self.stage.timeout

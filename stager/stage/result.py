"""What a stage run did: :class:`StageResult`, returned by :func:`stager.stage.stage` and printed by
``stager stage --json`` (:meth:`StageResult.to_json`; job scripts read its field names, so they are
stable) or as one line (:meth:`StageResult.summary`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StageResult:
    """One node's stage run. ``source``: SRC as staged (absolute); ``files_total``/``bytes_total``:
    the files this node is responsible for; ``files_copied``/``bytes_copied``: what this run copied
    (``--unpack only`` of tar shards: bytes streamed from SRC); ``files_kept``: verified files of an
    earlier run kept; ``already_staged``: a receipt already covered the plan (nothing read);
    ``waited_s``: for the node lock and, in shared mode, the other nodes; ``lock_takeover``: the dead
    holder whose lock was taken over; ``ordering``/``workers``/``block_size``/``io``: how the copy
    streams ran; ``durable``: False after ``--no-fsync``; ``node_source``: where node identity came
    from (``"flags"``, ``"slurm"``, ``"torchrun"``, ``"default"``...); ``source_fs``/``dest_fs``: file
    system types; ``warnings``: printed by the CLI on stderr; ``phases``: wall seconds of each phase
    of the run (:meth:`timed`: plan, dest, lock, claim, copy, unpack, seal, finish; a profile, not a
    contract: the names may change).
    """

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
    cache: dict[str, Any] | None = None
    repaired: list[str] = field(default_factory=list)  # --repair: "<file>: <why>" for each copy staged again
    mounts: list[str] = field(default_factory=list)  # --mount: where each staged image is mounted
    phases: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall seconds the ``with`` block takes to ``phases[phase]``."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] = self.phases.get(phase, 0.0) + time.perf_counter() - t

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
        if self.repaired:
            names = ", ".join(r.split(":", 1)[0] for r in self.repaired[:4])
            s += f"; repaired {len(self.repaired)} damaged files ({names})"
        if self.cache:
            c = self.cache
            s += (f"; cache {c['dir']}: {c['files_hit']} files ({c['bytes_hit'] / 1e9:.3f} GB) linked from it"
                  f" ({c['links'] or 'no'} links), {c['files_filled']} copied into it")
            if c["files_from_peer"]:
                s += f", {c['files_from_peer']} filled by another stage meanwhile"
            if c["files_uncached"]:
                s += f", {c['files_uncached']} not cached"
            if c["evicted_files"]:
                s += f", {c['evicted_files']} evicted ({c['evicted_bytes'] / 1e9:.3f} GB freed)"
        if self.unpacked:
            s += f"; unpacked {self.unpacked_files} files to {self.unpacked}"
        return s

"""Who reads what from the shared file system, and how the bytes are laid out on the wire.

Pure functions (no I/O, no torch) so the invariants are tested directly:

* :func:`assign_read_shares` splits the shards into one disjoint, byte-balanced *read share* per
  node (every shard in exactly one share, so the shared file system serves each byte once). When the
  OST index of each shard is known (Lustre, ``lfs getstripe -i``), each node's share also holds
  about the same bytes from every OST, and each node visits the OSTs in a rotated order so that the
  ``N`` concurrent readers start on different OSTs instead of all hammering OST 0 first.
* :class:`StreamLayout` (made by :func:`stream_layouts`) is one node's share seen as a single byte
  stream: the concatenation of its files (each shard followed by its companion files). Chunk ``s``
  of node ``j``'s stream is bytes ``[s*c, (s+1)*c)``; every node knows every layout, so chunks carry
  no header and a receiver demultiplexes them into files by offset alone.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stager.errors import UsageError
from stager.manifest import Manifest
from stager.manifest.clips import shard_groups
from stager.order import streams
from stager.order.partition import assign_shards_to_nodes


@dataclass(frozen=True)
class FileEntry:
    """One file of the dataset: name (relative to SRC and DEST), size in bytes, checksum, shard index."""

    name: str
    bytes: int
    hash: str
    shard: int


def files_of_shards(manifest: Manifest, shards: Sequence[int]) -> list[FileEntry]:
    """The files of ``shards`` in order: each shard, then its companion (aux) files."""
    out = []
    for i in shards:
        s = manifest.shards[i]
        out.append(FileEntry(s.name, s.bytes, s.hash, i))
        out += [FileEntry(a.name, a.bytes, a.hash, i) for a in s.aux]
    return out


def assign_read_shares(
    manifest: Manifest, num_nodes: int, seed: int = 0, osts: Sequence[int] | None = None
) -> list[list[int]]:
    """``num_nodes`` lists of shard indices (in read order); every shard appears in exactly one.

    Without ``osts`` this is :func:`stager.order.partition.assign_shards_to_nodes` (byte-balanced, seeded),
    so a ``--partition`` share and a read share coincide. With ``osts`` (first OST index of each
    shard, -1 for unknown) the shards of each OST are spread over the nodes by longest-processing
    -time greedy on the node's total bytes (ties by a seeded permutation), which keeps the nodes
    byte-balanced to within one shard per OST and gives each node an equal slice of every OST; each
    node then reads its shards round-robin over OSTs starting at OST ``node mod #osts``.
    """
    if num_nodes < 1:
        raise UsageError(f"num_nodes must be >= 1, got {num_nodes}")
    if osts is None or len(set(osts)) <= 1:
        return assign_shards_to_nodes(manifest.shard_bytes, num_nodes, seed, shard_groups(manifest))
    if len(osts) != len(manifest.shards):
        raise UsageError(f"got {len(osts)} OST indices for {len(manifest.shards)} shards")
    sizes = manifest.shard_bytes
    perm = streams.read_shares(seed, num_nodes).permutation(len(sizes))
    rank_of = np.empty(len(sizes), dtype=np.int64)
    rank_of[perm] = np.arange(len(sizes))
    by_ost: dict[int, list[int]] = defaultdict(list)
    for i, o in enumerate(osts):
        by_ost[int(o)].append(i)
    loads = [0] * num_nodes
    out: list[list[int]] = [[] for _ in range(num_nodes)]
    for o in sorted(by_ost):
        group = sorted(by_ost[o], key=lambda i: (-int(sizes[i]), int(rank_of[i])))
        # Per OST: least-loaded node overall first, but each node takes at most one shard of this
        # OST per round, so an OST's shards are spread over all nodes before any node gets two.
        per_ost_count = [0] * num_nodes
        for shard in group:
            heap = [(per_ost_count[n], loads[n], n) for n in range(num_nodes)]
            heapq.heapify(heap)
            _, _, node = heap[0]
            out[node].append(shard)
            per_ost_count[node] += 1
            loads[node] += int(sizes[shard])
    ost_list = sorted(by_ost)
    return [_rotate_by_ost(share, osts, ost_list, node) for node, share in enumerate(out)]


def _rotate_by_ost(share: list[int], osts: Sequence[int], ost_list: list[int], node: int) -> list[int]:
    """Order ``share`` round-robin over OSTs, starting at the ``node``-th OST (mod #OSTs)."""
    queues: dict[int, list[int]] = defaultdict(list)
    for i in sorted(share):
        queues[int(osts[i])].append(i)
    start = node % len(ost_list)
    order = ost_list[start:] + ost_list[:start]
    out: list[int] = []
    while len(out) < len(share):
        for o in order:
            if queues[o]:
                out.append(queues[o].pop(0))
    return out


@dataclass(frozen=True)
class StreamLayout:
    """One node's read share as a byte stream: ``files`` back to back, ``length`` bytes in all."""

    node: int
    files: tuple[FileEntry, ...]

    @property
    def length(self) -> int:
        return sum(f.bytes for f in self.files)

    def steps(self, chunk: int) -> int:
        """Number of ``chunk``-byte pieces the stream needs (0 for an empty stream)."""
        return -(-self.length // chunk)


def stream_layouts(
    manifest: Manifest, shares: Sequence[Sequence[int]], skip: set[str] = frozenset()  # type: ignore[assignment]
) -> list[StreamLayout]:
    """One :class:`StreamLayout` per node from its read share, leaving out files named in ``skip``.

    ``skip`` holds the files every node already has verified (a resumed run): nobody sends them.
    """
    return [
        StreamLayout(node, tuple(f for f in files_of_shards(manifest, share) if f.name not in skip))
        for node, share in enumerate(shares)
    ]


def chunk_size_for(num_nodes: int, chunk_bytes: int, memory_bytes: int, min_chunk: int = 64 << 10) -> int:
    """Bytes per node per exchange step so the receive buffers (3 steps x ``num_nodes`` chunks) fit.

    ``chunk_bytes`` is the preferred size, ``memory_bytes`` the budget for all exchange buffers.
    The result is a multiple of 4 KiB, between ``min_chunk`` and ``chunk_bytes``.
    """
    if chunk_bytes < 4096 or memory_bytes < 4096:
        raise UsageError("chunk and memory budget must be at least 4 KiB")
    fit = memory_bytes // (3 * (num_nodes + 1))
    c = max(min(chunk_bytes, fit), min(min_chunk, chunk_bytes))
    return max(4096, c // 4096 * 4096)

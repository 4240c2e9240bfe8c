"""Static assignment of shards to nodes, shared by ``stage --partition``/``--shared`` and the loader.

When a node stages only part of a dataset, the loader on that node must read exactly those shards.
Both sides call :func:`assign_shards_to_nodes` with the same (shard bytes, nodes, seed) so they
agree by construction. The assignment is byte-balanced (longest-processing-time greedy over a seeded
permutation, so equal-size shards are spread differently for different seeds) and does not depend
on the epoch: data staged once serves every epoch.
"""

from __future__ import annotations

import heapq

import numpy as np

from stager.errors import UsageError
from stager.order import streams
from stager.order.epoch import samples_per_rank


def assign_shards_to_nodes(
    shard_bytes: np.ndarray, num_nodes: int, seed: int = 0, groups: np.ndarray | None = None
) -> list[list[int]]:
    """Return ``num_nodes`` sorted lists of shard indices; every shard appears in exactly one.

    ``groups`` (int64 (shards,), non-decreasing group ids, or None: each shard its own group): shards
    of one group go to one node together (a clip pack's sequence continued across shards,
    :func:`stager.manifest.clips.shard_groups`), balanced as one unit of their summed bytes. With
    one group per shard the assignment is exactly the plain one.

    ``shard_bytes``: int64 (shards,), each shard's bytes with its companion files
    (:attr:`stager.manifest.Manifest.shard_bytes`). Bytes are balanced greedily (largest shard
    first onto the least-loaded node; ties broken by the :func:`~stager.order.streams.node_partition`
    permutation). With fewer shards than nodes some nodes get none; callers that need every node to
    have data must check that.
    """
    if num_nodes < 1:
        raise UsageError(f"num_nodes must be >= 1, got {num_nodes}")
    if groups is not None:
        groups = np.asarray(groups, dtype=np.int64)
        unit_bytes = np.bincount(groups, weights=np.asarray(shard_bytes, dtype=np.float64)).astype(np.int64)
        units = assign_shards_to_nodes(unit_bytes, num_nodes, seed)
        members = [np.flatnonzero(groups == g).tolist() for g in range(len(unit_bytes))]
        return [sorted(s for g in u for s in members[g]) for u in units]
    sizes = np.asarray(shard_bytes, dtype=np.int64)
    perm = streams.node_partition(seed, num_nodes).permutation(len(sizes))
    # Stable sort of the permuted order by descending size: equal sizes keep the seeded order.
    order = perm[np.argsort(-sizes[perm], kind="stable")]
    heap = [(0, node) for node in range(num_nodes)]
    out: list[list[int]] = [[] for _ in range(num_nodes)]
    for shard in order:
        load, node = heapq.heappop(heap)
        out[node].append(int(shard))
        heapq.heappush(heap, (load + int(sizes[shard]), node))
    return [sorted(x) for x in out]


def shards_of_node(
    shard_bytes: np.ndarray, node: int, num_nodes: int, seed: int = 0, groups: np.ndarray | None = None
) -> list[int]:
    """The shard indices node ``node`` of ``num_nodes`` holds (see :func:`assign_shards_to_nodes`)."""
    if not 0 <= node < num_nodes:
        raise UsageError(f"node {node} out of range for {num_nodes} nodes")
    return assign_shards_to_nodes(shard_bytes, num_nodes, seed, groups)[node]


def partition_samples_per_rank(
    shard_bytes: np.ndarray,
    shard_samples: np.ndarray,
    *,
    num_nodes: int,
    seed: int,
    ranks_per_node: int,
    drop_last: bool,
    groups: np.ndarray | None = None,
) -> int:
    """Samples per rank when every node's ranks read only the node's shards (``stage --partition``).

    The count must be the same on every node so that every rank gets the same number of batches:
    the largest node's ``ceil(samples / ranks_per_node)`` when padding, the smallest node's
    ``floor(...)`` with ``drop_last``. ``shard_samples``: int64 (shards,), the items each shard
    contributes (samples, or a clip pack's windows by the shard of their first frame; ``groups`` as
    for :func:`assign_shards_to_nodes`). Every node derives it alike from the manifest (no
    communication).
    """
    counts = np.asarray(shard_samples, dtype=np.int64)
    nodes = assign_shards_to_nodes(shard_bytes, num_nodes, seed, groups)
    per = [samples_per_rank(int(counts[g].sum()) if g else 0, ranks_per_node, drop_last) for g in nodes]
    return min(per) if drop_last else max(per)

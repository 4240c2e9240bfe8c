"""Every random stream stager draws from, in one table.

Each draw is ``numpy.random.default_rng(key)`` with a tuple key whose parts say whose stream it is;
never ``seed + epoch`` (which collides: seed 1 epoch 0 = seed 0 epoch 1). The tag in each key keeps
streams of different purposes apart even where the other parts coincide. Changing a key changes
what every node and rank computes, so these are part of the on-disk contract where noted.

================  ==============================================  =====================================
stream            key                                             draws
================  ==============================================  =====================================
pack order        ``(seed, PACK_ORDER)``                          permutation of the source's samples
node partition    ``(seed, num_nodes)``                           tie-break order of shards to nodes
                                                                  (receipts of ``--partition`` rely on it)
read shares       ``(seed, num_nodes, READ_SHARES)``              tie-break order of collective read shares
epoch runs        ``(seed, epoch, EPOCH_RUNS)``                   the epoch's run order
shuffle buffer    ``(seed, epoch, SHUFFLE_BUFFER, world, rank,    a worker stream's buffer shuffle
                  workers, worker)``
augment           ``(seed, epoch, AUGMENT, world, rank, batch)``  a batch's crops and flips
================  ==============================================  =====================================
"""

from __future__ import annotations

import numpy as np

PACK_ORDER = 0x5EED_9AC4
EPOCH_RUNS = 1
SHUFFLE_BUFFER = 2
AUGMENT = 3
READ_SHARES = 0x5EAD_0004  # was 1 (= EPOCH_RUNS) before: (seed, n, 1) met (seed, epoch, 1) at n == epoch


def pack_order(seed: int) -> np.random.Generator:
    return np.random.default_rng((seed, PACK_ORDER))


def node_partition(seed: int, num_nodes: int) -> np.random.Generator:
    return np.random.default_rng((seed, num_nodes))


def read_shares(seed: int, num_nodes: int) -> np.random.Generator:
    return np.random.default_rng((seed, num_nodes, READ_SHARES))


def epoch_runs(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng((seed, epoch, EPOCH_RUNS))


def shuffle_buffer(
    seed: int, epoch: int, world_size: int, rank: int, *, workers: int, worker: int
) -> np.random.Generator:
    return np.random.default_rng((seed, epoch, SHUFFLE_BUFFER, world_size, rank, workers, worker))


def augment(seed: int, epoch: int, world_size: int, rank: int, batch: int) -> np.random.Generator:
    return np.random.default_rng((seed, epoch, AUGMENT, world_size, rank, batch))

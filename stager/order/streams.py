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
mix round         ``(seed, epoch, MIX_ROUND, stream, j)``         a mix stream's ``j``-th whole pass of
                                                                  an epoch (up-sampled: several)
mix cycle         ``(seed, cycle, MIX_CYCLE, stream)``            a mix stream's rotation order, kept
                                                                  for the ``ceil(N / r)`` epochs that
                                                                  take its remainder ``r`` from it
mix layout        ``(seed, epoch, MIX_LAYOUT, world, rank)``      which stream fills each place of a
                                                                  rank's batches (random, stratified)
mix batch order   ``(seed, epoch, MIX_BATCH_ORDER, world)``       the order of the streams' batches
                                                                  (per_stream: the same on every rank)
mix buffer        ``(seed, epoch, MIX_BUFFER, world, rank,        a worker's shuffle buffer over one
                  workers, worker, stream)``                      stream of a mix
================  ==============================================  =====================================
"""

from __future__ import annotations

import numpy as np
import numpy.random  # numpy loads it on first use (~20 ms): here, with the imports, not mid-run

PACK_ORDER = 0x5EED_9AC4
EPOCH_RUNS = 1
SHUFFLE_BUFFER = 2
AUGMENT = 3
READ_SHARES = 0x5EAD_0004  # was 1 (= EPOCH_RUNS) before: (seed, n, 1) met (seed, epoch, 1) at n == epoch
# Mixing several datasets (stager.order.mix): tags no other key uses at their position.
MIX_ROUND = 0x313_0001
MIX_CYCLE = 0x313_0002
MIX_LAYOUT = 0x313_0003
MIX_BATCH_ORDER = 0x313_0004
MIX_BUFFER = 0x313_0005


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


def mix_round(seed: int, stream: int, epoch: int, j: int) -> np.random.Generator:
    return np.random.default_rng((seed, epoch, MIX_ROUND, stream, j))


def mix_cycle(seed: int, stream: int, cycle: int) -> np.random.Generator:
    return np.random.default_rng((seed, cycle, MIX_CYCLE, stream))


def mix_layout(seed: int, epoch: int, world_size: int, rank: int) -> np.random.Generator:
    return np.random.default_rng((seed, epoch, MIX_LAYOUT, world_size, rank))


def mix_batch_order(seed: int, epoch: int, world_size: int) -> np.random.Generator:
    return np.random.default_rng((seed, epoch, MIX_BATCH_ORDER, world_size))


def mix_buffer(
    seed: int, epoch: int, world_size: int, rank: int, *, workers: int, worker: int, stream: int
) -> np.random.Generator:
    return np.random.default_rng((seed, epoch, MIX_BUFFER, world_size, rank, workers, worker, stream))

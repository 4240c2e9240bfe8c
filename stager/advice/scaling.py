"""A bandwidth model of staging at scale: how long, and how many bytes the shared file system serves.

Strategies (``D`` dataset bytes, ``N`` nodes, ``E`` epochs; docs/scaling.md derives each line):

* ``direct``: every node copies the whole dataset from the shared FS. FS bytes ``N*D``; time
  ``max(N*D / FS, D / min(NIC, SSDw))`` plus ``N*files`` metadata operations.
* ``collective`` (``stager stage --collective``): each byte leaves the FS once, nodes exchange the
  rest. FS bytes ``D``; time ``max(D / FS, D / NIC, D / SSDw)`` (a node's NIC carries its 1/N
  share from the FS plus (N-1)/N from peers) plus the ring all_gather latency ``steps*(N-1)*alpha``
  plus, on more than one node, the constant cost of forming the group (importing torch, rendezvous).
* ``partition`` (``stage --partition``): each node copies only its share. FS bytes ``D``; time
  ``max(D / FS, D/N / min(NIC, SSDw))``; the loader then reads only node-local shards.
* ``beeond``: copy once into a per-job BeeOND over the nodes' SSDs, then read over the network every
  epoch. FS bytes ``D``; time ``start + max(D / FS, D / (N*min(NIC, SSDw)))``; each epoch a node
  reads its ``D/N`` (mostly remote) at ``NIC``.
* ``stream``: no staging; every epoch the ranks read their ``D/N`` from the shared FS. FS bytes
  ``E*D``; per epoch ``D / FS`` plus ``files`` metadata operations.

``FS`` is the effective shared-FS bandwidth ``min(aggregate, OSTs*per-OST, N*NIC)``. The model is a
roofline: it ignores overlap losses and protocol overheads, so it predicts a lower bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from stager.errors import UsageError
from stager.world import allocated_nodes

STRATEGIES = ("direct", "collective", "partition", "beeond", "stream")
GB = 1e9


@dataclass(frozen=True)
class Cluster:
    """Inputs of the model; bandwidths in bytes/s (per node unless named aggregate)."""

    dataset_bytes: float
    nodes: int
    nic_bps: float = 12.5e9  # 100 Gb/s per node
    fs_bps: float = 100e9  # shared FS aggregate read bandwidth
    osts: int = 64
    ost_bps: float = 2e9
    ssd_write_bps: float = 3e9
    ssd_read_bps: float = 6e9
    files: int = 600  # shard files (a 150 GB dataset in 256 MiB shards)
    mds_ops: float = 20e3  # metadata operations per second the MDS sustains
    epochs: int = 90
    local_capacity: float | None = None  # node-local bytes available (None: unlimited)
    alpha_s: float = 20e-6  # per-message latency of the exchange
    chunk_bytes: float = 8 << 20
    exchange_memory: float = 256 << 20
    beeond_start_s: float = 30.0
    # Importing torch and forming the gloo group on every node before the first byte moves: 2-3 s on
    # tools/cluster with torch on a local disk (docs/scaling.md); more where thousands of nodes import
    # torch from a parallel file system at once.
    group_setup_s: float = 3.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.dataset_bytes <= 0:
            raise UsageError("nodes must be >= 1 and dataset_bytes > 0")
        for name in ("nic_bps", "fs_bps", "ost_bps", "ssd_write_bps", "ssd_read_bps", "mds_ops"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name} must be > 0")
        if self.group_setup_s < 0:
            raise UsageError("group_setup_s must be >= 0")

    def fs_effective(self, readers: int) -> float:
        """Shared-FS bandwidth that ``readers`` nodes can draw (FS, OSTs and their NICs all limit)."""
        return min(self.fs_bps, self.osts * self.ost_bps, readers * self.nic_bps)


@dataclass(frozen=True)
class Prediction:
    """One strategy at one node count: staging seconds, per-epoch read seconds, FS bytes, bottleneck."""

    strategy: str
    nodes: int
    stage_s: float
    epoch_io_s: float
    fs_bytes_stage: float
    fs_bytes_run: float
    feasible: bool
    bottleneck: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _bound(**terms: float) -> tuple[float, str]:
    name = max(terms, key=lambda k: terms[k])
    return terms[name], name


def exchange_chunk(c: Cluster) -> float:
    """Bytes per node per exchange step (mirrors stager.stage.collective.plan.chunk_size_for)."""
    fit = c.exchange_memory / (3 * (c.nodes + 1))
    return max(min(c.chunk_bytes, fit), min(64 << 10, c.chunk_bytes))


def predict(c: Cluster, strategy: str) -> Prediction:
    """Predict one strategy (see module docstring for the formulas)."""
    d, n = c.dataset_bytes, c.nodes
    fs = c.fs_effective(n)
    local_write = min(c.nic_bps, c.ssd_write_bps)
    local_epoch = d / n / c.ssd_read_bps  # a node's ranks read their share from local SSD
    cap = c.local_capacity
    if strategy == "direct":
        t, why = _bound(shared_fs=n * d / fs, node_link=d / local_write)
        t += n * c.files / c.mds_ops
        return Prediction(strategy, n, t, local_epoch, n * d, n * d, cap is None or d <= cap, why)
    if strategy == "collective":
        t, why = _bound(shared_fs=d / fs, nic=d / c.nic_bps, ssd_write=d / c.ssd_write_bps)
        if n > 1:
            steps = d / n / exchange_chunk(c)
            t += steps * (n - 1) * c.alpha_s + c.group_setup_s
        t += c.files / c.mds_ops
        return Prediction(strategy, n, t, local_epoch, d, d, cap is None or d <= cap, why)
    if strategy == "partition":
        t, why = _bound(shared_fs=d / fs, node_link=d / n / local_write)
        t += c.files / c.mds_ops
        return Prediction(strategy, n, t, local_epoch, d, d, cap is None or d / n <= cap, why)
    if strategy == "beeond":
        t, why = _bound(shared_fs=d / fs, beeond_write=d / (n * local_write))
        t += c.beeond_start_s + c.files / c.mds_ops
        epoch = d / n / min(c.nic_bps, c.ssd_read_bps)
        return Prediction(strategy, n, t, epoch, d, d, cap is None or d / n <= cap, why)
    if strategy == "stream":
        epoch = d / fs + c.files / c.mds_ops
        return Prediction(strategy, n, 0.0, epoch, 0.0, c.epochs * d, True, "shared_fs")
    raise UsageError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")


def table(base: Cluster, node_counts: list[int]) -> list[Prediction]:
    """Every strategy at every node count in ``node_counts``."""
    return [predict(replace(base, nodes=n), s) for n in node_counts for s in STRATEGIES]


def recommend(c: Cluster) -> dict[str, Any]:
    """Pick a strategy: a full local copy when it fits, else a node's share, else streaming.

    A full copy keeps the loader's global shuffle and reads locally every epoch: ``collective``
    when it stages at least 10% faster than ``direct`` (more nodes than the shared FS can feed at
    NIC speed), else ``direct`` (no process group needed). When only a node's share fits,
    ``partition`` (node-local shuffle) with ``beeond`` as the global-shuffle alternative. When
    nothing fits, ``stream`` with :mod:`stager.prefetch` inside the local budget.
    """
    preds = {s: predict(c, s) for s in STRATEGIES}
    d, n, cap = c.dataset_bytes, c.nodes, c.local_capacity
    if cap is None or d <= cap:
        col, dire = preds["collective"], preds["direct"]
        if n > 1 and col.stage_s < 0.9 * dire.stage_s:
            best = "collective"
            why = (f"{n} full copies would take the shared FS {dire.stage_s:.3g}s and "
                   f"{dire.fs_bytes_stage / GB:.3g} GB; "
                   f"reading once and exchanging over the interconnect takes {col.stage_s:.3g}s and "
                   f"{col.fs_bytes_stage / GB:.3g} GB")
        else:
            best = "direct"
            why = "the shared FS can feed every node a full copy about as fast as the nodes can write it"
    elif d / n <= cap:
        best = "partition"
        why = (f"the dataset ({d / GB:.0f} GB) exceeds a node's {cap / GB:.0f} GB but a 1/{n} share fits; the loader "
               "then shuffles within a node's shards (BeeOND keeps a global shuffle at network cost)")
    else:
        best = "stream"
        why = "not even a node's share fits locally: read the shared FS, prefetching within the local budget"
    # One stager per node: `srun --ntasks-per-node=1` in a job of several nodes; on one node, the command itself.
    per_node = "srun --ntasks-per-node=1 " if n > 1 else ""
    cmd = {
        "direct": f"{per_node}stager stage SRC",
        "collective": f"{per_node}stager stage SRC --collective --timeout 600",
        "partition": f"{per_node}stager stage SRC --partition",
        "stream": "read SRC directly (stager.prefetch.Prefetcher with the local budget)",
    }[best]
    p = preds[best]
    return {
        "strategy": best,
        "reason": why,
        "command": cmd,
        "stage_s": round(p.stage_s, 1),
        "fs_bytes": p.fs_bytes_run,
        "alternatives": {s: {"stage_s": round(q.stage_s, 1), "epoch_io_s": round(q.epoch_io_s, 2),
                             "fs_gb_run": round(q.fs_bytes_run / GB, 1), "feasible": q.feasible}
                         for s, q in preds.items()},
    }


def format_table(preds: list[Prediction]) -> str:
    """A fixed-width text table of :func:`table`'s output."""
    head = f"{'nodes':>6} {'strategy':<11} {'stage s':>10} {'epoch io s':>10} {'FS GB (stage)':>14} {'FS GB (run)':>12}"
    lines = [head, "-" * len(head)]
    for p in preds:
        mark = "" if p.feasible else "  (does not fit)"
        lines.append(
            f"{p.nodes:>6} {p.strategy:<11} {p.stage_s:>10.1f} {p.epoch_io_s:>10.2f} {p.fs_bytes_stage / GB:>14.1f} "
            f"{p.fs_bytes_run / GB:>12.1f}  [{p.bottleneck}]{mark}"
        )
    return "\n".join(lines)


def strategy_for(
    dataset_bytes: float,
    *,
    nodes: int | None = None,
    local_capacity: float | None = None,
    osts: int | None = None,
    files: int = 600,
) -> dict[str, Any]:
    """:func:`recommend` with the model's default bandwidths, for ``stager hints``.

    ``nodes`` defaults to the job's node count ($SLURM_NNODES / $SLURM_JOB_NUM_NODES), else 1.
    """

    if nodes is None:
        nodes = allocated_nodes() or 1
    base = Cluster(dataset_bytes=max(float(dataset_bytes), 1.0), nodes=max(1, nodes), files=max(1, files),
                   local_capacity=local_capacity)
    if osts:
        base = replace(base, osts=osts)
    rec = recommend(base)
    rec["nodes"] = base.nodes
    rec["assumptions"] = {"nic_gbit": base.nic_bps * 8 / 1e9, "fs_gbs": base.fs_bps / 1e9, "osts": base.osts,
                          "ssd_write_gbs": base.ssd_write_bps / 1e9, "model": "stager.advice.scaling (docs/scaling.md)"}
    return rec

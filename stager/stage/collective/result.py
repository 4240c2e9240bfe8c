"""What a collective stage did: :class:`CollectiveResult`, one node's figures plus totals over all nodes.

Printed by ``stager stage --collective --json`` (:meth:`CollectiveResult.to_json`; job scripts read
its field names) or as a few lines (:meth:`CollectiveResult.summary`). :func:`node_stats` is what each
node contributes to the ``all_gather`` behind ``totals``; :func:`totals` sums them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CollectiveResult:
    """What one node did, plus ``totals`` summed over all nodes (identical on every node).

    ``src_bytes``: bytes this node read from SRC; ``exchange_bytes``: payload bytes it received
    from peers; ``totals["src_bytes"]`` equals the bytes that had to be staged (1x the dataset on a
    fresh run), whatever the node count.
    """

    ok: bool
    source: str
    dest: str
    mode: str
    node: int
    num_nodes: int
    dataset_id: str
    dataset_bytes: int
    collective: bool = True
    fallback: str | None = None
    files_written: int = 0
    files_kept: int = 0
    src_bytes: int = 0
    local_bytes: int = 0
    exchange_bytes: int = 0
    written_bytes: int = 0
    steps: int = 0
    chunk_bytes: int = 0
    group_s: float = 0.0
    exchange_s: float = 0.0
    seconds: float = 0.0
    gbps: float = 0.0
    backend: str = ""
    share_shards: int = 0
    receipt: str = ""
    totals: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    cache: dict[str, Any] | None = None  # what the shard cache did (--cache), as StageResult.cache

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        t = self.totals
        if self.fallback:
            head = f"node {self.node}/{self.num_nodes}: no peers, staged directly from SRC ({self.fallback})"
        else:
            head = f"node {self.node}/{self.num_nodes}: collective stage [{self.mode}] to {self.dest}"
        lines = [
            head,
            f"  this node: read {_gb(self.src_bytes)} from SRC, received {_gb(self.exchange_bytes)} from peers, "
            f"wrote {self.files_written} files ({_gb(self.written_bytes)}), kept {self.files_kept}, "
            f"{self.seconds:.2f} s, {self.gbps:.2f} GB/s",
        ]
        if t:
            ratio = t["src_bytes"] / self.dataset_bytes if self.dataset_bytes else 0.0
            lines.append(
                f"  all {self.num_nodes} nodes: SRC bytes read {_gb(t['src_bytes'])} ({ratio:.2f}x the dataset's "
                f"{_gb(self.dataset_bytes)}), exchanged {_gb(t['exchange_bytes'])}, slowest node {t['seconds']:.2f} s, "
                f"aggregate {t['gbps']:.2f} GB/s written"
            )
        return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def node_stats(res: CollectiveResult) -> dict[str, Any]:
    """This node's share of ``totals`` (a picklable dict: it goes through ``all_gather_object``)."""
    return {"node": res.node, "src_bytes": res.src_bytes, "exchange_bytes": res.exchange_bytes,
            "written_bytes": res.written_bytes, "seconds": res.seconds, "local_bytes": res.local_bytes,
            "exchange_s": res.exchange_s}


def totals(per_node: list[Any]) -> dict[str, Any]:
    """Bytes summed over the nodes' :func:`node_stats`, the slowest node's seconds, and ``per_node``."""
    secs = max(float(s["seconds"]) for s in per_node)
    written = sum(int(s["written_bytes"]) for s in per_node)
    return {
        "src_bytes": sum(int(s["src_bytes"]) for s in per_node),
        "exchange_bytes": sum(int(s["exchange_bytes"]) for s in per_node),
        "local_bytes": sum(int(s["local_bytes"]) for s in per_node),
        "written_bytes": written,
        "seconds": secs,
        "exchange_s": max(float(s.get("exchange_s", 0.0)) for s in per_node),
        "gbps": written / max(secs, 1e-9) / 1e9,
        "per_node": per_node,
    }

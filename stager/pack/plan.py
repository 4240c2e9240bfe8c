"""The pack plan (:func:`plan_shards`, pure): which sample goes to which shard, in which order.

The source's samples are ordered by a seeded permutation (``stager.order.streams.pack_order(seed)``)
unless ``keep_order``, and cut into shards by ``samples_per_shard`` and/or ``shard_size`` bytes
(estimated from source sizes; a shard ends before the sample that would exceed either limit, and
holds at least one). Each shard gets a fingerprint over its index, name, samples' keys, labels,
source sizes and mtimes, the format, the classes and the output-affecting options
(:func:`fingerprinted_options`); the plan fingerprint covers them all, so a rerun knows which
completed shards it may keep.

Shapes: ``PackPlan.shards`` in shard order (``index`` 0..n-1), each ``PlannedShard.refs`` in write
order; every listed sample is in exactly one shard; ``est_bytes`` sums source sizes (the exact
payload when files pass through unchanged).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from stager.order import streams

if TYPE_CHECKING:
    from stager.pack.options import PackOptions
    from stager.pack.sources.base import SampleRef


@dataclass(frozen=True)
class PlannedShard:
    index: int
    name: str
    refs: tuple[SampleRef, ...]
    est_bytes: int
    fingerprint: str


@dataclass
class PackPlan:
    """The shards to write: a pure function of the source listing and the options."""

    format: str
    shards: list[PlannedShard]
    fingerprint: str
    options: dict[str, Any]

    @property
    def samples(self) -> int:
        return sum(len(s.refs) for s in self.shards)

    @property
    def est_bytes(self) -> int:
        return sum(s.est_bytes for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "shards": len(self.shards),
            "samples": self.samples,
            "est_bytes": self.est_bytes,
            "plan": self.fingerprint,
            "shard_table": [{"name": s.name, "samples": len(s.refs), "est_bytes": s.est_bytes} for s in self.shards],
        }


def plan_order(n: int, *, seed: int = 0, keep_order: bool = False, groups: np.ndarray | None = None) -> np.ndarray:
    """int64 permutation of ``range(n)``: identity with ``keep_order``, else seeded shuffle.

    ``groups`` (int (n,), each group's items contiguous, e.g. a clip source's sequences): the
    groups are shuffled whole and each keeps its items in order (docs/clips.md).
    """
    if keep_order:
        return np.arange(n, dtype=np.int64)
    if groups is not None and n:
        cuts = np.flatnonzero(np.diff(groups)) + 1
        bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64)
        perm = streams.pack_order(seed).permutation(len(bounds) - 1)
        return np.concatenate([np.arange(bounds[g], bounds[g + 1], dtype=np.int64) for g in perm.tolist()])
    return streams.pack_order(seed).permutation(n).astype(np.int64)


def cut_shards(sizes: np.ndarray, *, samples_per_shard: int | None, shard_size: int | None) -> list[tuple[int, int]]:
    """Split a sequence with per-item ``sizes`` into ``[start, stop)`` runs.

    A run ends before the item that would make it exceed ``samples_per_shard`` items or
    ``shard_size`` bytes; every run holds at least one item (an oversized item is a shard alone).
    """
    runs: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, sz in enumerate(sizes.tolist()):
        n = i - start
        if n and (
            (samples_per_shard is not None and n >= samples_per_shard)
            or (shard_size is not None and acc + sz > shard_size)
        ):
            runs.append((start, i))
            start, acc = i, 0
        acc += sz
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def _digest(obj: Any) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def fingerprinted_options(options: PackOptions, image_shape: tuple[int, int, int] | None) -> dict[str, Any]:
    """The options besides the format that change a shard's bytes (``PackPlan.options``).

    They enter every shard fingerprint, so changing any of them invalidates all completed shards.
    """
    out = {
        "resize": list(options.resize) if options.resize else None,
        "quality": options.quality,
        "hash_algo": options.hash_algo,
        "image_shape": list(image_shape) if image_shape else None,
    }
    spec = options.clip_spec()
    if spec is not None:  # only for clip packs: other packs keep their fingerprints
        out["clip"] = spec.to_json()
    return out


def plan_shards(
    refs: Sequence[SampleRef],
    options: PackOptions,
    shard_name: Callable[[int], str],
    *,
    classes: Sequence[str],
    image_shape: tuple[int, int, int] | None,
    groups: np.ndarray | None = None,
) -> PackPlan:
    """Order and cut ``refs`` into shards named ``shard_name(i)``; see the module docstring.

    ``options`` give the order (``seed``, ``keep_order``), the cut (``samples_per_shard``,
    ``shard_size``) and, with ``classes`` and the decoded ``image_shape``, what the fingerprints
    cover besides the samples (:func:`fingerprinted_options`).
    """
    fmt_name = options.format
    fp_options = fingerprinted_options(options, image_shape)
    order = plan_order(len(refs), seed=options.seed, keep_order=options.keep_order, groups=groups)
    ordered = [refs[i] for i in order.tolist()]
    # Columns of the ordered refs, transposed at C speed (SampleRef is a tuple); the fingerprints
    # hash them per shard as whole columns rather than one formatted line per sample.
    keys, labels, _, sizes_t, mtimes = zip(*ordered, strict=True) if ordered else ((),) * 5
    sizes = np.asarray(sizes_t, dtype=np.int64)
    labels_a = np.asarray(labels, dtype=np.int64)
    mtimes_a = np.asarray(mtimes, dtype=np.int64)
    base = _digest({"format": fmt_name, "classes": list(classes), "options": fp_options})
    shards = []
    cuts = cut_shards(sizes, samples_per_shard=options.samples_per_shard, shard_size=options.shard_size)
    for idx, (a, b) in enumerate(cuts):
        name = shard_name(idx)
        h = xxhash.xxh3_128()
        h.update(f"{base}\0{idx}\0{name}\0{b - a}\0".encode())
        h.update(json.dumps(keys[a:b]).encode())
        for col in (labels_a, sizes, mtimes_a):
            h.update(col[a:b].tobytes())
        shards.append(PlannedShard(idx, name, tuple(ordered[a:b]), int(sizes[a:b].sum()), h.hexdigest()))
    fp = _digest({"base": base, "shards": [s.fingerprint for s in shards]})
    return PackPlan(fmt_name, shards, fp, fp_options)


def format_plan(plan: PackPlan, out: str, limit: int = 20) -> str:
    """Human-readable plan for ``--dry-run``."""
    buf = io.StringIO()
    buf.write(
        f"plan: {len(plan.shards)} {plan.format} shards, {plan.samples} samples, "
        f"~{plan.est_bytes / 1e6:,.1f} MB (source sizes) -> {out} [plan {plan.fingerprint[:16]}]\n"
    )
    for s in plan.shards[:limit]:
        buf.write(f"  {s.name:<28} {len(s.refs):>8} samples {s.est_bytes / 1e6:>10,.1f} MB\n")
    if len(plan.shards) > limit:
        buf.write(f"  ... {len(plan.shards) - limit} more shards\n")
    return buf.getvalue()

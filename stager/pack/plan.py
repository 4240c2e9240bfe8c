"""The pack plan (:func:`plan_shards`, pure): which sample goes to which shard, in which order.

The source's samples are ordered by a seeded permutation (``stager.order.streams.pack_order(seed)``)
unless ``keep_order``, and cut into shards by ``samples_per_shard`` and/or ``shard_size`` bytes
(a shard ends before the sample that would exceed either limit, and holds at least one). Bytes are
shard *file* bytes: each format's :meth:`~stager.formats.base.Format.disk_bytes` says what a
sample takes on disk (headers, padding, framing, metadata) and what every shard file has besides
(:func:`shard_costs`); files that pass through unchanged give exact sizes for tar and record.

Each shard gets a fingerprint over its index, name, samples' keys, labels, source sizes and mtimes,
the format, the classes and the output-affecting options (:func:`fingerprinted_options`); the plan
fingerprint covers them all, so a rerun knows which completed shards it may keep.

Shapes: ``PackPlan.shards`` in shard order (``index`` 0..n-1), each ``PlannedShard.refs`` in write
order; every listed sample is in exactly one shard; ``est_bytes`` is the shard file's estimated
bytes (exact for tar/record when files pass through unchanged). Of a columnar listing
(:class:`~stager.pack.sources.columns.ListingRefs`) the plan keeps only the shuffled order, an int64
array: each shard's refs are a :class:`ShardRefs` view of its ``positions`` (a slice of it), so
planning 1.28M samples holds ~8 bytes a sample, not a list of refs.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import xxhash

from stager.formats import get_format
from stager.formats.base import Lines, SizeInputs
from stager.order import streams
from stager.pack.sources.base import SampleRef
from stager.pack.sources.columns import ListingRefs, StrColumn

if TYPE_CHECKING:
    from stager.pack.options import PackOptions


@dataclass(frozen=True)
class PlannedShard:
    index: int
    name: str
    refs: Sequence[SampleRef]  # a tuple, or a ShardRefs view of a columnar listing
    est_bytes: int
    fingerprint: str
    # Where ``refs`` sit in the source's listing (int64, write order), so that the pack workers get
    # the listing as columns in source order plus these positions, not millions of shuffled tuples.
    positions: np.ndarray | None = field(default=None, compare=False, repr=False)


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
    n = len(sizes)
    cum = np.cumsum(sizes, dtype=np.int64)
    runs: list[tuple[int, int]] = []
    start, base = 0, 0
    while start < n:  # one binary search per run, not one Python step per item
        stop = n
        if shard_size is not None:  # items [start, stop) while their sum stays <= shard_size
            stop = int(np.searchsorted(cum, base + shard_size, side="right"))
        if samples_per_shard is not None:
            stop = min(stop, start + samples_per_shard)
        stop = max(stop, start + 1)
        runs.append((start, stop))
        base = int(cum[stop - 1])
        start = stop
    return runs


def _ext_of_suffix(suffix: str) -> str:
    """The extension a file with the text after its last ``.`` as ``suffix`` is stored under."""
    if not suffix.isalnum() or len(suffix) > 16:  # no extension at all (a CIFAR/pack locator, a dir)
        return "jpg"
    ext = suffix.lower()
    return "jpg" if ext == "jpeg" else ext


def _exts_of(locators: Sequence[Any]) -> list[str]:
    """The extension each locator's file is stored under (:func:`_ext_of_suffix`), at C speed when
    they all share one suffix (the usual case: ~0.05 s for 1.28M paths instead of ~0.6 s; a count
    over the text of :class:`~stager.formats.base.Lines`)."""
    if not locators:
        return []
    if isinstance(locators, Lines):
        text = locators.text
        line_end = text.find("\n")
        suffix = text[: line_end if line_end >= 0 else len(text)].rpartition(".")[2]
        # Every line ends with .suffix: its occurrences followed by a newline are line ends.
        if suffix.isalnum() and text.endswith("." + suffix) and text.count(f".{suffix}\n") == len(locators) - 1:
            return [_ext_of_suffix(suffix)] * len(locators)
    first = locators[0]
    if isinstance(first, str):
        suffix = first.rpartition(".")[2]
        if suffix.isalnum() and all(map(str.endswith, locators, repeat("." + suffix))):
            return [_ext_of_suffix(suffix)] * len(locators)
    cache: dict[str, str] = {}
    exts = []
    for loc in locators:  # one lower() per distinct suffix, not per sample
        suffix = loc.rpartition(".")[2] if isinstance(loc, str) else ""
        ext = cache.get(suffix)
        if ext is None:
            ext = cache[suffix] = _ext_of_suffix(suffix)
        exts.append(ext)
    return exts


def shard_costs(
    keys: Sequence[str],
    labels: np.ndarray,
    sizes: np.ndarray,
    locators: Sequence[Any],
    options: PackOptions,
    *,
    classes: Sequence[str],
    image_shape: tuple[int, int, int] | None,
) -> tuple[np.ndarray, int]:
    """``(each sample's bytes in a shard file, fixed bytes per shard file)`` for ``options.format``.

    From the format's :meth:`~stager.formats.base.Format.disk_bytes` (every format stager writes has one).
    """
    fmt = get_format(options.format)
    exts = _exts_of(locators)
    inputs = SizeInputs(keys, labels, sizes, exts, classes, image_shape, {"json_member": options.tar_json,
                                                                       "compression": options.compression})
    return fmt.disk_bytes(inputs)


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
        "tar_json": options.tar_json,
        "cut": "file-bytes",  # shards are cut at file bytes (shard_costs), no longer at payload bytes
    }
    if options.compression is not None:  # only for formats that compress: other packs keep their fingerprints
        out["compression"] = options.compression
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
    if isinstance(refs, ListingRefs):  # a columnar listing: no Python object per sample (columns.py)
        cols = refs.columns
        labels_src, sizes_src, mtimes_src = cols.labels, cols.sizes, cols.mtimes
        costs_src, fixed = _listing_costs(refs, options, classes=classes, image_shape=image_shape)
        keys_at: Callable[[np.ndarray], tuple[bytes, np.ndarray]] = lambda pos: _key_bytes(cols.keys, pos)  # noqa: E731
    else:
        # Columns taken at C speed in source order (walking the refs in listing order is ~8x faster
        # than in shuffled order, and itemgetter ~9x faster than zip(*refs)).
        keys_s, locators_s = (list(map(itemgetter(k), refs)) for k in (0, 2))
        labels_src, sizes_src, mtimes_src = (
            np.fromiter(map(itemgetter(k), refs), dtype=np.int64, count=len(refs)) for k in (1, 3, 4)
        )
        costs_src, fixed = shard_costs(
            keys_s, labels_src, sizes_src, locators_s, options, classes=classes, image_shape=image_shape
        )
        del locators_s
        keys_at = lambda pos: _key_text_bytes([keys_s[i] for i in pos.tolist()])  # noqa: E731
    costs = costs_src[order]
    del costs_src
    base = _digest({"format": fmt_name, "classes": list(classes), "options": fp_options})
    shards = []
    limit = None if options.shard_size is None else max(options.shard_size - fixed, 1)
    cuts = cut_shards(costs, samples_per_shard=options.samples_per_shard, shard_size=limit)
    cum = np.zeros(len(costs) + 1, dtype=np.int64)
    np.cumsum(costs, out=cum[1:])
    del costs
    for idx, (a, b) in enumerate(cuts):
        name = shard_name(idx)
        pos = order[a:b]
        h = xxhash.xxh3_128()
        h.update(f"{base}\0{idx}\0{name}\0{b - a}\0".encode())
        joined, lengths = keys_at(pos)
        h.update(joined)  # the keys, UTF-8, NUL-separated
        h.update(lengths.tobytes())  # their lengths in characters (int64): unambiguous
        for col in (labels_src, sizes_src, mtimes_src):
            h.update(col[pos].astype(np.int64, copy=False).tobytes())
        est = int(cum[b] - cum[a]) + fixed
        # A columnar listing's shards view it through their positions; a list's get their refs.
        srefs = ShardRefs(refs, pos) if isinstance(refs, ListingRefs) else tuple(refs[i] for i in pos.tolist())
        shards.append(PlannedShard(idx, name, srefs, est, h.hexdigest(), pos))
    fp = _digest({"base": base, "shards": [s.fingerprint for s in shards]})
    return PackPlan(fmt_name, shards, fp, fp_options)


def _listing_costs(
    refs: ListingRefs, options: PackOptions, *, classes: Sequence[str], image_shape: tuple[int, int, int] | None
) -> tuple[np.ndarray, int]:
    """:func:`shard_costs` of a columnar listing, in listing order, a chunk of samples at a time: each
    chunk's keys (and locators, unless they all share one suffix: only their extension matters)
    handed over as :class:`~stager.formats.base.Lines`, one decoded text each, never a Python string
    per sample (each sample's cost depends on that sample alone)."""
    cols = refs.columns
    n = len(cols.sizes)
    first = cols.locators.at(0) if n else ""
    suffix = "." + first.rpartition(".")[2]
    one_suffix = len(suffix) > 1 and suffix[1:].isalnum() and cols.locators.all_end_with(suffix.encode())
    costs = np.empty(n, dtype=np.int64)
    fixed = shard_costs([], np.zeros(0, np.int64), np.zeros(0, np.int64), [], options, classes=classes,
                        image_shape=image_shape)[1]
    a = 0
    for keys in refs.key_chunks():
        b = a + len(keys)
        locators: Sequence[str] = (
            [first] * (b - a) if one_suffix else cols.locators.lines(np.arange(a, b, dtype=np.int64))
        )
        costs[a:b] = shard_costs(
            keys, cols.labels[a:b].astype(np.int64), cols.sizes[a:b], locators, options,
            classes=classes, image_shape=image_shape,
        )[0]
        a = b
    return costs, fixed


class ShardRefs(Sequence[SampleRef]):
    """A planned shard's samples in write order, as ``positions`` into a columnar ``listing``
    (:class:`~stager.pack.sources.columns.ListingRefs`): refs are built when asked for (a slice, or each
    few thousand when iterated, at once), so a plan of millions of samples holds only its order."""

    __slots__ = ("listing", "positions")

    def __init__(self, listing: ListingRefs, positions: np.ndarray) -> None:
        self.listing = listing
        self.positions = positions

    @property
    def sizes(self) -> np.ndarray:
        """Each sample's ``size`` (int64), without building the refs."""
        return self.listing.columns.sizes[self.positions]

    def __len__(self) -> int:
        return len(self.positions)

    @overload
    def __getitem__(self, i: int) -> SampleRef: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[SampleRef, ...]: ...
    def __getitem__(self, i: int | slice) -> SampleRef | tuple[SampleRef, ...]:
        if isinstance(i, slice):
            return self.listing.take(self.positions[i])
        return self.listing[int(self.positions[i])]

    def __iter__(self) -> Iterator[SampleRef]:
        step = 4096
        for a in range(0, len(self), step):
            yield from self.listing.take(self.positions[a : a + step])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


def _key_text_bytes(keys: list[str]) -> tuple[bytes, np.ndarray]:
    """What a shard fingerprint hashes of its keys: them joined by NUL, UTF-8, and their lengths in
    characters (int64)."""
    return "\0".join(keys).encode(), np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))


def _key_bytes(keys: StrColumn, pos: np.ndarray) -> tuple[bytes, np.ndarray]:
    """:func:`_key_text_bytes` of the keys at ``pos`` of a listing's key column, gathered from its
    blob by numpy: the same bytes (the keys passed the name checks, so they are valid UTF-8), with
    the lengths in characters taken per key only where a key is not ASCII."""
    joined = keys.joined(pos, sep=0)
    if joined.isascii():
        return joined, keys.lengths()[pos]
    return _key_text_bytes(keys.take(pos))


def format_plan(plan: PackPlan, out: str, limit: int = 20) -> str:
    """Human-readable plan for ``--dry-run``."""
    buf = io.StringIO()
    buf.write(
        f"plan: {len(plan.shards)} {plan.format} shards, {plan.samples} samples, "
        f"~{plan.est_bytes / 1e6:,.1f} MB (shard files) -> {out} [plan {plan.fingerprint[:16]}]\n"
    )
    for s in plan.shards[:limit]:
        buf.write(f"  {s.name:<28} {len(s.refs):>8} samples {s.est_bytes / 1e6:>10,.1f} MB\n")
    if len(plan.shards) > limit:
        buf.write(f"  ... {len(plan.shards) - limit} more shards\n")
    return buf.getvalue()

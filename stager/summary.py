"""Summaries of a packed directory for humans (a table) and scripts (JSON), from its manifest."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from stager.manifest import Manifest, load_manifest


def summarize(path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest's summary and a per-shard table (no per-sample index) as a JSON-able dict.

    ``path``: a pack directory, its manifest, or a URL (opened with ``storage_options``)."""
    m = load_manifest(path, storage_options)
    counts = class_counts(m)
    sizes = m.column("size")
    starts = m.sample_starts()
    payload = [int(sizes[a:b].sum()) for a, b in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)]
    return {
        "path": os.fspath(path),
        "dataset_id": m.dataset_id,
        "format": m.format,
        "sample_kind": m.sample_kind,
        "image_shape": list(m.image_shape) if m.image_shape else None,
        "hash_algo": m.hash_algo,
        "created": m.created,
        "stager_version": m.stager_version,
        "samples": m.num_samples,
        "shards": len(m.shards),
        "bytes": m.num_bytes,
        "classes": len(m.classes),
        "class_names": m.classes,
        "samples_per_class": {
            "min": int(counts.min()) if counts.size else 0,
            "max": int(counts.max()) if counts.size else 0,
        },
        "skipped": len(m.skipped),
        "source": m.source,
        "options": m.options,
        "shard_root": m.shard_root,  # where an index's shards live (None: beside the manifest)
        "schema": m.schema,
        "index": m.index.to_json() if m.index is not None else None,  # the sample index file (manifest v2)
        "fields": m.fields,
        "clips": m.clips,
        "shard_table": [
            {
                "name": s.name,
                "samples": s.samples,
                "bytes": s.bytes,
                "hash": s.hash,
                "aux": [a.name for a in s.aux],
                "payload_bytes": payload[i],
            }
            for i, s in enumerate(m.shards)
        ],
    }


def format_summary(d: dict[str, Any], limit: int | None = None) -> str:
    """A human-readable summary plus the per-shard table (first ``limit`` rows if given)."""
    lines = [
        f"{d['path']}: {d['format']} {'index' if d['source'].get('kind') == 'index' else 'pack'}, "
        f"{d['samples']:,} samples in {d['shards']} shards, "
        f"{d['bytes'] / 1e6:,.1f} MB, {d['classes']} classes (id {d['dataset_id']})",
        f"  source: {d['source'].get('kind', '?')} {d['source'].get('path', '')}"
        + (f" split={d['source']['split']}" if d["source"].get("split") else "")
        + (f" (shards read from {d['shard_root']})" if d.get("shard_root") else ""),
        f"  samples: {d['sample_kind']}"
        + (f" {'x'.join(map(str, d['image_shape']))}" if d["image_shape"] else "")
        + f"; hash {d['hash_algo']}; created {d['created']}; skipped {d['skipped']}",
        *_schema_lines(d),
    ]
    rows = d["shard_table"] if limit is None else d["shard_table"][:limit]
    if rows:
        lines.append(f"  {'shard':<28} {'samples':>9} {'bytes':>14} {'hash':<18} aux")
    for r in rows:
        aux = " ".join(r["aux"])
        lines.append(f"  {r['name']:<28} {r['samples']:>9,} {r['bytes']:>14,} {r['hash'][:16]:<18} {aux}")
    if limit is not None and len(d["shard_table"]) > limit:
        lines.append(f"  ... {len(d['shard_table']) - limit} more shards (--json for all)")
    return "\n".join(lines)


def _schema_lines(d: dict[str, Any], shown: int = 8) -> list[str]:
    """The summary's lines on what a sample holds: classes (the first ``shown`` names, samples per
    class), fields (name, kind, stored extension) and clips (window length, stride, frame step)."""
    names = d["class_names"]
    lines = []
    if names:
        more = f", ... {len(names) - shown} more" if len(names) > shown else ""
        per = d["samples_per_class"]
        lines.append(f"  classes: {', '.join(names[:shown])}{more} ({per['min']:,}-{per['max']:,} samples per class)")
    else:
        lines.append("  classes: none (unlabelled samples)")
    if d["fields"]:
        lines.append("  fields: " + ", ".join(f"{f['name']} ({f['kind']}, .{f['ext']})" for f in d["fields"]))
    else:
        lines.append("  fields: none (an image and a label per sample)")
    c = d.get("clips")
    if c:
        lines.append(f"  clips: {c['windows']:,} windows of {c['length']} frames (stride {c['stride']}, frame step "
                     f"{c['frame_step']}) over {c['sequences']:,} sequences, frames stored as {c['frame_format']}")
    return lines


def class_counts(m: Manifest) -> np.ndarray:
    """int64 array of length ``len(m.classes)``: samples per class."""
    labels = m.column("label")
    return np.bincount(labels[labels >= 0], minlength=len(m.classes)).astype(np.int64)

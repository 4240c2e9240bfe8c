"""Raw labels (ints, class names, None) of every shard into manifest labels and ``classes``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stager.errors import UsageError
from stager.index.scan import ShardScan


def resolve_labels(scans: Sequence[ShardScan], label_offset: int, src: str) -> tuple[list[np.ndarray], list[str]]:
    """Per shard int64 labels (``-1`` unlabeled) and the class names.

    Class names come from the shards themselves when they declare them (parquet's Hugging Face
    ``ClassLabel``); string labels then index into them, else string labels are class names sorted
    (torchvision's ImageFolder rule). Integer labels get ``label_offset`` and, without declared names,
    classes ``"0" .. str(max)``. A mix of integers and names is refused, as is a label out of range.
    """
    declared = next((s.classes for s in scans if s.classes), None)
    ints = strs = False
    names: set[str] = set()
    for s in scans:
        if s.label_names is not None:  # class-name indices (SquashFS): the names, not every label
            strs = strs or bool(len(s.labels) and (np.asarray(s.labels) >= 0).any())
            names.update(s.label_names)
            continue
        for v in s.labels:
            if isinstance(v, str):
                strs = True
                names.add(v)
            elif v is not None:
                ints = True
    if ints and strs:
        raise UsageError(f"{src}: labels are a mix of integers and class names; pick one field with --label-key")
    classes = list(declared) if declared else sorted(names)
    lookup = {c: i for i, c in enumerate(classes)}
    out = []
    top = -1
    for s in scans:
        if s.label_names is not None:
            lut = np.asarray([lookup[n] for n in s.label_names] + [-1], dtype=np.int64)  # -1 maps to the last: -1
            arr = lut[np.asarray(s.labels, dtype=np.int64)]
            if len(arr):
                top = max(top, int(arr.max()))
            out.append(arr)
            continue
        arr = np.empty(len(s.labels), dtype=np.int64)
        for i, v in enumerate(s.labels):
            if v is None:
                arr[i] = -1
            elif isinstance(v, str):
                if v not in lookup:
                    raise UsageError(f"{s.name}: sample {s.keys[i]!r} has class {v!r}, not one of the "
                                     f"{len(classes)} class names in the file's metadata")
                arr[i] = lookup[v]
            else:
                arr[i] = int(v) + label_offset
                if arr[i] < 0:
                    raise UsageError(f"{s.name}: sample {s.keys[i]!r} has label {int(v)} -> {arr[i]} with "
                                     f"--label-offset {label_offset}; labels must be >= 0 (check --label-offset)")
        if len(arr):
            top = max(top, int(arr.max()))
        out.append(arr)
    if ints and not declared:
        classes = [str(i) for i in range(top + 1)]
    elif ints and top >= len(classes):
        raise UsageError(f"{src}: label {top} is out of range for the {len(classes)} class names in the metadata "
                         "(check --label-offset)")
    return out, classes

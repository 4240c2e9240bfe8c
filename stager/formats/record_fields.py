"""``tf.train.Example`` of a sample with fields, in the TensorFlow Object Detection API's keys.

The image features of :mod:`stager.formats.record` (``image/encoded``, ``image/format``,
``image/class/label``, ``image/class/text``, ``image/filename``) plus::

    image/height, image/width                    int64  the stored image's size
    image/object/bbox/xmin|ymin|xmax|ymax        float  the ``boxes`` field, normalised to [0, 1]
    image/object/class/label                     int64  the first ``box_labels`` field
    image/object/<name>                          float/int64  other per-box fields (flattened)
    image/segmentation/class/encoded, /format    bytes  the first ``mask`` field (DeepLab's keys)
    <name>                                       bytes  any other field under its own name

so TensorFlow's and DALI's usual feature specs read them. Serialised deterministically (sorted
keys, :func:`~stager.formats.example_pb.encode_example`); the byte fields' offsets inside the
payload become the manifest's field extents.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.formats.example_pb import Feature, bytes_feature, encode_example, float_feature, int64_feature
from stager.manifest.fields import FieldSpec

K_HEIGHT, K_WIDTH = "image/height", "image/width"
K_BBOX = ("image/object/bbox/xmin", "image/object/bbox/ymin", "image/object/bbox/xmax", "image/object/bbox/ymax")
K_BOX_LABEL = "image/object/class/label"
K_SEG, K_SEG_FORMAT = "image/segmentation/class/encoded", "image/segmentation/class/format"


def feature_keys(specs: Sequence[FieldSpec]) -> dict[str, str]:
    """Field name -> the Example key holding it (boxes: its ``xmin`` key)."""
    out: dict[str, str] = {}
    seen: set[str] = set()
    for s in specs:
        if s.kind == "boxes":
            out[s.name] = K_BBOX[0]
        elif s.kind == "box_labels" and "box_labels" not in seen:
            out[s.name] = K_BOX_LABEL
        elif s.kind in ("box_labels", "per_box"):
            out[s.name] = f"image/object/{s.name}"
        elif s.kind == "mask" and "mask" not in seen:
            out[s.name] = K_SEG
        else:
            out[s.name] = s.name
        seen.add(s.kind)
    return out


def _numeric(values: np.ndarray) -> Feature:
    flat = values.reshape(-1)
    if flat.dtype.kind in "iub":
        return int64_feature(*flat.tolist())
    return float_feature(*flat.astype(np.float32).tolist())


def encode_fields_example(
    image: dict[str, Feature], sample_fields: dict[str, Any], specs: Sequence[FieldSpec], hw: tuple[int, int], key: str
) -> tuple[bytes, dict[str, list[int]]]:
    """Serialise ``image``'s features plus the fields; ``(payload, offsets of each bytes feature)``."""
    h, w = hw
    feats = dict(image)
    feats[K_HEIGHT] = int64_feature(h)
    feats[K_WIDTH] = int64_feature(w)
    keys = feature_keys(specs)
    for s in specs:
        if s.name not in sample_fields:
            raise UsageError(f"sample {key!r} lacks field {s.name!r}")
        v = sample_fields[s.name]
        k = keys[s.name]
        if s.kind == "boxes":
            b = np.asarray(v, dtype=np.float64).reshape(-1, 4)
            for j, kk in enumerate(K_BBOX):
                feats[kk] = float_feature(*(b[:, j] / (w if j % 2 == 0 else h)).tolist())
        elif s.ragged:
            feats[k] = _numeric(np.asarray(v))
        else:
            feats[k] = bytes_feature(bytes(v))
            if k == K_SEG:
                feats[K_SEG_FORMAT] = bytes_feature(s.ext.encode())
    return encode_example(feats)


def field_extents(
    offsets: dict[str, list[int]], sample_fields: dict[str, Any], specs: Sequence[FieldSpec], base: int
) -> dict[str, tuple[int, int]]:
    """Extents in the shard (payload at ``base``) of the byte fields."""
    keys = feature_keys(specs)
    return {s.name: (base + offsets[keys[s.name]][0], len(sample_fields[s.name])) for s in specs if not s.ragged}

"""The *fields* sample kind: samples with masks, boxes, per-box lists, arrays and JSON (docs/fields.md).

How it plugs into the loader without touching the read path: :func:`field_spans` widens each
sample's extent to the *span* that covers its primary image and the byte fields asked for (tar:
the sample's consecutive members; record: its one record), and the loader's index uses those spans
as offsets/sizes (:func:`~stager.loader.dataset_index.index_from_manifest` with ``fields``). The read
schedule, the fetchers, staging and streaming then move whole spans as they move images, and
:class:`FieldsSampleFn` slices each field out of its sample's span by the manifest's extents.
Ragged fields (boxes, box_labels, per_box) come from the mapped index columns, never from the shard.

Geometry (:class:`Geometry`): ``transform="train"`` draws one random-resized crop box and one flip
coin for the sample (:func:`~stager.decode.crop.random_resized_crop_box`, the image path's own
draws); ``"eval"``/``None`` is the resize + center crop. Both map output pixel ``i`` to source
coordinate ``left + (i + 0.5) * box_w / size``: the image is resized over the box by the decoder,
masks are sampled nearest at those coordinates, boxes are mapped affinely and clipped to the output.
A box is dropped (with its per-box entries) only when its visible part is degenerate, by the
loader's :class:`BoxFilter`: less than ``min_side`` output pixels of width or height, or less than
``min_area`` square output pixels (torchvision's ``SanitizeBoundingBoxes`` defaults, 1 and 1), or,
when asked for, less than ``min_visibility`` of the box's own area (albumentations' rule; 0 by
default, so the box of an object that fills a zoomed crop is kept). A callable transform gets the whole
decoded sample dict (``image`` (H, W, 3) uint8, masks (H, W) uint8, boxes (n, 4) float32, ...) and
an RNG, and returns a dict of the same keys.

Batch layout (:func:`assemble_fields`): masks and other images stacked ((B, S, S) uint8,
(B, S, S, 3) uint8), boxes / box_labels / per_box lists of B arrays, arrays stacked when their
shapes agree (else a list), JSON a list of Python objects, bytes a list of ``bytes``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.loader.options import DEFAULT_BOX_FILTER, BoxFilter
from stager.manifest import Manifest
from stager.manifest.fields import (
    FieldSpec,
    offset_column,
    sample_fields,
    size_column,
    specs_from_json,
    values_column,
)


def select_fields(m: Manifest, names: Sequence[str] | str | None) -> list[FieldSpec]:
    """The manifest's field specs that ``names`` asks for (None: all), in schema order; UsageError for unknown ones."""
    specs = specs_from_json(sample_fields(m.fields))
    if names is None:
        return specs
    if isinstance(names, str):
        names = [names]
    known = {s.name for s in specs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"fields {unknown} are not in this dataset; it has {sorted(known) or 'none'}")
    return [s for s in specs if s.name in set(names)]


def field_spans(m: Manifest, specs: Sequence[FieldSpec]) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, sizes)`` (int64, (N,)) of each sample's span: its image and its byte fields ``specs``."""
    lo = np.array(m.column("offset"), dtype=np.int64)
    hi = lo + m.column("size")
    cols = m.extra_columns()
    for s in specs:
        if s.ragged:
            continue
        off = np.asarray(cols[offset_column(s.name)], dtype=np.int64)
        size = np.asarray(cols[size_column(s.name)], dtype=np.int64)
        np.minimum(lo, off, out=lo)
        np.maximum(hi, off + size, out=hi)
    return lo, hi - lo


@dataclass
class Geometry:
    """Where the output window lies in the source image: ``(top, left, height, width)`` source pixels,
    an output ``size`` (square) and a horizontal flip."""

    top: float
    left: float
    height: float
    width: float
    size: int
    flip: bool = False

    def sample_rows_cols(self, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """Nearest source row and column of each output pixel (pixel centres), clipped to the image."""
        i = np.arange(self.size) + 0.5
        rows = np.clip(np.floor(self.top + i * self.height / self.size), 0, h - 1).astype(np.intp)
        cols = np.clip(np.floor(self.left + i * self.width / self.size), 0, w - 1).astype(np.intp)
        return rows, (cols[::-1] if self.flip else cols)

    def map_boxes(self, boxes: np.ndarray, box_filter: BoxFilter = DEFAULT_BOX_FILTER) -> tuple[np.ndarray, np.ndarray]:
        """``(boxes in output pixels, kept mask)``: mapped, clipped to ``[0, size]``, filtered by
        ``box_filter``, flipped; see the module doc."""
        s = self.size
        sx, sy = s / self.width, s / self.height
        b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
        # Few numpy calls per sample (each costs ~1 us of dispatch): 2x the column-wise version.
        m = (b - (self.left, self.top, self.left, self.top)) * (sx, sy, sx, sy)
        c = m.clip(0.0, float(s))
        keep = box_filter.keep(m, c)
        c = c[keep]
        if self.flip:
            c = c[:, [2, 1, 0, 3]]
            c[:, 0::2] = s - c[:, 0::2]
        return c.astype(np.float32), keep


def train_geometry(h: int, w: int, size: int, rng: np.random.Generator) -> Geometry:
    """The random-resized crop + flip the image path draws (same draws, same order)."""
    from stager.decode.crop import random_resized_crop_box  # noqa: PLC0415 (decode loads lazily: only decoding processes)

    top, left, bh, bw = random_resized_crop_box(h, w, rng)
    return Geometry(top, left, bh, bw, size, bool(rng.random() < 0.5))


def eval_geometry(h: int, w: int, size: int) -> Geometry:
    """Resize the shorter side to ``round(size / 0.875)``, then the central ``size`` square."""
    from stager.decode.crop import center_crop_box, default_resize  # noqa: PLC0415 (as above)

    top, left, bh, bw = center_crop_box(h, w, size, default_resize(size))
    return Geometry(top, left, bh, bw, size)


def _decode_mask(data: Any) -> np.ndarray:
    """A PNG of class ids as (H, W) uint8 (cv2 when present: ~3x PIL on small masks); zarr's are decoded."""
    if isinstance(data, np.ndarray):
        return data
    buf = np.frombuffer(data, dtype=np.uint8)
    cv2 = _cv2()
    if cv2 is not None:
        arr = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
        if arr is not None and arr.ndim == 2:
            return arr.astype(np.uint8, copy=False)
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded)

    with Image.open(io.BytesIO(bytes(data))) as im:
        arr = np.asarray(im)
    return arr if arr.ndim == 2 else arr[..., 0]


def _resample(image: np.ndarray, g: Geometry) -> np.ndarray:
    """A decoded (H, W, 3) image (zarr) resized bilinearly over ``g``'s box to ``g.size``, flipped."""
    from PIL import Image  # noqa: PLC0415 (PIL only where images are decoded or resized)

    box = (g.left, g.top, g.left + g.width, g.top + g.height)
    out = np.asarray(Image.fromarray(image).resize((g.size, g.size), Image.Resampling.BILINEAR, box=box))
    return np.ascontiguousarray(out[:, ::-1]) if g.flip else out


def _cv2() -> Any:
    try:
        import cv2  # noqa: PLC0415 (OpenCV is optional)
    except ImportError:
        return None
    return cv2


class FieldsSampleFn:
    """Per sample: its span (bytes) and global id -> a dict of decoded, jointly transformed fields."""

    def __init__(self, m: Manifest, specs: Sequence[FieldSpec], span_offsets: np.ndarray, *,
                 transform: Any, size: int, kind: str, side: bool = False, starts: np.ndarray | None = None,
                 box_filter: BoxFilter = DEFAULT_BOX_FILTER) -> None:
        if kind not in ("encoded", "decoded"):
            raise UsageError(f"fields are not read from {kind!r} samples")
        self.specs = list(specs)
        self.transform, self.size = transform, size
        self.box_filter = box_filter
        self._m = m
        self._spans = span_offsets
        self._mod: Any = None
        self._cols: dict[str, Any] | None = None
        # side: byte fields lie outside the span (hdf5, parquet); each is read at its extent through
        # ``access`` (the worker's ShardAccess: a slice of the mapping, a pread or a ranged GET).
        self.side = side
        self._starts = starts
        self.access: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_mod": None, "_cols": None, "access": None}

    def _side_read(self, gid: int, spec: FieldSpec, offset: int, size: int) -> Any:
        assert self.access is not None and self._starts is not None
        shard = int(np.searchsorted(self._starts, gid, side="right")) - 1
        return self.access.read_field(shard, spec, offset, size)

    def _columns(self) -> dict[str, Any]:
        if self._cols is None:
            self._cols = {"offset": self._m.column("offset"), "size": self._m.column("size"),
                          **self._m.extra_columns()}
        return self._cols

    def _decoder(self) -> Any:
        if self._mod is None:
            from stager import decode  # noqa: PLC0415 (decoders load PIL/OpenCV: only in processes that decode)

            self._mod = decode
        return self._mod

    def raw(self, span: Any, gid: int) -> tuple[Any, dict[str, Any]]:
        """The image (bytes; a decoded (H, W, 3) array for zarr) and each field's raw value (bytes
        slices; arrays for ragged fields and zarr's decoded masks and images)."""
        cols, base = self._columns(), int(self._spans[gid])
        if isinstance(span, np.ndarray):
            image: Any = span
            view = memoryview(b"")
        else:
            view = memoryview(span)
            o = int(cols["offset"][gid]) - base
            image = bytes(view[o : o + int(cols["size"][gid])])
        out: dict[str, Any] = {}
        for s in self.specs:
            if s.ragged:
                out[s.name] = np.array(cols[values_column(s.name)][gid])
            elif self.side:
                out[s.name] = self._side_read(gid, s, int(cols[offset_column(s.name)][gid]),
                                              int(cols[size_column(s.name)][gid]))
            else:
                a = int(cols[offset_column(s.name)][gid]) - base
                out[s.name] = view[a : a + int(cols[size_column(s.name)][gid])]
        return image, out

    def __call__(self, span: Any, rng: np.random.Generator, gid: int) -> dict[str, Any]:
        image, raw = self.raw(span, gid)
        if callable(self.transform):
            return dict(self.transform(self._decoded(image, raw), rng))
        g, probe = self.geometry(image, rng)
        return self.with_geometry(image, raw, g, probe)

    def geometry(self, image: Any, rng: np.random.Generator) -> tuple[Geometry, Any]:
        """The sample's geometry from its image's size, and the image's header probe (None for zarr's
        decoded arrays): ``transform="train"`` draws it from ``rng``, otherwise the resize + center crop."""
        probe = None
        if isinstance(image, np.ndarray):
            h, w = image.shape[:2]
        else:
            probe = self._decoder().default_decoder().probe(image)
            h, w = probe.height, probe.width
        g = train_geometry(h, w, self.size, rng) if self.transform == "train" else eval_geometry(h, w, self.size)
        return g, probe

    def with_geometry(self, image: Any, raw: dict[str, Any], g: Geometry, probe: Any = None) -> dict[str, Any]:
        """The sample dict with the image and every field under geometry ``g`` (a clip applies one
        geometry to all its frames: :class:`stager.loader.clipfields.ClipFieldsFn`)."""
        if isinstance(image, np.ndarray):
            return self._fields_out(_resample(image, g), raw, g)
        d = self._decoder().default_decoder()
        probe = d.probe(image) if probe is None else probe
        if self.transform == "train":
            box = (int(g.top), int(g.left), int(g.height), int(g.width))
            img = d.crop_resize(image, probe, box, self.size)
            img = d.flip(img) if g.flip else img
        else:
            img = d.center_crop(image, probe, self.size, round(self.size / 0.875))
        return self._fields_out(img, raw, g)

    def _fields_out(self, img: np.ndarray, raw: dict[str, Any], g: Geometry) -> dict[str, Any]:
        """The sample dict: the transformed image, and each field under geometry ``g``."""
        dec = self._decoder()
        out: dict[str, Any] = {"image": img}
        keep: np.ndarray | None = None
        for s in self.specs:
            v = raw[s.name]
            if s.kind == "mask":
                m = _decode_mask(v)
                rows, cols = g.sample_rows_cols(*m.shape[:2])
                out[s.name] = m[rows][:, cols]  # two 1-D gathers: ~7x one 2-D fancy index
            elif s.kind == "image":
                arr = v if isinstance(v, np.ndarray) else dec.decode_rgb(bytes(v))
                rows, cols = g.sample_rows_cols(*arr.shape[:2])
                out[s.name] = arr[rows][:, cols]
            elif s.kind == "boxes":
                out[s.name], keep = g.map_boxes(v, self.box_filter)
            else:
                out[s.name] = _plain_value(s, v)
        if keep is not None:
            for s in self.specs:
                if s.kind in ("box_labels", "per_box"):
                    out[s.name] = out[s.name][keep]
        return out

    def _decoded(self, image: Any, raw: dict[str, Any]) -> dict[str, Any]:
        """The whole sample, decoded and untransformed: what a callable transform receives."""
        dec = self._decoder()
        out: dict[str, Any] = {"image": image if isinstance(image, np.ndarray) else dec.decode_rgb(image)}
        for s in self.specs:
            v = raw[s.name]
            if s.kind == "mask":
                out[s.name] = _decode_mask(v)
            elif s.kind == "image":
                out[s.name] = v if isinstance(v, np.ndarray) else dec.decode_rgb(bytes(v))
            elif s.kind == "boxes":
                out[s.name] = np.asarray(v, dtype=np.float32).reshape(-1, 4)
            else:
                out[s.name] = _plain_value(s, v)
        return out


def _plain_value(s: FieldSpec, v: Any) -> Any:
    """A field that no geometry touches: ragged arrays as they are, .npy arrays, JSON objects, bytes."""
    if s.ragged:
        return np.asarray(v)
    if s.kind == "array":
        return np.load(io.BytesIO(bytes(v)), allow_pickle=False)
    if s.kind == "json":
        return json.loads(bytes(v))
    return bytes(v)


def assemble_fields(items: Sequence[dict[str, Any]], specs: Sequence[FieldSpec]) -> dict[str, Any]:
    """The batch's field entries from the samples' dicts (layout in the module docstring)."""
    out: dict[str, Any] = {}
    for s in specs:
        vals = [it[s.name] for it in items]
        if s.kind in ("mask", "image") or (s.kind == "array" and _same_shapes(vals)):
            out[s.name] = np.stack(vals) if vals else np.zeros((0,), dtype=np.uint8)
        else:
            out[s.name] = vals
    return out


def _same_shapes(vals: Sequence[Any]) -> bool:
    return bool(vals) and all(isinstance(v, np.ndarray) and v.shape == vals[0].shape for v in vals)

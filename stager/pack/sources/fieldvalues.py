"""Field values as sources list them: typing by extension, and loading into what writers store.

Shared by the list-file, sidecar-folder and COCO sources. A *raw* value is what the source read:
a path (string) for file-backed kinds, or a JSON value. :func:`infer_spec` types an undeclared field:
by its name when that is a box kind's (:data:`NAMED_KINDS`: ``boxes``, ``box_labels``: a JSON value or
a ``.json`` file, typed so that the train transform moves and clips the boxes with the crop instead of
passing source coordinates through as opaque JSON); else by its value (a string naming an existing
file by its extension: a ``.png`` whose field name contains ``mask``, ``seg`` or ``label`` ->
``mask``, other image extensions -> ``image``, ``.npy`` -> ``array``, ``.json`` -> ``json``,
anything else -> ``bytes``; any other value -> ``json``).
:func:`load_value` reads files and encodes values: bytes for the byte kinds (arrays as ``.npy``,
JSON as compact UTF-8), the raw list for the ragged kinds (:func:`stager.pack.fields.ragged_value`
makes the array when the sample is prepared).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import SourceError
from stager.manifest.fields import MASK_HINTS, FieldSpec
from stager.pack.sources.base import IMAGE_EXTENSIONS, read_file


def _as_path(value: Any, base: Path) -> Path | None:
    if isinstance(value, str) and value and "\n" not in value and len(value) < 4096:
        p = Path(value) if os.path.isabs(value) else base / value
        if p.is_file():
            return p
    return None


# Undeclared fields typed by their name (docs/fields.md): the kinds whose geometry or meaning the loader needs.
NAMED_KINDS = {"boxes": "boxes", "box_labels": "box_labels"}


def infer_spec(name: str, value: Any, base: Path) -> FieldSpec:
    """The spec of an undeclared field from its name or one of its values (see the module docstring)."""
    p = _as_path(value, base)
    if name in NAMED_KINDS and (p is None or p.suffix.lower() == ".json"):
        return FieldSpec(name, NAMED_KINDS[name])
    if p is None:
        return FieldSpec(name, "json")
    ext = p.suffix.lower()
    if ext == ".png" and any(hint in name for hint in MASK_HINTS):
        return FieldSpec(name, "mask")
    if ext in IMAGE_EXTENSIONS:
        return FieldSpec(name, "image", ext.lstrip(".").replace("jpeg", "jpg"))
    if ext == ".npy":
        return FieldSpec(name, "array")
    if ext == ".json":
        return FieldSpec(name, "json")
    return FieldSpec(name, "bytes", ext.lstrip(".") or "bin")


def parse_cell(spec: FieldSpec, text: str) -> Any:
    """A CSV cell as a raw value: JSON text for ragged/json/array kinds when it parses, else the string."""
    if spec.kind in ("boxes", "box_labels", "per_box", "json", "array"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text


def load_value(spec: FieldSpec, raw: Any, base: Path, where: str) -> Any:
    """What the writers store for ``raw`` (see the module docstring); SourceError naming ``where``."""
    if spec.ragged:
        if isinstance(raw, str) and (p := _as_path(raw, base)) is not None:
            return json.loads(p.read_bytes())
        return raw
    p = _as_path(raw, base)
    if spec.kind in ("image", "mask", "bytes"):
        if p is None:
            raise SourceError(f"{where}: field {spec.name!r}: {raw!r} is not an existing file")
        return read_file(str(p))
    if spec.kind == "array":
        if p is not None:
            data = read_file(str(p))
            if not data.startswith(b"\x93NUMPY"):
                raise SourceError(f"{where}: field {spec.name!r}: {p} is not a .npy file")
            return data
        try:
            arr = np.asarray(raw)
        except (TypeError, ValueError) as exc:
            raise SourceError(f"{where}: field {spec.name!r}: not an array ({exc})") from exc
        if arr.dtype == object or arr.dtype.kind not in "biuf":
            raise SourceError(f"{where}: field {spec.name!r}: expected a .npy path or a nested list of numbers")
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        return buf.getvalue()
    # json: a .json file's bytes, or the value itself
    if p is not None and p.suffix.lower() == ".json":
        data = read_file(str(p))
        try:
            json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SourceError(f"{where}: field {spec.name!r}: {p} is not JSON ({exc})") from exc
        return data
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()

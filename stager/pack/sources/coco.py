"""COCO detection sets: an ``instances_*.json`` file plus its image folder.

Each COCO image is a sample (key: its file name without extension) with the fields

* ``boxes`` (boxes): the annotations' ``bbox`` ``[x, y, w, h]`` as ``[x0, y0, x1, y1]`` pixels;
* ``box_labels`` (box_labels): their ``category_id`` (COCO's ids, not remapped);
* ``iscrowd`` (per_box, int64): their ``iscrowd`` flag;
* ``image_id`` (json): the COCO image id.

Samples have no image-level label (-1). The category table (id -> name) goes into the manifest's
``source`` description. The image folder is the first of ``<json dir>/../<split>``,
``<json dir>/<split>``, ``<json dir>/images``, ``<json dir>`` that holds the first listed image
(``instances_val2017.json`` -> split ``val2017``). An image the file lists but the folder lacks is an
error naming the JSON file and the image id.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import SourceError, SourceNotFoundError
from stager.formats.base import Sample
from stager.manifest.fields import FieldSpec
from stager.pack.sources.base import SampleRef, Source, file_ext, key_for, read_file, sniff_ext, unique_keys

FIELDS = (FieldSpec("boxes", "boxes"), FieldSpec("box_labels", "box_labels"),
          FieldSpec("iscrowd", "per_box", dtype="int64"), FieldSpec("image_id", "json"))


def is_coco_file(path: Path) -> bool:
    """A ``.json`` file named like COCO's instance annotations (``instances_*.json``) or holding its keys."""
    if path.suffix.lower() != ".json":
        return False
    if path.name.startswith("instances"):
        return True
    with open(path, "rb") as f:
        head = f.read(4096)
    return b'"images"' in head and (b'"annotations"' in head or b'"categories"' in head)


def _image_dir(jsonfile: Path, first: str) -> Path:
    split = jsonfile.stem.split("_", 1)[1] if "_" in jsonfile.stem else jsonfile.stem
    d = jsonfile.parent
    for cand in (d.parent / split, d / split, d / "images", d):
        if (cand / first).is_file():
            return cand
    raise SourceNotFoundError(f"{jsonfile}: image {first!r} not found in {d.parent / split}, {d / split}, "
                              f"{d / 'images'} or {d}; put the images beside the annotations")


class CocoSource(Source):
    """COCO ``instances_*.json`` + images (see the module docstring)."""

    kind = "coco"

    def __init__(self, jsonfile: Path) -> None:
        super().__init__(jsonfile)
        try:
            doc = json.loads(jsonfile.read_bytes())
            images = doc["images"]
            anns = doc.get("annotations", [])
            self._categories = {int(c["id"]): str(c.get("name", c["id"])) for c in doc.get("categories", [])}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"{jsonfile}: not a COCO annotation file ({exc})") from exc
        if not images:
            raise SourceError(f"{jsonfile}: lists no images")
        by_image: dict[int, list[dict[str, Any]]] = {}
        for n, a in enumerate(anns):
            try:
                by_image.setdefault(int(a["image_id"]), []).append(a)
            except (KeyError, TypeError, ValueError) as exc:
                raise SourceError(f"{jsonfile}: annotation {n}: no image_id ({exc})") from exc
        self.dir = _image_dir(jsonfile, str(images[0]["file_name"]))
        self.fields = list(FIELDS)
        rows = []
        self._anns: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        for im in images:
            path = self.dir / str(im["file_name"])
            try:
                st = path.stat()
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"{jsonfile}: image id {im['id']}: {path} does not exist; "
                                          "fix the annotations or the image folder") from exc
            rows.append((str(im["file_name"]), int(im["id"]), str(path), st.st_size, st.st_mtime_ns))
        rows.sort()
        keys = unique_keys(key_for(r[0]) for r in rows)
        self.refs = []
        for k, (_, iid, loc, size, mtime) in zip(keys, rows, strict=True):
            self.refs.append(SampleRef(k, -1, loc, size, mtime))
            self._anns[loc] = (iid, by_image.get(iid, []))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "categories": {str(k): v for k, v in sorted(self._categories.items())}}

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        iid, anns = self._anns[ref.locator]
        where = self.where_of(ref)
        try:
            xywh = np.asarray([a["bbox"] for a in anns], dtype=np.float64).reshape(-1, 4)
            cats = np.asarray([int(a["category_id"]) for a in anns], dtype=np.int64)
            crowd = np.asarray([int(a.get("iscrowd", 0)) for a in anns], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(f"{where}: bad annotation ({exc})") from exc
        boxes = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1).astype(np.float32)
        values = {"boxes": boxes, "box_labels": cats, "iscrowd": crowd, "image_id": str(iid).encode()}
        return Sample(ref.key, -1, data, sniff_ext(data) or file_ext(ref.locator),
                      {"source": os.path.relpath(ref.locator, self.dir)}, values)

    def where_of(self, ref: SampleRef) -> str:
        return f"{self.root}: image id {self._anns[ref.locator][0]} ({ref.locator})"

"""A ``.csv`` or ``.jsonl`` list of samples: a primary image, an optional label, and any fields.

The primary image is ``path`` (or ``image``); ``label`` is optional (a dataset without labels is
allowed: every label is -1 and there are no classes). Every other column (CSV) or key (JSONL) is a
field (docs/fields.md): declared with ``--fields NAME:KIND,...`` or typed from its first value
(:func:`~stager.pack.sources.fieldvalues.infer_spec`). A field present in some rows but not others is
an error naming the row. Labels are all integers (classes ``"0".."max"``) or all class names
(sorted); relative paths resolve against the list file's directory; samples are in relative-path
order, a locator is the file's absolute path. Every listed image must exist when the list is read.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from stager.errors import SourceError, SourceNotFoundError
from stager.formats.base import Sample
from stager.manifest.fields import FieldSpec, check_unique
from stager.pack.sources.base import SampleRef, Source, file_ext, key_for, read_file, sniff_ext, unique_keys
from stager.pack.sources.fieldvalues import infer_spec, load_value, parse_cell

PRIMARY = ("path", "image")


class _Row(NamedTuple):
    path: str
    label: int | str | None
    line: int
    extra: dict[str, Any]


class ListSource(Source):
    """A CSV (``path,label`` header) or JSONL (``{"path", "label"}``) list of image files."""

    kind = "list"

    def __init__(self, listfile: Path, fields: Sequence[FieldSpec] = ()) -> None:
        super().__init__(listfile)
        base = listfile.parent
        self._base = base
        raw = _read_list(listfile)
        if not raw:
            raise SourceError(f"{listfile}: lists no samples")
        ids = self._classes(listfile, raw)
        self.fields = _field_specs(listfile, raw, fields)
        rows = []
        self._extra: dict[str, tuple[int, dict[str, Any]]] = {}
        for p, lab, line, extra in raw:
            full = Path(p) if os.path.isabs(p) else base / p
            try:
                st = full.stat()
            except FileNotFoundError as exc:
                raise SourceNotFoundError(f"{listfile}:{line}: {full} does not exist; fix the list") from exc
            try:
                rel = os.path.relpath(full, base)
            except ValueError:
                rel = str(full)
            if rel.startswith(".."):
                rel = str(full).lstrip("/")
            rows.append((rel, -1 if lab is None else ids[str(lab)], str(full), st.st_size, st.st_mtime_ns))
            if self.fields:
                self._extra[str(full)] = (line, extra)
        rows.sort()
        keys = unique_keys(key_for(r[0]) for r in rows)
        self.refs = [SampleRef(k, r[1], r[2], r[3], r[4]) for k, r in zip(keys, rows, strict=True)]
        self._rel = {r[2]: r[0] for r in rows}

    def _classes(self, listfile: Path, raw: list[_Row]) -> dict[str, int]:
        """Set ``classes`` from the labels; the label -> id map. No labels at all: no classes."""
        labels = [r.label for r in raw if r.label is not None]
        if not labels:
            return {}
        if len(labels) != len(raw):
            row = next(r.line for r in raw if r.label is None)
            raise SourceError(f"{listfile}:{row}: no label, but other rows have one; label every row or none")
        int_labels = [isinstance(lab, int) for lab in labels]
        if all(int_labels):
            nclass = max(int(lab) for lab in labels) + 1
            self.classes = [str(i) for i in range(nclass)]
            return {str(i): i for i in range(nclass)}
        if not any(int_labels):
            self.classes = sorted({str(lab) for lab in labels})
            return {c: i for i, c in enumerate(self.classes)}
        raise SourceError(f"{listfile}: labels mix integers and class names; use one kind throughout")

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        ext = sniff_ext(data) or file_ext(ref.locator)
        meta = {"source": self.rel_of(ref)}
        if not self.fields:
            return Sample(ref.key, ref.label, data, ext, meta)
        line, extra = self._extra[ref.locator]
        where = f"{self.root}:{line}"
        csv_cells = self.root.suffix.lower() == ".csv"
        values = {s.name: load_value(s, parse_cell(s, extra[s.name]) if csv_cells else extra[s.name], self._base, where)
                  for s in self.fields}
        return Sample(ref.key, ref.label, data, ext, meta, values)

    def where_of(self, ref: SampleRef) -> str:
        line = self._extra.get(ref.locator, (0, {}))[0]
        return f"{self.root}:{line} ({self.rel_of(ref)})" if line else self.path_of(ref)

    def rel_of(self, ref: SampleRef) -> str:
        return self._rel.get(ref.locator, ref.locator)


def _label_value(v: Any, where: str) -> int | str:
    if isinstance(v, bool):
        raise SourceError(f"{where}: label must be an integer or a class name, got {v!r}")
    if isinstance(v, str) and v.strip():
        s = v.strip()
        if not s.lstrip("-").isdigit():
            return s
        v = int(s)
    if isinstance(v, int):
        if v < 0:
            raise SourceError(f"{where}: negative label {v}")
        return v
    raise SourceError(f"{where}: label must be an integer or a class name, got {v!r}")


def _field_specs(listfile: Path, raw: list[_Row], declared: Sequence[FieldSpec]) -> list[FieldSpec]:
    """The list's field schema: declared specs, others typed from their first value; every row has every field."""
    names: list[str] = []
    for r in raw:
        names += [n for n in r.extra if n not in names]
    specs = {s.name: s for s in declared}
    for s in declared:
        if s.name not in names:
            raise SourceError(f"{listfile}: --fields names {s.name!r}, which no row has")
    out = []
    for n in names:
        for r in raw:
            if n not in r.extra:
                raise SourceError(f"{listfile}:{r.line}: field {n!r} is missing (other rows have it); "
                                  "give every row every field")
        out.append(specs.get(n) or infer_spec(n, raw[0].extra[n], listfile.parent))
    check_unique(out, str(listfile))
    return out


def _read_list(listfile: Path) -> list[_Row]:
    """The rows of a CSV or JSONL list file: primary path, label (None: none), line number, other values."""
    rows: list[_Row] = []
    text = listfile.read_text(encoding="utf-8")
    if listfile.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceError(f"{listfile}:{n}: not JSON ({exc.msg})") from exc
            prim = next((k for k in PRIMARY if k in obj), None) if isinstance(obj, dict) else None
            if prim is None or not isinstance(obj[prim], str):
                raise SourceError(f"{listfile}:{n}: expected an object with 'path' (or 'image', a string)")
            where = f"{listfile}:{n}"
            label = _label_value(obj["label"], where) if obj.get("label") is not None else None
            extra = {k: v for k, v in obj.items() if k not in (prim, "label")}
            rows.append(_Row(obj[prim], label, n, extra))
        return rows
    reader = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(reader, None) or []]
    low = [h.lower() for h in header]
    prim_col = next((low.index(k) for k in PRIMARY if k in low), None)
    if prim_col is None:
        raise SourceError(f"{listfile}: expected a CSV header 'path,label' ('image' for 'path'; 'label' optional; "
                          f"other columns are fields), got {header!r}")
    label_col = low.index("label") if "label" in low else None
    others = [(i, h) for i, h in enumerate(header) if i not in (prim_col, label_col)]
    for n, rec in enumerate(reader, 2):
        if not rec or not any(x.strip() for x in rec):
            continue
        if len(rec) <= prim_col or not rec[prim_col].strip():
            raise SourceError(f"{listfile}:{n}: no image path")
        label = None
        if label_col is not None and len(rec) > label_col and rec[label_col].strip():
            label = _label_value(rec[label_col], f"{listfile}:{n}")
        extra = {h: rec[i] for i, h in others if i < len(rec) and rec[i].strip()}
        rows.append(_Row(rec[prim_col].strip(), label, n, extra))
    return rows

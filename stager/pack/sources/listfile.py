"""A ``.csv`` (``path,label``) or ``.jsonl`` (``{"path", "label"}``) list of image files.

Labels are all integers (classes ``"0".."max"``) or all class names (sorted); relative paths
resolve against the list file's directory; samples are in relative-path order, a locator is the
file's absolute path. Every listed file must exist when the list is read.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from stager.errors import SourceError, SourceNotFoundError
from stager.formats.base import Sample
from stager.pack.sources.base import SampleRef, Source, file_ext, key_for, read_file, sniff_ext, unique_keys


class ListSource(Source):
    """A CSV (``path,label`` header) or JSONL (``{"path", "label"}``) list of image files."""

    kind = "list"

    def __init__(self, listfile: Path) -> None:
        super().__init__(listfile)
        base = listfile.parent
        raw = _read_list(listfile)
        if not raw:
            raise SourceError(f"{listfile}: lists no samples")
        int_labels = [isinstance(lab, int) for _, lab, _ in raw]
        if all(int_labels):
            nclass = max(int(lab) for _, lab, _ in raw) + 1
            self.classes = [str(i) for i in range(nclass)]
            ids = {str(i): i for i in range(nclass)}
        elif not any(int_labels):
            self.classes = sorted({str(lab) for _, lab, _ in raw})
            ids = {c: i for i, c in enumerate(self.classes)}
        else:
            raise SourceError(f"{listfile}: labels mix integers and class names; use one kind throughout")
        rows = []
        for p, lab, line in raw:
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
            rows.append((rel, ids[str(lab)], str(full), st.st_size, st.st_mtime_ns))
        rows.sort()
        keys = unique_keys(key_for(r[0]) for r in rows)
        self.refs = [SampleRef(k, r[1], r[2], r[3], r[4]) for k, r in zip(keys, rows, strict=True)]
        self._rel = {r[2]: r[0] for r in rows}

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        return Sample(ref.key, ref.label, data, sniff_ext(data) or file_ext(ref.locator), {"source": self.rel_of(ref)})

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


def _read_list(listfile: Path) -> list[tuple[str, int | str, int]]:
    """``(path, label, line number)`` rows of a CSV or JSONL list file."""
    rows: list[tuple[str, int | str, int]] = []
    text = listfile.read_text(encoding="utf-8")
    if listfile.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SourceError(f"{listfile}:{n}: not JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("path"), str) or "label" not in obj:
                raise SourceError(f"{listfile}:{n}: expected an object with 'path' (string) and 'label'")
            rows.append((obj["path"], _label_value(obj["label"], f"{listfile}:{n}"), n))
        return rows
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or [h.strip().lower() for h in header[:2]] != ["path", "label"]:
        raise SourceError(f"{listfile}: expected a CSV header 'path,label', got {header!r}")
    for n, rec in enumerate(reader, 2):
        if not rec or not any(x.strip() for x in rec):
            continue
        if len(rec) < 2 or not rec[0].strip():
            raise SourceError(f"{listfile}:{n}: expected 'path,label'")
        rows.append((rec[0].strip(), _label_value(rec[1], f"{listfile}:{n}"), n))
    return rows

"""Sidecar folders: files grouped by stem, the layout webdataset users keep before tarring.

``root/**/0001.jpg``, ``root/**/0001.mask.png``, ``root/**/0001.json``, ``root/**/0001.cls``: the
part of a file name before its first dot is the sample's stem (its key is the relative path of the
stem), the rest names the member: ``jpg`` (any image extension) is the primary image, ``cls`` the
label (an integer), and every other member ``<name>.<ext>`` or ``<ext>`` is a field named ``<name>``
(``mask.png`` -> field ``mask``; ``json`` -> field ``json``... named ``meta``; see below). Fields are
declared with ``--fields NAME:KIND`` (e.g. ``mask:mask``, ``boxes:boxes``) or typed by extension. A
member present for some stems and not others is an error naming the first stem that lacks it.

A bare ``<stem>.json`` becomes the field ``meta`` (kind ``json``), so the tar member is
``KEY.meta.json`` and never clashes with stager's own ``KEY.json``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from stager.errors import SourceError
from stager.formats.base import Sample
from stager.manifest.fields import FieldSpec, check_unique
from stager.pack.sources.base import IMAGE_EXTENSIONS, SampleRef, Source, file_ext, read_file, sniff_ext
from stager.pack.sources.fieldvalues import infer_spec, load_value

_IMAGE_EXTS = {e.lstrip(".") for e in IMAGE_EXTENSIONS}


def member_field(member: str) -> str:
    """The field name of a member suffix (``mask.png`` -> ``mask``, ``json`` -> ``meta``)."""
    if "." in member:
        return member.split(".", 1)[0]
    return "meta" if member == "json" else member


def is_sidecar_folder(root: Path) -> bool:
    """Whether ``root`` directly holds an image file and another file with the same stem (``0001.jpg`` and
    ``0001.mask.png`` or ``0001.cls``): an ImageFolder root holds class folders, not such groups."""
    try:
        names = [e.name for e in os.scandir(root) if e.is_file() and not e.name.startswith(".") and "." in e.name]
    except OSError:
        return False
    images = {n.split(".", 1)[0] for n in names if n.split(".", 1)[1].lower() in _IMAGE_EXTS}
    return any(n.split(".", 1)[0] in images and n.split(".", 1)[1].lower() not in _IMAGE_EXTS for n in names)


class SidecarSource(Source):
    """Files grouped by stem under ``root`` (see the module docstring)."""

    kind = "sidecar"

    def __init__(self, root: Path, fields: Sequence[FieldSpec] = ()) -> None:
        super().__init__(root)
        groups: dict[str, dict[str, str]] = {}
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel_dir = os.path.relpath(dirpath, root)
            for name in filenames:
                if name.startswith(".") or "." not in name:
                    continue
                stem, member = name.split(".", 1)
                key = stem if rel_dir == "." else f"{rel_dir}/{stem}".replace(os.sep, "/")
                groups.setdefault(key, {})[member] = os.path.join(dirpath, name)
        self._groups: dict[str, tuple[str, dict[str, str]]] = {}
        declared = {s.name: s for s in fields}
        specs: dict[str, FieldSpec] = {}
        labels: dict[str, int] = {}
        for key in sorted(groups):
            members = groups[key]
            prim = next((m for m in members if m.lower() in _IMAGE_EXTS), None)
            if prim is None:
                raise SourceError(f"{root}: sample {key!r} has no primary image ({key}.jpg, .png, ...); "
                                  f"members: {sorted(members)}")
            if "cls" in members:
                text = Path(members["cls"]).read_text().strip()
                if not text.lstrip("-").isdigit():
                    raise SourceError(f"{members['cls']}: expected an integer label, got {text[:40]!r}")
                labels[key] = int(text)
            rest = {member_field(m): p for m, p in members.items() if m not in (prim, "cls")}
            for name, path in rest.items():
                if name not in specs:
                    specs[name] = declared.get(name) or infer_spec(name, path, root)
            self._groups[key] = (members[prim], rest)
        self.fields = [specs[n] for n in sorted(specs)]
        check_unique(self.fields, str(root))
        for key, (_, rest) in self._groups.items():
            missing = sorted(set(specs) - set(rest))
            if missing:
                raise SourceError(f"{root}: sample {key!r} lacks field(s) {', '.join(missing)} that other samples have")
        if labels and len(labels) != len(self._groups):
            key = next(k for k in self._groups if k not in labels)
            raise SourceError(f"{root}: sample {key!r} has no .cls label, but others have one; label all or none")
        nclass = max(labels.values(), default=-1) + 1
        self.classes = [str(i) for i in range(nclass)]
        self.refs = []
        for key, (path, _) in self._groups.items():
            st = os.stat(path)
            self.refs.append(SampleRef(key, labels.get(key, -1), path, st.st_size, st.st_mtime_ns))

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        _, rest = self._groups[ref.key]
        where = self.where_of(ref)
        values = {s.name: load_value(s, rest[s.name], self.root, where) for s in self.fields}
        return Sample(ref.key, ref.label, data, sniff_ext(data) or file_ext(ref.locator), {"source": ref.key}, values)

    def where_of(self, ref: SampleRef) -> str:
        return f"{self.root}: sample {ref.key!r}"

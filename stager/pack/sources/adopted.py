"""Containers other tools wrote, as a pack source: MXNet RecordIO (``.rec``), LMDB (Caffe Datums,
pickled samples) and SquashFS images of ImageFolder trees (``mksquashfs``: a file, or a directory of
them), so ``stager pack SRC OUT --format F`` converts them to any stager format.

The source is indexed in memory exactly as ``stager index`` would index it
(:func:`stager.index.adopt_in_memory`: the same scanners, keys, labels and checks, nothing written)
and then read like an indexed pack (:class:`~stager.pack.sources.packed.PackSource`): payloads through
the format's reader by the byte extents. Raw Datums come out as ``(H, W, C)`` RGB arrays (decoded
samples: zarr stores them as they are, the encoded formats PNG-encode them).
"""

from __future__ import annotations

from pathlib import Path

from stager.formats import FORMAT_SPECS
from stager.pack.sources.packed import PackSource

SUFFIXES = {".rec": "recordio", ".mdb": "lmdb", ".lmdb": "lmdb",
            **{s: "squashfs" for s in FORMAT_SPECS["squashfs"].adopt_suffixes}}


def _magic_kind(path: Path) -> str | None:
    """The adopted format whose registered magic ``path`` starts with (a SquashFS image named ``x.img``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    return next((n for n, s in FORMAT_SPECS.items() if s.adopted and s.magic and head.startswith(s.magic)), None)


def adopted_kind(root: Path) -> str | None:
    """``recordio``, ``lmdb`` or ``squashfs`` when ``root`` is such a file or a directory holding such
    files, else None."""
    if root.is_file():
        return SUFFIXES.get(root.suffix.lower()) or _magic_kind(root)
    if (root / "data.mdb").is_file():
        return "lmdb"
    kinds = {SUFFIXES.get(p.suffix.lower()) for p in root.iterdir() if p.is_file() and not p.name.startswith(".")}
    return next((k for k in dict.fromkeys(SUFFIXES.values()) if k in kinds), None)


class AdoptedSource(PackSource):
    """A RecordIO file (or directory of them) or an LMDB, indexed in memory and read by extents."""

    def __init__(self, root: Path, kind: str) -> None:
        from stager.index import IndexOptions, adopt_in_memory  # noqa: PLC0415 (index scanners only for these)

        manifest = adopt_in_memory(root, IndexOptions(format=kind))
        super().__init__(root, manifest)
        self.kind = kind

"""Containers other tools wrote, as a pack source: MXNet RecordIO (``.rec``) and LMDB (Caffe Datums,
pickled samples), so ``stager pack SRC OUT --format F`` converts them to any stager format.

The source is indexed in memory exactly as ``stager index`` would index it
(:func:`stager.index.adopt_in_memory`: the same scanners, keys, labels and checks, nothing written)
and then read like an indexed pack (:class:`~stager.pack.sources.packed.PackSource`): payloads through
the format's reader by the byte extents. Raw Datums come out as ``(H, W, C)`` RGB arrays (decoded
samples: zarr stores them as they are, the encoded formats PNG-encode them).
"""

from __future__ import annotations

from pathlib import Path

from stager.pack.sources.packed import PackSource

SUFFIXES = {".rec": "recordio", ".mdb": "lmdb", ".lmdb": "lmdb"}


def adopted_kind(root: Path) -> str | None:
    """``recordio`` or ``lmdb`` when ``root`` is such a file or a directory holding such files, else None."""
    if root.is_file():
        return SUFFIXES.get(root.suffix.lower())
    if (root / "data.mdb").is_file():
        return "lmdb"
    if any(p.suffix.lower() == ".rec" for p in root.iterdir() if p.is_file()):
        return "recordio"
    return None


class AdoptedSource(PackSource):
    """A RecordIO file (or directory of them) or an LMDB, indexed in memory and read by extents."""

    def __init__(self, root: Path, kind: str) -> None:
        from stager.index import IndexOptions, adopt_in_memory  # noqa: PLC0415 (index scanners only for these)

        manifest = adopt_in_memory(root, IndexOptions(format=kind))
        super().__init__(root, manifest)
        self.kind = kind

"""Which kind of source a path is: :func:`open_source`.

Rules, in order: a ``.csv``/``.jsonl``/``.ndjson`` file is a list; ``manifest.json`` or a directory
holding one is a pack; a COCO ``instances_*.json`` is COCO; a directory with CIFAR batch files is
CIFAR; a directory holding files grouped by stem (``0001.jpg``, ``0001.mask.png``; or any directory
with ``--fields``) is a sidecar folder; any other directory is an ImageFolder. A source that lists nothing is an error.
"""

from __future__ import annotations

import os
from pathlib import Path

from stager.errors import SourceError, SourceNotFoundError, UsageError
from stager.manifest.fields import parse_fields_arg
from stager.pack.sources.base import MapFn, Source
from stager.pack.sources.cifar import CIFAR_SPLITS, CifarSource
from stager.pack.sources.coco import CocoSource, is_coco_file
from stager.pack.sources.imagefolder import ImageFolderSource
from stager.pack.sources.listfile import ListSource
from stager.pack.sources.packed import PackSource
from stager.pack.sources.sidecar import SidecarSource, is_sidecar_folder


def open_source(
    src: str | os.PathLike[str], *, split: str | None = None, map_fn: MapFn | None = None,
    fields: str | None = None,
) -> Source:
    """Recognise and list the source at ``src`` (see the module docstring for the kinds).

    ``map_fn`` (``map``-like) is used to list an ImageFolder's class folders (in parallel when it is
    a process pool's ``map``). Raises :class:`SourceNotFoundError` for a missing path and
    :class:`SourceError` for an empty or unrecognisable one.
    """
    root = Path(os.path.abspath(os.fspath(src)))
    specs = parse_fields_arg(fields) if fields else []
    if not root.exists():
        raise SourceNotFoundError(f"{root}: source does not exist")
    if root.is_file():
        if root.suffix.lower() in (".csv", ".jsonl", ".ndjson"):
            src_obj: Source = ListSource(root, specs)
        elif root.name == "manifest.json":
            src_obj = PackSource(root.parent)
        elif is_coco_file(root):
            src_obj = CocoSource(root)
        else:
            raise SourceError(
                f"{root}: unsupported source file; expected a .csv/.jsonl list, a COCO instances_*.json, an "
                "ImageFolder, sidecar or CIFAR batches directory, or a stager pack"
            )
    elif (root / "manifest.json").is_file():
        src_obj = PackSource(root)
    elif any((root / b).is_file() for names in CIFAR_SPLITS.values() for b in names):
        src_obj = CifarSource(root, split or "train")
    elif specs or is_sidecar_folder(root):
        src_obj = SidecarSource(root, specs)
    else:
        src_obj = ImageFolderSource(root, map_fn=map_fn)
    if specs and src_obj.kind not in ("list", "sidecar"):
        raise UsageError(f"--fields applies to list files and sidecar folders; {root} is a {src_obj.kind} source")
    if split is not None and src_obj.kind != "cifar":
        raise UsageError(f"--split applies to CIFAR batch directories only; {root} is a {src_obj.kind} source")
    if not src_obj.refs:
        raise SourceError(f"{root}: source holds no images ({src_obj.kind}); check the path")
    return src_obj

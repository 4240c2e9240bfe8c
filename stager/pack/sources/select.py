"""Which kind of source a path is: :func:`open_source`.

With clip options (``--clip-length``) the source is a folder of videos or of frame folders
(:mod:`~stager.pack.sources.video`, :mod:`~stager.pack.sources.frames`). Otherwise, rules, in
order: a ``.rec`` file or a directory of them (without a manifest) is MXNet RecordIO, an LMDB (a
directory holding ``data.mdb``, or an ``.mdb``/``.lmdb`` file) is LMDB (both indexed in memory:
:mod:`stager.pack.sources.adopted`); a ``.csv``/``.jsonl``/``.ndjson`` file is a list;
``manifest.json`` or a directory holding one is a pack; a COCO ``instances_*.json`` is COCO; a
directory with CIFAR batch files is CIFAR; a directory holding files grouped by stem (``0001.jpg``,
``0001.mask.png``; or any directory with ``--fields``) is a sidecar folder (docs/fields.md); any
other directory is an ImageFolder. A source that lists nothing is an error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import SourceNotFoundError, UnsuitableSourceError, UsageError
from stager.formats.registry import FORMAT_SPECS
from stager.manifest import not_a_pack
from stager.manifest.document import UNFINISHED_STATE
from stager.manifest.fields import parse_fields_arg
from stager.pack.sources.adopted import AdoptedSource, adopted_kind
from stager.pack.sources.base import MapFn, Source
from stager.pack.sources.cifar import CIFAR_SPLITS, CifarSource
from stager.pack.sources.coco import CocoSource, is_coco_file
from stager.pack.sources.frames import FrameFolderSource
from stager.pack.sources.imagefolder import ImageFolderSource
from stager.pack.sources.listfile import ListSource
from stager.pack.sources.packed import PackSource
from stager.pack.sources.sidecar import SidecarSource, is_sidecar_folder
from stager.pack.sources.video import VideoSource, find_videos

SHARD_SUFFIXES = tuple(s for spec in FORMAT_SPECS.values() for s in spec.adopt_suffixes)  # what `stager index` adopts

if TYPE_CHECKING:
    from stager.manifest.clips import ClipSpec
    from stager.pack.options import PackOptions


def open_source(
    src: str | os.PathLike[str],
    *,
    split: str | None = None,
    map_fn: MapFn | None = None,
    options: PackOptions | None = None,
) -> Source:
    """Recognise and list the source at ``src`` (see the module docstring for the kinds).

    ``map_fn`` (``map``-like) is used to list an ImageFolder's class folders (in parallel when it is
    a process pool's ``map``). Raises :class:`SourceNotFoundError` for a missing path and
    :class:`UnsuitableSourceError` for an empty or unrecognisable one.
    """
    root = Path(os.path.abspath(os.fspath(src)))
    if not root.exists():
        raise SourceNotFoundError(f"{root}: source does not exist")
    spec = options.clip_spec() if options is not None else None
    if spec is not None:
        return _open_clip_source(root, spec, options, map_fn)  # type: ignore[arg-type]
    specs = parse_fields_arg(options.fields) if options is not None and options.fields else []
    adopted = adopted_kind(root) if not (root / "manifest.json").is_file() else None
    if adopted is not None:
        src_obj: Source = AdoptedSource(root, adopted)
    elif root.is_file():
        if root.suffix.lower() in (".csv", ".jsonl", ".ndjson"):
            src_obj = ListSource(root, specs)
        elif root.name == "manifest.json":
            src_obj = PackSource(root.parent)
        elif is_coco_file(root):
            src_obj = CocoSource(root)
        elif root.name.lower().endswith(SHARD_SUFFIXES):
            if (root.parent / "manifest.json").is_file():
                raise not_a_pack(root)  # a shard of a pack: the message names the pack's directory
            raise UnsuitableSourceError(
                f"{root}: a single shard, not a source of images; adopt its directory in place with `stager index "
                f"{root.parent}`, which a pack can then convert (`stager pack {root.parent} OUT --format tar`)")
        else:
            raise UnsuitableSourceError(
                f"{root}: unsupported source file; expected a .csv/.jsonl list, a COCO instances_*.json, an "
                "ImageFolder, sidecar or CIFAR batches directory, or a stager pack"
            )
    elif (root / "manifest.json").is_file():
        src_obj = PackSource(root)
    elif any((root / b).is_file() for names in CIFAR_SPLITS.values() for b in names):
        src_obj = CifarSource(root, split or "train")
    elif specs or is_sidecar_folder(root):
        src_obj = SidecarSource(root, specs)
    elif any((root / state).is_dir() for state in UNFINISHED_STATE):
        raise not_a_pack(root)  # an unfinished pack or index: the message says which command finishes it
    elif not any(e.is_dir() for e in os.scandir(root)) and any(
            e.name.lower().endswith(SHARD_SUFFIXES) for e in os.scandir(root)):
        raise UnsuitableSourceError(
            f"{root}: holds shard files, not an image tree; adopt them in place with `stager index {root}`, which "
            f"a pack can then convert (`stager pack {root} OUT --format tar`)")
    else:
        src_obj = ImageFolderSource(root, map_fn=map_fn,
                                    allow_empty=options is not None and options.allow_empty_classes)
    if specs and src_obj.kind not in ("list", "sidecar"):
        raise UsageError(f"--fields applies to list files and sidecar folders; {root} is a {src_obj.kind} source")
    if split is not None and src_obj.kind != "cifar":
        raise UsageError(f"--split applies to CIFAR batch directories only; {root} is a {src_obj.kind} source")
    if not src_obj.refs:
        raise UnsuitableSourceError(f"{root}: source holds no images ({src_obj.kind}); check the path")
    return src_obj


def _open_clip_source(root: Path, spec: ClipSpec, options: PackOptions, map_fn: MapFn | None) -> Source:
    """A clip pack's source (``--clip-length``): video files if ``root`` holds any, else frame folders."""
    if not root.is_dir():
        raise UnsuitableSourceError(f"{root}: --clip-length needs a folder of sequences or videos")
    skip = options.on_error == "skip"
    if find_videos(root):
        if options.fields:
            raise UsageError(f"{root}: --fields applies to frame folders with sidecar files, not to video files")
        return VideoSource(root, spec, resize=options.resize, quality=options.quality, skip_bad=skip, map_fn=map_fn)
    specs = parse_fields_arg(options.fields) if options.fields else []
    return FrameFolderSource(root, spec, resize=options.resize, skip_bad=skip, fields=specs)

"""Index SquashFS images as ImageFolder trees (``mksquashfs TREE IMG``, with any of its options).

The image is hashed (one sequential pass, on a thread beside the rest) and its listing decoded in bulk
(:meth:`stager.formats.squashfs.SquashImage.listing`: the inode and directory tables only, no data
block is read); :func:`stager.formats.squashfs.folder.image_folder` applies torchvision's ImageFolder
rules to it: classes are the top-level folders, sorted; samples the files with an image extension
under them (``image_key``: other extensions, ``;``-separated, e.g. ``jpg;png``); keys the paths less
their extension; links, devices and hard links where samples are expected are refused, as are an
empty class folder and two files of one key. Files that mksquashfs stored once for several names
(duplicates: different inodes sharing blocks) are separate samples.

Each sample's ``offset`` is where its bytes are one stored range of the image (``-noD``,
``-no-fragments`` or files that did not compress), else :data:`~stager.formats.squashfs.shards.INODE`
plus its inode reference; a shard with any of the latter says ``extents: "inodes"`` (docs/formats.md).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from stager.errors import UsageError
from stager.formats.squashfs import SquashImage
from stager.formats.squashfs.folder import IMG_EXTENSIONS, image_folder
from stager.formats.squashfs.shards import INODE
from stager.index.scan import ShardScan, mapped

FOLDER_LABELS = "folder"  # the label key: a sample's class is its top-level folder


def image_extensions(image_key: str | None) -> tuple[str, ...]:
    """The sample file extensions ``image_key`` names (``jpg;png``), else ImageFolder's."""
    if image_key is None:
        return IMG_EXTENSIONS
    exts = tuple(f".{e.strip().lstrip('.').lower()}" for e in image_key.split(";") if e.strip().lstrip("."))
    if not exts:
        raise UsageError(f"--image-key {image_key!r}: name the extensions of sample files, e.g. jpg;png")
    return exts


def _hash(path: str, algo: str) -> tuple[str, os.stat_result]:
    with mapped(path, algo) as (_view, digest, st):
        return digest, st


def scan_squashfs(path: str, name: str, image_key: str | None, label_key: str | None, algo: str, *,
                  fields: bool = True) -> ShardScan:
    """Index one image (see the module docstring); one-line errors name it. ``fields`` is accepted for
    the scanner signature: files beside the images are not adopted as fields."""
    if label_key not in (None, FOLDER_LABELS):
        raise UsageError(f"--label-key {label_key!r}: a SquashFS image's labels are its top-level folders "
                         f"({FOLDER_LABELS}), or none")
    # The image's hash (one sequential pass; xxhash releases the GIL) runs beside the listing's decoding.
    with ThreadPoolExecutor(1) as pool:
        hashed = pool.submit(_hash, path, algo)
        try:
            with SquashImage(path, name=path) as im:
                lst = im.listing()
            found = image_folder(lst, path, image_extensions(image_key))
        finally:
            digest, st = hashed.result()  # waits for the hash; its own error first (a missing image)
    out = ShardScan(name, st.st_size, digest, st.st_mtime_ns)
    # Columns stand in for ShardScan's lists (readers take any sequence): no Python object per sample.
    out.keys = cast("list[str]", found.keys)
    out.label_names = list(found.classes)
    out.keys_unique = True  # image_folder refused two files of one key
    out.labels = cast("list[Any]", found.label if label_key is not None else np.full(len(found), -1, np.int64))
    raw = lst.raw_offset[found.files]
    out.offsets = cast("list[int]", np.where(raw >= 0, raw, INODE + lst.inode_ref[found.files]))
    out.sizes = cast("list[int]", lst.size[found.files])
    out.extents = "bytes" if (raw >= 0).all() else "inodes"
    return out

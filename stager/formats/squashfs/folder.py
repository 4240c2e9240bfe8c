"""An image's listing read as torchvision's ImageFolder reads a directory: :func:`image_folder`.

The rules are ImageFolder's (``torchvision.datasets.folder``): every top-level directory is a class,
classes sorted by name; a sample is a regular file at any depth under a class folder whose name ends
in one of :data:`IMG_EXTENSIONS` (compared in lower case); files at the top level and files of other
types are not samples. A class folder without a sample is refused, as ImageFolder refuses it. Where
samples are expected (under a class folder) a symlink, device, FIFO or socket, and a hard link (two
names for one inode), are refused with one line: a sample must be one regular file. Keys are the
paths without their extension (``cat/n0001``), as ``stager pack`` keys an ImageFolder tree; two files
that differ only by their extension would share a key and are refused.

Everything is vectorised over the listing's columns (an ImageNet-sized image has 1.28M entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stager.errors import SourceError, UnsafeArchiveError, UnsuitableSourceError
from stager.formats.squashfs.layout import DIR, KIND_NAMES, REG
from stager.formats.squashfs.listing import ImageListing
from stager.manifest.table import Ragged, Strings

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
_TAIL = 8  # bytes of each path's end compared with the extensions (the longest is 5)


@dataclass
class FolderSamples:
    """The samples of an image read as an ImageFolder, in listing order (class by class; a folder's
    files by name): ``files`` (int64 listing entries), ``keys`` (the paths less their extension),
    ``label`` (int64 index into ``classes``), ``ext_len`` (bytes of each path's extension, the dot
    included). ``classes`` are the top-level folder names, sorted."""

    files: np.ndarray
    keys: Strings
    label: np.ndarray
    ext_len: np.ndarray
    classes: list[str]

    def __len__(self) -> int:
        return len(self.files)


def extension_lengths(paths: Strings, extensions: tuple[str, ...]) -> np.ndarray:
    """For each path, the length of the first of ``extensions`` (``.jpg``, lower case; at most
    :data:`_TAIL` bytes) its name ends with, compared case-insensitively, else 0 (int64, ``(n,)``).
    Each path's last 8 bytes, lower-cased, as one little-endian uint64: an extension of L bytes is
    then one shift and compare for all paths."""
    raw = paths.raw
    lengths = np.diff(raw.starts)
    padded = np.concatenate([np.zeros(_TAIL, np.uint8), raw.values])  # a short first path reads zeros in front
    rows = np.lib.stride_tricks.as_strided(padded, shape=(len(raw.values) + 1, _TAIL), strides=(1, 1),
                                           writeable=False)
    tail = rows[raw.starts[1:]]  # each path's last _TAIL bytes: one gather of a row per path
    tail |= ((tail >= ord("A")) & (tail <= ord("Z"))).astype(np.uint8) << 5  # ASCII lower case
    last = tail.view("<u8").reshape(-1)
    out = np.zeros(len(lengths), dtype=np.int64)
    for ext in sorted(extensions, key=len, reverse=True):
        want = ext.lower().encode()
        if len(want) > _TAIL:
            raise ValueError(f"extension {ext!r} is longer than {_TAIL} bytes")
        hit = (out == 0) & (lengths > len(want)) & (last >> np.uint64(8 * (_TAIL - len(want)))
                                                     == np.uint64(int.from_bytes(want, "little")))
        out[hit] = len(want)
    return out


def keep_heads(paths: Strings, rows: np.ndarray, cut: np.ndarray) -> Strings:
    """The strings at ``rows`` (ascending) each less its last ``cut[k]`` bytes, as one new column: one
    boolean mask over the bytes, repeated from (kept, dropped) byte counts per string; no per-string
    Python work and no per-byte index array."""
    raw = paths.raw
    lengths = np.diff(raw.starts)
    keep = np.zeros(len(lengths), dtype=np.int64)
    keep[rows] = lengths[rows] - cut
    counts = np.stack([keep, lengths - keep], axis=1).reshape(-1)
    mask = np.repeat(np.tile(np.array([True, False]), len(lengths)), counts)
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(keep[rows], out=starts[1:])
    return Strings(Ragged(raw.values[raw.starts[0] : raw.starts[-1]][mask], starts))


def image_folder(lst: ImageListing, image: str, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> FolderSamples:
    """The samples of ``lst`` under ImageFolder's rules (see the module docstring); one-line errors
    name ``image``: :class:`UnsafeArchiveError` for links and special files where samples are expected,
    :class:`UnsuitableSourceError` (exit 2) for an image without class folders, :class:`SourceError`
    (exit 3) for an empty class folder or two samples of one key."""
    top_dirs = np.flatnonzero((lst.parent == -1) & (lst.kind == DIR))
    classes = [lst.paths[int(i)] for i in top_dirs]
    if not classes:
        raise UnsuitableSourceError(f"{image}: no top-level folders; an ImageFolder image holds <class>/<file> "
                                    "(make it with mksquashfs TREE IMG from a tree of class folders)")
    under = lst.parent >= 0
    _refuse_specials(lst, under, image)
    ext_len = extension_lengths(lst.paths, extensions)
    is_sample = under & (lst.kind == REG) & (ext_len > 0)
    files = np.flatnonzero(is_sample)
    top = lst.top[files]
    cls_of_top = np.full(len(lst), -1, dtype=np.int64)
    cls_of_top[top_dirs] = np.arange(len(top_dirs))  # listing order of the root's entries is name order
    label = cls_of_top[top]
    counts = np.bincount(label, minlength=len(classes))
    if (counts == 0).any():
        empty = classes[int(np.argmax(counts == 0))]
        raise SourceError(f"{image}: class folder {empty!r} holds no image ({', '.join(extensions)}); torchvision's "
                         "ImageFolder refuses it too: remove the folder from the image or add its images")
    _refuse_hard_links(lst, files, image)
    keys = keep_heads(lst.paths, files, ext_len[files])
    repeat = keys.first_repeat()
    if repeat is not None:
        i, j = (int(files[k]) for k in repeat)
        raise SourceError(f"{image}: {lst.paths[i]!r} and {lst.paths[j]!r} are both sample {keys[repeat[0]]!r} (a "
                          "key is the path less its extension); rename one and re-make the image")
    return FolderSamples(files, keys, label, ext_len[files], classes)


def _refuse_specials(lst: ImageListing, under: np.ndarray, image: str) -> None:
    bad = np.flatnonzero(under & (lst.kind != REG) & (lst.kind != DIR))
    if len(bad):
        i = int(bad[0])
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UnsafeArchiveError(f"{image}: {lst.paths[i]!r} is a {KIND_NAMES.get(int(lst.kind[i]), 'special file')}"
                                 f"{more} where samples must be regular files; re-make the image from a tree of plain "
                                 "files (mksquashfs TREE IMG; cp -rL TREE resolves links)")


def _refuse_hard_links(lst: ImageListing, files: np.ndarray, image: str) -> None:
    refs = lst.inode_ref[files]
    order = np.argsort(refs, kind="stable")
    same = np.flatnonzero(refs[order][1:] == refs[order][:-1])
    linked = files[lst.nlink[files] > 1]
    if len(same) or len(linked):
        i = int(files[order[same[0] + 1]]) if len(same) else int(linked[0])
        raise UnsafeArchiveError(f"{image}: {lst.paths[i]!r} is a hard link ({max(2, int(lst.nlink[i]))} names for one "
                                 "inode) where samples must be regular files; re-make the image from a tree without "
                                 "hard links (mksquashfs stores files of equal bytes once by itself)")


__all__ = ["IMG_EXTENSIONS", "FolderSamples", "extension_lengths", "image_folder", "keep_heads"]

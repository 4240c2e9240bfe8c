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
from stager.formats.squashfs.columns import ByteView, segment_starts
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
    Each path's last 8 bytes, lower-cased, as one little-endian uint64 (one unaligned 8-byte load per
    path): an extension of L bytes is then one shift and compare for all paths."""
    raw = paths.raw
    values, ends = raw.values, raw.starts[1:]
    lengths = np.diff(raw.starts)
    out = np.zeros(len(lengths), dtype=np.int64)
    if not len(values):
        return out
    padded = values if len(values) >= _TAIL else np.concatenate([np.zeros(_TAIL - len(values), np.uint8), values])
    shift = 0 if padded is values else _TAIL - len(values)
    at = ends + shift - _TAIL  # negative only for paths that end within the first 8 bytes
    words = np.ndarray(shape=(len(padded) - _TAIL + 1,), dtype="<u8", buffer=padded, strides=(1,))
    last = words[np.maximum(at, 0)]
    short = at < 0
    if short.any():  # push the bytes past such a path's end out of the word's top: zeros in front instead
        last[short] <<= (8 * -at[short]).astype(np.uint64)
    tail = last.view(np.uint8).reshape(-1, _TAIL)
    tail |= ((tail >= ord("A")) & (tail <= ord("Z"))).astype(np.uint8) << 5  # ASCII lower case
    wanted = [e.lower().encode() for e in extensions]
    if any(len(w) > _TAIL for w in wanted):
        raise ValueError(f"an extension of {', '.join(extensions)} is longer than {_TAIL} bytes")
    for size in sorted({len(w) for w in wanted}, reverse=True):  # the longest match wins (.tiff, not .tif)
        tail_word = last >> np.uint64(8 * (_TAIL - size))
        hit = np.zeros(len(out), dtype=bool)
        for w in wanted:
            if len(w) == size:
                hit |= tail_word == np.uint64(int.from_bytes(w, "little"))
        hit &= lengths > size
        if size != max(len(w) for w in wanted):
            hit &= out == 0
        out[hit] = size
    return out


_ROWS = 1 << 15  # strings per pass of cut_keys (their rows stay in the CPU cache)
_PASS_BYTES = 1 << 24  # and at most this many bytes of rows a pass (deep trees' long paths)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def cut_keys(paths: Strings, rows: np.ndarray, cut: np.ndarray) -> tuple[Strings, np.ndarray]:
    """The strings at ``rows`` (int64) each less its last ``cut[k]`` bytes, as one new column, and a
    64-bit hash of each (of its bytes and length; equal strings hash equal). A pass gathers its
    strings' bytes as rows of the widest one's width (rounded up to 8), masks what lies past each key
    (one mask keeps the key's bytes and zeroes the rest) and hashes the rows as 8-byte words: no
    per-byte index array and no per-string Python work."""
    raw = paths.raw
    values, starts = raw.values, raw.starts
    keep = np.diff(starts)[rows] - cut
    out_starts = segment_starts(keep)
    out = np.empty(int(out_starts[-1]), dtype=np.uint8)
    hashes = np.empty(len(rows), dtype=np.uint64)
    masks: dict[int, np.ndarray] = {}  # width -> its masks: row k keeps the first k bytes
    step = max(1, min(_ROWS, _PASS_BYTES // (int(keep.max()) + 8))) if len(keep) else 1
    for a in range(0, len(rows), step):
        b = min(len(rows), a + step)
        k = keep[a:b]
        w = int(k.max())
        w += -w % 8
        block = gather_rows(values, starts[rows[a:b]], w)
        if int(k.min()) == int(k.max()):  # keys of one length (the usual photo folder): plain copies
            out[out_starts[a] : out_starts[b]] = block[:, : int(k[0])].reshape(-1)
            block[:, int(k[0]) :] = 0
        else:
            if w not in masks:
                masks[w] = (np.arange(w) < np.arange(w + 1)[:, None]).view(np.uint8) * np.uint8(0xFF)
            mask = masks[w][k]
            out[out_starts[a] : out_starts[b]] = block[mask.view(bool)]
            block &= mask
        h = k.astype(np.uint64) * _MIX
        for word in block.view("<u8").T:
            h ^= word
            h *= _MIX
            h ^= h >> np.uint64(29)
        hashes[a:b] = h
    return Strings(Ragged(out, out_starts)), hashes


def gather_rows(values: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` bytes of ``values`` (uint8) from each offset in ``at``, zeros past its end: a
    fresh ``(len(at), width)`` uint8 array (one copy of a row each; only rows that run past the end
    go through a small zero-padded copy of it)."""
    limit = len(values) - width
    if len(at) == 0 or width == 0:
        return np.zeros((len(at), width), dtype=np.uint8)
    if int(at.max()) <= limit:
        return ByteView(values, len(values)).rows(at, width)
    base = max(0, limit)
    tail = np.zeros(len(values) - base + width, dtype=np.uint8)
    tail[: len(values) - base] = values[base:]
    near = at > limit
    out = np.empty((len(at), width), dtype=np.uint8)
    if not near.all():
        out[~near] = ByteView(values, len(values)).rows(at[~near], width)
    out[near] = ByteView(tail, len(tail)).rows(at[near] - base, width)
    return out


def first_equal(keys: Strings, hashes: np.ndarray) -> tuple[int, int] | None:
    """``(i, j)``, ``i < j``, of the first key ``j`` equal to an earlier one ``i`` (``hashes`` from
    :func:`cut_keys`), else None: keys of equal hashes are compared exactly."""
    ordered = np.sort(hashes)
    if not (ordered[1:] == ordered[:-1]).any():
        return None
    return keys.first_repeat()


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
    keys, hashes = cut_keys(lst.paths, files, ext_len[files])
    repeat = first_equal(keys, hashes)
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
    if (refs[1:] > refs[:-1]).all():  # increasing in listing order (mksquashfs's): none repeats, no sort
        same = np.zeros(0, dtype=np.int64)
    else:
        order = np.argsort(refs, kind="stable")
        same = np.flatnonzero(refs[order][1:] == refs[order][:-1])
    linked = files[lst.nlink[files] > 1]
    if len(same) or len(linked):
        i = int(files[order[same[0] + 1]]) if len(same) else int(linked[0])
        raise UnsafeArchiveError(f"{image}: {lst.paths[i]!r} is a hard link ({max(2, int(lst.nlink[i]))} names for one "
                                 "inode) where samples must be regular files; re-make the image from a tree without "
                                 "hard links (mksquashfs stores files of equal bytes once by itself)")


__all__ = ["IMG_EXTENSIONS", "FolderSamples", "cut_keys", "extension_lengths", "image_folder"]

"""The source protocol: :class:`Source` lists :class:`SampleRef` rows and loads samples; keys.

Contract of every source: after construction ``refs`` (a ``Sequence[SampleRef]``: a list, or a lazy
columnar view such as ImageFolder's :class:`~stager.pack.sources.columns.ListingRefs`) lists every
sample once, in an order that depends only on the source's contents (never on the file system's
listing order), with unique keys (:func:`unique_keys`); ``classes[label]`` names each label.
``load_many(refs)`` returns one result per ref, in order: the :class:`~stager.formats.base.Sample`
or the exception that stopped it (the writer applies ``on_error``). Sources pickle without their
caches, so workers can receive them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from stager.errors import SourceError
from stager.formats.base import Sample
from stager.manifest.fields import FieldSpec

# ``map``-like: ``fn`` applied to each item, results in order (builtin ``map`` or ``PackPool.map``).
MapFn = Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif"})


class SampleRef(NamedTuple):
    """One sample as the planner sees it; ``locator`` tells the source where to read it.

    ``size`` is the expected payload size in bytes (the file size for file sources) and ``mtime``
    the source file's modification time in ns (0 where meaningless); both enter the plan
    fingerprint so that a changed source file invalidates the shard holding it. A named tuple, not a
    dataclass: listing builds one per file and workers receive them pickled, and a tuple costs a
    fraction of a frozen dataclass on both counts.
    """

    key: str
    label: int
    locator: str
    size: int
    mtime: int = 0


class Source:
    """Base of all sources: ``refs`` in a deterministic order, ``classes``, and a loader."""

    kind = "?"
    sample_kind = "encoded"  # what load_many() returns natively: encoded bytes or decoded arrays
    # ``refs`` (a listing of files) is in the order of their paths, so reading a run of samples sorted
    # by their listing positions reads them in file-system order (pack/read_order.py).
    listing_in_path_order = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.refs: Sequence[SampleRef] = []  # a list, or a lazy columnar view (ImageFolder's)
        self.classes: list[str] = []
        self.image_shape: tuple[int, int, int] | None = None  # known fixed (H, W, C), if any
        self.fields: list[FieldSpec] = []  # the samples' field schema (stager.manifest.fields); [] = image + label

    def describe(self) -> dict[str, Any]:
        """JSON-able provenance for the manifest's ``source`` field."""
        return {"kind": self.kind, "path": str(self.root)}

    def load_many(self, refs: Sequence[SampleRef]) -> list[Sample | BaseException]:
        """Materialise ``refs`` in order; a per-sample failure is returned as its exception."""
        out: list[Sample | BaseException] = []
        for r in refs:
            try:
                out.append(self.load(r))
            except (OSError, SourceError) as exc:
                out.append(exc)
        return out

    def load(self, ref: SampleRef) -> Sample:
        raise NotImplementedError

    def path_of(self, ref: SampleRef) -> str:
        """A human-readable location of ``ref`` for error messages."""
        return ref.locator

    def where_of(self, ref: SampleRef) -> str:
        """Where ``ref`` is described, for error messages about its fields (a list file's row, ...)."""
        return self.path_of(ref)

    def rel_of(self, ref: SampleRef) -> str:
        """Where ``ref`` came from, relative to the source (stored as the sample's ``source`` meta)."""
        return ref.locator

    def close(self) -> None:
        """Release cached handles (open readers, loaded batches)."""


def key_for(relpath: str) -> str:
    """``a/b.c.jpg`` -> ``a/b_c``: drop the extension, replace dots in the last component."""
    parts = relpath.replace(os.sep, "/").split("/")
    stem = parts[-1].rsplit(".", 1)[0] if "." in parts[-1] else parts[-1]
    parts[-1] = stem.replace(".", "_")
    return "/".join(p for p in parts if p not in ("", "."))


def unique_keys(keys: Iterable[str]) -> list[str]:
    """Make ``keys`` unique in order: a repeat gets the first free ``_<n>`` suffix (n = 1, 2, ...)."""
    seen: set[str] = set()
    out = []
    for k in keys:
        cand, n = k, 0
        while cand in seen:
            n += 1
            cand = f"{k}_{n}"
        seen.add(cand)
        out.append(cand)
    return out


def sniff_ext(data: bytes) -> str | None:
    """The image type of encoded bytes from their magic number (``jpg``, ``png``, ...), else None."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if data[:2] in (b"P5", b"P6"):
        return "ppm"
    return None


def file_ext(path: str) -> str:
    """The lower-case extension of ``path`` without its dot (``bin`` when it has none): the image type
    of a file whose bytes :func:`sniff_ext` does not recognise."""
    return Path(path).suffix.lower().lstrip(".") or "bin"


def read_file(path: str, size: int = -1) -> bytes:
    """The bytes of the file at ``path``; ``size`` (the listed size) lets one ``read`` get them all.

    Plain ``os.open``/``os.read``/``os.close``: a Python file object costs ~10 us more per file, which
    is a third of the whole per-sample budget on CIFAR-sized images. A file that grew since listing
    is read to its end.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        want = size + 1 if size >= 0 else 1 << 20
        data = os.read(fd, want)
        if len(data) < want:  # short read on a regular file: end of file
            return data
        parts = [data]
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)

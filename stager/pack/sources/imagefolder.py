"""``root/<class>/**/<image>`` trees (torchvision's ImageFolder rule), listed in parallel per class.

Samples are in relative-path order; a locator is the file's absolute path and a sample's
``source`` meta its path relative to the root. Listing stats every file (size and mtime enter
the plan); no image is opened.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path

from stager.errors import SourceError
from stager.formats.base import Sample
from stager.pack.sources.base import (
    IMAGE_EXTENSIONS,
    MapFn,
    SampleRef,
    Source,
    file_ext,
    read_file,
    sniff_ext,
    unique_keys,
)


class ImageFolderSource(Source):
    """``root/<class>/**/<image>``: class = top-level sub-folder, label = index in sorted names."""

    kind = "imagefolder"

    def __init__(self, root: Path, *, map_fn: MapFn | None = None) -> None:
        """List ``root``; ``map_fn`` (``map``-like, e.g. a process pool's) lists the class folders.

        Listing costs a ``stat`` per file (size and mtime for the plan); ``stager pack --workers N``
        passes its pool's ``map`` so that the folders are listed in parallel.
        """
        super().__init__(root)
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise SourceError(f"{root}: no class sub-folders; expected an ImageFolder tree root/<class>/<image>")
        self.classes = classes
        base = str(root)
        self._cut = len(base) + 1
        parts = list((map_fn or map)(list_class_folder, [(base, c, i) for i, c in enumerate(classes)]))
        locs: list[str] = []
        keys: list[str] = []
        labels: list[int] = []
        sizes: list[int] = []
        mtimes: list[int] = []
        for label, (p_locs, p_keys, p_sizes, p_mtimes) in enumerate(parts):
            locs += p_locs
            keys += p_keys
            labels += [label] * len(p_locs)
            sizes += p_sizes
            mtimes += p_mtimes
        # Samples are in relative-path order; class folders concatenated in name order almost always are.
        if sorted(locs) != locs:
            order = sorted(range(len(locs)), key=locs.__getitem__)
            locs, keys, labels, sizes, mtimes = ([c[i] for i in order] for c in (locs, keys, labels, sizes, mtimes))  # type: ignore[assignment]
        if len(set(keys)) != len(keys):
            keys = unique_keys(keys)
        # tuple.__new__ straight from C: SampleRef's Python-level __new__ would double the cost.
        self.refs = list(map(tuple.__new__, repeat(SampleRef), zip(keys, labels, locs, sizes, mtimes, strict=True)))

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        return Sample(ref.key, ref.label, data, sniff_ext(data) or file_ext(ref.locator), {"source": self.rel_of(ref)})

    def load_many(self, refs: Sequence[SampleRef]) -> list[Sample | BaseException]:
        out: list[Sample | BaseException] = []
        cut = self._cut
        for r in refs:
            loc = r.locator
            try:
                data = read_file(loc, r.size)
            except OSError as exc:
                out.append(exc)
                continue
            out.append(Sample(r.key, r.label, data, sniff_ext(data) or file_ext(loc), {"source": loc[cut:]}))
        return out

    def rel_of(self, ref: SampleRef) -> str:
        return ref.locator[self._cut :]


def list_class_folder(job: tuple[str, str, int]) -> tuple[list[str], list[str], list[int], list[int]]:
    """List one class folder ``(base, class name, label)``: ``(paths, keys, sizes, mtimes_ns)`` of its
    image files in relative-path order (keys not yet made unique across the source). Columns, not
    rows, so that a pool worker's answer pickles cheaply."""
    base, cls, label = job
    rows: list[tuple[str, int, int, int, str]] = []
    _walk_images(f"{base}/{cls}", cls, label, rows)
    rows.sort()
    return (
        [f"{base}/{r[0]}" for r in rows],
        [f"{r[0][: r[0].rfind('/')]}/{r[4]}" for r in rows],  # rel dir + stem (see key_for)
        [r[2] for r in rows],
        [r[3] for r in rows],
    )


def _walk_images(folder: str, rel: str, label: int, rows: list[tuple[str, int, int, int, str]]) -> None:
    """Append ``(relative path, label, size, mtime_ns, key stem)`` for each image file under ``folder``.

    Hidden entries are skipped. The key stem is the file name without its extension, dots replaced by
    ``_`` (what :func:`key_for` gives for the last component), computed here while the name is at hand.
    The folder is listed through a descriptor so that each ``stat`` resolves the name relative to it
    (``fstatat``) instead of walking the whole path again: ~1 us less per file.
    """
    try:
        dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise SourceError(f"{folder}: cannot list ({exc.strerror}); check permissions") from exc
    try:
        with os.scandir(dfd) as it:
            entries = sorted(it, key=lambda e: e.name)
        exts = IMAGE_EXTENSIONS
        for e in entries:
            name = e.name
            if name[0] == ".":
                continue
            dot = name.rfind(".")
            if dot > 0 and name[dot:].lower() in exts and e.is_file():
                st = e.stat()
                rows.append((f"{rel}/{name}", label, st.st_size, st.st_mtime_ns, name[:dot].replace(".", "_")))
            elif e.is_dir():
                _walk_images(f"{folder}/{name}", f"{rel}/{name}", label, rows)
    except OSError as exc:
        raise SourceError(f"{folder}: cannot list ({exc.strerror}); check permissions") from exc
    finally:
        os.close(dfd)

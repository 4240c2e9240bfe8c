"""Frame folders: ``root/<sequence>/<frame>.png|jpg`` (KITTI's ``image_02/0000/000000.png``), or
``root/<class>/<sequence>/<frame>`` with the class as the label (docs/clips.md).

A sequence's frames are its image files in name order; its key prefix is the sequence folder's
path relative to the root, so keys are ``[<class>/]<sequence>/<frame stem>`` and the sequence is
recoverable from a key. The source hands the pack plan ``groups`` (the sequence of each ref, refs
grouped by sequence in frame order) so that sequences are shuffled whole and their frames stay
contiguous and in order, and :meth:`FrameSource.clip_rows` the ``clip/seq`` and ``clip/frame``
columns of written keys.

Fields per frame (docs/clips.md, "Fields per frame"): a frame ``000000.png`` may have sidecars
grouped by stem as in the sidecar source (:mod:`~stager.pack.sources.sidecar`): ``000000.mask.png``,
``000000.boxes.json``, ... A file is a sidecar when the part of its name before the first dot is the
stem of a frame in the same folder and the rest is more than an image extension; a sidecar is never a
frame. Fields are named by their member (``mask.png`` -> ``mask``) and declared with ``--fields`` or
typed by extension (:func:`~stager.pack.sources.fieldvalues.infer_spec`). Every frame of every
sequence must have the same fields (a :class:`SourceError` names the first frame that differs).

Bad input, checked at listing: an empty root or sequence folder, a sequence shorter than one
window (``(T - 1) * D + 1`` frames), frames of different sizes in one sequence without ``--resize``
(read from the image headers). With ``on_error="skip"`` such a sequence is left out and listed in
:attr:`FrameSource.skipped`; otherwise a :class:`SourceError` names the folder.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stager.errors import SourceError
from stager.formats.base import Sample
from stager.manifest import ShardInfo
from stager.manifest.clips import FRAME_COLUMN, SEQ_COLUMN, ClipSpec
from stager.manifest.fields import FieldSpec, check_unique
from stager.pack.sources.base import IMAGE_EXTENSIONS, SampleRef, Source, file_ext, read_file, sniff_ext
from stager.pack.sources.fieldvalues import infer_spec, load_value
from stager.pack.sources.sidecar import member_field

FRAME_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg"})


class FrameSource(Source):
    """Base of clip sources: frames as files, grouped by sequence (``groups``, ``frame_numbers``)."""

    kind = "frames"

    def __init__(self, root: Path, spec: ClipSpec) -> None:
        super().__init__(root)
        self.spec = spec
        self.groups = np.zeros(0, np.int64)  # sequence number of each ref, (refs,)
        self.frame_numbers = np.zeros(0, np.int64)  # frame number of each ref in its sequence
        self.sequences: list[str] = []  # sequence names (key prefixes), by sequence number
        self.skipped: list[dict[str, str]] = []  # sequences left out under on_error="skip"
        self.encodes_frames = False  # frames already carry --resize/--quality (a decoded video)
        self.sidecars: dict[str, dict[str, str]] = {}  # frame path -> {field name: sidecar path}

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.root), "sequences": len(self.sequences)}

    def _add_sequences(self, seqs: list[tuple[str, int, list[tuple[str, str, int, int]]]]) -> None:
        """Append ``(name, label, [(frame stem, path, size, mtime_ns), ...])`` sequences as refs."""
        refs, groups, numbers = [], [], []
        for name, label, frames in seqs:
            g = len(self.sequences)
            self.sequences.append(name)
            for f, (stem, path, size, mtime) in enumerate(frames):
                refs.append(SampleRef(f"{name}/{stem}", label, path, size, mtime))
                groups.append(g)
                numbers.append(f)
        self.refs = refs
        self.groups = np.asarray(groups, dtype=np.int64)
        self.frame_numbers = np.asarray(numbers, dtype=np.int64)

    def refuse(self, where: str, problem: str, skip: bool) -> None:
        """A bad sequence: :class:`SourceError` naming ``where``, or (``skip``) listed in ``skipped``."""
        msg = f"{where}: {problem}"
        if not skip:
            raise SourceError(f"{msg}; fix or remove it, or use --on-error skip")
        self.skipped.append({"key": where, "path": where, "error": problem, "shard": ""})

    def clip_rows(self, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ``clip/seq`` and ``clip/frame`` columns (int32) of written ``keys``."""
        if not hasattr(self, "_row_of"):
            self._row_of = {r.key: i for i, r in enumerate(self.refs)}
        rows = np.fromiter((self._row_of[k] for k in keys), dtype=np.int64, count=len(keys))
        return self.groups[rows].astype(np.int32), self.frame_numbers[rows].astype(np.int32)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_row_of", "_cleanup")}

    def load(self, ref: SampleRef) -> Sample:
        data = read_file(ref.locator, ref.size)
        values: dict[str, Any] = {}
        if self.fields:
            side = self.sidecars[ref.locator]
            values = {s.name: load_value(s, side[s.name], self.root, ref.locator) for s in self.fields}
        return Sample(ref.key, ref.label, data, sniff_ext(data) or file_ext(ref.locator), {"source": ref.locator},
                      values)

    def rel_of(self, ref: SampleRef) -> str:
        return os.path.relpath(ref.locator, self.root)


class FrameFolderSource(FrameSource):
    """``root/<sequence>/<frame>`` or ``root/<class>/<sequence>/<frame>`` (see the module docstring)."""

    def __init__(self, root: Path, spec: ClipSpec, *, resize: tuple[int, int] | None = None,
                 skip_bad: bool = False, fields: Sequence[FieldSpec] = ()) -> None:
        super().__init__(root, spec)
        self._declared = {s.name: s for s in fields}
        top = _subdirs(str(root))
        if not top:
            raise SourceError(f"{root}: empty folder: no sequence folders (expected {root}/<sequence>/<frame>.png)")
        nested = not _frame_files(os.path.join(root, top[0]), {}) and bool(_subdirs(os.path.join(root, top[0])))
        if nested:
            self.classes = top
            pairs = [(f"{c}/{s}", label) for label, c in enumerate(top) for s in _subdirs(os.path.join(root, c))]
        else:
            self.classes = [root.name or "frames"]
            pairs = [(s, 0) for s in top]
        seqs = []
        for name, label in pairs:
            folder = os.path.join(root, name)
            frames = _frame_files(folder, self.sidecars)
            if not frames:
                self.refuse(folder, "empty sequence folder (no .png/.jpg frames)", skip_bad)
                continue
            if len(frames) < spec.span:
                self.refuse(folder, f"sequence has {len(frames)} frames, shorter than one window of {spec.span} "
                            f"(--clip-length {spec.length}, --frame-step {spec.frame_step})", skip_bad)
                continue
            if resize is None:
                problem = _mixed_sizes(frames)
                if problem:
                    self.refuse(folder, problem + "; pass --resize HxW", skip_bad)
                    continue
            seqs.append((name, label, frames))
        if not seqs:
            raise SourceError(f"{root}: no usable sequence ({len(self.skipped)} skipped)")
        self._add_sequences(seqs)
        self._field_schema()

    def _field_schema(self) -> None:
        """``fields`` from the frames' sidecars: declared, or typed by the first frame's files; every
        frame must have the same ones (SourceError naming the first frame that differs)."""
        sides = [self.sidecars.get(r.locator, {}) for r in self.refs]
        names = set(sides[0]) if sides else set()
        for ref, side in zip(self.refs, sides, strict=True):
            if set(side) != names:
                lacks, extra = sorted(names - set(side)), sorted(set(side) - names)
                what = f"lacks field(s) {', '.join(lacks)}" if lacks else f"has field(s) {', '.join(extra)}"
                raise SourceError(f"{ref.locator}: frame {what} that other frames do not; give every frame the "
                                  "same sidecar files")
        self.fields = [self._declared.get(n) or infer_spec(n, sides[0][n], self.root) for n in sorted(names)]
        check_unique(self.fields, str(self.root))


def _subdirs(folder: str) -> list[str]:
    with os.scandir(folder) as it:
        return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))


def _frame_files(folder: str, sidecars: dict[str, dict[str, str]]) -> list[tuple[str, str, int, int]]:
    """``(stem, path, size, mtime_ns)`` of the frames in ``folder``, in name order; each frame's
    sidecar files (``<stem>.<member>`` beside ``<stem>.<image ext>``) go to ``sidecars[frame path]``
    as ``{field name: path}`` and are not frames."""
    with os.scandir(folder) as it:
        files = sorted((e for e in it if not e.name.startswith(".") and e.is_file()), key=lambda e: e.name)
    # A frame proper: <stem>.<image ext> with no other dot; its stem claims <stem>.<anything else>.
    stems = {e.name.split(".", 1)[0]: e.path for e in files
             if e.name.count(".") == 1 and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS}
    out = []
    for e in files:
        stem, _, member = e.name.partition(".")
        frame = stems.get(stem)
        if frame is not None and frame != e.path:
            sidecars.setdefault(frame, {})[member_field(member)] = e.path
            continue
        ext = os.path.splitext(e.name)[1].lower()
        if ext not in IMAGE_EXTENSIONS:
            continue
        st = e.stat()
        out.append((e.name[: -len(ext)].replace(".", "_"), e.path, st.st_size, st.st_mtime_ns))
    return out


def _mixed_sizes(frames: list[tuple[str, str, int, int]]) -> str | None:
    """A message naming two frames of different sizes (from their headers), or None."""
    from PIL import Image  # noqa: PLC0415 (PIL only where images are read)

    first: tuple[int, int] | None = None
    for _stem, path, _size, _mtime in frames:
        try:
            with Image.open(path) as im:
                size = im.size
        except (OSError, SyntaxError, ValueError) as exc:
            return f"frame {path} cannot be read ({exc})"
        if first is None:
            first = size
        elif size != first:
            return f"mixed frame sizes in one sequence: {path} is {size[1]}x{size[0]}, {frames[0][1]} is " \
                   f"{first[1]}x{first[0]}"
    return None


def clip_shards(source: FrameSource, infos: list[ShardInfo]) -> tuple[list[ShardInfo], dict[str, Any]]:
    """The written shards with their ``clip/seq`` and ``clip/frame`` columns, and the manifest's
    ``clips`` entry (window parameters and counts)."""
    from stager.order.windows import find_windows  # noqa: PLC0415 (only clip packs count windows)

    out, seqs, frames = [], [], []
    for i in infos:
        seq, frame = source.clip_rows(list(i.keys))
        seqs.append(seq)
        frames.append(frame)
        out.append(ShardInfo(i.name, i.bytes, i.hash, i.keys, i.labels, i.offsets, i.sizes, i.aux, i.extents,
                             columns={**i.columns, SEQ_COLUMN: seq, FRAME_COLUMN: frame}))
    counts = np.array([i.samples for i in infos], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    seq_all = np.concatenate(seqs) if seqs else np.zeros(0, np.int32)
    frame_all = np.concatenate(frames) if frames else np.zeros(0, np.int32)
    spec = source.spec
    windows = find_windows(seq_all, frame_all, starts, length=spec.length, stride=spec.stride, step=spec.frame_step)
    fmt = spec.frame_format if source.encodes_frames else "source"
    entry = ClipSpec(spec.length, spec.stride, spec.frame_step, fmt, len(np.unique(seq_all)), windows.count)
    return out, entry.to_json()

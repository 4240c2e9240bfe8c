"""Video files (``.mp4 .avi .mkv .webm``, in ``root`` or in ``root/<class>/``), decoded once at pack time.

Each video is one sequence, named by its path relative to the root without the extension. Listing
decodes every video front to back with OpenCV's bundled FFmpeg (``cv2.VideoCapture``; frames in
decoded order, so a variable frame rate keeps its order and nothing ever seeks) and encodes each
frame as an image file: JPEG at ``quality`` (default 95) or PNG (``frame_format``), resized to
``resize`` (H, W) when given. The frames wait in a private temporary folder (``$STAGER_TMPDIR`` or
the system's), removed when the source is closed or collected; from there they are packed like a
frame folder (:class:`~stager.pack.sources.frames.FrameSource`), unchanged by the writer
(``encodes_frames``). Frame file sizes enter the plan; their mtime is the video's, so an unchanged
video gives the same plan on a rerun.

Bad input: a video that does not open, decodes to no frame, stops before the frame count its
container states (truncated), or changes frame size without ``resize``; or one with fewer frames than
one window. :class:`SourceError` naming the file, or under ``on_error="skip"`` the video is skipped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

from stager.errors import SourceError
from stager.manifest.clips import ClipSpec
from stager.pack.sources.base import MapFn
from stager.pack.sources.frames import FrameSource

VIDEO_EXTENSIONS = frozenset({".mp4", ".avi", ".mkv", ".webm", ".mov"})


def find_videos(root: Path) -> list[tuple[str, str]]:
    """``(relative path, class)`` of the videos under ``root`` (flat, or one level of class folders)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        depth = 0 if rel == "." else rel.count(os.sep) + 1
        if depth > 1:
            continue
        for f in sorted(filenames):
            if not f.startswith(".") and os.path.splitext(f)[1].lower() in VIDEO_EXTENSIONS:
                out.append((f if depth == 0 else f"{rel}/{f}", "" if depth == 0 else rel))
    return sorted(out)


class VideoSource(FrameSource):
    """Videos decoded into frame files at listing (see the module docstring)."""

    kind = "video"

    def __init__(self, root: Path, spec: ClipSpec, *, resize: tuple[int, int] | None = None,
                 quality: int | None = None, skip_bad: bool = False, map_fn: MapFn | None = None) -> None:
        super().__init__(root, spec)
        videos = find_videos(root)
        if not videos:
            raise SourceError(f"{root}: no video files ({', '.join(sorted(VIDEO_EXTENSIONS))})")
        self.encodes_frames = True
        self.tmp = tempfile.mkdtemp(prefix="stager-frames-", dir=os.environ.get("STAGER_TMPDIR") or None)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.tmp, True)
        classes = sorted({c for _, c in videos})
        self.classes = [c or (root.name or "videos") for c in classes]
        ext = "png" if spec.frame_format == "png" else "jpg"
        jobs = [(str(root / rel), os.path.join(self.tmp, f"v{i:06d}"), ext, quality, resize)
                for i, (rel, _c) in enumerate(videos)]
        try:
            results = list((map_fn or map)(decode_video, jobs))
        except BaseException:
            self.close()
            raise
        seqs = []
        for (rel, cls), (path, _d, _e, _q, _r), (frames, problem) in zip(videos, jobs, results, strict=True):
            if problem is None and len(frames) < spec.span:
                problem = (f"video has {len(frames)} frames, shorter than one window of {spec.span} "
                           f"(--clip-length {spec.length}, --frame-step {spec.frame_step})")
            if problem is not None:
                try:
                    self.refuse(path, problem, skip_bad)
                except SourceError:
                    self.close()
                    raise
                continue
            mtime = os.stat(path).st_mtime_ns
            name = os.path.splitext(rel)[0]
            seqs.append((name, classes.index(cls), [(stem, p, size, mtime) for stem, p, size in frames]))
        if not seqs:
            self.close()
            raise SourceError(f"{root}: no usable video ({len(self.skipped)} skipped)")
        self._add_sequences(seqs)

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["frame_format"] = self.spec.frame_format
        return d

    def close(self) -> None:
        cleanup = getattr(self, "_cleanup", None)
        if cleanup is not None:  # the listing process's copy only (workers get none)
            cleanup()


DecodeJob = tuple[str, str, str, int | None, tuple[int, int] | None]


def decode_video(job: DecodeJob) -> tuple[list[tuple[str, str, int]], str | None]:
    """Decode one video into ``folder`` as numbered image files: ``([(stem, path, size)], problem)``.

    ``job``: (video path, folder, "jpg" | "png", JPEG quality, (H, W) or None). ``problem`` is None or
    what is wrong (the frames decoded so far are then of no use).
    """
    # FFmpeg's own log lines ("moov atom not found") would precede stager's one-line error: quiet
    # (read when OpenCV first registers FFmpeg, so set before the first capture).
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")
    import cv2  # noqa: PLC0415 (OpenCV only where videos are decoded)

    path, folder, ext, quality, resize = job
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        return [], "cannot open video (unreadable, truncated or unsupported codec)"
    os.makedirs(folder, exist_ok=True)
    params = [cv2.IMWRITE_JPEG_QUALITY, quality or 95] if ext == "jpg" else [cv2.IMWRITE_PNG_COMPRESSION, 1]
    stated = int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0)
    frames: list[tuple[str, str, int]] = []
    shape = None
    try:
        while True:
            ok, bgr = cap.read()
            if not ok:
                break
            if resize is not None:
                bgr = cv2.resize(bgr, (resize[1], resize[0]), interpolation=cv2.INTER_AREA)
            elif shape is None:
                shape = bgr.shape
            elif bgr.shape != shape:
                return frames, (f"frame {len(frames)} is {bgr.shape[0]}x{bgr.shape[1]}, earlier frames "
                                f"{shape[0]}x{shape[1]}: mixed frame sizes; pass --resize HxW")
            ok, buf = cv2.imencode(f".{ext}", bgr, params)
            if not ok:
                return frames, f"frame {len(frames)} cannot be encoded"
            stem = f"{len(frames):06d}"
            out = os.path.join(folder, f"{stem}.{ext}")
            with open(out, "wb") as f:
                f.write(buf.tobytes())
            frames.append((stem, out, len(buf)))
    finally:
        cap.release()
    if not frames:
        return [], "no decodable frame (damaged or truncated video)"
    if stated > 0 and len(frames) < stated:
        return frames, f"truncated: decoded {len(frames)} of the {stated} frames its container states"
    return frames, None

"""The options of one pack: :class:`PackOptions`, checked once when built.

``pack(src, out, format, **keywords)`` builds one frozen :class:`PackOptions` from its keywords and
hands that object to every phase and, inside each :class:`~stager.pack.shard.ShardJob`, to the
shard writers (it pickles, so worker processes get it too). Invariant: a ``PackOptions`` that exists
is valid (``__post_init__`` raises :class:`UsageError` otherwise) and ``resize`` is ``None`` or an
``(H, W)`` tuple of positive ints. The format name is checked by the format registry
(:func:`stager.formats.get_format`), not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stager.checksum import ALGOS
from stager.errors import UsageError

ON_ERROR = ("raise", "skip")


@dataclass(frozen=True)
class PackOptions:
    """How to pack (every keyword of :func:`stager.pack.pack`, plus the format name).

    Output-affecting: ``format``, ``samples_per_shard``/``shard_size`` (a shard ends at whichever
    limit comes first), ``seed``/``keep_order`` (the sample order), ``resize`` (H, W) and ``quality``
    (re-encode), ``on_error`` (``raise`` or ``skip`` a bad sample), ``hash_algo``, ``tar_json`` (tar
    shards also hold a ``KEY.json`` member per sample; off by default: the manifest has what it
    held). Run-only:
    ``workers``, ``overwrite``, ``dry_run``, ``quiet``, ``stripe_count``/``stripe_size`` (Lustre
    layout of OUT), ``allow_empty_classes`` (keep an ImageFolder class folder without images),
    ``split`` (which CIFAR split to read), ``storage_options`` (opening a URL OUT, stager/fs/open.py).
    ``compression``: what the format's writer compresses with (one of its registry entry's
    ``compressions``; None: the format's default, set when built; formats without compression take none).
    """

    format: str = "tar"
    samples_per_shard: int | None = None
    shard_size: int | None = 256 << 20
    workers: int = 1
    seed: int = 0
    keep_order: bool = False
    resize: tuple[int, int] | None = None
    quality: int | None = None
    on_error: str = "raise"
    overwrite: bool = False
    dry_run: bool = False
    quiet: bool = True
    hash_algo: str = "xxh3_128"
    stripe_count: int | None = None
    stripe_size: int | None = None
    split: str | None = None
    tar_json: bool = False
    compression: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    fields: str | None = None  # --fields NAME:KIND,...: the list/sidecar source's field kinds (docs/fields.md)
    # Clips (docs/clips.md): a frame-folder or video source packed as frames of windows of
    # clip_length frames, frame_step apart, starting every clip_stride frames; videos' frames as
    # frame_format (jpg or png).
    clip_length: int | None = None
    clip_stride: int = 1
    frame_step: int = 1
    frame_format: str = "jpg"
    # An ImageFolder class folder without images is refused (torchvision's ImageFolder raises on one);
    # True keeps it as a class with no samples.
    allow_empty_classes: bool = False

    def __post_init__(self) -> None:
        """Raise :class:`UsageError` naming the first bad option; normalise ``resize`` to ints."""
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            raise UsageError(f"samples_per_shard must be >= 1, got {self.samples_per_shard}")
        if self.shard_size is not None and self.shard_size < 1:
            raise UsageError(f"shard_size must be >= 1 byte, got {self.shard_size}")
        if self.workers < 1:
            raise UsageError(f"workers must be >= 1, got {self.workers}")
        resize = self.resize
        if resize is not None and (len(resize) != 2 or min(resize) < 1):
            raise UsageError(f"resize must be (H, W) positive integers, got {resize!r}")
        if self.quality is not None and not 1 <= self.quality <= 100:
            raise UsageError(f"quality must be in 1..100, got {self.quality}")
        if self.on_error not in ON_ERROR:
            raise UsageError(f"on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        if self.hash_algo not in ALGOS:
            raise UsageError(f"unknown hash {self.hash_algo!r}; expected one of {', '.join(ALGOS)}")
        if resize is not None:
            object.__setattr__(self, "resize", (int(resize[0]), int(resize[1])))
        self._check_compression()
        if self.clip_length is not None:
            self.clip_spec()  # checks the clip options
        elif (self.clip_stride, self.frame_step) != (1, 1):
            raise UsageError("--clip-stride and --frame-step need --clip-length")

    def _check_compression(self) -> None:
        """``compression`` is one the format takes; None becomes the format's default (None if it has none)."""
        from stager.formats import FORMAT_NAMES, format_spec  # noqa: PLC0415 (the registry alone: stdlib only)

        allowed = format_spec(self.format).compressions if self.format in FORMAT_NAMES else ()
        if self.compression is None:
            object.__setattr__(self, "compression", allowed[0] if allowed else None)
        elif self.compression not in allowed:
            what = f"one of {', '.join(allowed)}" if allowed else "none: it writes no compressed data"
            raise UsageError(f"--compression {self.compression}: --format {self.format} takes {what}")

    def clip_spec(self) -> Any:
        """The :class:`~stager.manifest.clips.ClipSpec` of a clip pack, or None."""
        if self.clip_length is None:
            return None
        from stager.manifest.clips import ClipSpec  # noqa: PLC0415 (options stay import-light)

        return ClipSpec(self.clip_length, self.clip_stride, self.frame_step, self.frame_format)
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))  # a private copy

    def passes_through(self, target_kind: str) -> bool:
        """Whether source files are written unchanged: an encoded target without ``resize`` or ``quality``.

        Then a sample needs only the cheap structure check, and shard sizes are known before writing.
        """
        return target_kind == "encoded" and not self.resize and not self.quality

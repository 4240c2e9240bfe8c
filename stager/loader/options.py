"""``LoaderOptions``: every setting of :func:`stager.loader.make_loader` besides the path, validated once.

``make_loader(path, batch_size, **kw)`` is ``Loader(ShardedDataset(path, LoaderOptions(batch_size,
**kw)))``: the dataset reads the plan, storage and per-sample settings, the :class:`~stager.loader.Loader`
the worker-process ones (``num_workers``, ``pin_memory``, ``prefetch_factor``,
``multiprocessing_context``, ``timeout``, ``persistent_workers``). The prefetcher rebuilds a rank's
dataset from the plan arguments the rank reports (:meth:`LoaderOptions.from_kwargs`). Field meanings
and defaults: docs/loader.md.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from stager.errors import UsageError
from stager.order.composition import COMPOSITIONS
from stager.order.epoch import SHUFFLE_MODES

if TYPE_CHECKING:
    import numpy as np

DEFAULT_BUFFER_BYTES = 512 << 20


@dataclass(frozen=True)
class BoxFilter:
    """Which boxes survive a crop (``make_loader(box_filter=...)``): a box is kept when the part of it
    inside the output has width and height of at least ``min_side`` output pixels (and more than 0),
    an area of at least ``min_area`` square output pixels and at least ``min_visibility`` (0..1) of
    the box's own area. The defaults keep every box whose object is visible: torchvision's
    ``SanitizeBoundingBoxes(min_size=1, min_area=1)``, albumentations' ``min_visibility=0``. A crop
    that zooms into a large object keeps that object's box, however small a fraction of it shows."""

    min_side: float = 1.0
    min_area: float = 1.0
    min_visibility: float = 0.0

    def __post_init__(self) -> None:
        for name in ("min_side", "min_area", "min_visibility"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise UsageError(f"box_filter: {name} must be a number >= 0, got {v!r}")
        if self.min_visibility > 1:
            raise UsageError(f"box_filter: min_visibility is a fraction of the box's area (0..1), "
                             f"got {self.min_visibility!r}")

    @classmethod
    def of(cls, value: BoxFilter | Mapping[str, float] | None) -> BoxFilter:
        """``value`` as a filter: a BoxFilter, a mapping of its fields (``{"min_visibility": 0.3}``),
        or None (the defaults); UsageError naming an unknown key."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"min_side", "min_area", "min_visibility"})
            if unknown:
                raise UsageError(f"box_filter: unknown keys {unknown}; expected min_side, min_area, min_visibility")
            return cls(**value)
        raise UsageError(f"box_filter must be a BoxFilter, a dict of its fields or None, got {type(value).__name__}")

    def keep(self, mapped: np.ndarray, clipped: np.ndarray) -> np.ndarray:
        """bool (n,): which of the boxes survive; ``mapped`` (n, 4) xyxy in output pixels before
        clipping to the output, ``clipped`` after."""
        d = clipped[:, 2:] - clipped[:, :2]  # (n, 2): visible width and height
        area = d[:, 0] * d[:, 1]
        keep = (d > 0).all(axis=1) & (d >= self.min_side).all(axis=1) & (area >= self.min_area)
        if self.min_visibility > 0:
            keep &= area >= self.min_visibility * ((mapped[:, 2] - mapped[:, 0]) * (mapped[:, 3] - mapped[:, 1]))
        return keep


DEFAULT_BOX_FILTER = BoxFilter()


@dataclass(frozen=True)
class LoaderOptions:
    """The loader's settings (see :func:`stager.loader.make_loader` for each).

    ``num_workers=None`` (bare :class:`~stager.loader.ShardedDataset` only) takes the worker count
    from the DataLoader at iteration time. :attr:`mode` is ``shuffle`` as a shuffle-mode name.
    """

    batch_size: int
    rank: int | None = None
    world_size: int | None = None
    num_workers: int | None = 0
    seed: int = 0
    shuffle: bool | str = True
    decode: str = "uint8"
    transform: Any = None
    image_size: int = 224
    drop_last: bool = False
    on_error: str = "raise"
    pin_memory: bool = False
    prefetch_factor: int | None = None
    storage_options: dict[str, Any] | None = None
    staged: bool | str = "auto"
    staging_roots: tuple[str, ...] = ()
    run_bytes: int | str = "auto"
    min_run: int | None = None
    shuffle_buffer: int | None = None
    shuffle_buffer_bytes: int = DEFAULT_BUFFER_BYTES
    multiprocessing_context: Any = None
    timeout: float = 0
    use_mmap: bool = True
    persistent_workers: bool | None = None
    fields: tuple[str, ...] | None = None  # samples with fields: which to read (None: all); docs/fields.md
    box_filter: BoxFilter | Mapping[str, float] | None = None  # which cropped boxes survive (None: BoxFilter())
    composition: str | None = None  # a mix's batch composition (None: the mix's own); docs/loader.md, "Mixing"

    def __post_init__(self) -> None:
        if self.num_workers is not None and self.num_workers < 0:
            raise UsageError(f"num_workers must be >= 0, got {self.num_workers}")
        try:
            positive = operator.index(self.batch_size) >= 1
        except TypeError:
            positive = False
        if not positive:
            raise UsageError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.on_error not in ("raise", "skip"):
            raise UsageError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.mode not in SHUFFLE_MODES:
            raise UsageError(
                f"shuffle must be True, False or one of {', '.join(SHUFFLE_MODES)}, got {self.shuffle!r}"
            )
        object.__setattr__(self, "box_filter", BoxFilter.of(self.box_filter))
        if isinstance(self.fields, str):
            object.__setattr__(self, "fields", (self.fields,))
        elif self.fields is not None:
            object.__setattr__(self, "fields", tuple(self.fields))
        if self.composition is not None and self.composition not in COMPOSITIONS:
            raise UsageError(f"composition must be one of {', '.join(COMPOSITIONS)}, got {self.composition!r}")
        if self.run_bytes != "auto" and (not isinstance(self.run_bytes, int) or self.run_bytes < 1):
            raise UsageError(f"run_bytes must be a positive integer or 'auto', got {self.run_bytes!r}")

    @property
    def mode(self) -> str:
        """The shuffle mode: ``True`` is ``"runs"``, ``False`` is ``"none"``, a name is itself."""
        if isinstance(self.shuffle, bool):
            return "runs" if self.shuffle else "none"
        return self.shuffle

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any], **overrides: Any) -> LoaderOptions:
        """Options from ``make_loader``-style keyword arguments (e.g. a rank's reported plan arguments).

        ``overrides`` win over ``kwargs``. Unknown names are a :class:`UsageError` naming them.
        """
        merged = {**kwargs, **overrides}
        unknown = set(merged) - {f.name for f in fields(cls)}
        if unknown:
            raise UsageError(f"unknown loader arguments: {', '.join(sorted(unknown))}")
        if "batch_size" not in merged:
            raise UsageError("loader arguments lack batch_size")
        return cls(**merged)

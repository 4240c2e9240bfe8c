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
from typing import Any

from stager.errors import UsageError
from stager.order.composition import COMPOSITIONS
from stager.order.epoch import SHUFFLE_MODES

DEFAULT_BUFFER_BYTES = 512 << 20


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

"""Keras 3: ``model.fit`` over a stager loader, on any backend (torch, TensorFlow, JAX).

:class:`KerasBatches` is a ``keras.utils.PyDataset`` over a loader (by default a
:class:`~stager.loader.numpy_loader.NumpyLoader`: numpy batches, no torch needed), each batch dict
mapped to ``(x, y)`` by a :class:`~stager.loader.mapping.BatchMapping`. One Keras epoch is one
stager epoch (``len`` batches): the rank's share, shuffled by the loader's seed, in equal batch counts
on every rank, resumable through ``loader.state_dict()``.

The order is the loader's. Keras asks a PyDataset for batches by index, in a shuffled order with
``fit(shuffle=True)`` (its default), and before training it asks for one or two batches to learn their
shapes (the torch backend's build pass, the TensorFlow backend's tensor spec), which it asks for again
during the epoch. So an index's first request gets the loader's next batch, and the batches of the
first :data:`PEEK_KEEP` indices of a cycle are kept until asked for a second time. A cycle is the
Keras epochs (``on_epoch_begin``/``on_epoch_end``) until one has asked for ``len`` distinct indices;
then the next stager epoch begins. Each batch of an epoch is trained on once, and at an epoch's end
the loader's position (``loader.state_dict()``) is that epoch's end. Keras' own ``workers`` /
``use_multiprocessing`` stay off: the loader has its worker processes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import keras

from stager.loader.base import LoaderBase
from stager.loader.mapping import BatchMapping, Names

# Batches kept per cycle for Keras' repeated requests (it asks for at most 2 ahead of an epoch).
PEEK_KEEP = 4


class KerasBatches(keras.utils.PyDataset):
    """``loader``'s batches as ``(x, y)`` for ``model.fit``/``evaluate``/``predict`` (module docstring).

    ``x``, ``y``, ``fn``, ``x_dtype``: the mapping (:class:`~stager.loader.mapping.BatchMapping`); a
    name that is not a batch field is a one-line :class:`~stager.errors.UsageError` listing the fields.
    """

    def __init__(self, loader: LoaderBase, x: Names = "image", y: Names = "label", *, fn: Any = None,
                 x_dtype: str | None = "float32") -> None:
        super().__init__(workers=1, use_multiprocessing=False)
        self.mapping = BatchMapping(x, y, fn, x_dtype)
        self.mapping.check(loader.fields, "the Keras mapping")
        self.loader = loader
        self._it: Iterator[dict[str, Any]] | None = None
        self._served: set[int] = set()  # indices asked for in this cycle
        self._kept: dict[int, dict[str, Any]] = {}  # the batches of its first PEEK_KEEP indices, until asked again
        self._cycle_done = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def num_batches(self) -> int:
        return len(self.loader)

    def __getitem__(self, index: int) -> Any:
        with self._lock:  # Keras may call from a thread; the loader is one sequential stream
            batch = self._kept.pop(index, None)  # a batch Keras probed: its second request
            if batch is None:
                if index in self._served:  # asked again though not probed: Keras started over
                    self._kept, self._served = {}, set()
                batch = self._next()
                self._served.add(index)
                if len(self._served) <= PEEK_KEEP:
                    self._kept[index] = batch
        return self.mapping(batch)

    def on_epoch_begin(self) -> None:
        with self._lock:
            if self._cycle_done:
                self._kept, self._served, self._cycle_done = {}, set(), False

    def on_epoch_end(self) -> None:
        with self._lock:
            # A Keras epoch that asked for every index ends the cycle; the torch backend's build pass
            # (one request between its own begin and end) does not.
            self._cycle_done = len(self._served) >= len(self.loader)

    def _next(self) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:  # the stager epoch is over: the next pass is the next epoch
            self._it = iter(self.loader)
            return next(self._it)


def keras_batches(path: str | os.PathLike[str], batch_size: int, x: Names = "image", y: Names = "label", *,
                  fn: Any = None, x_dtype: str | None = "float32", **loader_settings: Any) -> KerasBatches:
    """:class:`KerasBatches` over a new numpy loader (``loader_settings``: :func:`~stager.loader.make_loader`'s)."""
    from stager.loader.numpy_loader import make_numpy_loader  # noqa: PLC0415 (multiprocessing only when used)

    return KerasBatches(make_numpy_loader(path, batch_size, **loader_settings), x, y, fn=fn, x_dtype=x_dtype)

"""``BatchMapping``: a batch dict as the ``(x, y)`` a Keras model or a tf.data pipeline wants.

Shared by :mod:`stager.loader.keras` and :mod:`stager.loader.tfdata`. ``x`` and ``y`` name batch
fields (``"image"``, ``"label"``, ``"index"``, ``"key"``), a tuple of names for several inputs, or
``y=None`` for inputs only; ``fn`` replaces the whole mapping (``fn(batch) -> (x, y)`` or ``x``).
Names are checked against the loader's fields when the mapping is made, so a typo is one line naming
the fields there are, not a KeyError deep inside ``model.fit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stager.errors import UsageError

Names = str | Sequence[str] | None


def field_names(spec: Names) -> list[str]:
    if spec is None:
        return []
    return [spec] if isinstance(spec, str) else list(spec)


@dataclass(frozen=True)
class BatchMapping:
    """Batch dict -> ``(x, y)`` (or ``x`` alone when ``y`` is None). ``x_dtype``: cast ``x`` arrays
    to it (e.g. ``"float32"``: Keras layers compute in floats; uint8 images stay 0-255)."""

    x: Names = "image"
    y: Names = "label"
    fn: Callable[[dict[str, Any]], Any] | None = None
    x_dtype: str | None = None

    def check(self, fields: Sequence[str], where: str = "the mapping") -> None:
        """Raise :class:`UsageError` naming a field of ``x``/``y`` that is not in ``fields``."""
        if self.fn is not None:
            return
        for name in field_names(self.x) + field_names(self.y):
            if name not in fields:
                raise UsageError(
                    f"{where} names the field {name!r}, which the dataset's batches lack; "
                    f"use one of {', '.join(sorted(fields))}"
                )
        if not field_names(self.x):
            raise UsageError(f"{where} needs at least one input field for x (one of {', '.join(sorted(fields))})")

    def _pick(self, batch: dict[str, Any], spec: Names, dtype: str | None) -> Any:
        arrays = [np.asarray(batch[n]) for n in field_names(spec)]
        if dtype is not None:
            arrays = [a.astype(dtype, copy=False) for a in arrays]
        return arrays[0] if isinstance(spec, str) else tuple(arrays)

    def __call__(self, batch: dict[str, Any]) -> Any:
        if self.fn is not None:
            return self.fn(batch)
        x = self._pick(batch, self.x, self.x_dtype)
        if self.y is None:
            return x
        return x, self._pick(batch, self.y, None)

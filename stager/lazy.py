"""A module imported on first use: what lets a command that never touches numpy not pay for it.

``stager stage`` reads a manifest and copies files; the manifest's modules name numpy at their top
because their sample index is numpy columns, but a plain stage never opens the index. Importing
numpy costs ~0.1 s of CPU (and its BLAS threads at exit): most of what `stager stage` of a small set
spent beyond `cp` (docs/benchmarks.md, "Staging small sets"). A module that needs numpy only inside
its functions binds it with :func:`on_first_use`::

    if TYPE_CHECKING:
        import numpy as np
    else:
        np = on_first_use("numpy", globals(), "np")

The first attribute read (``np.int64``) imports the module and rebinds the global name to it, so
every later use is the module itself: no proxy in a hot loop. Imports are thread-safe (the import
lock); two threads racing for the first use both bind the same module. A use at module level (a
type alias, a default argument) imports at once: keep those out of such modules.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _OnFirstUse:
    """Stands for module ``name`` in ``namespace[binding]`` until an attribute is read from it."""

    __slots__ = ("_binding", "_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any], binding: str) -> None:
        self._name = name
        self._namespace = namespace
        self._binding = binding

    def _load(self) -> ModuleType:
        module = importlib.import_module(self._name)
        self._namespace[self._binding] = module
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def on_first_use(name: str, namespace: dict[str, Any], binding: str) -> Any:
    """A stand-in for module ``name``, bound as ``namespace[binding]``, that imports the module and
    replaces itself there with it the first time an attribute is read (see the module docstring)."""
    return _OnFirstUse(name, namespace, binding)


__all__ = ["on_first_use"]

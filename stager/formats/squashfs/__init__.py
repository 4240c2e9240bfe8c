"""SquashFS images: read without mounting (:class:`SquashImage`), written by stager (:class:`SquashWriter`).

Modules: ``layout`` (on-disk structures and constants), ``compress`` (the compressor table, lazy
imports with install hints), ``meta`` (metadata blocks and tables), ``columns`` (vectorised byte
helpers), ``dirtable`` and ``inodes`` (bulk decoding), ``walk`` (the tree, level by level),
``listing`` (:class:`ImageListing`, :class:`Piece`), ``reader`` and ``writer``. docs/formats.md,
"squashfs", describes the layout stager writes and what a reader needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stager.formats.squashfs.compress import WRITE_NAMES

if TYPE_CHECKING:
    from stager.formats.squashfs.listing import ImageListing, Piece
    from stager.formats.squashfs.reader import SquashImage

# The reading side, imported on first use: writing an image (`stager pack`) never loads it.
_LAZY = {"ImageListing": "listing", "Piece": "listing", "SquashImage": "reader"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["WRITE_NAMES", "ImageListing", "Piece", "SquashImage"]

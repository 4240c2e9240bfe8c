"""SquashFS images: read without mounting (:class:`SquashImage`), written by stager (:class:`SquashWriter`).

Modules: ``layout`` (on-disk structures and constants), ``compress`` (the compressor table, lazy
imports with install hints), ``meta`` (metadata blocks and tables), ``columns`` (vectorised byte
helpers), ``dirtable`` and ``inodes`` (bulk decoding), ``walk`` (the tree, level by level),
``listing`` (:class:`ImageListing`, :class:`Piece`), ``reader`` and ``writer``. docs/formats.md,
"squashfs", describes the layout stager writes and what a reader needs.
"""

from __future__ import annotations

from stager.formats.squashfs.compress import WRITE_NAMES
from stager.formats.squashfs.listing import ImageListing, Piece
from stager.formats.squashfs.reader import SquashImage

__all__ = ["WRITE_NAMES", "ImageListing", "Piece", "SquashImage"]

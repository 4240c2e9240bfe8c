"""Shard formats behind one protocol (:mod:`stager.formats.base`), listed in one registry
(:mod:`stager.formats.registry`).

``get_format(name)`` returns the format object, importing its module on first use: reading tar shards
never imports h5py or zarr, and importing this package (what ``stager pack --help`` does for its
``--format`` choices) loads neither numpy nor any format module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stager.errors import UsageError
from stager.formats.registry import (
    ADOPTED_FORMATS,
    ALL_FORMATS,
    FIELD_FORMATS,
    FORMAT_NAMES,
    FORMAT_SPECS,
    FormatSpec,
    format_spec,
)

if TYPE_CHECKING:
    from stager.formats.base import Extent, Format, Sample, ShardReader, ShardWriter

__all__ = ["ADOPTED_FORMATS", "ALL_FORMATS", "FIELD_FORMATS", "FORMAT_NAMES", "FORMAT_SPECS", "Extent", "Format",
           "FormatSpec", "Sample", "ShardReader", "ShardWriter", "format_spec", "get_format", "get_writer_format"]

_BASE_NAMES = frozenset({"Extent", "Format", "Sample", "ShardReader", "ShardWriter"})  # loaded on first use


def __getattr__(name: str) -> Any:
    if name in _BASE_NAMES:
        return getattr(importlib.import_module("stager.formats.base"), name)
    raise AttributeError(f"module 'stager.formats' has no attribute {name!r}")


def get_writer_format(name: str) -> Format:
    """The format ``stager pack`` writes as ``name`` (one of :data:`FORMAT_NAMES`; not a read-only one)."""
    if name not in FORMAT_NAMES:
        raise UsageError(f"unknown format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    return get_format(name)


def get_format(name: str) -> Format:
    """The format registered as ``name`` (any of :data:`ALL_FORMATS`), its module imported on first use."""
    module = importlib.import_module(format_spec(name).module)
    fmt: Format = module.FORMAT
    return fmt

"""Shard formats behind one protocol (see :mod:`stager.formats.base`).

``get_format(name)`` returns the format object; modules are imported lazily so that, e.g., reading
tar shards never imports h5py or zarr.
"""

from __future__ import annotations

import importlib

from stager.errors import UsageError
from stager.formats.base import Extent, Format, Sample, ShardReader, ShardWriter

_MODULES = {"tar": "tar", "hdf5": "hdf5", "record": "record", "zarr": "zarr_format"}
FORMAT_NAMES = tuple(_MODULES)  # the formats `stager pack` writes
# Read-only formats: shards adopted in place by `stager index`, never written by stager.
_READ_ONLY = {"parquet": "parquet_format", "recordio": "recordio", "lmdb": "lmdb_format"}

__all__ = ["FORMAT_NAMES", "Extent", "Format", "Sample", "ShardReader", "ShardWriter", "get_format",
           "get_writer_format"]


def get_writer_format(name: str) -> Format:
    """The format ``stager pack`` writes as ``name`` (one of :data:`FORMAT_NAMES`; not a read-only one)."""
    if name not in _MODULES:
        raise UsageError(f"unknown format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    return get_format(name)


def get_format(name: str) -> Format:
    """Return the format registered as ``name`` (one of :data:`FORMAT_NAMES`, or read-only ``parquet``)."""
    mod = _MODULES.get(name) or _READ_ONLY.get(name)
    if mod is None:
        raise UsageError(f"unknown format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    module = importlib.import_module(f"{__name__}.{mod}")
    fmt: Format = module.FORMAT
    return fmt

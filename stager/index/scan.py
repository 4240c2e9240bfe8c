"""What indexing one shard yields (:class:`ShardScan`) and how a shard is read once (:func:`mapped`).

Every input kind maps the shard file, hashes all of it (one sequential pass: the only time its data
pages are read) and parses the container's headers from the same mapping, whose pages are then in
the page cache. The scan keeps labels *raw* (an int, a class name, or None for unlabeled) because
class names are only known once every shard is scanned; :mod:`stager.index.api` maps them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stager.checksum import new_hasher
from stager.errors import CorruptSampleError, ShardMissingError

HASH_CHUNK = 8 << 20  # bytes hashed per call: large enough to run at memory bandwidth


class DamagedShardError(CorruptSampleError):
    """A shard that cannot be indexed as it is (damaged, truncated, a sample split across shards):
    exit 3, like every other finding of damaged data (a ``CorruptSampleError`` for Python callers)."""

    exit_code = 3


@dataclass
class ShardScan:
    """One indexed shard: identity, integrity and its samples in physical order.

    ``labels`` holds raw labels (int, str class name, or None), or, with ``label_names`` set, an int64
    array of indices into ``label_names`` (-1: unlabeled: a scanner that knows its classes as columns,
    SquashFS); ``keys`` is a list or a :class:`~stager.manifest.table.Strings` column, ``offsets``/``sizes``
    lists or int64 arrays (a million-file image is indexed without a Python object per sample); they locate each
    image's bytes in the file (``extents == "bytes"``) or, for compressed parquet pages, ``offsets``
    are rows in the file (``"rows"``). ``classes`` are class names the shard itself declares (parquet's
    Hugging Face metadata), ``records`` the DALI index lines of a TFRecord file, ``(offset, size)``,
    or of a RecordIO file, ``(key, offset)``. ``companion``: an index file beside the shard that the
    scan checked against it (a RecordIO ``.idx``), staged with it. ``sample_kind``: ``encoded`` image
    bytes, or ``decoded`` raw pixels (Caffe's unencoded Datums). ``columns``: extra per-sample values
    (JSON lists of length ``samples``): ``label_values`` (RecordIO array labels, float lists) and
    ``shape`` (raw Datums, ``[C, H, W]``), and the index columns of adopted fields (``field/<name>/offset``,
    ``.../size``, ``field/<name>``: :mod:`stager.index.fields`), whose schema is ``field_specs``.
    """

    name: str
    bytes: int
    hash: str
    mtime_ns: int
    keys: list[str] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    extents: str = "bytes"
    classes: list[str] | None = None
    records: list[tuple[int, int]] | None = None
    # tar: incomplete samples (no image) at the shard's start (0) or end (1): (edge, key, fields)
    edges: list[tuple[int, str, str]] = field(default_factory=list)
    companion: str | None = None
    sample_kind: str = "encoded"
    columns: dict[str, list[Any]] = field(default_factory=dict)
    field_specs: list[dict[str, Any]] = field(default_factory=list)  # stager.index.fields: the fields' schema
    label_names: list[str] | None = None
    keys_unique: bool = False  # the scanner checked that no key repeats within the shard

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for k in ("keys", "labels", "offsets", "sizes"):
            v = out[k]
            out[k] = v.tolist() if isinstance(v, np.ndarray) else v if isinstance(v, list) else list(v)
        return out

    def raw_labels(self) -> list[Any]:
        """``labels`` as raw values (ints, class names, None), whichever way the scanner kept them."""
        if self.label_names is None:
            return list(self.labels)
        names = self.label_names
        return [None if i < 0 else names[i] for i in np.asarray(self.labels).tolist()]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardScan:
        d = dict(d)
        if d.get("records") is not None:
            d["records"] = [tuple(r) for r in d["records"]]
        d["edges"] = [tuple(e) for e in d.get("edges", [])]
        return cls(**d)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.offsets, dtype=np.int64), np.asarray(self.sizes, dtype=np.int64)


@contextlib.contextmanager
def mapped(path: str, algo: str) -> Iterator[tuple[memoryview, str, os.stat_result]]:
    """``(read-only view of the whole file, its hash with algo, its stat)``; the file is read once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise ShardMissingError(f"{path}: no such shard") from exc
    try:
        st = os.fstat(fd)
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) if st.st_size else None
    finally:
        os.close(fd)
    view = memoryview(mm) if mm is not None else memoryview(b"")
    try:
        if mm is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                mm.madvise(mmap.MADV_SEQUENTIAL)
        h = new_hasher(algo)
        for i in range(0, len(view), HASH_CHUNK):
            h.update(view[i : i + HASH_CHUNK])
        yield view, h.hexdigest(), st
    finally:
        # An error raised mid-parse may still hold slices (in its traceback): the mapping then goes
        # away with the last of them.
        with contextlib.suppress(BufferError):
            view.release()
            if mm is not None:
                mm.close()

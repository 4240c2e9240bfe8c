"""Index an LMDB environment (its ``data.mdb``): Caffe ``Datum`` values or pickled ``(image, label)`` tuples.

The file is mapped and hashed once, its B-tree walked by :mod:`stager.formats.lmdb_pages` (every
value's byte range in ``data.mdb``), and each value parsed by its layout
(:mod:`stager.formats.lmdb_values`: ``caffe`` or ``pickle``, sniffed, or ``--lmdb-layout``). The
manifest extent of a sample is the byte range of its image bytes inside ``data.mdb``: the loader
reads it like a tar member, and never opens the environment with liblmdb (no lock file, nothing to
keep across a fork). The walk is cross-checked against liblmdb itself through py-lmdb (the
``stager[lmdb]`` extra): same keys in the same order, same value sizes and edges, opened read-only
without a lock (``lock=False``), as the only LMDB handle stager ever opens.

Keys are the LMDB keys (UTF-8; Caffe's ``%08d_<path>``); folder2lmdb's ``__keys__``/``__len__`` entries
are bookkeeping, not samples (``__len__`` must match the count). Labels (``label_key``, default
``label``): the Datum's ``label``, or the tuple's second item; ``none``: unlabeled. Raw Datums are
``sample_kind: "decoded"`` with their ``(C, H, W)`` in the ``shape`` column.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from stager.errors import MissingBackendError, UsageError, install_hint
from stager.formats.lmdb_pages import LmdbError, walk
from stager.formats.lmdb_values import LAYOUTS, META_KEYS, BadValueError, Value, decode_len, parse_value, sniff_layout
from stager.index.scan import DamagedShardError, ShardScan, mapped

EDGE = 16  # bytes compared at each end of every value against liblmdb's copy


def import_lmdb() -> Any:
    try:
        return importlib.import_module("lmdb")
    except ImportError as exc:
        raise MissingBackendError(f"indexing LMDB needs py-lmdb (not installed); run: {install_hint('lmdb', 'lmdb')}"
                                  ) from exc


def scan_lmdb(path: str, name: str, image_key: str | None, label_key: str | None, algo: str, *,
              layout: str = "auto") -> ShardScan:
    """Index one ``data.mdb`` (see the module docstring); raises a one-line error naming the file and key."""
    lmdb = import_lmdb()
    if image_key:
        raise UsageError(f"{path}: --image-key does not apply to LMDB (pass --lmdb-layout caffe|pickle)")
    if label_key not in (None, "label"):
        raise UsageError(f"{path}: unknown --label-key {label_key!r} for LMDB; expected label or none")
    if layout not in LAYOUTS:
        raise UsageError(f"unknown --lmdb-layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    with mapped(path, algo) as (view, digest, st):
        out = ShardScan(name, st.st_size, digest, st.st_mtime_ns)
        try:
            entries = list(walk(view, path))
        except LmdbError as exc:
            raise DamagedShardError(str(exc)) from exc
        _cross_check(lmdb, path, view, entries)
        if layout == "auto":
            first = next((bytes(view[o : o + n]) for k, o, n in entries if k not in META_KEYS), b"")
            layout = sniff_layout(first, {k for k, _, _ in entries[:1] + entries[-2:]})
        _samples(out, view, entries, layout=layout, label_key=label_key, path=path)
    return out


def _samples(out: ShardScan, view: memoryview, entries: list[tuple[bytes, int, int]], *, layout: str,
             label_key: str | None, path: str) -> None:
    shapes: list[list[int]] = []
    declared: int | None = None
    for key, off, size in entries:
        if layout == "pickle" and key in META_KEYS:
            if key == b"__len__":
                declared = decode_len(bytes(view[off : off + size]))
            continue
        try:
            v: Value = parse_value(view[off : off + size], layout)
        except BadValueError as exc:
            raise DamagedShardError(f"{path}: key {_show(key)}: not a {layout} value ({exc}); the data.mdb is damaged "
                                    "or of another layout (--lmdb-layout)") from exc
        if shapes and (v.shape is None) != (not shapes[-1]):
            raise DamagedShardError(f"{path}: key {_show(key)}: mixes encoded and raw Datums; stager reads one kind "
                                    "per LMDB")
        out.keys.append(key.decode("utf-8", "replace"))
        out.offsets.append(off + v.offset)
        out.sizes.append(v.size)
        out.labels.append(v.label if label_key is not None else None)
        shapes.append(list(v.shape) if v.shape is not None else [])
    if declared is not None and declared != len(out.keys):
        raise DamagedShardError(f"{path}: __len__ says {declared} samples but the LMDB holds {len(out.keys)}; "
                                "the data.mdb is damaged or was written partly")
    if shapes and shapes[0]:
        out.sample_kind = "decoded"
        out.columns = {"shape": shapes}


def _cross_check(lmdb: Any, path: str, view: memoryview, entries: list[tuple[bytes, int, int]]) -> None:
    """liblmdb must list the same keys, in the same order, with the same value sizes and edge bytes."""
    try:
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=False, meminit=False,
                        max_readers=1, max_dbs=0)
    except lmdb.Error as exc:
        raise DamagedShardError(f"{path}: liblmdb cannot open it ({exc}); not an LMDB data.mdb, or damaged") from exc
    try:
        with env.begin(buffers=True) as txn:
            it: Iterator[tuple[Any, Any]] = iter(txn.cursor())
            for i, (key, off, size) in enumerate(entries):
                got = next(it, None)
                if got is None:
                    raise DamagedShardError(f"{path}: key {_show(key)}: liblmdb lists only {i} entries; the data.mdb "
                                            "is damaged")
                k, v = got
                if bytes(k) != key or len(v) != size or bytes(v[:EDGE]) != bytes(view[off : off + min(EDGE, size)]) \
                        or bytes(v[-EDGE:]) != bytes(view[off + size - min(EDGE, size) : off + size]):
                    raise DamagedShardError(f"{path}: entry {i} (key {_show(key)}): stager's page walk disagrees with "
                                            f"liblmdb (key {_show(bytes(k))}, {len(v)} bytes); please report this LMDB")
            if next(it, None) is not None:
                raise DamagedShardError(f"{path}: liblmdb lists more than the {len(entries)} entries found; please "
                                        "report this LMDB")
    except lmdb.Error as exc:
        raise DamagedShardError(f"{path}: liblmdb cannot read it ({exc}); the data.mdb is damaged") from exc
    finally:
        env.close()


def _show(key: bytes) -> str:
    return repr(key[:80].decode("utf-8", "replace"))

"""The manifest: the contract between ``pack``, ``stage``, the loader and ``verify``.

A packed directory holds shard files, one sample index file and ``manifest.json``, written last and
atomically. The manifest (schema ``stager.manifest/2``) lists every shard with its size, sample
count and checksum, the dataset's schema (classes, fields, clips) and its sample index file; it
grows with shards, not samples. The per-sample index (key, label, byte offset, byte length, and
the extra columns of fields and clips) is a columnar table file (:mod:`stager.manifest.samples`)
that readers map, so that they can partition exactly and read runs of samples with one ``pread``
without parsing the container, and so that ranks and workers on a node share its pages.
docs/formats.md is the normative description; this package is its only reader and writer. v1
manifests (the index inline as JSON lists) are still read.

Per-sample ``offsets``/``sizes`` locate the *encoded image payload* inside the shard file:

* tar: the data of the ``<key>.<ext>`` image member;
* record: the ``image/encoded`` bytes inside the record's ``tf.train.Example`` payload;
* hdf5: the sample's slice of the contiguous ``images`` dataset (file offset of the dataset plus
  the in-array offset);
* zarr: decoded images; ``offsets`` is the row inside the shard's ``images`` array and ``sizes`` is
  ``H*W*C``.

The manifest carries a ``digest`` over its own canonical JSON (which names the index file's hash),
so that a damaged manifest (a flipped digit) is refused instead of silently misleading every reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import xxhash

from stager import __version__
from stager.checksum import ALGOS, DEFAULT_ALGO, new_hasher
from stager.errors import ManifestError, NotAPackError, ShardMissingError, UnsafeArchiveError
from stager.formats.registry import ALL_FORMATS, FORMAT_SPECS
from stager.fs.atomic import PARTIAL_SUFFIX, atomic_write_bytes, partial_path
from stager.fs.open import is_url, join, read_bytes
from stager.fs.safe import open_exclusive, open_regular
from stager.fs.writeback import start_writeback
from stager.lazy import on_first_use
from stager.manifest.fields import sample_fields, specs_from_json
from stager.manifest.samples import (
    INDEX_PARTIAL_BASE,
    LABEL,
    OFFSET,
    SIZE,
    SampleIndex,
    index_file_name,
    is_index_file_name,
)
from stager.manifest.shard import AuxFile, ShardInfo, table_columns
from stager.manifest.table import Column, Ragged, Strings, Table, open_table, parse_table, write_table
from stager.redact import redact

if TYPE_CHECKING:
    import numpy as np
else:  # the index is numpy columns; a plain stage never opens it: no numpy (stager/lazy.py)
    np = on_first_use("numpy", globals(), "np")

SCHEMA = "stager.manifest/2"
SCHEMA_V1 = "stager.manifest/1"  # read, never written: the per-sample index inline as JSON lists
MANIFEST_NAME = "manifest.json"
FORMATS = ALL_FORMATS  # every registered format (stager.formats.registry); read-only ones from `stager index`
# Fields left out of the digest: ``digest`` itself, and ``shard_root`` (where the shards live is not
# what they are: a staged copy drops it and keeps the digest, so receipts still match).
_UNDIGESTED = ("digest", "shard_root")
MAX_MANIFEST_BYTES = 4 << 30  # refuse absurd manifests before parsing them
MAX_DEPTH = 64  # deepest nesting of a manifest's JSON (ours: a few levels); deeper would exhaust the recursion
MAX_COUNT = (1 << 63) - 1  # bytes and sample counts: what int64 holds

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")
RECEIPT_NAME = "stager-receipt.json"  # a staged copy's receipt (stager.receipt), reserved here
UNPACK_DIR_NAME = "unpacked"  # the default directory of `stage --unpack` (stager.stage.options)
# Names stager itself writes beside a manifest's files, so a manifest may not list them: a shard
# called ``stager-receipt.json`` would be a forged receipt once staged. Hidden names (the journal,
# the lock, done markers, ``.stager-pack``) are already refused by the plain-name rule, and
# ``<name>.<12 hex>.partial`` by :data:`stager.fs.atomic.PARTIAL_SUFFIX`.
MIX_RECEIPT_NAME = "stager-mix.json"  # a staged mix's receipt (stager.stage.mix): DEST/<stream> per stream
RESERVED_NAMES = frozenset({MANIFEST_NAME, MIX_RECEIPT_NAME, RECEIPT_NAME, UNPACK_DIR_NAME})
PACK_STATE_NAME = ".stager-pack"  # OUT's state directory while a pack runs (stager.pack.state.STATE_DIR)
NAME_MAX_BYTES = 255  # the longest file name Linux file systems take, in bytes (NAME_MAX)
# What a name from the data may not hold: NUL and control characters (C0, DEL, C1), and lone surrogates
# (bytes that are not UTF-8, decoded with surrogateescape).
BAD_NAME_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
# The state directories of an unfinished run, which writes the manifest last (stager.index.discover.STATE_DIR
# is held equal by a test), and the command that finishes it: `not_a_pack`.
UNFINISHED_STATE = {PACK_STATE_NAME: "stager pack", ".stager-index": "stager index"}


def check_safe_name(name: object, what: str = "shard name") -> str:
    """Return ``name`` if it is a plain file name (no separators, no ``..``, no hidden/odd chars).

    Manifest entries become paths under a destination; anything that could escape it is refused.
    """
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", "..") or ".." in name:
        raise UnsafeArchiveError(
            f"unsafe {what} {name!r}: expected a plain file name (letters, digits, '._+-', no path separators)"
        )
    return name


def entry_name_problem(name: object) -> str | None:
    """Why ``name`` may not become one directory entry that stager creates from the data (a class
    folder, an unpacked sample file), or None when it may.

    The rule (docs/pack.md, "Names"): any name a file system takes, spaces and every script's letters
    included, except one that is empty, ``.`` or ``..``, holds a ``/`` (a separator) or NUL, holds a
    control character (it garbles terminals, logs and ``ls``), is not valid UTF-8 (the manifest is JSON
    text, and other tools read the names as text), or is longer than 255 bytes in UTF-8.
    """
    if not isinstance(name, str) or not name:
        return "empty"
    if name in (".", ".."):
        return f"{name!r} names a directory itself"
    if "/" in name:
        return "holds a path separator '/'"
    bad = BAD_NAME_CHARS.search(name)
    if bad is not None:
        ch = bad.group()
        what = "is not valid UTF-8" if "\ud800" <= ch <= "\udfff" else f"holds the control character {ch!r}"
        return what
    if len(name.encode()) > NAME_MAX_BYTES:
        return f"is longer than {NAME_MAX_BYTES} bytes"
    return None


def check_entry_name(name: object, what: str = "class name") -> str:
    """Return ``name`` if it may become a directory entry (:func:`entry_name_problem`); else
    :class:`UnsafeArchiveError` (exit 3) naming it. The one rule for class folders and unpacked sample
    files, applied by ``stager pack`` (the listing) and ``stage --unpack`` alike."""
    why = entry_name_problem(name)
    if why is not None:
        raise UnsafeArchiveError(f"unsafe {what} {name!r}: {why}; rename it (a name may hold any letter and spaces, "
                                 "not '/', NUL or control characters) and re-pack")
    return name  # type: ignore[return-value]


UNLABELED = "_unlabeled"  # the class folder of unlabeled samples in an unpacked tree


def class_dir_name(classes: Sequence[str], label: int) -> str:
    """The class folder sample ``label`` unpacks into (unchecked: :func:`check_entry_name` it)."""
    return UNLABELED if label == -1 or not classes or not 0 <= label < len(classes) else classes[label]


def unpacked_stem(key: str, class_name: str) -> str:
    """The file name (without extension) a sample unpacks to inside its class folder.

    The key minus a leading ``<class>/`` (ImageFolder keys keep their original file names), with
    any further ``/`` turned into ``_`` so keys that differ only by a directory (CIFAR's
    ``data_batch_1/00006`` and ``data_batch_2/00006``) stay distinct files.
    """
    prefix = class_name + "/"
    if key.startswith(prefix):
        key = key[len(prefix) :]
    return key.replace("/", "_")


def _redacted(value: Any) -> Any:
    """``value`` (JSON-like) with every string location passed through :func:`stager.redact.redact`."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


def check_file_name(name: object, what: str = "shard name") -> str:
    """:func:`check_safe_name`, and not one of stager's own names (:data:`RESERVED_NAMES`, ``*.partial``):
    the rule for every file a manifest lists (shards, companion files, the sample index)."""
    name = check_safe_name(name, what)
    if name in RESERVED_NAMES or name.endswith(PARTIAL_SUFFIX):
        raise UnsafeArchiveError(
            f"{what} {name!r} is reserved for stager's own files ({', '.join(sorted(RESERVED_NAMES))}, "
            "*.partial); rename the file and re-pack or re-index"
        )
    return name


@dataclass(frozen=True)
class IndexRef:
    """The manifest's entry for its sample index file (v2): name, exact size, hash (``hash_algo``)."""

    name: str
    bytes: int
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "hash": self.hash}


@dataclass
class Manifest:
    """A packed dataset: format, classes, shards and provenance.

    ``sample_kind`` is ``"encoded"`` (image files' bytes: tar, hdf5, record) or ``"decoded"``
    (fixed-shape uint8 arrays: zarr, with ``image_shape`` = (H, W, C)). ``fields`` describes
    samples with several fields and ``clips`` windows of consecutive frames (both: the schema of
    extra index columns; empty/None for one image and a label). ``index``: the sample index file
    (set once written or read; None for a manifest read from a v1 file, whose shards hold their arrays).
    """

    format: str
    classes: list[str]
    shards: list[ShardInfo]
    source: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    hash_algo: str = DEFAULT_ALGO
    sample_kind: str = "encoded"
    image_shape: tuple[int, int, int] | None = None
    skipped: list[dict[str, str]] = field(default_factory=list)
    stager_version: str = __version__
    created: str = ""
    digest: str = ""
    # Where the shard files live when not beside the manifest (``stager index --out``): an absolute
    # path or a URL of their directory. Not part of the digest (see ``_UNDIGESTED``).
    shard_root: str | None = None
    fields: list[dict[str, Any]] = field(default_factory=list)
    clips: dict[str, Any] | None = None
    index: IndexRef | None = None
    schema: str = SCHEMA
    samples_index: SampleIndex | None = field(default=None, repr=False, compare=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        """Bytes of the data files: shards and their companion files (the sample index not counted)."""
        return sum(s.bytes + sum(a.bytes for a in s.aux) for s in self.shards)

    @property
    def copy_bytes(self) -> int:
        """Bytes a full copy of the dataset stores: :attr:`num_bytes` plus the sample index."""
        return self.num_bytes + (self.index.bytes if self.index else 0)

    @property
    def shard_bytes(self) -> np.ndarray:
        """int64 (shards,): each shard's bytes with its companion files (what a node holding it stores)."""
        return np.array([s.bytes + sum(a.bytes for a in s.aux) for s in self.shards], dtype=np.int64)

    def files(self) -> Iterator[tuple[str, int, str]]:
        """Every file of the dataset except the manifest: ``(name, bytes, hash)``, shards first, the
        sample index last."""
        for s in self.shards:
            yield s.name, s.bytes, s.hash
            for a in s.aux:
                yield a.name, a.bytes, a.hash
        if self.index is not None:
            yield self.index.name, self.index.bytes, self.index.hash

    def shard_of_sample(self) -> np.ndarray:
        """int64 array of length ``num_samples``: the shard index of each global sample index."""
        counts = np.array([s.samples for s in self.shards], dtype=np.int64)
        return np.repeat(np.arange(len(self.shards), dtype=np.int64), counts)

    def sample_starts(self) -> np.ndarray:
        """int64 array of length ``len(shards)+1``: global index of each shard's first sample."""
        counts = np.array([s.samples for s in self.shards], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def indexed(self) -> bool:
        """True for a manifest written by ``stager index`` (the shards are someone else's files)."""
        return self.source.get("kind") == "index"

    @property
    def dataset_id(self) -> str:
        """A short, stable identifier of this exact dataset (first 16 hex digits of the digest)."""
        return (self.digest or self.compute_digest())[:16]

    # ---- the dataset-wide per-sample columns -------------------------------------------------
    @property
    def keys(self) -> Sequence[str]:
        """Every sample's key in manifest order (mapped, decoded on access, for a loaded v2 manifest)."""
        if self.samples_index is not None:
            return self.samples_index.keys
        out: list[str] = []
        for s in self.shards:
            out.extend(s.keys)
        return out

    def column(self, name: str) -> np.ndarray:
        """A core int64 column (``"label"``, ``"offset"``, ``"size"``) over all samples, shape (N,): a
        view of the mapped index for a loaded v2 manifest, else concatenated from the shards."""
        if self.samples_index is not None:
            return self.samples_index.table.array(name)
        attr = {LABEL: "labels", OFFSET: "offsets", SIZE: "sizes"}[name]
        arrs = [getattr(s, attr) for s in self.shards]
        return np.concatenate(arrs).astype(np.int64, copy=False) if arrs else np.zeros(0, np.int64)

    def extra_columns(self) -> dict[str, Column]:
        """The extra per-sample columns (fields, clips) over all samples, by name."""
        if self.samples_index is not None:
            return dict(self.samples_index.extra())
        if not self.shards:
            return {}
        out: dict[str, Column] = {}
        for n in self.shards[0].columns:
            parts = [s.columns[n] for s in self.shards]
            if isinstance(parts[0], Strings):
                out[n] = Strings(Ragged.concat([p.raw for p in parts]))  # type: ignore[union-attr]
            elif isinstance(parts[0], Ragged):
                out[n] = Ragged.concat(parts)  # type: ignore[arg-type]
            else:
                out[n] = np.concatenate(parts)  # type: ignore[arg-type]
        return out

    def detached(self) -> Manifest:
        """A copy whose shards hold writable in-memory copies of their per-sample data (no mapping,
        no index file needed): for rewriting a manifest (tools, repairs, tests that damage one)."""
        shards = []
        for s in self.shards:
            cols = {n: _copy_column(c) for n, c in s.columns.items()}
            keys = _copy_column(s.keys) if isinstance(s.keys, Strings) else list(s.keys)
            shards.append(ShardInfo(s.name, s.bytes, s.hash, keys, s.labels.copy(), s.offsets.copy(),
                                    s.sizes.copy(), list(s.aux), s.extents, columns=cols))
        return dataclasses.replace(self, shards=shards, samples_index=None)

    # ---- serialisation -------------------------------------------------------------------
    def _body(self) -> dict[str, Any]:
        if self.index is None:
            # A caller's bug, never bad input: not a StagerError, so no CLI reports it as the user's error.
            raise RuntimeError("internal error: a manifest's body (digest, dataset_id, to_bytes) needs its sample "
                               "index written first (Manifest.write_index)")
        return {
            "schema": SCHEMA,
            "stager_version": self.stager_version,
            "created": self.created,
            "format": self.format,
            "sample_kind": self.sample_kind,
            "image_shape": list(self.image_shape) if self.image_shape else None,
            "hash_algo": self.hash_algo,
            "classes": list(self.classes),
            "fields": list(self.fields),
            "clips": self.clips,
            "source": self.source,
            "options": self.options,
            "totals": {
                "samples": self.num_samples,
                "shards": len(self.shards),
                "bytes": self.num_bytes,
                "skipped": len(self.skipped),
            },
            "skipped": self.skipped,
            "index": self.index.to_json(),
            "shards": [s.to_json() for s in self.shards],
            **({"shard_root": self.shard_root} if self.shard_root else {}),
        }

    def compute_digest(self) -> str:
        return _digest_of(self._body())

    def to_bytes(self) -> bytes:
        """The manifest v2 JSON. The sample index must have been written (:meth:`write_index`)."""
        if not self.created:
            import datetime as _dt  # noqa: PLC0415 (only writing a manifest needs it, not every stage)

            self.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        # What is stored never carries a URL's credentials or query values (stager.redact): where the
        # data came from is kept for people, and readers take credentials from storage options.
        self.source = _redacted(self.source)
        if self.shard_root:
            self.shard_root = redact(self.shard_root)
        body = self._body()
        self.digest = _digest_of(body)
        self.schema = SCHEMA
        body["digest"] = self.digest
        return (json.dumps(body, separators=(",", ":")) + "\n").encode()

    def write_index(self, directory: str | os.PathLike[str], mode: int | None = None) -> str:
        """Write the sample index file into ``directory`` (atomically, under its content-addressed
        name) and record it in :attr:`index`; return its path. Reads every shard's rows (from memory,
        or from the index it was loaded with)."""
        directory = os.fspath(directory)
        tmp = partial_path(os.path.join(directory, INDEX_PARTIAL_BASE))
        h = new_hasher(self.hash_algo)
        try:
            with open_exclusive(tmp) as f:
                sink = _HashingWriter(f, h)
                nbytes = write_table(sink, self.num_samples, table_columns(self.shards))  # type: ignore[arg-type]
                f.flush()
                os.fsync(f.fileno())
            if mode is not None:
                os.chmod(tmp, mode)
            digest = h.hexdigest()
            name = index_file_name(digest)
            final = os.path.join(directory, name)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.index = IndexRef(name, nbytes, digest)
        return final

    def write(self, directory: str | os.PathLike[str], mode: int | None = None) -> str:
        """Write the sample index, then ``manifest.json`` into ``directory`` atomically; return the
        manifest's path. Index files of earlier manifests in ``directory`` are removed afterwards."""
        self.write_index(directory, mode)
        path = os.path.join(directory, MANIFEST_NAME)
        atomic_write_bytes(path, self.to_bytes(), mode=mode)
        remove_stale_indexes(directory, keep=self.index.name if self.index else None)
        return path

    @classmethod
    def from_bytes(cls, data: bytes, where: str = MANIFEST_NAME, *, root: str | None = None,
                   storage_options: Mapping[str, Any] | None = None) -> Manifest:
        """Parse a manifest. A v2 manifest's sample index is opened on first use from ``root`` (the
        directory or URL prefix holding it; default: ``where``'s directory when ``where`` is a
        manifest path)."""
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc}); re-run `stager pack` to rewrite it") from exc
        if _depth_exceeds(body, MAX_DEPTH):
            raise ManifestError(f"{where}: nested deeper than {MAX_DEPTH} levels, which stager never writes; the "
                                "manifest is damaged (or not stager's): re-run `stager pack` to rewrite it")
        return cls.from_json(body, where, root=root, storage_options=storage_options)

    @classmethod
    def from_json(cls, body: Any, where: str = MANIFEST_NAME, *, root: str | None = None,
                  storage_options: Mapping[str, Any] | None = None) -> Manifest:
        try:
            m = _parse(body, where)
        except ManifestError:
            raise
        except UnsafeArchiveError as exc:
            raise ManifestError(f"{where}: {exc}") from exc
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ManifestError(
                f"{where}: malformed manifest ({type(exc).__name__}: {exc}); re-run `stager pack`"
            ) from exc
        if m.index is not None:
            if root is None and where.endswith(".json"):
                root = dataset_root(where)
            _attach_index(m, root, dict(storage_options or {}))
        return m


def _copy_column(c: Any) -> Any:
    """An in-memory, writable copy of a (mapped) column."""
    if isinstance(c, Strings):
        return Strings(_copy_column(c.raw))
    if isinstance(c, Ragged):
        return Ragged(c.values.copy(), c.starts.copy())
    return np.array(c, copy=True)


_KICK = 8 << 20  # bytes written between two write-back starts of the sample index


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (the index's hash, in one pass) and
    starts the kernel's write-back every few MB, so the fsync after it waits for little (a million
    samples' index is ~70 MB)."""

    def __init__(self, f: Any, hasher: Any) -> None:
        self._f, self._h = f, hasher
        self._pos = self._kicked = 0

    def write(self, b: Any) -> int:
        self._h.update(b)
        n = int(self._f.write(b))
        self._pos += n
        if self._pos - self._kicked >= _KICK:
            self._f.flush()
            start_writeback(self._f.fileno(), self._kicked, self._pos - self._kicked)
            self._kicked = self._pos
        return n


def remove_stale_indexes(directory: str | os.PathLike[str], keep: str | None) -> list[str]:
    """Remove ``index-*.sidx`` files in ``directory`` other than ``keep`` (earlier manifests' indexes)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for n in names:
        if is_index_file_name(n) and n != keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, n))
                removed.append(n)
    return removed


def _attach_index(m: Manifest, root: str | None, storage_options: dict[str, Any]) -> None:
    """Give a parsed v2 manifest its lazily opened sample index, and its shards their row ranges."""
    assert m.index is not None
    ref = m.index
    where = ref.name if root is None else join(root, ref.name)
    opener = _IndexOpener(None if root is None else where, ref, storage_options)
    # Plain ints, no numpy: loading a manifest (all a plain stage does with it) costs O(shards).
    starts = list(itertools.accumulate((s.samples for s in m.shards), initial=0))
    si = SampleIndex(opener, where, starts=starts, shard_bytes=[s.bytes for s in m.shards],
                     nclass=len(m.classes), byte_ranges=FORMAT_SPECS[m.format].byte_ranges,
                     extents=[s.extents for s in m.shards])
    m.samples_index = si
    m.shards = [ShardInfo(s.name, s.bytes, s.hash, aux=s.aux, extents=s.extents, samples=s.samples,
                          rows=(si, a)) for s, a in zip(m.shards, starts[:-1], strict=True)]


@dataclass(frozen=True)
class _IndexOpener:
    """Opens the sample index at ``where`` (mapped when local), checking its size against the
    manifest. Picklable: a spawned loader worker reopens the file instead of receiving its pages."""

    where: str | None
    ref: IndexRef
    storage_options: dict[str, Any]

    def __call__(self) -> Table:
        where, ref = self.where, self.ref
        if where is None:
            raise ManifestError(f"{ref.name}: the manifest was read without its directory; its sample index "
                                "cannot be found (load it with load_manifest)")
        try:
            if is_url(where):
                data = read_bytes(where, self.storage_options)
                if len(data) != ref.bytes:
                    raise ManifestError(f"{where}: sample index is {len(data)} bytes, the manifest says "
                                        f"{ref.bytes}; restore it or re-run the pack")
                return parse_table(data, where)
            size = os.stat(where).st_size
            if size != ref.bytes:
                raise ManifestError(f"{where}: sample index is {size} bytes, the manifest says {ref.bytes}; "
                                    "restore it or re-run the pack")
            return open_table(where)
        except FileNotFoundError as exc:
            raise ShardMissingError(f"{where}: the manifest's sample index is missing; copy it beside "
                                    "manifest.json or re-run the pack") from exc


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests lists and objects more than ``limit`` deep (walked without
    recursion, so that a hostile document cannot exhaust the stack here either)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _is_count(v: Any) -> bool:
    """An integer from 0 to :data:`MAX_COUNT` (not a bool, which JSON's ``true`` would make one)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT


def _digest_of(body: dict[str, Any]) -> str:
    canon = json.dumps({k: v for k, v in body.items() if k not in _UNDIGESTED}, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(canon.encode())


def _int_array(values: Any, n: int, what: str, where: str) -> np.ndarray:
    if not isinstance(values, list) or len(values) != n:
        raise ManifestError(f"{where}: {what} must be a list of {n} integers")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        raise ManifestError(f"{where}: {what} must hold integers")
    return arr.astype(np.int64)


def _parse_v1_index(sj: dict[str, Any], n: int, nbytes: int, *, nclass: int, fmt: str, extents: str,
                    sw: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """A v1 shard's inline per-sample index, checked."""
    idx = sj["index"]
    keys = idx["keys"]
    if not isinstance(keys, list) or len(keys) != n or not all(isinstance(k, str) for k in keys):
        raise ManifestError(f"{sw}: index.keys must be {n} strings")
    labels = _int_array(idx["labels"], n, "index.labels", sw)
    offsets = _int_array(idx["offsets"], n, "index.offsets", sw)
    sizes = _int_array(idx["sizes"], n, "index.sizes", sw)
    if n and (labels.min() < -1 or (nclass and labels.max() >= nclass)):
        raise ManifestError(f"{sw}: label out of range 0..{nclass - 1}")
    if n and (offsets.min() < 0 or sizes.min() < 0):
        raise ManifestError(f"{sw}: negative sample offset or size")
    if FORMAT_SPECS[fmt].byte_ranges and extents == "bytes" and n and (offsets + sizes).max() > nbytes:
        raise ManifestError(f"{sw}: sample extents exceed the shard's {nbytes} bytes")
    return keys, labels, offsets, sizes


def _parse(body: Any, where: str) -> Manifest:
    if not isinstance(body, dict):
        raise ManifestError(f"{where}: expected a JSON object at top level")
    schema = body.get("schema")
    if schema not in (SCHEMA, SCHEMA_V1):
        raise ManifestError(f"{where}: unknown schema {schema!r}, expected {SCHEMA!r}; upgrade stager or re-pack")
    v1 = schema == SCHEMA_V1
    fmt = body["format"]
    if fmt not in FORMATS:
        raise ManifestError(f"{where}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    algo = body["hash_algo"]
    if algo not in ALGOS:
        raise ManifestError(f"{where}: unknown hash_algo {algo!r}")
    classes = body["classes"]
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise ManifestError(f"{where}: classes must be a list of strings")
    shape = body.get("image_shape")
    image_shape = None
    if shape is not None:
        if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and v > 0 for v in shape)):
            raise ManifestError(f"{where}: image_shape must be [H, W, C] positive integers")
        image_shape = (shape[0], shape[1], shape[2])
    shards: list[ShardInfo] = []
    seen: set[str] = set()
    for i, sj in enumerate(body["shards"]):
        sw = f"{where}: shard {i}"
        name = check_file_name(sj["name"])
        n = sj["samples"]
        nbytes = sj["bytes"]
        if not (_is_count(n) and _is_count(nbytes)):
            raise ManifestError(f"{sw} ({name}): samples and bytes must be integers from 0 to 2^63-1")
        extents = sj.get("extents", "bytes")
        if extents not in FORMAT_SPECS[fmt].extents:
            raise ManifestError(f"{sw} ({name}): unknown extents {extents!r} for format {fmt}")
        aux = [AuxFile(check_file_name(a["name"], "companion file name"), a["bytes"], str(a["hash"]))
               for a in sj.get("aux", [])]
        if not all(_is_count(a.bytes) for a in aux):
            raise ManifestError(f"{sw} ({name}): a companion file's bytes must be an integer from 0 to 2^63-1")
        for fname in [name, *(a.name for a in aux)]:
            if fname in seen or fname == MANIFEST_NAME:
                raise ManifestError(f"{sw}: file name {fname!r} listed twice")
            seen.add(fname)
        if v1:
            keys, labels, offsets, sizes = _parse_v1_index(sj, n, nbytes, nclass=len(classes), fmt=fmt, extents=extents,
                                                             sw=f"{sw} ({name})")
            shards.append(ShardInfo(name, nbytes, str(sj["hash"]), keys, labels, offsets, sizes, aux, extents))
        else:
            shards.append(ShardInfo(name, nbytes, str(sj["hash"]), aux=aux, extents=extents, samples=n))
    index = None
    if not v1:
        ij = body["index"]
        index = IndexRef(check_file_name(ij["name"], "sample index name"), int(ij["bytes"]), str(ij["hash"]))
        if index.name in seen or not is_index_file_name(index.name):
            raise ManifestError(f"{where}: sample index name {index.name!r} must be index-<hex>.sidx and not a shard's")
    fields = body.get("fields") or []
    clips = body.get("clips")
    if not isinstance(fields, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                                 and isinstance(f.get("kind"), str) for f in fields):
        raise ManifestError(f"{where}: fields must be a list of objects with a name and a kind")
    specs_from_json(sample_fields(fields), where)  # each sample field as the readers will take it
    if clips is not None and not isinstance(clips, dict):
        raise ManifestError(f"{where}: clips must be an object or null")
    m = Manifest(
        format=fmt,
        classes=classes,
        shards=shards,
        source=dict(body.get("source") or {}),
        options=dict(body.get("options") or {}),
        hash_algo=algo,
        sample_kind=body.get("sample_kind", "encoded"),
        image_shape=image_shape,
        skipped=list(body.get("skipped") or []),
        stager_version=str(body.get("stager_version", "")),
        created=str(body.get("created", "")),
        digest=str(body.get("digest", "")),
        shard_root=_check_root(body.get("shard_root"), where),
        fields=fields,
        clips=clips,
        index=index,
        schema=schema,
    )
    expect = _digest_of(body)
    if m.digest != expect:
        raise ManifestError(
            f"{where}: manifest digest mismatch (stored {m.digest or 'none'}, computed {expect}); "
            "the manifest is damaged: restore it or re-run `stager pack`"
        )
    return m


def _check_root(root: Any, where: str) -> str | None:
    """``shard_root`` must be an absolute path or a URL (a relative one would depend on the reader's cwd)."""
    if root is None:
        return None
    if not isinstance(root, str) or not root or not (root.startswith("/") or is_url(root)):
        raise ManifestError(f"{where}: shard_root must be an absolute path or a URL, got {root!r}")
    return root


def manifest_path(path: str | os.PathLike[str]) -> str:
    """Accept a packed directory or its manifest file; return the manifest's path/URL."""
    p = os.fspath(path)
    if p.endswith(".json"):
        return p
    return p.rstrip("/") + "/" + MANIFEST_NAME


def load_manifest(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read and validate the manifest of a packed directory (local path or fsspec URL)."""
    mp = manifest_path(path)
    if is_url(mp):
        try:
            data = read_bytes(mp, storage_options, limit=MAX_MANIFEST_BYTES)
        except FileNotFoundError as exc:
            raise not_a_pack(path) from exc
    else:
        try:
            # open_regular: a FIFO or a device planted as manifest.json never blocks, it is refused.
            with io.FileIO(open_regular(mp), "rb") as f:
                # Check the size first: read(MAX + 1) asks for a 4 GiB buffer up front, a MemoryError
                # under `ulimit -v` or strict overcommit (common on HPC nodes).
                if os.fstat(f.fileno()).st_size > MAX_MANIFEST_BYTES:
                    raise ManifestError(f"{mp}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse")
                data = f.read()
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise not_a_pack(path) from exc
        except IsADirectoryError as exc:
            raise ManifestError(f"{mp}: is a directory, expected manifest.json") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{mp}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse")
    return Manifest.from_bytes(data, mp, storage_options=storage_options)


def not_a_pack(path: str | os.PathLike[str]) -> NotAPackError:
    """The one-line error for ``path``, given where a pack is expected, when it holds no manifest: what
    it is (missing, a file, a directory without ``manifest.json``) and the command that fits (exit 2)."""
    p = os.fspath(path)
    if is_url(p):
        return NotAPackError(f"{manifest_path(p)}: no manifest; give the location `stager pack` (or `stager index "
                             "--out`) wrote, once it has finished")
    if not os.path.lexists(p):
        return NotAPackError(f"{p}: no such file or directory; give the directory `stager pack` wrote")
    for state, command in UNFINISHED_STATE.items():
        if os.path.isdir(os.path.join(p, state)):
            return NotAPackError(f"{p}: an unfinished `{command}` (no {MANIFEST_NAME} yet: it is written last); rerun "
                                 f"the same `{command}` command, which resumes, then give {p}")
    if os.path.isdir(p):
        return NotAPackError(f"{p}: no {MANIFEST_NAME}, so not a pack; an image tree is packed first: "
                             f"`stager pack {p} OUT --format tar`, then give OUT")
    parent = os.path.dirname(p) or "."
    if os.path.isfile(os.path.join(parent, MANIFEST_NAME)):
        return NotAPackError(f"{p}: a single file of the pack {parent}; give the pack's directory, {parent}")
    return NotAPackError(f"{p}: a single file, not a pack; give the directory `stager pack` wrote (existing "
                         f"shards are adopted in place with `stager index {parent}`)")


def dataset_root(path: str | os.PathLike[str]) -> str:
    """The directory (or URL prefix) that holds the manifest, given a directory or manifest path.

    That is where the shards are unless the manifest says otherwise: use :func:`shard_root`."""
    p = os.fspath(path)
    if p.endswith(".json"):
        return str(PurePosixPath(p).parent) if "://" not in p else p.rsplit("/", 1)[0]
    return p.rstrip("/") or "/"


def shard_root(path: str | os.PathLike[str], manifest: Manifest) -> str:
    """The directory (or URL prefix) holding ``manifest``'s shards: its ``shard_root`` when set (an
    index written with ``stager index --out``), else the manifest's own directory."""
    if manifest.shard_root:
        return manifest.shard_root.rstrip("/") or "/"
    return dataset_root(path)


def bytes_for_copy(manifest: Manifest, data: bytes) -> bytes:
    """What a copy of the dataset stores as its ``manifest.json``: ``data`` verbatim, less the
    ``shard_root`` field when it has one (the copy's shards are beside its manifest). The digest is
    unchanged (``shard_root`` is not part of it), so receipts and dataset ids still match."""
    if not manifest.shard_root:
        return data
    body = json.loads(data)
    body.pop("shard_root", None)
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def shard_index_arrays(shards: Sequence[ShardInfo]) -> tuple[np.ndarray, np.ndarray]:
    """Global ``labels`` and ``sizes`` (int64, length = total samples) in manifest order."""
    if not shards:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (np.concatenate([s.labels for s in shards]), np.concatenate([s.sizes for s in shards]))

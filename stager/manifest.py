"""The manifest: the contract between ``pack``, ``stage``, the loader and ``verify``.

A packed directory holds shard files plus ``manifest.json``, written last and atomically. The
manifest lists every shard with its size, sample count and checksum, and a columnar per-sample
index (key, label, byte offset, byte length) so that readers can partition exactly and read runs
of samples with one ``pread`` without parsing the container. docs/formats.md is the normative
description; this module is its only reader and writer.

Per-sample ``offsets``/``sizes`` locate the *encoded image payload* inside the shard file:

* tar: the data of the ``<key>.<ext>`` image member;
* record: the ``image/encoded`` bytes inside the record's ``tf.train.Example`` payload;
* hdf5: the sample's slice of the contiguous ``images`` dataset (file offset of the dataset plus
  the in-array offset);
* zarr: decoded images; ``offsets`` is the row inside the shard's ``images`` array and ``sizes`` is
  ``H*W*C``.

The manifest carries a ``digest`` over its own canonical JSON so that a damaged manifest (a flipped
digit) is refused instead of silently misleading every reader.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import xxhash

from stager import __version__
from stager.checksum import ALGOS, DEFAULT_ALGO
from stager.errors import ManifestError, ShardMissingError, UnsafeArchiveError
from stager.fs.atomic import atomic_write_bytes
from stager.fs.open import is_url, read_bytes

SCHEMA = "stager.manifest/1"
MANIFEST_NAME = "manifest.json"
FORMATS = ("tar", "hdf5", "record", "zarr", "parquet", "recordio", "lmdb")  # the last three: `stager index` only
# Extents other than file byte ranges, and the formats that may use them (docs/formats.md).
EXTENTS = {"bytes": FORMATS, "rows": ("parquet",), "records": ("recordio",)}
# Fields left out of the digest: ``digest`` itself, and ``shard_root`` (where the shards live is not
# what they are: a staged copy drops it and keeps the digest, so receipts still match).
_UNDIGESTED = ("digest", "shard_root")
MAX_MANIFEST_BYTES = 4 << 30  # refuse absurd manifests before parsing them

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,254}$")


def check_safe_name(name: object, what: str = "shard name") -> str:
    """Return ``name`` if it is a plain file name (no separators, no ``..``, no hidden/odd chars).

    Manifest entries become paths under a destination; anything that could escape it is refused.
    """
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", "..") or ".." in name:
        raise UnsafeArchiveError(
            f"unsafe {what} {name!r}: expected a plain file name (letters, digits, '._+-', no path separators)"
        )
    return name


@dataclass(frozen=True)
class AuxFile:
    """A companion file of a shard that is staged with it (e.g. a record shard's DALI index)."""

    name: str
    bytes: int
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "hash": self.hash}


@dataclass
class ShardInfo:
    """One shard file: identity, integrity, and the columnar index of its samples.

    ``keys``, ``labels``, ``offsets`` and ``sizes`` all have length ``samples`` and are in the
    shard's physical order. ``labels``/``offsets``/``sizes`` are int64 arrays.
    """

    name: str
    bytes: int
    hash: str
    keys: list[str]
    labels: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    aux: list[AuxFile] = field(default_factory=list)
    extents: str = "bytes"  # "bytes": file byte ranges; "rows": rows (parquet); "records": framed records (recordio)

    @property
    def samples(self) -> int:
        return len(self.keys)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "bytes": self.bytes,
            "samples": self.samples,
            "hash": self.hash,
            "aux": [a.to_json() for a in self.aux],
            "index": {
                "keys": list(self.keys),
                "labels": self.labels.tolist(),
                "offsets": self.offsets.tolist(),
                "sizes": self.sizes.tolist(),
            },
        }
        if self.extents != "bytes":  # written only when set: older manifests keep their digest
            out["extents"] = self.extents
        return out


@dataclass
class Manifest:
    """A packed dataset: format, classes, shards and provenance.

    ``sample_kind`` is ``"encoded"`` (image files' bytes: tar, hdf5, record) or ``"decoded"``
    (fixed-shape uint8 arrays: zarr, with ``image_shape`` = (H, W, C)).
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

    # ---- derived -------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        """Bytes of all files a copy needs (shards and their companion files)."""
        return sum(s.bytes + sum(a.bytes for a in s.aux) for s in self.shards)

    @property
    def shard_bytes(self) -> np.ndarray:
        """int64 (shards,): each shard's bytes with its companion files (what a node holding it stores)."""
        return np.array([s.bytes + sum(a.bytes for a in s.aux) for s in self.shards], dtype=np.int64)

    def files(self) -> Iterator[tuple[str, int, str]]:
        """Every file of the dataset except the manifest: ``(name, bytes, hash)``, shards first."""
        for s in self.shards:
            yield s.name, s.bytes, s.hash
            for a in s.aux:
                yield a.name, a.bytes, a.hash

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

    # ---- serialisation -------------------------------------------------------------------
    def _body(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "stager_version": self.stager_version,
            "created": self.created,
            "format": self.format,
            "sample_kind": self.sample_kind,
            "image_shape": list(self.image_shape) if self.image_shape else None,
            "hash_algo": self.hash_algo,
            "classes": list(self.classes),
            "source": self.source,
            "options": self.options,
            "totals": {
                "samples": self.num_samples,
                "shards": len(self.shards),
                "bytes": self.num_bytes,
                "skipped": len(self.skipped),
            },
            "skipped": self.skipped,
            "shards": [s.to_json() for s in self.shards],
            **({"shard_root": self.shard_root} if self.shard_root else {}),
        }

    def compute_digest(self) -> str:
        return _digest_of(self._body())

    def to_bytes(self) -> bytes:
        if not self.created:
            self.created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        body = self._body()
        self.digest = _digest_of(body)
        body["digest"] = self.digest
        return (json.dumps(body, separators=(",", ":")) + "\n").encode()

    def write(self, directory: str | os.PathLike[str], mode: int | None = None) -> str:
        """Write ``manifest.json`` into ``directory`` atomically; return its path."""
        path = os.path.join(directory, MANIFEST_NAME)
        atomic_write_bytes(path, self.to_bytes(), mode=mode)
        return path

    @classmethod
    def from_bytes(cls, data: bytes, where: str = MANIFEST_NAME) -> Manifest:
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc}); re-run `stager pack` to rewrite it") from exc
        return cls.from_json(body, where)

    @classmethod
    def from_json(cls, body: Any, where: str = MANIFEST_NAME) -> Manifest:
        try:
            return _parse(body, where)
        except ManifestError:
            raise
        except UnsafeArchiveError as exc:
            raise ManifestError(f"{where}: {exc}") from exc
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise ManifestError(
                f"{where}: malformed manifest ({type(exc).__name__}: {exc}); re-run `stager pack`"
            ) from exc


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


def _parse(body: Any, where: str) -> Manifest:
    if not isinstance(body, dict):
        raise ManifestError(f"{where}: expected a JSON object at top level")
    schema = body.get("schema")
    if schema != SCHEMA:
        raise ManifestError(f"{where}: unknown schema {schema!r}, expected {SCHEMA!r}; upgrade stager or re-pack")
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
    nclass = len(classes)
    for i, sj in enumerate(body["shards"]):
        sw = f"{where}: shard {i}"
        name = check_safe_name(sj["name"])
        n = sj["samples"]
        nbytes = sj["bytes"]
        if not (isinstance(n, int) and isinstance(nbytes, int)) or n < 0 or nbytes < 0:
            raise ManifestError(f"{sw} ({name}): samples and bytes must be non-negative integers")
        idx = sj["index"]
        keys = idx["keys"]
        if not isinstance(keys, list) or len(keys) != n or not all(isinstance(k, str) for k in keys):
            raise ManifestError(f"{sw} ({name}): index.keys must be {n} strings")
        labels = _int_array(idx["labels"], n, "index.labels", sw)
        offsets = _int_array(idx["offsets"], n, "index.offsets", sw)
        sizes = _int_array(idx["sizes"], n, "index.sizes", sw)
        if n and (labels.min() < -1 or (nclass and labels.max() >= nclass)):
            raise ManifestError(f"{sw} ({name}): label out of range 0..{nclass - 1}")
        extents = sj.get("extents", "bytes")
        if fmt not in EXTENTS.get(extents, ()):
            raise ManifestError(f"{sw} ({name}): unknown extents {extents!r} for format {fmt}")
        if n and (offsets.min() < 0 or sizes.min() < 0):
            raise ManifestError(f"{sw} ({name}): negative sample offset or size")
        if fmt != "zarr" and extents == "bytes" and n and (offsets + sizes).max() > nbytes:
            raise ManifestError(f"{sw} ({name}): sample extents exceed the shard's {nbytes} bytes")
        aux = []
        for a in sj.get("aux", []):
            aux.append(AuxFile(check_safe_name(a["name"], "companion file name"), int(a["bytes"]), str(a["hash"])))
        for fname in [name, *(a.name for a in aux)]:
            if fname in seen or fname == MANIFEST_NAME:
                raise ManifestError(f"{sw}: file name {fname!r} listed twice")
            seen.add(fname)
        shards.append(ShardInfo(name, nbytes, str(sj["hash"]), keys, labels, offsets, sizes, aux, extents))
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
            raise ShardMissingError(f"{mp}: no manifest; run `stager pack SRC OUT` first") from exc
    else:
        try:
            with open(mp, "rb") as f:
                # Check the size first: read(MAX + 1) asks for a 4 GiB buffer up front, a MemoryError
                # under `ulimit -v` or strict overcommit (common on HPC nodes).
                if os.fstat(f.fileno()).st_size > MAX_MANIFEST_BYTES:
                    raise ManifestError(f"{mp}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse")
                data = f.read()
        except FileNotFoundError as exc:
            raise ShardMissingError(f"{mp}: no manifest; is this a `stager pack` output directory?") from exc
        except IsADirectoryError as exc:
            raise ManifestError(f"{mp}: is a directory, expected manifest.json") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{mp}: larger than {MAX_MANIFEST_BYTES} bytes; refusing to parse")
    return Manifest.from_bytes(data, mp)


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

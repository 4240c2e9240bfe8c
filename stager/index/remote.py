"""Indexing shards that live behind a URL (``s3://``, ``az://``, ``gs://``, ``https://`` ...).

The scanners parse a mapped local file (:func:`stager.index.scan.mapped`), so each object is read
once, sequentially, with the retried ranged reads of :mod:`stager.fs.remote`, into a temporary file in
the index's state directory (on OUT's disk), scanned there and deleted: a worker holds at most one
shard on disk at a time. An object's identity for resuming is its size and a stamp made of its ETag
and modification time (what the store reports; fsspec's ``info``), in place of a file's mtime.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

from stager.errors import SourceNotFoundError
from stager.fs.atomic import space_error
from stager.fs.open import filesystem, open_read
from stager.fs.remote import list_names, object_info, read_range, stream_to
from stager.redact import location_path

PARTIAL_SUFFIX = ".download.partial"  # objects being copied down (state directory; stale ones removed)


def list_objects(src: str, storage_options: Mapping[str, Any] | None) -> tuple[str, list[str]]:
    """``(prefix URL, names)`` of the objects directly under ``src`` (a prefix, or one object: then its
    parent and its name), hidden names (``.x``) left out."""
    fs, path = filesystem(src, storage_options)
    base = src.rstrip("/")
    names = [n for n in list_names(fs, path.rstrip("/"), src) if "/" not in n and not n.startswith(".")]
    if not names:
        with contextlib.suppress(FileNotFoundError):
            if object_info(fs, path, src).get("type", "file") == "file":
                base, name = base.rsplit("/", 1)
                names = [name]
    if not names:
        raise SourceNotFoundError(f"{src}: no objects under this URL; give the prefix that holds the shards")
    return base, sorted(names)


def head(url: str, storage_options: Mapping[str, Any] | None, n: int = 512) -> bytes:
    """The first ``n`` bytes of the object at ``url`` (fewer when it is smaller): one ranged GET."""
    fs, path = filesystem(url, storage_options)
    size = int(object_info(fs, path, url).get("size") or 0)
    return read_range(fs, path, 0, min(size, n), url) if size else b""


def stamp(url: str, storage_options: Mapping[str, Any] | None) -> tuple[int, int]:
    """``(size, identity stamp)`` of the object at ``url``: the stamp changes when the object is
    replaced (a crc of its ETag and modification time), and stands where a file's mtime does.

    A server that reports neither (a plain web server without ETags: fsspec's HTTP info carries only
    the size) gets stamp 0: a resumed run then trusts an unchanged size, and an object replaced by one
    of the same size is still caught by ``verify``, which hashes every byte against the manifest.
    """
    fs, path = filesystem(url, storage_options)
    try:
        info = object_info(fs, path, url)
    except FileNotFoundError as exc:
        raise SourceNotFoundError(f"{url}: no such object") from exc
    ident = "|".join(str(info.get(k, "")) for k in ("ETag", "etag", "LastModified", "last_modified", "mtime"))
    return int(info["size"]), (zlib.crc32(ident.encode()) if ident.strip("|") else 0)


@contextlib.contextmanager
def local_copy(url: str, spool_dir: str, storage_options: Mapping[str, Any] | None, size: int) -> Iterator[str]:
    """A temporary local copy of the ``size``-byte object at ``url`` in ``spool_dir``, removed on exit
    (also on error). ``size`` comes from the caller's :func:`stamp` (no second HEAD)."""
    name = location_path(url).rstrip("/").rsplit("/", 1)[-1] or "object"  # never a query's secret
    tmp = os.path.join(spool_dir, f"{name}.{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}")
    try:
        try:
            with open_read(url, storage_options, size=size) as src, open(tmp, "wb") as out:
                stream_to(src, out)
        except OSError as exc:
            raise (space_error(exc, tmp) or exc) from exc
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def remove_stale_downloads(spool_dir: str) -> None:
    """Remove copies a killed run left in the state directory."""
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(spool_dir):
            if e.name.endswith(PARTIAL_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)

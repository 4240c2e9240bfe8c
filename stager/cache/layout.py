"""The on-disk layout of a shard cache: every name the cache writes, spelled once.

A cache directory (``stager stage --cache DIR``) holds only these::

    DIR/                                  the cache owner's; 0700 (a user's cache) or 0755 (a site cache)
      .stager-cache.json                  the marker: schema, kind ("user" or "site"), owner uid, quota
      objects/<algo>/<kk>/<key>           one read-only file per distinct content (shards, companion
                                          files, sample indexes); ``<kk>`` = the key's first two digits
      datasets/<manifest digest>.json     what a dataset needs: file name -> key, uses, pinned
      locks/<key>                         fill locks (``flock``): one copy of an object at a time
      locks/.gc                           one eviction at a time
      leases/<id>.lease                   who uses which objects now (:mod:`stager.cache.lease`)
      log.jsonl                           what eviction removed, why, and the bytes it freed

**Content addressing** (:func:`object_key`). An object's key is the hash the manifest gives its file,
the hash it was verified to have while it was written. With a cryptographic hash (``blake2b``) that
name alone identifies the bytes, so every dataset holding the same bytes shares the object. With the
default ``xxh3_128`` (fast, not collision-resistant: someone who writes a dataset could craft bytes
with the hash of another dataset's shard) the key also carries a tag of where the bytes came from
(:func:`source_tag`: the source file's real path, or its URL without credentials), so bytes read from
one source are never served as another source's shard; datasets that share shard *files* (two
manifests over one directory, ``stager index --out``) still share objects. Readers never trust a
name they did not compute: they derive the key from their own manifest and source.

Every name under ``objects/`` is checked (:func:`is_object_name`) before it is used in a path, so a
manifest's hash can never name a path outside the cache.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from stager.errors import ManifestError
from stager.fs.atomic import partial_base

SCHEMA = "stager.cache/1"
MARKER = ".stager-cache.json"
OBJECTS = "objects"
DATASETS = "datasets"
LOCKS = "locks"
LEASES = "leases"
LOG = "log.jsonl"
GC_LOCK = ".gc"
ROOM_LOCK = ".room"  # held while a filler measures the room under the quota and reserves its share
LEASE_SUFFIX = ".lease"
KINDS = ("user", "site")
TOP_LEVEL = frozenset({MARKER, OBJECTS, DATASETS, LOCKS, LEASES, LOG})

CRYPTOGRAPHIC_ALGOS = frozenset({"blake2b"})
HASH_ALGOS = ("xxh3_128", "blake2b")
_HASH_RE = re.compile(r"^[0-9a-f]{16,128}$")
_KEY_RE = re.compile(r"^[0-9a-f]{16,128}(-[0-9a-f]{16})?$")
_DIGEST_RE = re.compile(r"^[0-9a-f]{16,128}$")
TAG_DIGITS = 16


def canonical_source(src_path: str) -> str:
    """The identity of a source file for :func:`source_tag`: a local path with its directory resolved
    (symbolic links, ``..``), a URL without user info, query or fragment (credentials never reach the
    cache). The directory is resolved once per process (:func:`_real_dir`): on a network file system
    every component of a path costs a round trip, and a dataset's files share one directory."""
    if "://" in src_path and not src_path.startswith("file://"):
        u = urlsplit(src_path)
        host = u.hostname or ""
        netloc = host + (f":{u.port}" if u.port else "")
        return urlunsplit((u.scheme, netloc, u.path, "", ""))
    local = os.path.abspath(src_path.removeprefix("file://"))
    return os.path.join(_real_dir(os.path.dirname(local)), os.path.basename(local))


@functools.lru_cache(maxsize=256)
def _real_dir(directory: str) -> str:
    return os.path.realpath(directory)


def source_tag(src_path: str) -> str:
    """16 hex digits naming where an object's bytes came from (see the module docstring)."""
    return hashlib.blake2b(canonical_source(src_path).encode(), digest_size=TAG_DIGITS // 2).hexdigest()


def object_key(algo: str, file_hash: str, src_path: str) -> str:
    """The key of the object holding a file whose manifest hash is ``file_hash`` (``algo``), read from
    ``src_path``: the hash, plus the source tag for a hash that is not collision-resistant.

    A hash that is not lower-case hex (a damaged or hostile manifest) is a :class:`ManifestError`:
    it never becomes part of a path.
    """
    if algo not in HASH_ALGOS:
        raise ManifestError(f"{src_path}: unknown hash algorithm {algo!r}; re-pack with stager")
    if not _HASH_RE.match(file_hash):
        raise ManifestError(f"{src_path}: the manifest's hash {file_hash[:40]!r} is not a hex digest; re-pack or "
                            "re-index the dataset")
    if algo in CRYPTOGRAPHIC_ALGOS:
        return file_hash
    return f"{file_hash}-{source_tag(src_path)}"


def key_hash(key: str) -> str:
    """The content hash part of an object key."""
    return key.split("-", 1)[0]


def is_object_name(name: str) -> bool:
    return bool(_KEY_RE.match(name))


def is_digest(name: str) -> bool:
    return bool(_DIGEST_RE.match(name))


def object_relpath(algo: str, key: str) -> str:
    """``objects/<algo>/<kk>/<key>`` (checked: only known algorithms and well-formed keys)."""
    if algo not in HASH_ALGOS or not is_object_name(key):
        raise ManifestError(f"not a cache object: {algo}/{key[:40]!r}")
    return f"{OBJECTS}/{algo}/{key[:2]}/{key}"


def record_name(digest: str) -> str:
    """``<manifest digest>.json`` under ``datasets/``."""
    if not is_digest(digest):
        raise ManifestError(f"not a manifest digest: {digest[:40]!r}")
    return f"{digest}.json"


def foreign_entries(root: Path, limit: int = 5) -> list[str]:
    """Up to ``limit`` paths under ``root`` (relative) that are not the cache's own files: what makes
    ``stager cache`` refuse a directory (it deletes only what it can tell is its own).

    Checked: the top level, ``objects/`` down to the object files, ``datasets/`` and ``locks/``;
    each name must be one the cache writes (or a partial file of one). ``leases/`` of a site cache is
    written by its users, and is read, never trusted, so it is not checked here.
    """
    out: list[str] = []

    def names(rel: str) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(root / rel) as it:
                return list(it)
        except (FileNotFoundError, PermissionError):
            return []  # absent, or not for this reader to list (a site cache's locks/)

    def bad(rel: str) -> bool:
        out.append(rel)
        return len(out) >= limit

    for e in names(""):
        own = e.name in TOP_LEVEL or partial_base(e.name) in (MARKER, LOG)
        if not own and bad(e.name):
            return out
    for algo in names(OBJECTS):
        if algo.name not in HASH_ALGOS or not algo.is_dir(follow_symlinks=False):
            if bad(f"{OBJECTS}/{algo.name}"):
                return out
            continue
        for sub in names(f"{OBJECTS}/{algo.name}"):
            rel = f"{OBJECTS}/{algo.name}/{sub.name}"
            if not re.fullmatch(r"[0-9a-f]{2}", sub.name) or not sub.is_dir(follow_symlinks=False):
                if bad(rel):
                    return out
                continue
            for f in names(rel):
                base = partial_base(f.name) or f.name
                own = is_object_name(base) and base[:2] == sub.name and f.is_file(follow_symlinks=False)
                if not own and bad(f"{rel}/{f.name}"):
                    return out
    for f in names(DATASETS):
        base = partial_base(f.name) or f.name
        own = base.endswith(".json") and is_digest(base[:-5]) and f.is_file(follow_symlinks=False)
        if not own and bad(f"{DATASETS}/{f.name}"):
            return out
    for f in names(LOCKS):
        own = (is_object_name(f.name) or f.name in (GC_LOCK, ROOM_LOCK)) and f.is_file(follow_symlinks=False)
        if not own and bad(f"{LOCKS}/{f.name}"):
            return out
    return out

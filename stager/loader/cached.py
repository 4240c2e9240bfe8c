"""The loader's reads through a shard cache (:mod:`stager.cache`): which file holds each shard.

Two ways a dataset is found in a cache, both reported as ``staged_mode: "cache"``:

* a staged copy whose receipt says it links into a cache (``stage --cache``): a shard that DEST holds
  as a regular file of the reader's (or root's) with the manifest's size (a hard link, the object
  itself) is read from DEST; a symbolic link is never followed: the shard is looked up in the cache
  the receipt names, by the key the reader computes from its own manifest and source;
* no receipt, but a cache the reader uses (``$STAGER_CACHE``, the site cache) holds every shard.

Either way an object is used only if :meth:`stager.cache.store.Cache.find` trusts it (the cache's
owner is the reader, root or the site's service account; the object is read-only, the owner's,
of the manifest's size, in directories nobody else may write), and only while a lease held by this
process protects it from eviction (:class:`~stager.cache.lease.Lease`, one per dataset and cache,
released when the process exits; forked workers share it).
"""

from __future__ import annotations

import atexit
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from stager.cache.config import reader_caches
from stager.cache.layout import object_key
from stager.cache.lease import Lease
from stager.cache.store import Cache
from stager.errors import StagerError
from stager.fs.open import join
from stager.manifest import Manifest
from stager.receipt import Receipt

log = logging.getLogger("stager.loader")

_LEASES: dict[tuple[str, str], Lease] = {}  # (cache dir, manifest digest) -> this process's lease


@atexit.register
def _release_all() -> None:
    for lease in _LEASES.values():
        lease.release()  # a forked worker only closes its copy; the process that took it removes it
    _LEASES.clear()


@dataclass(frozen=True)
class CachedShards:
    """Where each shard is read: ``paths[i]`` for shard ``i`` (None: not held here); ``cache``: the
    cache directory the objects are in."""

    paths: list[str | None]
    cache: str


def _keys(m: Manifest, src_root: str) -> list[str]:
    return [object_key(m.hash_algo, s.hash, join(src_root, s.name)) for s in m.shards]


def _lease(cache: Cache, m: Manifest, keys: list[str]) -> None:
    """Hold a lease on ``keys`` for this process's lifetime (one per cache and dataset)."""
    ident = (str(cache.root), m.digest)
    held = _LEASES.get(ident)
    if held is not None and held.pid == os.getpid():
        held.extend(keys)
        return
    _LEASES[ident] = Lease(cache, keys, f"loader pid {os.getpid()}").acquire()


def _own_regular(path: Path, nbytes: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022
            and st.st_size == nbytes)


def through_receipt(m: Manifest, src_root: str, dest: Path, rec: Receipt) -> CachedShards | None:
    """Shard paths of a staged copy that links into a cache; None (logged) when a shard cannot be
    trusted or is gone (the caller then reads SRC)."""
    assert rec.cache is not None
    wanted = set(rec.shards)
    try:
        cache = Cache.open(rec.cache["dir"], read_only=True)
    except (StagerError, OSError) as exc:
        cache = None
        reason = str(exc)
    keys = _keys(m, src_root)
    paths: list[str | None] = [None] * len(m.shards)
    used: list[str] = []
    for i, s in enumerate(m.shards):
        if s.name not in wanted:
            continue
        if _own_regular(dest / s.name, s.bytes):
            paths[i] = str(dest / s.name)
            continue
        found = cache.find(m.hash_algo, keys[i], s.bytes) if cache is not None else None
        if found is None:
            why = reason if cache is None else f"its object {keys[i][:16]}... is not in the cache (or not trusted)"
            log.warning("stager.loader: not using the staged copy at %s: shard %s: %s", dest, s.name, why)
            return None
        paths[i] = str(found)
        used.append(keys[i])
    if used and cache is not None:
        _lease(cache, m, used)
        # Checked again under the lease: an eviction that started before it may have removed one.
        if any(cache.find(m.hash_algo, keys[i], m.shards[i].bytes) is None for i, p in enumerate(paths)
               if p is not None and not p.startswith(str(dest))):
            log.warning("stager.loader: not using the staged copy at %s: an object was evicted meanwhile", dest)
            return None
    return CachedShards(paths, rec.cache["dir"])


def in_caches(m: Manifest, src_root: str) -> CachedShards | None:
    """Every shard of ``m`` from one of the reader's caches (``$STAGER_CACHE``, the site cache), or None."""
    keys = _keys(m, src_root)
    for d in reader_caches():
        try:
            cache = Cache.open(d, read_only=True)
        except (StagerError, OSError) as exc:
            log.warning("stager.loader: cache %s not used: %s", d, exc)
            continue
        if any(cache.find(m.hash_algo, k, s.bytes) is None for k, s in zip(keys, m.shards, strict=True)):
            continue
        _lease(cache, m, keys)
        found = [cache.find(m.hash_algo, k, s.bytes) for k, s in zip(keys, m.shards, strict=True)]
        if any(p is None for p in found):
            continue  # evicted before the lease: read SRC
        return CachedShards([str(p) for p in found], str(cache.root))
    return None

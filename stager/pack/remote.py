"""``stager pack SRC s3://bucket/prefix``: a pack written straight to an object store (any fsspec URL).

The format writers need a local, seekable file (HDF5 and zarr rewrite their headers; the parallel
tar writer ``pwrite`` s segments at their offsets), so each shard is written as usual into a local
*spool* directory and, once complete and hashed, streamed up in parts (:func:`stager.fs.remote.upload_file`:
a multipart upload on S3, memory one part) and removed locally. The spool therefore holds at most
the shards being written (one per worker), never the pack; it is ``$STAGER_SPOOL`` or a temporary
directory, removed at the end.

Consistency, the same contract as a local pack:

* an object appears only complete: the store's atomic PUT / completed multipart upload, or a
  temporary ``<name>.<uuid>.partial`` key moved into place where the store has no such guarantee;
* ``OUT/.stager-pack/`` holds ``plan.json`` and, after each shard's upload, its done-record with the
  ETag of every object it uploaded; ``manifest.json`` is written last, then the state removed.
  Readers that wait for the manifest (``stage``, the loader, ``verify``) never see a partial pack;
* a rerun after a kill keeps every shard whose done-record has this plan's fingerprint and whose
  objects still have the recorded size and ETag (no download), and re-uploads the rest. Shards of a
  previous complete manifest with another plan are re-hashed by downloading them; a complete pack of
  this very plan whose objects all have the manifest's sizes is left untouched (``stager verify URL``
  re-hashes it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stager.checksum import new_hasher
from stager.errors import ManifestError
from stager.fs.atomic import partial_base
from stager.fs.open import backend_of, filesystem, require_backend
from stager.fs.remote import RemoteFile, list_names, object_info, put_bytes, read_range, remove, upload_file
from stager.fs.verified import Expected, mismatch
from stager.manifest import MANIFEST_NAME, Manifest, ShardInfo, is_index_file_name, load_manifest
from stager.pack.state import DONE_SUFFIX, PLAN_FILE, PLAN_SCHEMA, STATE_DIR, OutState, ShardDone, done_record_shard

if TYPE_CHECKING:
    from stager.pack.plan import PackPlan
    from stager.pack.sources.base import Source

SPOOL_ENV = "STAGER_SPOOL"
HASH_BLOCK = 8 << 20


@dataclass(frozen=True)
class RemoteOut:
    """OUT as a URL prefix: where the objects go, with which storage options (picklable: workers get it)."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))
        require_backend(self.url)

    def _fs(self) -> tuple[Any, str]:
        fs, root = filesystem(self.url, self.storage_options)  # fsspec caches the instance per process
        return fs, root.rstrip("/")

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    @property
    def atomic(self) -> bool:
        return backend_of(self.url).atomic

    def upload(self, local: str | os.PathLike[str], name: str) -> str:
        """Upload the local file as object ``name``; return its ETag ("" where the store has none)."""
        fs, root = self._fs()
        upload_file(fs, os.fspath(local), f"{root}/{name}", self.url_of(name), atomic=self.atomic)
        return self.etag(name)

    def etag(self, name: str) -> str:
        fs, root = self._fs()
        fs.invalidate_cache(f"{root}/{name}")
        info = object_info(fs, f"{root}/{name}", self.url_of(name))
        return str(info.get("ETag") or info.get("etag") or "")

    def size_and_etag(self, name: str) -> tuple[int, str] | None:
        fs, root = self._fs()
        fs.invalidate_cache(f"{root}/{name}")
        try:
            info = object_info(fs, f"{root}/{name}", self.url_of(name))
        except FileNotFoundError:
            return None
        return int(info.get("size") or 0), str(info.get("ETag") or info.get("etag") or "")

    def put(self, name: str, data: bytes) -> None:
        fs, root = self._fs()
        put_bytes(fs, f"{root}/{name}", data, self.url_of(name), atomic=self.atomic)

    def read(self, name: str) -> bytes:
        fs, root = self._fs()
        with RemoteFile(fs, f"{root}/{name}", self.url_of(name)) as f:
            return f.read()

    def remove(self, name: str) -> None:
        fs, root = self._fs()
        remove(fs, f"{root}/{name}", self.url_of(name))

    def names(self) -> list[str]:
        fs, root = self._fs()
        return list_names(fs, root, self.url)

    def upload_files(self, spool: str | os.PathLike[str], names: list[str]) -> dict[str, str]:
        """Upload the complete files ``names`` (companions first, the shard last) from the spool,
        removing each there once it is up; return their ETags."""
        etags = {}
        for name in names:
            local = os.path.join(spool, name)
            etags[name] = self.upload(local, name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local)
        return etags

    def record_done(self, done: ShardDone, etags: dict[str, str]) -> None:
        """Publish a shard's done-record (with its objects' ETags) in ``OUT/.stager-pack/``."""
        self.put(f"{STATE_DIR}/{done.info.name}{DONE_SUFFIX}", done.to_bytes(etags=etags))

    def hash_of(self, name: str, algo: str) -> tuple[int, str] | None:
        """``(bytes, digest)`` of object ``name``, downloaded and hashed; None when it is missing."""
        fs, root = self._fs()
        try:
            src = RemoteFile(fs, f"{root}/{name}", self.url_of(name))
        except FileNotFoundError:
            return None
        h = new_hasher(algo)
        for start in range(0, src.size, HASH_BLOCK):
            h.update(read_range(fs, src.path, start, min(src.size, start + HASH_BLOCK), src.url))
        return src.size, h.hexdigest()


def make_spool() -> str:
    """A fresh local directory for the shards being written (``$STAGER_SPOOL`` or the temp directory)."""
    base = os.environ.get(SPOOL_ENV) or None
    if base:
        os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix="stager-pack-spool-", dir=base)


def remove_spool(spool: str) -> None:
    shutil.rmtree(spool, ignore_errors=True)


# ---- resume --------------------------------------------------------------------------------------------
@dataclass
class RemoteState:
    """:class:`~stager.pack.resume.OutState` of a remote OUT, plus the ETags its done-records list."""

    found: OutState
    etags: dict[str, dict[str, str]] = field(default_factory=dict)  # shard -> object -> ETag


def survey_remote(remote: RemoteOut, shard_prefix: str) -> RemoteState:
    """What a previous run left under OUT (as :func:`stager.pack.resume.survey_out` does for a directory)."""
    found = OutState()
    state = RemoteState(found)
    names = remote.names()
    if MANIFEST_NAME in names:
        try:
            # Detached: kept shards must outlive the sample index object that clear_remote removes.
            found.manifest = load_manifest(remote.url, remote.storage_options).detached()
            found.owned.update(n for n, _, _ in found.manifest.files())
        except ManifestError as exc:
            found.damaged_manifest = str(exc)
    for n in names:
        if not n.startswith(STATE_DIR + "/"):
            continue
        base = n[len(STATE_DIR) + 1:]
        if base == PLAN_FILE:
            try:
                found.plan = json.loads(remote.read(n))
            except (FileNotFoundError, ValueError):
                continue
            found.owned.update(found.plan.get("names", []) if isinstance(found.plan, dict) else [])
            continue
        if done_record_shard(base) is None:
            continue
        try:
            d, meta = ShardDone.from_bytes(remote.read(n), remote.url_of(n))
        except (FileNotFoundError, ManifestError, ValueError, KeyError, TypeError):
            continue
        found.done[d.info.name] = d
        state.etags[d.info.name] = dict(meta.get("etags") or {})
        found.owned.add(d.info.name)
        found.owned.update(a.name for a in d.info.aux)
    for n in names:
        if n == MANIFEST_NAME or n.startswith(STATE_DIR + "/") or n in found.owned or partial_base(n) is not None:
            continue
        if is_index_file_name(n):
            found.owned.add(n)  # an earlier run's sample index
            continue
        if shard_prefix and n.startswith(shard_prefix) and found.plan is not None:
            continue  # uploaded before its done-record was written
        found.foreign.append(n)
    return state


def _same_object(remote: RemoteOut, entry: tuple[str, int, str], etag: str | None, algo: str) -> bool:
    """Whether object ``entry`` (name, bytes, hash) is the one recorded: its size and ETag, or
    without a recorded ETag its size and (downloaded) hash."""
    name, nbytes, digest = entry
    got = remote.size_and_etag(name)
    if got is None or got[0] != nbytes:
        return False
    if etag:
        return got[1] == etag
    got_hash = remote.hash_of(name, algo)
    return got_hash is not None and mismatch(Expected(name, nbytes, digest, algo), *got_hash) is None


def _intact(remote: RemoteOut, info: ShardInfo, etags: dict[str, str] | None, algo: str) -> bool:
    e = etags or {}
    return _same_object(remote, (info.name, info.bytes, info.hash), e.get(info.name), algo) and all(
        _same_object(remote, (a.name, a.bytes, a.hash), e.get(a.name), algo) for a in info.aux)


def find_reusable_remote(remote: RemoteOut, state: RemoteState, plan: PackPlan, algo: str) -> dict[str, ShardDone]:
    """Shards of a previous run this plan keeps (see the module docstring for how each is checked)."""
    found = state.found
    out: dict[str, ShardDone] = {}
    m = found.manifest
    if m is not None and m.hash_algo == algo and m.options.get("plan") == plan.fingerprint:
        # This very pack, complete: sizes only (``stager verify URL`` re-hashes).
        sizes = {n: b for n, b, _ in m.files()}
        if all((remote.size_and_etag(n) or (-1, ""))[0] == b for n, b in sizes.items()):
            return {info.name: ShardDone(info, [], 0, fp) for info, fp in
                    zip(m.shards, m.options.get("shard_plans") or [], strict=False)}
    for p in plan.shards:
        d = found.done.get(p.name)
        if d is not None and d.fingerprint == p.fingerprint and _intact(remote, d.info, state.etags.get(p.name), algo):
            out[p.name] = d
    if m is not None and m.hash_algo == algo:
        by_shard: dict[str, list[dict[str, str]]] = {}
        for s in m.skipped:
            by_shard.setdefault(s.get("shard", ""), []).append(s)
        for p, info, fp in zip(plan.shards, m.shards, m.options.get("shard_plans") or [], strict=False):
            if p.name not in out and p.name == info.name and p.fingerprint == fp and _intact(remote, info, None, algo):
                out[p.name] = ShardDone(info, by_shard.get(info.name, []), 0, fp)
    return out


def clear_remote(remote: RemoteOut, state: RemoteState, keep: dict[str, ShardDone], plan: PackPlan,
                 source: Source) -> None:
    """Make OUT hold only what this run keeps (the order of :func:`stager.pack.resume.clear_out`):
    the old manifest first, then ``plan.json``, then stale objects and records; kept shards' records
    are (re)written with their objects' ETags."""
    found = state.found
    remote.remove(MANIFEST_NAME)
    names = [s.name for s in plan.shards]
    remote.put(f"{STATE_DIR}/{PLAN_FILE}", json.dumps({
        "schema": PLAN_SCHEMA, "plan": plan.fingerprint, "source": source.describe(), "format": plan.format,
        "names": names}).encode())
    kept_files = {n for d in keep.values() for n in (d.info.name, *(a.name for a in d.info.aux))}
    plan_key = f"{STATE_DIR}/{PLAN_FILE}"
    for n in remote.names():
        stale_record = (n.startswith(STATE_DIR + "/") and n != plan_key
                        and done_record_shard(n[len(STATE_DIR) + 1:]) not in keep)
        if partial_base(n) is not None or (n in found.owned and n not in kept_files) or stale_record:
            remote.remove(n)
    for d in keep.values():
        files = (d.info.name, *(a.name for a in d.info.aux))
        remote.record_done(d, state.etags.get(d.info.name) or {n: remote.etag(n) for n in files})


def publish_remote(remote: RemoteOut, manifest: Manifest, spool: str | os.PathLike[str]) -> None:
    """Upload the sample index (written in the spool), then ``manifest.json`` (last: the pack is
    complete from here on); then remove the state objects and earlier runs' index objects."""
    path = manifest.write_index(spool)
    assert manifest.index is not None
    remote.upload_files(spool, [manifest.index.name])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    remote.put(MANIFEST_NAME, manifest.to_bytes())
    clean_state(remote)
    for n in remote.names():
        if is_index_file_name(n) and n != manifest.index.name:
            remote.remove(n)


def clean_state(remote: RemoteOut) -> None:
    for n in remote.names():
        if n.startswith(STATE_DIR + "/") or partial_base(n) is not None:
            remote.remove(n)

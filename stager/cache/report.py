"""What a cache holds, for ``stager cache ls`` and ``du``, and pinning (``stager cache pin|unpin``).

:func:`listing`: one row per dataset record (how much of it is present, its uses, last use, pinned),
the objects no record names, the leases and the last evictions. :func:`usage`: bytes against the
quota and the disk, and per dataset the bytes it alone holds and those it shares with others.
:func:`set_pinned`: a pinned dataset's objects are never evicted; a dataset is named by its id (or
a prefix of its digest) or by its source (whose manifest is read, so a dataset can be pinned before
it is first staged).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from typing import Any

from stager.cache.layout import object_key
from stager.cache.lease import junk_line, protected_keys, read_leases
from stager.cache.store import RECORD_SCHEMA, Cache, now_iso, record_files, record_int
from stager.errors import UsageError
from stager.fs.open import join
from stager.manifest import dataset_root, load_manifest, shard_root
from stager.redact import printable, redact


def _present(cache: Cache, rec: dict[str, Any]) -> tuple[int, int, int]:
    """(files, files the caller may use, their bytes) of a dataset record."""
    files = record_files(rec)
    have = [f for f in files if cache.find(f[1], f[2], f[3]) is not None]
    return len(files), len(have), sum(f[3] for f in have)


def _str(v: Any) -> str | None:
    """A record's free-text field as listed: a string with its control characters escaped, or None."""
    return printable(v) if isinstance(v, str) else None


def listing(cache: Cache, *, log_lines: int = 10) -> dict[str, Any]:
    """``stager cache ls``: every dataset record (what of it the caller may use), objects, leases (junk
    reported in one line, ``junk``) and the last evictions. Text that someone else wrote is escaped."""
    records = cache.records()
    objects = {o.key: o for o in cache.scan()}
    named: set[str] = set()
    rows = []
    for rec in records:
        files, have, have_bytes = _present(cache, rec)
        named.update(f[2] for f in record_files(rec))
        rows.append({"dataset_id": _str(rec.get("dataset_id")), "digest": _str(rec.get("digest")),
                     "source": _str(rec.get("source")), "files": files, "present": have,
                     "bytes": record_int(rec, "bytes"), "present_bytes": have_bytes,
                     "complete": files > 0 and have == files, "uses": record_int(rec, "uses"),
                     "last_used": _str(rec.get("last_used")), "pinned": rec.get("pinned") is True})
    orphans = [k for k in objects if k not in named]
    judged = read_leases(cache)
    leases = [{**le.to_json(), "name": printable(le.name)} for le in judged]
    evictions = [{k: (printable(v) if isinstance(v, str) else v) for k, v in e.items()}
                 for e in cache.read_log(log_lines)]
    return {"ok": True, "cache": cache.to_json(), "datasets": rows, "objects": len(objects),
            "bytes": sum(o.bytes for o in objects.values()), "unnamed_objects": len(orphans),
            "leases": leases, "junk": junk_line(judged, cache.leases_dir), "evictions": evictions}


def human_listing(rep: dict[str, Any]) -> str:
    c = rep["cache"]
    lines = [f"{printable(c['dir'])}: {c['kind']} cache of uid {c['owner']}, {rep['objects']} objects, "
             f"{rep['bytes'] / 1e9:.3f} GB (quota {printable(c['quota'])})"]
    for r in rep["datasets"]:
        state = "complete" if r["complete"] else f"{r['present']}/{r['files']} files"
        lines.append(f"  {r['dataset_id']}  {r['present_bytes'] / 1e9:8.3f} GB  {state:>14}  uses {r['uses']:<4} "
                     f"last {r['last_used'] or '-'}{'  PINNED' if r['pinned'] else ''}  {r['source']}")
    if rep["unnamed_objects"]:
        lines.append(f"  {rep['unnamed_objects']} objects no dataset record names")
    live = [le for le in rep["leases"] if le["live"]]
    if live:
        lines.append(f"  {len(live)} live leases: " + "; ".join(f"{le['what'] or le['kind']} (uid {le['uid']}, "
                                                                   f"{le['objects']} objects)" for le in live[:5]))
    if rep.get("junk"):
        lines.append(f"  {rep['junk']}")
    for e in rep["evictions"][-5:]:
        datasets = e.get("datasets")
        names = ", ".join(printable(d) for d in datasets if isinstance(d, str)) if isinstance(datasets, list) else ""
        size = e.get("bytes")
        size = size if isinstance(size, (int, float)) and not isinstance(size, bool) else 0
        lines.append(f"  evicted {e.get('time')}: {e.get('algo')}/{str(e.get('key'))[:16]} "
                     f"{size / 1e6:.1f} MB [{names}]: {e.get('reason')}")
    return "\n".join(lines)


def usage(cache: Cache) -> dict[str, Any]:
    objects = {o.key: o for o in cache.scan()}
    total = sum(o.bytes for o in objects.values())
    refs: Counter[str] = Counter()
    per: list[tuple[dict[str, Any], set[str]]] = []
    for rec in cache.records():
        keys = {f[2] for f in record_files(rec) if f[2] in objects}
        refs.update(keys)
        per.append((rec, keys))
    datasets = [{"dataset_id": _str(rec.get("dataset_id")), "source": _str(rec.get("source")),
                 "bytes": sum(objects[k].bytes for k in keys),
                 "unique_bytes": sum(objects[k].bytes for k in keys if refs[k] == 1),
                 "shared_bytes": sum(objects[k].bytes for k in keys if refs[k] > 1)} for rec, keys in per]
    live = protected_keys(cache, read_leases(cache), objects)
    disk = shutil.disk_usage(cache.root)
    quota = cache.quota_bytes if cache.quota_bytes is not None else cache.quota.resolve(disk.total, str(cache.root))
    return {"ok": True, "cache": cache.to_json(), "objects": len(objects), "bytes": total, "quota_bytes": quota,
            "disk_bytes": disk.total, "disk_free_bytes": disk.free,
            "in_use_bytes": sum(o.bytes for o in objects.values() if o.key in live),
            "linked_bytes": sum(o.bytes for o in objects.values() if o.nlink > 1 and cache.kind == "user"),
            "shared_bytes": sum(objects[k].bytes for k, n in refs.items() if n > 1), "datasets": datasets}


def human_usage(rep: dict[str, Any]) -> str:
    lines = [f"{rep['cache']['dir']}: {rep['bytes'] / 1e9:.3f} GB in {rep['objects']} objects, quota "
             f"{rep['quota_bytes'] / 1e9:.3f} GB ({rep['cache']['quota']}), disk {rep['disk_free_bytes'] / 1e9:.1f} of "
             f"{rep['disk_bytes'] / 1e9:.1f} GB free; in use by live jobs {rep['in_use_bytes'] / 1e9:.3f} GB, "
             f"hard-linked into destinations {rep['linked_bytes'] / 1e9:.3f} GB, shared by datasets "
             f"{rep['shared_bytes'] / 1e9:.3f} GB"]
    for d in rep["datasets"]:
        lines.append(f"  {d['dataset_id']}  {d['bytes'] / 1e9:8.3f} GB  (alone {d['unique_bytes'] / 1e9:.3f} GB, "
                     f"shared {d['shared_bytes'] / 1e9:.3f} GB)  {d['source']}")
    return "\n".join(lines)


def _record_of_source(cache: Cache, src: str) -> dict[str, Any]:
    """A dataset record built from SRC's manifest (the keys a stage of it would use)."""
    src = os.path.abspath(src) if "://" not in src else src
    m = load_manifest(src)
    root = shard_root(src, m)
    files: list[list[Any]] = []
    for s in m.shards:
        files.append([s.name, m.hash_algo, object_key(m.hash_algo, s.hash, join(root, s.name)), s.bytes])
        files += [[a.name, m.hash_algo, object_key(m.hash_algo, a.hash, join(root, a.name)), a.bytes] for a in s.aux]
    if m.index is not None:
        ix = m.index
        files.append([ix.name, m.hash_algo, object_key(m.hash_algo, ix.hash, join(dataset_root(src), ix.name)),
                      ix.bytes])
    digest = m.digest or m.compute_digest()
    rec = cache.read_record(digest) or {"schema": RECORD_SCHEMA, "digest": digest, "dataset_id": m.dataset_id,
                                        "first_cached": now_iso(), "uses": 0, "stages": [], "hit_bytes": 0,
                                        "filled_bytes": 0}
    rec.update(source=redact(src), algo=m.hash_algo, files=sorted(files), bytes=sum(int(f[3]) for f in files))
    return rec


def find_record(cache: Cache, ref: str) -> dict[str, Any]:
    """The record ``ref`` names: a dataset id or digest prefix, or a source path or URL."""
    if "/" in ref or os.path.exists(ref):
        return _record_of_source(cache, ref)
    matches = [r for r in cache.records() if str(r.get("digest", "")).startswith(ref)
               or str(r.get("dataset_id", "")) == ref]
    if len(matches) != 1:
        raise UsageError(f"{cache.root}: {'no' if not matches else len(matches)} cached datasets match {ref!r}; give "
                         "a dataset id from `stager cache ls` or the dataset's source path")
    return matches[0]


def set_pinned(cache: Cache, refs: list[str], pinned: bool) -> dict[str, Any]:
    if not cache.writable:
        raise UsageError(f"{cache.root}: only the cache's owner (uid {cache.owner}) pins or unpins")
    done = []
    for ref in refs:
        rec = find_record(cache, ref)
        rec["pinned"] = pinned
        cache.write_record(rec)
        done.append({"dataset_id": rec["dataset_id"], "source": rec.get("source"), "pinned": pinned,
                     "files": len(rec.get("files", [])), "bytes": rec.get("bytes", 0)})
    return {"ok": True, "cache": str(cache.root), "datasets": done}

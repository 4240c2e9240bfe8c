"""``stager cache verify DIR``: every object's bytes against its name, and the cache's own rules.

Each object is hashed again with its algorithm and compared with the hash its name carries; it must
also be read-only and the owner's. A damaged one is removed (the owner's run; a reader only reports),
so the next stage copies it again: a repair, never a deletion of anything but the cache's own copy.
Partial files whose filler is gone are removed too. Exit code 3 when anything was damaged.

A reader of a site cache checks what it may read: an object of a group it is not in (a licensed
dataset) is counted as ``not_readable`` and left alone, never reported damaged and never read.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from stager.cache.locks import lock_held
from stager.cache.seal import rehash
from stager.cache.store import Cache
from stager.fs.atomic import partial_base
from stager.progress import Progress


@dataclass
class VerifyReport:
    dir: str
    objects: int = 0
    bytes: int = 0
    damaged: list[dict[str, Any]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    partials_removed: int = 0
    not_readable: int = 0  # a reader's run: objects of groups it is not in, not checked

    @property
    def ok(self) -> bool:
        return not self.damaged

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "dir": self.dir, "objects": self.objects, "bytes": self.bytes, "damaged": self.damaged,
                "removed": self.removed, "partials_removed": self.partials_removed, "not_readable": self.not_readable}

    def summary(self) -> str:
        head = (f"{self.dir}: {self.objects} objects, {self.bytes / 1e9:.3f} GB verified"
                if self.ok else f"{self.dir}: {len(self.damaged)} of {self.objects} objects DAMAGED")
        lines = [head]
        lines += [f"  {d['object']}: {d['problem']}" for d in self.damaged[:20]]
        if self.removed:
            lines.append(f"  removed {len(self.removed)} damaged objects: the next stage copies them again")
        if self.not_readable:
            lines.append(f"  {self.not_readable} objects not readable by you (another group's dataset): not checked")
        return "\n".join(lines)


_EFFECTIVE = os.access in os.supports_effective_ids


def verify_cache(cache: Cache, *, quiet: bool = True, repair: bool = True) -> VerifyReport:
    """Hash every object of ``cache``; with ``repair`` (and ownership) remove damaged ones and dead
    fillers' partial files."""
    rep = VerifyReport(dir=str(cache.root))
    objects = list(cache.scan())
    progress = Progress("cache verify", total_items=len(objects), total_bytes=sum(o.bytes for o in objects),
                        unit="objects", quiet=quiet)
    try:
        for o in objects:
            rel = f"{o.algo}/{o.key}"
            problem = None
            if not cache.writable and not os.access(o.path, os.R_OK, effective_ids=_EFFECTIVE):
                rep.not_readable += 1
                progress.update(1, o.bytes)
                continue
            if o.uid != cache.owner:
                problem = f"owned by uid {o.uid}, not the cache's owner {cache.owner}"
            elif o.mode & 0o222:
                problem = f"writable (mode {o.mode:04o}): an object is read-only"
            else:
                problem = rehash(o.path, o.algo, o.key, o.bytes)
            rep.objects += 1
            rep.bytes += o.bytes
            progress.update(1, o.bytes)
            if problem is None:
                continue
            rep.damaged.append({"object": rel, "bytes": o.bytes, "problem": problem})
            if repair and cache.writable:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(o.path)
                    rep.removed.append(rel)
        if repair and cache.writable:
            for p in cache.partial_files():
                key = partial_base(p.name) or ""
                with contextlib.suppress(OSError):
                    if not lock_held(cache.locks_dir / key) and stat.S_ISREG(os.lstat(p).st_mode):
                        os.unlink(p)
                        rep.partials_removed += 1
    finally:
        progress.close()
    return rep

"""Seals: what an object was when its bytes were last verified, so a hit is re-hashed when it changed.

An object is hashed while it is filled; a later stage that finds it (a *hit*) links it without
reading it. A seal makes that safe against an object changed after its fill (written through a hard
link made writable, an editor, a tool run by its owner): it records the object's size, modification
time (ns) and inode at the moment it was verified, and that moment (:class:`Seal`). On a hit
(:class:`HitCheck`):

* the object still matches its seal: it is linked as "cached, verified at <seal time>";
* it does not (or has no seal: an object of a cache from before seals, or one a reader has no
  record for): it is re-hashed against its key (``stage --verify-cache`` re-hashes every hit); when
  the bytes match, it is linked as verified now (and its owner's stage seals it again); when they do
  not, the owner removes it (a repair: the stage fills it again) and a reader leaves it alone (the
  plain copy reads SRC). Either way the damage is said in one line, and never linked.

Why the modification time and not the change time (``ctime``): a user's cache hard-links its objects
into every DEST, and each link and each removal of a DEST changes the object's ``ctime``; so does the
LRU clock's touch. ``ctime`` would make every hit a re-hash. Every write to a file moves its ``mtime``
(stager never sets it: the LRU clock is the access time, :meth:`stager.cache.store.Cache.touch`), so
the seal catches a changed object; a byte a disk flips moves nothing, and ``--verify-cache`` or
``stager cache verify`` is what finds that.

Seals live in the dataset records (``seals``: key -> ``[bytes, mtime_ns, inode, verified]``), which
only the cache's owner writes (:meth:`stager.cache.store.Cache.note_stage`) and whose readers are
those the record's access lets in.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stager.cache.layout import is_object_name, key_hash
from stager.fs.verified import Expected, verify_file


@dataclass(frozen=True)
class Seal:
    """An object as it was when verified at ``verified`` (epoch seconds)."""

    bytes: int
    mtime_ns: int
    ino: int
    verified: float

    @classmethod
    def of(cls, st: os.stat_result, verified: float) -> Seal:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, verified)

    def matches(self, st: os.stat_result) -> bool:
        return (self.bytes, self.mtime_ns, self.ino) == (st.st_size, st.st_mtime_ns, st.st_ino)

    def to_json(self) -> list[Any]:
        return [self.bytes, self.mtime_ns, self.ino, self.verified]


def seals_of(rec: Mapping[str, Any] | None) -> dict[str, Seal]:
    """A dataset record's seals; entries that are not well formed are skipped."""
    out: dict[str, Seal] = {}
    raw = rec.get("seals") if rec is not None else None
    if not isinstance(raw, dict):
        return out
    for k, v in raw.items():
        if (isinstance(k, str) and is_object_name(k) and isinstance(v, list) and len(v) == 4
                and all(isinstance(x, int) and not isinstance(x, bool) for x in v[:3])
                and isinstance(v[3], (int, float)) and not isinstance(v[3], bool)):
            out[k] = Seal(v[0], v[1], v[2], float(v[3]))
    return out


def iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


def rehash(path: Path, algo: str, key: str, nbytes: int) -> str | None:
    """What is wrong with the object at ``path`` against its key and size, or None when its bytes are
    the ones its name says: ``read N bytes, expected M`` or ``<algo> checksum G, expected E``. (The
    one re-check of existing bytes, :func:`stager.fs.verified.verify_file`, which ``stager verify``
    uses too.)"""
    try:
        return verify_file(path, Expected(str(path), nbytes, key_hash(key), algo))
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


@dataclass
class HitCheck:
    """Checks the hits of one stage (module docstring). ``seals``: the dataset record's; ``everything``:
    re-hash every hit (``--verify-cache``); ``owner``: the caller owns the cache (it repairs). After the
    stage, :attr:`new` holds the seals to record, :attr:`verified` each file's verification time,
    :attr:`damaged` one line per object refused."""

    algo: str
    seals: dict[str, Seal]
    everything: bool = False
    owner: bool = False
    new: dict[str, Seal] = field(default_factory=dict)
    rehashed: int = 0
    damaged: list[str] = field(default_factory=list)

    def check(self, key: str, obj: Path, nbytes: int) -> float | None:
        """When ``obj`` (found for ``key``) was verified: its seal's time, or now after a re-hash; None
        when its bytes are not its name's (removed by the owner: fill it again)."""
        try:
            st = os.lstat(obj)
        except FileNotFoundError:
            return None
        seal = self.seals.get(key) or self.new.get(key)
        if seal is not None and not self.everything and seal.matches(st):
            return seal.verified
        now = time.time()
        why = rehash(obj, self.algo, key, nbytes)
        self.rehashed += 1
        if why is None:
            after = os.lstat(obj)
            if (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino):
                self.new[key] = Seal.of(st, now)
                return now
            why = "it changed while it was re-hashed"
        changed = "changed since it was verified" if seal is not None else "not sealed"
        self.damaged.append(f"{obj}: a cached object {changed}, re-hashed: {why}; "
                            + ("removed, filled again from SRC" if self.owner else "not used, copied from SRC"))
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(obj)
        return None

    def filled(self, key: str, obj: Path, when: float | None = None) -> None:
        """Seal an object this stage (or one just before it, under the fill lock) filled and verified."""
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(obj)
            self.new[key] = Seal.of(st, st.st_mtime if when is None else when)

    def summary(self) -> str | None:
        if not self.damaged:
            return None
        n = len(self.damaged)
        return f"{n} cached object{'s' if n != 1 else ''} did not match {'their' if n != 1 else 'its'} name " \
               f"(first: {self.damaged[0]})"


__all__ = ["HitCheck", "Seal", "iso", "rehash", "seals_of"]

"""The engine of ``stager clean DEST``: remove what ``stager stage`` wrote into DEST, by its own records, only.

The records, in the order they are looked for:

* **the receipt** (a finished stage): the paths its ``files`` list names (shards, companion files,
  ``manifest.json``, the sample index, journals, shared-mode markers, the unpacked tree, the receipt
  itself, last), plus stale partial files of those names;
* **the journal** (a failed or interrupted stage, or a damaged receipt): every stage records in
  ``.stager-journal[.node<i>].jsonl`` the names it may write before it creates anything
  (:meth:`stager.stage.journal.Journal.begin`), and each file it verified; clean removes those names,
  their partial files (:data:`stager.fs.atomic.PARTIAL_RE`), the unpacked tree's files the manifest
  names, the stage's lock, then the journal, last;
* **a mix receipt** (``stager-mix.json``): each stream's copy, by its own records.

First of all, with the lock held, what ``stage --mount`` recorded is unmounted
(:func:`stager.stage.mount.unmount_recorded`): its mount points, ``mnt`` and the record go too.

A DEST with none of them is refused (exit 2), as is a record naming anything but a plain name inside
DEST (absolute, ``..``, a subdirectory): then nothing at all is removed. Everything else in DEST is
left where it is, and the result says what was left (``left``). DEST itself is removed only when the
stage created it (no DEST was given) and it is empty.

Order and safety (docs/security.md): DEST is opened once, without following a link, and must be the
user's (or root's) and not writable by others (else exit 2: someone else could swap what is in it).
Then the node lock (for a journal: the lock of each journal's node) is taken, so a running ``stage``
is not undercut, and only then are the records read and checked: what is removed is decided with
the lock held. Every removal is relative to the DEST handle (:class:`stager.fs.safe.SafeDir`): a name
that became a symlink is removed as a link, never followed; the unpacked tree is walked through
directory handles, never leaving it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from stager.errors import DestinationError, StagerError, UnsafeArchiveError
from stager.fs.atomic import partial_base
from stager.fs.lock import NodeLock
from stager.fs.safe import SafeDir
from stager.manifest import MIX_RECEIPT_NAME, RECEIPT_NAME, class_dir_name, load_manifest, unpacked_stem
from stager.receipt import Receipt, parse_receipt
from stager.stage.journal import JournalRecords, read_records
from stager.stage.mount import unmount_recorded
from stager.stage.names import JOURNAL_RE, LOCK_RE, lock_name, node_of

DEST_FIX = "run clean as the user who staged it; if it is yours, chmod go-w it first"
SHOWN_LEFT = 8  # entries left in DEST named in the result


@dataclass
class _Removal:
    """What one clean removed (or would remove): names relative to DEST, and bytes."""

    removed: list[str] = field(default_factory=list)
    freed: int = 0
    records: str = "receipt"  # what decided: "receipt", "journal" or "mix receipt"


def clean(dest: str | os.PathLike[str], *, dry_run: bool = False, timeout: float | None = 600.0) -> dict[str, Any]:
    """Remove the staged copy in ``dest`` (see the module docstring); return ``{"dest", "removed",
    "files_removed", "bytes_freed", "records", "left", "dry_run", "dest_removed"}``."""
    d = Path(os.path.abspath(dest))
    try:
        handle = SafeDir.open(d, what="staging destination", fix=DEST_FIX)
    except FileNotFoundError:
        raise DestinationError(f"{d}: no such directory") from None
    with handle:
        if handle.lstat(RECEIPT_NAME) is None and handle.lstat(MIX_RECEIPT_NAME) is not None:
            return _clean_mix(handle, dry_run=dry_run, timeout=timeout)
        rec = _receipt_or_none(handle, fallback=bool(_bookkeeping(handle)))
        if rec is not None:
            done, created = _clean_by_receipt(handle, rec, dry_run=dry_run, timeout=timeout)
        else:
            done, created = _clean_by_journals(handle, dry_run=dry_run, timeout=timeout)
        left = [] if dry_run else sorted(n for n, _ in handle.entries())
        dir_removed = not dry_run and created and not left and _rmdir_if_empty(handle)
    return {"ok": True, "dest": str(d), "removed": done.removed, "files_removed": len(done.removed),
            "bytes_freed": done.freed, "records": done.records, "left": left[:SHOWN_LEFT], "left_count": len(left),
            "dry_run": dry_run, "dest_removed": dir_removed}


# ---- the records ----------------------------------------------------------------------------------
def _receipt_or_none(d: SafeDir, *, fallback: bool) -> Receipt | None:
    """DEST's receipt; None when there is none (or, with ``fallback``, a journal to go by instead of a
    damaged one). Without a receipt and a journal: :class:`DestinationError`."""
    data = d.read_bytes(RECEIPT_NAME, what="staging receipt")
    if data is None:
        if fallback:
            return None
        raise DestinationError(f"{d.path}: no {RECEIPT_NAME} and no staging journal or lock; refusing to delete "
                               "anything (stager clean only removes what stager staged, by its records)")
    try:
        return parse_receipt(data, d.join(RECEIPT_NAME))
    except StagerError:
        if fallback:
            return None  # a damaged receipt: the journal says what the stage wrote
        raise


def _journals(d: SafeDir) -> list[str]:
    """The stage journals in DEST (node-private, or one per node on a shared DEST), sorted."""
    return sorted(n for n in os.listdir(d.fd) if JOURNAL_RE.match(n))


def _bookkeeping(d: SafeDir) -> list[str]:
    """Stage's journals and locks in DEST, and their partial files (a stage killed while it created
    its journal leaves only those), sorted."""
    def own(n: str) -> bool:
        base = partial_base(n) or n
        return bool(JOURNAL_RE.match(base) or LOCK_RE.match(base))
    return sorted(n for n in os.listdir(d.fd) if own(n))


def _plain(names: Iterable[str], where: str) -> list[str]:
    """``names`` if each is a plain name inside DEST; else :class:`UnsafeArchiveError`, nothing removed."""
    out = []
    for rel in names:
        pp = PurePosixPath(rel)
        if not rel or pp.is_absolute() or len(pp.parts) != 1 or rel in (".", "..") or pp.name != rel:
            raise UnsafeArchiveError(f"{where}: lists {rel!r}, which is not a plain name inside DEST; removing nothing")
        out.append(rel)
    return out


def _receipt_names(d: SafeDir, rec: Receipt) -> list[str]:
    """The receipt's entries (less the receipt itself) as plain names inside DEST."""
    names = [n for n in rec.files if n != RECEIPT_NAME]
    if rec.unpacked:
        rel = rec.unpacked
        if os.path.isabs(rel):
            # A tree written inside the receipt's DEST is that DEST's, wherever DEST was moved since (mv).
            inside = rec.dest and os.path.dirname(rel.rstrip("/")) == rec.dest.rstrip("/")
            rel = os.path.basename(rel.rstrip("/")) if inside else os.path.relpath(rel, d.path)
        if rel not in names:
            names.append(rel)
    return _plain(names, d.join(RECEIPT_NAME))


def _unpacked_stems(d: SafeDir, digest: str | None = None) -> set[str] | None:
    """``<class>/<stem>`` of every file ``stage --unpack`` writes for DEST's manifest (the extension
    comes from the shard, so files are matched without it); None if the manifest is unreadable or
    (with ``digest``) of another dataset. The manifest is read through the DEST handle."""
    try:
        m = load_manifest(d.via_handle())
    except (StagerError, OSError):
        return None
    if digest is not None and m.digest != digest:
        return None
    stems = set()
    for s in m.shards:
        for key, label in zip(s.keys, s.labels.tolist(), strict=True):
            cls = class_dir_name(m.classes, label)
            stems.add(f"{cls}/{unpacked_stem(key, cls)}")
    return stems


def _not_staged(stems: set[str] | None) -> Callable[[str], bool]:
    """``keep(relative path)`` for the unpacked tree: files stage did not write (all, without stems).
    A file is stage's when its path, less its extension, is a sample's ``<class>/<stem>``."""
    def keep(rel: str) -> bool:
        if stems is None:
            return True
        head, _, base = rel.rpartition("/")
        stem = base.rpartition(".")[0] or base
        return f"{head}/{stem}" not in stems and f"{head}/{base}" not in stems
    return keep


# ---- removing -------------------------------------------------------------------------------------
def _clean_by_receipt(handle: SafeDir, rec: Receipt, *, dry_run: bool, timeout: float | None
                      ) -> tuple[_Removal, bool]:
    """A finished stage: what its receipt lists, decided again with its node lock held."""
    d = Path(handle.path)
    lock = _lock_name(rec)
    with NodeLock(d / lock, timeout=timeout, directory=handle):
        data = handle.read_bytes(RECEIPT_NAME, what="staging receipt")
        if data is None:
            raise DestinationError(f"{d}: the receipt went away while waiting for the lock (another clean?); "
                                   "nothing removed")
        rec = parse_receipt(data, handle.join(RECEIPT_NAME))  # with the lock held: what is removed is decided now
        if _lock_name(rec) != lock:
            raise DestinationError(f"{d}: the receipt changed while waiting for the lock; nothing removed")
        return _clean_by_receipt_locked(handle, rec, dry_run=dry_run)


def _lock_name(rec: Receipt) -> str:
    return lock_name(rec.partition["node"] if rec.mode == "shared" and rec.partition else None)


def _clean_by_journals(handle: SafeDir, *, dry_run: bool, timeout: float | None) -> tuple[_Removal, bool]:
    """A stage that never finished: what its journals say it writes, with every journal's lock held
    (a stage still running is waited for, up to ``timeout``)."""
    d = Path(handle.path)
    with contextlib.ExitStack() as locks:
        for lock in sorted({lock_name(node_of(partial_base(n) or n)) for n in _bookkeeping(handle)}):
            locks.enter_context(NodeLock(d / lock, timeout=timeout, directory=handle))
        rec = _receipt_or_none(handle, fallback=True)  # the stage may have finished while we waited
        if rec is not None:
            return _clean_by_receipt_locked(handle, rec, dry_run=dry_run)
        unmounted = unmount_recorded(handle, dry_run=dry_run)  # before anything under a mount goes
        journals = _journals(handle)
        records = [_read_journal(handle, j) for j in journals]
        names = sorted(set().union(*(r.writes | r.files for r in records)) - set(journals))
        names = _plain(names, handle.join(journals[0]) if journals else handle.path)
        unpack_dirs = set().union(*(r.unpack_dirs for r in records)) & set(names)
        digests = {r.digest for r in records}
        stems = _unpacked_stems(handle, digests.pop() if len(digests) == 1 else "") if unpack_dirs else None
        bases = [*names, *(partial_base(n) or n for n in _bookkeeping(handle))]
        # Data first, the journals last: a clean that is itself interrupted can be run again.
        done = _remove(handle, [*names, *_partials(handle, bases), *journals], stems, dry_run=dry_run)
        done.removed[:0] = unmounted
        done.records = "journal"
    return done, any(r.created_dest for r in records)


def _clean_by_receipt_locked(handle: SafeDir, rec: Receipt, *, dry_run: bool) -> tuple[_Removal, bool]:
    """Remove what ``rec`` lists (its lock held), and what the journals of its dataset say earlier runs
    wrote (an unpacked tree that a later plain stage's receipt no longer names); return it and whether
    stage created DEST."""
    unmounted = unmount_recorded(handle, dry_run=dry_run)  # stage --mount's mounts, before anything under them goes
    names = _receipt_names(handle, rec)
    earlier, unpack_dirs = _journaled(handle, rec, exclude={*names, RECEIPT_NAME})
    stems = _unpacked_stems(handle) if rec.unpacked or unpack_dirs else None  # before manifest.json goes
    names = [*earlier, *names]  # data first; the journals (in the receipt's names) and the receipt last
    done = _remove(handle, [*names, *_partials(handle, names), RECEIPT_NAME], stems, dry_run=dry_run)
    done.removed[:0] = unmounted
    return done, bool(rec.stats.get("created_dest"))


def _journaled(handle: SafeDir, rec: Receipt, exclude: set[str]) -> tuple[list[str], set[str]]:
    """Names that journals of ``rec``'s dataset in DEST record and ``exclude`` lacks (plain names inside
    DEST, else :class:`UnsafeArchiveError`), and which of them are unpacked trees."""
    names: set[str] = set()
    unpack_dirs: set[str] = set()
    for j in _journals(handle):
        got = _read_journal(handle, j)
        if got.digest and rec.manifest_digest.endswith(got.digest):
            more = sorted((got.writes | got.files) - exclude - set(_journals(handle)))
            names.update(_plain(more, handle.join(j)))
            unpack_dirs |= got.unpack_dirs
    return sorted(names), unpack_dirs & names


def _read_journal(handle: SafeDir, name: str) -> JournalRecords:
    data = handle.read_bytes(name, what="staging journal", limit=1 << 30)
    return read_records(data or b"")


def _partials(handle: SafeDir, bases: Iterable[str]) -> list[str]:
    """Partial files (``<base>.<12 hex>.partial``, regular) of ``bases`` in DEST."""
    base = set(bases)
    return sorted(n for n, st in handle.entries() if partial_base(n) in base and not stat.S_ISDIR(st.st_mode))


def _remove(handle: SafeDir, names: list[str], stems: set[str] | None, *, dry_run: bool) -> _Removal:
    """Remove ``names`` (in that order) relative to ``handle``; a directory (the unpacked tree) keeps the
    files :func:`_not_staged` says the stage did not write."""
    done = _Removal()
    seen: set[str] = set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        st = handle.lstat(name)
        if st is None:
            continue
        keep = _not_staged(stems) if stat.S_ISDIR(st.st_mode) else None
        _, nbytes = handle.remove(name, keep=keep, dry_run=dry_run)
        done.freed += nbytes
        done.removed.append(name)
    return done


def _clean_mix(handle: SafeDir, *, dry_run: bool, timeout: float | None) -> dict[str, Any]:
    """A staged mix (``stager stage MIX.yaml DEST``): clean every stream's copy its mix receipt names (each
    by its own records, through :func:`clean`, so each stream gets the same checks), then the mix receipt,
    relative to the DEST handle; DEST itself when left empty."""
    d = Path(handle.path)
    data = handle.read_bytes(MIX_RECEIPT_NAME, what="mix receipt")
    try:
        dirs = [str(s["dir"]) for s in json.loads(data or b"")["streams"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DestinationError(f"{d / MIX_RECEIPT_NAME}: unreadable mix receipt ({exc}); refusing to delete anything"
                               ) from exc
    dirs = _plain(dirs, str(d / MIX_RECEIPT_NAME))  # every name a plain name inside DEST, or nothing is removed
    removed: list[str] = []
    freed = 0
    for name in dirs:
        st = handle.lstat(name)
        if st is None or not stat.S_ISDIR(st.st_mode):
            continue  # a stream that was never staged here (or is already clean); a link is never followed
        with handle.subdir(name, what="staged stream") as sub:
            if sub.lstat(RECEIPT_NAME) is None and not _bookkeeping(sub):
                continue
        got = clean(d / name, dry_run=dry_run, timeout=timeout)
        removed += [f"{name}/{r}" for r in got["removed"]]
        freed += got["bytes_freed"]
        if not dry_run:
            with contextlib.suppress(OSError):
                handle.rmdir(name)
    st = handle.lstat(MIX_RECEIPT_NAME)
    removed.append(MIX_RECEIPT_NAME)
    freed += st.st_size if st is not None else 0
    dir_removed = False
    left: list[str] = []
    if not dry_run:
        handle.unlink(MIX_RECEIPT_NAME)
        left = sorted(n for n, _ in handle.entries())
        dir_removed = not left and _rmdir_if_empty(handle)
    return {"ok": True, "dest": str(d), "removed": removed, "files_removed": len(removed), "bytes_freed": freed,
            "records": "mix receipt", "left": left[:SHOWN_LEFT], "left_count": len(left), "dry_run": dry_run,
            "dest_removed": dir_removed}


def _rmdir_if_empty(handle: SafeDir) -> bool:
    """Remove DEST itself when stage created it and it is now empty, checked to be the directory we hold."""
    with contextlib.suppress(OSError), SafeDir.open(os.path.dirname(handle.path), check=False) as parent:
        name = os.path.basename(handle.path)
        st = parent.lstat(name)
        if st is not None and (st.st_dev, st.st_ino) == (handle.st.st_dev, handle.st.st_ino):
            return parent.rmdir(name)
    return False


__all__ = ["clean"]

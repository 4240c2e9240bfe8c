"""``stager clean DEST``: remove what ``stager stage`` put in DEST, and nothing else.

Only the paths the receipt's ``files`` list names are removed (shards, companion files,
``manifest.json``, journals, shared-mode markers, the unpacked tree, the receipt itself, last),
plus stale ``.partial`` files of those names. A DEST without a receipt is refused, as is a receipt
naming anything but a plain name inside DEST (absolute, ``..``, a subdirectory): then nothing at all
is removed.

Order and safety (docs/security.md): DEST is opened once, without following a link, and must be
the user's (or root's) and not writable by others (else exit 2: someone else could swap what is in
it). Then the node lock is taken, so a concurrent ``stage`` is not undercut, and only then is the
receipt read and checked: what is removed is decided with the lock held. Every removal is relative
to the DEST handle (:class:`stager.fs.safe.SafeDir`): a name that became a symlink is removed as a
link, never followed; the unpacked tree is walked through directory handles, never leaving it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from stager.cli import add_common, emit
from stager.errors import DestinationError, StagerError, UnsafeArchiveError

if TYPE_CHECKING:
    from stager.fs.safe import SafeDir
    from stager.receipt import Receipt

# stager.receipt.RECEIPT_NAME, spelled out so that registering the command does not import numpy
# (stager.receipt and stager.stage are imported in clean(); a test holds them equal).
RECEIPT_NAME = "stager-receipt.json"
DEST_FIX = "run clean as the user who staged it; if it is yours, chmod go-w it first"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("clean", help="remove a staged copy (only what its receipt lists)",
                       description="Remove the files `stager stage` wrote into DEST, as listed by its receipt. "
                       "Refuses a DEST without a receipt. Exit codes: 0 ok, 2 no receipt, 3 unsafe receipt.")
    p.add_argument("dest", metavar="DEST", help="a staging destination (holds stager-receipt.json)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a running stage (default 600)")
    add_common(p)
    p.set_defaults(func=run)


def _checked_names(dest: Path, rec: Receipt) -> list[str]:
    """The receipt's entries (less the receipt itself) as plain names inside DEST; refuses anything else."""
    names = [n for n in rec.files if n != RECEIPT_NAME]
    if rec.unpacked:
        rel = os.path.relpath(rec.unpacked, dest) if os.path.isabs(rec.unpacked) else rec.unpacked
        if rel not in names:
            names.append(rel)
    for rel in names:
        pp = PurePosixPath(rel)
        if not rel or pp.is_absolute() or len(pp.parts) != 1 or rel in (".", "..") or pp.name != rel:
            raise UnsafeArchiveError(
                f"{dest / RECEIPT_NAME}: lists {rel!r}, which is not a plain name inside DEST; removing nothing"
            )
    return names


def _unpacked_stems(d: SafeDir) -> set[str] | None:
    """``<class>/<stem>`` of every file ``stage --unpack`` writes for DEST's manifest (the
    extension comes from the shard, so files are matched without it); None if the manifest is unreadable.
    The manifest is read through the DEST handle."""
    from stager.manifest import load_manifest
    from stager.stage.unpack import class_dir_name, unpacked_stem

    try:
        m = load_manifest(d.via_handle())
    except (StagerError, OSError):
        return None
    stems = set()
    for s in m.shards:
        for key, label in zip(s.keys, s.labels.tolist(), strict=True):
            cls = class_dir_name(m.classes, label)
            stems.add(f"{cls}/{unpacked_stem(key, cls)}")
    return stems


def _not_staged(stems: set[str] | None) -> Any:
    """``keep(relative path)`` for the unpacked tree: files stage did not write (all, without stems)."""
    def keep(rel: str) -> bool:
        if stems is None:
            return True
        head, _, base = rel.rpartition("/")
        return f"{head}/{base.split('.', 1)[0]}" not in stems
    return keep


def _read_receipt(d: SafeDir) -> Receipt:
    from stager.receipt import parse_receipt

    data = d.read_bytes(RECEIPT_NAME, what="staging receipt")
    if data is None:
        raise DestinationError(
            f"{d.path}: no {RECEIPT_NAME}; refusing to delete anything (stager clean only removes what stager staged)"
        )
    return parse_receipt(data, d.join(RECEIPT_NAME))


def _lock_name(rec: Receipt) -> str:
    from stager.stage.names import lock_name

    return lock_name(rec.partition["node"] if rec.mode == "shared" and rec.partition else None)


def clean(dest: str | os.PathLike[str], *, dry_run: bool = False, timeout: float | None = 600.0) -> dict[str, Any]:
    """Remove the staged copy in ``dest``; return ``{"dest", "removed", "bytes_freed", "dry_run"}``."""
    from stager.fs.lock import NodeLock
    from stager.fs.safe import SafeDir

    d = Path(os.path.abspath(dest))
    try:
        handle = SafeDir.open(d, what="staging destination", fix=DEST_FIX)
    except FileNotFoundError:
        raise DestinationError(f"{d}: no such directory") from None
    with handle:
        lock = _lock_name(_read_receipt(handle))  # which lock to take; decided on again below
        with NodeLock(d / lock, timeout=timeout, directory=handle):
            rec = _read_receipt(handle)  # with the lock held: what is removed is decided now
            if _lock_name(rec) != lock:
                raise DestinationError(f"{d}: the receipt changed while waiting for the lock; rerun")
            removed, freed = _remove(handle, rec, dry_run=dry_run)
        dir_removed = not dry_run and bool(rec.stats.get("created_dest")) and _rmdir_if_empty(handle)
    return {"ok": True, "dest": str(d), "removed": removed, "files_removed": len(removed), "bytes_freed": freed,
            "dry_run": dry_run, "dest_removed": dir_removed}


def _remove(handle: SafeDir, rec: Receipt, *, dry_run: bool) -> tuple[list[str], int]:
    """Remove the receipt's entries, their stale partials and the receipt, relative to ``handle``."""
    from stager.fs.atomic import partial_base

    d = Path(handle.path)
    names = _checked_names(d, rec)
    base = set(names)
    partials = sorted(n for n, st in handle.entries() if partial_base(n) in base and not stat.S_ISDIR(st.st_mode))
    stems = _unpacked_stems(handle) if rec.unpacked else None  # before manifest.json goes
    removed: list[str] = []
    freed = 0
    for name in [*names, *partials, RECEIPT_NAME]:
        st = handle.lstat(name)
        if st is None:
            continue
        keep = _not_staged(stems) if stat.S_ISDIR(st.st_mode) else None
        _, nbytes = handle.remove(name, keep=keep, dry_run=dry_run)
        freed += nbytes
        removed.append(name)
    return removed, freed


def _rmdir_if_empty(handle: SafeDir) -> bool:
    """Remove DEST itself when stage created it and it is now empty, checked to be the directory we hold."""
    from stager.fs.safe import SafeDir

    with contextlib.suppress(OSError), SafeDir.open(os.path.dirname(handle.path), check=False) as parent:
        name = os.path.basename(handle.path)
        st = parent.lstat(name)
        if st is not None and (st.st_dev, st.st_ino) == (handle.st.st_dev, handle.st.st_ino):
            return parent.rmdir(name)
    return False


def run(args: argparse.Namespace) -> int:
    res = clean(args.dest, dry_run=args.dry_run, timeout=args.timeout)
    verb = "would remove" if res["dry_run"] else "removed"
    emit(args, res, f"{res['dest']}: {verb} {res['files_removed']} entries ({res['bytes_freed'] / 1e9:.3f} GB)")
    return 0

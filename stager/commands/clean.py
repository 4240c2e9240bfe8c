"""``stager clean DEST``: remove what ``stager stage`` put in DEST, and nothing else.

Only the paths the receipt's ``files`` list names are removed (shards, companion files,
``manifest.json``, journals, shared-mode markers, the unpacked tree, the receipt itself, last),
plus stale ``.partial`` files of those names. A DEST without a receipt is refused, as is a receipt
naming a path outside DEST (absolute, ``..``, or resolving elsewhere through a symlink): then
nothing at all is removed. The node lock is held so a concurrent ``stage`` is not undercut.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path, PurePosixPath
from typing import Any

from stager.cli import add_common, emit
from stager.errors import DestinationError, StagerError, UnsafeArchiveError
from stager.fs.atomic import partial_base
from stager.fs.lock import NodeLock

# stager.receipt.RECEIPT_NAME, spelled out so that registering the command does not import numpy
# (stager.receipt and stager.stage are imported in clean(); a test holds them equal).
RECEIPT_NAME = "stager-receipt.json"
MIX_RECEIPT_NAME = "stager-mix.json"  # stager.receipt.MIX_RECEIPT_NAME: a staged mix, one stream per subdirectory


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("clean", help="remove a staged copy (only what its receipt lists)",
                       description="Remove the files `stager stage` wrote into DEST, as listed by its receipt. "
                       "Refuses a DEST without a receipt. Exit codes: 0 ok, 2 no receipt, 3 unsafe receipt.")
    p.add_argument("dest", metavar="DEST", help="a staging destination (holds stager-receipt.json, or a staged mix's "
                   "stager-mix.json: then every stream's copy is cleaned)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a running stage (default 600)")
    add_common(p)
    p.set_defaults(func=run)


def _checked_targets(dest: Path, names: list[str]) -> list[Path]:
    real_dest = os.path.realpath(dest)
    out = []
    for rel in names:
        pp = PurePosixPath(rel)
        if not rel or pp.is_absolute() or ".." in pp.parts or rel in (".", "./"):
            raise UnsafeArchiveError(
                f"{dest / RECEIPT_NAME}: lists {rel!r}, which is not inside DEST; removing nothing"
            )
        p = dest / rel
        parent = os.path.realpath(p.parent)
        if parent != real_dest and not parent.startswith(real_dest + os.sep):
            raise UnsafeArchiveError(f"{dest / RECEIPT_NAME}: {rel!r} resolves outside {dest}; removing nothing")
        out.append(p)
    return out


def _size_of(p: Path) -> int:
    try:
        if p.is_symlink() or not p.is_dir():
            return p.lstat().st_size
        total = 0
        for root, _dirs, files in os.walk(p):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, f)).st_size
        return total
    except OSError:
        return 0


def _unpacked_stems(d: Path) -> set[str] | None:
    """``<class>/<stem>`` of every file ``stage --unpack`` writes for DEST's manifest (the
    extension comes from the shard, so files are matched without it); None if the manifest is unreadable."""
    from stager.manifest import load_manifest
    from stager.stage.unpack import class_dir_name, unpacked_stem

    try:
        m = load_manifest(d)
    except StagerError:
        return None
    stems = set()
    for s in m.shards:
        for key, label in zip(s.keys, s.labels.tolist(), strict=True):
            cls = class_dir_name(m.classes, label)
            stems.add(f"{cls}/{unpacked_stem(key, cls)}")
    return stems


def _remove_unpacked(tree: Path, stems: set[str] | None) -> None:
    """Remove the files of an unpacked tree that stage wrote, then the directories left empty.

    Anything else (a file a user added) stays, with the directories that hold it. Without a readable
    manifest (``stems`` None) nothing in the tree is removed.
    """
    if stems is None:
        return
    for dirpath, _dirs, files in os.walk(tree, topdown=False):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), tree)
            head, _, base = rel.rpartition("/")
            if f"{head}/{base.split('.', 1)[0]}" in stems:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, f))
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)  # only when empty


def clean(dest: str | os.PathLike[str], *, dry_run: bool = False, timeout: float | None = 600.0) -> dict[str, Any]:
    """Remove the staged copy in ``dest``; return ``{"dest", "removed", "bytes_freed", "dry_run"}``."""
    from stager.receipt import load_receipt
    from stager.stage.names import lock_name

    d = Path(os.path.abspath(dest))
    if not d.is_dir():
        raise DestinationError(f"{d}: no such directory")
    rec = load_receipt(d)
    if rec is None and (d / MIX_RECEIPT_NAME).is_file():
        return _clean_mix(d, dry_run=dry_run, timeout=timeout)
    if rec is None:
        raise DestinationError(
            f"{d}: no {RECEIPT_NAME}; refusing to delete anything (stager clean only removes what stager staged)"
        )
    names = [n for n in rec.files if n != RECEIPT_NAME]
    if rec.unpacked:
        rel = os.path.relpath(rec.unpacked, d) if os.path.isabs(rec.unpacked) else rec.unpacked
        if rel not in names:
            names.append(rel)
    targets = _checked_targets(d, names)
    base = {p.name for p in targets}
    removed: list[str] = []
    freed = 0
    shared_node = rec.partition["node"] if rec.mode == "shared" and rec.partition else None
    stems = _unpacked_stems(d) if rec.unpacked else None  # before manifest.json goes
    with NodeLock(d / lock_name(shared_node), timeout=timeout):
        partials = [d / e.name for e in os.scandir(d) if partial_base(e.name) in base]
        for p in [*targets, *partials, d / RECEIPT_NAME]:
            if not os.path.lexists(p):
                continue
            freed += _size_of(p)
            removed.append(str(p.relative_to(d)))
            if dry_run:
                continue
            if p.is_dir() and not p.is_symlink():
                _remove_unpacked(p, stems)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
    dir_removed = False
    if not dry_run and rec.stats.get("created_dest"):
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty
            dir_removed = True
    return {"ok": True, "dest": str(d), "removed": removed, "files_removed": len(removed), "bytes_freed": freed,
            "dry_run": dry_run, "dest_removed": dir_removed}


def _clean_mix(d: Path, *, dry_run: bool, timeout: float | None) -> dict[str, Any]:
    """A staged mix (``stager stage MIX.yaml DEST``): clean every stream's copy its mix receipt names (each
    by its own receipt), then the mix receipt; DEST itself when left empty."""
    import json

    path = d / MIX_RECEIPT_NAME
    try:
        doc = json.loads(path.read_bytes())
        dirs = [str(s["dir"]) for s in doc["streams"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DestinationError(f"{path}: unreadable mix receipt ({exc}); refusing to delete anything") from exc
    targets = _checked_targets(d, dirs)  # every name inside DEST, or nothing is removed
    removed: list[str] = []
    freed = 0
    for t in targets:
        if not (t / RECEIPT_NAME).is_file():
            continue  # a stream that was never staged here (or is already clean)
        got = clean(t, dry_run=dry_run, timeout=timeout)
        removed += [f"{t.name}/{r}" for r in got["removed"]]
        freed += got["bytes_freed"]
        if not dry_run:
            with contextlib.suppress(OSError):
                t.rmdir()
    removed.append(MIX_RECEIPT_NAME)
    freed += _size_of(path)
    dir_removed = False
    if not dry_run:
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()
            dir_removed = True
    return {"ok": True, "dest": str(d), "removed": removed, "files_removed": len(removed), "bytes_freed": freed,
            "dry_run": dry_run, "dest_removed": dir_removed}


def run(args: argparse.Namespace) -> int:
    res = clean(args.dest, dry_run=args.dry_run, timeout=args.timeout)
    verb = "would remove" if res["dry_run"] else "removed"
    emit(args, res, f"{res['dest']}: {verb} {res['files_removed']} entries ({res['bytes_freed'] / 1e9:.3f} GB)")
    return 0

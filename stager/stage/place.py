"""Where DEST may be: the one check, before anything is written, for every kind of stage.

A stage writes into DEST and ``stager clean`` later removes what it wrote, so a DEST that is the
dataset itself, or shares files with it, loses data: ``stager stage P P`` followed by the README's
``trap ... clean`` would delete the original pack. :func:`check_dest_place` refuses (one line,
:class:`~stager.errors.DestinationError`, exit 2), for the plain, ``--unpack``, ``--partition``,
``--shared``, ``--cache`` and collective stage alike (all go through
:func:`stager.stage.dest.make_dest_dir`), a DEST that

* **is SRC, lies inside SRC, or contains SRC** (SRC's manifest directory, and its shard root when
  an index keeps the shards elsewhere), by :func:`stager.fs.nesting.overlap`: real paths
  (symbolic links resolved) *and* the ``(st_dev, st_ino)`` identity of every existing directory on
  the way up, so a bind mount or a second path to the same directory is caught too;

and :func:`check_dest_holds` (with DEST open, relative to its handle: :mod:`stager.fs.safe`) a DEST that
**holds something that is not a copy of this dataset**: a ``manifest.json`` of another dataset (a
pack, another staged copy; an unreadable one too), a staged mix (``stager-mix.json``), a pack being
written (``.stager-pack/``), or the journal of another dataset's unfinished stage (which a new stage
would otherwise overwrite, and with it ``stager clean``'s record of what to remove). A copy of this
same dataset (same ``dataset_id``) is fine: that is a resume. Other files are left alone (a stage
never lists them, and ``clean`` never removes them). A mix's DEST gets the same checks against
every stream (:func:`check_mix_dest`).

Nor does a stage write over a name it has no record of: a file in DEST under a name the stage would
write (a shard, a companion, ``manifest.json``, the unpacked tree) is refused unless DEST's records of
this dataset (its receipt's ``files``, its journals' names) say a stage wrote it. Such a file is not
stage's: the pack itself (``stager stage COPY PACK``, the staged copy as SRC, a mistyped order), a
``cp -r`` of it, or a file of the user's that a dataset's shard happens to be named after; copied
over, it is lost, and ``stager clean`` (which removes what the journal names) would delete it
afterwards. The sample index (``index-<hash>.sidx``, named by its own hash) is stager's own name and
exempt.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from stager.errors import DestinationError, StagerError
from stager.fs.nesting import overlap
from stager.fs.open import local_path_of
from stager.fs.safe import SafeDir
from stager.manifest import MANIFEST_NAME, MIX_RECEIPT_NAME, PACK_STATE_NAME, Manifest
from stager.receipt import RECEIPT_NAME, parse_receipt
from stager.stage.journal import read_records
from stager.stage.names import JOURNAL_RE, LOCK_RE

_HEAD_LIMIT = 64 << 20  # a journal's first line (its header, listing the plan's names) is at most this


def check_dest_place(dest: str | os.PathLike[str], sources: Iterable[str], *, what: str = "DEST") -> None:
    """Refuse a ``dest`` that is, lies inside or contains one of ``sources`` (local directories and
    ``file://`` URLs; other URLs are skipped): :class:`DestinationError` naming both and what to do."""
    d = os.fspath(dest)
    for src in sources:
        local = local_path_of(src) if src else None  # file:///data/pack is the directory /data/pack
        if not local:
            continue
        how = overlap(local, d)
        if how is not None:
            raise DestinationError(f"{d}: {what} {how} SRC {src}; staging there would overwrite the dataset and "
                                   "`stager clean` would delete it: choose a DEST outside SRC (e.g. under "
                                   "$SLURM_TMPDIR)")


def _manifest_id(data: bytes, where: str) -> str | None:
    try:
        return Manifest.from_bytes(data, where).dataset_id
    except (StagerError, ValueError):
        return None


def journal_head(d: SafeDir, name: str) -> dict[str, object] | None:
    """The header (first line) of the journal ``name`` in ``d`` (read relative to the handle, the
    user's own file only), or None when absent or unreadable."""
    try:
        fd, _ = d.open_file(name, what="staging journal", fix="remove it and rerun")
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        line = f.readline(_HEAD_LIMIT)
    try:
        head = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return head if isinstance(head, dict) else None


def check_dest_holds(d: SafeDir, manifest: Manifest, manifest_bytes: bytes, writes: Iterable[str] = ()) -> None:
    """Refuse a DEST (open as ``d``) that holds something other than a copy of ``manifest`` (whose
    staged ``manifest.json`` is ``manifest_bytes``), or a file under one of ``writes`` (the names the
    stage may write) that DEST's records do not say a stage wrote: see the module docstring."""
    dataset_id, digest = manifest.dataset_id, manifest.digest
    fix = f"run `stager clean {d.path}` if it is a staged copy, else choose another DEST"
    if d.lstat(MIX_RECEIPT_NAME) is not None:
        raise DestinationError(f"{d.path}: holds a staged mix ({MIX_RECEIPT_NAME}); {fix}")
    if d.lstat(PACK_STATE_NAME) is not None:
        raise DestinationError(f"{d.path}: holds a pack being written ({PACK_STATE_NAME}/); choose another DEST")
    if d.lstat(MANIFEST_NAME) is not None:
        data = d.read_bytes(MANIFEST_NAME, what="manifest", limit=4 << 30) or b""
        got = dataset_id if data == manifest_bytes else _manifest_id(data, d.join(MANIFEST_NAME))
        if got != dataset_id:
            said = f"of another dataset (id {got})" if got else "that is unreadable"
            raise DestinationError(f"{d.path}: holds a {MANIFEST_NAME} {said}, not a copy of this dataset "
                                   f"(id {dataset_id}); {fix}")
    for name in os.listdir(d.fd):
        if JOURNAL_RE.match(name):
            head = journal_head(d, name)
            other = head.get("digest") if head else None
            if isinstance(other, str) and other != digest:
                raise DestinationError(f"{d.path}: holds an unfinished stage of another dataset ({name}); "
                                       f"run `stager clean {d.path}` first, or choose another DEST")
    _check_unrecorded(d, manifest, writes)


def _check_unrecorded(d: SafeDir, manifest: Manifest, writes: Iterable[str]) -> None:
    """Refuse when DEST holds a name of ``writes`` that no record of this dataset in DEST names."""
    index = manifest.index.name if manifest.index is not None else None
    present = sorted(n for n in set(writes) if n not in (index, RECEIPT_NAME) and not JOURNAL_RE.match(n)
                     and not LOCK_RE.match(n) and d.lstat(n) is not None)
    if not present:
        return
    recorded = recorded_names(d, manifest)
    foreign = [n for n in present if recorded is not None and n not in recorded]
    if not foreign:
        return
    if MANIFEST_NAME in foreign:
        raise DestinationError(f"{d.path}: holds this dataset's {MANIFEST_NAME} and files but no record that stager "
                               "staged them (no receipt or journal): it is a pack of this dataset (perhaps SRC's "
                               "original); staging would take its files over and `stager clean` would delete them: "
                               "choose another DEST")
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    raise DestinationError(f"{d.path}: holds {shown}, which this stage would write over, and no record that stager "
                           "wrote it (no receipt or journal of this dataset names it); move it out of DEST or choose "
                           "another DEST")


def recorded_names(d: SafeDir, manifest: Manifest) -> set[str] | None:
    """Every name DEST's records of ``manifest``'s dataset say a stage wrote or may write: its receipt's
    ``files`` and unpacked tree, its journals' names (for a shared DEST, every node's). None when a
    journal of this dataset lists no names (an older stager's): then every name counts as recorded."""
    names: set[str] = set()
    data = d.read_bytes(RECEIPT_NAME, what="staging receipt")
    if data is not None:
        with contextlib.suppress(StagerError):
            rec = parse_receipt(data, d.join(RECEIPT_NAME))
            if rec.dataset_id == manifest.dataset_id or rec.manifest_digest.endswith(manifest.digest):
                names.update(rec.files)
                if rec.unpacked:
                    names.add(os.path.basename(rec.unpacked.rstrip("/")))
    for name in os.listdir(d.fd):
        if JOURNAL_RE.match(name):
            got = read_records(d.read_bytes(name, what="staging journal", limit=1 << 30) or b"")
            if got.digest == manifest.digest:
                if not got.writes:
                    return None
                names |= got.writes | got.files
    return names


def check_mix_dest(dest: str | os.PathLike[str] | None, sources: Iterable[str]) -> None:
    """A mix's DEST: none of its streams' sources may be, contain or lie inside it, and it may not be
    a pack or a staged copy (a ``manifest.json``): each stream goes into ``DEST/<name>``."""
    if dest is None:
        return
    d = Path(os.path.abspath(dest))
    check_dest_place(d, sources, what="the mix's DEST")
    try:
        handle = SafeDir.open(d, check=False)
    except (FileNotFoundError, NotADirectoryError):
        return
    with handle:
        if handle.lstat(MANIFEST_NAME) is not None:
            raise DestinationError(f"{d}: holds a {MANIFEST_NAME} (a dataset); a mix is staged into DEST/<stream>: "
                                   "choose another DEST")

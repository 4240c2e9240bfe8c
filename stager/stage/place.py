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
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from stager.errors import DestinationError, StagerError
from stager.fs.nesting import overlap
from stager.fs.open import is_url
from stager.fs.safe import SafeDir
from stager.manifest import MANIFEST_NAME, MIX_RECEIPT_NAME, PACK_STATE_NAME, Manifest
from stager.stage.names import JOURNAL_RE

_HEAD_LIMIT = 64 << 20  # a journal's first line (its header, listing the plan's names) is at most this


def check_dest_place(dest: str | os.PathLike[str], sources: Iterable[str], *, what: str = "DEST") -> None:
    """Refuse a ``dest`` that is, lies inside or contains one of ``sources`` (local directories; URLs
    are skipped): :class:`DestinationError` naming both and what to do."""
    d = os.fspath(dest)
    for src in sources:
        if not src or is_url(src):
            continue
        how = overlap(src, d)
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


def check_dest_holds(d: SafeDir, manifest: Manifest, manifest_bytes: bytes) -> None:
    """Refuse a DEST (open as ``d``) that holds something other than a copy of ``manifest`` (whose
    staged ``manifest.json`` is ``manifest_bytes``): see the module docstring."""
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

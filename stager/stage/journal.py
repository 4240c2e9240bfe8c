"""The staging journal: an append-only record of what a stage writes into DEST and what is verified there.

It serves two readers: a rerun, which resumes from the files it lists as verified, and ``stager
clean`` after a failed or interrupted stage (no receipt yet), which removes exactly what the
journal says the stage writes (:mod:`stager.stage.clean`).

One file per DEST (``.stager-journal.jsonl``; per node on a shared DEST, :mod:`stager.stage.names`).
Contract: a line is appended only once its file is final in DEST (renamed after verification, and
fsynced unless ``--no-fsync``) or its shard's unpacked files are on disk, so a reader may trust
every line it can parse; the journal of another dataset (another manifest digest) is ignored and
replaced; lines of a ``--no-fsync`` run are trusted only in the boot that wrote them. A resumed run
keeps a journaled file only if DEST still holds it with the manifest's size
(:func:`stager.stage.dest.kept_files`).

Before a run creates anything in DEST it records the names it may write there (:meth:`Journal.begin`:
a ``"w"`` line; the first run of a dataset writes it with the header, atomically), so at every moment
after the journal exists, the names of every file, partial file and directory the stage made are
in it (:func:`read_records`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stager.fs.atomic import atomic_write_bytes
from stager.fs.kernel import boot_id
from stager.fs.safe import open_trusted, read_trusted

_FIX = "remove it (stage writes it anew) and rerun"


class Journal:
    """Append-only record of verified files (and unpacked shards) of one dataset in DEST.

    Line 1 is ``{"journal": 1, "digest": <manifest digest>, "w": [names], "unpack": <dir or null>,
    "created_dest": bool}`` (the last three: what the first run may write, :meth:`begin`); then
    ``{"f": name, "b": bytes}`` per verified file, ``{"u": shard name}`` per unpacked shard, and a
    ``{"w": ...}`` line when a later run of the same dataset may write more names. A journal of another
    dataset is reset.
    Appends are single ``write`` calls on an ``O_APPEND`` fd, so a kill -9 loses at most a line.
    ``volatile`` (``--no-fsync``): the files were not fsynced, so each line also carries
    ``"v": <boot id>`` and is ignored after a reboot (the file is copied again).
    The journal is read and appended to only when it is a regular file of the user's with one link,
    not writable by others (:func:`stager.fs.safe.open_trusted`; else UnsafePathError, exit 2).
    """

    def __init__(self, path: Path, digest: str, *, volatile: bool = False) -> None:
        self.path = path
        this_boot = boot_id()
        self._mark = {"v": this_boot} if volatile else {}
        self.files: dict[str, int] = {}
        self.unpacked: set[str] = set()
        self.has_volatile = False  # a trusted line came from a --no-fsync run of this boot
        self.writes: set[str] = set()  # every name an earlier run of this dataset said it may write
        self.created_dest = False  # an earlier run said it created DEST
        self._lock = threading.Lock()
        valid = False
        data = read_trusted(path, what="staging journal", limit=1 << 30)
        if data is not None:
            lines = data.splitlines()
            if lines:
                with contextlib.suppress(ValueError, RecursionError):
                    head = json.loads(lines[0])
                    valid = isinstance(head, dict) and head.get("digest") == digest
                    if valid and isinstance(head.get("w"), list):
                        self.writes.update(n for n in head["w"] if isinstance(n, str))
                        self.created_dest = head.get("created_dest") is True
            for line in lines[1:] if valid else []:
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # a torn last line
                # A damaged line is ignored: its file is then copied (and verified) again.
                if not isinstance(rec, dict) or rec.get("v", this_boot) != this_boot:
                    continue  # damaged, or unsynced before a reboot: not trusted
                self.has_volatile |= "v" in rec
                if isinstance(rec.get("f"), str) and type(rec.get("b")) is int:
                    self.files[rec["f"]] = rec["b"]
                elif isinstance(rec.get("u"), str):
                    self.unpacked.add(rec["u"])
                elif isinstance(rec.get("w"), list):
                    self.writes.update(n for n in rec["w"] if isinstance(n, str))
                    self.created_dest |= rec.get("created_dest") is True
        self._digest = digest
        # A fresh header is written (atomically, fsynced) by the first append or by close(), not here:
        # during a copy that is a finisher thread, so its two fsyncs overlap the copy streams. Until
        # then an old journal stays as it was; it does not match the digest, so it is ignored.
        self._fd = self._open_append() if valid else -1

    def _open_append(self) -> int:
        fd, _ = open_trusted(self.path, os.O_WRONLY | os.O_APPEND, what="staging journal", fix=_FIX,
                             single_link=True)
        return fd

    def _open(self, writes: dict[str, Any] | None = None) -> int:
        """The append fd, writing a fresh header (with ``writes``, :meth:`begin`'s record) if needed, else
        appending ``writes`` as a line (call with ``_lock`` held)."""
        if self._fd == -2:
            raise ValueError(f"{self.path}: journal already closed")
        if self._fd < 0:
            header = (json.dumps({"journal": 1, "digest": self._digest, **(writes or {})}) + "\n").encode()
            atomic_write_bytes(self.path, header, mode=0o600)
            self._fd = self._open_append()
        elif writes:
            os.write(self._fd, (json.dumps(writes) + "\n").encode())
        return self._fd

    def begin(self, names: Iterable[str], *, unpack: str | None = None, created_dest: bool = False) -> None:
        """Record, before the run creates anything in DEST, every name it may write there (``unpack``:
        the one among them that is the unpacked tree; ``created_dest``: stage made DEST, so ``clean``
        may remove it once empty). A fresh journal gets it with its header, in one atomic write; a
        resumed one an appended ``"w"`` line when the run adds names (or ``created_dest``)."""
        names = set(names)
        if self._fd >= 0 and names <= self.writes and created_dest <= self.created_dest:
            return
        line = {"w": sorted(names), "unpack": unpack, "created_dest": created_dest}
        with self._lock:
            self._open(line)
        self.writes |= names
        self.created_dest |= created_dest

    def _append(self, rec: dict[str, Any]) -> None:
        with self._lock:
            os.write(self._open(), (json.dumps(rec) + "\n").encode())

    def add_file(self, name: str, nbytes: int) -> None:
        self._append({"f": name, "b": nbytes, **self._mark})
        self.files[name] = nbytes

    def add_unpacked(self, shard: str) -> None:
        self._append({"u": shard, **self._mark})
        self.unpacked.add(shard)

    def close(self) -> None:
        with self._lock:
            fd = self._open()
            self._fd = -2  # closed: a later append fails instead of silently recreating the header
        with contextlib.suppress(OSError):
            os.fsync(fd)
        os.close(fd)


@dataclass
class JournalRecords:
    """What a journal says a stage wrote into DEST (:func:`read_records`): ``digest`` (its dataset's
    manifest digest, or None for an unreadable header), ``writes`` (names its runs said they may write),
    ``files`` (files verified in place), ``unpack_dirs`` (which of the names are unpacked trees),
    ``created_dest`` (a run created DEST)."""

    digest: str | None = None
    writes: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)
    unpack_dirs: set[str] = field(default_factory=set)
    created_dest: bool = False


def read_records(data: bytes) -> JournalRecords:
    """Every record of a journal's bytes, whatever the boot or the lines' trust for a resume (for
    ``stager clean``: a file a ``--no-fsync`` run renamed is still the stage's to remove)."""
    out = JournalRecords()
    for i, line in enumerate(data.splitlines()):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(rec, dict):
            continue
        if i == 0:
            out.digest = rec.get("digest") if isinstance(rec.get("digest"), str) else None
        if isinstance(rec.get("w"), list):
            out.writes.update(n for n in rec["w"] if isinstance(n, str))
            if isinstance(rec.get("unpack"), str):
                out.unpack_dirs.add(rec["unpack"])
            out.created_dest |= rec.get("created_dest") is True
        elif isinstance(rec.get("f"), str):
            out.files.add(rec["f"])
    return out

"""``stage --mount``: each staged file system image mounted read-only under DEST, and unmounted again.

After the verified copy (or when DEST already holds it), :func:`mount_staged` mounts every image of
this node's shards (a format whose registry entry is ``mountable``: SquashFS) with ``squashfuse``,
as the user who stages, read-only, at ``DEST/mnt/<shard name less its suffix>/``: code that reads a
directory (torchvision's ``ImageFolder``) reads ``DEST/mnt/shard-00000/<class>/<file>``. Nothing here
needs root, and nothing is mounted anywhere but under DEST.

Records, so that ``stager clean`` and the prolog service's Epilog undo exactly this: before the first
mount, ``DEST/.stager-mounts.json`` lists the mount points (the intent: a stage killed mid-way leaves
a record of what it may have mounted); :func:`unmount_recorded` unmounts what it lists that is still
mounted (``fusermount3 -u``, then lazily when busy: fusermount unmounts only its caller's own mounts),
removes the emptied mount points, ``mnt`` and the record. A failed :func:`mount_staged` unmounts what
it mounted and removes what it made: nothing is left mounted or behind.

Safety (docs/security.md): DEST is opened and checked once (the user's, not writable by others:
:class:`~stager.fs.safe.SafeDir`); ``mnt`` and each mount point are made relative to its handle,
exclusively or checked when they exist; squashfuse and fusermount get real paths under that checked
DEST (what :func:`~stager.fs.safe.check_chain` vouches for), so nobody else can point a mount
elsewhere. Mounts are found in ``/proc/self/mountinfo``, never inferred from a path's contents.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import DestinationError, MissingBackendError, StagerError, UsageError
from stager.formats import format_spec
from stager.fs.safe import SafeDir

if TYPE_CHECKING:
    from stager.stage.plan import StagePlan
    from stager.stage.result import StageResult

MOUNT_DIR = "mnt"  # DEST/mnt/<shard stem>/
MOUNTS_NAME = ".stager-mounts.json"  # the record of what stage --mount mounted (clean and the Epilog read it)
DEST_FIX = "run it as the user who staged it; if DEST is yours, chmod go-w it first"
_INSTALL = ("needs squashfuse and fusermount3 (Debian/Ubuntu: apt-get install squashfuse fuse3; RHEL: dnf install "
            "squashfuse fuse3); or mount the images yourself (docs/staging.md, \"Mounting images\")")


def tools() -> tuple[str, str]:
    """``(squashfuse, fusermount)``: the programs that mount and unmount as the user; else a one-line
    :class:`MissingBackendError` naming the packages."""
    squashfuse = shutil.which("squashfuse")
    fusermount = shutil.which("fusermount3") or shutil.which("fusermount")
    if squashfuse is None or fusermount is None:
        missing = "squashfuse" if squashfuse is None else "fusermount3"
        raise MissingBackendError(f"stage --mount: no {missing} on PATH; it {_INSTALL}")
    return squashfuse, fusermount


def check_mountable(plan: StagePlan) -> None:
    """Before anything is copied: the dataset's shards are images, kept in a node-private DEST, and the
    tools are there (:class:`UsageError`, :class:`MissingBackendError`)."""
    spec = format_spec(plan.manifest.format)
    if not spec.mountable:
        raise UsageError(f"stage --mount: {plan.src} holds {spec.what} shards, which are no file system images; "
                         "--mount mounts SquashFS shards (stager pack --format squashfs, or images adopted with "
                         "stager index); use --unpack for a directory tree")
    if plan.unpack == "only":
        raise UsageError("stage --mount needs the shards in DEST: --unpack only keeps none")
    if plan.mode == "shared":
        raise UsageError(f"{plan.dest}: stage --mount mounts into a node-private DEST; a shared (BeeOND) DEST is one "
                         "directory for every node: stage with --no-shared, or mount under a node-local directory")
    tools()


def mount_points(dest: Path) -> set[str]:
    """The mount points in this mount namespace at or below ``dest`` (a real path), from mountinfo."""
    prefix = str(dest).rstrip("/") + "/"
    out = set()
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            point = _unescape(line.split(" ", 5)[4])
            if point.startswith(prefix) or point == str(dest):
                out.add(point)
    return out


def _unescape(field: str) -> str:
    """A mountinfo path: ``\\040`` and the other octal escapes the kernel writes, decoded."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_staged(plan: StagePlan, result: StageResult) -> None:
    """Mount this node's staged images under ``DEST/mnt`` (see the module docstring); the mount points
    go into ``result.mounts``. Already mounted ones are kept (every rank may run ``stage --mount``)."""
    squashfuse, fusermount = tools()
    names = [plan.manifest.shards[i].name for i in plan.shard_indices]
    suffix = format_spec(plan.manifest.format).suffix
    stems = [n[: -len(suffix)] if n.endswith(suffix) else n for n in names]
    with SafeDir.open(plan.dest, what="staging destination", fix=DEST_FIX) as d:
        previous = _read_record(d)
        _write_record(d, sorted({*previous, *stems}))  # the intent, before anything is mounted
        made: list[str] = []
        mounted: list[str] = []
        try:
            mnt, created = d.mkdir(MOUNT_DIR, 0o755, what="mount directory", fix="remove it and rerun")
            if created:
                made.append(MOUNT_DIR)
            with mnt:
                already = mount_points(Path(plan.dest))
                for name, stem in zip(names, stems, strict=True):
                    point = os.path.join(plan.dest, MOUNT_DIR, stem)
                    if point in already:
                        continue
                    sub, new = mnt.mkdir(stem, 0o755, what="mount point", fix="remove it and rerun")
                    with sub:
                        if not new and any(True for _ in sub.entries()):
                            raise DestinationError(f"{point}: not empty; stage --mount mounts onto empty directories "
                                                   "only: move its contents away")
                    if new:
                        made.append(f"{MOUNT_DIR}/{stem}")
                    _mount(squashfuse, os.path.join(plan.dest, name), point)
                    mounted.append(point)
        except BaseException:
            for point in reversed(mounted):
                with contextlib.suppress(StagerError, OSError):
                    _unmount(fusermount, point)
            _remove_made(d, made)
            if previous:
                _write_record(d, previous)
            else:
                d.unlink(MOUNTS_NAME)
            raise
    result.mounts = [os.path.join(plan.dest, MOUNT_DIR, s) for s in stems]


def _mount(squashfuse: str, image: str, point: str) -> None:
    r = subprocess.run([squashfuse, "-o", "ro", image, point], capture_output=True, text=True, check=False,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0 or point not in mount_points(Path(point).parent):
        why = " ".join((r.stderr or r.stdout or f"exit {r.returncode}").split())[:300]
        raise DestinationError(f"{image}: squashfuse could not mount it at {point} ({why}); is /dev/fuse there and "
                               "may you use it? (docs/staging.md, \"Mounting images\")")


def _unmount(fusermount: str, point: str) -> None:
    """Unmount ``point`` (a FUSE mount of the user's); lazily when busy. :class:`DestinationError` if it stays."""
    for args in (["-u"], ["-u", "-z"]):
        r = subprocess.run([fusermount, *args, point], capture_output=True, text=True, check=False,
                           stdin=subprocess.DEVNULL)
        if r.returncode == 0 or point not in mount_points(Path(point).parent):
            return
    raise DestinationError(f"{point}: cannot unmount it ({' '.join(r.stderr.split())[:200]}); unmount it with "
                           f"`{os.path.basename(fusermount)} -u {point}` and rerun")


def _read_record(d: SafeDir) -> list[str]:
    """The mount points (names under ``mnt``) DEST's record lists; [] when there is none. A record that
    names anything but plain names is refused: nothing is unmounted or removed by it."""
    data = d.read_bytes(MOUNTS_NAME, what="mount record")
    if data is None:
        return []
    try:
        names = json.loads(data)["mounts"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DestinationError(f"{d.join(MOUNTS_NAME)}: unreadable mount record ({exc}); unmount what is under "
                               f"{d.join(MOUNT_DIR)} yourself and remove the record") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..")
                                              for n in names):
        raise DestinationError(f"{d.join(MOUNTS_NAME)}: lists something other than mount point names; removing nothing")
    return names


def _write_record(d: SafeDir, stems: list[str]) -> None:
    d.write_atomic(MOUNTS_NAME, json.dumps({"dir": MOUNT_DIR, "mounts": stems}).encode() + b"\n", 0o600)


def _remove_made(d: SafeDir, made: list[str]) -> None:
    """Remove the (empty) directories this run made, deepest first."""
    for rel in reversed(made):
        with contextlib.suppress(OSError, StagerError):
            if "/" in rel:
                with d.subdir(MOUNT_DIR, check=False) as mnt:
                    mnt.rmdir(rel.split("/", 1)[1])
            else:
                d.rmdir(rel)


def unmount_recorded(d: SafeDir, *, dry_run: bool = False) -> list[str]:
    """``stager clean``'s first step: unmount what DEST's mount record lists and is mounted, then remove
    the emptied mount points, ``mnt`` and the record. Returns what it removed (names relative to DEST).
    A mount point that is not empty after its unmount is left where it is (it is not stage's)."""
    stems = _read_record(d)
    if d.lstat(MOUNTS_NAME) is None:
        return []
    removed = [f"{MOUNT_DIR}/{s}" for s in stems] + [MOUNT_DIR, MOUNTS_NAME]
    if dry_run:
        return removed
    if stems:
        _, fusermount = tools()
        mounted = mount_points(Path(d.path))
        for s in stems:
            point = os.path.join(d.path, MOUNT_DIR, s)
            if point in mounted:
                _unmount(fusermount, point)
    gone = []
    st = d.lstat(MOUNT_DIR)
    if st is not None:
        with d.subdir(MOUNT_DIR, what="mount directory", fix=DEST_FIX) as mnt:
            gone = [f"{MOUNT_DIR}/{s}" for s in stems if mnt.rmdir(s)]
        if d.rmdir(MOUNT_DIR):
            gone.append(MOUNT_DIR)
    d.unlink(MOUNTS_NAME)
    return [*gone, MOUNTS_NAME]


__all__ = ["MOUNTS_NAME", "MOUNT_DIR", "check_mountable", "mount_points", "mount_staged", "tools", "unmount_recorded"]

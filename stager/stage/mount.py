"""``stage --mount``: each staged file system image mounted read-only under DEST, and unmounted again.

After the verified copy (or when DEST already holds it), :func:`mount_staged` mounts every image of
this node's shards (a format whose registry entry is ``mountable``: SquashFS) with ``squashfuse``,
as the user who stages, read-only, at ``DEST/mnt/<shard name less its suffix>/``: code that reads a
directory (torchvision's ``ImageFolder``) reads ``DEST/mnt/shard-00000/<class>/<file>``. Nothing here
needs root, and nothing is mounted anywhere but under DEST.

Records, so that ``stager clean`` and the prolog service's Epilog undo exactly this: before the first
mount, ``DEST/.stager-mounts.json`` lists the mount points and the identity (``st_dev``, ``st_ino``)
of the image each serves (the intent: a stage killed mid-way leaves a record of what it may have
mounted); :func:`unmount_recorded` unmounts what it lists that is still mounted (``fusermount3 -u``,
then lazily when busy: fusermount unmounts only its caller's own mounts), removes the emptied mount
points, ``mnt`` and the record. A failed or interrupted :func:`mount_staged` unmounts what it
mounted and removes what it made: nothing is left mounted or behind.

A mount lives as long as its squashfuse daemon, which lives in the job step that ran ``stage
--mount``: Slurm (proctrack/cgroup) ends every process of a step when the step ends, and the mount
then answers ``ENOTCONN``. A rerun (in the step that reads: docs/staging.md) mounts such a mount
again, and one whose image was replaced since (``--repair`` renames a new copy over it, while
squashfuse still serves the old file).

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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import DestinationError, MissingBackendError, StagerError, UsageError
from stager.formats import format_spec
from stager.fs.info import unescape_mount_field
from stager.fs.safe import SafeDir

if TYPE_CHECKING:
    from stager.stage.plan import StagePlan
    from stager.stage.result import StageResult

MOUNT_DIR = "mnt"  # DEST/mnt/<shard stem>/
MOUNTS_NAME = ".stager-mounts.json"  # the record of what stage --mount mounted (clean and the Epilog read it)
DEST_FIX = "run it as the user who staged it; if DEST is yours, chmod go-w it first"
_INSTALL = ("needs squashfuse and fusermount3 (Debian/Ubuntu: apt-get install squashfuse fuse3; RHEL: dnf install "
            "squashfuse fuse3); or mount the images yourself (docs/staging.md, \"SquashFS images\")")


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
            point = unescape_mount_field(line.split(" ", 5)[4])
            if point.startswith(prefix) or point == str(dest):
                out.add(point)
    return out


def mount_staged(plan: StagePlan, result: StageResult) -> None:
    """Mount this node's staged images under ``DEST/mnt`` (see the module docstring); the mount points
    go into ``result.mounts``. A mount this stage made earlier is kept while it answers and serves the
    image now in DEST (every rank may run ``stage --mount``); one whose squashfuse ended (Slurm ends a
    step's processes with the step) or whose image was replaced since (``--repair``) is mounted again.
    A mount there that no record of stage's names is refused: it is not stage's to take over."""
    squashfuse, fusermount = tools()
    names = [plan.manifest.shards[i].name for i in plan.shard_indices]
    stems = mount_names(names, format_spec(plan.manifest.format).suffix, {s.name for s in plan.manifest.shards})
    with SafeDir.open(plan.dest, what="staging destination", fix=DEST_FIX) as d:
        previous, seen = _read_record(d)
        images = {stem: _identity(d, name) for name, stem in zip(names, stems, strict=True)}
        already = mount_points(Path(plan.dest))
        foreign = [s for s in stems if os.path.join(plan.dest, MOUNT_DIR, s) in already and s not in previous]
        if foreign:
            point = os.path.join(plan.dest, MOUNT_DIR, foreign[0])
            raise DestinationError(f"{point}: something is mounted there that stage --mount did not mount; unmount "
                                   f"it (fusermount3 -u {point}) or stage into another DEST")
        _write_record(d, sorted({*previous, *stems}), {**seen, **images})  # the intent, before anything is mounted
        made: list[str] = []
        tried: list[str] = []
        try:
            mnt, created = d.mkdir(MOUNT_DIR, 0o755, what="mount directory", fix="remove it and rerun")
            if created:
                made.append(MOUNT_DIR)
            with mnt:
                for name, stem in zip(names, stems, strict=True):
                    point = os.path.join(plan.dest, MOUNT_DIR, stem)
                    if point in already:
                        if _answers(mnt, stem) and seen.get(stem) == images[stem]:
                            continue
                        _unmount(fusermount, point)  # its squashfuse ended, or its image was replaced
                    _mount_one(mnt, stem, made)
                    tried.append(point)
                    _mount(squashfuse, os.path.join(plan.dest, name), point)
        except BaseException:
            still = _undo(fusermount, tried, Path(plan.dest))
            _remove_made(d, made)
            if still:
                pass  # the intent record stays: `stager clean` unmounts what it lists
            elif previous:
                _write_record(d, previous, seen)
            else:
                d.unlink(MOUNTS_NAME)
            raise
    result.mounts = [os.path.join(plan.dest, MOUNT_DIR, s) for s in stems]


def mount_names(names: list[str], suffix: str, taken: set[str]) -> list[str]:
    """Each shard's mount point under ``mnt``: its name less ``suffix``, unless a shard of the dataset
    (``taken``) is named that (adopted images ``a`` and ``a.sqfs``): then its whole name, so that no two
    images share a mount point."""
    out = []
    for n in names:
        stem = n[: -len(suffix)] if n.endswith(suffix) else n
        out.append(n if stem != n and stem in taken else stem)
    return out


def _mount_one(mnt: SafeDir, stem: str, made: list[str]) -> None:
    """The empty mount point ``mnt/stem``: made (and noted in ``made``), or an existing empty one."""
    sub, new = mnt.mkdir(stem, 0o755, what="mount point", fix="remove it and rerun")
    with sub:
        if not new and any(True for _ in sub.entries()):
            raise DestinationError(f"{mnt.join(stem)}: not empty; stage --mount mounts onto empty directories "
                                   "only: move its contents away")
    if new:
        made.append(f"{MOUNT_DIR}/{stem}")


def _identity(d: SafeDir, name: str) -> list[int] | None:
    """``[st_dev, st_ino]`` of the image ``name`` in DEST: a copy staged again is another file."""
    st = d.lstat(name)
    return None if st is None else [st.st_dev, st.st_ino]


def _answers(mnt: SafeDir, stem: str) -> bool:
    """Whether the mount at ``mnt/stem`` answers: one whose FUSE daemon ended fails with ENOTCONN."""
    try:
        os.stat(stem, dir_fd=mnt.fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _undo(fusermount: str, tried: list[str], dest: Path) -> list[str]:
    """After a failure (Ctrl-C included, which may come after squashfuse mounted but before it returned):
    unmount every point this run tried that is mounted; the ones that stay mounted."""
    for point in reversed([p for p in tried if p in mount_points(dest)]):
        with contextlib.suppress(StagerError, OSError):
            _unmount(fusermount, point)
    now = mount_points(dest)
    return [p for p in tried if p in now]


def _mount(squashfuse: str, image: str, point: str) -> None:
    r = subprocess.run([squashfuse, "-o", "ro", image, point], capture_output=True, text=True, check=False,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0 or point not in mount_points(Path(point).parent):
        why = " ".join((r.stderr or r.stdout or f"exit {r.returncode}").split())[:300]
        raise DestinationError(f"{image}: squashfuse could not mount it at {point} ({why}); is /dev/fuse there and "
                               "may you use it? (docs/staging.md, \"SquashFS images\")")


def _unmount(fusermount: str, point: str) -> None:
    """Unmount ``point`` (a FUSE mount of the user's); lazily when busy. :class:`DestinationError` if it stays."""
    for args in (["-u"], ["-u", "-z"]):
        r = subprocess.run([fusermount, *args, point], capture_output=True, text=True, check=False,
                           stdin=subprocess.DEVNULL)
        if r.returncode == 0 or point not in mount_points(Path(point).parent):
            return
    raise DestinationError(f"{point}: cannot unmount it ({' '.join(r.stderr.split())[:200]}); unmount it with "
                           f"`{os.path.basename(fusermount)} -u {point}` and rerun")


def _read_record(d: SafeDir) -> tuple[list[str], dict[str, list[int]]]:
    """The mount points (names under ``mnt``) DEST's record lists, and the identity of the image each
    was mounted from (``[st_dev, st_ino]``; absent for a record without them); ``([], {})`` when there
    is none. A record that names anything but plain names is refused: nothing is unmounted or removed
    by it."""
    data = d.read_bytes(MOUNTS_NAME, what="mount record")
    if data is None:
        return [], {}
    try:
        rec = json.loads(data)
        names = rec["mounts"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DestinationError(f"{d.join(MOUNTS_NAME)}: unreadable mount record ({exc}); unmount what is under "
                               f"{d.join(MOUNT_DIR)} yourself and remove the record") from exc
    if not isinstance(names, list) or not all(isinstance(n, str) and n and "/" not in n and n not in (".", "..")
                                              for n in names):
        raise DestinationError(f"{d.join(MOUNTS_NAME)}: lists something other than mount point names; removing nothing")
    images = rec.get("images")
    if not isinstance(images, dict):
        images = {}
    return names, {k: v for k, v in images.items() if isinstance(v, list)}


def _write_record(d: SafeDir, stems: list[str], images: Mapping[str, list[int] | None]) -> None:
    body = {"dir": MOUNT_DIR, "mounts": stems, "images": {s: images[s] for s in stems if images.get(s) is not None}}
    d.write_atomic(MOUNTS_NAME, json.dumps(body).encode() + b"\n", 0o600)


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
    A mount point that is not empty after its unmount is left where it is (it is not stage's).

    Mounts are looked up by DEST's real path, read from the handle: mountinfo lists real paths, and
    DEST may have been named through a symbolic link (``$HOME/scratch -> /local/$USER``)."""
    stems, _ = _read_record(d)
    if d.lstat(MOUNTS_NAME) is None:
        return []
    removed = [f"{MOUNT_DIR}/{s}" for s in stems] + [MOUNT_DIR, MOUNTS_NAME]
    if dry_run:
        return removed
    real = _real_path(d)
    mounted = mount_points(Path(real))
    points = [p for p in (os.path.join(real, MOUNT_DIR, s) for s in stems) if p in mounted]
    if points:
        fusermount = _fusermount(points[0])
        for point in points:
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


def _real_path(d: SafeDir) -> str:
    """The path of the directory ``d`` holds, with no symbolic link in it (the kernel's, from
    ``/proc/self/fd``); where there is no such link to read, ``d.path`` resolved."""
    try:
        real = os.readlink(f"/proc/self/fd/{d.fd}")
    except OSError:
        return os.path.realpath(d.path)
    return real if real.startswith("/") else os.path.realpath(d.path)


def _fusermount(point: str) -> str:
    """fusermount, the one tool an unmount needs; else a one-line :class:`MissingBackendError`."""
    found = shutil.which("fusermount3") or shutil.which("fusermount")
    if found is None:
        raise MissingBackendError(f"{point}: cannot unmount it: no fusermount3 on PATH (Debian/Ubuntu: apt-get "
                                  f"install fuse3; RHEL: dnf install fuse3); unmount it yourself and rerun")
    return found


__all__ = ["MOUNTS_NAME", "MOUNT_DIR", "check_mountable", "mount_names", "mount_points", "mount_staged", "tools",
           "unmount_recorded"]

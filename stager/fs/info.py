"""Which file system holds a path? statfs(2) magic plus /proc/self/mountinfo.

Python's ``os.statvfs`` does not expose ``f_type``, so :func:`statfs_magic` calls ``statfs(2)``
through ctypes. The mount table gives the fstype *name* and the mount point: the entry with the
longest mount point that is a prefix of the resolved path wins. The magic number decides for the
file systems staging cares about (Lustre ``0x0BD00BD0``, BeeGFS ``0x19830326``: see
../shared/HPC.md), the mount table for everything else.

``$STAGER_MOUNTINFO`` names another mount table (tests point it at a fixture); when it is set, the
fixture's fstype wins over the real statfs magic so that a test can pretend a tmp dir is Lustre.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from stager.fs.kernel import statfs_magic

MOUNTINFO_ENV = "STAGER_MOUNTINFO"
DEFAULT_MOUNTINFO = "/proc/self/mountinfo"

# statfs f_type values (linux/magic.h and the vendors' sources, see ../shared/HPC.md).
MAGIC_NAMES: dict[int, str] = {
    0x0BD00BD0: "lustre",
    0x19830326: "beegfs",
    0x47504653: "gpfs",
    0x01021994: "tmpfs",
    0x0000EF53: "ext4",
    0x58465342: "xfs",
    0x00006969: "nfs",
    0x9123683E: "btrfs",
    0x794C7630: "overlay",
    0x65735546: "fuse",
}
# Shared (multi-node) file systems: data there is not node-local.
SHARED_FSTYPES = frozenset({"lustre", "beegfs", "gpfs", "nfs", "nfs4", "cifs", "smb3", "ceph", "fuse.sshfs"})


@dataclass(frozen=True)
class Mount:
    """One row of mountinfo: where it is mounted, what it is, and from where."""

    mount_point: str
    fstype: str
    source: str
    options: str


@dataclass(frozen=True)
class FsInfo:
    """The file system under ``path``: ``fstype`` (e.g. ``"lustre"``), its ``mount_point``, the
    mount ``source`` (``10.0.0.1@o2ib:/scratch``), and the statfs ``magic`` (None if unavailable)."""

    path: str
    fstype: str
    mount_point: str
    source: str = ""
    options: str = ""
    magic: int | None = None

    @property
    def is_lustre(self) -> bool:
        return self.fstype == "lustre"

    @property
    def is_beegfs(self) -> bool:
        return self.fstype == "beegfs"

    @property
    def is_shared(self) -> bool:
        return self.fstype in SHARED_FSTYPES

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "fstype": self.fstype,
            "mount_point": self.mount_point,
            "source": self.source,
            "magic": None if self.magic is None else f"0x{self.magic:08X}",
        }


def unescape_mount_field(field: str) -> str:
    """A mountinfo/mounts path field decoded: the kernel writes space, tab, newline and backslash as
    ``\\ooo`` octal escapes (``/mnt/a\\040b`` is ``/mnt/a b``), a trailing one included."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        digits = field[i + 1 : i + 4]
        if field[i] == "\\" and len(digits) == 3 and digits.isdigit():
            out.append(chr(int(digits, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse ``/proc/self/mountinfo`` text (proc(5) format; malformed lines are skipped).

    Also accepts ``/proc/mounts`` lines (``source mount_point fstype options 0 0``) so a fixture can
    be written in either format.
    """
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if " - " in line:
            left, right = line.split(" - ", 1)
            lf, rf = left.split(), right.split()
            if len(lf) < 5 or len(rf) < 2:
                continue
            mounts.append(Mount(unescape_mount_field(lf[4]), rf[0], unescape_mount_field(rf[1]),
                                rf[2] if len(rf) > 2 else ""))
        elif len(parts) >= 4:
            mounts.append(Mount(unescape_mount_field(parts[1]), parts[2], unescape_mount_field(parts[0]), parts[3]))
    return mounts


def read_mounts() -> list[Mount]:
    path = os.environ.get(MOUNTINFO_ENV) or DEFAULT_MOUNTINFO
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return []


def find_mount(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount with the longest mount point containing ``path`` (later rows win ties: overmounts)."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if (path == mp or path.startswith(mp + "/") or mp == "/") and (
            best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")
        ):
            best = m
    return best


def detect_fs(path: str | os.PathLike[str]) -> FsInfo:
    """Detect the file system of ``path`` (which need not exist yet: its parents are used)."""
    real = os.path.realpath(os.fspath(path))
    probe = real
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    magic = statfs_magic(probe)
    mount = find_mount(real, read_mounts())
    by_magic = MAGIC_NAMES.get(magic) if magic is not None else None
    fixture = bool(os.environ.get(MOUNTINFO_ENV))
    if mount is not None and (fixture or by_magic not in ("lustre", "beegfs")):
        fstype = mount.fstype
    else:
        fstype = by_magic or (mount.fstype if mount else "unknown")
    return FsInfo(
        path=real,
        fstype=fstype,
        mount_point=mount.mount_point if mount else "/",
        source=mount.source if mount else "",
        options=mount.options if mount else "",
        magic=magic,
    )

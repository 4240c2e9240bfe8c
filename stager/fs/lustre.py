"""A thin wrapper around ``lfs``: read and set Lustre striping, and recommend a layout.

Everything goes through the ``lfs`` command (found on PATH or named by ``$STAGER_LFS``), never
through liblustreapi, so that the same code runs on any client version and the tests can use the
stand-in ``tests/bin/lfs``. Output formats parsed here are those of Lustre 2.10+ (see
../shared/HPC.md): plain ``lmm_*`` layouts with an ``obdidx`` table, composite (PFL) layouts with
``lcm_*``/``lcme_*`` headers, the one-line ``getstripe -d`` form and the bare numbers of
``getstripe -c``/``-i``/``-S``.

Layout rules (docs/staging.md lists the sources): more shard files than OSTs -> stripe count 1 so
whole files spread over OSTs; a few files of 1 GiB or more read by many clients -> stripe wide
(at most 72 OSTs, NERSC); other files below 1 GiB -> count 1-4; stripe size 1 MiB, or 4 MiB for
files of 64 MiB and more. A layout only applies to files created afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from stager.errors import ExitCode, StagerError
from stager.fs.info import detect_fs

LFS_ENV = "STAGER_LFS"
MIB = 1 << 20
GIB = 1 << 30
MAX_WIDE_STRIPES = 72  # NERSC: striping over more OSTs than this hurts


class LfsError(StagerError, OSError):
    """``lfs`` failed or printed something we cannot parse: the user's environment to fix (exit 2)."""

    exit_code = ExitCode.USAGE


def lfs_path() -> str | None:
    """The ``lfs`` executable to use, or None when there is none."""
    return shutil.which(os.environ.get(LFS_ENV) or "lfs")


def run_lfs(args: list[str], timeout: float = 120.0) -> str:
    exe = lfs_path()
    if exe is None:
        raise LfsError("lfs not found on PATH (set $STAGER_LFS to its path)")
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LfsError(f"lfs {' '.join(args)}: {exc}") from exc
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise LfsError(f"lfs {' '.join(args)} failed (exit {proc.returncode}): {msg[-1] if msg else ''}")
    return proc.stdout


# ---- parsing ------------------------------------------------------------------------------------
@dataclass
class Component:
    """One stripe layout: a whole plain file, or one PFL component covering ``[start, end)``.

    ``end`` is None for EOF (``-1``). ``stripe_offset`` -1 means "chosen by the MDS". ``osts`` lists
    the OST index of every stripe object when the file has them (empty for a directory default).
    """

    stripe_count: int = 0
    stripe_size: int = 0
    stripe_offset: int = -1
    pattern: str = ""
    start: int = 0
    end: int | None = None
    osts: list[int] = field(default_factory=list)


@dataclass
class Layout:
    """A parsed ``lfs getstripe`` result: one component for plain layouts, several for PFL."""

    path: str
    components: list[Component]
    composite: bool = False

    @property
    def first(self) -> Component:
        return self.components[0] if self.components else Component()

    @property
    def stripe_count(self) -> int:
        """Stripe count of the last component (what large files end up with)."""
        return self.components[-1].stripe_count if self.components else 0

    @property
    def stripe_size(self) -> int:
        return self.components[-1].stripe_size if self.components else 0

    @property
    def stripe_offset(self) -> int:
        """First OST index of the file (of its first component)."""
        c = self.first
        return c.osts[0] if c.osts else c.stripe_offset

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "composite": self.composite,
            "components": [
                {
                    "start": c.start,
                    "end": c.end,
                    "stripe_count": c.stripe_count,
                    "stripe_size": c.stripe_size,
                    "stripe_offset": c.stripe_offset,
                    "pattern": c.pattern,
                    "osts": c.osts,
                }
                for c in self.components
            ],
        }


_KV = re.compile(r"^\s*(lmm_|lcme_|lcm_)?([a-z_.]+):\s*(\S.*?)\s*$")
_ROW = re.compile(r"^\s+(\d+)\s+(\d+)\s+(0x[0-9a-fA-F]+|\d+)\s+(\S+)\s*$")
_OBJ = re.compile(r"l_ost_idx:\s*(\d+)")
_DIRLINE = re.compile(r"(stripe_count|stripe_size|pattern|stripe_offset):\s*(\S+)")


def _int(v: str) -> int:
    v = v.strip()
    if v.upper() == "EOF":
        return -1
    return int(v, 0)


def _set(c: Component, key: str, val: str) -> None:
    if key == "stripe_count":
        c.stripe_count = _int(val)
    elif key == "stripe_size":
        c.stripe_size = _int(val)
    elif key == "stripe_offset":
        c.stripe_offset = _int(val)
    elif key == "pattern":
        c.pattern = val


def parse_getstripe(text: str, path: str = "") -> Layout:
    """Parse the full output of ``lfs getstripe PATH`` (plain, composite/PFL, or ``-d`` form).

    Raises :class:`LfsError` when no layout field is found.
    """
    lines = text.splitlines()
    if lines and path == "" and lines[0].strip() and ":" not in lines[0]:
        path = lines[0].strip()
    # One-line directory default: "stripe_count:  1 stripe_size:   1048576 pattern: 0 stripe_offset: -1"
    for line in lines:
        if line.lstrip().startswith("stripe_count:") and "stripe_size:" in line:
            c = Component()
            for k, v in _DIRLINE.findall(line):
                _set(c, k, v)
            return Layout(path, [c])
    comps: list[Component] = []
    composite = False
    cur: Component | None = None
    for line in lines:
        m = _KV.match(line)
        if m:
            prefix, key, val = m.group(1) or "", m.group(2), m.group(3)
            if prefix == "lcm_":
                composite = True
            elif prefix == "lcme_":
                composite = True
                if key == "id":
                    cur = Component()
                    comps.append(cur)
                elif cur is not None and key == "extent.e_start":
                    cur.start = _int(val)
                elif cur is not None and key == "extent.e_end":
                    end = _int(val)
                    cur.end = None if end < 0 else end
            elif prefix == "lmm_":
                if cur is None:
                    cur = Component()
                    comps.append(cur)
                _set(cur, key, val)
            continue
        if cur is None:
            continue
        r = _ROW.match(line)
        if r:
            cur.osts.append(int(r.group(1)))
            continue
        o = _OBJ.search(line)
        if o:
            cur.osts.append(int(o.group(1)))
    if not comps:
        raise LfsError(f"cannot parse `lfs getstripe` output for {path or '?'}: {text.strip()[:200]!r}")
    return Layout(path, comps, composite)


def getstripe(path: str | os.PathLike[str]) -> Layout:
    """The layout of a file, or the default layout of a directory (``lfs getstripe -d``)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        return parse_getstripe(run_lfs(["getstripe", "-d", p]), p)
    return parse_getstripe(run_lfs(["getstripe", p]), p)


def _one_number(out: str, what: str, path: str) -> int:
    for line in out.splitlines():
        s = line.strip()
        if s:
            try:
                return _int(s)
            except ValueError:
                break
    raise LfsError(f"cannot parse `lfs getstripe {what}` output for {path}: {out.strip()[:100]!r}")


def stripe_index(path: str | os.PathLike[str]) -> int:
    """First OST index of a file (``lfs getstripe -i``)."""
    return _one_number(run_lfs(["getstripe", "-i", os.fspath(path)]), "-i", os.fspath(path))


def stripe_count(path: str | os.PathLike[str]) -> int:
    return _one_number(run_lfs(["getstripe", "-c", os.fspath(path)]), "-c", os.fspath(path))


def stripe_size(path: str | os.PathLike[str]) -> int:
    return _one_number(run_lfs(["getstripe", "-S", os.fspath(path)]), "-S", os.fspath(path))


def ost_count(path: str | os.PathLike[str]) -> int | None:
    """Number of OSTs of the file system holding ``path`` (rows ``[OST:n]`` of ``lfs df``)."""
    try:
        out = run_lfs(["df", os.fspath(path)])
    except LfsError:
        return None
    n = sum(1 for line in out.splitlines() if "[OST:" in line)
    return n or None


# ---- recommendations ----------------------------------------------------------------------------
@dataclass
class Recommendation:
    """A recommended layout for a directory of ``num_files`` files totalling ``total_bytes``."""

    stripe_count: int
    stripe_size: int
    reason: str

    def args(self, path: str) -> list[str]:
        return ["setstripe", "-c", str(self.stripe_count), "-S", _size_arg(self.stripe_size), path]

    def command(self, path: str) -> str:
        return "lfs " + " ".join(self.args(path))

    def to_json(self, path: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"stripe_count": self.stripe_count, "stripe_size": self.stripe_size, "reason": self.reason}
        if path is not None:
            d["command"] = self.command(path)
        return d


def _size_arg(n: int) -> str:
    for unit, mult in (("G", GIB), ("M", MIB), ("K", 1024)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def recommend_layout(
    total_bytes: int,
    num_files: int,
    num_osts: int | None = None,
    *,
    stripe_count: int | None = None,
    stripe_size: int | None = None,
) -> Recommendation:
    """Choose ``lfs setstripe`` parameters for a directory that will hold ``num_files`` files.

    Explicit ``stripe_count``/``stripe_size`` win. Rules in the module docstring.
    """
    num_files = max(num_files, 1)
    avg = total_bytes / num_files
    osts = num_osts or 0
    size = stripe_size or (4 * MIB if avg >= 64 * MIB else MIB)
    if stripe_count is not None:
        return Recommendation(stripe_count, size, "explicit stripe count")
    if osts and num_files >= osts:
        count, why = 1, f"{num_files} files >= {osts} OSTs: count 1 spreads whole files over OSTs"
    elif not osts and num_files >= 8:
        count, why = 1, f"{num_files} files: count 1 spreads whole files over OSTs"
    elif avg >= GIB:
        count = min(max(osts // num_files, 1), MAX_WIDE_STRIPES) if osts else 8
        why = f"{num_files} file(s) of ~{avg / GIB:.1f} GiB read by many clients: stripe wide"
    else:
        count = min(4, osts) if osts else 4
        why = f"{num_files} file(s) below 1 GiB: stripe count 1-4"
    return Recommendation(count, size, why)


def setstripe(path: str | os.PathLike[str], rec: Recommendation) -> None:
    run_lfs(rec.args(os.fspath(path)))


def prepare_pack_dir(
    out_dir: str | os.PathLike[str],
    *,
    total_bytes: int,
    num_shards: int,
    stripe_count: int | None = None,
    stripe_size: int | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Give a pack output directory the recommended Lustre layout before shards are written.

    On Lustre with ``lfs`` available: creates ``out_dir`` and runs ``lfs setstripe`` on it. On Lustre
    without ``lfs``: prints the command to run (stderr) instead. Elsewhere: does nothing. Never
    raises for an ``lfs`` failure (packing still works with the default layout); the returned dict
    says what happened: ``{"fstype", "lustre", "applied", "command", "stripe_count",
    "stripe_size", "reason", "error"}``.
    """
    path = os.fspath(out_dir)
    fs = detect_fs(path)
    result: dict[str, Any] = {
        "fstype": fs.fstype,
        "lustre": fs.is_lustre,
        "applied": False,
        "command": None,
        "stripe_count": None,
        "stripe_size": None,
        "reason": f"not on Lustre ({fs.fstype}): striping does not apply",
        "error": None,
    }
    if not fs.is_lustre:
        return result
    have_lfs = lfs_path() is not None
    osts = ost_count(fs.mount_point or path) if have_lfs else None
    rec = recommend_layout(total_bytes, num_shards, osts, stripe_count=stripe_count, stripe_size=stripe_size)
    cmd = rec.command(path)
    result.update(stripe_count=rec.stripe_count, stripe_size=rec.stripe_size, reason=rec.reason, command=cmd)
    if not have_lfs:
        print(f"stager: {path} is on Lustre but lfs is not on PATH; run first: mkdir -p {path} && {cmd}",
              file=sys.stderr)
        return result
    try:
        os.makedirs(path, exist_ok=True)
        setstripe(path, rec)
    except (OSError, LfsError) as exc:
        result["error"] = str(exc)
        print(f"stager: warning: could not set the layout of {path} ({exc}); packing with the default layout",
              file=sys.stderr)
        return result
    result["applied"] = True
    if not quiet:
        print(f"stager: {cmd}  ({rec.reason})", file=sys.stderr)
    return result

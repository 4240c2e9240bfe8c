"""``stager hints PATH``: what a dataset looks like to the file system, and what to do about it.

Reports the file system (Lustre/BeeGFS/...), file count and size distribution, a small-file
warning with the ``stager pack`` command that fixes it, on Lustre the current striping (``lfs
getstripe -d``) and the recommended ``lfs setstripe`` for a pack output directory (rules in
:mod:`stager.fs.lustre`, sources in docs/staging.md), whether the data fits the node-local staging
destination and RAM, and, for a packed dataset this user staged again within a day without a cache,
that a node-local shard cache would pay (:mod:`stager.cache.history`).

``next`` lists the commands to run, in order, with this dataset's paths, so that they work when
followed literally: for an image tree ``stager pack PATH PATH-packed --format tar`` and then the
staging strategy's command on the pack (``stage`` refuses an image tree); for a pack, the strategy's
command on it.
"""

from __future__ import annotations

import math
import os
import shlex
from typing import Any

import numpy as np

from stager.advice.scaling import strategy_for
from stager.cache.history import repeat_advice
from stager.errors import SourceNotFoundError, UsageError
from stager.fs import lustre
from stager.fs.info import detect_fs
from stager.fs.open import local_path_of
from stager.manifest import MANIFEST_NAME, load_manifest
from stager.receipt import STAGING_ROOT_VARS

SMALL_FILE = 1 << 20  # files below 1 MiB are "small" for Lustre (one RPC, MDS-bound)
SMALL_FILE_COUNT = 1000  # below this many files, metadata load does not matter
DEFAULT_SHARD = 256 << 20  # stager pack's default shard size
BUCKETS = [(4 << 10, "<4K"), (64 << 10, "4K-64K"), (1 << 20, "64K-1M"), (16 << 20, "1M-16M"),
           (256 << 20, "16M-256M"), (1 << 30, "256M-1G"), (None, ">=1G")]
TAR_OVERHEAD_PER_SAMPLE = 3 * 1024 + 512  # three ustar headers + padding per sample


def _walk_sizes(root: str) -> np.ndarray:
    sizes: list[int] = []
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            sizes.append(e.stat(follow_symlinks=False).st_size)
                    except OSError:
                        continue
        except OSError:
            continue
    return np.asarray(sizes, dtype=np.int64)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def distribution(sizes: np.ndarray) -> dict[str, Any]:
    """Count, total and percentiles of ``sizes`` (int64 array), plus a bucketed histogram."""
    if len(sizes) == 0:
        return {"files": 0, "bytes": 0, "min": 0, "median": 0, "p90": 0, "max": 0, "histogram": {}}
    hist: dict[str, int] = {}
    lo = 0
    for hi, label in BUCKETS:
        n = int(((sizes >= lo) & (sizes < hi)).sum()) if hi is not None else int((sizes >= lo).sum())
        if n:
            hist[label] = n
        lo = hi or 0
    return {
        "files": len(sizes),
        "bytes": int(sizes.sum()),
        "min": int(sizes.min()),
        "median": int(np.median(sizes)),
        "p90": int(np.percentile(sizes, 90)),
        "max": int(sizes.max()),
        "histogram": hist,
    }


def hints(path: str | os.PathLike[str], *, dest: str | None = None, nodes: int | None = None) -> dict[str, Any]:
    """Analyse ``path`` (an image tree or a packed directory); return the JSON-able report.

    Local paths only: the advice is about a file system (striping, metadata load); a URL is refused."""
    if local_path_of(path) is None:
        raise UsageError(f"{os.fspath(path)}: hints inspects a file system, not a URL; for a pack in an object "
                         "store run `stager inspect URL` (and stage it: docs/staging.md, Object storage)")
    p = os.path.abspath(os.fspath(local_path_of(path) or path))
    if not os.path.exists(p):
        raise SourceNotFoundError(f"{p}: no such file or directory")
    fs = detect_fs(p)
    packed = os.path.isfile(os.path.join(p, MANIFEST_NAME)) or p.endswith(".json")
    if packed:
        m = load_manifest(p)
        sizes = np.asarray([s.bytes for s in m.shards], dtype=np.int64)
        samples = m.num_samples
        need = m.copy_bytes
    else:
        sizes = _walk_sizes(p) if os.path.isdir(p) else np.asarray([os.path.getsize(p)], dtype=np.int64)
        samples = len(sizes)
        need = int(sizes.sum()) + TAR_OVERHEAD_PER_SAMPLE * samples
    dist = distribution(sizes)
    report: dict[str, Any] = {"path": p, "fs": fs.to_json(), "kind": "packed" if packed else "files",
                              "samples": samples, "sizes": dist, "warnings": []}
    small = int((sizes < SMALL_FILE).sum())
    out = p.rstrip("/") + "-packed"  # where an image tree's pack goes: beside it
    pack_cmd = f"stager pack {shlex.quote(p)} {shlex.quote(out)} --format tar"
    if not packed and len(sizes) >= SMALL_FILE_COUNT and small * 2 >= len(sizes):
        cmd = pack_cmd
        report["warnings"].append(
            f"{small} of {len(sizes)} files are below 1 MiB: reading them costs one metadata operation each "
            f"({'Lustre MDS' if fs.is_lustre else fs.fstype}); pack them into shards: {cmd}"
        )
        report["pack_command"] = cmd
    # Striping now and recommended for a pack output.
    num_shards = len(sizes) if packed else max(1, math.ceil(need / DEFAULT_SHARD))
    have_lfs = lustre.lfs_path() is not None
    osts = lustre.ost_count(p) if fs.is_lustre and have_lfs else None
    current = None
    if fs.is_lustre and have_lfs:
        try:
            current = lustre.getstripe(p).to_json()
        except lustre.LfsError as exc:
            report["warnings"].append(str(exc))
    rec = lustre.recommend_layout(need, num_shards, osts)
    target = p if packed else out
    report["lustre"] = {
        "is_lustre": fs.is_lustre,
        "lfs": have_lfs,
        "osts": osts,
        "current": current,
        "recommended": rec.to_json(target) if fs.is_lustre else None,  # `lfs setstripe` means nothing elsewhere
        "note": "a layout applies only to files created afterwards: set it on the (empty) pack output "
        "directory, or copy (not mv) files into a directory that has it",
    }
    # Does it fit this node?
    root = dest or next((os.environ[v] for v in STAGING_ROOT_VARS if os.environ.get(v)), None)
    fit: dict[str, Any] = {"need_bytes": need, "dest": root, "dest_free": None, "fits_dest": None}
    if root:
        try:
            st = os.statvfs(root)
            fit["dest_free"] = st.f_bavail * st.f_frsize
            fit["fits_dest"] = need <= fit["dest_free"]
        except OSError as exc:
            report["warnings"].append(f"{root}: cannot check free space ({exc.strerror})")
    mem = _mem_available()
    fit["ram_available"] = mem
    fit["fits_ram"] = None if mem is None else need <= mem
    report["fit"] = fit
    if fit["fits_dest"] is False:
        report["warnings"].append(
            f"{need / 1e9:.1f} GB does not fit {root} ({fit['dest_free'] / 1e9:.1f} GB free): "
            "use `stager stage --partition` (each node stages its share) or a BeeOND/shared DEST"
        )
    # Which staging strategy for this job's node count (stager.advice.scaling's bandwidth model).

    report["strategy"] = strategy = strategy_for(need, nodes=nodes, local_capacity=fit["dest_free"], osts=osts,
                                                 files=num_shards)
    stage_cmd = strategy["command"] = strategy["command"].replace("SRC", shlex.quote(target))  # this pack, or the next
    report["next"] = ([] if packed else [pack_cmd]) + ([stage_cmd] if "stager stage" in stage_cmd else [])
    if packed:
        # Staged again within a day without a cache (this user's staging history): a node-local cache pays.
        report["cache"] = repeat_advice(m.dataset_id, need)
        if report["cache"]["pays"]:
            report["warnings"].append(f"{report['cache']['reason']}: stager stage {p} --cache DIR")
    return report


def human(report: dict[str, Any]) -> str:
    d = report["sizes"]
    fs = report["fs"]
    lines = [
        f"{report['path']}: {fs['fstype']} (mounted at {fs['mount_point']}), {report['kind']}",
        f"  files: {d['files']}  total {d['bytes'] / 1e9:.3f} GB  median {d['median'] / 1e3:.1f} KB  "
        f"p90 {d['p90'] / 1e3:.1f} KB  max {d['max'] / 1e6:.1f} MB",
        "  sizes: " + ", ".join(f"{k}: {v}" for k, v in d["histogram"].items()),
    ]
    lu = report["lustre"]
    if lu["is_lustre"]:
        cur = lu["current"]
        if cur:
            c = cur["components"][-1]
            lines.append(f"  striping now: count {c['stripe_count']}, size {c['stripe_size']}")
        lines.append(f"  OSTs: {lu['osts'] or 'unknown'}")
    rec = lu["recommended"]
    if rec:
        lines.append(f"  recommended for the pack output: {rec['command']}  ({rec['reason']})")
    fit = report["fit"]
    if fit["dest"]:
        free = fit["dest_free"]
        free_s = f"{free / 1e9:.1f} GB free" if free is not None else "free space unknown"
        lines.append(f"  node-local DEST {fit['dest']}: {free_s}; needs {fit['need_bytes'] / 1e9:.2f} GB "
                     f"-> {'fits' if fit['fits_dest'] else 'does NOT fit'}")
    else:
        lines.append("  node-local DEST: none set ($STAGER_DEST, $SLURM_TMPDIR, $TMPDIR)")
    if fit["ram_available"]:
        lines.append(f"  RAM available {fit['ram_available'] / 1e9:.1f} GB -> "
                     f"{'fits in page cache' if fit['fits_ram'] else 'does not fit in RAM'}")
    cache = report.get("cache")
    if cache:
        lines.append(f"  node-local cache: {'would pay' if cache['pays'] else 'not needed yet'} ({cache['reason']})")
    st = report.get("strategy")
    if st:
        lines.append(f"  staging strategy for {st['nodes']} node(s): {st['strategy']} ({st['reason']}): "
                     f"{st['command']}")
    lines += [f"  warning: {w}" for w in report["warnings"]]
    if report["next"]:
        lines.append("  next (in order):" if len(report["next"]) > 1 else "  next:")
        lines += [f"    {cmd}" for cmd in report["next"]]
    return "\n".join(lines)

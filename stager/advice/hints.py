"""``stager hints PATH``: what a dataset looks like to the file system, and what to do about it.

Reports the file system (Lustre/BeeGFS/...), file count and size distribution, a small-file
warning with the ``stager pack`` command that fixes it, on Lustre the current striping (``lfs
getstripe -d``) and the recommended ``lfs setstripe`` for a pack output directory (rules in
:mod:`stager.fs.lustre`, sources in docs/staging.md), whether the data fits the node-local staging
destination and RAM, and, for a packed dataset this user staged again within a day without a cache,
that a node-local shard cache would pay (:mod:`stager.cache.history`).

``next`` lists the commands to run, in order, with this dataset's paths, so that they work when
followed literally: for an image tree ``stager pack PATH PATH-packed --format tar`` and then the
staging strategy's command on the pack (``stage`` refuses an image tree); for a directory of existing
shards (webdataset tars, TFRecords, parquet, RecordIO, LMDB) ``stager index PATH`` and then the
strategy's command on it; for a pack, the strategy's command on it. What is none of these (a single
shard or other file, an unfinished pack or index) is the one-line error of
:func:`stager.manifest.not_a_pack`, which names the command that fits (exit 2).

The walk counts what ``stager pack`` would read, as the user running hints may read it: folders it
cannot read are named in a warning (pack refuses them), and symbolic links, which the walk does not
follow but an ImageFolder pack does, are counted and the first one named, so that a tree whose links
lead elsewhere (another user's files) says so before it is packed.
"""

from __future__ import annotations

import math
import os
import shlex
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stager.advice.scaling import strategy_for
from stager.cache.history import repeat_advice
from stager.errors import PathError, SourceNotFoundError, UsageError, translated
from stager.formats.registry import FORMAT_SPECS
from stager.fs import lustre
from stager.fs.info import detect_fs
from stager.fs.open import local_path_of
from stager.manifest import MANIFEST_NAME, load_manifest, not_a_pack
from stager.manifest.document import UNFINISHED_STATE
from stager.receipt import STAGING_ROOT_VARS

SMALL_FILE = 1 << 20  # files below 1 MiB are "small" for Lustre (one RPC, MDS-bound)
SMALL_FILE_COUNT = 1000  # below this many files, metadata load does not matter
DEFAULT_SHARD = 256 << 20  # stager pack's default shard size
BUCKETS = [(4 << 10, "<4K"), (64 << 10, "4K-64K"), (1 << 20, "64K-1M"), (16 << 20, "1M-16M"),
           (256 << 20, "16M-256M"), (1 << 30, "256M-1G"), (None, ">=1G")]
TAR_OVERHEAD_PER_SAMPLE = 3 * 1024 + 512  # three ustar headers + padding per sample


LIST_SUFFIXES = (".csv", ".jsonl", ".ndjson")  # list files, which `stager pack` takes as SRC
SHARD_SUFFIXES = tuple(s for spec in FORMAT_SPECS.values() for s in spec.adopt_suffixes)  # what `stager index` adopts


@dataclass
class Walk:
    """What :func:`walk` found under a directory: regular files' ``sizes``, how many of them are ``shards``
    (by suffix), the ``links`` (symbolic links, not followed) and the folders it could not read
    (``unreadable``: path and reason), each list in the order met."""

    sizes: list[int] = field(default_factory=list)
    shards: int = 0
    links: list[str] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)


def walk(root: str) -> Walk:
    """Walk ``root`` without following links. ``root`` itself unreadable is the one-line error of its errno
    (:func:`stager.errors.translated`); a folder below it is listed in :attr:`Walk.unreadable`."""
    out = Walk()
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as exc:
            if d == root:
                raise translated(exc, f"{root}: cannot read ({exc.strerror}); check its permissions (`ls -ld`)",
                                 PathError) from exc
            out.unreadable.append((d, exc.strerror or str(exc)))
            continue
        for e in entries:
            try:
                if e.is_symlink():
                    out.links.append(e.path)
                elif e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    out.sizes.append(e.stat(follow_symlinks=False).st_size)
                    out.shards += e.name.lower().endswith(SHARD_SUFFIXES)
            except OSError as exc:
                out.unreadable.append((e.path, exc.strerror or str(exc)))
    return out


def _walk_warnings(w: Walk) -> list[str]:
    """What the walk could not count, for the report's warnings."""
    out = []
    if w.unreadable:
        path, why = w.unreadable[0]
        more = f" and {len(w.unreadable) - 1} more" if len(w.unreadable) > 1 else ""
        out.append(f"{path}{more}: cannot read ({why}); the counts leave them out, and `stager pack` refuses them: "
                   "fix their permissions")
    if w.links:
        try:
            target = os.readlink(w.links[0])
        except OSError:
            target = "?"
        more = f" and {len(w.links) - 1} more" if len(w.links) > 1 else ""
        out.append(f"{w.links[0]} -> {target}{more}: symbolic links, not counted here; an ImageFolder pack follows "
                   "them, so what they point to is packed too: check where they lead")
    return out


def _kind_of(p: str) -> str:
    """``"packed"``, ``"files"`` (an image tree or a list file) or ``"shards"`` (decided after the walk): the
    rest is :func:`not_a_pack`'s error (a single shard or other file, an unfinished pack or index)."""
    if os.path.isfile(os.path.join(p, MANIFEST_NAME)) or (p.endswith(".json") and os.path.isfile(p)):
        return "packed"
    if os.path.isdir(p):
        if any(os.path.isdir(os.path.join(p, state)) for state in UNFINISHED_STATE):
            raise not_a_pack(p)
        return "files"
    if p.lower().endswith(LIST_SUFFIXES) and os.path.isfile(p):
        return "files"
    raise not_a_pack(p)


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


def _measure(p: str) -> tuple[str, np.ndarray, int, int, Any, list[str]]:
    """``(kind, file sizes, samples, bytes a copy needs, the manifest or None, warnings)`` of ``p``: a pack's
    from its manifest, a directory's from :func:`walk` (``"shards"`` when mostly shard files), a list file's
    own size."""
    kind = _kind_of(p)
    if kind == "packed":
        m = load_manifest(p)
        return kind, np.asarray([s.bytes for s in m.shards], dtype=np.int64), m.num_samples, m.copy_bytes, m, []
    if not os.path.isdir(p):  # a list file
        sizes = np.asarray([os.path.getsize(p)], dtype=np.int64)
        return kind, sizes, 1, int(sizes.sum()) + TAR_OVERHEAD_PER_SAMPLE, None, []
    w = walk(p)
    sizes = np.asarray(w.sizes, dtype=np.int64)
    if not w.sizes and not w.links:
        why = f" you may read ({w.unreadable[0][0]}: {w.unreadable[0][1]})" if w.unreadable else ""
        raise UsageError(f"{p}: holds no files{why}; give the directory of the images (or of a pack)")
    if w.shards and w.shards * 2 >= len(w.sizes):  # mostly shards: adopt them in place, not pack them again
        return "shards", sizes, len(sizes), int(sizes.sum()), None, _walk_warnings(w)
    return kind, sizes, len(sizes), int(sizes.sum()) + TAR_OVERHEAD_PER_SAMPLE * len(sizes), None, _walk_warnings(w)


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
    kind, sizes, samples, need, m, warnings = _measure(p)
    packed = kind == "packed"
    dist = distribution(sizes)
    report: dict[str, Any] = {"path": p, "fs": fs.to_json(), "kind": kind, "samples": samples, "sizes": dist,
                              "warnings": warnings}
    small = int((sizes < SMALL_FILE).sum())
    out = p.rstrip("/") + "-packed"  # where an image tree's pack goes: beside it
    pack_cmd = f"stager pack {shlex.quote(p)} {shlex.quote(out)} --format tar"
    if kind == "files" and len(sizes) >= SMALL_FILE_COUNT and small * 2 >= len(sizes):
        cmd = pack_cmd
        report["warnings"].append(
            f"{small} of {len(sizes)} files are below 1 MiB: reading them costs one metadata operation each "
            f"({'Lustre MDS' if fs.is_lustre else fs.fstype}); pack them into shards: {cmd}"
        )
        report["pack_command"] = cmd
    # Striping now and recommended for a pack output.
    num_shards = len(sizes) if kind != "files" else max(1, math.ceil(need / DEFAULT_SHARD))
    have_lfs = lustre.lfs_path() is not None
    osts = lustre.ost_count(p) if fs.is_lustre and have_lfs else None
    current = None
    if fs.is_lustre and have_lfs:
        try:
            current = lustre.getstripe(p).to_json()
        except lustre.LfsError as exc:
            report["warnings"].append(str(exc))
    rec = lustre.recommend_layout(need, num_shards, osts)
    target = out if kind == "files" else p  # an image tree's advice is about its pack
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
    first = {"files": [pack_cmd], "shards": [f"stager index {shlex.quote(p)}"]}.get(kind, [])
    report["next"] = first + ([stage_cmd] if "stager stage" in stage_cmd else [])
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

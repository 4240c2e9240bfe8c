"""The staging receipt: how the loader learns that a node-local copy exists.

``stager stage SRC DEST`` copies the shards and ``manifest.json`` into DEST (so DEST is itself a
valid packed directory) and writes ``DEST/stager-receipt.json`` last, atomically. The loader, given
SRC, looks for a receipt whose ``manifest_digest`` equals SRC's manifest digest under the staging
roots ($STAGER_DEST, $SLURM_TMPDIR, $TMPDIR, and their direct subdirectories) and reads from there.

Receipt fields (schema ``stager.receipt/1``): ``dataset_id``, ``manifest_digest``, ``source``,
``dest``, ``created``, ``host``, ``verified`` (how: e.g. ``"xxh3_128 while copying"``), ``mode``
(``"full"``, ``"partition"`` or ``"shared"``), ``partition`` (``{"num_nodes", "node", "seed",
"ranks_per_node"}`` or null), ``shards`` (names of the shards present), ``unpacked`` (path of an
ImageFolder tree written by ``--unpack`` or null), ``files`` (every path stager created, relative
to DEST: what ``stager clean`` may remove), ``stats``, ``durable`` (false after ``stage --no-fsync``:
the files may not have reached the disk) and ``boot_id`` (the boot that wrote a non-durable copy; the
copy is ignored, and staged again, once the node has rebooted).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stager.errors import ManifestError
from stager.fs.access import chgrp_quiet, size_or_missing
from stager.fs.atomic import atomic_write_bytes
from stager.fs.kernel import boot_id
from stager.manifest import Manifest

RECEIPT_NAME = "stager-receipt.json"
RECEIPT_SCHEMA = "stager.receipt/1"
# ``stager stage MIX.yaml DEST`` stages each stream into DEST/<name> and writes this file last: a
# directory holding it is searched one level deeper (so DEST itself may sit under a staging root).
MIX_RECEIPT_NAME = "stager-mix.json"
MIX_RECEIPT_SCHEMA = "stager.mix-receipt/1"
STAGING_ROOT_VARS = ("STAGER_DEST", "SLURM_TMPDIR", "TMPDIR")


@dataclass
class Receipt:
    dataset_id: str
    manifest_digest: str
    source: str
    dest: str
    created: str
    host: str
    verified: str
    mode: str = "full"
    partition: dict[str, int] | None = None
    shards: list[str] = field(default_factory=list)
    unpacked: str | None = None
    files: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    durable: bool = True
    boot_id: str = ""
    schema: str = RECEIPT_SCHEMA

    def trusted(self) -> bool:
        """False for a non-durable copy written before the last reboot (its files may be torn)."""
        return self.durable or self.boot_id == boot_id()

    def write(self, dest: str | os.PathLike[str], mode: int | None = None, gid: int | None = None) -> Path:
        """Write DEST/stager-receipt.json atomically with ``mode``, then give it group ``gid`` (if allowed)."""
        path = Path(dest) / RECEIPT_NAME
        atomic_write_bytes(path, (json.dumps(asdict(self), indent=1) + "\n").encode(), mode=mode)
        chgrp_quiet(path, gid)
        return path


def load_receipt(dest: str | os.PathLike[str]) -> Receipt | None:
    """Read ``DEST/stager-receipt.json``; None if absent. A damaged receipt raises ManifestError."""
    path = Path(dest) / RECEIPT_NAME
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path}: unreadable receipt ({exc}); run `stager clean` and stage again") from exc
    if not isinstance(data, dict) or data.get("schema") != RECEIPT_SCHEMA:
        raise ManifestError(f"{path}: unknown receipt schema; run `stager clean` and stage again")
    try:
        rec = Receipt(**data)
    except TypeError as exc:
        raise ManifestError(f"{path}: malformed receipt ({exc})") from exc
    bad = _wrong_types(rec)
    if bad:
        raise ManifestError(f"{path}: malformed receipt (field {bad!r} has the wrong type); run `stager clean` "
                            "and stage again")
    return rec


def _wrong_types(rec: Receipt) -> str | None:
    """The first field of ``rec`` whose JSON type is not the documented one, else None."""
    for name in ("dataset_id", "manifest_digest", "source", "dest", "created", "host", "verified", "mode"):
        if not isinstance(getattr(rec, name), str):
            return name
    for name in ("shards", "files"):
        v = getattr(rec, name)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            return name
    if rec.unpacked is not None and not isinstance(rec.unpacked, str):
        return "unpacked"
    if rec.partition is not None and not isinstance(rec.partition, dict):
        return "partition"
    if not isinstance(rec.stats, dict):
        return "stats"
    if not isinstance(rec.durable, bool):
        return "durable"
    if not isinstance(rec.boot_id, str):
        return "boot_id"
    return None


def staging_roots(extra: Iterable[str | os.PathLike[str]] = ()) -> list[Path]:
    """Directories searched for staged copies: ``extra`` first, then $STAGER_DEST, $SLURM_TMPDIR, $TMPDIR."""
    roots = [Path(p) for p in extra]
    roots += [Path(os.environ[v]) for v in STAGING_ROOT_VARS if os.environ.get(v)]
    seen: set[Path] = set()
    out = []
    for r in roots:
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def _subdirs(d: Path) -> list[Path]:
    try:
        return sorted(p for p in d.iterdir() if p.is_dir())
    except OSError:
        return []


def _candidates(root: Path) -> list[Path]:
    """``root``, its direct subdirectories, and the subdirectories of those that hold a staged mix."""
    out = [root, *_subdirs(root)]
    for d in list(out):
        if (d / MIX_RECEIPT_NAME).is_file():
            out += [p for p in _subdirs(d) if p not in out]
    return out


def find_staged_copy(
    manifest: Manifest, extra_roots: Iterable[str | os.PathLike[str]] = ()
) -> tuple[Path, Receipt] | None:
    """Find a complete node-local copy of ``manifest``'s dataset; return ``(dest dir, receipt)``.

    A candidate counts only if its receipt names the same manifest digest, every shard it lists
    exists with the manifest's size (a cheap stat, no hashing: stage verified them while copying),
    and it is not a ``--no-fsync`` copy from before a reboot.
    """
    digest = manifest.digest or manifest.compute_digest()
    sizes = {s.name: s.bytes for s in manifest.shards}
    for root in staging_roots(extra_roots):
        candidates = _candidates(root)
        for d in candidates:
            try:
                rec = load_receipt(d)
            except ManifestError:
                continue
            if rec is None or rec.manifest_digest != digest or not rec.trusted():
                continue
            if all(size_or_missing(d / name) == sizes.get(name, -2) for name in rec.shards):
                return d, rec
    return None



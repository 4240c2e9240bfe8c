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
the files may not have reached the disk), ``boot_id`` (the boot that wrote a non-durable copy; the
copy is ignored, and staged again, once the node has rebooted) and ``cache`` (null, or ``{"dir",
"kind", "links"}`` when the shards are links to a shard cache's objects, ``stage --cache``: the loader
then reads them through the cache, with its checks).

Trust (docs/security.md): a staging root is often shared (``/tmp``), so anyone may plant a directory
with a receipt there. :func:`find_staged_copy` takes a copy only when its directory, receipt and
shards are the user's (or root's), regular or real directories (no links, FIFOs), not writable by
others, under directories nobody else can change; when the receipt names that very directory and a
non-empty list of the manifest's shards, each present with the manifest's size. Every candidate of
the same dataset that fails is logged as a warning saying why. ``source`` is stored redacted
(:func:`stager.redact.redact`); a receipt about a URL source is ``0600``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stager.errors import ManifestError, StagerError
from stager.fs.access import chgrp_quiet
from stager.fs.atomic import atomic_write_bytes
from stager.fs.kernel import boot_id
from stager.fs.safe import check_chain, describe, problem, read_regular, read_trusted, trusted_size
from stager.manifest import MIX_RECEIPT_NAME, RECEIPT_NAME, Manifest
from stager.redact import printable, redact

MAX_RECEIPT_BYTES = 64 << 20

RECEIPT_SCHEMA = "stager.receipt/1"
# ``stager stage MIX.yaml DEST`` stages each stream into DEST/<name> and writes this file last: a
# directory holding it is searched one level deeper (so DEST itself may sit under a staging root).
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
    cache: dict[str, Any] | None = None
    schema: str = RECEIPT_SCHEMA

    def trusted(self) -> bool:
        """False for a non-durable copy written before the last reboot (its files may be torn)."""
        return self.durable or self.boot_id == boot_id()

    def write(self, dest: str | os.PathLike[str], mode: int | None = None, gid: int | None = None) -> Path:
        """Write DEST/stager-receipt.json atomically with ``mode``, then give it group ``gid`` (if allowed)."""
        path = Path(dest) / RECEIPT_NAME
        body = asdict(self)
        body["source"] = redact(self.source)
        atomic_write_bytes(path, (json.dumps(body, indent=1) + "\n").encode(), mode=mode)
        chgrp_quiet(path, gid)
        return path


def load_receipt(dest: str | os.PathLike[str]) -> Receipt | None:
    """Read ``DEST/stager-receipt.json``; None if absent. A damaged receipt raises ManifestError; one
    that is not a regular file of the user's (or root's), or is writable by others, UnsafePathError."""
    path = Path(dest) / RECEIPT_NAME
    data = read_trusted(path, what="staging receipt", limit=MAX_RECEIPT_BYTES,
                        fix="remove it (or the whole copy: see `stager clean`) and stage again")
    return None if data is None else parse_receipt(data, path)


def parse_receipt(data: bytes, path: str | os.PathLike[str]) -> Receipt:
    """A :class:`Receipt` from the bytes of ``path``; ManifestError (one line) when damaged."""
    # `stager clean DEST` removes the copy by its journal when the receipt is damaged (stager/stage/clean.py).
    fix = f"run `stager clean {os.path.dirname(os.fspath(path)) or '.'}` and stage again"
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(f"{path}: unreadable receipt ({exc}); {fix}") from exc
    if not isinstance(doc, dict) or doc.get("schema") != RECEIPT_SCHEMA:
        raise ManifestError(f"{path}: unknown receipt schema; {fix}")
    try:
        rec = Receipt(**doc)
    except TypeError as exc:
        raise ManifestError(f"{path}: malformed receipt ({exc}); {fix}") from exc
    bad = _wrong_types(rec)
    if bad:
        raise ManifestError(f"{path}: malformed receipt (field {bad!r} has the wrong type); {fix}")
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
    if rec.cache is not None and not (isinstance(rec.cache, dict) and isinstance(rec.cache.get("dir"), str)):
        return "cache"
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
    """``d``'s subdirectories, sorted; a symlink is never followed (nor listed)."""
    try:
        return [d / n for n in sorted(e.name for e in os.scandir(d) if e.is_dir(follow_symlinks=False))]
    except OSError:
        return []


def _candidates(root: Path) -> list[Path]:
    """``root`` (resolved once), its direct subdirectories, and the subdirectories of those that hold
    a staged mix (a regular ``stager-mix.json``, not a link); no symlink is followed below ``root``."""
    real = Path(os.path.realpath(root))
    out = [real, *_subdirs(real)]
    for d in list(out):
        try:
            mix = stat.S_ISREG(os.lstat(d / MIX_RECEIPT_NAME).st_mode)
        except OSError:
            mix = False
        if mix:
            out += [p for p in _subdirs(d) if p not in out]
    return out


def _log_warning(message: str) -> None:
    """A warning on the ``stager.receipt`` logger (logging imported only when there is one to give)."""
    import logging  # noqa: PLC0415

    logging.getLogger("stager.receipt").warning(message)


def find_staged_copy(
    manifest: Manifest, extra_roots: Iterable[str | os.PathLike[str]] = (),
    warn: Callable[[str], None] | None = None,
) -> tuple[Path, Receipt] | None:
    """Find a complete node-local copy of ``manifest``'s dataset; return ``(dest dir, receipt)``.

    Candidates are each staging root and its direct subdirectories (never through a symlink) that
    hold a receipt naming the same manifest digest. One counts only if :func:`untrusted_because`
    finds nothing wrong: the trust rules of the module docstring, every shard it lists present with
    the manifest's size (a cheap ``lstat``, no hashing: stage verified them while copying), not a
    ``--no-fsync`` copy from before a reboot. Each candidate skipped is reported with ``warn``
    (default: a warning on the ``stager.receipt`` logger) saying why.
    """
    digest = manifest.digest or manifest.compute_digest()
    sizes = {s.name: s.bytes for s in manifest.shards}
    say = warn or _log_warning
    for root in staging_roots(extra_roots):
        for d in _candidates(root):
            rec = _candidate(d, digest)
            if rec is None:
                continue
            why = untrusted_because(d, rec, sizes)
            if why is None:
                return d, rec
            say(printable(f"stager: skipped the staged copy at {d}: {why}"))  # d: a name anyone may pick
    return None


def _candidate(d: Path, digest: str) -> Receipt | None:
    """The receipt in ``d`` when it is about ``digest`` (read without trusting it yet: no link is
    followed, a FIFO never blocks, the size is bounded), else None."""
    try:
        data = read_regular(d / RECEIPT_NAME, limit=MAX_RECEIPT_BYTES)
        rec = parse_receipt(data, d / RECEIPT_NAME) if data is not None else None
    except (OSError, StagerError):
        return None
    return rec if rec is not None and rec.manifest_digest == digest else None


def untrusted_because(d: Path, rec: Receipt, sizes: dict[str, int]) -> str | None:
    """Why the copy in ``d`` (whose receipt ``rec`` names the right digest) may not be used, or None.

    ``sizes``: the manifest's shard name -> bytes.
    """
    try:
        check_chain(d.parent)
        st = os.lstat(d)
        rst = os.lstat(d / RECEIPT_NAME)
    except (OSError, StagerError) as exc:
        return str(exc)
    for what, s, expect in (("the directory", st, "dir"), ("its receipt", rst, "file")):
        why = problem(s, expect=expect)
        if why is not None:
            return f"{what} is {describe(s)} ({why}); only copies of your own (or root's) are used"
    if os.path.realpath(rec.dest) != os.path.realpath(d):
        return f"its receipt was written for {rec.dest}, not for this directory"
    if not rec.shards:
        return "its receipt lists no shards"
    unknown = [n for n in rec.shards if n not in sizes]
    if unknown:
        return f"its receipt lists {unknown[0]!r}, which is not a shard of this dataset"
    if not rec.trusted():
        return "a --no-fsync copy from before the last reboot"
    if rec.cache is not None:
        return None  # links into a shard cache: each shard is checked through the cache (stager.loader.cached)
    for name in rec.shards:
        if trusted_size(d / name) != sizes[name]:
            return (f"{name} is missing, not a regular file of yours, writable by others, or not the manifest's "
                    f"{sizes[name]} bytes")
    return None

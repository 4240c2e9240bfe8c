"""DEST's bookkeeping around the copy: the done check, stale partials, free space, the staged
manifest, the shared-mode barrier and the receipt.

``$STAGER_TEST_FREE_BYTES`` (test-only) overrides the free-space figure.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import time
from pathlib import Path

from stager.errors import DestinationError, StagerError, StagerTimeoutError, VerificationError
from stager.fs.access import URL_FILE_MODE, copy_mode, dir_mode, size_or_missing, source_access
from stager.fs.atomic import atomic_write_bytes, partial_path, space_error
from stager.fs.copy import write_all
from stager.fs.kernel import boot_id, syncfs
from stager.manifest import MANIFEST_NAME, manifest_path
from stager.receipt import RECEIPT_NAME, Receipt, load_receipt
from stager.stage.copier import _discard_partial
from stager.stage.plan import StagePlan
from stager.stage.result import StageResult

FREE_BYTES_ENV = "STAGER_TEST_FREE_BYTES"




def _write_partial(final: Path, data: bytes, mode: int) -> Path:
    """Write ``data`` to a fsynced ``<final>.<uuid>.partial`` with ``mode``; return its path (not renamed)."""
    tmp = partial_path(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        write_all(fd, memoryview(data))
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException as exc:
        _discard_partial(fd, tmp, final, exc)
    os.close(fd)
    return tmp


def _manifest_mode(plan: StagePlan) -> int:
    """The staged manifest's mode: the source manifest's, masked like the shards' (0o644 for URLs)."""
    if "://" in plan.src_root:
        return URL_FILE_MODE
    with contextlib.suppress(OSError):
        return copy_mode(os.stat(manifest_path(plan.source)).st_mode)
    return URL_FILE_MODE


# ---- helpers ----------------------------------------------------------------------------------------
def _receipt_done(plan: StagePlan) -> Receipt | None:
    """The existing receipt if it already satisfies ``plan`` (cheap: stats only)."""
    try:
        rec = load_receipt(plan.dest)
    except StagerError:
        return None
    if rec is None or rec.manifest_digest != plan.receipt_digest or rec.mode != plan.mode or not rec.trusted():
        return None
    if plan.mode == "partition" and rec.partition != plan.partition_info:
        return None
    if sorted(rec.shards) != sorted(plan.receipt_shards()):
        return None
    if plan.unpack and (rec.unpacked != str(plan.dest / plan.unpack_dir) or not (plan.dest / plan.unpack_dir).is_dir()):
        return None
    if any(size_or_missing(plan.dest / n) != b for n, b in plan.expected_files().items()):
        return None
    return rec


def _free_bytes(dest: Path) -> int:
    override = os.environ.get(FREE_BYTES_ENV)
    if override:
        return int(override)
    st = os.statvfs(dest)
    return st.f_bavail * st.f_frsize


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _mkdir_dest(dest: Path, src_root: str) -> None:
    if dest.is_dir():
        return
    if dest.exists():
        raise DestinationError(f"{dest}: exists and is not a directory; choose another DEST")
    mode = 0o700
    if "://" not in src_root:
        with contextlib.suppress(OSError):
            mode = dir_mode(os.stat(src_root).st_mode)
    try:
        dest.mkdir(parents=True, exist_ok=True)
        os.chmod(dest, mode)
    except OSError as exc:
        err = space_error(exc, dest)
        if err is not None:
            raise err from exc
        raise DestinationError(f"{dest}: cannot create the destination ({exc.strerror}); choose another DEST") from exc


def load_receipt_quiet(dest: Path) -> Receipt | None:
    try:
        return load_receipt(dest)
    except StagerError:
        return None


def _read_quiet(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None


def _shared_barrier(plan: StagePlan, result: StageResult, timeout: float | None) -> None:
    """Write this node's done marker, then wait until every node's marker names this manifest."""
    dest = plan.dest
    marker = {"digest": plan.manifest.digest, "node": plan.node, "num_nodes": plan.num_nodes,
              "host": socket.gethostname(), "files": [t.name for t in plan.tasks]}
    atomic_write_bytes(dest / plan.marker_name(plan.node), (json.dumps(marker) + "\n").encode(), mode=0o644)
    start = time.monotonic()
    while True:
        missing = []
        for n in range(plan.num_nodes):
            try:
                rec = json.loads((dest / plan.marker_name(n)).read_bytes())
                if rec.get("digest") != plan.manifest.digest:
                    missing.append(n)
            except (OSError, ValueError):
                missing.append(n)
        if not missing:
            break
        if timeout is not None and time.monotonic() - start > timeout:
            raise StagerTimeoutError(
                f"{dest}: nodes {missing[:8]} of {plan.num_nodes} did not finish their share within {timeout:g}s; "
                "check their logs and rerun (finished shards are kept)"
            )
        time.sleep(0.1)
    result.waited_s += time.monotonic() - start
    bad = [n for n, b in plan.expected_files().items() if size_or_missing(dest / n) != b]
    if bad:
        raise VerificationError(f"{dest}: every node reported done but {bad[0]} is missing or has the wrong size; "
                                "rerun stage on all nodes")


def _make_durable(plan: StagePlan, rec: Receipt) -> None:
    """Flush a ``--no-fsync`` copy of this boot to disk (one ``syncfs``), then mark its receipt durable."""
    syncfs(plan.dest)
    rec.durable, rec.boot_id = True, ""
    rec.write(plan.dest, *source_access(manifest_path(plan.source)))


def _write_receipt(plan: StagePlan, result: StageResult) -> None:
    dest = plan.dest
    files = sorted(plan.expected_files())
    files += [MANIFEST_NAME]
    if plan.mode == "shared":
        files += [f".stager-journal.node{n}.jsonl" for n in range(plan.num_nodes)]
        files += [plan.marker_name(n) for n in range(plan.num_nodes)]
    else:
        files += [plan.journal_path.name]
    if plan.unpack:
        files.append(plan.unpack_dir)
    files.append(RECEIPT_NAME)
    stats = {
        "files_copied": result.files_copied,
        "bytes_copied": result.bytes_copied,
        "files_kept": result.files_kept,
        "workers": result.workers,
        "block_size": result.block_size,
        "ordering": result.ordering,
        "source_fs": result.source_fs,
        "dest_fs": result.dest_fs,
        "unpacked_files": result.unpacked_files,
        "seconds": round(result.seconds, 3),
        "created_dest": not plan.explicit_dest,
    }
    rec = Receipt(
        dataset_id=plan.manifest.dataset_id,
        manifest_digest=plan.receipt_digest,
        source=plan.source,
        dest=str(dest),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(),
        verified=f"{plan.manifest.hash_algo} while copying",
        mode=plan.mode,
        partition=plan.partition_info,
        shards=plan.receipt_shards(),
        unpacked=str(dest / plan.unpack_dir) if plan.unpack else None,
        files=files,
        stats=stats,
        durable=result.durable,
        boot_id="" if result.durable else boot_id(),
    )
    rec.write(dest, *source_access(manifest_path(plan.source)))

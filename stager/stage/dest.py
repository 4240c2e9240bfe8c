"""DEST's bookkeeping around the copy, shared by the plain and the collective stage.

In the order a run meets them: :func:`make_dest_dir` (where DEST may be: :mod:`stager.stage.place`),
:func:`receipt_done` (the fast path: a receipt that covers the plan, checked by sizes only),
:func:`claim_dest` (refuse another dataset's DEST, drop a receipt that no longer describes it,
remove stale partial files), :func:`begin_journal` (what the run may write, recorded before it writes),
:func:`kept_files` (what the journal lists and DEST still holds), :func:`check_free_space`,
:class:`StagedManifest` (the verbatim ``manifest.json``, published only once every shard is in
place), :func:`shared_barrier` (shared mode: wait for every node's done marker), and
:func:`write_receipt`, always last; or
:func:`make_durable` for a ``--no-fsync`` copy asked for again durably.

Contract: everything stage writes about SRC gets SRC's manifest's access, less the umask
(:attr:`~stager.stage.plan.StagePlan.src_access`); nothing appears under its final name before it
is complete (:mod:`stager.fs.atomic`); the receipt's ``files`` name every path stage created, which
is what ``stager clean`` removes.

Trust (docs/security.md): DEST is the user's. :func:`make_dest_dir` creates it exclusively, or
accepts an existing one only when it is a real directory owned by the user (or root), not writable
by others, under directories nobody else can change (:func:`stager.fs.safe.private_dir`); anything
else is a one-line :class:`~stager.errors.UnsafePathError` (exit 2). Inside such a DEST only the
user can create names, so the path-based copy is safe; what the journal or a receipt vouches for
still counts only when it is a regular file of the user's (:func:`stager.fs.safe.trusted_size`).

``$STAGER_TEST_FREE_BYTES`` (test-only) overrides the free-space figure.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stager.errors import (
    DestinationError,
    OutOfSpaceError,
    ShardMissingError,
    StagerError,
    StagerTimeoutError,
    VerificationError,
    translated,
)
from stager.fs.access import dir_mode, give_group
from stager.fs.atomic import atomic_write_bytes, remove_partials, space_error
from stager.fs.kernel import boot_id, syncfs
from stager.fs.open import is_url, open_read
from stager.fs.safe import SafeDir, private_dir, trusted_size
from stager.fs.verified import Expected, PartialCopy, copy_verified
from stager.manifest import MANIFEST_NAME, dataset_root
from stager.receipt import RECEIPT_NAME, Receipt, load_receipt
from stager.stage.names import journal_name
from stager.stage.place import check_dest_holds, check_dest_place
from stager.stage.plan import FileTask, StagePlan

if TYPE_CHECKING:
    from stager.stage.journal import Journal

FREE_BYTES_ENV = "STAGER_TEST_FREE_BYTES"


# ---- before the copy ------------------------------------------------------------------------------
def receipt_done(plan: StagePlan) -> Receipt | None:
    """The existing receipt if it already satisfies ``plan`` (cheap: stats only), else None."""
    rec = load_receipt_quiet(plan.dest)
    if rec is None or rec.manifest_digest != plan.receipt_digest or rec.mode != plan.mode or not rec.trusted():
        return None
    if plan.mode == "partition" and rec.partition != plan.partition_info:
        return None
    if sorted(rec.shards) != sorted(plan.receipt_shards()):
        return None
    if plan.unpack and (rec.unpacked != str(plan.dest / plan.unpack_dir) or not (plan.dest / plan.unpack_dir).is_dir()):
        return None
    if any(trusted_size(plan.dest / n) != b for n, b in plan.expected_files().items()):
        return None
    return rec


DEST_FIX = "choose another DEST (if it is yours: chmod go-w it, or remove it)"


def make_dest_dir(plan: StagePlan) -> Path:
    """Refuse a DEST that is, contains or lies inside SRC, or holds something other than a copy of
    this dataset (:mod:`stager.stage.place`: exit 2, nothing created); create DEST exclusively
    (SRC's directory access less the umask, 0700 for a URL), or accept an existing directory that
    is the user's (see the module docstring); check the unpack directory, journal and lock it
    already holds. Returns DEST's real path (no link on the way that anyone else could re-point:
    everything after uses it, :func:`stager.fs.safe.check_chain`). Raises
    :class:`~stager.errors.UnsafePathError` (exit 2)."""
    dest = plan.dest
    check_dest_place(dest, {dataset_root(plan.src), plan.src_dir})  # before anything is created
    mode, gid = 0o700, None
    if not is_url(plan.src_dir):
        with contextlib.suppress(OSError):
            st = os.stat(plan.src_dir)
            mode, gid = dir_mode(st.st_mode), st.st_gid
    try:
        handle, created = private_dir(dest.parent, dest.name, mode, what="staging destination", fix=DEST_FIX)
    except StagerError:
        raise
    except OSError as exc:
        err = space_error(exc, dest)
        if err is not None:
            raise err from exc
        raise translated(exc, f"{dest}: cannot create the destination ({exc.strerror}); choose another DEST",
                         DestinationError) from exc
    with handle:
        if created:  # SRC's group, not a setgid parent's (fs/access.py)
            give_group(handle.fd, gid)
        check_own_files(plan, handle)  # first: one that is not the user's is named as such
        check_dest_holds(handle, plan.manifest, plan.manifest_bytes, stage_writes(plan))
        return Path(handle.path)


def check_own_files(plan: StagePlan, dest: SafeDir) -> None:
    """Refuse a journal, lock or unpack directory in DEST that is not the user's (a link, a FIFO,
    another owner, writable by others): stage would otherwise trust or write through it."""
    fix = f"remove it (stage writes it anew) or {DEST_FIX}"
    dest.check(plan.journal_path.name, what="staging journal", fix=fix, single_link=True)
    dest.check(plan.lock_path.name, what="staging lock", fix=fix)
    if plan.unpack:
        dest.check(plan.unpack_dir, expect="dir", what="unpack directory", fix=fix)


def claim_dest(plan: StagePlan, *, keep_receipt: bool) -> list[str]:
    """Make DEST this plan's (call with the node lock held); return the stale partial files removed.

    Refuses a DEST that holds another dataset. Unless ``keep_receipt``, removes the receipt: it no
    longer describes DEST once the run starts changing it. Removes ``<file>.<uuid>.partial``
    leftovers of this plan's files and journal; on a shared DEST not those of the manifest and the
    receipt, which another node may be writing right now.
    """
    dest, m = plan.dest, plan.manifest
    existing = load_receipt_quiet(dest)
    if existing is not None and existing.dataset_id != m.dataset_id and not existing.manifest_digest.endswith(
        m.digest
    ):
        raise DestinationError(
            f"{dest}: already holds another staged dataset ({existing.source}, id {existing.dataset_id}); "
            f"run `stager clean {dest}` first or choose another DEST"
        )
    if existing is not None and not keep_receipt:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dest / RECEIPT_NAME)
    names = {t.name for t in plan.tasks} | {plan.journal_path.name}
    if plan.mode != "shared":
        names |= {MANIFEST_NAME, RECEIPT_NAME}
        if plan.index_task is not None:  # on a shared DEST another node may be copying it right now
            names.add(plan.index_task.name)
    return remove_partials(dest, names)


def begin_journal(plan: StagePlan, journal: Journal) -> None:
    """Record in the journal, before the run creates anything in DEST, every name it may write there
    (the receipt's ``files``): what ``stager clean`` removes should the run never finish."""
    journal.begin(stage_writes(plan), unpack=plan.unpack_dir if plan.unpack else None,
                  created_dest=not plan.explicit_dest)


def stage_writes(plan: StagePlan) -> set[str]:
    """Every name the run may write into DEST: the receipt's ``files`` and, with ``--unpack only``, the
    shards that pass through DEST (what the journal records first, and what DEST may not already hold
    without a record: :func:`stager.stage.place.check_dest_holds`)."""
    names = set(receipt_files(plan)) | {t.name for t in plan.tasks}
    if plan.index_task is not None:
        names.add(plan.index_task.name)
    return names


def kept_files(plan: StagePlan, journal: Journal) -> set[str]:
    """The plan's files a resumed run keeps: journaled as verified, and still of the manifest's size."""
    return {t.name for t in plan.tasks
            if journal.files.get(t.name) == t.bytes and trusted_size(plan.dest / t.name) == t.bytes}


def free_bytes(dest: Path) -> int:
    """Bytes free for us (``f_bavail``) on DEST's file system."""
    override = os.environ.get(FREE_BYTES_ENV)
    if override:
        return int(override)
    st = os.statvfs(dest)
    return st.f_bavail * st.f_frsize


def format_size(n: int) -> str:
    """``n`` bytes for a message: GB with 2 decimals from 0.1 GB, else MB with 1."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def check_free_space(dest: Path, need: int) -> None:
    """Raise :class:`OutOfSpaceError` (exit 4, needed vs free) before anything is copied."""
    free = free_bytes(dest)
    if need > free:
        raise OutOfSpaceError(
            f"{dest}: staging needs {format_size(need)} but only {format_size(free)} is free; free space, stage a "
            "--partition share, or choose another DEST"
        )


# ---- the staged manifest --------------------------------------------------------------------------
class StagedManifest:
    """DEST's verbatim copy of SRC's ``manifest.json`` and its sample index: what makes DEST a packed
    directory for the loader, so they are published only once every shard is in place, and a failed
    run never leaves a manifest that promises missing shards.

    :meth:`prepare` copies the sample index (hashed while copied, checked against the manifest) and
    writes the manifest, each as a fsynced ``<name>.<uuid>.partial`` with SRC's access (nothing for
    what DEST already holds), :meth:`publish` renames them into place, index first, :meth:`discard`
    removes unpublished ones. Every node copies the index itself, from beside SRC's manifest, in
    every mode (it is small next to the shards: 24 bytes and the key per sample). The directory fsync
    that makes the renames durable is the caller's (one for every rename of the run).
    """

    def __init__(self, plan: StagePlan) -> None:
        self.plan = plan
        self.path = plan.dest / MANIFEST_NAME
        self._partial: Path | None = None
        self._index_partial: Path | None = None

    def prepare(self) -> None:
        plan = self.plan
        mode, gid = plan.src_access
        task = plan.index_task
        if task is not None and self._index_partial is None and trusted_size(plan.dest / task.name) != task.bytes:
            self._index_partial = copy_index(task, plan.dest / task.name, (mode, gid), plan.storage_options,
                                             plan.manifest.hash_algo)
        if self._partial is None and read_quiet(self.path) != plan.manifest_bytes:
            self._partial = write_partial(self.path, plan.manifest_bytes, (mode, gid))

    def publish(self) -> bool:
        """Rename the prepared copies into place, index first; True if there was one (DEST then needs
        a directory fsync)."""
        renamed = False
        index, self._index_partial = self._index_partial, None
        if index is not None and self.plan.index_task is not None:
            with contextlib.suppress(FileNotFoundError):  # shared DEST: another node published it
                os.replace(index, self.plan.dest / self.plan.index_task.name)
            renamed = True
        partial, self._partial = self._partial, None
        if partial is None:
            return renamed
        try:
            os.replace(partial, self.path)
        except FileNotFoundError:
            # Shared DEST: another node starting up removed it as a stale partial.
            if read_quiet(self.path) != self.plan.manifest_bytes:
                atomic_write_bytes(self.path, self.plan.manifest_bytes, mode=self.plan.src_access[0])
        return True

    def discard(self) -> None:
        for p in (self._partial, self._index_partial):
            if p is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        self._partial = self._index_partial = None


def copy_index(task: FileTask, final: Path, access: tuple[int, int | None], storage_options: dict[str, Any],
               algo: str) -> Path:
    """The one verified copy (:func:`~stager.fs.verified.copy_verified`) of ``task``'s file to a fsynced
    ``<final>.<uuid>.partial`` with ``access`` (mode, group); return the partial (not renamed). A size
    or hash that differs from the manifest's is a :class:`~stager.errors.VerificationError` naming the
    file and SRC (exit 3), and nothing is left behind."""
    expect = Expected(task.name, task.bytes, task.hash, algo)
    try:
        src = open_read(task.src_path, storage_options, size=task.bytes if is_url(task.src_path) else None)
    except FileNotFoundError as exc:
        raise ShardMissingError(f"{task.src_path}: the manifest's sample index is missing in SRC; "
                                "re-run the pack") from exc
    with src:
        part = copy_verified(src, final, expect, context=f" copying {task.src_path}",
                             fix="restore it or re-run the pack", buf=memoryview(bytearray(1 << 20)))
    return part.seal(*access)[0]


def write_partial(final: Path, data: bytes, access: tuple[int, int | None]) -> Path:
    """Write ``data`` to a fsynced ``<final>.<uuid>.partial`` with ``access`` (mode, group); return
    its path (not renamed)."""
    part = PartialCopy(final)
    part.write(data)
    return part.seal(*access)[0]


# ---- after the copy -------------------------------------------------------------------------------
def shared_barrier(plan: StagePlan, timeout: float | None) -> float:
    """Write this node's done marker, wait until every node's marker names this manifest, then check
    that DEST holds every file; return the seconds waited."""
    dest = plan.dest
    marker = {"digest": plan.manifest.digest, "node": plan.node, "num_nodes": plan.num_nodes,
              "host": os.uname().nodename, "files": [t.name for t in plan.tasks]}
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
    waited = time.monotonic() - start
    bad = [n for n, b in plan.expected_files().items() if trusted_size(dest / n) != b]
    if bad:
        raise VerificationError(f"{dest}: every node reported done but {bad[0]} is missing or has the wrong size; "
                                "rerun stage on all nodes")
    return waited


def make_durable(plan: StagePlan, rec: Receipt) -> None:
    """Flush a ``--no-fsync`` copy of this boot to disk (one ``syncfs``), then mark its receipt durable."""
    syncfs(plan.dest)
    rec.durable, rec.boot_id = True, ""
    rec.write(plan.dest, *plan.src_access)


def receipt_files(plan: StagePlan) -> list[str]:
    """Every path the finished run created in DEST, relative to it: the receipt's ``files``."""
    files = sorted(plan.expected_files())
    if plan.unpack == "only" and plan.index_task is not None:
        files.append(plan.index_task.name)  # the sample index is staged in every mode (StagedManifest)
    files += [MANIFEST_NAME]
    if plan.mode == "shared":
        files += [journal_name(n) for n in range(plan.num_nodes)]
        files += [plan.marker_name(n) for n in range(plan.num_nodes)]
    else:
        files += [plan.journal_path.name]
    if plan.unpack:
        files.append(plan.unpack_dir)
    files.append(RECEIPT_NAME)
    return files


def write_receipt(plan: StagePlan, *, verified: str, stats: dict[str, Any], durable: bool = True,
                  cache: dict[str, Any] | None = None) -> None:
    """Write DEST's receipt for ``plan`` (the run's last write), with SRC's access.

    ``verified`` says how (``"<algo> while copying"``); ``stats`` are the run's figures; a
    non-``durable`` receipt carries this boot's id and is not trusted after a reboot; ``cache`` says
    which shard cache DEST's links point into (``stage --cache``).
    """
    dest = plan.dest
    rec = Receipt(
        dataset_id=plan.manifest.dataset_id,
        manifest_digest=plan.receipt_digest,
        source=plan.src,
        dest=str(dest),
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        host=os.uname().nodename,
        verified=verified,
        mode=plan.mode,
        partition=plan.partition_info,
        shards=plan.receipt_shards(),
        unpacked=str(dest / plan.unpack_dir) if plan.unpack else None,
        files=receipt_files(plan),
        stats=stats,
        durable=durable,
        boot_id="" if durable else boot_id(),
        cache=cache,
    )
    rec.write(dest, *plan.src_access)


def confirm_staged(plan: StagePlan) -> None:
    """The last check before a stage reports ``ok``: DEST, opened without following a link and still
    the user's, holds the manifest it staged, byte for byte, and its receipt (relative to the DEST
    handle, so a path swapped meanwhile cannot answer for it). Else :class:`VerificationError`."""
    fix = f"stage again into {plan.dest} (a DEST only you can change)"
    try:
        with SafeDir.open(plan.dest, what="staging destination", fix=DEST_FIX) as d:
            got = d.read_bytes(MANIFEST_NAME, what="staged manifest")
            receipt = d.lstat(RECEIPT_NAME)
    except FileNotFoundError:
        got, receipt = None, None
    if got != plan.manifest_bytes:
        raise VerificationError(f"{plan.dest}: the staged {MANIFEST_NAME} is "
                                f"{'missing' if got is None else 'not the one staged'} after the copy; {fix}")
    if receipt is None:
        raise VerificationError(f"{plan.dest}: {RECEIPT_NAME} is missing after the copy; {fix}")


# ---- quiet reads ----------------------------------------------------------------------------------
def load_receipt_quiet(dest: Path) -> Receipt | None:
    """DEST's receipt, or None when there is none or it is damaged (a rerun then replaces it)."""
    try:
        return load_receipt(dest)
    except StagerError:
        return None


def read_quiet(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None

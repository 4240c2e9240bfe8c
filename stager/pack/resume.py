"""What a previous run left in OUT, which of its shards this run may keep, and clearing the rest.

A pack's state while it runs is ``OUT/.stager-pack/``: ``plan.json`` (schema :data:`PLAN_SCHEMA`:
the plan fingerprint, the source, the format and the planned shard names) and one done-record per
written shard (:func:`stager.pack.shard.record_done`). A rerun with the same plan (after kill -9, a
full disk, ...) keeps every shard whose done-record or previous manifest entry has this plan's
fingerprint and whose size and hash still match (:func:`find_reusable`: the files are re-hashed),
and rewrites the rest; stale ``*.partial`` files are removed. A completed pack rerun with the same
plan is left untouched. Files that no pack wrote make OUT someone else's, as does another source's
pack (:func:`check_destination`: refused without ``--overwrite``, and even then only files a pack
wrote are removed).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stager.errors import DestinationError, ManifestError
from stager.fs.atomic import atomic_write_bytes, partial_base, remove_partials
from stager.fs.verified import Expected, mismatch
from stager.manifest import MANIFEST_NAME, ShardInfo, is_index_file_name, load_manifest
from stager.pack.shard import fsync_and_hash
from stager.pack.state import (
    DONE_SUFFIX,
    PLAN_FILE,
    PLAN_SCHEMA,
    STATE_DIR,
    OutState,
    ShardDone,
    done_record_path,
    done_record_shard,
    read_done_record,
)

if TYPE_CHECKING:
    from stager.pack.plan import PackPlan
    from stager.pack.sources.base import Source


def survey_out(out: Path, shard_prefix: str) -> OutState:
    """Classify OUT's entries into a previous pack's files and anything else (``foreign``)."""
    found = OutState()
    if not out.exists():
        return found
    if not out.is_dir():
        raise DestinationError(f"{out}: exists and is not a directory; choose a directory for the pack")
    names = sorted(os.listdir(out))
    if MANIFEST_NAME in names:
        try:
            # Detached: the shards kept from it must outlive its sample index, which clear_out removes.
            found.manifest = load_manifest(out).detached()
            if found.manifest.indexed:  # `stager index` output: the shards are not stager's to remove
                raise DestinationError(f"{out}: holds a `stager index` manifest of data stager does not own; "
                                       "choose another directory for the pack (even --overwrite never removes them)")
            found.owned.update(n for n, _, _ in found.manifest.files())
        except ManifestError as exc:
            found.damaged_manifest = str(exc)
    state = out / STATE_DIR
    if state.is_dir():
        try:
            found.plan = json.loads((state / PLAN_FILE).read_text())
            found.owned.update(found.plan.get("names", []))
        except (OSError, ValueError):
            found.plan = None
        for p in state.glob(f"*{DONE_SUFFIX}"):
            d = read_done_record(p)
            if d is None:
                continue
            found.done[d.info.name] = d
            found.owned.add(d.info.name)
            found.owned.update(a.name for a in d.info.aux)
    for n in names:
        if n in (MANIFEST_NAME, STATE_DIR) or n in found.owned or partial_base(n) is not None:
            continue
        if is_index_file_name(n):
            found.owned.add(n)  # an earlier run's sample index (its manifest replaced or not yet written)
            continue
        if shard_prefix and n.startswith(shard_prefix) and found.plan is not None:
            continue  # a shard renamed before its done-record was written
        found.foreign.append(n)
    return found


def _file_matches(path: Path, nbytes: int, digest: str, algo: str) -> bool:
    """Whether ``path`` is what its done-record says, hashed and fsynced through one descriptor (a reused
    shard must be durable before the manifest names it), compared by the one comparison
    (:func:`stager.fs.verified.mismatch`; verify_file would not fsync)."""
    try:
        if path.stat().st_size != nbytes:
            return False
        got = fsync_and_hash(path, algo)
        return mismatch(Expected(path.name, nbytes, digest, algo), *got) is None
    except OSError:
        return False


def _reusable(out: Path, info: ShardInfo, algo: str) -> bool:
    return _file_matches(out / info.name, info.bytes, info.hash, algo) and all(
        _file_matches(out / a.name, a.bytes, a.hash, algo) for a in info.aux
    )


def check_destination(out: Path | str, found: OutState, source: Source, plan: PackPlan, overwrite: bool) -> None:
    """Refuse (:class:`DestinationError`) an OUT that holds files no pack wrote, a damaged manifest, or
    another source's pack with another plan; ``overwrite`` accepts all three."""
    if overwrite:
        return
    desc = source.describe()
    if found.foreign:
        shown = ", ".join(found.foreign[:3]) + (f" and {len(found.foreign) - 3} more" if len(found.foreign) > 3 else "")
        raise DestinationError(
            f"{out}: holds files that are not part of a stager pack ({shown}); choose an empty directory "
            "or pass --overwrite (only files a previous pack wrote are removed)"
        )
    if found.damaged_manifest:
        raise DestinationError(
            f"{out}: holds a damaged manifest ({found.damaged_manifest}); pass --overwrite to replace it"
        )
    prev = None
    same_plan = False
    if found.manifest is not None:
        prev = found.manifest.source
        same_plan = found.manifest.options.get("plan") == plan.fingerprint
    elif found.plan is not None:
        prev = found.plan.get("source") or {}
        same_plan = found.plan.get("plan") == plan.fingerprint
    if prev is not None and not same_plan and (prev.get("kind"), prev.get("path")) != (desc["kind"], desc["path"]):
        raise DestinationError(
            f"{out}: holds a pack of another source ({prev.get('kind')} {prev.get('path')}); "
            "choose another directory or pass --overwrite"
        )


def find_reusable(out: Path, found: OutState, plan: PackPlan, algo: str) -> dict[str, ShardDone]:
    """Completed shards of a previous run that match this plan (name, fingerprint, size, hash)."""
    cands: dict[str, ShardDone] = {}
    if found.manifest is not None and found.manifest.hash_algo == algo:
        by_shard: dict[str, list[dict[str, str]]] = {}
        for s in found.manifest.skipped:
            by_shard.setdefault(s.get("shard", ""), []).append(s)
        old = found.manifest.options.get("shard_plans") or []
        for p, info, fp in zip(plan.shards, found.manifest.shards, old, strict=False):
            if p.name == info.name and p.fingerprint == fp:
                cands[p.name] = ShardDone(info, by_shard.get(info.name, []), 0, p.fingerprint)
    for p in plan.shards:  # done-records of an interrupted run (hash_algo is part of the fingerprint)
        d = found.done.get(p.name)
        if d is not None and d.fingerprint == p.fingerprint:
            cands.setdefault(p.name, d)
    return {n: d for n, d in cands.items() if _reusable(out, d.info, algo)}


class PlanRecord:
    """``plan.json`` being written durably (partial, fsync, rename, directory fsync) on a thread, so
    that its two fsyncs (~10 ms on a busy disk) overlap the first shard's writing instead of
    preceding it. :meth:`wait` before any shard is renamed into place (a shard must never be durable
    under its final name before the plan that owns it) and before the state directory goes."""

    def __init__(self, path: Path, data: bytes) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, args=(path, data), name="stager-pack-plan", daemon=True)
        self._thread.start()

    def _write(self, path: Path, data: bytes) -> None:
        try:
            atomic_write_bytes(path, data)
        except BaseException as exc:  # handed to the waiter
            self._error = exc

    def wait(self) -> None:
        """Block until ``plan.json`` is durable; raise what writing it raised (a full disk: exit 4)."""
        self._thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise err


@dataclass(frozen=True)
class Kept:
    """What this run keeps of OUT's previous contents (the resume phase's answer)."""

    found: OutState
    shards: dict[str, ShardDone]  # by name: this plan's shards that need not be written again
    complete: bool  # OUT already holds this very pack, manifest included: nothing to do
    plan_record: PlanRecord | None = None  # plan.json on its way to disk: wait before renaming a shard

    def ready(self) -> None:
        """Wait until this run may rename shards into place (its ``plan.json`` is durable)."""
        if self.plan_record is not None:
            self.plan_record.wait()


def holds_complete_pack(found: OutState, plan: PackPlan, reusable: dict[str, ShardDone]) -> bool:
    """Whether OUT's manifest is this plan's and every planned shard is still intact."""
    return (
        found.manifest is not None
        and found.manifest.options.get("plan") == plan.fingerprint
        and len(reusable) == len(plan.shards)
    )


def clear_out(out: Path, found: OutState, keep: dict[str, ShardDone], plan: PackPlan, source: Source) -> PlanRecord:
    """Make OUT hold only what this run keeps, before it writes a shard.

    Steps in this order, so that a kill anywhere leaves what a rerun understands: the old manifest
    goes first (it must never describe replaced shards); ``plan.json`` records this plan (from then
    on shard-like names are this plan's, see :func:`survey_out`), durably on a thread
    (:class:`PlanRecord`, returned: wait for it before renaming a shard into place); partial files, a
    previous pack's files not in ``keep`` and stale done-records are removed; the kept shards'
    done-records are (re)written, so that a kill during writing still keeps them. Until a shard is
    renamed, a rerun finds nothing of this run but kept shards (their done-records say so) and partials.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    state = out / STATE_DIR
    state.mkdir(exist_ok=True)
    names = [s.name for s in plan.shards]
    record = PlanRecord(
        state / PLAN_FILE,
        json.dumps(
            {
                "schema": PLAN_SCHEMA,
                "plan": plan.fingerprint,
                "source": source.describe(),
                "format": plan.format,
                "names": names,
            }
        ).encode(),
    )
    try:
        remove_partials(out)
        kept_files = set()
        for d in keep.values():
            kept_files.add(d.info.name)
            kept_files.update(a.name for a in d.info.aux)
        for n in sorted(found.owned - kept_files):
            (out / n).unlink(missing_ok=True)
        for p in state.iterdir():  # not plan.json, nor its partial (being written)
            if PLAN_FILE not in (p.name, partial_base(p.name)) and done_record_shard(p.name) not in keep:
                p.unlink(missing_ok=True)
        for d in keep.values():  # re-record shards reused from a complete manifest
            atomic_write_bytes(done_record_path(out, d.info.name), d.to_bytes())
    except BaseException:
        with contextlib.suppress(BaseException):
            record.wait()
        raise
    return record

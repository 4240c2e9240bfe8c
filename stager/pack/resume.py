"""What a previous run left in OUT, and which of its shards this run may keep.

A rerun with the same plan (after kill -9, a full disk, ...) keeps every shard whose done-record
fingerprint matches the plan and whose size and hash still match; files that no pack wrote make
OUT someone else's (refused without ``--overwrite``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stager.errors import DestinationError, ManifestError
from stager.fs.atomic import partial_base
from stager.manifest import MANIFEST_NAME, Manifest, ShardInfo, load_manifest
from stager.pack.plan import PackPlan
from stager.pack.shard import STATE_DIR, ShardDone, fsync_and_hash
from stager.pack.sources.base import Source

PLAN_SCHEMA = "stager.pack-plan/1"


@dataclass
class OutState:
    """What a previous run left in OUT: its manifest, its plan file and its completed shards."""

    manifest: Manifest | None = None
    plan: dict[str, Any] | None = None
    done: dict[str, ShardDone] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  # files a previous pack wrote
    foreign: list[str] = field(default_factory=list)
    damaged_manifest: str | None = None


def survey_out(out: Path, shard_prefix: str) -> OutState:
    """Classify OUT's entries into a previous pack's files and anything else (``foreign``)."""
    st = OutState()
    if not out.exists():
        return st
    if not out.is_dir():
        raise DestinationError(f"{out}: exists and is not a directory; choose a directory for the pack")
    names = sorted(os.listdir(out))
    if MANIFEST_NAME in names:
        try:
            st.manifest = load_manifest(out)
            st.owned.update(n for n, _, _ in st.manifest.files())
        except ManifestError as exc:
            st.damaged_manifest = str(exc)
    state = out / STATE_DIR
    if state.is_dir():
        try:
            st.plan = json.loads((state / "plan.json").read_text())
            st.owned.update(st.plan.get("names", []))
        except (OSError, ValueError):
            st.plan = None
        for p in state.glob("*.json"):
            if p.name == "plan.json":
                continue
            try:
                d = ShardDone.from_json(json.loads(p.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            st.done[d.info.name] = d
            st.owned.add(d.info.name)
            st.owned.update(a.name for a in d.info.aux)
    for n in names:
        if n in (MANIFEST_NAME, STATE_DIR) or n in st.owned or partial_base(n) is not None:
            continue
        if shard_prefix and n.startswith(shard_prefix) and st.plan is not None:
            continue  # a shard renamed before its done-record was written
        st.foreign.append(n)
    return st


def _file_matches(path: Path, nbytes: int, digest: str, algo: str) -> bool:
    try:
        if path.stat().st_size != nbytes:
            return False
        return fsync_and_hash(path, algo) == (nbytes, digest)
    except OSError:
        return False


def _reusable(out: Path, info: ShardInfo, algo: str) -> bool:
    return _file_matches(out / info.name, info.bytes, info.hash, algo) and all(
        _file_matches(out / a.name, a.bytes, a.hash, algo) for a in info.aux
    )


def check_destination(out: Path, st: OutState, source: Source, plan: PackPlan, overwrite: bool) -> None:
    if overwrite:
        return
    desc = source.describe()
    if st.foreign:
        shown = ", ".join(st.foreign[:3]) + (f" and {len(st.foreign) - 3} more" if len(st.foreign) > 3 else "")
        raise DestinationError(
            f"{out}: holds files that are not part of a stager pack ({shown}); choose an empty directory "
            "or pass --overwrite (only files a previous pack wrote are removed)"
        )
    if st.damaged_manifest:
        raise DestinationError(
            f"{out}: holds a damaged manifest ({st.damaged_manifest}); pass --overwrite to replace it"
        )
    prev = None
    same_plan = False
    if st.manifest is not None:
        prev = st.manifest.source
        same_plan = st.manifest.options.get("plan") == plan.fingerprint
    elif st.plan is not None:
        prev = st.plan.get("source") or {}
        same_plan = st.plan.get("plan") == plan.fingerprint
    if prev is not None and not same_plan and (prev.get("kind"), prev.get("path")) != (desc["kind"], desc["path"]):
        raise DestinationError(
            f"{out}: holds a pack of another source ({prev.get('kind')} {prev.get('path')}); "
            "choose another directory or pass --overwrite"
        )


def find_reusable(out: Path, st: OutState, plan: PackPlan, algo: str) -> dict[str, ShardDone]:
    """Completed shards of a previous run that match this plan (name, fingerprint, size, hash)."""
    cands: dict[str, ShardDone] = {}
    if st.manifest is not None and st.manifest.hash_algo == algo:
        by_shard: dict[str, list[dict[str, str]]] = {}
        for s in st.manifest.skipped:
            by_shard.setdefault(s.get("shard", ""), []).append(s)
        old = st.manifest.options.get("shard_plans") or []
        for p, info, fp in zip(plan.shards, st.manifest.shards, old, strict=False):
            if p.name == info.name and p.fingerprint == fp:
                cands[p.name] = ShardDone(info, by_shard.get(info.name, []), 0, p.fingerprint)
    for p in plan.shards:  # done-records of an interrupted run (hash_algo is part of the fingerprint)
        d = st.done.get(p.name)
        if d is not None and d.fingerprint == p.fingerprint:
            cands.setdefault(p.name, d)
    return {n: d for n, d in cands.items() if _reusable(out, d.info, algo)}

"""A pack's state while it runs, ``OUT/.stager-pack/``: the names, records and types that the shard
writer, the resume logic and the remote OUT all share (the layer below all three, so none of them
imports another to reach these).

* ``plan.json`` (schema :data:`PLAN_SCHEMA`): the plan fingerprint, the source, the format and the
  planned shard names;
* one *done-record* per written shard, ``<shard name>.done``: a table file
  (:mod:`stager.manifest.table`) holding the shard's per-sample rows (the same columns as the
  dataset's sample index) with the shard's facts, its skipped samples and its plan fingerprint in
  the header's ``meta``. Binary, so that a rerun of a million-sample pack does not parse JSON lists
  and the driver holds compact columns, not Python lists.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from stager.errors import ManifestError
from stager.fs.atomic import partial_path, space_error
from stager.fs.safe import open_exclusive
from stager.manifest import PACK_STATE_NAME, AuxFile, Manifest, ShardInfo, parse_table, write_table
from stager.manifest.samples import CORE, KEY, LABEL, OFFSET, SIZE
from stager.manifest.shard import table_columns

STATE_DIR = PACK_STATE_NAME  # in OUT while a pack runs: plan.json and one done-record per written shard
PLAN_SCHEMA = "stager.pack-plan/1"
PLAN_FILE = "plan.json"  # in STATE_DIR
DONE_SUFFIX = ".done"
DONE_SCHEMA = "stager.pack-done/2"


@dataclass
class ShardDone:
    """A written shard: its :class:`ShardInfo` (rows included), skipped samples, payload bytes, and
    the fingerprint of the plan entry it was written for."""

    info: ShardInfo
    skipped: list[dict[str, str]]
    payload_bytes: int  # bytes of the samples written (for throughput)
    fingerprint: str

    def to_bytes(self, **meta: Any) -> bytes:
        """The done-record's bytes; ``meta`` adds facts for the record's reader (a remote OUT's ETags)."""
        buf = io.BytesIO()
        head = {"schema": DONE_SCHEMA, "fingerprint": self.fingerprint, "info": self.info.to_json(),
                "skipped": self.skipped, **meta}
        write_table(buf, self.info.samples, table_columns([self.info]), meta=head)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> tuple[ShardDone, dict[str, Any]]:
        """Parse a done-record: ``(done, its meta)``. Raises :class:`ManifestError` when malformed."""
        t = parse_table(data, where)
        meta = t.meta
        if meta.get("schema") != DONE_SCHEMA:
            raise ManifestError(f"{where}: not a done-record of this stager")
        j = meta["info"]
        extra = {n: c for n, c in t.columns.items() if n not in CORE}
        info = ShardInfo(
            str(j["name"]), int(j["bytes"]), str(j["hash"]), t.strings(KEY),
            t.array(LABEL), t.array(OFFSET), t.array(SIZE),
            [AuxFile(str(a["name"]), int(a["bytes"]), str(a["hash"])) for a in j.get("aux", [])],
            str(j.get("extents", "bytes")), columns=extra,
        )
        if info.samples != int(j["samples"]):
            raise ManifestError(f"{where}: done-record rows disagree with its shard entry")
        return cls(info, list(meta.get("skipped", [])), 0, str(meta["fingerprint"])), meta


def done_record_path(out: Path, shard_name: str) -> Path:
    """Where a written shard's done-record lives: ``OUT/.stager-pack/<shard name>.done``."""
    return out / STATE_DIR / f"{shard_name}{DONE_SUFFIX}"


def done_record_shard(name: str) -> str | None:
    """The shard a done-record file name is for, or None for any other file in the state directory."""
    return name[: -len(DONE_SUFFIX)] if name.endswith(DONE_SUFFIX) else None


def read_done_record(path: Path) -> ShardDone | None:
    """A local done-record, or None when it is unreadable or malformed (a hint: the shard is redone)."""
    try:
        return ShardDone.from_bytes(path.read_bytes(), str(path))[0]
    except (OSError, ManifestError, ValueError, KeyError, TypeError):
        return None


def write_hint(final: Path, data: bytes) -> None:
    """Publish a done-record atomically (partial + rename) but without fsync.

    A done-record is a hint that a rerun verifies (the shard's size and hash must match), so losing
    one in a crash costs a rewrite, never a wrong pack; an fsync per shard would cost more than the
    shard's own.
    """
    tmp = partial_path(final)
    try:
        with open_exclusive(tmp) as f:
            f.write(data)
        os.replace(tmp, final)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        err = space_error(exc, final)  # a full disk is exit 4 with one line, not a traceback
        if err is not None:
            raise err from exc
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class OutState:
    """What a previous run left in OUT: its manifest, its plan file and its completed shards."""

    manifest: Manifest | None = None
    plan: dict[str, Any] | None = None  # the previous run's plan.json
    done: dict[str, ShardDone] = field(default_factory=dict)
    owned: set[str] = field(default_factory=set)  # files a previous pack wrote
    foreign: list[str] = field(default_factory=list)
    damaged_manifest: str | None = None


class Uploader(Protocol):
    """Where a finished shard goes when OUT is a URL (:class:`stager.pack.remote.RemoteOut`)."""

    def upload_files(self, spool: str | os.PathLike[str], names: list[str]) -> dict[str, str]: ...

    def record_done(self, done: ShardDone, etags: dict[str, str]) -> None: ...

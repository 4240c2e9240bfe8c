"""``stager stage MIX.yaml [DEST]``: stage every stream of a mix, so the loader reads each from node-local storage.

Each stream is staged as the dataset it is, one after another, with the run's options (plain,
``--partition``, ``--shared``; collective: :mod:`stager.stage.collective.mix`): into ``DEST/<stream
name>`` when DEST is given, else into its own default ``stager-<dataset id>`` under the first
staging root. With a DEST, ``DEST/stager-mix.json`` (:data:`~stager.receipt.MIX_RECEIPT_NAME`) is
written last, atomically: it lists the streams' directories, and the loader's lookup of staged copies
searches such a directory one level deeper, so DEST may itself sit under $STAGER_DEST, $SLURM_TMPDIR
or $TMPDIR (or be passed as ``staging_roots``). Each stream keeps its own lock, journal and
receipt: a rerun after a failure resumes every stream where it stopped; a failed stream ends the run
with its error (named) and exit code, the streams staged before it are kept.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stager.errors import StagerError, UsageError
from stager.fs.access import URL_FILE_MODE, current_umask
from stager.fs.safe import private_dir
from stager.manifest import RESERVED_NAMES, UNPACK_DIR_NAME, dataset_root
from stager.mix import Mix, Stream, named_error
from stager.receipt import MIX_RECEIPT_NAME, MIX_RECEIPT_SCHEMA
from stager.redact import has_secret, redact
from stager.stage.dest import DEST_FIX
from stager.stage.options import StageOptions
from stager.stage.place import check_mix_dest
from stager.stage.plan import read_src_manifest
from stager.stage.run import run_stage


@dataclass
class MixStageResult:
    """A staged mix: one entry per stream (``name`` plus that stream's own result, as ``stager stage --json``
    prints it), the mix receipt written (or None without a DEST), totals and the streams' warnings."""

    ok: bool
    source: str
    dest: str | None
    streams: list[dict[str, Any]] = field(default_factory=list)
    mix_receipt: str | None = None
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "source": self.source, "dest": self.dest, "mix_receipt": self.mix_receipt,
                "seconds": round(self.seconds, 6), "streams": self.streams, "warnings": self.warnings}

    def summary(self) -> str:
        parts = []
        for s in self.streams:
            copied = s.get("bytes_copied", s.get("written_bytes", 0))
            parts.append(f"{s['name']}: {'already staged' if s.get('already_staged') else f'{copied / 1e9:.3f} GB'} "
                         f"-> {s.get('dest')}")
        return (f"staged a mix of {len(self.streams)} streams in {self.seconds:.2f} s"
                f"{' into ' + self.dest if self.dest else ''}: " + "; ".join(parts))


def stream_dest(dest: str | os.PathLike[str] | None, stream: Stream) -> str | None:
    """Where a stream is staged: ``DEST/<name>``, or None (its own default under the staging roots)."""
    return None if dest is None else os.path.join(os.fspath(dest), stream.name)


def stream_stage_options(stream: Stream, options: StageOptions) -> StageOptions:
    """The run's options with the stream's storage options over them (a stream on its own object store)."""
    if not stream.storage_options:
        return options
    return replace(options, storage_options={**options.storage_options, **stream.storage_options})


def check_sources(mix: Mix, options: StageOptions) -> None:
    """Read every stream's manifest before anything is copied: a missing or damaged stream, or the same
    dataset twice, fails the run with its one-line error (named) and nothing staged."""
    seen: dict[str, str] = {}
    for s in mix.streams:
        try:
            manifest, _ = read_src_manifest(s.path, stream_stage_options(s, options).storage_options)
        except StagerError as exc:
            raise named_error(s.name, exc) from exc
        if manifest.dataset_id in seen:
            raise UsageError(f"duplicate stream: {seen[manifest.dataset_id]!r} and {s.name!r} are the same dataset "
                             f"({manifest.dataset_id}); list it once and give it a weight, samples or repeat")
        seen[manifest.dataset_id] = s.name


def stage_streams(mix: Mix, dest: str | os.PathLike[str] | None,
                  stage_one: Callable[[Stream, str | None], Any]) -> MixStageResult:
    """Stage each stream with ``stage_one(stream, its DEST)`` (a :class:`StageResult`-like object with
    ``to_json`` and ``warnings``), then write the mix receipt; errors are named after their stream."""
    t0 = time.perf_counter()
    check_mix_dest(dest, [dataset_root(s.path) for s in mix.streams])
    reserved = RESERVED_NAMES - {UNPACK_DIR_NAME}
    for s in mix.streams:
        if dest is not None and (s.name in reserved or s.name.endswith(".partial")):
            # DEST/<name> would take the place of the mix receipt (or of a copy's own file): a stage that
            # fails after copying, or a DEST that `stager clean` refuses.
            raise UsageError(f"stream name {s.name!r} is reserved for stager's own files in DEST "
                             f"({', '.join(sorted(reserved))}, *.partial): give the stream another name")
    res = MixStageResult(ok=True, source=mix.source or mix.describe(), dest=None if dest is None else os.fspath(dest))
    entries = []
    for s in mix.streams:
        where = stream_dest(dest, s)
        try:
            got = stage_one(s, where)
        except StagerError as exc:
            raise named_error(s.name, exc) from exc
        res.streams.append({"name": s.name, **got.to_json()})
        res.warnings += [f"stream {s.name!r}: {w}" for w in got.warnings]
        entries.append({"name": s.name, "path": redact(s.path), "dir": s.name, "dataset_id": got.dataset_id})
    if dest is not None:
        doc = {"schema": MIX_RECEIPT_SCHEMA, "source": None if mix.source is None else redact(mix.source),
               "mix": mix.to_json(), "streams": entries}
        res.mix_receipt = write_mix_receipt(dest, doc, secret=any(has_secret(s.path) for s in mix.streams))
    res.seconds = time.perf_counter() - t0
    return res


def write_mix_receipt(dest: str | os.PathLike[str], doc: dict[str, Any], *, secret: bool) -> str:
    """Write ``DEST/stager-mix.json`` atomically, relative to a checked handle on DEST (the user's, not
    writable by others: docs/security.md); its mode follows the umask, 0600 when a stream's URL hid a secret."""
    d = Path(os.path.abspath(dest))
    handle, _ = private_dir(d.parent, d.name, what="staging destination", fix=DEST_FIX)
    with handle:
        mode = URL_FILE_MODE if secret else 0o666 & ~current_umask()
        handle.write_atomic(MIX_RECEIPT_NAME, (json.dumps(doc, indent=1) + "\n").encode(), mode)
    return str(d / MIX_RECEIPT_NAME)


def run_stage_mix(mix: Mix, dest: str | os.PathLike[str] | None, options: StageOptions) -> MixStageResult:
    """Stage every stream of ``mix`` with a plain stage each (:func:`~stager.stage.run.run_stage`)."""
    check_sources(mix, options)
    return stage_streams(mix, dest, lambda s, where: run_stage(s.path, where, stream_stage_options(s, options)))

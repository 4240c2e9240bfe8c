"""Progress files: how training ranks tell a prefetch follower where they are (docs/scaling.md).

Each rank writes ``DEST/.stager-progress/rank<r>.json`` (atomically: tmp + rename) with its
position (epoch, batches done), pid and host, the loader's plan arguments (:func:`loader_config`,
enough to rebuild its exact read order) and its read-ahead (:func:`loader_read_ahead`). The
follower (:mod:`stager.prefetch.follow`) polls them; ``DEST/.stager-progress/done`` tells it to stop.
Training code uses :class:`ProgressReporter`; the functions are the protocol underneath.

A report is one JSON object: ``{"rank", "epoch", "done", "pid", "host", "finished", "failed",
"config", "read_ahead", "start", "time"}`` (:func:`report_progress`); ``config`` is the dict of
:func:`loader_config` (the keys of :class:`stager.loader.LoaderOptions` that decide the read order).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stager.world import World

if TYPE_CHECKING:
    from stager.loader import Loader, ShardedDataset

PROGRESS_DIR = ".stager-progress"
DONE_MARKER = "done"
_REPORT_RE = re.compile(r"rank(\d+)\.json")


def report_progress(
    dest: str | os.PathLike[str],
    rank: int,
    epoch: int,
    batches_done: int,
    *,
    config: dict[str, Any] | None = None,
    finished: bool = False,
    failed: bool = False,
    read_ahead: int | None = None,
    start: tuple[int, int] | None = None,
) -> None:
    """Record that ``rank`` finished ``batches_done`` batches of ``epoch`` (for a follower process).

    Writes ``DEST/.stager-progress/rank<r>.json`` atomically (tmp + rename, no fsync: progress is
    ephemeral): ``{"rank", "epoch", "done", "pid", "host", "finished", "failed", "config",
    "read_ahead", "start", "time"}``. ``config``: the loader's plan arguments (:func:`loader_config`);
    ``read_ahead``: batches the loader's workers load ahead of ``done`` (:func:`loader_read_ahead`);
    ``start``: the (epoch, batches done) this run of the rank began reading at ((0, 0), or where a
    resumed loader starts), so that a follower that first sees the rank later still accounts every
    read since; ``finished``: the rank will read no more (training ended, or failed).
    """
    d = Path(dest) / PROGRESS_DIR
    d.mkdir(exist_ok=True)
    rec = {
        "rank": rank,
        "epoch": epoch,
        "done": batches_done,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "finished": finished,
        "failed": failed,
        "config": config,
        "read_ahead": read_ahead,
        "start": None if start is None else list(start),
        "time": time.time(),
    }
    tmp = d / f".rank{rank}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, d / f"rank{rank}.json")


def read_reports(dest: str | os.PathLike[str], ranks: Iterable[int] = ()) -> dict[int, dict[str, Any]]:
    """The last progress record of every rank that reported in DEST (rank -> record).

    ``ranks`` are also looked up by name: a directory listing taken while another report is being
    renamed into place may miss an entry (readdir is unspecified under concurrent renames), a
    lookup by name never does. Missing or unreadable records are left out.
    """
    out: dict[int, dict[str, Any]] = {}
    d = Path(dest) / PROGRESS_DIR
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    found = {int(m.group(1)) for m in map(_REPORT_RE.fullmatch, names) if m}
    for r in sorted(found | set(ranks)):
        try:
            rec = json.loads((d / f"rank{r}.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict):
            out[r] = rec
    return out


def read_progress(dest: str | os.PathLike[str], ranks: Sequence[int]) -> tuple[int, int] | None:
    """The slowest of ``ranks``' reported (epoch, batches done), or None if one has not reported."""
    reports = read_reports(dest, ranks)
    out = []
    for r in ranks:
        rec = reports.get(r)
        if rec is None:
            return None
        out.append((int(rec["epoch"]), int(rec["done"])))
    return min(out)


def mark_done(dest: str | os.PathLike[str]) -> None:
    """Tell a follower on DEST that training is over (what ``touch DEST/.stager-progress/done`` does)."""
    d = Path(dest) / PROGRESS_DIR
    d.mkdir(parents=True, exist_ok=True)
    (d / DONE_MARKER).touch()


def loader_config(loader: Loader | ShardedDataset) -> dict[str, Any]:
    """The plan arguments of a :func:`~stager.loader.make_loader` Loader (or a ShardedDataset).

    Passed (with ``rank``) to ``ShardedDataset`` (:meth:`~stager.loader.LoaderOptions.from_kwargs`)
    they reproduce the rank's read order exactly: batch size, world size, worker streams, seed,
    shuffle mode, drop_last, run size and the per-worker shuffle buffer (resolved to samples, so
    ``"auto"`` settings cannot drift); ``"deal_batches": True`` when the ranks take the epoch's batches in
    turn (what ``accelerator.prepare`` asks of a ``shuffle=False`` loader:
    :meth:`~stager.loader.rank.RankDataset.deal_batches_in_turn`), which ``make_loader`` does not take.
    """
    from stager.loader import Loader  # already imported: the caller holds one of its objects  # noqa: PLC0415 (the loader imports torch)

    if isinstance(loader, Loader):
        ds, nw = loader.dataset, loader.num_workers
    else:
        ds, nw = loader, int(loader.num_workers or 0)
    dealt = {"deal_batches": True} if ds.deal_batches else {}
    return {
        "batch_size": int(ds.batch_size),
        "world_size": int(ds.world_size),
        "num_workers": nw,
        "seed": int(ds.seed),
        "shuffle": ds.mode,
        "drop_last": bool(ds.drop_last),
        "run_bytes": int(ds.run_bytes),
        "min_run": int(ds.min_run),
        "shuffle_buffer": int(ds.buffer_samples(max(1, nw))),
        **dealt,
    }


def loader_read_ahead(loader: Loader) -> int:
    """Batches a Loader's DataLoader workers have in flight beyond the one being consumed.

    ``num_workers x prefetch_factor`` (torch's default factor is 2); 0 in-process. When a rank has
    finished ``d`` batches, its workers have loaded (or are loading) batches up to ``d + this``.
    """
    if loader.num_workers == 0:
        return 0
    pf = loader.prefetch_factor
    return loader.num_workers * int(pf if pf is not None else 2)


class ProgressReporter:
    """What a training rank calls so that ``stager stage --follow`` knows where it is.

    ``ProgressReporter(DEST, loader)`` (the Loader reading DEST) reports the loader's position
    and plan arguments at once; iterate epochs with :meth:`iterate` (or call :meth:`update` after
    each training step with the epoch and batches done in it), and use it as a context manager (or
    call :meth:`finish`) so the follower learns when the rank is done. Writes are throttled to one
    per ``min_interval`` seconds except at an epoch change and at the end. ``rank`` defaults to
    the loader's rank. ``start``: the (epoch, batches done) this run begins at, when no loader is
    given and training resumes (default: the loader's resumed position, else (0, 0)).
    """

    def __init__(
        self,
        dest: str | os.PathLike[str],
        loader: Loader | None = None,
        *,
        rank: int | None = None,
        min_interval: float = 0.02,
        start: tuple[int, int] | None = None,
    ) -> None:
        self.dest = Path(dest)
        self.config = loader_config(loader) if loader is not None else None
        self.read_ahead = loader_read_ahead(loader) if loader is not None else None
        if rank is None:
            if loader is None:
                rank = World.detect().rank
            else:
                rank = loader.dataset.rank
        self.rank = rank
        self.min_interval = min_interval
        self._pos = (0, 0)
        if loader is not None:
            st = loader.state_dict()  # a resumed loader starts mid-epoch
            self._pos = (int(st["epoch"]), int(st["batches_done"]))
        # Where this run began reading: a follower accounts every read from here, also the ones
        # made before it first saw this rank (it may start after training did).
        self.start = self._pos if start is None else (int(start[0]), int(start[1]))
        self._last = 0.0
        self._write()

    def _write(self, *, finished: bool = False, failed: bool = False) -> None:
        report_progress(self.dest, self.rank, *self._pos, config=self.config, finished=finished, failed=failed,
                        read_ahead=self.read_ahead, start=self.start)
        self._last = time.monotonic()

    def update(self, epoch: int, batches_done: int) -> None:
        """``batches_done`` batches of ``epoch`` are finished (the epoch's last one: its length)."""
        new_epoch = epoch != self._pos[0]
        self._pos = (epoch, batches_done)
        if new_epoch or time.monotonic() - self._last >= self.min_interval:
            self._write()

    def iterate(self, loader: Loader) -> Iterator[dict[str, Any]]:
        """``for batch in progress.iterate(loader)``: one epoch of ``loader``, reported as it goes.

        A batch counts as done when the next one is asked for (the training step on it is over)
        and at the end of the epoch; the epoch and a resumed loader's start come from
        ``loader.state_dict()``.
        """
        st = loader.state_dict()
        epoch, done = int(st["epoch"]), int(st["batches_done"])
        if done >= len(loader):  # a finished epoch: iterating it starts the next one
            epoch, done = epoch + 1, 0
        for batch in loader:
            yield batch
            done += 1
            self.update(epoch, done)

    def finish(self, failed: bool = False) -> None:
        """This rank reads no more: the follower exits once every rank of the node has finished."""
        self._write(finished=True, failed=failed)

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.finish(failed=et is not None)

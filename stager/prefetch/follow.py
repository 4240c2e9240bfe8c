"""``stager stage SRC DEST --follow``: keep DEST filled with what this node's ranks read next.

One process per node runs beside training. It makes DEST a prefetch directory (manifest + a verified
local copy or a symlink into SRC per shard, :func:`stager.prefetch.prepare_dest`), then polls the
progress files the node's ranks write (:class:`stager.prefetch.ProgressReporter`) and drives a
:class:`stager.prefetch.Prefetcher` with the slowest rank's (epoch, batches done): Belady's MIN
within the byte budget, fetching ahead (hash while copying, ``.partial`` + fsync + rename) and
evicting shards whose next read is furthest away or not in the lookahead at all.

What is planned, and for whom:

* Loader arguments: from the command line (so fetching starts while training still starts up),
  else from the first report. Reports carry the ranks' actual plan arguments
  (:func:`stager.prefetch.loader_config`); when they differ from the command line's, the reports
  win (warning, re-plan): the order the ranks read is the one that matters.
* Ranks: ``ranks`` when given, else the ranks that report (DEST is node-local, so every report in
  it comes from this node). Each rank is scheduled from its own reported position; its hits and
  misses are counted from where it began reading (the report's ``start``), the reads before the
  follower first saw it by DEST as the follower found it.

While running it writes ``DEST/.stager-progress/follower.json`` (ranks observed, slowest position,
figures so far) when the set of observed ranks changes and every second, for monitoring.

Stops (reason in the result) when every planned rank has finished (``finished``), the done marker
``DEST/.stager-progress/done`` exists (``done``), every reporting rank's process is gone without
finishing (``ranks-gone``, a crashed run), the watched pid is gone (``pid-gone``), this process's
parent is gone (``parent-gone``), ``epochs`` epochs are done (``epochs``), or on SIGTERM/SIGINT
(``signal``). A fetch in progress is then abandoned between chunks and its ``.partial`` deleted, so
DEST holds only verified copies and symlinks; the loader keeps reading correctly with or without a
follower.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stager.errors import UsageError
from stager.fs.lock import NodeLock, pid_alive
from stager.prefetch.prefetcher import (
    DONE_MARKER,
    PROGRESS_DIR,
    Prefetcher,
    PrefetchStats,
    prepare_dest,
    read_reports,
    remove_fetch_partials,
)

LOCK_NAME = ".stager-follow.lock"
STATUS_NAME = "follower.json"
STATUS_INTERVAL = 1.0


@dataclass
class FollowResult:
    """What one follower did: why it stopped, for whom it planned, and the prefetch figures."""

    src: str
    dest: str
    budget: int
    reason: str = ""
    ranks: list[int] = field(default_factory=list)
    loader_kwargs: dict[str, Any] | None = None
    position: tuple[int, int] | None = None
    replans: int = 0
    seconds: float = 0.0
    removed_partials: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    stats: PrefetchStats = field(default_factory=PrefetchStats)
    on_warning: Callable[[str], None] | None = field(default=None, repr=False)

    def warn(self, message: str) -> None:
        """Record a warning and pass it on at once (a follower runs for hours; exit is too late)."""
        self.warnings.append(message)
        if self.on_warning is not None:
            self.on_warning(message)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "ok": True,
            "mode": "follow",
            "src": self.src,
            "dest": self.dest,
            "stopped": self.reason,
            "ranks": self.ranks,
            "loader": self.loader_kwargs,
            "position": None if self.position is None else {"epoch": self.position[0],
                                                            "batches_done": self.position[1]},
            "replans": self.replans,
            "seconds": round(self.seconds, 3),
            "removed_partials": self.removed_partials,
            "warnings": self.warnings,
        }
        d.update(self.stats.to_json())
        d["budget"] = self.budget
        return d

    def summary(self) -> str:
        s = self.stats
        read = s.hit_bytes + s.miss_bytes
        return (
            f"prefetch follower stopped ({self.reason}) after {self.seconds:.1f}s: hit rate {s.hit_rate:.1%} "
            f"({s.hit_bytes / 1e9:.3f} of {read / 1e9:.3f} GB read locally), fetched {s.fetched_shards} shards "
            f"({s.fetched_bytes / 1e9:.3f} GB), evicted {s.evicted_shards}, peak local "
            f"{s.peak_local_bytes / 1e9:.3f} GB of the {self.budget / 1e9:.3f} GB budget"
        )


@contextlib.contextmanager
def stop_on_signals(
    stop: threading.Event,
    signums: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
    ignore: Sequence[int] = (signal.SIGUSR1,),
) -> Iterator[None]:
    """Within the block, ``signums`` set ``stop`` (main thread only) instead of killing the process.

    ``ignore``: SIGUSR1 is what `#SBATCH --signal=USR1@...` sends to every task of every step
    before the time limit, as the training's "checkpoint and exit" request. The follower keeps
    going: the ranks finish (their reports say so) and it exits then.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in signums}
    old.update({s: signal.signal(s, signal.SIG_IGN) for s in ignore})
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _clear_stale(dest: Path) -> None:
    """Forget a previous run's reports (writer gone) and done marker: they are not this run's."""
    d = dest / PROGRESS_DIR
    d.mkdir(exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(d / DONE_MARKER)
    host = socket.gethostname()
    for r, rec in read_reports(dest).items():
        if rec.get("host") == host and not pid_alive(int(rec.get("pid", 0))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(d / f"rank{r}.json")


def follow(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    budget: int,
    loader_kwargs: dict[str, Any] | None = None,
    ranks: Sequence[int] | None = None,
    watch_pid: int | None = None,
    epochs: int | None = None,
    poll: float = 0.05,
    chunk_bytes: int = 8 << 20,
    lookahead_epochs: int = 1,
    stop: threading.Event | None = None,
    lock_timeout: float | None = 0.0,
    on_warning: Callable[[str], None] | None = None,
) -> FollowResult:
    """Run the follower until training ends or ``stop`` is set (see the module docstring).

    ``loader_kwargs``: the training loader's plan arguments (as for ``ShardedDataset``: batch_size,
    world_size, num_workers, seed, shuffle, drop_last, run_bytes, min_run, shuffle_buffer), or None
    to learn them from the first report. ``ranks``: the global ranks on this node, or None to
    learn them. One follower per DEST: a second one fails after ``lock_timeout`` seconds.
    ``on_warning`` gets each warning when it arises (they are also in the result).
    """
    if budget <= 0:
        raise UsageError(f"--budget must be > 0 bytes, got {budget}")
    if epochs is not None and epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {epochs}")
    t0 = time.monotonic()
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    stop = stop or threading.Event()
    parent = os.getppid()
    host = socket.gethostname()
    res = FollowResult(src=os.fspath(src), dest=str(d), budget=budget, loader_kwargs=loader_kwargs,
                       on_warning=on_warning)
    fixed_ranks = sorted(set(ranks)) if ranks else None
    with NodeLock(d / LOCK_NAME, timeout=lock_timeout):
        manifest = prepare_dest(src, d)
        res.removed_partials = remove_fetch_partials(d, manifest)
        sizes = manifest.shard_bytes
        if len(sizes) and int(sizes.max()) > budget:
            res.warn(f"--budget {budget} B is below the largest shard ({int(sizes.max())} B, with its "
                                "companion files): such shards are never fetched, and nothing needed after them")
        _clear_stale(d)
        pf: Prefetcher | None = None
        seen_configs: set[str] = set()
        known_pids: set[int] = set()
        seen: set[int] = set()  # ranks that reported: looked up by name from then on
        observed: set[int] = set()  # ranks whose position the prefetcher has (counted from there)
        last_status: tuple[set[int], float] = (set(), 0.0)
        try:
            while True:
                # Liveness before reading: a rank that finishes writes its last report, then exits,
                # so a pid dead before this read has its final report in this read.
                dead = {pid for pid in known_pids if not pid_alive(pid)}
                reports = read_reports(d, set(fixed_ranks or ()) | set(seen))
                seen.update(reports)
                known_pids = {int(rec.get("pid", 0)) for rec in reports.values() if rec.get("host") == host}
                plan_ranks = fixed_ranks or sorted(reports)
                cfg = loader_kwargs
                reported = [reports[r]["config"] for r in sorted(reports) if reports[r].get("config")]
                if reported:
                    cfg = reported[0]
                    for other in reported[1:]:
                        if other != cfg and repr(other) not in seen_configs:
                            seen_configs.add(repr(other))
                            res.warn(f"ranks report different loader arguments: {other} vs {cfg}")
                if plan_ranks and cfg is not None:
                    if pf is None:
                        pf = Prefetcher(src, d, budget=budget, ranks=plan_ranks, loader_kwargs=cfg,
                                        lookahead_epochs=lookahead_epochs, chunk_bytes=chunk_bytes,
                                        baseline=False).start()
                        if reported and loader_kwargs is not None and pf.config() != _resolved(pf, loader_kwargs):
                            res.warn(f"the ranks' loader arguments {cfg} differ from the command "
                                                f"line's {loader_kwargs}; following the ranks")
                    elif plan_ranks != pf.ranks or (reported and cfg != pf.config()):
                        if reported and cfg != pf.config():
                            res.warn(f"the ranks' loader arguments {cfg} differ from the planned "
                                                f"{pf.config()}; re-planned")
                        pf.replan(plan_ranks, cfg)
                        res.replans += 1
                    res.ranks, res.loader_kwargs = list(pf.ranks), dict(cfg)
                    for r in plan_ranks:
                        if r in reports:
                            pf.advance(*_loaded(reports[r], pf.batches_per_epoch, cfg), rank=r,
                                       start=_start(reports[r]))
                            if int(reports[r]["done"]) == 0 and not reports[r].get("finished"):
                                pf.refresh(r)  # not stepping yet: what is fetched meanwhile counts
                            observed.add(r)
                    if all(r in reports for r in plan_ranks):
                        res.position = pf.position
                    if pf.error is not None:
                        raise pf.error
                res.reason = _stop_reason(d, reports=reports, plan_ranks=plan_ranks, position=res.position,
                                          pf=pf, stop=stop, host=host, dead=dead, watch_pid=watch_pid, parent=parent,
                                          epochs=epochs)
                if res.reason:
                    break
                if observed != last_status[0] or time.monotonic() - last_status[1] >= STATUS_INTERVAL:
                    _write_status(d, res, pf, sorted(observed))
                    last_status = (set(observed), time.monotonic())
                stop.wait(poll)
        finally:
            if pf is not None:
                with contextlib.suppress(Exception):
                    pf.close()  # re-raises a thread error that the loop above already raised
                res.stats = pf.stats()
    res.stats.budget = budget
    res.seconds = time.monotonic() - t0
    return res


def _loaded(rec: dict[str, Any], batches_per_epoch: int, cfg: dict[str, Any]) -> tuple[int, int]:
    """Where a rank's workers are loading: ``done`` plus their read-ahead, within the epoch.

    The schedule starts there (the batches in flight opened their files already) and a batch's
    reads are judged by DEST when that batch began loading, not when it was consumed. The epoch's
    end needs no special case: ``(e, batches)`` is ``(e + 1, 0)`` to the prefetcher.
    """
    ahead = rec.get("read_ahead")
    if ahead is None:  # a report without it: torch's default prefetch_factor 2
        ahead = 2 * int(cfg.get("num_workers") or 0)
    done = int(rec["done"])
    if done == 0:  # reported before the first step (start or resume): loading may not have begun
        return int(rec["epoch"]), 0
    return int(rec["epoch"]), min(done + int(ahead), batches_per_epoch)


def _start(rec: dict[str, Any]) -> tuple[int, int] | None:
    """Where the rank began reading in this run (None from a reporter that does not say)."""
    st = rec.get("start")
    if not isinstance(st, (list, tuple)) or len(st) != 2:
        return None
    return int(st[0]), int(st[1])


def _write_status(dest: Path, res: FollowResult, pf: Prefetcher | None, observed: list[int]) -> None:
    """``DEST/.stager-progress/follower.json``: what the follower plans for and its figures so far."""
    rec = {"pid": os.getpid(), "time": time.time(), "ranks": res.ranks, "observed": observed,
           "position": res.position, "stats": pf.stats().to_json() if pf is not None else None}
    d = dest / PROGRESS_DIR
    tmp = d / f".{STATUS_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, d / STATUS_NAME)


def _resolved(pf: Prefetcher, loader_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``loader_kwargs`` with "auto" settings resolved as the loader resolves them on DEST."""
    from stager.loader import ShardedDataset
    from stager.prefetch.prefetcher import loader_config

    kw = {k: v for k, v in loader_kwargs.items() if k != "staged"}
    return loader_config(ShardedDataset(str(pf.dest), rank=pf.ranks[0], staged=False, **kw))


def _stop_reason(
    dest: Path,
    *,
    reports: dict[int, dict[str, Any]],
    plan_ranks: list[int],
    position: tuple[int, int] | None,
    pf: Prefetcher | None,
    stop: threading.Event,
    host: str,
    dead: set[int],
    watch_pid: int | None,
    parent: int,
    epochs: int | None,
) -> str:
    if stop.is_set():
        return "signal"
    if (dest / PROGRESS_DIR / DONE_MARKER).exists():
        return "done"
    mine = [reports[r] for r in plan_ranks if r in reports]
    if plan_ranks and len(mine) == len(plan_ranks) and all(rec.get("finished") for rec in mine):
        return "finished"
    if reports and all(rec.get("finished") or (rec.get("host") == host and int(rec.get("pid", 0)) in dead)
                       for rec in reports.values()):
        return "ranks-gone"
    if watch_pid is not None and not pid_alive(watch_pid):
        return "pid-gone"
    if os.getppid() != parent:
        return "parent-gone"
    if epochs is not None and position is not None and pf is not None:
        e, b = position
        if e >= epochs or (e == epochs - 1 and b >= pf.batches_per_epoch):
            return "epochs"
    return ""

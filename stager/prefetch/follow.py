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

:func:`follow` runs a :class:`Follower`: lock DEST, prepare it, then poll until a stop reason, each
poll in phases: *observe* (read the reports: an :class:`Observation`), *plan* (start the
prefetcher, or re-plan it when the ranks or their loader arguments changed), *advance* (each
reporting rank's loading position), *decide* (:meth:`Follower.stop_reason`), *status* (the
monitoring file).

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
from stager.prefetch.prefetcher import Prefetcher, PrefetchStats, own_dest, prepare_dest, remove_fetch_partials
from stager.prefetch.reports import DONE_MARKER, PROGRESS_DIR, read_reports

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

    ``loader_kwargs``: the training loader's plan arguments (as for ``make_loader``: batch_size,
    world_size, num_workers, seed, shuffle, drop_last, run_bytes, min_run, shuffle_buffer), or None
    to learn them from the first report. ``ranks``: the global ranks on this node, or None to
    learn them. One follower per DEST: a second one fails after ``lock_timeout`` seconds.
    ``on_warning`` gets each warning when it arises (they are also in the result).
    """
    if budget <= 0:
        raise UsageError(f"--budget must be > 0 bytes, got {budget}")
    if epochs is not None and epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {epochs}")
    follower = Follower(src, dest, budget=budget, loader_kwargs=loader_kwargs, ranks=ranks, watch_pid=watch_pid,
                        epochs=epochs, poll=poll, chunk_bytes=chunk_bytes, lookahead_epochs=lookahead_epochs,
                        stop=stop, on_warning=on_warning)
    return follower.run(lock_timeout)


@dataclass(frozen=True)
class Observation:
    """One poll of the ranks' progress files.

    ``reports``: rank -> its last record; ``dead``: pids of this host's reporting ranks that were gone
    before the read (so their final report is in it); ``plan_ranks``: the ranks to plan for;
    ``config``: the loader arguments to plan with (the first report's, else the command line's, else
    None); ``reported``: ``config`` comes from a report.
    """

    reports: dict[int, dict[str, Any]]
    dead: set[int]
    plan_ranks: list[int]
    config: dict[str, Any] | None
    reported: bool


class Follower:
    """One ``stage --follow`` process's state between polls (see the module docstring)."""

    def __init__(
        self,
        src: str | os.PathLike[str],
        dest: str | os.PathLike[str],
        *,
        budget: int,
        loader_kwargs: dict[str, Any] | None,
        ranks: Sequence[int] | None,
        watch_pid: int | None,
        epochs: int | None,
        poll: float,
        chunk_bytes: int,
        lookahead_epochs: int,
        stop: threading.Event | None,
        on_warning: Callable[[str], None] | None,
    ) -> None:
        self.src, self.dest = src, Path(dest)
        own_dest(self.dest)
        self.budget, self.loader_kwargs = budget, loader_kwargs
        self.fixed_ranks = sorted(set(ranks)) if ranks else None
        self.watch_pid, self.epochs, self.poll = watch_pid, epochs, poll
        self.chunk_bytes, self.lookahead_epochs = chunk_bytes, lookahead_epochs
        self.stop = stop or threading.Event()
        self.parent = os.getppid()
        self.host = socket.gethostname()
        self.result = FollowResult(src=os.fspath(src), dest=str(self.dest), budget=budget, loader_kwargs=loader_kwargs,
                                on_warning=on_warning)
        self.pf: Prefetcher | None = None
        self._warned_configs: set[str] = set()
        self._known_pids: set[int] = set()
        self._seen: set[int] = set()  # ranks that reported: looked up by name from then on
        self._observed: set[int] = set()  # ranks whose position the prefetcher has (counted from there)
        self._status_written: tuple[set[int], float] = (set(), 0.0)  # observed ranks and time of the last

    def run(self, lock_timeout: float | None) -> FollowResult:
        """Lock DEST, prepare it, poll until a stop reason; the result (prefetch figures included)."""
        t0 = time.monotonic()
        with NodeLock(self.dest / LOCK_NAME, timeout=lock_timeout):
            self._prepare()
            try:
                while not self._poll_once():
                    self.stop.wait(self.poll)
            finally:
                self._close()
        self.result.stats.budget = self.budget
        self.result.seconds = time.monotonic() - t0
        return self.result

    def _prepare(self) -> None:
        """DEST as a prefetch directory, a killed follower's partials removed, stale reports forgotten."""
        manifest = prepare_dest(self.src, self.dest)
        self.result.removed_partials = remove_fetch_partials(self.dest, manifest)
        sizes = manifest.shard_bytes
        if len(sizes) and int(sizes.max()) > self.budget:
            self.result.warn(f"--budget {self.budget} B is below the largest shard ({int(sizes.max())} B, with its "
                          "companion files): such shards are never fetched, and nothing needed after them")
        _clear_stale(self.dest)

    def _poll_once(self) -> bool:
        """Observe, plan, advance, decide, report status; True when the follower stops."""
        obs = self.observe()
        if obs.plan_ranks and obs.config is not None:
            pf = self._plan(obs.plan_ranks, obs.config, obs.reported)
            self._advance(pf, obs, obs.config)
        self.result.reason = self.stop_reason(obs)
        if self.result.reason:
            return True
        observed, at = self._status_written
        if self._observed != observed or time.monotonic() - at >= STATUS_INTERVAL:
            _write_status(self.dest, self.result, self.pf, sorted(self._observed))
            self._status_written = (set(self._observed), time.monotonic())
        return False

    def observe(self) -> Observation:
        """Read the reports; whom to plan for and with which loader arguments (warns on disagreement)."""
        # Liveness before reading: a rank that finishes writes its last report, then exits, so a
        # pid dead before this read has its final report in this read.
        dead = {pid for pid in self._known_pids if not pid_alive(pid)}
        reports = read_reports(self.dest, set(self.fixed_ranks or ()) | self._seen)
        self._seen.update(reports)
        self._known_pids = {int(rec.get("pid", 0)) for rec in reports.values() if rec.get("host") == self.host}
        cfg = self.loader_kwargs
        reported = [reports[r]["config"] for r in sorted(reports) if reports[r].get("config")]
        if reported:
            cfg = reported[0]
            for other in reported[1:]:
                if other != cfg and repr(other) not in self._warned_configs:
                    self._warned_configs.add(repr(other))
                    self.result.warn(f"ranks report different loader arguments: {other} vs {cfg}")
        return Observation(reports, dead, self.fixed_ranks or sorted(reports), cfg, bool(reported))

    def _plan(self, plan_ranks: list[int], cfg: dict[str, Any], reported: bool) -> Prefetcher:
        """The prefetcher for ``plan_ranks`` and ``cfg``: started at the first call, re-planned on a change."""
        pf = self.pf
        if pf is None:
            pf = self.pf = Prefetcher(self.src, self.dest, budget=self.budget, ranks=plan_ranks, loader_kwargs=cfg,
                                      lookahead_epochs=self.lookahead_epochs, chunk_bytes=self.chunk_bytes,
                                      baseline=False).start()
            if reported and self.loader_kwargs is not None and pf.config() != pf.config_for(self.loader_kwargs):
                self.result.warn(f"the ranks' loader arguments {cfg} differ from the command line's "
                              f"{self.loader_kwargs}; following the ranks")
        elif plan_ranks != pf.ranks or (reported and cfg != pf.config()):
            if reported and cfg != pf.config():
                self.result.warn(f"the ranks' loader arguments {cfg} differ from the planned {pf.config()}; re-planned")
            pf.replan(plan_ranks, cfg)
            self.result.replans += 1
        self.result.ranks, self.result.loader_kwargs = list(pf.ranks), dict(cfg)
        return pf

    def _advance(self, pf: Prefetcher, obs: Observation, cfg: dict[str, Any]) -> None:
        """Move every reporting rank to its loading position; the slowest once all have reported."""
        for r in obs.plan_ranks:
            rec = obs.reports.get(r)
            if rec is None:
                continue
            pf.advance(*_loading_position(rec, pf.batches_per_epoch, cfg), rank=r, start=_start_position(rec))
            if int(rec["done"]) == 0 and not rec.get("finished"):
                pf.refresh(r)  # not stepping yet: what is fetched meanwhile counts
            self._observed.add(r)
        if all(r in obs.reports for r in obs.plan_ranks):
            self.result.position = pf.position
        if pf.error is not None:
            raise pf.error

    def stop_reason(self, obs: Observation) -> str:
        """Why to stop now (see the module docstring), or "" to go on."""
        if self.stop.is_set():
            return "signal"
        if (self.dest / PROGRESS_DIR / DONE_MARKER).exists():
            return "done"
        mine = [obs.reports[r] for r in obs.plan_ranks if r in obs.reports]
        if obs.plan_ranks and len(mine) == len(obs.plan_ranks) and all(rec.get("finished") for rec in mine):
            return "finished"
        if obs.reports and all(
            rec.get("finished") or (rec.get("host") == self.host and int(rec.get("pid", 0)) in obs.dead)
            for rec in obs.reports.values()
        ):
            return "ranks-gone"
        if self.watch_pid is not None and not pid_alive(self.watch_pid):
            return "pid-gone"
        if os.getppid() != self.parent:
            return "parent-gone"
        position, pf = self.result.position, self.pf
        if self.epochs is not None and position is not None and pf is not None:
            e, b = position
            if e >= self.epochs or (e == self.epochs - 1 and b >= pf.batches_per_epoch):
                return "epochs"
        return ""

    def _close(self) -> None:
        if self.pf is not None:
            with contextlib.suppress(Exception):
                self.pf.close()  # re-raises a thread error that the loop already raised
            self.result.stats = self.pf.stats()


def _loading_position(rec: dict[str, Any], batches_per_epoch: int, cfg: dict[str, Any]) -> tuple[int, int]:
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


def _start_position(rec: dict[str, Any]) -> tuple[int, int] | None:
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

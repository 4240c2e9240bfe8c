"""A cluster for the length of one process (a test session): up at the start, down at the end, on
every way the process can end.

* Normal end, an exception, Ctrl-C (KeyboardInterrupt), SIGTERM or SIGHUP (turned into
  KeyboardInterrupt by :func:`signals_interrupt`, as ``make`` sends SIGTERM to its recipe and CI
  time limits and closed terminals send theirs): the ``finally`` of :func:`session` takes it down,
  also when the signal came in the middle of the bring-up.
* SIGKILL, a crash, or a signal in the middle of the take-down: a *reaper* does it. It is started
  before the bring-up, in a session of its own (a signal to the test's process group does not reach
  it), and reads a pipe whose only writer is this process; the kernel closes the pipe whatever way
  this process ends. At end of file the reaper takes the cluster down if its record still names this
  process as owner (after a clean take-down there is no record, and it just exits).
* Reaper killed too (a CI job's whole process tree): the record names a dead session, and the next
  ``up`` of any checkout clears it (:mod:`tools.cluster.lifecycle`).

A healthy cluster of a live owner (``make cluster`` by hand, or another session) is used as it is
and left up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from types import FrameType

from . import lifecycle
from .config import ROOT, Config
from .proc import ClusterError
from .state import Owner, Record

ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # Once: a second signal while the first one's cleanup runs must not cut it short (the reaper is
    # there for a SIGKILL).
    for sig in ENDING_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}")


def _ctrl_c(signum: int, frame: FrameType | None) -> None:
    # Python's own Ctrl-C (a second one still interrupts), but a SIGTERM that follows (make or .ci/run
    # passing the same stop on) must not cut short the teardown the first one started.
    for sig in ENDING_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.default_int_handler(signum, frame)


def signals_interrupt() -> None:
    """SIGTERM and SIGHUP end this process as Ctrl-C does (KeyboardInterrupt in the main thread), so
    ``finally`` blocks and pytest's session teardown run. Main thread only. A SIGINT that this process
    inherited as ignored (a background job of a non-interactive shell, as ``.ci/run`` starts make)
    stays ignored: such a parent passes the stop on as SIGTERM."""
    for sig in ENDING_SIGNALS:
        signal.signal(sig, _interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _ctrl_c)


def reusable(cfg: Config) -> bool:
    """A complete, healthy cluster whose owner is alive (or brought it up by hand)."""
    rec = Record(cfg.record)
    owner = rec.owner
    if owner is not None and owner.dead_session:
        return False
    try:
        lifecycle.healthy(cfg, rec)
    except ClusterError:
        return False
    return True


class Reaper:
    """The process that takes the cluster down if this one ends without doing so (module docstring)."""

    def __init__(self, cfg: Config, owner: Owner) -> None:
        r, self._w = os.pipe()
        cfg.logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CLUSTER_ROOT": str(cfg.root), "CLUSTER_NODES": str(cfg.nodes)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        with open(cfg.logs / "reaper.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.cluster", "reap", "--owner-pid", str(owner.pid),
                 "--owner-start", str(owner.start)],
                stdin=r, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env=env)
        os.close(r)

    def release(self) -> None:
        """The cluster is down (or not ours): close the pipe; the reaper finds nothing to do and exits."""
        if self._w >= 0:
            os.close(self._w)
            self._w = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)


def reap(cfg: Config, owner: Owner) -> int:
    """The reaper's body: wait for end of file on stdin, then take the cluster down if ``owner`` still
    owns it."""
    with contextlib.suppress(OSError):
        while os.read(0, 1 << 12):
            pass
    rec = Record(cfg.record)
    if not lifecycle.exists(cfg) or rec.owner != owner:
        return 0
    lifecycle.log(f"reaper: {owner.describe()} ended without taking the cluster down; taking it down")
    lifecycle.down(cfg)
    return 0


@contextlib.contextmanager
def session(cfg: Config) -> Iterator[bool]:
    """Hold a cluster for this process: yield True when this session brought it up (and takes it down
    on leaving, however it leaves), False when it uses a live owner's healthy cluster as it is."""
    if reusable(cfg):
        yield False
        return
    owner = Owner.this_process("session")
    reaper = Reaper(cfg, owner)
    try:
        lifecycle.up(cfg, owner=owner)
        Record(cfg.record).set("reaper", reaper.proc.pid)
        yield True
    finally:
        try:
            if Record(cfg.record).owner == owner or not lifecycle.exists(cfg):
                lifecycle.down(cfg)
        finally:
            reaper.release()


"""The worker processes of a :class:`~concurrent.futures.ProcessPoolExecutor`: ending them, and naming one that ended.

``pack -j`` and ``index -j`` run on such a pool. Two things the executor does not offer (before Python 3.14):

* :func:`kill_workers`: end every worker at once (SIGKILL) and wait until each is gone. On an interrupt
  what they do is abandoned, and a worker blocked reading a FIFO, a hung file or a stalled server would
  otherwise keep the pool's shutdown, and so stager, waiting for ever; after a worker died, its siblings
  must be gone before the caller removes their ``.partial`` files (or they could write one after).
* :func:`ended_workers` and :func:`lost_worker_error`: the pool breaks
  (:class:`~concurrent.futures.process.BrokenProcessPool`) when one worker ends on its own: the OOM
  killer's SIGKILL, a ``kill`` of that one process, a crash. The error that replaces it is one line that
  names the worker's pid and signal and what to do, with the exit code of the table
  (:class:`~stager.errors.WorkerLostError`), instead of the pool's traceback. The pool itself ends the
  other workers with SIGTERM and SIGKILL is :func:`kill_workers`'s, so a crash's signal (SIGSEGV, SIGBUS)
  is the cause wherever it appears, then a SIGKILL, then a SIGTERM; callers take :func:`ended_workers`
  before :func:`kill_workers` so that its SIGKILLs are not counted.
* :func:`end_with_parent`, a worker's initializer: the worker is SIGKILLed when stager itself ends without
  ending it (``kill -9``, the OOM killer choosing stager): a worker waits on its task queue, whose write end
  its siblings hold open too, so it would never see the end and stay, an orphan, for ever.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from stager.errors import WorkerLostError

if TYPE_CHECKING:  # multiprocessing is imported by the callers that start a pool, not by importing this module
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing.process import BaseProcess

__all__ = ["end_with_parent", "ended_workers", "kill_workers", "lost_worker_error", "signals_held"]


def _processes(ex: ProcessPoolExecutor) -> list[BaseProcess]:
    """The pool's worker processes (no public way to reach them before Python 3.14; none once shut down)."""
    return list((getattr(ex, "_processes", None) or {}).values())


_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP (blocked) for the block; one that came meanwhile is delivered after it.

    Around a pool's ``submit`` (which forks or spawns its workers): a signal whose handler raises inside
    ``os.fork``'s after-fork hooks is printed as "Exception ignored" and lost, and the run went on to the
    end. The workers inherit the mask: :func:`end_with_parent` unblocks them."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def end_with_parent() -> None:
    """In a pool worker (its ``initializer``): have the kernel SIGKILL it when the process that started it ends.

    Linux's ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked the worker ends: the pools of
    ``pack -j`` and ``index -j`` start their workers from the thread that runs the pack or index, and are
    shut down before it returns. A parent that ended before the setting took effect is caught by comparing
    ``getppid()``. Unblocks the signals :func:`signals_held` held. The rest is a no-op where ``prctl`` is
    missing (not Linux)."""
    import ctypes  # noqa: PLC0415 (a worker's start only)
    import multiprocessing  # noqa: PLC0415 (the pool imported it already)

    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)  # held by the parent while it started this worker

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    if prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it ended already: the signal will not come
        os.kill(os.getpid(), signal.SIGKILL)


def kill_workers(ex: ProcessPoolExecutor) -> None:
    """SIGKILL every worker of ``ex`` and wait until each is gone (a worker already gone is skipped)."""
    kill = getattr(ex, "kill_workers", None)  # Python 3.14
    if kill is not None:
        kill()
    procs = _processes(ex)
    # A second Ctrl-C (or SIGTERM) must not stop this half-way: a worker left alive is one Python's exit
    # would wait for. Held until every worker has its SIGKILL, then delivered.
    with signals_held():
        for p in procs:
            with contextlib.suppress(OSError, ValueError):  # gone already, or closed
                p.kill()
    for p in procs:
        with contextlib.suppress(ValueError):
            p.join()


def ended_workers(ex: ProcessPoolExecutor) -> dict[int, int]:
    """``{pid: exit code}`` of the workers of ``ex`` that have ended (a negative code: the signal that ended it).

    A worker has ended when its sentinel (a pipe only it holds open) is readable: that happens as the kernel
    closes its files, a moment before it can be waited for, so each such worker is waited for without
    being reaped (``waitid`` with ``WNOWAIT``: the pool still reaps it)."""
    from multiprocessing.connection import wait as mp_wait  # noqa: PLC0415 (the pool imported it already)

    procs = {p.sentinel: p for p in _processes(ex) if p.pid is not None}
    out: dict[int, int] = {}
    for sentinel in mp_wait(list(procs), timeout=0):  # ready now: no waiting
        p = procs[sentinel]  # type: ignore[index]
        pid = int(p.pid)  # type: ignore[arg-type]  # started: it has one
        info = None
        with contextlib.suppress(ChildProcessError):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        code = (info.si_status if info.si_code == os.CLD_EXITED else -info.si_status) if info else _reaped_code(p)
        if code is not None:
            out[pid] = code
    return out


def _reaped_code(p: BaseProcess) -> int | None:
    """The exit code of ``p``, which the pool's thread has just reaped: that thread stores it once it holds
    the GIL again (a few switch intervals at most; None should it not)."""
    for _ in range(1000):
        code = p.exitcode
        if code is not None:
            return code
        time.sleep(0.001)
    return None


def _cause(ended: dict[int, int]) -> tuple[int, int] | None:
    """The ``(pid, exit code)`` that broke the pool (the module docstring's order), None when none ended badly."""
    def rank(code: int) -> int:
        if code == -signal.SIGTERM:
            return 3
        if code == -signal.SIGKILL:
            return 2
        return 1 if code < 0 else 4

    bad = sorted((rank(code), pid, code) for pid, code in ended.items() if code != 0)
    return (bad[0][1], bad[0][2]) if bad else None


def lost_worker_error(ended: dict[int, int], what: str, fix: str) -> WorkerLostError:
    """The error for a pool that broke: ``a <what> worker (pid P) was killed (SIGKILL: out of memory?); <fix>``
    (``an`` before a vowel)
    (``ended``: :func:`ended_workers`; ``fix``: what to rerun, and that the run resumes)."""
    cause = _cause(ended)
    a = "an" if what[:1] in "aeiou" else "a"
    if cause is None:
        return WorkerLostError(f"{a} {what} worker ended unexpectedly; {fix}")
    pid, code = cause
    if code > 0:
        return WorkerLostError(f"{a} {what} worker (pid {pid}) exited with status {code}; {fix}")
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = f"{name}: out of memory?" if code == -signal.SIGKILL else name
    return WorkerLostError(f"{a} {what} worker (pid {pid}) was killed ({why}); {fix}")

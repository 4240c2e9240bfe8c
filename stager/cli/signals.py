"""SIGINT, SIGTERM and SIGHUP end a stager command as Ctrl-C does, promptly, whatever the main thread is doing.

:func:`end_on_signals` (called by :func:`stager.cli.main`) makes each of them raise, in the main thread,
KeyboardInterrupt (SIGINT) or :class:`Interrupted` (SIGTERM: Slurm's time limit, ``scancel``; SIGHUP: a
closed terminal), so that the command's clean-up runs and ``--json`` still prints its object (exit 130).
A signal the process was started with ignored (``nohup``) stays ignored.

**Why a relay.** Python runs a signal's handler in the main thread, between bytecodes; the C-level
handler only records the signal. A signal that lands after the main thread's last such check and before
it enters a blocking system call (the ``read`` of a FIFO that ``open`` has just returned, a wait on a
lock), or that the kernel hands to another thread (numpy's OpenBLAS threads, pack's ``plan.json``
writer), interrupts nothing: the handler then runs when that call returns, which for a FIFO whose writer
waits for stager to exit is never. :func:`start_relay` closes that window: Python also writes the number
of every signal it catches to a pipe (:func:`signal.set_wakeup_fd`); a relay thread reads it and, for an
ending signal, sends the main thread :data:`POKE` (:func:`signal.pthread_kill`; its handler does
nothing) until that handler has run. The poke makes the blocking call fail with EINTR; Python then runs
the pending handlers (PEP 475: every call it retries checks them first), lowest signal number first, so
the KeyboardInterrupt is raised there and the poke's handler runs at the next check at the latest. A
poke that itself lands in the window is repeated every :data:`POKE_INTERVAL` seconds until one is
taken; this bounds how late a handler runs, the outcome never depends on it.

The relay is a low-level ``_thread`` thread, not a :class:`threading.Thread`: the workers of ``pack -j``
and ``index -j`` are forked only while ``threading.active_count() == 1`` (a thread holding a lock at the
fork would leave it locked in the child), and the relay holds none while it waits on its pipe.

**Processes stager forks** (``pack -j``'s and ``index -j``'s workers, which a terminal's Ctrl-C or Slurm's
signal reaches as well) start with SIGINT, SIGTERM and SIGHUP at the system's default, no relay and no
wakeup pipe: such a signal ends them at once and quietly (as their pool expects of the SIGTERM with which
it ends its workers), and stager, which the same signal reaches, ends the rest of the pool and removes
what they half-wrote (:meth:`stager.pack.workers.PackPool.kill`).
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time
from types import FrameType

__all__ = ["ENDING_SIGNALS", "POKE", "POKE_INTERVAL", "Interrupted", "end_on_signals"]

ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each ends a command as Ctrl-C does
POKE = signal.SIGURG  # ignored by default, used by nothing else here: interrupts the main thread's system call
POKE_INTERVAL = 0.05  # seconds between pokes while none has been taken (how late a handler may run, at most)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C's KeyboardInterrupt is (exit 130)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted ({signal.Signals(signum).name})")


class _State:
    """This process's: its pid (the handler tells the processes it forks apart), the relay's pipe and the
    number of pokes the main thread has taken."""

    pid = os.getpid()
    relay: tuple[int, int] | None = None  # (read end, write end) once the relay runs
    main_thread = 0  # the ident of the thread the relay pokes
    pokes_taken = 0


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """KeyboardInterrupt or :class:`Interrupted` in stager; in a process it forked (where
    :func:`_after_fork_in_child` has not run: a fork outside :func:`os.fork`), the system's default."""
    if os.getpid() != _State.pid:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)


def _on_poke(signum: int, frame: FrameType | None) -> None:
    """The poke was taken: the main thread ran the signal handlers pending before it."""
    _State.pokes_taken += 1


def end_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP call :func:`_on_signal`, except one this process was started with ignored
    (``nohup``, a background job of a non-interactive shell); then :func:`start_relay`. In the main thread."""
    _State.pid = os.getpid()
    ours = False
    for sig in ENDING_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler, _on_signal):
            signal.signal(sig, _on_signal)
            ours = True
    if ours:
        start_relay()


def start_relay() -> None:
    """Start the relay (the module docstring), once per process; leave a wakeup descriptor someone else
    set (an asyncio loop's) alone."""
    if _State.relay is None:
        r, w = os.pipe2(os.O_CLOEXEC) if hasattr(os, "pipe2") else os.pipe()
        os.set_blocking(w, False)  # the C-level handler must never block on it
        _State.relay = (r, w)
        _thread.start_new_thread(_relay, (r,))
    w = _State.relay[1]
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old not in (-1, w):
        signal.set_wakeup_fd(old)
        return
    _State.main_thread = threading.get_ident()
    signal.signal(POKE, _on_poke)


def _relay(r: int) -> None:
    """The relay thread: for each ending signal Python caught, poke the main thread until a poke is taken."""
    ending = {int(s) for s in ENDING_SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, [*ENDING_SIGNALS, POKE])  # the kernel hands them to other threads
    while True:
        try:
            caught = os.read(r, 512)
        except OSError:
            return
        if not caught:
            return
        if ending.isdisjoint(caught):  # only the relay's own pokes (or another handler's signals)
            continue
        taken = _State.pokes_taken
        while _State.pokes_taken == taken:
            try:
                signal.pthread_kill(_State.main_thread, POKE)
            except (OSError, ValueError):  # the main thread has ended
                return
            time.sleep(POKE_INTERVAL)


def _after_fork_in_child() -> None:
    """A forked child (see the module docstring): the ending signals at the system's default, no relay, no poke."""
    for sig in ENDING_SIGNALS:
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, signal.SIG_DFL)
    if _State.relay is None:
        return
    if signal.getsignal(POKE) is _on_poke:
        signal.signal(POKE, signal.SIG_DFL)
    if signal.set_wakeup_fd(-1) != _State.relay[1]:  # not ours (an asyncio loop's): put it back
        signal.set_wakeup_fd(_State.relay[1])
    for fd in _State.relay:
        os.close(fd)
    _State.relay = None


os.register_at_fork(after_in_child=_after_fork_in_child)  # once per process (main() may run many times in one)

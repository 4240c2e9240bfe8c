"""The offset slots through which ``pack --workers N`` segments hand each other their offsets.

Invariants: :meth:`Slots.wait` returns the value another process publishes, and a process blocked in
it (asleep in the kernel, not polling) is woken by the publish itself; a poisoned slot raises
:class:`SegmentAbortedError` in the waiter; a published value whose first 32-bit word equals the
"unknown" marker's is still returned.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import pytest

from stager.pack.segments import _POISON, SegmentAbortedError, Slots

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="futexes and /proc are Linux's")


def _wait_and_report(path: str, i: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    Slots.WAIT_S = 3600.0  # only a wake-up can end this wait in time (the test joins for 60 s)
    s = Slots(path)
    try:
        q.put(("value", s.wait(i)))
    except SegmentAbortedError as exc:
        q.put(("aborted", str(exc)))
    finally:
        s.close()


def _asleep(pid: int) -> bool:
    """Whether process ``pid`` sleeps (state S): the child's only sleep is the wait on its slot."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def _publish_to_sleeper(tmp_path: Path, value: int) -> tuple[str, object]:
    """A child waits on slot 1; once it sleeps in the kernel, slot 1 gets ``value``; what the child saw."""
    s = Slots(str(tmp_path / "slots.bin"), 3)
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    child = ctx.Process(target=_wait_and_report, args=(s.path, 1, q))
    child.start()
    try:
        assert child.pid is not None
        while child.is_alive() and not _asleep(child.pid):
            os.sched_yield()
        s.publish(1, value)
        child.join(60)
        assert not child.is_alive(), "the publish did not wake the waiting process"
        return q.get(timeout=60)  # type: ignore[no-any-return]
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        s.close()


@linux_only
def test_publish_wakes_a_process_asleep_on_the_slot(tmp_path: Path) -> None:
    assert _publish_to_sleeper(tmp_path, 123_456_789) == ("value", 123_456_789)


@linux_only
def test_poison_wakes_the_waiter_with_segment_aborted(tmp_path: Path) -> None:
    kind, msg = _publish_to_sleeper(tmp_path, _POISON)
    assert kind == "aborted" and "slot 1" in str(msg)


@pytest.mark.parametrize("value", [0, 1, (1 << 32) - 1, (7 << 32) | 0xFFFFFFFF, (1 << 40) + 5])
def test_wait_returns_what_was_published(tmp_path: Path, value: int) -> None:
    s = Slots(str(tmp_path / "slots.bin"), 2)
    try:
        s.publish(0, value)
        assert s.wait(0) == value
        again = Slots(s.path)  # another mapping of the same file, as a worker has
        try:
            assert again.wait(0) == value
        finally:
            again.close()
    finally:
        s.close()

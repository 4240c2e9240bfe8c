"""A training process that dies mid-epoch (SIGKILL from the OOM killer or ``scancel``, ``os._exit``) leaves
no shared memory behind (issue 38.14).

A real trainer runs in a subprocess: a Loader with 2 DataLoader workers (persistent and fresh ones),
holding every batch it received so that its workers must make new ring segments for the batches they
prefetch; once such a batch is waiting in the DataLoader's queue (received by nobody, so its segment
was never opened by the main process), the trainer says so on stdout and is killed (the main process
only, as the OOM killer does, or its whole process group, as ``scancel`` does), or calls ``os._exit``.
The test waits for the workers to exit (their pidfds), then asserts that nothing of theirs is left
under ``/dev/shm``, where segments used to be named ``stager-<token>-<worker pid>-...`` and stayed until
a reboot (stager.loader.shm now names none).
"""

from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TRAINER = """
import gc, os, sys
from stager.loader import make_loader

loader = make_loader(sys.argv[1], 8, rank=0, world_size=1, num_workers=2, persistent_workers=sys.argv[2] == "1",
                     image_size=8, transform="eval", staged=False, multiprocessing_context="fork")
batches = iter(loader)  # kept: the epoch (and its workers) stays open
held = [next(batches) for _ in range(3)]  # every slot of both rings stays busy: the next batches need new segments
it = next(o for o in gc.get_objects() if type(o).__name__ == "_MultiProcessingDataLoaderIter")
it._data_queue._reader.poll(None)  # a prefetched batch waits in the queue, its segment never opened here
print("FLOWING", *[w.pid for w in it._workers], flush=True)
if sys.argv[3] == "exit":
    os._exit(3)
sys.stdin.read()  # until killed
"""


def _wait_exited(pids: list[int]) -> None:
    """Block until every process in ``pids`` has exited (pidfds become readable at exit)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue  # gone already
    try:
        while fds:
            ready, _, _ = select.select(fds, [], [], 120)
            assert ready, f"workers {pids} still run 120 s after their trainer died"
            for fd in ready:
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfd_open: Linux")
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "fresh"])
@pytest.mark.parametrize("death", ["sigkill", "sigkill-group", "exit"])
def test_a_killed_trainer_leaves_no_shared_memory(frameworks_pack: Path, tmp_path: Path, persistent: bool,
                                                  death: str) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    how = "exit" if death == "exit" else "wait"
    proc = subprocess.Popen([sys.executable, str(script), str(frameworks_pack), "1" if persistent else "0", how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("FLOWING"), (line, proc.stderr.read() if proc.stderr else "")
        workers = [int(p) for p in line.split()[1:]]
        assert len(workers) == 2
        if death == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)
        elif death == "sigkill-group":
            os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=120) == (3 if death == "exit" else -signal.SIGKILL)
        _wait_exited(workers)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    left = [p for p in glob.glob("/dev/shm/stager-*") if any(f"-{w}-" in os.path.basename(p) for w in workers)]
    assert left == [], f"shared memory left by the killed trainer's workers: {left}"

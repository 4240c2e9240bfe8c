"""Helpers for the command-line tests (no tests here): the real CLI in a clean environment, the error contract."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from stager.errors import ExitCode

LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI", "HOROVOD_", "MPI_")
LAUNCHER_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"}


# How a shell starts a command it runs in the foreground: SIGINT at its default. This suite may itself run with
# SIGINT ignored (.ci/run starts make as a background job of a non-interactive shell), children inherit an
# ignored signal, and Python then installs no KeyboardInterrupt handler at all: a test that sends SIGINT starts
# its command through this prefix (env execs, so the pid is the command's).
AS_TYPED = ["env", "--default-signal=INT"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher, cache and staging variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_VARS
           and k not in ("STAGER_CACHE", "STAGER_DEST", "STAGER_CACHE_QUOTA")}
    env.update(extra)
    return env


def stager(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stager", *map(os.fspath, args)], capture_output=True, text=True,
                          env=env or clean_env(), timeout=600, check=False)


def assert_error_contract(r: subprocess.CompletedProcess[str], code: int, prog: str, *, as_json: bool) -> None:
    """``r`` failed by the contract: exit ``code``, one error line from ``prog``, with --json one JSON object."""
    what = f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert r.returncode == code and r.returncode != ExitCode.INTERNAL, what
    assert "Traceback" not in r.stderr, what
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), what
    if as_json:
        out = r.stdout.splitlines()
        assert len(out) == 1, what
        obj = json.loads(out[0])
        assert obj["ok"] is False and obj["exit_code"] == code and lines[0] == f"{prog}: error: {obj['error']}", what
    else:
        assert r.stdout == "", what


def open_writer_when_read(fifo: Path, proc: subprocess.Popen[str]) -> int:
    """Open ``fifo`` for writing once ``proc`` has opened it for reading (until then a non-blocking open fails
    with ENXIO); the event ``proc`` waits on is then the data. Fails if ``proc`` ends first."""
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before reading the FIFO: {proc.communicate()}")
        time.sleep(0.01)


def wait_main_thread_reads_a_pipe(proc: subprocess.Popen[str]) -> None:
    """Wait until ``proc``'s main thread sleeps in the read of a pipe or FIFO, the blocking call a signal must
    interrupt: its ``wchan`` (what it waits in; ``0`` while it runs) names ``pipe_read`` (``anon_pipe_read``
    on Linux 6, ``pipe_wait`` before 5.6). Fails if ``proc`` ends first."""
    wchan = Path(f"/proc/{proc.pid}/task/{proc.pid}/wchan")
    while proc.poll() is None:
        now = wchan.read_text()
        if "pipe_read" in now or "pipe_wait" in now:
            return
        time.sleep(0.01)
    raise AssertionError(f"exited {proc.returncode} before reading: {proc.communicate()}")


def signal_another_thread(pid: int, sig: int) -> int:
    """Send ``sig`` to one thread of process ``pid`` other than its main thread, one that neither blocks nor
    ignores it (``tgkill``): a thread the kernel may hand a signal sent to the process. Returns its id."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    bit = 1 << (sig - 1)
    for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
        if tid == pid:
            continue
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines())
        if (int(fields["SigBlk"], 16) | int(fields["SigIgn"], 16)) & bit:
            continue
        if libc.tgkill(pid, tid, sig) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), f"tgkill {pid} {tid}")
        return tid
    raise AssertionError(f"process {pid} has no thread but its main one that takes signal {sig}")

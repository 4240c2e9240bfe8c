"""How the ``stager`` process leaves (:func:`stager.cli.entry`): ``stager stage`` skips interpreter
teardown (``os._exit``) once its output is out, and only when teardown has nothing left to do; what it
printed and wrote is complete either way. Also the unpack's threads (:func:`stager.stage.unpack.each_in_threads`).

Each child runs the real entry point from ``python -c`` with a module-level object whose ``__del__``
writes ``<teardown>`` to stderr: it appears exactly when the interpreter's teardown ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from stager.errors import ExitCode
from stager.manifest import RECEIPT_NAME
from stager.shardcheck import verify
from stager.stage.unpack import each_in_threads
from tests.cli_support import clean_env

CHILD = """
import atexit, os, sys, threading
class Teardown:
    def __del__(self):
        os.write(2, b"<teardown>")
marker = Teardown()
{setup}
sys.argv = ["stager", *sys.argv[1:]]
from stager.cli import entry
entry()
"""


def child(setup: str, *args: str | os.PathLike[str], **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD.format(setup=setup), *map(os.fspath, args)], text=True,
                            env=clean_env(), **kw)  # type: ignore[call-overload]


def finished(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out or "", err or ""


def assert_staged(dest: Path, out: str) -> None:
    """One complete JSON object on stdout, a receipt as it says, and a copy that verifies."""
    assert out.endswith("\n") and len(out.splitlines()) == 1, out
    obj = json.loads(out)
    assert obj["ok"] is True and obj["receipt"] == str(dest / RECEIPT_NAME), obj
    receipt = json.loads((dest / RECEIPT_NAME).read_text())
    assert receipt["dataset_id"] == obj["dataset_id"]
    assert verify(dest).ok


@pytest.mark.parametrize("unpack", [[], ["--unpack", "also"]])
def test_stage_leaves_without_teardown_and_its_output_and_receipt_are_complete(
        imagenet_tiny_tar: Path, tmp_path: Path, unpack: list[str]) -> None:
    dest = tmp_path / "dest"
    code, out, err = finished(child("", "stage", "--json", *unpack, imagenet_tiny_tar, dest,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert code == 0, err
    assert "<teardown>" not in err, err
    assert_staged(dest, out)


def test_an_exit_hook_takes_the_normal_exit_and_runs(imagenet_tiny_tar: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    code, out, err = finished(child('atexit.register(os.write, 2, b"<atexit>")', "stage", "--json",
                                    imagenet_tiny_tar, dest, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    assert code == 0, err
    assert "<atexit>" in err and "<teardown>" in err, err
    assert_staged(dest, out)


def test_a_thread_still_running_is_waited_for(imagenet_tiny_tar: Path, tmp_path: Path) -> None:
    # A non-daemon thread that ends only when this test closes the child's stdin, after the result is
    # printed: the child must wait for it (as Python's exit does) and not cut it off. (A wrong exit could
    # still pass here if the thread ended before it: the next test checks the decision itself.)
    setup = ('t = threading.Thread(target=lambda: (sys.stdin.read(), os.write(2, b"<thread>")))\n'
             't.start()')
    dest = tmp_path / "dest"
    proc = child(setup, "stage", "--json", imagenet_tiny_tar, dest, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()  # the result, printed while the thread still waits
    code, rest, err = finished(proc)  # closes the child's stdin: the thread ends
    assert code == 0 and "<thread>" in err, err
    assert_staged(dest, line + rest)


def test_teardown_is_skipped_only_when_no_hook_or_thread_is_left() -> None:
    # The decision itself, deterministically (the runs above could miss a wrong one when the thread
    # happened to end first): a non-daemon thread alive or an exit hook registered: normal exit.
    code = """
import atexit, os, threading
from stager.cli import _nothing_left_at_exit as fast
got = [fast()]
e = threading.Event(); t = threading.Thread(target=e.wait); t.start()
got.append(fast()); e.set(); t.join()
d = threading.Thread(target=threading.Event().wait, daemon=True); d.start()
got.append(fast())
atexit.register(os.getpid)
got.append(fast())
print(got)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean_env(), timeout=600,
                       check=True)
    assert r.stdout.strip() == "[True, False, True, False]", r.stdout + r.stderr


def test_stage_into_a_full_or_closed_stdout_reports_as_before(imagenet_tiny_tar: Path, tmp_path: Path) -> None:
    with open("/dev/full", "w") as full:
        code, _, err = finished(child("", "stage", "--json", imagenet_tiny_tar, tmp_path / "a", stdout=full,
                                      stderr=subprocess.PIPE))
    assert code == ExitCode.NO_SPACE and "standard output" in err and "Traceback" not in err, err
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # `stager stage --json ... | head -c0`: every write is EPIPE
    try:
        code, _, err = finished(child("", "stage", "--json", imagenet_tiny_tar, tmp_path / "b", stdout=w_fd,
                                      stderr=subprocess.PIPE))
    finally:
        os.close(w_fd)
    assert code == 0 and err.replace("<teardown>", "") == "", err
    assert verify(tmp_path / "a").ok and verify(tmp_path / "b").ok


def test_each_in_threads_calls_each_item_once_on_at_most_n_threads() -> None:
    seen: list[int] = []
    names: set[str] = set()
    lock = threading.Lock()

    def fn(i: int) -> None:
        with lock:
            seen.append(i)
            names.add(threading.current_thread().name)

    each_in_threads(list(range(50)), fn, 3)
    assert sorted(seen) == list(range(50)) and 1 <= len(names) <= 3
    each_in_threads([], fn, 3)  # nothing to do: returns


def test_each_in_threads_raises_the_first_items_failure_and_starts_nothing_after_one() -> None:
    # Item 1 fails first; item 0 (still running) fails after it: item 0's error is the one raised, and no
    # item after a failure is started.
    failed_1 = threading.Event()
    started: list[int] = []

    def fn(i: int) -> None:
        started.append(i)
        if i == 1:
            failed_1.set()
            raise ValueError("item 1")
        if i == 0:
            assert failed_1.wait(600)
            raise KeyError("item 0")

    with pytest.raises(KeyError, match="item 0"):
        each_in_threads(list(range(10)), fn, 2)
    assert sorted(started) == [0, 1]
    started.clear()
    with pytest.raises(ValueError, match="item 1"):  # one thread: the items in order, none after the failure
        each_in_threads([2, 1, 3, 4], fn, 1)
    assert started == [2, 1]

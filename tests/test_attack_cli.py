"""The command-line contract under attack: what a newcomer, a job script, a launcher and another user on
the node can do to ``stager`` from outside (README "Exit codes"; docs/architecture.md, "cli/").

Every case runs the real CLI as a process and holds it to the contract of tests/test_cli_contract.py: an
exit code of the table and never 1, no traceback, one line on stderr, one JSON object on stdout with
``--json``, nothing half-written. The cases: ``--json`` as argparse reads it (a prefix, ``--json=1``);
numbers beyond what the engines hold (``-j``, durations, sizes, node counts, ``--resize``); file names
with control characters; stdout and stderr that are closed, full or stop reading; SIGTERM and SIGHUP;
file-descriptor limits, full and unreadable outputs and sources; launcher variables that cannot be true;
``hints`` on what is not an image tree or a pack, on folders it may not read and on links into another
user's home; manifests written by someone hostile. No test waits on time: they wait on processes, FIFOs
and files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stager.errors import ExitCode, from_os_error
from stager.manifest.document import _digest_of
from stager.shardcheck import verify
from stager.world import World
from tests.asuser import ATTACKER, VICTIM, run_as, stager_as
from tests.cli_support import (
    AS_TYPED,
    assert_error_contract,
    clean_env,
    open_writer_when_read,
    signal_another_thread,
    stager,
    wait_main_thread_reads_a_pipe,
)
from tools.datagen import jpeg_bytes, render_image

CLI = [*AS_TYPED, sys.executable, "-m", "stager"]  # SIGINT at its default, as typed in a shell


def run(*args: str | os.PathLike[str], shell: str = "", **kw: Any) -> subprocess.CompletedProcess[str]:
    """``stager ARGS`` with the subprocess options ``kw`` (stdout, stderr), after the shell commands ``shell``
    (``ulimit -n 6``, ``exec >&-``) in the process that then becomes stager."""
    kw.setdefault("capture_output", "stdout" not in kw and "stderr" not in kw)
    prefix = ["sh", "-c", f'{shell}\nexec "$@"', "sh"] if shell else []
    return subprocess.run([*prefix, *CLI, *map(os.fspath, args)], text=True, env=clean_env(), timeout=600,
                          check=False, **kw)


@pytest.fixture(scope="module")
def places(imagenet_tiny: Path, imagenet_tiny_tar: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("attack")
    (base / "empty").mkdir()
    return {"pack": imagenet_tiny_tar, "tree": imagenet_tiny, "base": base, "missing": base / "missing",
            "empty": base / "empty"}


# ---- --json as argparse reads it ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["inspect", "{pack}", "--js", "--limit", "x"], ["inspect", "{pack}", "--json=1"],
                                  ["stage", "{pack}", "--jso", "-j", "0"], ["verify", "{pack}", "--json="]],
                         ids=["prefix", "json=1", "prefix-stage", "json="])
def test_json_asked_as_argparse_reads_it_still_prints_one_object(places: dict[str, Path], argv: list[str]) -> None:
    args = [a.format(pack=places["pack"]) for a in argv]
    assert_error_contract(stager(*args), 2, f"stager {args[0]}", as_json=True)


def test_json_after_a_double_dash_is_a_path_not_the_flag(places: dict[str, Path]) -> None:
    assert_error_contract(stager("inspect", "--", "--json"), 2, "stager inspect", as_json=False)


# ---- numbers beyond what the engines hold -------------------------------------------------------------------
HUGE = "99999999999999999999"
ABSURD: list[tuple[str, str, str]] = [
    # (id, argv, the flag the error names). Each would fork until the node runs out of memory, overflow a C
    # integer or a timer, or allocate per node or pixel, after the command had started.
    ("j-beyond-64-bits", f"pack {{missing}} {{out}} --format tar -j {HUGE}", "-j/--workers"),
    ("j-fork-bomb", "pack {missing} {out} --format tar -j 99999999", "-j/--workers"),
    ("stage-j", "stage {missing} {out} -j 99999999", "-j/--workers"),
    ("num-nodes", f"stage {{missing}} {{out}} --partition --node 0 --num-nodes {HUGE}", "--num-nodes"),
    ("hints-nodes", f"hints {{tree}} --nodes {HUGE}", "--nodes"),
    ("timeout-hours", f"clean {{missing}} --timeout {HUGE}h", "--timeout"),
    ("timeout-collective", "stage {missing} {out} --collective --timeout 30000000000", "--timeout"),
    ("resize", "pack {tree} {out} --format tar --resize 99999x99999 --dry-run", "--resize"),
    ("label-offset", f"index {{missing}} --label-offset {HUGE}", "--label-offset"),
    ("fraction-of-a-byte", "pack {tree} {out} --format tar --shard-size 1.5 --dry-run", "--shard-size"),
    ("quota-fraction-of-a-byte", "stage {missing} {out} --cache {empty} --cache-quota 1.5", "--cache-quota"),
    ("size-beyond-8-eib", "stage {missing} {out} --chunk-size 9E", "--chunk-size"),
]


@pytest.mark.parametrize(("case", "argv", "flag"), ABSURD, ids=[a[0] for a in ABSURD])
def test_numbers_beyond_what_the_engines_hold_are_usage_errors_naming_the_flag(places: dict[str, Path], case: str,
                                                                              argv: str, flag: str) -> None:
    out = places["base"] / case
    args = shlex.split(argv.format(out=out, **places))
    r = stager(*args, "--json")
    assert_error_contract(r, 2, f"stager {args[0]}", as_json=True)
    assert f"argument {flag}" in r.stderr, r.stderr
    assert not out.exists()


def test_sizes_take_petabytes_and_fractions_with_a_unit(places: dict[str, Path]) -> None:
    for size in ("1P", "1.5G", "1PiB", "2EB"):
        r = stager("pack", places["tree"], places["base"] / "dry", "--format", "tar", "--shard-size", size,
                   "--dry-run", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["shards"] == 1, (size, r.stderr)


# ---- file names with control characters ---------------------------------------------------------------------
NAMES = {"newline": "a\nb", "escape": "e\x1b[31mred\x1b]0;title\x07", "carriage-return": "c\rfake", "bell": "b\x07"}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_path_with_control_characters_is_named_on_one_line(places: dict[str, Path], name: str) -> None:
    path = places["base"] / NAMES[name]  # missing: each command names it and says what to do
    shown = "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 else c for c in str(path))  # \x0a, \x0d, \x1b, \x07
    for argv in (["inspect", path], ["verify", path], ["stage", path], ["hints", path], ["clean", path],
                 ["pack", path, places["base"] / "o", "--format", "tar"]):
        for as_json in (False, True):
            r = stager(*argv, *(["--json"] if as_json else []))
            assert_error_contract(r, 2, f"stager {argv[0]}", as_json=as_json)
            assert shown in r.stderr and not any(c in r.stderr.rstrip("\n") for c in "\x1b\x07\r\n"), r.stderr


# ---- stdout and stderr --------------------------------------------------------------------------------------
def test_a_reader_that_stops_reading_ends_the_output_quietly(places: dict[str, Path]) -> None:
    for args in (["inspect", places["pack"], "--json"], ["inspect", places["pack"]], ["hints", places["pack"]]):
        r_fd, w_fd = os.pipe()
        os.close(r_fd)  # `stager ... | head -c1` once head has gone: every write is EPIPE
        try:
            res = run(*args, stdout=w_fd, stderr=subprocess.PIPE)
        finally:
            os.close(w_fd)
        assert res.returncode == 0 and res.stderr == "", (args, res.stderr)


def test_a_full_stdout_is_out_of_space_in_one_line(places: dict[str, Path]) -> None:
    with open("/dev/full", "w") as full:
        for args in (["inspect", places["pack"], "--json"], ["inspect", places["pack"]]):
            res = run(*args, stdout=full, stderr=subprocess.PIPE)
            assert res.returncode == ExitCode.NO_SPACE and "Traceback" not in res.stderr, res.stderr
            assert res.stderr.splitlines() == [res.stderr.strip()] and "standard output" in res.stderr


def test_closed_or_full_stdout_and_stderr_never_fail_the_work(places: dict[str, Path], tmp_path: Path) -> None:
    # stdout closed when stager starts (`stager ... >&-`): the result goes nowhere, the command still works.
    res = run("inspect", places["pack"], "--json", shell="exec >&-", stderr=subprocess.PIPE)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    # stderr closed (`2>&-`) or full (`2>/dev/full`): progress and warnings go nowhere; the copy is made.
    with open("/dev/full", "w") as full:
        for i, kw in enumerate(({"shell": "exec 2>&-"}, {"stderr": full})):
            dest = tmp_path / f"dest{i}"
            res = run("stage", places["pack"], dest, stdout=subprocess.PIPE, **kw)
            assert res.returncode == 0, res.stdout
            assert verify(dest).ok


# ---- SIGTERM, SIGHUP ----------------------------------------------------------------------------------------
def _list_with_a_fifo(tmp_path: Path, images: int = 2) -> tuple[Path, Path]:
    """A list file of ``images`` JPEGs and, last, a FIFO nobody writes yet (pack blocks reading it); (list, fifo)."""
    import numpy as np

    rng = np.random.default_rng(7)
    d = tmp_path / "imgs"
    d.mkdir()
    rows = []
    for i in range(images):
        (d / f"img{i}.jpg").write_bytes(jpeg_bytes(render_image(rng, i, 2, 24, 24)))
        rows.append(f"{d / f'img{i}.jpg'},{i}")
    fifo = d / "zz-last.jpg"
    os.mkfifo(fifo)
    rows.append(f"{fifo},1")
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\n" + "\n".join(rows) + "\n")
    return lst, fifo


def _signalled(proc: subprocess.Popen[str], fd: int, send: Callable[[], object]) -> tuple[str, str]:
    """``send()`` (which signals ``proc``, started in a session of its own), then ``proc``'s stdout and stderr
    once it exits; then the FIFO's writer ``fd`` is closed. Should ``proc`` not exit (the defect these tests
    catch), or ``send`` fail, its process group is killed so that nothing outlives the test, and the test fails."""
    try:
        send()
        return proc.communicate(timeout=300)
    finally:
        os.close(fd)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its workers too (they hold its stdout open)
            proc.communicate()


def _assert_interrupted(proc: subprocess.Popen[str], stdout: str, stderr: str, sig: signal.Signals, out: Path) -> None:
    """Ended by ``sig`` as the contract says: exit 130, one error line, one JSON object, no ``.partial`` file."""
    said = "interrupted" if sig == signal.SIGINT else f"interrupted ({sig.name})"
    assert proc.returncode == ExitCode.INTERRUPTED, (proc.returncode, stderr)
    assert stderr.splitlines() == [f"stager pack: error: {said}"], stderr
    (line,) = stdout.splitlines()
    kind = "KeyboardInterrupt" if sig == signal.SIGINT else "Interrupted"
    assert json.loads(line) == {"ok": False, "error": said, "type": kind, "exit_code": 130}
    assert not list(out.rglob("*.partial")), sorted(out.rglob("*"))


SIGNALS = pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_end_a_command_as_ctrl_c_does(tmp_path: Path, sig: signal.Signals) -> None:
    """Slurm's time limit and scancel send SIGTERM, a closed terminal SIGHUP: exit 130 with the JSON object,
    after the same clean-up as Ctrl-C (no ``.partial`` file left in OUT). Whenever the signal lands after pack
    opened the FIFO (in ``open``, between ``open`` and ``read``, in ``read``), it ends pack."""
    lst, fifo = _list_with_a_fifo(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "pack", str(lst), str(out), "--format", "tar", "--samples-per-shard", "1",
                             "--keep-order", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), start_new_session=True)
    fd = open_writer_when_read(fifo, proc)  # pack is writing the last shard, opening or reading the FIFO
    stdout, stderr = _signalled(proc, fd, lambda: proc.send_signal(sig))
    _assert_interrupted(proc, stdout, stderr, sig, out)


@SIGNALS
def test_a_signal_another_thread_takes_still_ends_a_blocked_read(tmp_path: Path, sig: signal.Signals) -> None:
    """The kernel may hand a signal sent to pack to any of its threads that does not block it (numpy's
    OpenBLAS threads here), and Python runs the handler only in the main thread, between bytecodes: blocked
    reading a FIFO nobody writes, pack used to wait for ever. So it did when the signal landed between the
    FIFO's ``open`` and its ``read`` (the hang of test_ctrl_c_under_json_prints_one_object_and_exits_130 on
    a busy machine); a signal sent to such a thread reproduces it every time. The relay
    (stager/cli/signals.py) interrupts the read: exit 130, the JSON object, nothing half-written."""
    lst, fifo = _list_with_a_fifo(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "pack", str(lst), str(out), "--format", "tar", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=clean_env(OPENBLAS_NUM_THREADS="2"),  # a thread besides the main one, at least
                            start_new_session=True)
    fd = open_writer_when_read(fifo, proc)
    stdout, stderr = _signalled(proc, fd, lambda: (wait_main_thread_reads_a_pipe(proc),
                                                   signal_another_thread(proc.pid, sig)))
    _assert_interrupted(proc, stdout, stderr, sig, out)


@pytest.mark.parametrize("to", ["stager", "its-group"])
@SIGNALS
def test_pack_with_workers_ends_them_on_a_signal(tmp_path: Path, sig: signal.Signals, to: str) -> None:
    """``pack -j 2`` with a worker blocked reading a FIFO: the signal to stager alone (``kill PID``) or to its
    process group (a terminal's Ctrl-C, a closed terminal) ends it as in one process (130, the JSON object,
    nothing half-written), and no worker outlives it. Stager used to wait for that worker's segment for
    ever, and an idle worker printed a KeyboardInterrupt traceback."""
    lst, fifo = _list_with_a_fifo(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "pack", str(lst), str(out), "--format", "tar", "-j", "2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)  # its own process group, as a shell's job has
    fd = open_writer_when_read(fifo, proc)
    stdout, stderr = _signalled(proc, fd, lambda: proc.send_signal(sig) if to == "stager" else os.killpg(proc.pid, sig))
    _assert_interrupted(proc, stdout, stderr, sig, out)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no process of the group is left


def _worker_reading(proc: subprocess.Popen[str], path: Path) -> int:
    """The pid of ``proc``'s child (a pool worker) blocked reading ``path`` (a FIFO): it has it open (its fd
    links in /proc) and sleeps in a pipe's read (its ``wchan``). Waits until one does; fails if ``proc`` ends."""
    while proc.poll() is None:
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a child that has just ended
                wchan = Path(f"/proc/{child}/wchan").read_text()
                if ("pipe_read" in wchan or "pipe_wait" in wchan) and any(
                        os.readlink(fd) == str(path) for fd in Path(f"/proc/{child}/fd").iterdir()):
                    return int(child)
        time.sleep(0.01)
    raise AssertionError(f"exited {proc.returncode} before a worker read {path}: {proc.communicate()}")


def test_a_pack_worker_killed_on_its_own_is_one_line_and_the_pack_resumes(tmp_path: Path) -> None:
    """The OOM killer ends one worker of ``pack -j 2`` (SIGKILL to it alone, while it reads a FIFO): one
    error line that names it and what to do, the table's code (2, as ENOMEM), the JSON object, nothing
    half-written and no process left, where the pool's BrokenProcessPool used to exit 1 with a traceback.
    The same command then resumes and writes the shards an uninterrupted pack writes, byte for byte."""
    import numpy as np

    lst, fifo = _list_with_a_fifo(tmp_path, images=9)
    out = tmp_path / "out"
    cmd = [*CLI, "pack", str(lst), str(out), "--format", "tar", "--samples-per-shard", "2", "-j", "2", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                            start_new_session=True)
    fd = open_writer_when_read(fifo, proc)  # a worker is reading the FIFO
    victim = _worker_reading(proc, fifo)
    # The other worker's shards (the FIFO is the last sample) are published before the kill, so the rerun
    # has something to resume from: without this wait the kill could come first (it did once on CI).
    deadline = time.monotonic() + 300  # a safety bound only: the shards are written at once
    while not list(out.glob("shard-*.tar")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(out.glob("shard-*.tar")), sorted(p.name for p in out.glob("*")) if out.exists() else "no OUT"
    stdout, stderr = _signalled(proc, fd, lambda: os.kill(victim, signal.SIGKILL))
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert_error_contract(r, ExitCode.USAGE, "stager pack", as_json=True)
    assert f"a pack worker (pid {victim}) was killed (SIGKILL: out of memory?); rerun with fewer --workers" \
        in stderr, stderr
    assert not list(out.rglob("*.partial")), sorted(out.rglob("*"))
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no worker outlives it
    fifo.unlink()  # the last image is now readable: the same command resumes
    fifo.write_bytes(jpeg_bytes(render_image(np.random.default_rng(8), 1, 2, 24, 24)))
    again = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=600, check=False)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["reused_shards"] > 0, again.stdout  # resumed, not started over
    whole = tmp_path / "whole"
    subprocess.run([*cmd[:cmd.index(str(out))], str(whole), *cmd[cmd.index(str(out)) + 1:]], capture_output=True,
                   text=True, env=clean_env(), timeout=600, check=True)
    shards = sorted(p.name for p in whole.iterdir() if p.name.endswith(".tar"))
    assert len(shards) == 5 and sorted(p.name for p in out.iterdir() if p.name.endswith(".tar")) == shards
    for name in shards:
        assert (out / name).read_bytes() == (whole / name).read_bytes(), name
    assert verify(out).ok


class _HeldShards:
    """An HTTP server (directory listings, on a thread) that holds every GET of a ``.tar`` until :meth:`release`:
    ``stager index -j 2 URL``'s workers each wait in such a GET, mid-task. :meth:`wait_held` returns once ``n``
    GETs are held."""

    def __init__(self, directory: Path) -> None:
        import functools
        import http.server
        import threading

        self.held = threading.Semaphore(0)
        self.released = threading.Event()
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.endswith(".tar"):
                    outer.held.release()
                    outer.released.wait()
                super().do_GET()

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client killed mid-request: its broken pipe is the point

        self.server = Server(("127.0.0.1", 0), functools.partial(Handler, directory=str(directory)))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_held(self, n: int, proc: subprocess.Popen[str]) -> None:
        for _ in range(n):
            while not self.held.acquire(timeout=0.05):  # a poll: fails when proc ends first, never on time
                if proc.poll() is not None:
                    raise AssertionError(f"exited {proc.returncode} before {n} GETs: {proc.communicate()}")

    def release(self) -> None:
        self.released.set()

    def stop(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def held_shards(tmp_path: Path) -> Any:
    """3 webdataset tars behind a :class:`_HeldShards` server: ``(server, the shards' URL)``."""
    from tests.test_index import write_wds

    write_wds(tmp_path / "wds")
    srv = _HeldShards(tmp_path)
    yield srv, f"{srv.url}/wds/"
    srv.stop()


# A stalled GET is neither retried nor given up on while the test holds it.
_HOLD_ENV = {"STAGER_RETRIES": "1", "STAGER_REQUEST_TIMEOUT": "3600"}


def _pool_workers(proc: subprocess.Popen[str]) -> list[int]:
    """The pids of ``proc``'s pool workers: its children but the resource tracker a spawning pool starts."""
    kids = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    return [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]


def _index_held(held: _HeldShards, url: str, out: Path) -> tuple[subprocess.Popen[str], list[str], list[int]]:
    """``stager index -j 2 URL --out OUT --json`` in a session of its own, once both workers wait in a held
    GET: ``(process, command, the workers' pids)``."""
    cmd = [*CLI, "index", url, "--out", str(out), "-j", "2", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(**_HOLD_ENV), start_new_session=True)
    try:
        held.wait_held(2, proc)
        workers = _pool_workers(proc)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert len(workers) == 2, workers
    return proc, cmd, workers


def _assert_gone(pids: list[int]) -> None:
    """No process of ``pids`` is left (nor a zombie: stager waited for each)."""
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived stager"


def _ended(proc: subprocess.Popen[str], send: Callable[[], object]) -> tuple[str, str]:
    """``send()``, then ``proc``'s output once it exits, while the server still holds its GETs (so it must end
    its workers itself); should it not exit, its group is killed and the test fails."""
    try:
        send()
        return proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_an_index_worker_killed_on_its_own_is_one_line_and_the_index_resumes(held_shards: Any, tmp_path: Path) -> None:
    """The OOM killer ends one worker of ``index -j 2`` mid-shard: one error line naming it and what to do, the
    table's code, the JSON object, no copy of an object left in OUT and no process left (the pool's
    BrokenProcessPool used to exit 1 with a traceback); the same command then indexes the shards."""
    held, url = held_shards
    out = tmp_path / "idx"
    proc, cmd, workers = _index_held(held, url, out)
    victim = workers[0]  # in a held GET
    stdout, stderr = _ended(proc, lambda: os.kill(victim, signal.SIGKILL))
    r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    assert_error_contract(r, ExitCode.USAGE, "stager index", as_json=True)
    assert f"an index worker (pid {victim}) was killed (SIGKILL: out of memory?); rerun with fewer -j" in stderr, stderr
    assert not [p for p in out.rglob("*") if p.is_file()], sorted(out.rglob("*"))
    _assert_gone(workers)
    held.release()
    again = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(**_HOLD_ENV), timeout=600, check=False)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["samples"] == 23 and verify(out).ok


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_index_with_workers_ends_them_on_a_signal(held_shards: Any, tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C or Slurm's SIGTERM to ``index -j 2`` alone while both workers wait on a stalled server: exit 130
    with the JSON object at once, no worker left alive, nothing half-written in OUT. Index used to wait for
    its running scans (here: for ever)."""
    held, url = held_shards
    out = tmp_path / "idx"
    proc, _, workers = _index_held(held, url, out)
    stdout, stderr = _ended(proc, lambda: proc.send_signal(sig))
    said = "interrupted" if sig == signal.SIGINT else f"interrupted ({sig.name})"
    assert proc.returncode == ExitCode.INTERRUPTED, (proc.returncode, stderr)
    assert stderr.splitlines() == [f"stager index: error: {said}"], stderr
    (line,) = stdout.splitlines()
    assert json.loads(line)["exit_code"] == 130
    _assert_gone(workers)
    assert not [p for p in out.rglob("*") if p.is_file()], sorted(out.rglob("*"))


def test_a_signal_the_parent_ignores_stays_ignored(tmp_path: Path) -> None:
    """``nohup stager pack ...``: SIGHUP is ignored when stager starts, and stays so."""
    lst, fifo = _list_with_a_fifo(tmp_path)
    out = tmp_path / "out"
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited across exec, as nohup leaves it
    try:
        proc = subprocess.Popen([*CLI, "pack", str(lst), str(out), "--format", "tar", "-q"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=clean_env())
    finally:
        signal.signal(signal.SIGHUP, old)
    fd = open_writer_when_read(fifo, proc)
    try:
        proc.send_signal(signal.SIGHUP)
        import numpy as np

        os.write(fd, jpeg_bytes(render_image(np.random.default_rng(8), 1, 2, 24, 24)))
    finally:
        os.close(fd)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert verify(out).ok and verify(out).samples == 3


# ---- limits, full and unreadable places ----------------------------------------------------------------------
def test_errnos_a_user_causes_are_in_the_table() -> None:
    import errno

    for e, code in {errno.EMFILE: 2, errno.ENFILE: 2, errno.EAGAIN: 2, errno.ENOMEM: 2, errno.ENXIO: 2,
                    errno.ESPIPE: 2, errno.ESTALE: 3, errno.ENETDOWN: 5}.items():
        assert from_os_error(OSError(e, os.strerror(e), "/p")).exit_code == code, e


def test_too_many_open_files_is_a_usage_error_and_nothing_is_half_written(places: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    limit = 6  # stdin, stdout, stderr and three more: Python starts, a stage of 12 shards cannot finish
    r = run("stage", places["pack"], dest, "--json", shell=f"ulimit -n {limit}")
    assert_error_contract(r, 2, "stager stage", as_json=True)
    assert "ulimit -n" in r.stderr and not list(dest.glob("*.partial")), r.stderr


def _in_tmpfs(tmp_path: Path, options: str) -> list[str]:
    """A prefix running a command in a mount namespace where ``tmp_path/fs`` is a tmpfs mounted with
    ``options`` (``unshare`` with a user namespace: no privilege needed where those are allowed); skips when not."""
    fs = tmp_path / "fs"
    fs.mkdir()
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare (util-linux)")
    prefix = [unshare, "--map-root-user", "--mount", "sh", "-c",
              f'mount -t tmpfs -o {options} tmpfs "{fs}" && exec "$@"', "sh"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    return prefix


def test_an_output_directory_on_a_full_file_system_is_out_of_space(places: dict[str, Path], tmp_path: Path) -> None:
    prefix = _in_tmpfs(tmp_path, "size=1m,nr_inodes=1")  # the root uses the only inode: no directory can be made
    shards = tmp_path / "shards"
    shutil.copytree(places["pack"], shards, ignore=shutil.ignore_patterns("manifest.json", "*.sidx"))
    out = tmp_path / "fs" / "index"
    r = subprocess.run([*prefix, *CLI, "index", str(shards), "--out", str(out), "--json"], capture_output=True,
                       text=True, env=clean_env(), check=False, timeout=600)
    assert_error_contract(r, ExitCode.NO_SPACE, "stager index", as_json=True)
    assert str(out) in r.stderr


def _unreadable_tree(node: Any, tree: Path) -> tuple[Path, Path]:
    """A copy of ``tree`` in the node's shared data directory, one class folder of it mode 000; (copy, that
    folder)."""
    src = node.data / "tree"
    shutil.copytree(tree, src)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    locked = sorted(d for d in src.iterdir() if d.is_dir())[0]
    locked.chmod(0o000)
    return src, locked


def test_a_source_folder_the_user_may_not_read_is_a_usage_error(node: Any, imagenet_tiny: Path) -> None:
    src, locked = _unreadable_tree(node, imagenet_tiny)
    r = stager_as(VICTIM, "pack", src, node.home(VICTIM) / "out", "--format", "tar", "--json", env=node.env(VICTIM))
    assert_error_contract(r, 2, "stager pack", as_json=True)
    assert str(locked) in r.stderr and "Permission denied" in r.stderr, r.stderr


# ---- launcher variables that cannot be true ------------------------------------------------------------------
CONTRADICTIONS: list[tuple[str, dict[str, str], str]] = [
    # (id, variables, a name the one-line error must hold)
    ("rank-negative", {"RANK": "-1", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, "RANK=-1"),
    ("rank-beyond-world", {"RANK": "9", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, "RANK=9"),
    ("world-of-none", {"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ("local-rank-beyond-local-size", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "4"},
     "LOCAL_RANK=5"),
    ("local-size-zero", {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"},
     "LOCAL_WORLD_SIZE=0"),
    ("group-rank-disagrees", {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                              "GROUP_RANK": "0"}, "GROUP_RANK=0"),
    ("ompi-rank-beyond-size", {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "8",
                               "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
     "OMPI_COMM_WORLD_RANK=9"),
    ("hydra-local-beyond", {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "7", "MPI_LOCALNRANKS": "4"},
     "MPI_LOCALRANKID=7"),
    ("horovod-node-beyond", {"HOROVOD_RANK": "5", "HOROVOD_SIZE": "8", "HOROVOD_LOCAL_RANK": "1",
                             "HOROVOD_LOCAL_SIZE": "4", "HOROVOD_CROSS_RANK": "2", "HOROVOD_CROSS_SIZE": "2"},
     "HOROVOD_CROSS_RANK=2"),
    ("slurm-task-beyond", {"SLURM_PROCID": "9", "SLURM_NTASKS": "8", "SLURM_NODEID": "1", "SLURM_NNODES": "2"},
     "SLURM_PROCID=9"),
    ("slurm-nodeid-alone", {"SLURM_NODEID": "1", "SLURM_JOB_ID": "7"}, "SLURM_NODEID=1"),
    ("slurm-nnodes-alone", {"SLURM_NNODES": "4", "SLURM_JOB_ID": "7"}, "SLURM_NNODES=4"),
    ("slurm-no-nodes", {"SLURM_NODEID": "0", "SLURM_NNODES": "0"}, "SLURM_NNODES=0"),
    ("slurm-more-nodes-than-any-machine", {"SLURM_NODEID": "0", "SLURM_NNODES": "99999999999"}, "SLURM_NNODES"),
]


@pytest.mark.parametrize(("case", "env", "name"), CONTRADICTIONS, ids=[c[0] for c in CONTRADICTIONS])
def test_launcher_variables_that_cannot_be_true_are_refused_in_one_line(places: dict[str, Path], case: str,
                                                                       env: dict[str, str], name: str) -> None:
    """``stage --partition`` (and ``--collective``) refuse them: never node 0 of 1, node -1, or a traceback."""
    for mode in ("--partition", "--collective"):
        dest = places["base"] / f"{case}{mode}"
        r = stager("stage", places["pack"], dest, mode, "--fallback", "none", "--json", env=clean_env(**env)) \
            if mode == "--collective" else stager("stage", places["pack"], dest, mode, "--json", env=clean_env(**env))
        assert_error_contract(r, 2, "stager stage", as_json=True)
        assert name in r.stderr, r.stderr
        assert not dest.exists() or not any(dest.iterdir())


RANK_CONTRADICTIONS = [c for c in CONTRADICTIONS if "PROCID" in str(c[1]) or not c[0].startswith("slurm-")]


@pytest.mark.parametrize(("case", "env", "name"), RANK_CONTRADICTIONS, ids=[c[0] for c in RANK_CONTRADICTIONS])
def test_the_loader_refuses_the_ranks_such_variables_give(case: str, env: dict[str, str], name: str) -> None:
    """The loader (World.detect) numbers ranks from the same variables: what stage refuses of them is the
    same one-line error there (Slurm's node variables alone name no rank: the loader has none to refuse)."""
    from stager.errors import UsageError

    with pytest.raises(UsageError, match=r"launcher|Slurm|ranks|variables") as err:
        World.detect(env=env)
    assert name in str(err.value) and "\n" not in str(err.value)


# ---- hints -------------------------------------------------------------------------------------------------
def test_hints_on_what_is_neither_an_image_tree_nor_a_pack_names_what_fits(places: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    shard = sorted(places["pack"].glob("shard-*"))[0]
    unfinished = tmp_path / "unfinished"
    (unfinished / ".stager-pack").mkdir(parents=True)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, says in ((shard, f"give the pack's directory, {places['pack']}"), (fifo, "stager index"),
                       (Path("/dev/null"), "stager index"), (unfinished, "rerun the same `stager pack`"),
                       (places["empty"], "holds no files")):
        r = stager("hints", path, "--json")
        assert_error_contract(r, 2, "stager hints", as_json=True)
        assert says in r.stderr, (path, r.stderr)


def test_hints_on_a_directory_of_shards_advises_index_and_it_works_followed_literally(places: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    shards = tmp_path / "web dataset"
    shutil.copytree(places["pack"], shards, ignore=shutil.ignore_patterns("manifest.json", "*.sidx"))
    local = tmp_path / "local"
    local.mkdir()
    env = clean_env(TMPDIR=str(local))
    # pack says what fits of the directory and of one of its files (stager index), not "no class sub-folders"
    for src in (shards, sorted(shards.glob("*.tar"))[0]):
        r = stager("pack", src, tmp_path / "out", "--format", "tar", "--json")
        assert_error_contract(r, 2, "stager pack", as_json=True)
        assert f"stager index {shards}" in r.stderr, r.stderr
    rep = json.loads(stager("hints", shards, "--json", env=env).stdout)
    assert rep["kind"] == "shards" and [shlex.split(c)[:2] for c in rep["next"]] == [["stager", "index"],
                                                                                     ["stager", "stage"]], rep
    for cmd in rep["next"]:
        r = subprocess.run([*CLI, *shlex.split(cmd)[1:]], capture_output=True, text=True, env=env, check=False,
                           timeout=600)
        assert r.returncode == 0, (cmd, r.stderr)
    (staged,) = local.glob("stager-*")
    assert verify(staged).ok


def test_hints_names_what_it_may_not_read_and_the_links_pack_would_follow(node: Any, imagenet_tiny: Path) -> None:
    """As VICTIM: an unreadable class folder is named (not silently left out), an unreadable PATH is an
    error; links the ATTACKER planted into VICTIM's home are named with where they lead, not followed."""
    src, locked = _unreadable_tree(node, imagenet_tiny)
    env = node.env(VICTIM)
    rep = json.loads(stager_as(VICTIM, "hints", src, "--json", env=env).stdout)
    assert any(str(locked) in w and "cannot read" in w for w in rep["warnings"]), rep["warnings"]
    r = stager_as(VICTIM, "hints", locked, "--json", env=env)
    assert_error_contract(r, 2, "stager hints", as_json=True)
    assert "Permission denied" in r.stderr
    # ATTACKER's tree in the shared tmp, with a class folder that links into VICTIM's home.
    private = node.home(VICTIM) / "private"
    run_as(VICTIM, ["sh", "-c", f'mkdir -p "{private}/secret" && echo x > "{private}/secret/diary.jpg"'], env=env)
    tree = node.tmp / "dataset"
    run_as(ATTACKER, ["sh", "-c", f'mkdir -p "{tree}/cls" && echo y > "{tree}/cls/a.jpg" && '
                                  f'ln -s "{private}/secret" "{tree}/innocent" && chmod -R a+rX "{tree}"'],
           env=node.env(ATTACKER))
    r = stager_as(VICTIM, "hints", tree, env=env)
    assert r.returncode == 0 and "diary" not in r.stdout, r.stdout
    assert f"{tree}/innocent -> {private}/secret" in r.stdout and "packed too" in r.stdout, r.stdout


# ---- manifests written by someone hostile --------------------------------------------------------------------
HOSTILE: dict[str, Any] = {
    "bytes-beyond-int64": lambda d: d["shards"][0].update(bytes=10**30),
    "samples-beyond-int64": lambda d: d["shards"][0].update(samples=10**30),
    "bytes-true": lambda d: d["shards"][0].update(bytes=True),
    "field-with-escapes": lambda d: d.update(fields=[{"name": "\x1b]0;x\x07f\n", "kind": "json"}]),
    "deep-source": lambda d: d.update(source=_nested(500)),
}


def _nested(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = {"a": v}
    return v


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_manifest_is_damaged_data_in_one_line(places: dict[str, Path], tmp_path: Path, case: str) -> None:
    """ATTACKER wrote the manifest (and its digest, which is no secret): inspect, verify and stage of it are
    exit 3 in one line, never a traceback."""
    copy = tmp_path / case
    shutil.copytree(places["pack"], copy)
    body = json.loads((copy / "manifest.json").read_text())
    HOSTILE[case](body)
    body["digest"] = _digest_of(body)
    (copy / "manifest.json").write_text(json.dumps(body))
    for argv in (["inspect", copy], ["verify", copy], ["stage", copy, tmp_path / "dest"]):
        assert_error_contract(stager(*argv, "--json"), 3, f"stager {argv[0]}", as_json=True)


def test_escapes_in_a_manifest_are_shown_not_obeyed(places: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "escapes"
    shutil.copytree(places["pack"], copy)
    body = json.loads((copy / "manifest.json").read_text())
    body["classes"] = ["\x1b[2J\x1b]0;pwned\x07" + c for c in body["classes"]]
    body["source"]["path"] = "/data/\x1b[31mred\rX"
    body["digest"] = _digest_of(body)
    (copy / "manifest.json").write_text(json.dumps(body))
    r = stager("inspect", copy)
    assert r.returncode == 0 and not any(c in r.stdout for c in "\x1b\x07\r"), r.stdout
    assert "\\x1b[2J" in r.stdout and "\\x1b[31mred\\x0dX" in r.stdout

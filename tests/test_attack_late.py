"""Attacks on the loader's one-pass-at-a-time rule, the pack/index pool's lost-worker error and
``index -j``'s interrupt (brief attack-late): each test is a defect found by hand, failing before its fix.

- A replaced pass of a loader without persistent workers (``persistent_workers=False``: each pass starts
  its own DataLoader workers) kept those workers running for as long as the caller kept the replaced
  iterator (in a variable across epochs, say): ``iter()`` replacing it called only ``close()``, which
  stops persistent workers alone.
- ``set_epoch``, ``skip_to`` or ``load_state_dict`` while an iterator was mid-epoch, then that iterator
  advanced: ``RuntimeError: stager.loader: expected batch 0, worker sent 2`` (the round-robin check's
  message, about a worker) on both loaders, with and without workers, instead of one line saying what to do.
- ``kill -9`` of ``stager pack -j N`` or ``stager index -j N`` itself (not a worker) left its N workers
  asleep on the pool's task queue for ever: orphans, each holding its copy of the source.
- Ctrl-C or SIGTERM the moment ``index -j 4``'s (or ``pack -j 4``'s) first worker exists: it landed in
  the pool's start, for index outside the ``try`` that kills the workers (``RuntimeError: cannot join
  thread before it is started``, exit 1, or a stager waiting for ever at exit on workers never told to stop), or inside
  ``os.fork``'s after-fork hooks (both), where Python printed "Exception ignored" and the run went on, exit 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import AS_TYPED, clean_env
from tests.loader_support import reference_and_loader
from tools.datagen import make_imagefolder

ROOT = Path(__file__).resolve().parents[1]

KEPT_REPLACED = """
import os, sys
from stager.loader import make_loader
def children():  # this process' live children, from /proc (no timing: a joined worker is gone)
    me = str(os.getpid())
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                out.append(int(p))
    return out
ld = make_loader(sys.argv[1], 4, seed=3, staged=False, num_workers=2, persistent_workers=False,
                 multiprocessing_context="fork", decode="raw")
kept = iter(ld)
next(kept)
assert len(children()) == 2, children()
whole = [k for b in ld for k in b["key"]]  # the newer pass, complete: its own workers ended with it
print("children", len(children()), "samples", len(whole), len(set(whole)))
ld.close()
"""


def test_a_replaced_pass_without_persistent_workers_ends_its_workers_at_once(imagenet_tiny_tar: Path) -> None:
    """The replaced iterator is still held: its pass's workers must be gone once the newer pass ends."""
    r = subprocess.run([sys.executable, "-c", KEPT_REPLACED, str(imagenet_tiny_tar)], capture_output=True,
                       text=True, env=clean_env(), cwd=ROOT, timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["children", "0", "samples", "24", "24"], r.stdout + r.stderr


@pytest.mark.parametrize("move", ["set_epoch", "skip_to", "load_state_dict"])
@pytest.mark.parametrize(("make", "workers"), [("torch", 0), ("torch", 2), ("numpy", 2)])
def test_moving_the_loader_mid_pass_is_one_line_for_the_open_iterator(
    imagenet_tiny_tar: Path, make: str, workers: int, move: str
) -> None:
    """The open iterator, advanced after the loader was moved under it, says so in one line; the next
    ``iter()`` is exactly the moved-to position's remaining batches."""
    from stager.errors import UsageError
    whole, ld = reference_and_loader(imagenet_tiny_tar, make, workers)
    try:
        it = iter(ld)
        head = [list(next(it)["key"]) for _ in range(2)]
        assert head == whole[:2]
        state = ld.state_dict()
        next(it)
        if move == "set_epoch":
            ld.set_epoch(0)
            expect = whole
        elif move == "skip_to":
            ld.skip_to(4)
            expect = whole[4:]
        else:
            ld.load_state_dict(state)
            expect = whole[2:]
        with pytest.raises(UsageError, match="mid-epoch") as e:
            next(it)
        assert "\n" not in str(e.value)
        del it
        assert [list(b["key"]) for b in ld] == expect
    finally:
        ld.close()


# ---- pack -j / index -j: stager itself killed ---------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The live (not zombie) children of ``pid``, from /proc."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        return []
    return [c for c in out if _state(c) not in ("Z", "gone")]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.fixture(scope="module")
def many_small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An ImageFolder of 240 small JPEGs and its pack into 240 one-sample tar shards (to index)."""
    from stager.pack import pack

    base = tmp_path_factory.mktemp("many")
    src = make_imagefolder(base / "train", num_classes=4, per_class=60, seed=1, size=(32, 24))
    shards = base / "shards"
    pack(src, shards, "tar", samples_per_shard=1)
    (shards / "manifest.json").unlink()
    for p in shards.glob("index-*"):
        p.unlink()
    return src, shards


@pytest.mark.parametrize("command", ["pack", "index"])
def test_stager_killed_takes_its_workers_with_it_and_the_rerun_resumes(
    many_small: tuple[Path, Path], tmp_path: Path, command: str
) -> None:
    """``kill -9`` of stager (the OOM killer's choice, a user's kill) while ``-j 2`` workers run left both
    workers asleep on their task queue for ever (orphans). Now they end with it, and the rerun with
    ``-j 1`` resumes from what was published and gives the bytes a fresh run gives."""
    src, shards = many_small
    if command == "pack":
        out = tmp_path / "out"
        argv = ["pack", str(src), str(out), "--format", "tar", "--samples-per-shard", "2"]
        published = lambda: len(list(out.glob("shard-*.tar")))  # noqa: E731
    else:
        out = tmp_path / "shards"
        shutil.copytree(shards, out)
        argv = ["index", str(out)]
        published = lambda: len(list((out / ".stager-index").glob("*.json")))  # noqa: E731
    stager = [str(Path(sys.executable).with_name("stager"))]
    p = subprocess.Popen([*stager, *argv, "-j", "2", "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=clean_env(), cwd=ROOT)
    workers: list[int] = []
    while p.poll() is None and (len(workers) < 2 or published() < 4):  # mid-run: workers up, some work saved
        workers = _children(p.pid)
    assert p.poll() is None, "the run ended before it could be killed: give it more to do"
    fds = [os.pidfd_open(w) for w in workers]
    p.kill()
    p.wait()
    try:
        waiting = list(fds)
        while waiting:  # a pidfd turns readable when its process ends
            ready, _, _ = select.select(waiting, [], [], 120)  # a safety bound: they end at once, or never
            assert ready, [(w, _state(w)) for w in workers]
            waiting = [fd for fd in waiting if fd not in ready]
    finally:
        for fd in fds:
            os.close(fd)
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)
    again = subprocess.run([*stager, *argv, "-j", "1", "--json"], capture_output=True, text=True, env=clean_env(),
                           cwd=ROOT, timeout=600, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    report = json.loads(again.stdout)
    assert report["reused_shards" if command == "pack" else "resumed"] >= 1, report  # it resumed
    if command == "pack":
        fresh = tmp_path / "fresh"
        subprocess.run([*stager, "pack", str(src), str(fresh), "--format", "tar", "--samples-per-shard", "2", "-q"],
                       env=clean_env(), cwd=ROOT, timeout=600, check=True)
        names = sorted(x.name for x in fresh.iterdir())
        assert sorted(x.name for x in out.iterdir()) == names
        for n in names:
            if n.endswith(".tar"):
                assert (out / n).read_bytes() == (fresh / n).read_bytes(), n


# ---- index -j / pack -j: interrupted as the pool starts----------------------------------------------------


@pytest.mark.parametrize("command", ["index", "pack"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_as_its_workers_start_exits_130_with_nothing_left(
    many_small: tuple[Path, Path], tmp_path: Path, sig: signal.Signals, command: str
) -> None:
    """A Ctrl-C or SIGTERM the moment ``index -j 4``'s or ``pack -j 4``'s first worker exists lands in the
    pool's start (inside ``submit``): for index, before the ``try`` that kills the workers (``RuntimeError:
    cannot join thread before it is started`` with a traceback and exit 1, or a stager that never exits:
    Python's exit joined workers never told to stop); for both, inside fork's after-fork hooks, where it
    was lost and the run went on to exit 0. Now: exit 130, one JSON object, every worker gone."""
    if command == "index":
        out = tmp_path / "shards"
        shutil.copytree(many_small[1], out)
        argv = ["index", str(out)]
    else:
        argv = ["pack", str(many_small[0]), str(tmp_path / "out"), "--format", "tar", "--samples-per-shard", "2"]
    stager = str(Path(sys.executable).with_name("stager"))
    p = subprocess.Popen([*AS_TYPED, stager, *argv, "-j", "4", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=ROOT)
    workers: list[int] = []
    while p.poll() is None and not workers:
        workers = _children(p.pid)
    assert p.poll() is None, "the run ended before it could be interrupted"
    fds = [os.pidfd_open(w) for w in workers]
    try:
        os.kill(p.pid, sig)
        stdout, stderr = p.communicate(timeout=300)  # a safety bound: a stager that waits for ever fails here
        assert p.returncode == 130, stdout + stderr
        assert stdout.count("\n") == 1 and json.loads(stdout)["exit_code"] == 130, stdout
        assert "Traceback" not in stderr, stderr
        ready, _, _ = select.select(fds, [], [], 0)  # stager has exited: its workers must be gone already
        assert len(ready) == len(fds)
    finally:
        if p.poll() is None:
            p.kill()
        for fd in fds:
            os.close(fd)
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)

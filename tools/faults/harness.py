"""Shared machinery for fault trials: real CLI subprocesses, kill points, snapshots, tiny datasets.

Every command under test runs as ``sys.executable -m stager ...`` in its own session, so a kill
takes the whole process group (pack's writer processes too), as when Slurm cancels a job step.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PARTIAL = ".partial"


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a stager subprocess: this checkout importable, no staging roots inherited."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for var in ("STAGER_DEST", "SLURM_TMPDIR", "STAGER_TEST_THROTTLE_BPS", "STAGER_TEST_FREE_BYTES"):
        env.pop(var, None)
    env.update(extra or {})
    return env


def stager_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "stager", *args]


def run(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 180,
        preexec_fn: Callable[[], None] | None = None, cwd: str | os.PathLike[str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion; capture text output."""
    return subprocess.run(list(argv), capture_output=True, text=True, env=child_env(env), timeout=timeout,
                          preexec_fn=preexec_fn, cwd=cwd, check=False)


def run_stager(*args: str, env: Mapping[str, str] | None = None, timeout: float = 180,
               preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    return run(stager_argv(*args), env=env, timeout=timeout, preexec_fn=preexec_fn)


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
          cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a new session (so :func:`kill_group` reaches all its processes)."""
    return subprocess.Popen(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=child_env(env),
                            cwd=cwd, start_new_session=True)


def kill_group(proc: subprocess.Popen[bytes]) -> bool:
    """SIGKILL ``proc``'s process group; True if ``proc`` was still running (a real mid-run kill)."""
    alive = proc.poll() is None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()
    return alive


@dataclass
class KillPoint:
    """How a trial picks its kill moment: after ``delay`` seconds, or once ``condition()`` holds
    (then after ``after`` more seconds). ``describe`` is for logs."""

    delay: float | None = None
    condition: Callable[[], bool] | None = None
    after: float = 0.0
    describe: str = ""


def kill_at(proc: subprocess.Popen[bytes], point: KillPoint, *, timeout: float = 120.0,
            poll: float = 0.002) -> bool:
    """Wait for ``point`` (or the process's exit), then kill the group; return whether it was mid-run."""
    start = time.monotonic()
    while proc.poll() is None and time.monotonic() - start < timeout:
        if point.delay is not None and time.monotonic() - start >= point.delay:
            break
        if point.condition is not None:
            try:
                hit = point.condition()
            except OSError:
                hit = False  # the tree changes under our feet; poll again
            if hit:
                if point.after:
                    time.sleep(point.after)
                break
        time.sleep(poll)
    return kill_group(proc)


def files_under(root: str | os.PathLike[str]) -> list[Path]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [Path(dirpath) / f for f in files]
    return out


def partials(root: str | os.PathLike[str]) -> list[Path]:
    """``*.partial`` files anywhere under ``root``."""
    return [p for p in files_under(root) if p.name.endswith(PARTIAL)]


def count_files(root: str | os.PathLike[str]) -> int:
    n = 0
    for _dirpath, _dirs, files in os.walk(root):
        n += len(files)
    return n


def snapshot(root: str | os.PathLike[str], skip: str | os.PathLike[str] | None = None) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` (not following links) -> (type, size, mtime_ns, mode); entries
    under ``skip`` (the destination itself) are left out. Equal snapshots = nothing written there."""
    root = Path(root)
    skip_p = Path(skip).resolve() if skip is not None else None
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        d = Path(dirpath)
        if skip_p is not None:
            dirs[:] = [x for x in dirs if (d / x).resolve() != skip_p]
        for name in [*dirs, *files]:
            p = d / name
            if skip_p is not None and p.resolve() == skip_p:
                continue
            st = p.lstat()
            if stat.S_ISDIR(st.st_mode):
                # A directory's mtime changes when DEST is created in it; its entries are listed anyway.
                out[str(p.relative_to(root))] = (stat.S_IFDIR, stat.S_IMODE(st.st_mode))
            else:
                out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns,
                                                 stat.S_IMODE(st.st_mode))
    return out


def one_line_error(stderr: str) -> str:
    """The CLI's error line (``stager <cmd>: error: ...``); '' if stderr holds a traceback instead."""
    if "Traceback" in stderr:
        return ""
    lines = [ln for ln in stderr.strip().splitlines() if "error:" in ln]
    return lines[-1] if len(lines) == 1 else ""


def multiset_diff(expected: Sequence[str], got: Sequence[str]) -> tuple[int, int]:
    """(lost, duplicated): expected items missing from ``got``, and extra copies in ``got``."""
    want = collections.Counter(expected)
    have = collections.Counter(got)
    lost = sum((want - have).values())
    dup = sum((have - want).values())
    return lost, dup


# ---- tiny datasets ------------------------------------------------------------------------------------
def cifar_source(work: Path, n_train: int = 64, seed: int = 3) -> Path:
    """CIFAR-10 python batches (real on-disk format) with ``n_train`` images; returns the batches dir."""
    from tools.datagen import make_cifar

    d = work / f"cifar-{n_train}-{seed}"
    if not (d / "cifar-10-batches-py" / "data_batch_1").exists():
        make_cifar(d, n_train=n_train, n_test=8, seed=seed)
    return d / "cifar-10-batches-py"


def imagefolder_source(work: Path, classes: int = 3, per_class: int = 8, seed: int = 5) -> Path:
    from tools.datagen import make_imagefolder

    d = work / f"if-{classes}x{per_class}-{seed}"
    if not d.exists():
        make_imagefolder(d, num_classes=classes, per_class=per_class, seed=seed, size=(64, 48))
    return d


def packed(src: Path, out: Path, fmt: str = "tar", samples_per_shard: int = 8, **kw: Any) -> Any:
    """Pack ``src`` into ``out`` in-process (fixture data; the CLI is what trials exercise)."""
    from stager.pack import pack

    if (out / "manifest.json").exists():
        from stager.manifest import load_manifest

        return load_manifest(out)
    if fmt == "zarr" and "resize" not in kw:
        kw["resize"] = (32, 32)
    return pack(str(src), str(out), fmt, samples_per_shard=samples_per_shard, quiet=True, **kw).manifest


def verify_ok(path: str | os.PathLike[str], deep: bool = False) -> tuple[bool, list[tuple[str, str]]]:
    from stager.shardcheck import verify

    res = verify(path, deep=deep)
    return res.ok, res.bad


SUBPROCESS_ENV = "STAGER_FAULTS_SUBPROCESS"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``stager ARGS`` in this process (fast) unless ``$STAGER_FAULTS_SUBPROCESS=1`` (real process).

    An exception escaping the CLI becomes exit 1 with "Traceback" in stderr, as it would in a
    process, so :func:`one_line_error` rejects it.
    """
    if os.environ.get(SUBPROCESS_ENV) == "1":
        return run_stager(*args)
    import io
    import traceback
    from contextlib import redirect_stderr, redirect_stdout

    from stager.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception:
            traceback.print_exc()
            rc = 1
    return subprocess.CompletedProcess(["stager", *args], rc, out.getvalue(), err.getvalue())

"""Run things as another user: real unprivileged uids, for the trust-boundary tests (docs/security.md).

CI runs as root. These helpers drop to numeric uids with ``setpriv`` (util-linux), which needs no
account, so nothing in /etc is changed: :data:`VICTIM` and :data:`ATTACKER` are two local users
sharing a node, :data:`OTHER` a third. A test that needs them takes the :func:`node` fixture (a
fresh :class:`Node`: a shared sticky ``tmp`` like ``/tmp``, a private home per user, a root-owned
``data`` directory everyone can read) and runs commands with :func:`run_as`, :func:`stager_as`
and :func:`python_as`. Where users cannot be switched (not root, no ``setpriv``, no interpreter
another uid can run), those tests are skipped with the reason.

Another uid must be able to run Python with this checkout and its packages: the interpreter may
live under a directory only root can enter (``/root/.pyenv``), so :func:`interpreter` picks the
first of ``sys.executable`` and the system ``python3.X`` of the same minor version that the uid can
run, and a ``sitecustomize`` in a world-readable directory adds the venv's site-packages (its
``.pth`` files included) and this checkout to ``sys.path``.
"""

from __future__ import annotations

import functools
import os
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETPRIV = shutil.which("setpriv")


@dataclass(frozen=True)
class User:
    """An unprivileged identity: ``uid``, primary ``gid``, supplementary ``groups``."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def setpriv(self) -> list[str]:
        """The ``setpriv`` prefix that runs a command as this user (real, effective and saved ids)."""
        groups = ["--groups=" + ",".join(map(str, self.groups))] if self.groups else ["--clear-groups"]
        return [SETPRIV or "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", *groups, "--"]


VICTIM = User("victim", 64101, 64101)
ATTACKER = User("attacker", 64102, 64102)
OTHER = User("other", 64103, 64103)


def account(names: Sequence[str], fallback: User) -> User:
    """The first of ``names`` that is an existing account (base-passwd's unprivileged system
    accounts), as a :class:`User`; ``fallback`` when none exists. For code that looks the user up
    (``setpriv --init-groups``, as the prolog service did before it learnt numeric uids)."""
    import pwd

    for name in names:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_uid != 0:
            return User(name, pw.pw_uid, pw.pw_gid)
    return fallback


# Two accounts with entries in /etc/passwd (read, never changed) for the prolog service's tests.
ACCOUNT_ATTACKER = account(("nobody",), ATTACKER)
ACCOUNT_VICTIM = account(("irc", "list", "games", "news"), VICTIM)


# ---- an interpreter another uid can run -------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _bootstrap_dir() -> Path:
    """A world-readable directory with a ``sitecustomize`` that puts the venv's site-packages and this
    checkout on ``sys.path`` (for an interpreter that does not find the venv by itself)."""
    d = Path(tempfile.mkdtemp(prefix="stager-asuser-"))
    d.chmod(0o755)
    paths = [p for p in site.getsitepackages() if os.path.isdir(p)]
    (d / "sitecustomize.py").write_text(
        "import site, sys\n"
        f"for p in {paths!r}:\n"
        "    if p not in sys.path:\n"
        "        site.addsitedir(p)\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
    )
    (d / "sitecustomize.py").chmod(0o644)
    return d


def _candidates() -> list[str]:
    out = [sys.executable]
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for d in ("/usr/bin", "/usr/local/bin", "/bin"):
        p = os.path.join(d, minor)
        if os.path.exists(p) and p not in out:
            out.append(p)
    return out


def base_env(home: str | os.PathLike[str] = "/", **extra: str) -> dict[str, str]:
    """A clean environment for another user: PATH, HOME, LANG, this checkout's imports, no Slurm or
    staging variables from the test process."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.fspath(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": os.pathsep.join([str(_bootstrap_dir()), str(ROOT)]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


@functools.lru_cache(maxsize=1)
def interpreter() -> str | None:
    """The first interpreter :data:`VICTIM` can run with numpy and this checkout's ``stager``, or None."""
    if SETPRIV is None or os.geteuid() != 0:
        return None
    for exe in _candidates():
        try:
            # Through a shell's exec, as scripts run it (setpriv's own exec may find its way where execve
            # does not).
            res = subprocess.run([*VICTIM.setpriv(), "sh", "-c", 'exec "$0" -c "import numpy, stager"', exe],
                                 env=base_env(), cwd="/", capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if res.returncode == 0:
            return exe
    return None


def why_not() -> str | None:
    """Why users cannot be switched here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root to switch to unprivileged uids (CI runs as root)"
    if SETPRIV is None:
        return "needs setpriv (util-linux)"
    if interpreter() is None:
        return f"no Python interpreter uid {VICTIM.uid} can run with this checkout's packages"
    return None


requires_users = pytest.mark.skipif("os.geteuid() != 0 or __import__('shutil').which('setpriv') is None",
                                    reason="needs root and setpriv to run attacks as unprivileged uids")


# ---- running ------------------------------------------------------------------------------------------
def run_as(user: User | None, argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
           cwd: str | os.PathLike[str] = "/", timeout: float = 180, input: str | None = None
           ) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``user`` (None: as root, unchanged) and wait; text output captured, no check."""
    prefix = user.setpriv() if user is not None else []
    return subprocess.run([*prefix, *map(os.fspath, argv)], env=dict(env) if env is not None else base_env(),
                          cwd=cwd, capture_output=True, text=True, timeout=timeout, input=input, check=False)


def popen_as(user: User | None, argv: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
             cwd: str | os.PathLike[str] = "/") -> subprocess.Popen[str]:
    """Start ``argv`` as ``user`` (stdin, stdout and stderr piped, text); the caller waits."""
    prefix = user.setpriv() if user is not None else []
    return subprocess.Popen([*prefix, *map(os.fspath, argv)], env=dict(env) if env is not None else base_env(),
                            cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def python_argv() -> list[str]:
    exe = interpreter()
    if exe is None:
        pytest.skip(why_not() or "no interpreter")
    return [exe]


def stager_as(user: User | None, *args: str | os.PathLike[str], env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] = "/", timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``stager ARGS`` as ``user`` (this checkout's CLI)."""
    return run_as(user, [*python_argv(), "-m", "stager", *args], env=env, cwd=cwd, timeout=timeout)


def python_as(user: User | None, code: str, *args: str, env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] = "/", timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` as ``user``."""
    return run_as(user, [*python_argv(), "-c", code, *args], env=env, cwd=cwd, timeout=timeout)


def stager_command(directory: Path) -> Path:
    """An executable ``stager`` in ``directory`` that any uid can run (what a site's ``STAGER=`` names)."""
    exe = interpreter()
    if exe is None:
        pytest.skip(why_not() or "no interpreter")
    path = directory / "stager"
    path.write_text(f'#!/bin/sh\nPYTHONPATH="{_bootstrap_dir()}:{ROOT}" exec "{exe}" -m stager "$@"\n')
    path.chmod(0o755)
    return path


# ---- a shared node --------------------------------------------------------------------------------------
@dataclass
class Node:
    """Directories of one shared machine, fresh per test (removed afterwards).

    ``base``: root-owned 0755, the top. ``tmp``: 1777 like ``/tmp`` (every user can create names,
    none can remove another's). ``data``: root-owned 0755, for datasets every user may read.
    ``bin``: 0755, commands any uid can run. ``home(user)``: the user's own 0700 directory.
    """

    base: Path
    tmp: Path
    data: Path
    bin: Path

    def home(self, user: User) -> Path:
        h = self.base / f"home-{user.name}"
        if not h.exists():
            h.mkdir(mode=0o700)
            os.chown(h, user.uid, user.gid)
        return h

    def env(self, user: User, **extra: str) -> dict[str, str]:
        """:func:`base_env` for ``user`` with HOME their home and TMPDIR the shared ``tmp``."""
        return base_env(self.home(user), TMPDIR=str(self.tmp), **extra)


@pytest.fixture
def node() -> Iterator[Node]:
    """A fresh :class:`Node`; skips when users cannot be switched here (:func:`why_not`)."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="stager-node-", dir="/tmp"))
    base.chmod(0o755)
    dirs = {}
    for name, mode in (("tmp", 0o1777), ("data", 0o755), ("bin", 0o755)):
        d = base / name
        d.mkdir()
        d.chmod(mode)
        dirs[name] = d
    try:
        yield Node(base=base, **dirs)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)

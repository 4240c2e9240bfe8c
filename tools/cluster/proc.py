"""Running commands, inside a host's namespaces or not, and the daemons the cluster keeps."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from .config import Config


class ClusterError(RuntimeError):
    """A step of bringing the cluster up or down failed; the message says which and why."""


def run(cmd: Sequence[str], *, check: bool = True, timeout: float = 120, env: dict[str, str] | None = None,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=timeout, env=env,
                             input=input)
    except FileNotFoundError as exc:
        raise ClusterError(f"{cmd[0]}: not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"`{' '.join(cmd)}` did not finish within {timeout:.0f}s") from exc
    if check and res.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` exited {res.returncode}: {(res.stderr or res.stdout).strip()}")
    return res


def enter(cfg: Config, host: str, *, mount: bool = True) -> list[str]:
    """The nsenter prefix that runs a command as ``host``: its network, hostname and (optionally) mounts."""
    cmd = ["nsenter", f"--net={cfg.netns(host)}"]
    if mount:
        cmd += [f"--mount={cfg.ns_file(host, 'mnt')}", f"--uts={cfg.ns_file(host, 'uts')}"]
    return [*cmd, "--"]


def on(cfg: Config, host: str, cmd: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return run([*enter(cfg, host), *cmd], **kw)  # type: ignore[arg-type]


def spawn(cfg: Config, host: str | None, name: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Start a daemon in the foreground of its own session (inside ``host``'s namespaces); log to log/NAME.log."""
    cfg.logs.mkdir(parents=True, exist_ok=True)
    full = [*(enter(cfg, host) if host else []), *cmd]
    with open(cfg.logs / f"{name}.log", "ab") as log:
        p = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env)
    return p.pid


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def netns_pids(inodes: set[int]) -> list[int]:
    """Processes whose network namespace is one of ``inodes`` (what ``ip netns pids`` does)."""
    want = {f"net:[{i}]" for i in inodes}
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/ns/net") in want:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def ns_inode(path: Path) -> int | None:
    """The namespace a bound namespace file holds, or None when nothing is bound there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino if os.stat(path.parent).st_dev != st.st_dev else None


def terminate(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in pids if alive(p)]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10)
        while time.monotonic() < deadline and any(alive(p) for p in live):
            time.sleep(0.1)


def wait_for(what: str, probe: object, timeout: float, interval: float = 0.25) -> None:
    """Poll ``probe()`` until it is truthy; ClusterError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = probe()  # type: ignore[operator]
        except ClusterError as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return
        time.sleep(interval)
    raise ClusterError(f"{what}: not ready after {timeout:.0f}s ({last})")


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` in this (the host's) mount namespace, deepest first."""
    base = str(path).rstrip("/")
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == (base or "/") or mp.startswith(base + "/"):
                found.append(mp)
    return sorted(set(found), key=lambda m: -m.count("/"))

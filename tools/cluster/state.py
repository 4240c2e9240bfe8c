"""The record of what ``up`` made (.cluster/state.json), written after every step so that ``down``
can undo a half-finished bring-up, and who owns the cluster (:class:`Owner`)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def proc_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None when it is
    gone: with the pid it names one process, never a later one that reuses the number."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if fields[0] not in ("Z", "X") else None


@dataclass(frozen=True)
class Owner:
    """Who brought the cluster up. ``kind``: ``"manual"`` (``make cluster``: it stays up until
    ``make cluster-down``) or ``"session"`` (a test session that takes it down when it ends; one that
    died left it behind, and the next ``up`` clears it)."""

    kind: str
    pid: int
    start: int | None

    @classmethod
    def this_process(cls, kind: str) -> Owner:
        return cls(kind, os.getpid(), proc_start(os.getpid()))

    @classmethod
    def from_json(cls, data: Any) -> Owner | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(str(data["kind"]), int(data["pid"]), None if data.get("start") is None else int(data["start"]))
        except (KeyError, TypeError, ValueError):
            return None

    def alive(self) -> bool:
        return proc_start(self.pid) == self.start

    @property
    def dead_session(self) -> bool:
        """A test session's cluster whose session is gone (killed, crashed): nobody will take it down."""
        return self.kind == "session" and not self.alive()

    def describe(self) -> str:
        return f"{self.kind} pid {self.pid}"


class Record:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"netns": {}, "daemons": {}, "complete": False}
        if path.exists():
            with contextlib.suppress(OSError, ValueError):  # a torn record: down still sweeps by name
                self.data.update(json.loads(path.read_text()))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def add_netns(self, host: str, inode: int) -> None:
        self.data["netns"][host] = inode
        self.save()

    @property
    def netns(self) -> dict[str, int]:
        return dict(self.data["netns"])

    def add_daemon(self, name: str, pid: int) -> None:
        self.data["daemons"][name] = pid
        self.save()

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    @property
    def daemons(self) -> dict[str, int]:
        return dict(self.data["daemons"])

    @property
    def owner(self) -> Owner | None:
        return Owner.from_json(self.data.get("owner"))

    def set_owner(self, owner: Owner) -> None:
        self.set("owner", asdict(owner))

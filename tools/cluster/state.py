"""The record of what ``up`` made (.cluster/state.json), written after every step so that ``down``
can undo a half-finished bring-up."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


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

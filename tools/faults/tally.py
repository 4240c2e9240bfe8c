"""Figures recorded by fault trials: one JSON line per (row, counts) into ``$STAGER_FAULTS_TALLY``.

A row of docs/reliability.md is "fault or input | trials | detected/handled | data lost". Tests call
:func:`record` after asserting; :mod:`tools.faults.report` runs the tests with the variable set and
sums the lines per row. Without the variable (plain ``make test``) recording is a no-op.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

TALLY_ENV = "STAGER_FAULTS_TALLY"


@dataclass
class Row:
    """Summed figures of one table row. ``extra`` holds named counters (e.g. ``leftovers``)."""

    row: str
    group: str = ""
    trials: int = 0
    handled: int = 0
    lost: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, rec: dict[str, Any]) -> None:
        self.trials += int(rec.get("trials", 0))
        self.handled += int(rec.get("handled", 0))
        self.lost += int(rec.get("lost", 0))
        for k, v in (rec.get("extra") or {}).items():
            self.extra[k] = self.extra.get(k, 0) + int(v)
        note = rec.get("note")
        if note and note not in self.notes:
            self.notes.append(str(note))


def record(row: str, *, trials: int, handled: int, lost: int = 0, group: str = "", note: str = "",
           **extra: int) -> None:
    """Append one tally line for ``row`` (no-op unless ``$STAGER_FAULTS_TALLY`` names a file)."""
    path = os.environ.get(TALLY_ENV)
    if not path:
        return
    line = json.dumps({"row": row, "group": group, "trials": trials, "handled": handled, "lost": lost,
                       "note": note, "extra": {k: int(v) for k, v in extra.items()}}) + "\n"
    # Tests may run in parallel processes: one locked append per line.
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line)


def load(path: str | os.PathLike[str]) -> list[Row]:
    """Sum the tally lines of ``path`` per row, in first-seen order."""
    rows: dict[str, Row] = {}
    try:
        with open(path) as f:
            lines: Iterable[str] = f.read().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        r = rows.setdefault(rec["row"], Row(rec["row"], rec.get("group", "")))
        r.add(rec)
    return list(rows.values())

"""Progress reporting for long-running commands: samples/s and MB/s on stderr.

A single line redrawn in place on a terminal, or one line every ``interval`` seconds when stderr
is a file (Slurm logs), so job logs stay readable. Thread-safe counters; quiet mode prints nothing.
Progress is only ever shown: a stream that cannot be written (closed, a full disk) turns it off
instead of failing the command whose progress it is.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        label: str,
        total_items: int | None = None,
        total_bytes: int | None = None,
        *,
        unit: str = "samples",
        quiet: bool = False,
        interval: float = 0.5,
        stream: TextIO | None = None,
    ) -> None:
        self.label = label
        self.total_items = total_items
        self.total_bytes = total_bytes
        self.unit = unit
        self.quiet = quiet
        self.stream = stream or sys.stderr
        try:
            self.tty = self.stream.isatty()
        except (AttributeError, OSError, ValueError):  # no stderr at all, or a closed one
            self.tty, self.quiet = False, True
        self.interval = interval if self.tty else max(interval, 10.0)
        self.items = 0
        self.bytes = 0
        self.start = time.perf_counter()
        self._last = 0.0
        self._lock = threading.Lock()

    def update(self, items: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            self.items += items
            self.bytes += nbytes
            now = time.perf_counter()
            if not self.quiet and now - self._last >= self.interval:
                self._last = now
                self._draw(now, final=False)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def rates(self) -> tuple[float, float]:
        dt = max(self.elapsed, 1e-9)
        return self.items / dt, self.bytes / dt

    def _draw(self, now: float, final: bool) -> None:
        dt = max(now - self.start, 1e-9)
        parts = [f"{self.label}:"]
        if self.total_items:
            parts.append(f"{self.items}/{self.total_items} {self.unit} ({100 * self.items / self.total_items:.0f}%)")
        else:
            parts.append(f"{self.items} {self.unit}")
        parts.append(f"{self.items / dt:,.0f} {self.unit}/s")
        parts.append(f"{self.bytes / dt / 1e6:,.1f} MB/s")
        parts.append(f"{dt:.1f}s")
        line = " ".join(parts)
        try:
            if self.tty:
                self.stream.write("\r" + line + ("\n" if final else ""))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # stderr full or gone: the command goes on without progress
            self.quiet = True

    def close(self) -> None:
        if not self.quiet:
            self._draw(time.perf_counter(), final=True)

"""Per-rank loader statistics (``loader.stats()``).

Workers time their own reads and decodes and send the figures with each batch; the main process
adds how long it waited for each batch. Seconds are summed over workers, so with ``W`` busy workers
``io_seconds + decode_seconds`` can exceed wall time by up to ``W``x.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoaderStats:
    rank: int = 0
    world_size: int = 1
    source: str = ""
    reading_from: str = ""
    staged: bool = False
    staged_mode: str | None = None
    batches: int = 0
    samples: int = 0
    bytes: int = 0
    io_seconds: float = 0.0
    decode_seconds: float = 0.0
    wait_seconds: float = 0.0
    padded: int = 0
    dropped: int = 0
    skipped: int = 0
    skipped_keys: list[str] = field(default_factory=list)
    # A mix (docs/loader.md, "Mixing datasets"): each stream's name, source, reading_from and staged,
    # and per stream the samples and payload bytes handed out (workers send both with each batch).
    streams: list[dict[str, Any]] = field(default_factory=list)
    stream_samples: list[int] = field(default_factory=list)
    stream_bytes: list[int] = field(default_factory=list)
    _t0: float | None = None
    _busy: float = 0.0

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._t0 is not None:
            self._busy += time.perf_counter() - self._t0
            self._t0 = None

    @property
    def seconds(self) -> float:
        return self._busy + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def add_worker(self, w: dict[str, Any]) -> None:
        self.bytes += int(w["bytes"])
        self.io_seconds += float(w["io_s"])
        self.decode_seconds += float(w["decode_s"])
        if "stream_samples" in w:
            if not self.stream_samples:
                self.stream_samples = [0] * len(self.streams)
                self.stream_bytes = [0] * len(self.streams)
            self.stream_samples = list(map(operator.add, self.stream_samples, w["stream_samples"]))
            self.stream_bytes = list(map(operator.add, self.stream_bytes, w["stream_bytes"]))
        skipped = list(w.get("skipped", ()))
        self.skipped += len(skipped)
        self.skipped_keys += skipped[: max(0, 100 - len(self.skipped_keys))]

    def to_dict(self) -> dict[str, Any]:
        secs = self.seconds
        out = self._totals(secs)
        if self.streams:
            got = self.stream_samples or [0] * len(self.streams)
            nbytes = self.stream_bytes or [0] * len(self.streams)
            out["streams"] = {
                info["name"]: {**{k: v for k, v in info.items() if k != "name"}, "samples": n, "bytes": b,
                               "share": n / self.samples if self.samples else 0.0}
                for info, n, b in zip(self.streams, got, nbytes, strict=True)
            }
        return out

    def _totals(self, secs: float) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "source": self.source,
            "reading_from": self.reading_from,
            "staged": self.staged,
            "staged_mode": self.staged_mode,
            "batches": self.batches,
            "samples": self.samples,
            "bytes": self.bytes,
            "seconds": round(secs, 6),
            "samples_per_s": self.samples / secs if secs > 0 else 0.0,
            "bytes_per_s": self.bytes / secs if secs > 0 else 0.0,
            "io_seconds": round(self.io_seconds, 6),
            "decode_seconds": round(self.decode_seconds, 6),
            "wait_seconds": round(self.wait_seconds, 6),
            "padded": self.padded,
            "dropped": self.dropped,
            "skipped": self.skipped,
            "skipped_keys": list(self.skipped_keys),
        }

"""``stager pack --workers N`` reports progress while shards are written, for every format (issue 38.11).

Formats without segments (hdf5, record, zarr) are written one whole shard per worker process
(stager/pack/workers.py ``_run_shards``): each finished shard must count at once, not when the last
one is done. The test holds the last shard back on an event, not on time: its only image is a FIFO
that the test writes only after a progress line counting the other shards has appeared on stderr.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from stager.manifest import load_manifest
from tests.cli_support import clean_env, open_writer_when_read
from tools.datagen import jpeg_bytes, render_image

N = 5  # samples, one per shard; the last one's image is the FIFO


def _list(tmp_path: Path) -> tuple[Path, Path, bytes]:
    rng = np.random.default_rng(11)
    d = tmp_path / "imgs"
    d.mkdir()
    rows = []
    for i in range(N - 1):
        (d / f"a{i}.jpg").write_bytes(jpeg_bytes(render_image(rng, i % 2, 2, 32, 32)))
        rows.append(f"{d / f'a{i}.jpg'},{i % 2}")
    fifo = d / "z-last.jpg"
    os.mkfifo(fifo)
    rows.append(f"{fifo},0")
    (tmp_path / "list.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return tmp_path / "list.csv", fifo, jpeg_bytes(render_image(rng, 0, 2, 32, 32))


@pytest.mark.parametrize("fmt", ["hdf5", "record", "zarr"])
def test_progress_counts_each_shard_as_it_finishes(tmp_path: Path, fmt: str) -> None:
    lst, fifo, last = _list(tmp_path)
    out = tmp_path / "out"
    extra = ["--resize", "32x32"] if fmt == "zarr" else []  # zarr's one size, without probing the FIFO's header
    proc = subprocess.Popen([sys.executable, "-m", "stager", "pack", str(lst), str(out), "--format", fmt,
                             "--samples-per-shard", "1", "--keep-order", "--workers", "2", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    lines: queue.Queue[str | None] = queue.Queue()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read_stderr, daemon=True).start()
    fd = open_writer_when_read(fifo, proc)  # a worker is blocked on the last sample's image
    seen: list[str] = []
    try:
        while True:
            # Old behaviour (progress only once every shard is in) never prints this line: the deadline is
            # only there to fail instead of hanging; passing does not depend on it.
            line = lines.get(timeout=300)
            assert line is not None, f"pack ended before the last image was written: {seen}"
            seen.append(line)
            m = re.search(rf"pack {fmt}: (\d+)/{N} samples", line)
            if m and 0 < int(m.group(1)) < N:
                break
        os.write(fd, last)
    finally:
        os.close(fd)
    assert proc.wait(timeout=300) == 0, (seen, proc.stdout.read() if proc.stdout else "")
    assert load_manifest(out).num_samples == N

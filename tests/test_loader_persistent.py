"""Persistent DataLoader workers: the same batches as fresh workers per epoch, exact resume, clean exit.

Data: 240 tiny JPEGs in 4 classes, packed in class order into tar shards of 20 samples. Each test
compares a persistent-worker loader against the non-persistent one (fresh workers each epoch), whose
order the other loader tests pin to the plan.
"""

from __future__ import annotations

import gc
import glob
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.errors import CorruptSampleError
from stager.loader import make_loader, make_numpy_loader
from stager.manifest import load_manifest
from stager.pack import pack
from tools.datagen import make_imagefolder

KW: dict[str, Any] = {
    "rank": 1,
    "world_size": 2,
    "decode": "raw",
    "seed": 4,
    "staged": False,
    "shuffle_buffer": 16,
    "multiprocessing_context": "fork",
}


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("persist_src") / "train"
    make_imagefolder(src, num_classes=4, per_class=60, seed=5, size=(10, 8))
    out = tmp_path_factory.mktemp("persist_packed") / "tar"
    pack(src, out, "tar", samples_per_shard=20, keep_order=True)
    return out


def content(batch: dict[str, Any]) -> tuple[list[str], list[int], list[bytes]]:
    images = batch["image"]
    data = [bytes(x) for x in images] if isinstance(images, list) else [images.numpy().tobytes()]
    return batch["key"], batch["label"].tolist(), data


def epoch(loader: Any, stop: int | None = None) -> list[Any]:
    out = []
    for i, b in enumerate(loader):
        if stop is not None and i == stop:
            break
        out.append(content(b))
    return out


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_same_batches_as_fresh_workers_over_epochs(packed: Path, workers: int) -> None:
    """Two implicit epochs, an abandoned one, and an explicit set_epoch: batch for batch identical,
    each epoch exactly len(loader) batches, and the workers are the same processes throughout."""
    per = make_loader(packed, 7, num_workers=workers, **KW)
    fresh = make_loader(packed, 7, num_workers=workers, persistent_workers=False, **KW)
    assert per.persistent_workers and not fresh.persistent_workers
    seen = []
    pids = None
    for _ in range(2):
        a, b = epoch(per), epoch(fresh)
        assert a == b and len(a) == len(per) == len(fresh)
        seen.append(a)
        now = [w.pid for w in per._pool.dl._iterator._workers]  # type: ignore[union-attr]
        assert pids is None or now == pids, "persistent workers were restarted"
        pids = now
    assert seen[0] != seen[1], "epochs differ in order"
    assert epoch(per, stop=3) == epoch(fresh, stop=3)  # epoch 2, abandoned after 3 batches
    per.set_epoch(5)
    fresh.set_epoch(5)
    assert epoch(per) == epoch(fresh)
    per.close()
    assert epoch(per) == epoch(fresh), "a closed loader starts new workers for the next epoch"
    per.close()


def test_mid_epoch_resume_is_exact(packed: Path) -> None:
    """state_dict() after c batches, loaded into a loader whose persistent workers already served an
    epoch, yields exactly the rest (and the same as a non-persistent loader given that state);
    an elastic resume (different worker count) reaches the running workers too."""
    ref = make_loader(packed, 5, num_workers=2, **KW)
    ref.set_epoch(3)
    full = epoch(ref)
    for c in (0, 1, len(full) // 2, len(full) - 1, len(full)):
        src = make_loader(packed, 5, num_workers=2, **KW)
        src.set_epoch(3)
        it: Any = iter(src)
        for _ in range(c):
            next(it)
        state = src.state_dict()
        it.close()
        src.close()
        warm = make_loader(packed, 5, num_workers=2, **KW)
        epoch(warm)  # workers started and used for epoch 0
        warm.load_state_dict(state)
        warm.set_epoch(3)  # the usual training-loop call keeps the loaded position
        rest = epoch(warm)
        assert rest == full[c:], f"resume after {c} batches"
        fresh = make_loader(packed, 5, num_workers=2, persistent_workers=False, **KW)
        fresh.load_state_dict(state)
        fresh.set_epoch(3)
        assert epoch(fresh) == rest
        assert epoch(warm) == epoch(fresh), "the epoch after the resumed one"
        if c == len(full):
            # Without set_epoch (Accelerate's and Fabric's loops), a state saved at an epoch's end goes on
            # with the next epoch, which `epoch` reports beforehand.
            unpinned = make_loader(packed, 5, num_workers=2, persistent_workers=False, **KW)
            unpinned.load_state_dict(state)
            following = make_loader(packed, 5, num_workers=2, persistent_workers=False, **KW)
            following.set_epoch(4)
            assert unpinned.epoch == 4 and epoch(unpinned) == epoch(following)
        warm.close()
    # Elastic: a 2-worker state into a 3-worker persistent loader, against a fresh 3-worker one.
    src = make_loader(packed, 5, num_workers=2, **KW)
    src.set_epoch(1)
    it2: Any = iter(src)
    for _ in range(4):
        next(it2)
    state = src.state_dict()
    it2.close()
    src.close()
    warm = make_loader(packed, 5, num_workers=3, **KW)
    epoch(warm)
    warm.load_state_dict(state)
    fresh = make_loader(packed, 5, num_workers=3, persistent_workers=False, **KW)
    fresh.load_state_dict(state)
    a, b = epoch(warm), epoch(fresh)
    assert a == b and len(a) == len(fresh)
    assert epoch(warm) == epoch(fresh), "back to the plain plan in the next epoch"
    warm.close()


EXIT_SCRIPT = """
import os, sys
from stager.loader import make_loader
loader = make_loader(sys.argv[1], 7, rank=0, world_size=1, decode="raw", staged=False, num_workers=2)
for b in loader:
    pass
for i, b in enumerate(loader):
    if i == 2:
        break
held = b  # a batch still referenced at exit
print("PIDS", *[w.pid for w in loader._pool.dl._iterator._workers], flush=True)
"""


def test_process_exits_cleanly_without_close(packed: Path, tmp_path: Path) -> None:
    """A training script that never calls close(), stopping mid-epoch with batches in flight, exits
    promptly with status 0, its workers are gone and nothing of it remains under /dev/shm."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, str(script), str(packed)], check=False, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PIDS"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 2
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a worker outlived the process"
    # Ring files are named stager-<token>-<worker pid>-... (stager.loader.shm).
    left = [p for p in glob.glob("/dev/shm/stager-*") if any(f"-{w}-" in p for w in pids)]
    assert left == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_worker_error_restarts_the_workers(packed: Path, tmp_path: Path) -> None:
    """A corrupt sample raised in a persistent worker stops that pool (workers gone); the next epoch
    starts new workers and raises again instead of hanging on the broken pool."""
    d = tmp_path / "tar"
    shutil.copytree(packed, d)
    shard = load_manifest(d).shards[2]
    with open(d / shard.name, "r+b") as f:
        f.seek(int(shard.offsets[1]))
        f.write(b"\0" * 16)  # the JPEG markers, size kept
    kw = {k: v for k, v in KW.items() if k != "decode"} | {"decode": "uint8", "image_size": 8, "transform": "eval"}
    loader = make_loader(d, 7, num_workers=2, **kw)
    for _ in range(2):
        with pytest.raises(CorruptSampleError, match=shard.name):
            epoch(loader)
        assert loader._pool is None


def _freeze_count(image: Any, rng: Any) -> np.ndarray:
    """A transform run in the worker: the worker's ``gc.get_freeze_count()`` as a (1, 1, 4) image."""
    return np.frombuffer(gc.get_freeze_count().to_bytes(4, "little"), np.uint8).reshape(1, 1, 4).copy()


@pytest.mark.parametrize("transport", ["persistent", "fresh", "numpy"])
def test_forked_workers_inherit_the_heap_frozen(packed: Path, transport: str) -> None:
    """A forked worker holds every object inherited from the parent in the collector's permanent
    generation: its garbage collections never walk (and so never copy) the parent's heap, whenever its
    inherited allocation counters would have started one (docs/benchmarks.md, "Loader start-up"). The
    parent's own objects are unfrozen again once the workers run."""
    assert gc.get_freeze_count() == 0
    inherited = len(gc.get_objects())
    kw = {k: v for k, v in KW.items() if k != "decode"} | {"decode": "uint8", "transform": _freeze_count}
    if transport == "numpy":
        loader: Any = make_numpy_loader(packed, 7, num_workers=2, **kw)
    else:
        loader = make_loader(packed, 7, num_workers=2, persistent_workers=transport == "persistent", **kw)
    try:
        counts = set()
        for _ in range(2):
            for b in loader:
                images = np.asarray(b["image"]).reshape(len(b["key"]), 4)
                counts |= {int.from_bytes(bytes(x.tolist()), "little") for x in images}
            assert gc.get_freeze_count() == 0, "the parent's heap stays frozen"
        assert min(counts) >= inherited // 2, (counts, inherited)
    finally:
        loader.close()


def test_a_program_that_froze_its_heap_keeps_its_freeze(packed: Path) -> None:
    """A training script that calls ``gc.freeze()`` itself before its workers start keeps that freeze: the
    loader neither unfreezes nor adds to it in the parent."""
    sentinel: list[Any] = [object()]  # a container the collector tracks
    gc.freeze()
    try:
        loader = make_loader(packed, 7, num_workers=2, **KW)
        epoch(loader)
        epoch(make_loader(packed, 7, num_workers=2, persistent_workers=False, **KW))
        loader.close()
        # get_objects() lists the collected generations, never the permanent one.
        assert gc.get_freeze_count() > 0
        assert not any(o is sentinel for o in gc.get_objects()), "the program's freeze was undone"
    finally:
        gc.unfreeze()
    assert any(o is sentinel for o in gc.get_objects())

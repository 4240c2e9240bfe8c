"""Shared fixtures: small synthetic datasets generated once per session (tools/datagen.py)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.asuser import node  # noqa: E402, F401 (the fixture of the trust-boundary tests)
from tools.datagen import make_cifar, make_imagefolder  # noqa: E402

# Stages in tests do not add to the staging history in the real home (stager/cache/history.py); the
# tests of `stager hints` point $STAGER_HISTORY at a file of their own.
os.environ.setdefault("STAGER_HISTORY", "off")
# Subprocesses started by tests must import this checkout and find tools/.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (``make`` passing on its own, a CI time limit) and SIGHUP end the run as Ctrl-C does, so
    session fixtures are torn down (the cluster above all: tools/cluster/session.py). Under pytest-xdist
    (``make test`` runs ``-n 2``) the session fixtures live in the worker processes, which a signal sent to
    the controller alone (make's, CI's) does not reach: the controller passes it on to them first."""
    from tools.cluster.session import ENDING_SIGNALS, signals_interrupt

    signals_interrupt()
    if getattr(config, "workerinput", None) is None and config.pluginmanager.has_plugin("dsession"):
        for sig in ENDING_SIGNALS:
            signal.signal(sig, functools.partial(_to_workers_then, signal.getsignal(sig)))


def _to_workers_then(handler: Any, signum: int, frame: FrameType | None) -> None:
    """The xdist controller's handler of an ending signal: send it to the workers (this process's
    children: execnet starts nothing else here), each of which then ends its session as Ctrl-C does,
    tearing down its fixtures; then end the controller's own session (``handler``)."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[1] == me:  # the parent pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signum)
    handler(signum, frame)


# Tests that share a singleton of the machine run one after another in one xdist worker: ``make test``
# runs ``-n 2 --dist loadgroup``, and pytest-xdist's own xdist_group marks do not reach its scheduler
# under pytest 9 (the worker renames ``item._nodeid``, which pytest 9 no longer reads), so the groups
# are named here by path, rootdir-relative. The one-machine Slurm cluster is one per machine (network
# namespaces, daemons, the checkout's .cluster/); its suite brings it up once and its teardown tests run
# inner `make test`s of their own.
SERIAL_GROUPS = {"tests/cluster/": "cluster"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` that keeps each of :data:`SERIAL_GROUPS` in one worker, every other test a
    unit of its own (xdist's ``@group`` suffix still counts, should it come back). The largest unit goes
    out first: the cluster suite starts at once, beside everything else."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Groups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in SERIAL_GROUPS.items():
                if nodeid.startswith(prefix):
                    return group
            return str(super()._split_scope(nodeid))

    return Groups(config, log)


@pytest.fixture(scope="session")
def imagenet_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ImageFolder of 4 classes x 6 JPEGs at ~1/4 ImageNet size (fast to generate and decode)."""
    root = tmp_path_factory.mktemp("imagenet") / "train"
    return make_imagefolder(root, num_classes=4, per_class=6, seed=1, size=(128, 96))


@pytest.fixture(scope="session")
def imagenet_tiny_tar(imagenet_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``imagenet_tiny`` packed once per session: 12 tar shards of 2 JPEGs (~250 KB). Shared by the
    modules that stage, stream and prefetch it: read it, never change it (copy it to damage it)."""
    from stager.pack import pack

    out = tmp_path_factory.mktemp("imagenet-tar") / "packed"
    pack(imagenet_tiny, out, "tar", samples_per_shard=2)
    return out


@pytest.fixture(scope="session")
def cifar_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CIFAR-10 python batches with 60 train / 20 test images; returns the batches directory."""
    return make_cifar(tmp_path_factory.mktemp("cifar"), n_train=60, n_test=20, seed=2, png_folder=True)


@pytest.fixture(scope="session")
def mix_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small datasets for the mixing tests (issue 31), each in another format: packed tar (60 samples),
    record (40), hdf5 (26), zarr (30, decoded 8x8) and a webdataset ShardWriter set adopted with
    ``stager index`` (23). Tiny JPEGs, shards of 8 samples."""
    import webdataset as wds

    from stager.index.api import index_dataset
    from stager.pack import pack
    from tools.datagen import jpeg_bytes

    base = tmp_path_factory.mktemp("mix_sets")
    out: dict[str, Path] = {}
    for name, n, fmt, seed in (("tar", 60, "tar", 31), ("record", 40, "record", 32), ("hdf5", 26, "hdf5", 33),
                               ("zarr", 30, "zarr", 34)):
        src = make_imagefolder(base / f"src-{name}", num_classes=2, per_class=n // 2, seed=seed, size=(12, 10))
        pack(src, base / name, fmt, samples_per_shard=8, resize=(8, 8) if fmt == "zarr" else None)
        out[name] = base / name
    wds_dir = base / "wds"
    wds_dir.mkdir()
    rng = np.random.default_rng(35)
    with wds.ShardWriter(str(wds_dir / "train-%06d.tar"), maxcount=8, verbose=0) as w:
        for i in range(23):
            img = rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)
            w.write({"__key__": f"w{i:04d}", "jpg": jpeg_bytes(img), "cls": i % 3})
    index_dataset(wds_dir)
    out["wds"] = wds_dir
    return out


@pytest.fixture(scope="session")
def frameworks_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tar pack of 203 tiny JPEGs (7 classes, 11 shards) for the framework tests (tests/test_frameworks_*.py):
    odd, so two ranks get one padding repeat; 13 batches of 8 per rank and epoch."""
    from stager.pack import pack

    base = tmp_path_factory.mktemp("frameworks")
    make_imagefolder(base / "src", num_classes=7, per_class=29, seed=5, size=(10, 8))
    pack(base / "src", base / "tar", "tar", samples_per_shard=20)
    return base / "tar"

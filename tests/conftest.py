"""Shared fixtures: small synthetic datasets generated once per session (tools/datagen.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.datagen import make_cifar, make_imagefolder  # noqa: E402

# Subprocesses started by tests must import this checkout and find tools/.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (``make`` passing on its own, a CI time limit) and SIGHUP end the run as Ctrl-C does, so
    session fixtures are torn down (the cluster above all: tools/cluster/session.py)."""
    from tools.cluster.session import signals_interrupt

    signals_interrupt()


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
def frameworks_pack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tar pack of 203 tiny JPEGs (7 classes, 11 shards) for the framework tests (tests/test_frameworks_*.py):
    odd, so two ranks get one padding repeat; 13 batches of 8 per rank and epoch."""
    from stager.pack import pack

    base = tmp_path_factory.mktemp("frameworks")
    make_imagefolder(base / "src", num_classes=7, per_class=29, seed=5, size=(10, 8))
    pack(base / "src", base / "tar", "tar", samples_per_shard=20)
    return base / "tar"

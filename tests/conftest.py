"""Shared fixtures: small synthetic datasets generated once per session (tools/datagen.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


@pytest.fixture(scope="session")
def imagenet_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ImageFolder of 4 classes x 6 JPEGs at ~1/4 ImageNet size (fast to generate and decode)."""
    root = tmp_path_factory.mktemp("imagenet") / "train"
    return make_imagefolder(root, num_classes=4, per_class=6, seed=1, size=(128, 96))


@pytest.fixture(scope="session")
def cifar_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CIFAR-10 python batches with 60 train / 20 test images; returns the batches directory."""
    return make_cifar(tmp_path_factory.mktemp("cifar"), n_train=60, n_test=20, seed=2, png_folder=True)

"""Keras 3's ``model.fit`` over stager loaders (stager.loader.keras), on the torch backend (always) and
on the TensorFlow backend (where tensorflow imports; mark: slow for the ResNet run).

Invariants: over 3 ranks and 2 epochs of ``fit``, the loaders hand Keras every sample exactly once per
epoch (Keras' shape-probing requests do not cost a batch), ending at the epoch's end position; the
BSC hands-on in small (tools/train_keras.py: ResNet50V2, weights=None, 32x32 CIFAR packed by stager)
runs a few steps; a mapping naming a field the batches lack is one line naming the fields there are.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stager.errors import UsageError
from stager.loader.mapping import BatchMapping
from stager.pack import pack
from tools.datagen import make_cifar

ROOT = Path(__file__).resolve().parents[1]
N = 120
HAS_KERAS = importlib.util.find_spec("keras") is not None
HAS_TF = importlib.util.find_spec("tensorflow") is not None
needs_keras = pytest.mark.skipif(not HAS_KERAS, reason="keras is not installed (pip install 'stager[test]')")
BACKENDS = [
    pytest.param("torch", marks=needs_keras),
    pytest.param("tensorflow", marks=[needs_keras, pytest.mark.skipif(
        not HAS_TF, reason="tensorflow is not installed here (pip install tensorflow-cpu; docs/training.md)")]),
]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("keras")
    src = make_cifar(root, n_train=N, n_test=4, seed=6)
    pack(src, root / "packed", samples_per_shard=16, split="train")
    return root / "packed"


def _run(backend: str, *args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT,
                          check=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_sees_each_sample_once_per_epoch(packed: Path, tmp_path: Path, backend: str) -> None:
    out = tmp_path / "fit.json"
    r = _run(backend, str(ROOT / "tests" / "keras_fit_script.py"), str(packed), str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res: dict[str, Any] = json.loads(out.read_text())
    assert res["backend"] == backend
    for epoch in range(2):
        ids = []
        for rank in res["ranks"]:
            n = rank["len"]
            assert len(rank["fetched"]) == 2 * n  # no batch lost to Keras' probing, none read ahead
            ids += [i for batch in rank["fetched"][epoch * n:(epoch + 1) * n] for i in batch]
        assert sorted(ids) == list(range(N))
    for rank in res["ranks"]:
        assert (rank["state"]["epoch"], rank["state"]["batches_done"]) == (1, rank["len"])
        assert len(rank["loss"]) == 2


@pytest.mark.parametrize("backend", [pytest.param("torch", marks=needs_keras),
                                     pytest.param("tensorflow", marks=[*BACKENDS[1].marks, pytest.mark.slow])])
def test_train_keras_resnet50v2_runs_a_few_steps(packed: Path, backend: str) -> None:
    r = _run(backend, "tools/train_keras.py", "--data", str(packed), "--steps", "1", "--batch-size", "4",
             "--workers", "1", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["backend"] == backend and summary["params"] > 20_000_000  # ResNet50V2 itself
    assert len(summary["loss"]) == 1 and summary["loss"][0] == summary["loss"][0]  # a number, not NaN


@needs_keras
def test_a_mapping_naming_a_missing_field_is_one_line(packed: Path) -> None:
    r = _run("torch", "tools/train_keras.py", "--data", str(packed), "--x", "pixels", "--workers", "0")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "'pixels'" in r.stderr and "image, index, key, label" in r.stderr


def test_batch_mapping_checks_names_against_the_fields() -> None:
    fields = ("image", "index", "key", "label")
    BatchMapping(("image", "index"), "label").check(fields)
    with pytest.raises(UsageError) as e:
        BatchMapping("image", "target").check(fields, "the Keras mapping")
    assert str(e.value) == ("the Keras mapping names the field 'target', which the dataset's batches lack; "
                            "use one of image, index, key, label")
    with pytest.raises(UsageError, match="at least one input"):
        BatchMapping(None, "label").check(fields)

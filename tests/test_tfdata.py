"""tf.data over a stager loader (stager.loader.tfdata), where tensorflow imports (tensorflow-cpu is
not in the test extra: docs/training.md, "TensorFlow").

Invariants: over 3 ranks, each pass over each rank's ``tf.data.Dataset`` is one epoch of its share:
together the ranks see every sample exactly once per epoch, each epoch in a new order, with equal
batch counts; a position saved after some batches resumes, in a new loader and a new dataset, with
exactly the epoch's remaining batches; a mapping naming a missing field is a one-line error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stager.errors import UsageError
from stager.pack import pack
from tools.datagen import make_cifar

tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed here (pip install tensorflow-cpu)")

N = 120
KW = {"seed": 3, "staged": False, "image_size": 32, "num_workers": 2, "multiprocessing_context": "fork"}


@pytest.fixture(scope="module", params=["tar", "squashfs"])
def packed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same CIFAR-like set packed as tar shards and as SquashFS images (issue 41: every transport
    holds over images, read without a mount)."""
    root = tmp_path_factory.mktemp(f"tfdata-{request.param}")
    src = make_cifar(root, n_train=N, n_test=4, seed=8)
    pack(src, root / "packed", request.param, samples_per_shard=16, split="train")
    return root / "packed"


def _ids(ds: object) -> list[list[int]]:
    return [x.numpy().tolist() for x, _y in ds]  # type: ignore[attr-defined]


def test_each_pass_is_an_epoch_of_the_ranks_share(packed: Path) -> None:
    from stager.loader import make_numpy_loader
    from stager.loader.tfdata import tf_dataset

    epochs: list[list[int]] = [[], []]
    counts = set()
    for rank in range(3):
        loader = make_numpy_loader(packed, 8, rank=rank, world_size=3, **KW)
        ds = tf_dataset(loader, x="index", y="label")
        first, second = _ids(ds), _ids(ds)
        counts.add((len(first), len(second)))
        assert first != second  # a new shuffle each epoch
        epochs[0] += [i for b in first for i in b]
        epochs[1] += [i for b in second for i in b]
        images = next(iter(tf_dataset(loader)))[0]
        assert images.dtype == tf.uint8 and tuple(images.shape)[1:] == (32, 32, 3)
        loader.close()
    assert len(counts) == 1
    for ids in epochs:
        assert sorted(ids) == list(range(N))


def test_resume_continues_with_the_remaining_batches(packed: Path) -> None:
    from stager.loader import make_numpy_loader
    from stager.loader.tfdata import tf_dataset

    whole_loader = make_numpy_loader(packed, 4, rank=2, world_size=3, **KW)
    whole = _ids(tf_dataset(whole_loader, x="index", y="label"))
    whole_loader.close()
    loader = make_numpy_loader(packed, 4, rank=2, world_size=3, **KW)
    head = []
    for x, _y in tf_dataset(loader, x="index", y="label"):
        head.append(x.numpy().tolist())
        if len(head) == 4:
            break
    state = loader.state_dict()
    loader.close()
    again = make_numpy_loader(packed, 4, rank=2, world_size=3, **KW)
    again.load_state_dict(state)
    assert head + _ids(tf_dataset(again, x="index", y="label")) == whole
    again.close()
    assert np.array_equal(np.sort(np.concatenate(whole)), np.unique(np.concatenate(whole)))


def test_a_missing_field_is_one_line(packed: Path) -> None:
    from stager.loader import make_numpy_loader
    from stager.loader.tfdata import tf_dataset

    loader = make_numpy_loader(packed, 4, **{**KW, "num_workers": 0})
    with pytest.raises(UsageError) as e:
        tf_dataset(loader, x="image", y="class")
    assert "'class'" in str(e.value) and "image, index, key, label" in str(e.value) and "\n" not in str(e.value)

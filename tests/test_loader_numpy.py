"""The numpy loader (stager.loader.numpy_loader): TF/Keras/JAX batches from worker processes, no torch.

Invariants tested: in an interpreter where importing torch raises, the loader (2 spawned workers)
yields numpy batches; over 3 ranks every sample is read exactly once per epoch (120 samples, batch 8),
and with 7 ranks (padding) every rank gets the same number of batches; for the same seed, world size,
workers and batch size its batches are the torch loader's, batch for batch and in order; a state saved
mid-epoch by either loader resumes the other with exactly the epoch's remaining batches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.pack import pack
from tests.squashfs_trees import HAVE_TOOLS, mksquashfs_of_pack
from tools.datagen import make_cifar

N = 120
KW: dict[str, Any] = {"seed": 11, "staged": False, "image_size": 32, "num_workers": 2}

BLOCKED = '''
import sys


class _NoTorch:
    """A meta path finder that makes `import torch` (and any torch.*) fail, here and in spawned workers."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, _NoTorch())


def main():
    import json

    from stager.loader import make_numpy_loader

    data, out = sys.argv[1], sys.argv[2]
    result = {}
    for rank in range(3):
        loader = make_numpy_loader(data, 8, rank=rank, world_size=3, seed=11, staged=False, image_size=32,
                                   num_workers=2)
        epochs = []
        for _ in range(2):
            batches = []
            for b in loader:
                img = b["image"]
                assert isinstance(img, __import__("numpy").ndarray) and img.dtype.name == "uint8", type(img)
                assert img.shape[1:] == (32, 32, 3) and b["label"].dtype.name == "int64"
                batches.append(b["index"].tolist())
            epochs.append(batches)
        loader.close()
        result[rank] = epochs
    try:
        import torch  # noqa: F401
        result["torch_importable"] = True
    except ImportError:
        result["torch_importable"] = False
    result["torch_loaded"] = any(m == "torch" or m.startswith("torch.") for m in sys.modules)
    open(out, "w").write(json.dumps(result))


if __name__ == "__main__":
    main()
'''


@pytest.fixture(scope="module", params=["tar", "squashfs-index"])
def packed(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The CIFAR set packed as tar; and as SquashFS images made by mksquashfs (zstd, fragments), adopted
    with ``stager index``: samples read through their inodes, decompressed in the workers."""
    root = tmp_path_factory.mktemp("npl")
    src = make_cifar(root, n_train=N, n_test=4, seed=5)
    if request.param == "tar":
        pack(src, root / "packed", samples_per_shard=16, split="train")
        return root / "packed"
    if not HAVE_TOOLS:
        pytest.skip("needs squashfs-tools: apt-get install squashfs-tools")
    pack(src, root / "sqfs", "squashfs", samples_per_shard=40, split="train")
    return mksquashfs_of_pack(root / "sqfs", root / "packed", "-comp", "zstd")


def _ids(loader: Any) -> list[list[int]]:
    return [np.asarray(b["index"]).tolist() for b in loader]


def test_numpy_loader_runs_where_torch_cannot_be_imported(packed: Path, tmp_path: Path) -> None:
    script = tmp_path / "no_torch.py"
    script.write_text(BLOCKED)
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(script), str(packed), str(out)], capture_output=True, text=True,
                       timeout=240, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["torch_importable"] is False and res["torch_loaded"] is False
    for epoch in range(2):
        ids = [i for rank in "012" for batch in res[rank][epoch] for i in batch]
        assert sorted(ids) == list(range(N))  # the 3 ranks partition the epoch
        assert len({len(res[rank][epoch]) for rank in "012"}) == 1
    # The same order as the torch loader for the same settings (torch is allowed in this process).
    from stager.loader import make_loader

    for rank in "012":
        torch_loader = make_loader(packed, 8, rank=int(rank), world_size=3, multiprocessing_context="fork", **KW)
        assert [_ids(torch_loader), _ids(torch_loader)] == res[rank]
        torch_loader.close()


def test_equal_batches_with_padding_and_the_torch_order(packed: Path) -> None:
    from stager.loader import make_loader, make_numpy_loader

    counts = set()
    seen: list[int] = []
    for rank in range(7):
        kw = {**KW, "rank": rank, "world_size": 7, "multiprocessing_context": "fork", "num_workers": 3,
              "decode": "raw"}
        nl = make_numpy_loader(packed, 5, **kw)
        got = _ids(nl)
        counts.add(len(got))
        seen += [i for b in got for i in b]
        if rank in (0, 6):
            tl = make_loader(packed, 5, **kw)
            assert _ids(tl) == got
            tl.close()
        nl.close()
    assert len(counts) == 1
    assert set(seen) == set(range(N)) and len(seen) == 7 * -(-N // 7)  # padded by repeats, nothing lost


@pytest.mark.parametrize(("first", "second"), [("numpy", "numpy"), ("numpy", "torch"), ("torch", "numpy")])
def test_resume_mid_epoch_across_transports(packed: Path, first: str, second: str) -> None:
    from stager.loader import make_loader, make_numpy_loader

    make = {"numpy": make_numpy_loader, "torch": make_loader}
    kw = {**KW, "rank": 1, "world_size": 3, "multiprocessing_context": "fork", "decode": "raw"}
    full = make_numpy_loader(packed, 4, **kw)
    full.set_epoch(1)
    whole = _ids(full)
    full.close()
    a = make[first](packed, 4, **kw)
    a.set_epoch(1)
    head = []
    for b in a:
        head.append(np.asarray(b["index"]).tolist())
        if len(head) == 3:
            break
    state = a.state_dict()
    a.close()
    b_loader = make[second](packed, 4, **kw)
    b_loader.load_state_dict(state)
    b_loader.set_epoch(1)
    assert head + _ids(b_loader) == whole
    b_loader.close()


def test_bad_settings_are_one_line_errors(packed: Path) -> None:
    from stager.errors import UsageError
    from stager.loader import make_numpy_loader

    with pytest.raises(UsageError, match="pin_memory"):
        make_numpy_loader(packed, 4, pin_memory=True, staged=False)
    with pytest.raises(UsageError, match="unknown loader arguments: colour"):
        make_numpy_loader(packed, 4, colour="blue")

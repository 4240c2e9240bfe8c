"""The Hugging Face ``Trainer`` given a stager dataset (``SampleDataset``), 2 CPU ranks under torchrun.

The Trainer batches samples itself (its DataLoader, its sampler, Accelerate's sharding across ranks,
evenly padded); stager serves ``ds[i]``. Invariants: every sample at least once per epoch across the
ranks with exactly Accelerate's declared padding (``ceil(N / 16) * 16 - N`` repeats), a new order each
epoch, and a run resumed from a mid-epoch checkpoint sees exactly the uninterrupted run's batches.
The same for a Trainer whose ``get_train_dataloader()`` returns ``make_loader(...)``: its epochs are the
loader's plan, and ``resume_from_checkpoint`` skips the consumed batches without reading them.
Plus ``SampleDataset`` itself: the loader's samples, bytes and decoding, by index, in DataLoader workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stager.loader import SampleDataset, make_loader
from tests.frameworks.common import (
    PER_RANK_BATCHES,
    N,
    assert_epoch,
    free_port,
    load,
    python,
    run,
    script,
    stager_epoch,
)

STEPS = -(-N // 16)  # global batches of 2 x 8 per epoch


def launch(frameworks_pack: Path, out: Path, *phase: str) -> list[dict[str, Any]]:
    pytest.importorskip("transformers", reason="transformers is in the test extra: make venv (tools/setup_venv.sh)")
    run([python(), "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         script("trainer_run.py"), str(frameworks_pack), str(out), *phase], cwd=out)
    return load(out, "loader-trainer" if phase else "trainer")


@pytest.mark.timeout(400)
def test_trainer_with_a_sample_dataset(frameworks_pack: Path, tmp_path: Path) -> None:
    ranks = launch(frameworks_pack, tmp_path)
    firsts = []
    for e in range(3):
        batches = [r["full"][STEPS * e : STEPS * (e + 1)] for r in ranks]
        ids = [i for b in batches for x in b for i in x]
        assert sorted(set(ids)) == list(range(N)) and len(ids) == STEPS * 16, f"epoch {e}"
        assert [len(b) for b in batches] == [STEPS, STEPS]
        firsts.append(tuple(batches[0][0]))
    assert len(set(firsts)) == 3, "a new order each epoch"
    for r in ranks:
        assert r["resumed"] == r["full"][19:], "resumed at step 19: the same batches as the uninterrupted run"


@pytest.mark.timeout(400)
def test_trainer_over_a_loader_resumes_from_a_checkpoint(frameworks_pack: Path, tmp_path: Path) -> None:
    """``get_train_dataloader()`` returning ``make_loader(...)``: the Trainer's epochs are the loader's plan
    (every sample once per epoch, the epoch the Trainer sets), and ``resume_from_checkpoint`` at step 19
    (mid-epoch 1) sees exactly the uninterrupted run's batches from there (accelerate's
    ``skip_first_batches``, imported by name into transformers.trainer, skips in the loader)."""
    ranks = launch(frameworks_pack, tmp_path, "loader")
    full = [r["full"] for r in ranks]
    for e in range(3):
        per_rank = [f[PER_RANK_BATCHES * e : PER_RANK_BATCHES * (e + 1)] for f in full]
        assert_epoch(per_rank)
        for rank in range(2):
            want = stager_epoch(rank, e, data=frameworks_pack, seed=7, image_size=8, transform="train", decode="raw")
            assert per_rank[rank] == want, f"rank {rank} epoch {e}: the loader's plan"
    for r in ranks:
        assert len(r["full"]) == 3 * PER_RANK_BATCHES
        assert r["resumed"] == r["full"][19:], "resumed at step 19: the uninterrupted run's batches"


def test_sample_dataset_serves_the_loaders_samples(frameworks_pack: Path) -> None:
    ds = SampleDataset(frameworks_pack, image_size=8, transform="eval", staged=False)
    assert len(ds) == N
    loader = make_loader(frameworks_pack, 16, rank=0, world_size=1, shuffle=False, image_size=8, transform="eval",
                         staged=False)
    for batch in loader:
        for j, i in enumerate(batch["index"].tolist()):
            s = ds[i]
            assert (s["index"], s["key"], s["label"]) == (i, batch["key"][j], int(batch["label"][j]))
            assert torch.equal(s["image"], batch["image"][j].contiguous()), "same decode and transform"
    raw = SampleDataset(frameworks_pack, decode="raw", staged=False)
    src = frameworks_pack.parent / "src"
    assert raw[7]["image"] == (src / f"{raw[7]['key']}.JPEG").read_bytes()
    with pytest.raises(IndexError):
        ds[N]


def test_sample_dataset_in_dataloader_workers_covers_every_index(frameworks_pack: Path) -> None:
    ds = SampleDataset(frameworks_pack, image_size=8, transform="train", staged=False)
    dl = torch.utils.data.DataLoader(ds, batch_size=10, shuffle=True, num_workers=2,
                                     multiprocessing_context="fork", generator=torch.Generator().manual_seed(0))
    seen = np.concatenate([b["index"].numpy() for b in dl])
    assert sorted(seen.tolist()) == list(range(N))
    b = next(iter(dl))
    assert b["image"].shape == (10, 3, 8, 8) and b["image"].dtype == torch.uint8 and len(b["key"]) == 10


def test_sample_dataset_of_fields_and_clips_matches_the_loaders_batches(tmp_path: Path) -> None:
    from stager.pack import pack
    from tools.datagen import make_shapes, make_videos

    shapes = make_shapes(tmp_path / "shapes", train=10, val=2, size=48, seed=3)
    pack(shapes / "train.jsonl", tmp_path / "fields", "tar", fields="mask:mask,boxes:boxes,box_labels:box_labels",
         samples_per_shard=4)
    make_videos(tmp_path / "vid", sequences=2, frames=9, size=(24, 32), seed=1)
    pack(tmp_path / "vid" / "frames", tmp_path / "clips", "tar", clip_length=4, samples_per_shard=5)
    for name, size in (("fields", 32), ("clips", 16)):
        kw = {"image_size": size, "transform": "eval", "staged": False}
        ds = SampleDataset(tmp_path / name, **kw)
        batch = next(iter(make_loader(tmp_path / name, 64, rank=0, world_size=1, shuffle=False, **kw)))
        assert len(ds) == len(batch["index"])
        for j in range(len(ds)):
            s = ds[j]
            assert torch.equal(s["image"], batch["image"][j].contiguous()), (name, j)
            for k, v in s.items():
                if k != "image":
                    want = batch[k][j]
                    got = v.tolist() if hasattr(v, "tolist") else v
                    assert got == (want.tolist() if hasattr(want, "tolist") else want), (name, k)

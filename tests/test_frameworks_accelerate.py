"""Hugging Face Accelerate over stager loaders: ``accelerate launch`` of 2 CPU ranks (gloo), and in-process checks.

tests/frameworks/accelerate_run.py is what Accelerate's tutorials write: ``prepare(model, optimizer,
loader)``, ``accumulate()`` with ``gradient_accumulation_steps=3``, ``save_state``/``load_state`` with
``skip_first_batches`` for the mid-epoch resume, ``gather_for_metrics``, and
``prepare(DataLoader(ShardedDataset, batch_size=None))``. Invariants: every sample once per epoch
across the ranks (one padding repeat declared), equal batches, a new order each epoch, gradients
synced at every 3rd batch and at the epoch's last (``end_of_dataloader``), ``gather_for_metrics``
returning each sample exactly once and in the dataset's order (as over Accelerate's own DataLoader), and a
resumed run's batches equal to the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.common import PER_RANK_BATCHES, N, assert_epoch, free_port, load, python, run, script

pytest.importorskip("accelerate", reason="accelerate is in the test extra: make venv (tools/setup_venv.sh)")


@pytest.fixture(scope="module")
def launched(frameworks_pack: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("accelerate")
    # accelerate's own launcher (torchrun underneath); ACCELERATE_USE_CPU stands in for the GPUs of a node.
    run([python(), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
         script("accelerate_run.py"), str(frameworks_pack), str(out)], cwd=out, env={"ACCELERATE_USE_CPU": "1"})
    return load(out, "accelerate")


@pytest.mark.timeout(400)
def test_prepare_adopts_the_loader_and_accumulation_syncs_at_the_epochs_end(launched: list[dict[str, Any]]) -> None:
    train = [r["train"] for r in launched]
    assert all(t["adopted"] for t in train), "prepare() returns the stager loader itself"
    for e in ("0", "1", "2"):
        assert_epoch([t["seen"][e] for t in train])
        # 13 batches, 3 per step: steps end at batches 3, 6, 9, 12 and at the epoch's last (end_of_dataloader).
        assert [i + 1 for i, s in enumerate(train[0]["synced"][e]) if s] == [3, 6, 9, 12, 13], e
    assert len({tuple(t["seen"][e][0]) for t in train[:1] for e in ("0", "1", "2")}) == 3, "a new order each epoch"


@pytest.mark.timeout(400)
def test_save_state_load_state_and_skip_first_batches_resume_exactly(launched: list[dict[str, Any]]) -> None:
    for r in launched:
        full = r["train"]["seen"]
        mid, end = r["resume_mid"]["seen"], r["resume_end"]["seen"]
        assert mid["1"] == full["1"][19 - PER_RANK_BATCHES:] and mid["2"] == full["2"], "mid-epoch: skipped, not read"
        assert end == {"1": full["1"], "2": full["2"]}, "from an epoch's end: the next epoch, then on"


@pytest.mark.timeout(400)
def test_gather_for_metrics_drops_the_padding_and_sharded_datasets_are_not_split_again(
        launched: list[dict[str, Any]]) -> None:
    gathered = launched[0]["eval"]["gathered"]
    assert sorted(gathered) == list(range(N)), "each sample exactly once: the padding repeat dropped"
    assert launched[1]["eval"]["gathered"] == gathered
    # In the dataset's order, as Accelerate's own DataLoader gathers (predictions line up with the rows).
    assert launched[0]["eval"]["accelerate"] == list(range(N))
    assert gathered == launched[0]["eval"]["accelerate"]
    sharded = [r["sharded"] for r in launched]
    assert sharded[0]["type"] == "Loader"
    for e in ("0", "1"):
        assert_epoch([s["seen"][e] for s in sharded])  # all 203, not rank 0's share split in two
    assert sharded[0]["seen"]["0"] != sharded[0]["seen"]["1"]


# ---- in-process: one rank --------------------------------------------------------------------------------


@pytest.fixture
def accelerator() -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_skip_first_batches_is_absolute_and_reads_nothing_before(frameworks_pack: Path, accelerator: Any) -> None:
    from stager.loader import make_loader

    loader = accelerator.prepare(make_loader(frameworks_pack, 8, rank=0, world_size=2, decode="raw", staged=False))
    full = [b["index"].tolist() for b in loader]
    skipped = accelerator.skip_first_batches(loader, 5)
    assert len(skipped) == len(full) - 5
    # After a complete pass the next pass is the next epoch: skip 5 of epoch 1.
    nxt = [b["index"].tolist() for b in skipped]
    loader.set_epoch(1)
    assert nxt == [b["index"].tolist() for b in loader][5:]
    # A restored position at batch 5 is not skipped twice.
    fresh = accelerator.prepare(make_loader(frameworks_pack, 8, rank=0, world_size=2, decode="raw", staged=False))
    state = {**loader.state_dict(), "epoch": 0, "batches_done": 5}
    fresh.load_state_dict(state)
    assert [b["index"].tolist() for b in accelerator.skip_first_batches(fresh, 5)] == full[5:]
    assert fresh.stats()["batches"] == len(full) - 5, "the skipped batches were never read"


def test_a_sharded_dataset_refuses_accelerates_splitting_wrappers(frameworks_pack: Path) -> None:
    """Without stager's integration (accelerate imported after the dataset was built), accelerate's
    wrappers would split one rank's share again: refused in one line when they set the epoch."""
    from accelerate.data_loader import IterableDatasetShard

    from stager.errors import UsageError
    from stager.loader import ShardedDataset

    ds = ShardedDataset(frameworks_pack, 8, rank=0, world_size=2, decode="raw", staged=False, num_workers=None)
    with pytest.raises(UsageError, match="IterableDatasetShard would split a ShardedDataset") as e:
        IterableDatasetShard(ds, batch_size=1, num_processes=2, process_index=0).set_epoch(1)
    assert "\n" not in str(e.value)


def test_gather_remainder_counts_the_real_rows_of_the_last_gathered_batch(frameworks_pack: Path) -> None:
    from stager.loader import make_loader
    from stager.loader.frameworks.hooks import gather_remainder

    unshuffled = make_loader(frameworks_pack, 8, rank=0, world_size=2, shuffle=False, decode="raw", staged=False)
    assert gather_remainder(unshuffled) == 2 * 6 - 1  # last batches of 6 on both ranks, 1 repeat at the tail
    dropping = make_loader(frameworks_pack, 8, rank=0, world_size=2, drop_last=True, decode="raw", staged=False)
    assert gather_remainder(dropping) == 0
    shuffled = make_loader(frameworks_pack, 8, rank=0, world_size=2, decode="raw", staged=False, seed=1)
    assert gather_remainder(shuffled) in (0, 11)  # 11 only when the shuffle left the repeat at the tail


def test_prepare_turns_a_sharded_dataloader_into_the_loader_or_refuses_a_batched_one(frameworks_pack: Path,
                                                                                     accelerator: Any) -> None:
    from torch.utils.data import DataLoader

    from stager.errors import UsageError
    from stager.loader import Loader, ShardedDataset

    ds = ShardedDataset(frameworks_pack, 8, rank=1, world_size=2, decode="raw", staged=False, num_workers=None)
    loader = accelerator.prepare(DataLoader(ds, batch_size=None))
    assert isinstance(loader, Loader) and loader.dataset is ds and len(loader) == 13
    assert loader in accelerator._custom_objects, "registered for save_state/load_state"
    with pytest.raises(UsageError, match="SampleDataset") as e:  # what the HF Trainer would build over it
        accelerator.prepare(DataLoader(ds, batch_size=8))
    assert "\n" not in str(e.value)


def test_accelerate_imported_after_the_dataset_still_adopts_it(frameworks_pack: Path) -> None:
    """A ShardedDataset built before ``import accelerate`` (so stager's wrappers could not be installed yet):
    they are installed as accelerate's import completes, so ``prepare`` still gives the stager Loader over
    it, and accelerate keeps its own module loader (what importlib.resources and reloads use)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from torch.utils.data import DataLoader\n"
        "from stager.loader import Loader, ShardedDataset\n"
        "ds = ShardedDataset(sys.argv[1], 8, rank=0, world_size=2, decode='raw', staged=False, num_workers=None)\n"
        "assert 'accelerate' not in sys.modules\n"
        "import accelerate\n"
        "from accelerate import Accelerator\n"
        "loader = Accelerator(cpu=True).prepare(DataLoader(ds, batch_size=None))\n"
        "print(type(loader).__name__, isinstance(loader, Loader) and loader.dataset is ds,"
        " type(accelerate.__spec__.loader).__name__, type(accelerate.__loader__).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(frameworks_pack)], capture_output=True, text=True,
                         check=False, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["Loader", "True", "SourceFileLoader", "SourceFileLoader"], out.stdout

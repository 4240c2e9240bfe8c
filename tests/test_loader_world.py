"""Rank and world size wherever a loader is built or used: 2 spawned ranks on gloo, plain torch.distributed.

What the frameworks do to a loader, without the frameworks: a loader built in the parent (rank 0 of
1) and pickled into the ranks (Lightning's ``ddp_spawn``), built before ``init_process_group``, built
under Lightning's partial environment (WORLD_SIZE without RANK), a bare ShardedDataset in the user's
own DataLoader. Invariants: the initialised process group wins; a detected world follows it (every
sample once per epoch across the ranks, the order stager's plan gives rank r of 2); an explicit world
is kept; a state loaded for the old world is refused in one line; a missing RANK without a process
group is a one-line error that names the variables.
"""

from __future__ import annotations

import json
import os
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from stager.errors import UsageError
from stager.loader import Loader, ShardedDataset, make_loader
from stager.world import World
from tests.frameworks.common import N, assert_epoch, free_port, stager_epoch

KW: dict[str, Any] = {"decode": "raw", "staged": False, "seed": 11}


def _ids(loader: Any) -> list[list[int]]:
    return [b["index"].tolist() for b in loader]


def _pairs(loader: Any) -> list[list[list[int]]]:
    return [[b["stream"].tolist(), b["index"].tolist()] for b in loader]


def _rank_main(rank: int, port: int, data: str, out: str, pickled: bytes,  # noqa: PLR0917 (start_processes' args)
               state: dict[str, Any], mix: list[str]) -> None:
    parent: Loader = pickle.loads(pickled)  # as ddp_spawn hands a DataModule's loader to its ranks
    res: dict[str, Any] = {}
    os.environ["WORLD_SIZE"] = "2"  # a launcher's size without its RANK (and no LOCAL_RANK)
    try:
        make_loader(data, 8, **KW)
        res["before_init"] = "built"
    except UsageError as e:
        res["before_init"] = str(e)
    del os.environ["WORLD_SIZE"]
    early = make_loader(data, 8, num_workers=1, **KW)  # no launcher variables: one rank of one, for now
    stale = make_loader(data, 8, **KW)
    stale.load_state_dict(state)
    bare = ShardedDataset(data, 8, num_workers=None, **KW)
    early_mix = make_loader(mix, 8, **KW)  # a mix of two datasets, also built as one rank of one
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    os.environ["WORLD_SIZE"] = "2"
    res["after_init"] = _ids(make_loader(data, 8, **KW))  # the process group wins over the gap
    del os.environ["WORLD_SIZE"]
    res["parent"] = _ids(parent)
    res["early"] = _ids(early)
    res["early_world"] = [early.dataset.rank, early.dataset.world_size, early.stats()["rank"]]
    res["explicit"] = _ids(make_loader(data, 8, rank=0, world_size=1, **KW))
    res["mix"] = _pairs(early_mix)
    import torch.utils.data

    res["bare"] = _ids(torch.utils.data.DataLoader(bare, batch_size=None, num_workers=1,
                                                   multiprocessing_context="fork"))
    try:
        len(stale)
        res["stale"] = "accepted"
    except UsageError as e:
        res["stale"] = str(e)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_the_process_group_decides_wherever_the_loader_was_built(frameworks_pack: Path, mix_sets: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    parent = make_loader(frameworks_pack, 8, num_workers=1, **KW)  # the parent's world: rank 0 of 1
    assert (parent.dataset.rank, parent.dataset.world_size) == (0, 1)
    mid = make_loader(frameworks_pack, 8, **KW)
    it = iter(mid)
    for _ in range(3):
        next(it)
    state = mid.state_dict()
    out = tmp_path / "out.json"
    # Forked (cheap: torch is imported) but with the parent's loader pickled, as a spawned rank receives it.
    mix = [str(mix_sets["tar"]), str(mix_sets["record"])]
    mp.start_processes(_rank_main, args=(free_port(), str(frameworks_pack), str(out), pickle.dumps(parent), state,
                                         mix), nprocs=2, join=True, start_method="fork")
    ranks = json.loads(out.read_text())
    msg = ranks[0]["before_init"]
    assert "WORLD_SIZE=2" in msg and "RANK" in msg and "\n" not in msg, msg
    want = {w: [stager_epoch(r, 0, data=frameworks_pack, num_workers=w, **KW) for r in range(2)] for w in (0, 1)}
    for name, workers in (("after_init", 0), ("parent", 1), ("early", 1), ("bare", 1)):
        got = [r[name] for r in ranks]
        assert_epoch(got)
        assert got == want[workers], f"{name}: stager's plan of rank r of 2"
    assert [r["early_world"] for r in ranks] == [[0, 2, 0], [1, 2, 1]], "dataset and stats follow the group"
    assert [r["mix"] for r in ranks] == [_pairs(make_loader(mix, 8, rank=r, world_size=2, **KW)) for r in range(2)], \
        "a mix built as one rank of one re-plans as rank r of 2"
    for r in ranks:
        assert sorted(i for b in r["explicit"] for i in b) == list(range(N)), "an explicit world of one is kept"
        assert "loaded before the process group" in r["stale"] and "\n" not in r["stale"], r["stale"]


def test_an_initialised_group_wins_over_the_environment_in_detect() -> None:
    """World.detect's order, with Lightning's launcher variables as the environment (no group: env only)."""
    env = {"WORLD_SIZE": "4", "NODE_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    w = World.detect(env=env)
    assert (w.rank, w.world_size, w.node, w.num_nodes, w.local_rank, w.source) == (3, 4, 1, 2, 1, "lightning")
    w0 = World.detect(env={"WORLD_SIZE": "2", "LOCAL_RANK": "0", "NODE_RANK": "0"})
    assert (w0.rank, w0.world_size) == (0, 2)
    with pytest.raises(UsageError, match="LOCAL_WORLD_SIZE") as e:
        World.detect(env={"WORLD_SIZE": "4", "NODE_RANK": "1", "LOCAL_RANK": "0"})
    assert "\n" not in str(e.value)

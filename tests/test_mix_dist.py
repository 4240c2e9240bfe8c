"""A mix under real torch.distributed (issue 31): 2 spawned ranks on gloo/localhost, rank and world size taken
from the process group, DDP lockstep (one all_reduce per batch: unequal batch counts would hang and trip
the timeout), DataLoader workers 0 and 2, three compositions.

All ranks' (stream, index) pairs are gathered on rank 0 and checked here: every drawn item read, only
padding repeated, the same batch sizes on every rank, per_stream batches of one stream on all ranks at
each step, and epochs that differ but repeat for the same epoch.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_loader_dist import _free_port

WORLD = 2
CONFIGS = [
    {"composition": "random", "workers": 2, "batch": 7},
    {"composition": "stratified", "workers": 0, "batch": 5},
    {"composition": "per_stream", "workers": 2, "batch": 6},
]


def _rank_main(rank: int, port: int, mix: str, out: str) -> None:
    from stager.loader import make_loader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    results: list[Any] = []
    for cfg in CONFIGS:
        loader = make_loader(mix, cfg["batch"], num_workers=cfg["workers"], composition=cfg["composition"],
                             decode="raw", seed=5, staged=False, multiprocessing_context="fork")
        epochs: dict[str, list[Any]] = {}
        for epoch in (0, 1, 0):
            loader.set_epoch(epoch)
            batches = []
            for b in loader:
                batches.append((b["stream"].tolist(), b["index"].tolist()))
                t = torch.tensor([len(b["key"])], dtype=torch.int64)
                dist.all_reduce(t)
            epochs.setdefault(str(epoch), []).append(batches)
        ds = loader.dataset
        draws = {str(e): [ds.stream_sequence(i, e).tolist() for i in range(len(ds.members))] for e in (0, 1)}
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, {"epochs": epochs, "rank": loader.stats()["rank"], "draws": draws,
                                          "padded": loader.stats()["padded"] // 3})
        loader.close()
        results.append({"cfg": cfg, "ranks": gathered})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_a_mix_under_ddp(mix_sets: dict[str, Path], tmp_path: Path) -> None:
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"streams:\n  - {{path: {mix_sets['tar']}, weight: 2}}\n"
                   f"  - {{path: {mix_sets['record']}, weight: 1}}\n  - {{path: {mix_sets['wds']}, repeat: 0.5}}\n")
    out = tmp_path / "result.json"
    mp.spawn(_rank_main, args=(_free_port(), str(mix), str(out)), nprocs=WORLD, join=True)
    for res in json.loads(out.read_text()):
        cfg, ranks = res["cfg"], res["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for e in ("0", "1"):
            sizes = {tuple(len(s) for s, _ in r["epochs"][e][0]) for r in ranks}
            assert len(sizes) == 1, f"{cfg}: unequal batches across ranks"
            got = Counter((s, i) for r in ranks for ss, ii in r["epochs"][e][0] for s, i in zip(ss, ii, strict=True))
            want = Counter((s, i) for s, seq in enumerate(ranks[0]["draws"][e]) for i in seq)
            assert not (want - got), f"{cfg}: every drawn item is read"
            assert sum((got - want).values()) == sum(r["padded"] for r in ranks) <= 3 * (WORLD - 1)
            if cfg["composition"] == "per_stream":
                steps = [[ss[0] for ss, _ in r["epochs"][e][0]] for r in ranks]
                assert steps[0] == steps[1] and all(len(set(ss)) == 1 for r in ranks for ss, _ in r["epochs"][e][0])
        for r in ranks:
            assert r["epochs"]["0"][0] == r["epochs"]["0"][1], "the order of an epoch is reproducible"
            assert r["epochs"]["0"][0] != r["epochs"]["1"][0], "epochs differ"

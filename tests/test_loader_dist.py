"""The loader under real torch.distributed: 3 spawned ranks on gloo/localhost, rank and world size
detected from the process group, DataLoader workers 0-3, 1,001 samples, batch 7.

Each rank runs a DDP-style loop (one all_reduce per batch, so unequal batch counts would hang and
trip the timeout) and all ranks' sample ids are gathered on rank 0, which writes them to a JSON file
for the assertions here.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stager.pack import pack
from tools.datagen import make_imagefolder

N, WORLD = 1001, 3
CONFIGS = [
    {"batch": 7, "workers": 0, "drop_last": False, "shuffle": True},
    {"batch": 7, "workers": 3, "drop_last": False, "shuffle": True},
    {"batch": 5, "workers": 2, "drop_last": True, "shuffle": True},
    {"batch": 7, "workers": 1, "drop_last": False, "shuffle": False},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, data: str, out: str) -> None:
    from stager.loader import make_loader

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    results: list[dict[str, Any]] = []
    for cfg in CONFIGS:
        loader = make_loader(
            data,
            cfg["batch"],
            num_workers=cfg["workers"],
            drop_last=cfg["drop_last"],
            shuffle=cfg["shuffle"],
            decode="raw",
            seed=123,
            staged=False,
            # A spawned rank's default start method is spawn (a full interpreter per worker and
            # epoch: slow on a 2-core CI box); fork is what torch uses on Linux by default.
            # test_loader_e2e covers spawn-started workers.
            multiprocessing_context="fork",
        )
        epochs = {}
        for epoch in (0, 1, 0):
            loader.set_epoch(epoch)
            ids: list[list[int]] = []
            for batch in loader:
                ids.append(batch["index"].tolist())
                t = torch.tensor([len(batch["key"])], dtype=torch.int64)
                dist.all_reduce(t)  # DDP lockstep: every rank must reach every batch
            epochs.setdefault(str(epoch), []).append(ids)
        st = loader.stats()
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(
            gathered,
            {
                "epochs": epochs,
                "len": len(loader),
                "padded": st["padded"],
                "dropped": st["dropped"],
                "rank": st["rank"],
            },
        )
        results.append({"cfg": cfg, "ranks": gathered})
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def packed_tar(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("loader_dist")
    make_imagefolder(base / "src", num_classes=7, per_class=N // 7, seed=5, size=(10, 8))
    pack(base / "src", base / "tar", "tar", samples_per_shard=40)
    return base / "tar"


@pytest.mark.timeout(240)
def test_ddp_partition_invariants(packed_tar: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    mp.spawn(_rank_main, args=(_free_port(), str(packed_tar), str(out)), nprocs=WORLD, join=True)
    results = json.loads(out.read_text())
    for res in results:
        cfg, ranks = res["cfg"], res["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2], "rank detected from torch.distributed"
        lens = {r["len"] for r in ranks}
        assert len(lens) == 1, f"{cfg}: unequal batch counts {lens}"
        for e in ("0", "1"):
            counts = {len(r["epochs"][e][0]) for r in ranks}
            assert counts == lens, cfg
            flat = [i for r in ranks for b in r["epochs"][e][0] for i in b]
            padded = sum(r["padded"] for r in ranks) // 3  # stats accumulate over the 3 passes
            if cfg["drop_last"]:
                assert len(flat) == len(set(flat)), "drop_last never repeats"
                assert len(flat) == N - ranks[0]["dropped"]
                assert all(len(b) == cfg["batch"] for r in ranks for b in r["epochs"][e][0])
            else:
                assert set(flat) == set(range(N)), f"{cfg}: every sample at least once"
                assert len(flat) == N + padded and padded == 3 * 334 - N
        for r in ranks:
            e0, e1, e0_again = r["epochs"]["0"][0], r["epochs"]["1"][0], r["epochs"]["0"][1]
            assert e0 == e0_again, f"{cfg}: epoch order is reproducible"
            if cfg["shuffle"]:
                assert e0 != e1, f"{cfg}: epochs differ"
            else:
                assert e0 == e1

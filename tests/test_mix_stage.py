"""Staging a mix (issue 31): ``stager stage MIX.yaml DEST`` plain, ``--partition`` and ``--collective``, and the
loader finding every stream's copy (a stream without one is read from its source, with a warning).

Data: the session's ``mix_sets``. The collective run is two real ``stager stage --collective`` processes
on localhost (gloo), whose reads of SRC are counted through tests/test_collective.py's ``countfs``.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.cli import main
from stager.loader import make_loader
from stager.manifest import load_manifest
from stager.order.partition import assign_shards_to_nodes
from stager.receipt import MIX_RECEIPT_NAME, load_receipt
from tests.test_collective import _finish, _launch, _src_reads


def write_mix(path: Path, streams: list[dict[str, Any]], **extra: Any) -> Path:
    path.write_text(json.dumps({"streams": streams, **extra}))
    return path


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any, str]:
    rc = main(["stage", *args])
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return rc, json.loads(lines[-1]) if lines else None, err


def read_all(loader: Any) -> Counter[tuple[int, int]]:
    got: Counter[tuple[int, int]] = Counter()
    for b in loader:
        got.update(zip(b["stream"].tolist(), b["index"].tolist(), strict=True))
    return got


def draws(loader: Any, epoch: int = 0) -> Counter[tuple[int, int]]:
    ds = loader.dataset
    return Counter((i, int(x)) for i in range(len(ds.members)) for x in ds.stream_sequence(i, epoch).tolist())


def test_stage_a_mix_and_the_loader_reads_every_staged_stream(
    mix_sets: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    mix = write_mix(tmp_path / "mix.json", [{"path": str(mix_sets["tar"]), "weight": 2},
                                           {"path": str(mix_sets["record"]), "weight": 1},
                                           {"path": str(mix_sets["wds"]), "samples": 10}])
    root = tmp_path / "nodelocal"
    dest = root / "mixdest"  # DEST under a staging root: found through its mix receipt
    rc, res, _ = cli(capsys, str(mix), str(dest), "--json")
    assert rc == 0 and res["ok"] and [s["name"] for s in res["streams"]] == ["tar", "record", "wds"]
    assert res["mix_receipt"] == str(dest / MIX_RECEIPT_NAME) and (dest / MIX_RECEIPT_NAME).is_file()
    for name in ("tar", "record", "wds"):
        rec = load_receipt(dest / name)
        assert rec is not None and rec.dataset_id == load_manifest(mix_sets[name]).dataset_id
    kw: dict[str, Any] = {"rank": 0, "world_size": 1, "decode": "raw", "staging_roots": (str(root),)}
    ld = make_loader(mix, 8, **kw)
    st = ld.stats()
    assert st["staged"] and {n: s["reading_from"] for n, s in st["streams"].items()} == {
        n: str(dest / n) for n in ("tar", "record", "wds")}
    assert read_all(ld) == draws(ld)
    rc, res, _ = cli(capsys, str(mix), str(dest), "--json")
    assert rc == 0 and all(s["already_staged"] for s in res["streams"])
    # one stream's copy gone: read from its source, with a warning naming it
    shutil.rmtree(dest / "record")
    caplog.set_level(logging.INFO, logger="stager.loader")
    ld = make_loader(mix, 8, **kw)
    assert ld.stats()["streams"]["record"]["reading_from"] == str(mix_sets["record"])
    assert any(r.levelno == logging.WARNING and "stream 'record' has no staged copy" in r.message
               for r in caplog.records)
    assert read_all(ld) == draws(ld)
    # `stager clean DEST` removes every stream's copy (each by its receipt) and the mix receipt; a user's file stays
    (dest / "notes.txt").write_text("mine")
    assert main(["clean", str(dest), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"] and MIX_RECEIPT_NAME in res["removed"] and any(r.startswith("tar/") for r in res["removed"])
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]
    from stager.commands import clean as clean_cmd

    assert clean_cmd.MIX_RECEIPT_NAME == MIX_RECEIPT_NAME


def test_stage_a_mix_partitioned_over_two_nodes(mix_sets: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    mix = write_mix(tmp_path / "mix.json", [{"path": str(mix_sets["tar"]), "weight": 1},
                                           {"path": str(mix_sets["hdf5"]), "repeat": 2}],
                    composition="stratified")
    for node in (0, 1):
        rc, res, err = cli(capsys, str(mix), str(tmp_path / f"node{node}" / "mix"), "--partition", "--node",
                           str(node), "--num-nodes", "2", "--ranks-per-node", "2", "--json")
        assert rc == 0, err
        assert all(s["mode"] == "partition" for s in res["streams"])
    got: Counter[tuple[int, int]] = Counter()
    lens = set()
    for r in range(4):
        ld = make_loader(mix, 5, rank=r, world_size=4, decode="raw", staging_roots=(str(tmp_path / f"node{r // 2}"),))
        assert all(s["staged"] for s in ld.stats()["streams"].values())
        mine = read_all(ld)
        lens.add(len(ld))
        for i, name in enumerate(("tar", "hdf5")):
            m = load_manifest(mix_sets[name])
            starts = m.sample_starts()
            shards = assign_shards_to_nodes(m.shard_bytes, 2, 0)[r // 2]
            local = set(np.concatenate([np.arange(starts[s], starts[s + 1]) for s in shards]).tolist())
            assert {x for s, x in mine if s == i} <= local, "a rank reads only its node's shards"
        got += mine
    assert len(lens) == 1, "equal batch counts on every node"
    want = draws(ld)
    assert not (want - got)


def test_stage_a_mix_collectively_reads_each_source_byte_once(mix_sets: dict[str, Path], tmp_path: Path) -> None:
    mix = write_mix(tmp_path / "mix.json", [{"path": f"countfs://{mix_sets['tar']}", "weight": 1},
                                           {"path": f"countfs://{mix_sets['record']}", "weight": 1}])
    results = _finish(_launch(tmp_path, str(mix), 2, timeout=120))
    for rc, res, err in results:
        assert rc == 0, err
        assert [s["name"] for s in res["streams"]] == ["tar", "record"]
        assert all(s["collective"] for s in res["streams"])
    reads = _src_reads(tmp_path, 2)
    for name in ("tar", "record"):
        for s in load_manifest(mix_sets[name]).shards:
            assert reads.get(s.name, 0) == s.bytes, f"{name}/{s.name} read {reads.get(s.name, 0)} of {s.bytes} bytes"
    # the training job names the same datasets by their paths (countfs exists only in the staging processes)
    local = write_mix(tmp_path / "local.json", [{"path": str(mix_sets["tar"]), "weight": 1},
                                                {"path": str(mix_sets["record"]), "weight": 1}])
    for i in range(2):
        ld = make_loader(local, 8, rank=0, world_size=1, decode="raw", staging_roots=(str(tmp_path / f"dest{i}"),))
        assert ld.stats()["staged"]
        assert read_all(ld) == draws(ld)


def test_bad_mixes_on_the_command_line(mix_sets: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    bad = [
        ({"streams": [{"path": str(mix_sets["tar"]), "wieght": 1}]}, "unknown key 'wieght'"),
        ({"streams": [{"path": str(mix_sets["tar"]), "weight": -1}]}, "weight must be a positive finite number"),
        ({"streams": [str(mix_sets["tar"]), str(mix_sets["tar"])]}, "duplicate stream name 'tar'"),
        ({"streams": [str(mix_sets["tar"]), str(tmp_path / "gone")]}, "stream 'gone': "),
        ({"streams": []}, "'streams' must be a non-empty list"),
    ]
    for i, (doc, message) in enumerate(bad):
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(doc))
        rc, _, err = cli(capsys, str(path), str(tmp_path / "d"))
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    good = write_mix(tmp_path / "ok.json", [str(mix_sets["tar"])])
    rc, _, err = cli(capsys, str(good), str(tmp_path / "d"), "--follow", "--budget", "1G")
    assert rc == 2 and "--follow prefetches one dataset" in err
    rc, res, _ = cli(capsys, str(tmp_path / "bad0.json"), str(tmp_path / "d"), "--json")
    assert rc == 2 and res["ok"] is False and "unknown key" in res["error"]
    assert not (tmp_path / "d").exists(), "nothing half-written"
    assert sys.modules.get("stager.stage.mix") is not None

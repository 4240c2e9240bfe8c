"""End-to-end loader tests in one process: every format, resume, errors, staging, ImageFolder, URLs.

Data: 1,001 tiny JPEGs in 7 classes (143 each), packed in class order (``keep_order=True``) into
shards of 50 samples (21 shards, the last one short), once per format for the module; and the same
tree made into three SquashFS images by mksquashfs (gzip, fragments: the samples are read through
their inodes) and adopted with ``stager index --out`` (``squashfs-index``).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stager.errors import CorruptSampleError, ShardMissingError, UsageError, VerificationError
from stager.index import IndexOptions, index_dataset
from stager.loader import make_loader
from stager.manifest import load_manifest
from stager.pack import pack
from tools.bench.shuffle_quality import tv_metric
from tools.datagen import make_imagefolder

N, CLASSES = 1001, 7
FORMATS = ("tar", "record", "hdf5", "zarr", "squashfs", "squashfs-index")
HAVE_MKSQUASHFS = shutil.which("mksquashfs") is not None


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loader_src") / "train"
    make_imagefolder(root, num_classes=CLASSES, per_class=N // CLASSES, seed=3, size=(12, 10))
    return root


@pytest.fixture(scope="module")
def packed(src: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("loader_packed")
    out = {}
    for fmt in FORMATS:
        if fmt == "squashfs-index":
            out[fmt] = adopted_images(src, base / "images", base / fmt)
            continue
        resize = (8, 8) if fmt == "zarr" else None
        pack(src, base / fmt, fmt, samples_per_shard=50, keep_order=True, resize=resize)
        out[fmt] = base / fmt
    return out


def adopted_images(src: Path, images: Path, index: Path) -> Path:
    """The tree as three mksquashfs images (classes 0-2, 3-4, 5-6), indexed into ``index`` (``--out``)."""
    if not HAVE_MKSQUASHFS:
        pytest.skip("needs squashfs-tools: apt-get install squashfs-tools")
    classes = sorted(p.name for p in src.iterdir())
    images.mkdir()
    for i, part in enumerate((classes[:3], classes[3:5], classes[5:])):
        cmd = ["mksquashfs", *(str(src / c) for c in part), str(images / f"part-{i}.sqfs"), "-quiet", "-no-progress"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    index_dataset(images, index, IndexOptions())
    m = load_manifest(index)
    assert m.num_samples == N and {s.extents for s in m.shards} == {"inodes"}
    return index


def epoch_batches(loader: Any) -> list[list[int]]:
    return [b["index"].tolist() for b in loader]


def test_every_format_yields_each_sample_once(packed: dict[str, Path]) -> None:
    labels_by_key = None
    for fmt in FORMATS:
        loader = make_loader(packed[fmt], 64, rank=0, world_size=1, decode="uint8", image_size=16, staged=False)
        seen, keys = [], []
        for b in loader:
            assert b["image"].dtype == torch.uint8 and b["image"].shape[1:] == (
                (3, 8, 8) if fmt == "zarr" else (3, 16, 16)
            )
            assert b["label"].dtype == torch.int64 and len(b["key"]) == b["image"].shape[0]
            seen += b["index"].tolist()
            keys += list(zip(b["key"], b["label"].tolist(), strict=True))
        assert sorted(seen) == list(range(N)), fmt
        mapping = dict(keys)
        if labels_by_key is None:
            labels_by_key = mapping
        assert mapping == labels_by_key, "same keys and labels in every format"
        assert len(loader) == -(-N // 64)


def test_raw_and_pil_modes(packed: dict[str, Path], src: Path) -> None:
    loader = make_loader(packed["tar"], 100, rank=0, world_size=1, decode="raw", shuffle=False, staged=False)
    first = next(iter(loader))
    assert isinstance(first["image"][0], memoryview)
    key = first["key"][0]
    assert bytes(first["image"][0]) == (src / f"{key}.JPEG").read_bytes(), "raw bytes are the source file's bytes"
    # Through a worker the batch travels as one shared-memory buffer plus offsets, same bytes
    # (a slot of the worker's reused ring, stager.loader.shm).
    via = make_loader(
        packed["tar"], 100, rank=0, world_size=1, decode="raw", shuffle=False, staged=False, num_workers=1
    )
    b = next(iter(via))
    assert b["data"].dtype == torch.uint8 and b["offsets"].shape == (101,)
    assert [bytes(x) for x in b["image"]] == [bytes(x) for x in first["image"]]
    assert b["label"].dtype == torch.int64 and torch.equal(b["label"], first["label"])
    pil = make_loader(packed["hdf5"], 10, rank=0, world_size=1, decode="pil", shuffle=False, staged=False)
    img = next(iter(pil))["image"][0]
    assert img.mode == "RGB"


@pytest.mark.parametrize("decode", ["raw", "uint8"])
def test_worker_batches_held_by_the_consumer_are_never_overwritten(packed: dict[str, Path], decode: str) -> None:
    """Workers reuse shared-memory slots once a batch is released: holding every batch of an epoch
    (more than the ring's slots) must still give exactly the in-process batches, and the epoch
    leaves nothing behind in /dev/shm."""
    import glob

    # shuffle=False: the same (manifest) order with and without workers.
    kw: dict[str, Any] = {"rank": 0, "world_size": 1, "decode": decode, "staged": False, "shuffle": False}
    kw |= {"image_size": 8, "transform": "eval"} if decode == "uint8" else {}
    before = set(glob.glob("/dev/shm/stager-*"))
    held = list(make_loader(packed["tar"], 16, num_workers=2, multiprocessing_context="fork", **kw))
    assert len(held) > 2 * 16, "more batches held than the two rings have slots"
    ref = list(make_loader(packed["tar"], 16, num_workers=0, **kw))
    assert [b["index"].tolist() for b in held] == [b["index"].tolist() for b in ref]
    for got, want in zip(held, ref, strict=True):
        if decode == "raw":
            assert [bytes(x) for x in got["image"]] == [bytes(x) for x in want["image"]]
        else:
            assert got["image"].shape == want["image"].shape and torch.equal(got["image"], want["image"])
    assert set(glob.glob("/dev/shm/stager-*")) <= before
    # Released batches are reused: a second epoch consumed one batch at a time still matches.
    loader = make_loader(packed["tar"], 16, num_workers=2, multiprocessing_context="fork", **kw)
    loader.set_epoch(1)
    ref_loader = make_loader(packed["tar"], 16, num_workers=0, **kw)
    ref_loader.set_epoch(1)
    for got, want in zip(loader, ref_loader, strict=True):
        if decode == "raw":
            assert [bytes(x) for x in got["image"]] == [bytes(x) for x in want["image"]]
        else:
            assert torch.equal(got["image"], want["image"])


@pytest.mark.parametrize(("fmt", "workers"), [("tar", 2), ("record", 0), ("hdf5", 0), ("zarr", 1), ("squashfs", 2),
                                              ("squashfs-index", 2)])
def test_resume_mid_epoch_every_format(packed: dict[str, Path], fmt: str, workers: int) -> None:
    """A fresh loader given state_dict() after c batches yields exactly the rest (c = start/middle/last)."""
    kw: dict[str, Any] = {"rank": 1, "world_size": 3, "num_workers": workers, "decode": "raw", "seed": 11}
    kw |= {"staged": False, "shuffle_buffer": 40}
    ref = make_loader(packed[fmt], 7, **kw)
    ref.set_epoch(2)
    full = epoch_batches(ref)
    assert len(full) == len(ref) == 48  # ceil(1001 / 3) = 334 samples -> 48 batches of 7 (last 5)
    for cut in (0, len(full) // 2, len(full) - 1, len(full)):
        a = make_loader(packed[fmt], 7, **kw)
        a.set_epoch(2)
        it = iter(a)
        got = [next(it)["index"].tolist() for _ in range(cut)]
        state = a.state_dict()
        b = make_loader(packed[fmt], 7, **kw)
        b.load_state_dict(state)
        b.set_epoch(2)  # the usual training loop calls this; it keeps the loaded position
        rest = epoch_batches(b)
        assert got + rest == full, (fmt, cut)
        # Afterwards the loader moves on to the next epoch, identical to a fresh loader's.
        if cut == len(full) // 2:
            nxt = epoch_batches(b)
            fresh = make_loader(packed[fmt], 7, **kw)
            fresh.set_epoch(3)
            assert nxt == epoch_batches(fresh)


def test_resume_state_is_typed_and_checked(packed: dict[str, Path]) -> None:
    a = make_loader(packed["tar"], 8, rank=0, world_size=2, decode="raw", staged=False)
    it = iter(a)
    next(it)
    state = a.state_dict()
    assert state["version"] == 1 and state["batches_done"] == 1 and state["world_size"] == 2
    with pytest.raises(UsageError, match="seed"):
        make_loader(packed["tar"], 8, rank=0, world_size=2, seed=5, decode="raw", staged=False).load_state_dict(state)
    with pytest.raises(UsageError, match="global batch"):
        make_loader(packed["tar"], 8, rank=0, world_size=3, decode="raw", staged=False).load_state_dict(state)
    with pytest.raises(UsageError, match="version"):
        a.load_state_dict({**state, "version": 99})


@pytest.mark.parametrize("fmt", ["record", "squashfs-index"])  # byte ranges; samples decompressed by inode
def test_elastic_resume_same_global_batch(packed: dict[str, Path], fmt: str) -> None:
    """World 2 x batch 6 for 40 batches, then world 1 x batch 12: nothing repeated, nothing lost."""
    kw: dict[str, Any] = {"decode": "raw", "staged": False, "seed": 4, "shuffle_buffer": 30}
    consumed: list[int] = []
    state = None
    for r in range(2):
        old = make_loader(packed[fmt], 6, rank=r, world_size=2, num_workers=2, **kw)
        it = iter(old)
        for _ in range(40):
            consumed += next(it)["index"].tolist()
        state = old.state_dict()
    assert state is not None
    new = make_loader(packed[fmt], 12, rank=0, world_size=1, num_workers=1, **kw)
    new.load_state_dict(state)
    rest = [i for batch in epoch_batches(new) for i in batch]
    assert sorted(consumed + rest) == list(range(N))
    # The resumed epoch can itself be checkpointed and resumed (the state records its parent).
    again = make_loader(packed[fmt], 12, rank=0, world_size=1, num_workers=1, **kw)
    again.load_state_dict(state)
    it = iter(again)
    part = next(it)["index"].tolist()
    s2 = again.state_dict()
    third = make_loader(packed[fmt], 12, rank=0, world_size=1, num_workers=1, **kw)
    third.load_state_dict(s2)
    assert sorted(consumed + part + [i for b in epoch_batches(third) for i in b]) == list(range(N))


def test_shuffle_false_is_manifest_order(packed: dict[str, Path]) -> None:
    loaders = [
        make_loader(
            packed["tar"],
            7,
            rank=r,
            world_size=3,
            shuffle=False,
            decode="raw",
            num_workers=2 if r == 0 else 0,
            staged=False,
        )
        for r in range(3)
    ]
    per_rank = [[i for b in epoch_batches(ld) for i in b] for ld in loaders]
    assert per_rank[0] == list(range(334)) and per_rank[1] == list(range(334, 668))
    assert per_rank[2] == [*range(668, 1001), 0], "padding repeats the first sample"
    assert loaders[2].stats()["padded"] == 1 and loaders[0].stats()["padded"] == 0


def test_loader_order_is_the_plan_and_quality(packed: dict[str, Path]) -> None:
    """The loader yields the plan's batches; with a buffer of 20% of the set it is still well mixed.

    Runs of 4 samples (``run_bytes=1`` forces ``min_run``) and 200 samples of buffer per worker.
    """
    kw: dict[str, Any] = {"rank": 0, "world_size": 1, "decode": "raw", "staged": False, "shuffle_buffer": 200}
    kw["run_bytes"] = 1
    labels = load_manifest(packed["tar"]).shards
    lab = np.concatenate([s.labels for s in labels])
    shuffled = make_loader(packed["tar"], 10, num_workers=2, **kw)
    order = [i for b in epoch_batches(shuffled) for i in b]
    plan = shuffled.dataset.plan()
    assert order == np.concatenate(plan.batch_ids()).tolist()
    plain = [i for b in epoch_batches(make_loader(packed["tar"], 10, shuffle=False, **kw)) for i in b]
    rnd = np.random.default_rng(0).permutation(N)
    tv_default = tv_metric(lab[order], CLASSES, 100)
    tv_plain = tv_metric(lab[plain], CLASSES, 100)
    tv_random = tv_metric(lab[rnd], CLASSES, 100)
    assert tv_plain > 0.6, "a shard-order loader over class-ordered data is far from uniform"
    assert tv_default < tv_random + 0.1, (tv_default, tv_random)


def test_corrupt_sample_raises_or_skips(packed: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "tar"
    shutil.copytree(packed["tar"], d)
    m = load_manifest(d)
    shard = m.shards[3]
    victim_key = shard.keys[5]
    with open(d / shard.name, "r+b") as f:
        f.seek(int(shard.offsets[5]))
        f.write(b"\0" * 16)  # destroys the JPEG's SOI/APP0 markers, keeps the size
    loader = make_loader(d, 16, rank=0, world_size=1, decode="uint8", image_size=8, staged=False, num_workers=1)
    with pytest.raises(CorruptSampleError) as ei:
        epoch_batches(loader)
    assert shard.name in str(ei.value) and victim_key in str(ei.value)
    skip = make_loader(d, 16, rank=0, world_size=1, decode="uint8", image_size=8, staged=False, on_error="skip")
    batches = [b for b in skip]
    assert len(batches) == len(skip)
    assert sum(len(b["key"]) for b in batches) == N - 1
    st = skip.stats()
    assert st["skipped"] == 1 and st["skipped_keys"] == [victim_key]


def test_missing_and_truncated_shards_fail_before_iteration(packed: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "hdf5"
    shutil.copytree(packed["hdf5"], d)
    m = load_manifest(d)
    (d / m.shards[2].name).unlink()
    with pytest.raises(ShardMissingError, match=m.shards[2].name):
        make_loader(d, 8, rank=0, world_size=1, staged=False)
    shutil.copy(packed["hdf5"] / m.shards[2].name, d / m.shards[2].name)
    with open(d / m.shards[7].name, "r+b") as f:
        f.truncate(m.shards[7].bytes - 100)
    with pytest.raises(VerificationError, match=m.shards[7].name):
        make_loader(d, 8, rank=0, world_size=1, staged=False)


def test_imagefolder_tree_and_fsspec_urls(src: Path, packed: dict[str, Path]) -> None:
    loader = make_loader(src, 50, rank=1, world_size=2, decode="uint8", image_size=8, num_workers=2)
    got = [i for b in epoch_batches(loader) for i in b]
    other = [i for b in epoch_batches(make_loader(src, 50, rank=0, world_size=2, decode="raw")) for i in b]
    assert len(set(got) | set(other)) == N and len(got) == len(other) == 501
    url = make_loader("file://" + str(packed["tar"]), 64, rank=0, world_size=1, decode="raw", staged=False)
    assert sorted(i for b in epoch_batches(url) for i in b) == list(range(N))
    # memory:// (a real fsspec filesystem, not a local path): copy the packed tar set into it.
    import fsspec

    fs = fsspec.filesystem("memory")
    for p in packed["record"].iterdir():
        fs.pipe_file(f"/loader-test/{p.name}", p.read_bytes())
    mem = make_loader("memory://loader-test", 64, rank=0, world_size=1, decode="uint8", image_size=8, num_workers=2)
    assert sorted(i for b in epoch_batches(mem) for i in b) == list(range(N))
    assert mem.stats()["bytes"] > 0


def test_staged_copy_is_used_and_partition_is_respected(
    packed: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stager.stage import stage

    root = tmp_path / "nodelocal"
    dest = root / "full"
    stage(packed["tar"], dest)
    caplog.set_level(logging.INFO, logger="stager.loader")
    loader = make_loader(packed["tar"], 32, rank=0, world_size=1, decode="raw", staging_roots=(str(root),))
    assert loader.stats()["staged"] and loader.stats()["reading_from"] == str(dest)
    assert any("staged" in r.message for r in caplog.records)
    assert sorted(i for b in epoch_batches(loader) for i in b) == list(range(N))
    # Node partitions: 2 nodes x 2 ranks; each node staged only its shards.
    m = load_manifest(packed["tar"])
    from stager.order.partition import assign_shards_to_nodes

    groups = assign_shards_to_nodes(m.shard_bytes, 2, 0)
    node_dirs = [tmp_path / f"node{i}" for i in range(2)]
    for i, nd in enumerate(node_dirs):
        stage(packed["tar"], nd / "data", partition=True, node=i, num_nodes=2, ranks_per_node=2)
    seen: list[int] = []
    counts = []
    starts = m.sample_starts()
    for r in range(4):
        ld = make_loader(packed["tar"], 9, rank=r, world_size=4, decode="raw", staging_roots=(str(node_dirs[r // 2]),))
        assert ld.stats()["staged_mode"] == "partition"
        ids = [i for b in epoch_batches(ld) for i in b]
        counts.append(len(ld))
        local = np.concatenate([np.arange(starts[s], starts[s + 1]) for s in groups[r // 2]])
        assert set(ids) <= set(local.tolist()), "a rank reads only its node's shards"
        seen += ids
    assert len(set(counts)) == 1, "equal batch counts on every node"
    assert set(seen) == set(range(N))
    with pytest.raises(UsageError, match="node"):
        make_loader(packed["tar"], 9, rank=0, world_size=4, staging_roots=(str(node_dirs[1]),))


def test_spawned_workers(packed: dict[str, Path]) -> None:
    """The dataset pickles: workers started with spawn (Python 3.14's forkserver default) work."""
    kw: dict[str, Any] = {"rank": 0, "world_size": 1, "decode": "uint8", "transform": "train", "image_size": 8}
    ld = make_loader(packed["tar"], 128, num_workers=1, multiprocessing_context="spawn", staged=False, **kw)
    ref = make_loader(packed["tar"], 128, num_workers=1, staged=False, **kw)
    a, b = list(ld), list(ref)
    assert [x["index"].tolist() for x in a] == [x["index"].tolist() for x in b]
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(a, b, strict=True)), "augmentation is seeded"


def test_options_validated_once_and_make_loader_signature(packed: dict[str, Path]) -> None:
    """make_loader(path, **kw) is Loader(ShardedDataset(path, LoaderOptions(**kw))): the documented
    keyword signature (docs/loader.md) is LoaderOptions' fields; bad settings fail on construction;
    the ``ShardedDataset(path, batch_size, **settings)`` shorthand gives the same dataset."""
    import dataclasses
    import inspect

    from stager.loader import LoaderOptions, ShardedDataset

    params = inspect.signature(make_loader).parameters
    fields = {f.name: f.default for f in dataclasses.fields(LoaderOptions)}
    assert list(params)[1:] == list(fields)
    assert all(params[n].default == d for n, d in fields.items() if d is not dataclasses.MISSING)
    bad_settings = {"batch_size": 0, "on_error": "x", "shuffle": "rows", "run_bytes": 0, "num_workers": -1}
    for name, value in bad_settings.items():
        with pytest.raises(UsageError, match=name):
            LoaderOptions(**{"batch_size": 2, name: value})
    with pytest.raises(UsageError, match="unknown loader arguments: colour"):
        LoaderOptions.from_kwargs({"batch_size": 2, "colour": 1})
    a = ShardedDataset(packed["tar"], LoaderOptions(batch_size=8, world_size=2, rank=1, seed=4, staged=False))
    b = ShardedDataset(packed["tar"], 8, world_size=2, rank=1, seed=4, staged=False)
    assert a.options == b.options and [x.tolist() for x in a.plan().batch_ids()] == [
        x.tolist() for x in b.plan().batch_ids()
    ]
    with pytest.raises(TypeError):
        ShardedDataset(packed["tar"], LoaderOptions(batch_size=8), seed=3)

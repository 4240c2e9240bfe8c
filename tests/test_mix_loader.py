"""The loader over a mix of datasets (issue 31): every guarantee of the single-dataset loader, across streams.

Data: the session's ``mix_sets`` (tar, record, hdf5, zarr packs and an adopted webdataset set, 23-60
tiny samples each). Ranks are built in one process with explicit ``rank``/``world_size`` (the real
torch.distributed run is tests/test_mix_dist.py); the invariants are checked against the mix's own
draws (``dataset.stream_sequence``), not against examples.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stager.errors import ShardMissingError, SourceNotFoundError, UsageError
from stager.loader import Stream, make_loader, make_numpy_loader
from stager.mix import Mix
from tools.datagen import make_imagefolder

FIVE = ("tar", "record", "hdf5", "zarr", "wds")


def stream_ids(loader: Any) -> list[tuple[list[int], list[int]]]:
    """One epoch as ``(streams, ids)`` per batch."""
    out = []
    for b in loader:
        s, i = b["stream"], b["index"]
        out.append((np.asarray(s).tolist(), np.asarray(i).tolist()))
    return out


def tally(batches: list[tuple[list[int], list[int]]]) -> Counter[tuple[int, int]]:
    return Counter((s, i) for ss, ii in batches for s, i in zip(ss, ii, strict=True))


def draws(loader: Any, epoch: int) -> Counter[tuple[int, int]]:
    ds = loader.dataset
    return Counter((i, int(x)) for i in range(len(ds.members)) for x in ds.stream_sequence(i, epoch).tolist())


@pytest.mark.parametrize("composition", ["random", "stratified", "per_stream"])
def test_every_format_in_one_mix_each_draw_once_equal_batches(mix_sets: dict[str, Path], composition: str) -> None:
    mix = [(str(mix_sets[n]), w) for n, w in zip(FIVE, (3, 2, 1, 1, 1), strict=True)]
    world = 3
    for epoch in (0, 1):
        got: Counter[tuple[int, int]] = Counter()
        lens = set()
        pads = 0
        for r in range(world):
            # uint8: a zarr stream holds decoded arrays, the others encoded images (raw payloads differ)
            ld = make_loader(mix, 8, rank=r, world_size=world, image_size=8, composition=composition, staged=False,
                             seed=7)
            ld.set_epoch(epoch)
            batches = stream_ids(ld)
            lens.add((len(ld), tuple(len(s) for s, _ in batches)))
            got += tally(batches)
            pads += ld.stats()["padded"]
            want_layout = ld.dataset.mix_plan().batch_items()
            assert [(s.tolist(), i.tolist()) for s, i in want_layout] == batches, "the loader follows the plan"
        assert len(lens) == 1, "every rank has the same batches and sizes"
        want = draws(ld, epoch)
        assert not (want - got), "every drawn item is read"
        assert sum((got - want).values()) == pads <= len(FIVE) * (world - 1), "only padding repeats"
    # the shares are the weights' (largest remainders of the streams' total size)
    table = ld.dataset.epoch_table()
    total = sum(r["take"] for r in table)
    assert total == 60 + 40 + 26 + 30 + 23
    assert [r["take"] for r in table] == [pytest.approx(total * w / 8, abs=1) for w in (3, 2, 1, 1, 1)]


def test_batches_hold_stream_keys_labels_and_images(mix_sets: dict[str, Path]) -> None:
    ld = make_loader([str(mix_sets["tar"]), str(mix_sets["zarr"]), str(mix_sets["wds"])], 16, rank=0, world_size=1,
                     decode="uint8", image_size=8, staged=False, num_workers=2)
    from stager.loader.dataset_index import index_from_manifest
    from stager.manifest import load_manifest

    idx = [index_from_manifest(load_manifest(mix_sets[n])) for n in ("tar", "zarr", "wds")]
    n = 0
    for b in ld:
        assert b["stream"].dtype == torch.int64 and b["stream"].shape == b["label"].shape == (len(b["key"]),)
        assert b["image"].shape[1:] == (3, 8, 8) and b["image"].dtype == torch.uint8
        for s, i, key, label in zip(b["stream"].tolist(), b["index"].tolist(), b["key"], b["label"].tolist(),
                                    strict=True):
            assert idx[s].keys[i] == key and int(idx[s].labels[i]) == label
        n += len(b["key"])
    assert n == 60 + 30 + 23
    st = ld.stats()
    assert {k: v["samples"] for k, v in st["streams"].items()} == {"tar": 60, "zarr": 30, "wds": 23}
    assert sum(v["bytes"] for v in st["streams"].values()) == st["bytes"] > 0
    assert "stream" in ld.fields
    ld.close()


@pytest.mark.parametrize(("composition", "workers"), [("random", 2), ("stratified", 0), ("per_stream", 2)])
def test_resume_mid_epoch_is_exact(mix_sets: dict[str, Path], composition: str, workers: int) -> None:
    mix = [(str(mix_sets["tar"]), 2), (str(mix_sets["record"]), 1), Stream(str(mix_sets["hdf5"]), repeat=2)]
    kw: dict[str, Any] = {"rank": 1, "world_size": 2, "decode": "raw", "composition": composition, "staged": False,
                          "num_workers": workers, "seed": 3}
    full = make_loader(mix, 6, **kw)
    full.set_epoch(1)
    ref = stream_ids(full)
    part = make_loader(mix, 6, **kw)
    part.set_epoch(1)
    head = []
    for b in part:
        head.append((b["stream"].tolist(), b["index"].tolist()))
        if len(head) == 4:
            break
    state = part.state_dict()
    assert json.loads(json.dumps(state)) == state
    resumed = make_loader(mix, 6, **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert head + stream_ids(resumed) == ref
    # the next epoch follows as if never interrupted
    assert stream_ids(resumed)[:3] != ref[:3]
    # a state of another mix (other weights: other epoch takes) is refused, naming what differs
    other = make_loader([(str(mix_sets["tar"]), 1), *mix[1:]], 6, **kw)
    with pytest.raises(UsageError, match="dataset_id: state 'mix-"):
        other.load_state_dict(state)
    other.close()
    for ld in (full, part, resumed):
        ld.close()


def test_elastic_resume_at_another_world_size(mix_sets: dict[str, Path]) -> None:
    mix = [(str(mix_sets["tar"]), 1), (str(mix_sets["record"]), 1), Stream(str(mix_sets["wds"]), samples=30)]
    kw: dict[str, Any] = {"decode": "raw", "staged": False, "composition": "stratified", "seed": 9}
    old = [make_loader(mix, 6, rank=r, world_size=2, **kw) for r in range(2)]
    seen: Counter[tuple[int, int]] = Counter()
    for ld in old:
        ld.set_epoch(2)
        for k, b in enumerate(ld):
            seen += tally([(b["stream"].tolist(), b["index"].tolist())])
            if k == 2:
                break
    state = old[0].state_dict()
    new = [make_loader(mix, 4, rank=r, world_size=3, num_workers=1, **kw) for r in range(3)]
    lens = set()
    for ld in new:
        ld.load_state_dict(state)
        ld.set_epoch(2)
        lens.add(len(ld))
        seen += tally(stream_ids(ld))
    assert len(lens) == 1
    want = draws(old[0], 2)
    assert not (want - seen), "nothing lost"
    assert sum((seen - want).values()) <= 2 * 3 + 3 * 2, "only padding repeats"
    # an elastic run's state resumes again (its parent recorded)
    again = make_loader(mix, 4, rank=0, world_size=3, num_workers=1, **kw)
    again.load_state_dict(new[0].state_dict())


def test_torch_numpy_and_keras_transports_agree(mix_sets: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    mix = [(str(mix_sets["tar"]), 2), (str(mix_sets["hdf5"]), 1)]
    kw: dict[str, Any] = {"rank": 0, "world_size": 2, "decode": "uint8", "image_size": 8, "staged": False,
                          "num_workers": 2, "multiprocessing_context": "fork", "composition": "stratified"}
    tl = make_loader(mix, 5, **kw)
    nl = make_numpy_loader(mix, 5, **{**kw, "multiprocessing_context": "spawn"})  # the mix pickles into workers
    tb, nb = list(tl), list(nl)
    assert len(tb) == len(nb) == len(tl)
    for a, b in zip(tb, nb, strict=True):
        assert a["stream"].tolist() == b["stream"].tolist() and a["index"].tolist() == b["index"].tolist()
        assert isinstance(b["stream"], np.ndarray) and b["stream"].dtype == np.int64
        assert np.array_equal(a["image"].permute(0, 2, 3, 1).numpy(), b["image"])
    # a numpy state resumes the torch loader
    nl2 = make_numpy_loader(mix, 5, **kw)
    it = iter(nl2)
    next(it)
    next(it)
    state = nl2.state_dict()
    tl2 = make_loader(mix, 5, **kw)
    tl2.load_state_dict(state)
    assert [b["index"].tolist() for b in tl2] == [b["index"].tolist() for b in tb[2:]]
    monkeypatch.setenv("KERAS_BACKEND", "torch")  # tests/test_keras.py runs keras in subprocesses; here: torch
    from stager.loader.keras import KerasBatches

    kb = KerasBatches(make_numpy_loader(mix, 5, **{**kw, "num_workers": 0}), x="image", y=("label", "stream"))
    x, (_, s) = kb[0]
    assert x.shape == (5, 8, 8, 3) and s.dtype == np.int64 and len(kb) == len(tl)
    for ld in (tl, nl, nl2, tl2):
        ld.close()


def test_mix_files_yaml_and_json_relative_paths(mix_sets: dict[str, Path], tmp_path: Path) -> None:
    base = mix_sets["tar"].parent
    (base / "mix.yaml").write_text("composition: per_stream\nepoch_samples: 90\nstreams:\n"
                                   "  - {path: tar, weight: 2}\n  - {name: rec, path: record, weight: 1}\n"
                                   "  - {path: hdf5, samples: 12}\n")
    ld = make_loader(base / "mix.yaml", 6, rank=0, world_size=1, decode="raw", staged=False)
    assert [r["take"] for r in ld.dataset.epoch_table()] == [52, 26, 12]
    assert ld.dataset.names == ("tar", "rec", "hdf5") and ld.dataset.mix.composition == "per_stream"
    assert all(len(set(s)) == 1 for s, _ in stream_ids(ld))
    (tmp_path / "mix.json").write_text(json.dumps({"streams": [str(mix_sets["tar"]), {"path": str(mix_sets["hdf5"]),
                                                                                     "repeat": 0.5}]}))
    ld = make_numpy_loader(tmp_path / "mix.json", 6, rank=0, world_size=1, decode="raw", staged=False,
                           composition="random")
    assert [r["take"] for r in ld.dataset.epoch_table()] == [60, 13] and ld.dataset.mix.composition == "random"


def test_object_store_stream(mix_sets: dict[str, Path]) -> None:
    """A stream on an fsspec object store (memory://) beside a local one: read by ranged GETs."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for p in mix_sets["record"].iterdir():
        if p.is_file():
            fs.pipe_file(f"/mix-test/record/{p.name}", p.read_bytes())
    ld = make_loader([(str(mix_sets["tar"]), 1), ("memory://mix-test/record", 1)], 8, rank=0, world_size=1,
                     decode="uint8", image_size=8, num_workers=2, staged=False)
    got = tally(stream_ids(ld))
    assert got == draws(ld, 0)
    assert ld.stats()["streams"]["record"]["bytes"] > 0
    ld.close()


def test_staged_copies_are_found_and_a_missing_one_warns(mix_sets: dict[str, Path], tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from stager.stage import stage

    root = tmp_path / "nodelocal"
    stage(mix_sets["tar"], root / "tar")
    caplog.set_level(logging.INFO, logger="stager.loader")
    mix = [str(mix_sets["tar"]), str(mix_sets["hdf5"])]
    ld = make_loader(mix, 8, rank=0, world_size=1, decode="raw", staging_roots=(str(root),))
    st = ld.stats()
    assert st["streams"]["tar"]["staged"] and st["streams"]["tar"]["reading_from"] == str(root / "tar")
    assert not st["streams"]["hdf5"]["staged"] and not st["staged"]
    assert any(r.levelno == logging.WARNING and "'hdf5' has no staged copy" in r.message for r in caplog.records)
    assert tally(stream_ids(ld)) == draws(ld, 0)
    with pytest.raises(ShardMissingError, match=r"stream 'hdf5'.*no staged copy"):
        make_loader(mix, 8, rank=0, world_size=1, staging_roots=(str(root),), staged=True)


def test_common_fields_and_a_schema_mismatch(mix_sets: dict[str, Path],
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    from stager.pack import pack
    from tools.datagen import make_shapes

    shapes = make_shapes(tmp_path_factory.mktemp("mixshapes"), train=10, val=2, size=32, seed=5)
    base = tmp_path_factory.mktemp("mixfields")
    pack(shapes / "train.jsonl", base / "seg", "tar", fields="mask:mask,boxes:boxes,box_labels:box_labels",
         samples_per_shard=4)
    pack(shapes / "train.jsonl", base / "det", "record", fields="mask:mask,boxes:boxes,box_labels:box_labels",
         samples_per_shard=4, seed=1)
    pack(shapes / "train.jsonl", base / "odd", "tar", fields="mask:image", samples_per_shard=4, seed=2)
    # the fields both streams have, each batch's boxes per sample (one geometry per sample, whatever its stream)
    ld = make_loader([str(base / "seg"), str(base / "det")], 4, rank=0, world_size=1, image_size=16, staged=False,
                     fields=["boxes", "box_labels"])
    assert ld.fields[-2:] == ("boxes", "box_labels")
    n = 0
    for b in ld:
        assert "mask" not in b and len(b["boxes"]) == len(b["key"]) == len(b["box_labels"])
        assert all(isinstance(x, torch.Tensor) and x.shape[-1] == 4 for x in b["boxes"])
        n += len(b["key"])
    assert n == 20
    full = make_loader([str(base / "seg"), str(base / "det")], 4, rank=0, world_size=1, image_size=16, staged=False)
    b = next(iter(full))
    assert b["mask"].shape == (4, 16, 16) and set(b["stream"].tolist()) <= {0, 1}
    # a stream with no fields: the mix reads none (or says which stream lacks the one asked for)
    plain = make_loader([str(base / "seg"), str(mix_sets["tar"])], 4, rank=0, world_size=1, image_size=8)
    assert "mask" not in next(iter(plain)) and plain.fields[-1] == "stream"
    with pytest.raises(UsageError, match="field 'mask' is not in stream 'tar'"):
        make_loader([str(base / "seg"), str(mix_sets["tar"])], 4, rank=0, world_size=1, fields=["mask"])
    with pytest.raises(UsageError, match=r"field 'mask' differs between streams 'seg' \(mask.*and 'odd' \(image"):
        make_loader([str(base / "seg"), str(base / "odd")], 4, rank=0, world_size=1)


def test_bad_mixes_are_one_line_errors(mix_sets: dict[str, Path], tmp_path: Path) -> None:
    tar, rec = str(mix_sets["tar"]), str(mix_sets["record"])
    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda: [(tar, 1), (str(tmp_path / "nope"), 1)], SourceNotFoundError, "stream 'nope': .*no such file"),
        (lambda: [(tar, 1), (tar + "/manifest.json", 1)], UsageError, "duplicate stream name 'tar'"),
        (lambda: [Stream(tar, name="a"), Stream(tar + "/", name="b")], UsageError,
         "duplicate stream: 'a' and 'b' both read"),
        (lambda: [(tar, 0)], UsageError, "stream 'tar': weight must be a positive finite number, got 0"),
        (lambda: [(tar, -1.5)], UsageError, "weight must be a positive finite number, got -1.5"),
        (lambda: [(tar, "heavy")], UsageError, "got 'heavy'"),
        (lambda: [(tar, True)], UsageError, "got True"),
        (lambda: [(tar, float("nan"))], UsageError, "got nan"),
        (lambda: [{"path": tar, "samples": 2.5}], UsageError, "samples must be a positive integer"),
        (lambda: [Stream(tar, weight=1, repeat=2)], UsageError,
         "give one of weight, samples or repeat, not weight and repeat"),
        (lambda: [{"path": tar, "wieght": 2}], UsageError, "unknown key 'wieght'"),
        (lambda: Mix((Stream(tar),), composition="zip"), UsageError, "unknown composition 'zip'"),
    ]
    for mix, exc, pattern in cases:
        with pytest.raises(exc, match=pattern) as info:
            make_loader(mix(), 4, rank=0, world_size=1, staged=False)
        assert "\n" not in str(info.value)
    # the same dataset under two paths (a copy): same dataset id
    import shutil

    shutil.copytree(mix_sets["record"], tmp_path / "copy")
    with pytest.raises(UsageError, match="'record' and 'copy' are the same dataset"):
        make_loader([rec, str(tmp_path / "copy")], 4, rank=0, world_size=1, staged=False)
    with pytest.raises(UsageError, match="stream 'wds' has 23 samples, fewer than the 24 ranks"):
        make_loader([tar, str(mix_sets["wds"])], 4, rank=0, world_size=24, staged=False)
    with pytest.raises(UsageError, match="stream 'record' gives 2 samples per epoch, fewer than the 4 ranks"):
        make_loader([tar, Stream(rec, samples=2)], 4, rank=0, world_size=4, staged=False)
    with pytest.raises(UsageError, match="'zarr' stores decoded samples, stream 'tar' encoded"):
        make_loader([tar, str(mix_sets["zarr"])], 4, rank=0, world_size=1, decode="raw", staged=False)
    with pytest.raises(UsageError, match="composition='stratified' applies to a mix"):
        make_loader(tar, 4, rank=0, world_size=1, composition="stratified")
    (tmp_path / "bad.yaml").write_text("streams:\n  - path: tar\n    weight: [1\n")
    with pytest.raises(UsageError, match=r"bad\.yaml: not valid YAML at line"):
        make_loader(tmp_path / "bad.yaml", 4, rank=0, world_size=1)


def test_a_mix_of_clip_packs(mix_sets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Streams of windows (docs/clips.md) mix like streams of images; another window length does not."""
    from stager.pack import pack
    from tools.datagen import make_videos

    base = tmp_path_factory.mktemp("mixclips")
    for i, (fmt, t) in enumerate((("tar", 4), ("record", 4), ("tar", 3))):
        make_videos(base / f"src{i}", sequences=2, frames=10, size=(16, 20), seed=i)
        pack(base / f"src{i}" / "frames", base / f"c{i}", fmt, clip_length=t, samples_per_shard=7)
    ld = make_loader([(str(base / "c0"), 1), (str(base / "c1"), 2)], 3, rank=1, world_size=2, image_size=8,
                     transform="eval", staged=False, num_workers=2, composition="stratified")
    got: Counter[tuple[int, int]] = Counter()
    for b in ld:
        assert b["image"].shape[1:] == (4, 3, 8, 8) and len(b["sequence"]) == len(b["start_frame"]) == len(b["key"])
        got.update(zip(b["stream"].tolist(), b["index"].tolist(), strict=True))
    other = make_loader([(str(base / "c0"), 1), (str(base / "c1"), 2)], 3, rank=0, world_size=2, image_size=8,
                        staged=False, composition="stratified")
    got += tally(stream_ids(other))
    assert not (draws(ld, 0) - got)
    with pytest.raises(UsageError, match="stream 'c2' holds clips of 3 frames, stream 'c0' clips of 4 frames"):
        make_loader([str(base / "c0"), str(base / "c2")], 3, rank=0, world_size=1)
    with pytest.raises(UsageError, match="stream 'tar' holds images, stream 'c0' clips of 4 frames"):
        make_loader([str(base / "c0"), str(mix_sets["tar"])], 3, rank=0, world_size=1)
    ld.close()


def test_tf_data_over_a_mix(mix_sets: dict[str, Path]) -> None:
    tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed here (docs/training.md)")
    from stager.loader.tfdata import tf_dataset

    ld = make_numpy_loader([str(mix_sets["tar"]), str(mix_sets["hdf5"])], 8, rank=0, world_size=1, image_size=8,
                           staged=False)
    n = 0
    for x, s in tf_dataset(ld, x="image", y="stream"):
        assert x.shape[1:] == (8, 8, 3) and s.dtype == tf.int64
        n += int(x.shape[0])
    assert n == 60 + 26


@pytest.mark.parametrize(("composition", "workers"), [("random", 0), ("stratified", 2)])
def test_a_corrupt_sample_in_one_stream_is_skipped_or_raised(mix_sets: dict[str, Path], tmp_path: Path,
                                                             composition: str, workers: int) -> None:
    """on_error="skip" in a mix: the damaged sample alone is dropped (named in stats), every other draw is
    read once, and each place's key, label, index and stream still belong together; "raise" names it."""
    import shutil

    from stager.errors import CorruptSampleError
    from stager.loader.dataset_index import index_from_manifest
    from stager.manifest import load_manifest

    tar = tmp_path / "tar"
    shutil.copytree(mix_sets["tar"], tar)
    m = load_manifest(tar)
    shard = m.shards[2]
    victim = shard.keys[3]
    with open(tar / shard.name, "r+b") as f:
        f.seek(int(shard.offsets[3]))
        f.write(b"\0" * 16)  # the JPEG's markers gone, the size kept
    mix = [(str(tar), 2), (str(mix_sets["record"]), 1), (str(mix_sets["wds"]), 1)]
    idx = [index_from_manifest(load_manifest(p)) for p, _ in mix]
    kw = dict(rank=0, world_size=1, decode="uint8", image_size=8, staged=False, composition=composition,
              num_workers=workers, seed=3)
    with pytest.raises(CorruptSampleError, match=victim):
        for _ in make_loader(mix, 8, **kw):
            pass
    ld = make_loader(mix, 8, on_error="skip", **kw)
    got: Counter[tuple[int, int]] = Counter()
    for b in ld:
        n = len(b["key"])
        assert b["stream"].shape == b["label"].shape == b["index"].shape == (n,) and b["image"].shape[0] == n
        for s, i, key, label in zip(b["stream"].tolist(), b["index"].tolist(), b["key"], b["label"].tolist(),
                                    strict=True):
            assert idx[s].keys[i] == key and int(idx[s].labels[i]) == label
        got += Counter(zip(b["stream"].tolist(), b["index"].tolist(), strict=True))
    want = draws(ld, 0)
    lost = want - got
    assert list(lost) == [(0, list(idx[0].keys).index(victim))], "only the damaged sample is missing"
    assert not (got - want)
    st = ld.stats()
    assert st["skipped"] == sum(lost.values()) and st["skipped_keys"][0] == victim
    ld.close()


@pytest.mark.parametrize("streams", [1, 3, 12])
def test_window_and_gather_orders_are_the_stable_sorts(streams: int) -> None:
    """The mix's per-window orders (stager.loader.mix.feed) equal their definitions by stable argsort, for
    random layouts with uneven batches and streams absent from some batches or the whole window."""
    from stager.loader.mix.feed import gather_order, window_order

    rng = np.random.default_rng(streams)
    for _ in range(20):
        sizes = rng.integers(1, 40, rng.integers(1, 9))
        used = rng.choice(streams, size=max(1, streams - 1), replace=False)  # one stream may be missing
        slots = rng.choice(used, size=int(sizes.sum())).astype(np.int32)
        batch = np.repeat(np.arange(len(sizes)), sizes)
        counts = np.zeros((len(sizes), streams), dtype=np.int64)
        np.add.at(counts, (batch, slots), 1)
        want_window = np.empty(len(slots), dtype=np.int64)
        want_window[np.argsort(slots, kind="stable")] = np.arange(len(slots))
        order = window_order(slots, streams)
        np.testing.assert_array_equal(order, want_window)
        key = np.argsort(batch * streams + slots, kind="stable")
        inv = np.empty(len(slots), dtype=np.int64)
        inv[key] = np.arange(len(slots))
        starts = np.concatenate([[0], np.cumsum(sizes)])
        np.testing.assert_array_equal(gather_order(order, slots, counts), inv - starts[batch])


def test_squashfs_streams_mix_each_draw_once_and_resume_exactly(mix_sets: dict[str, Path], tmp_path: Path) -> None:
    """A packed SquashFS stream (JPEGs as byte ranges) and a mksquashfs image adopted with `stager index`
    (zstd, fragments: read by inode) beside tar: every drawn item read once per epoch, equal batches per
    rank, and a resumed loader gives the rest exactly (workers decompress in their own processes)."""
    from stager.pack import pack
    from tests.squashfs_trees import HAVE_TOOLS, mksquashfs_of_pack

    if not HAVE_TOOLS:
        pytest.skip("needs squashfs-tools: apt-get install squashfs-tools")
    src = make_imagefolder(tmp_path / "src", num_classes=2, per_class=11, seed=36, size=(12, 10))
    pack(src, tmp_path / "sq", "squashfs", samples_per_shard=8)
    mksquashfs_of_pack(tmp_path / "sq", tmp_path / "img", "-comp", "zstd")
    mix = [(str(mix_sets["tar"]), 2), (str(tmp_path / "sq"), 1), (str(tmp_path / "img"), 1)]
    kw: dict[str, Any] = {"decode": "raw", "staged": False, "seed": 4, "num_workers": 2}
    got: Counter[tuple[int, int]] = Counter()
    lens = set()
    pads = 0
    for r in range(2):
        ld = make_loader(mix, 6, rank=r, world_size=2, **kw)
        ld.set_epoch(1)
        batches = stream_ids(ld)
        lens.add(tuple(len(s) for s, _ in batches))
        got += tally(batches)
        pads += ld.stats()["padded"]
    assert len(lens) == 1, "every rank has the same batches and sizes"
    want = draws(ld, 1)
    assert not (want - got), "every drawn item is read"
    assert sum((got - want).values()) == pads <= 3, "only padding repeats"
    full = make_loader(mix, 6, rank=1, world_size=2, **kw)
    full.set_epoch(2)
    ref = stream_ids(full)
    part = make_loader(mix, 6, rank=1, world_size=2, **kw)
    part.set_epoch(2)
    head = []
    for b in part:
        head.append((np.asarray(b["stream"]).tolist(), np.asarray(b["index"]).tolist()))
        if len(head) == 3:
            break
    resumed = make_loader(mix, 6, rank=1, world_size=2, **kw)
    resumed.load_state_dict(part.state_dict())
    resumed.set_epoch(2)
    assert head + stream_ids(resumed) == ref
    for x in (ld, full, part, resumed):
        x.close()

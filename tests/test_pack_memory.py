"""The pack driver's heap per listed sample is bounded (issue 20: pack under 200 MB at 1.28M samples).

An ImageFolder listing is kept as columns (:class:`~stager.pack.sources.columns.ListingRefs`) and
the plan as positions into it (:class:`~stager.pack.plan.ShardRefs`), so listing and planning N
files costs their paths' and keys' bytes plus a few numbers each, not a Python object per sample
(the lists of SampleRef tuples that came before held ~510 bytes a sample). Measured with
tracemalloc (Python and numpy allocations), not time.
"""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import numpy as np

from stager.formats import get_format
from stager.pack.options import PackOptions
from stager.pack.plan import ShardRefs, plan_shards
from stager.pack.sources.imagefolder import ImageFolderSource

CLASSES, PER_CLASS = 8, 1500
BOUND = 200  # bytes a sample held by listing + plan: ~155 here (~100 at 1.28M: fixed costs amortised);
#   a SampleRef tuple per sample and a shuffled list of them held ~600


def _tree(root: Path) -> None:
    for c in range(CLASSES):
        d = root / f"n{c:08d}"
        d.mkdir(parents=True)
        for i in range(PER_CLASS):
            (d / f"n{c:08d}_{i:05d}.JPEG").write_bytes(b"\xff\xd8\xff" + bytes(i % 7))


def test_listing_and_plan_heap_per_sample_is_bounded(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    _tree(root)
    n = CLASSES * PER_CLASS
    options = PackOptions(format="tar", samples_per_shard=1000)
    shard_name = get_format("tar").shard_name  # imported before measuring
    ImageFolderSource(root)  # a first listing warms caches of modules it uses (imports, regexes)
    gc.collect()
    tracemalloc.start()
    try:
        src = ImageFolderSource(root)
        plan = plan_shards(src.refs, options, shard_name, classes=src.classes, image_shape=None)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(src.refs) == n and plan.samples == n
    assert held / n < BOUND, f"listing + plan hold {held / n:.0f} bytes a sample (bound {BOUND})"
    # The lazy views still give every sample once, as the refs a list would have held.
    shards = [s.refs for s in plan.shards]
    assert all(isinstance(r, ShardRefs) for r in shards)
    locators = [r.locator for refs in shards for r in refs]
    assert sorted(locators) == [r.locator for r in src.refs]
    first = src.refs[0]
    assert (first.key, first.label, first.locator, first.size) == (
        "n00000000/n00000000_00000", 0, f"{root}/n00000000/n00000000_00000.JPEG", 3)
    assert src.refs[-1] == src.refs[n - 1] and src.refs[-1].label == CLASSES - 1
    s0 = shards[0]
    assert list(s0[2:5]) == [s0[2], s0[3], s0[4]]
    assert np.array_equal(s0.sizes, [r.size for r in s0])


def test_hdf5_close_holds_no_copy_of_the_shard(tmp_path: Path) -> None:
    """The hdf5 writer builds a shard's metadata without a copy of the shard (issue 40): HDF5's core
    driver held the whole file image, zero-filled and then copied out, ~2x the shard for ~0.3 s per
    256 MB shard; the gap file holds only the metadata. Measured with tracemalloc: the copy was a
    Python bytes object."""
    from stager.formats.base import Sample
    from stager.formats.hdf5 import Hdf5Reader, Hdf5Writer

    payload = b"\xff\xd8\xff" + bytes(range(256)) * 2048  # 512 KiB
    n = 64  # a 32 MiB shard
    w = Hdf5Writer(str(tmp_path / "s.h5"), shard_name="s.h5", classes=["a"])
    for i in range(n):
        w.write(Sample(f"a/{i}", 0, payload, "jpg", {"source": f"a/{i}.jpg"}))
    gc.collect()
    tracemalloc.start()
    try:
        w.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = (tmp_path / "s.h5").stat().st_size
    assert size > n * len(payload)
    assert peak < size / 8, f"close() peaked at {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB shard"
    got = list(Hdf5Reader(str(tmp_path / "s.h5")).iter_samples())
    assert [s.key for s in got] == [f"a/{i}" for i in range(n)] and all(s.data == payload for s in got)

"""The formats stager adopts (parquet, MXNet RecordIO, LMDB, SquashFS images) against the reader conformance suite.

Each class writes its container with another tool (pyarrow, tools/datagen.py's RecordIO writer of
dmlc-core's framing, liblmdb through py-lmdb with Caffe ``Datum`` values, mksquashfs), adopts it with ``stager
index`` in place, and runs :class:`stager.testing.formats.ReaderTests` on the result: keys, labels and
payloads back through ``iter_samples`` and ``read``, payloads at their byte extents where the shard
declares ``bytes`` extents, a missing or truncated shard reported as our error.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stager.formats.base import Sample
from stager.index import IndexOptions, index_dataset
from stager.manifest import Manifest, load_manifest
from stager.testing.formats import ReaderTests
from tools.datagen import RECORDIO_MAGIC, caffe_datum, png_bytes, recordio_pack, render_image, write_recordio


def png_samples(n: int, seed: int) -> list[Sample]:
    """``n`` small PNGs (what an adopted container holds: real images, which the scanners sniff) with
    labels 0..2; keys are placeholders: the container names its samples."""
    rng = np.random.default_rng((seed, n))
    out = []
    for i in range(n):
        label = int(rng.integers(0, 3))
        out.append(Sample(f"s{i:04d}", label, png_bytes(render_image(rng, label, 3, 8 + i % 5, 9)), "png"))
    return out


class AdoptedTests(ReaderTests):
    """Containers written by other tools, adopted by ``stager index`` in place."""

    index_options: dict[str, Any] = {}  # IndexOptions beyond the format (read-only per class)

    def samples(self, n: int, seed: int = 0) -> list[Sample]:
        return png_samples(n, seed)

    def write_container(self, out: Path, samples: Sequence[Sample]) -> None:
        raise NotImplementedError

    def write_shard(self, out: Path, samples: Sequence[Sample], **options: Any) -> tuple[Manifest, list[Sample]]:
        out.mkdir(parents=True, exist_ok=True)
        self.write_container(out, samples)
        index_dataset(out, options=IndexOptions(format=self.format_name, **self.index_options))
        m = load_manifest(out)
        assert len(m.shards) == 1 and m.format == self.format_name
        keys = list(m.shards[0].keys)
        return m, [Sample(k, s.label, s.data, s.ext) for k, s in zip(keys, samples, strict=True)]


class TestParquet(AdoptedTests):
    format_name = "parquet"

    def write_container(self, out: Path, samples: Sequence[Sample]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"image": pa.array([bytes(s.data) for s in samples], pa.binary()),
                          "label": pa.array([s.label for s in samples], pa.int64())})
        pq.write_table(table, out / "a.parquet", compression="none")


class TestParquetCompressed(TestParquet):
    """Snappy pages: payloads are rows read through pyarrow (``extents: rows``), not byte ranges."""

    def write_container(self, out: Path, samples: Sequence[Sample]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"image": pa.array([bytes(s.data) for s in samples], pa.binary()),
                          "label": pa.array([s.label for s in samples], pa.int64())})
        pq.write_table(table, out / "a.parquet", compression="snappy")

    def test_compressed_pages_are_rows(self, tmp_path: Path) -> None:
        m, _ = self.write_shard(tmp_path, self.samples(4))
        assert m.shards[0].extents == "rows"


class TestRecordIO(AdoptedTests):
    format_name = "recordio"

    def write_container(self, out: Path, samples: Sequence[Sample]) -> None:
        write_recordio(out / "a.rec", [recordio_pack(bytes(s.data), float(s.label), i) for i, s in enumerate(samples)])


class TestRecordIOSplitRecords(TestRecordIO):
    """Payloads holding the magic at an aligned offset are split by the writer: the shard's extents are
    ``records`` (framed parts to join), not byte ranges."""

    def samples(self, n: int, seed: int = 0) -> list[Sample]:
        magic = RECORDIO_MAGIC.to_bytes(4, "little")
        # The 24-byte IRHeader precedes the payload: magic at payload byte 8 sits at record byte 32.
        return [Sample(s.key, s.label, bytes(s.data)[:8] + magic + bytes(s.data)[8:], s.ext)
                for s in png_samples(n, seed)]

    def test_split_records_are_records(self, tmp_path: Path) -> None:
        m, _ = self.write_shard(tmp_path, self.samples(4))
        assert m.shards[0].extents == "records"


class TestLmdb(AdoptedTests):
    format_name = "lmdb"
    index_options = {"lmdb_layout": "caffe"}

    def write_container(self, out: Path, samples: Sequence[Sample]) -> None:
        lmdb = pytest.importorskip("lmdb", reason="lmdb is not installed (pip install 'stager[lmdb]'; make venv does)")
        env = lmdb.open(str(out), map_size=1 << 24)
        with env.begin(write=True) as txn:
            for i, s in enumerate(samples):  # keys in B-tree order: the order of data.mdb's leaves
                txn.put(f"{i:08d}".encode(), caffe_datum(bytes(s.data), s.label))
        env.close()


@pytest.mark.skipif(shutil.which("mksquashfs") is None, reason="needs squashfs-tools: apt-get install squashfs-tools")
class TestSquashfs(AdoptedTests):
    """An ImageFolder tree made into an image by mksquashfs with its defaults (gzip, fragments, duplicate
    detection): PNGs that compress are read through their inodes (``extents: inodes``)."""

    format_name = "squashfs"
    mksquashfs_options: tuple[str, ...] = ()

    def write_shard(self, out: Path, samples: Sequence[Sample], **options: Any) -> tuple[Manifest, list[Sample]]:
        # The image lists class by class, files by name: the samples in that order.
        ordered = sorted(samples, key=lambda s: (s.label, s.key))
        m, got = super().write_shard(out, ordered, **options)
        assert [k.split("/")[0] for k in m.shards[0].keys] == [f"c{s.label}" for s in ordered]
        return m, got

    def write_container(self, out: Path, samples: Sequence[Sample]) -> None:
        tree = out.parent / f"{out.name}-tree"
        for s in samples:
            p = tree / f"c{s.label}" / f"{s.key}.{s.ext}"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(bytes(s.data))
        subprocess.run(["mksquashfs", str(tree), str(out / "a.sqfs"), "-noappend", "-quiet", "-no-progress",
                        *self.mksquashfs_options], check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(tree)


class TestSquashfsUncompressed(TestSquashfs):
    """``-noD -no-fragments``: every file one stored range (``extents: bytes``), read like a tar member."""

    mksquashfs_options = ("-noD", "-no-fragments")

    def test_uncompressed_files_are_byte_ranges(self, tmp_path: Path) -> None:
        m, _ = self.write_shard(tmp_path, self.samples(5))
        assert m.shards[0].extents == "bytes"

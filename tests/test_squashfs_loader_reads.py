"""How the loader reads an adopted image whose samples are partly byte ranges and partly compressed
(``extents: "inodes"``): the byte ranges come as zero-copy slices of the image's mapping (no read
buffer, no copy, as a mapped tar's members), which the fetcher keeps as they are; the compressed ones
by inode; a byte range past the end of a truncated image is a one-line error; and the format is
imported when the loader is made, before its workers fork."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stager.errors import CorruptSampleError
from stager.formats import get_format
from stager.index import IndexOptions, index_dataset
from stager.loader.fetch import owned_copy
from stager.manifest import load_manifest
from tests.squashfs_trees import HAVE_TOOLS, mksquashfs

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="needs mksquashfs: apt-get install squashfs-tools")


@pytest.fixture(scope="module")
def adopted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    """A zstd image of mksquashfs's defaults: incompressible "JPEGs" end up in stored fragment blocks
    (byte ranges), compressible ones in compressed fragments (read by inode)."""
    root = tmp_path_factory.mktemp("loader-reads")
    rng = random.Random(7)
    files: dict[str, bytes] = {}
    for c in ("cat", "dog"):
        for i in range(40):
            data = rng.randbytes(rng.randrange(2000, 9000)) if i % 2 else b"\xff\xd8\xff" + b"ab" * 3000
            files[f"{c}/{c}{i:03d}.jpg"] = data
            (root / "src" / c).mkdir(parents=True, exist_ok=True)
            (root / "src" / c / f"{c}{i:03d}.jpg").write_bytes(data)
    (root / "img").mkdir()
    image = mksquashfs(root / "src", root / "img" / "train.sqfs", "-comp", "zstd")
    index_dataset(root / "img", root / "idx", IndexOptions())
    return image, root / "idx", files


def test_byte_ranges_are_zero_copy_slices_the_fetcher_keeps(adopted: tuple[Path, Path, dict[str, bytes]]) -> None:
    image, idx, files = adopted
    m = load_manifest(idx)
    info = m.shards[0]
    assert info.extents == "inodes"
    reader = get_format("squashfs").open_reader(str(image), info, m)
    try:
        got = reader.read(np.arange(info.samples)[::-1])
        keys = [info.keys[i] for i in range(info.samples)][::-1]
        assert [bytes(g) for g in got] == [files[k + ".jpg"] for k in keys]
        ranges = [g for g, off in zip(got, info.offsets[::-1].tolist(), strict=True) if off < 1 << 62]
        assert ranges and all(isinstance(g, memoryview) and isinstance(g.obj, mmap.mmap) for g in ranges)
        assert all(owned_copy(g) is g for g in ranges)  # a mapping slice pins no read buffer: kept as it is
    finally:
        reader.close()


def test_a_byte_range_past_the_image_is_one_line(adopted: tuple[Path, Path, dict[str, bytes]],
                                                  tmp_path: Path) -> None:
    """An image replaced by a smaller one (still a valid image) under its name: the index's byte range
    lies past its end, which a mapping would not notice by itself (a slice just comes back short)."""
    _image, idx, _files = adopted
    m = load_manifest(idx)
    info = m.shards[0]
    last = int(np.argmax(np.where(info.offsets < 1 << 62, info.offsets, -1)))
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "a.jpg").write_bytes(b"\xff\xd8\xff")
    small = mksquashfs(tmp_path / "src", tmp_path / "small.sqfs")
    reader = get_format("squashfs").open_reader(str(small), info, m)
    try:
        with pytest.raises(CorruptSampleError, match="truncated") as e:
            reader.read([last])
    finally:
        reader.close()
    assert str(small) in str(e.value) and "\n" not in str(e.value)


def test_the_format_is_imported_before_workers_fork(adopted: tuple[Path, Path, dict[str, bytes]]) -> None:
    _image, idx, _files = adopted
    code = ("import sys; from stager.loader import make_numpy_loader; "
            f"make_numpy_loader({str(idx)!r}, 8, rank=0, world_size=1, staged=False, decode='raw'); "
            "print('stager.formats.squashfs.shards' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_indexing_an_image_imports_no_tfrecord_crc(adopted: tuple[Path, Path, dict[str, bytes]],
                                                    tmp_path: Path) -> None:
    """``stager index`` of an image never loads crc32c (TFRecord framing; its import reads package
    metadata, ~30 ms of every index's start)."""
    image, _idx, _files = adopted
    code = ("import sys; from stager.index import IndexOptions, index_dataset; "
            f"index_dataset({str(image.parent)!r}, {str(tmp_path / 'idx')!r}, IndexOptions()); "
            "print('crc32c' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_decompressor_is_loaded_before_workers_fork(adopted: tuple[Path, Path, dict[str, bytes]]) -> None:
    """A loader over an image read by inodes loads the image's decompressor (zstandard) when it is made,
    in the main process, so that its forked workers inherit it instead of each importing it before its
    first sample; the workers' batches are the files' bytes. Reading never imports the image writer."""
    _image, idx, files = adopted
    code = ("import hashlib, json, sys; from stager.loader import make_numpy_loader; "
            f"ld = make_numpy_loader({str(idx)!r}, 8, rank=0, world_size=1, staged=False, decode='raw', "
            "num_workers=2); loaded = 'zstandard' in sys.modules; "
            "got = {k: hashlib.sha256(v).hexdigest() for b in ld for k, v in zip(b['key'], b['image'], strict=True)}; "
            "writer = {'writer', 'tables'} & {m.rsplit('.', 1)[1] for m in sys.modules if 'squashfs.' in m}; "
            "print(json.dumps([loaded, sorted(writer), got]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded, writer, got = json.loads(out)
    assert loaded
    assert writer == []
    assert got == {k.removesuffix(".jpg"): hashlib.sha256(v).hexdigest() for k, v in files.items()}


def test_warming_skips_what_is_no_image(tmp_path: Path) -> None:
    """The warm-up reads only superblocks and never raises: a missing file, a directory, a FIFO and a
    file that is no SquashFS image are left to the reader that opens them, which reports them."""
    (tmp_path / "junk.sqfs").write_bytes(b"not an image" * 20)
    (tmp_path / "dir.sqfs").mkdir()
    os.mkfifo(tmp_path / "fifo.sqfs")
    paths = [str(tmp_path / n) for n in ("missing.sqfs", "junk.sqfs", "dir.sqfs", "fifo.sqfs")]
    get_format("squashfs").warm_readers(paths)

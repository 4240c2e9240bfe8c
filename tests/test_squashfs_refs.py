"""Reads by inode reference in runs of neighbours, as the loader reads an adopted image's compressed
samples: a run of small files goes straight to their fragment blocks (one gather of their inodes, no
listing), a run that mixes in other files takes the general path; both read every compressor's
images byte-exact, and a damaged fragment block or a reference that matches no inode is a one-line
:class:`CorruptSampleError` naming the image."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from stager.errors import CorruptSampleError
from stager.formats.squashfs import SquashImage
from tests.squashfs_trees import HAVE_TOOLS, mksquashfs

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="needs mksquashfs: apt-get install squashfs-tools")


def _tree(root: Path) -> dict[str, bytes]:
    """Small files that compress (text) and that do not (random bytes), a few past the block size."""
    rng = random.Random(5)
    files: dict[str, bytes] = {}
    for c in range(3):
        for i in range(300):
            text = (f"class {c} sample {i} " * rng.randrange(1, 120)).encode()
            files[f"c{c}/t{i:04d}.txt"] = text if i % 3 else rng.randbytes(rng.randrange(1, 3000))
    files["c1/big.bin"] = rng.randbytes(300_000)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


@pytest.mark.parametrize("comp", ["gzip", "zstd", "lz4", "xz"])
def test_runs_of_neighbours_read_exact(tmp_path: Path, comp: str) -> None:
    files = _tree(tmp_path / "src")
    image = mksquashfs(tmp_path / "src", tmp_path / "img.sqfs", "-comp", comp, "-b", "16K")
    with SquashImage(image) as im:
        lst = im.listing()
        idx = lst.files()
        want = [files[lst.paths[int(i)]] for i in idx.tolist()]
        refs = lst.inode_ref[idx]
        for run in (1, 7, 64, 257):
            got: list[bytes] = []
            for a in range(0, len(idx), run):
                got += im.read_refs(refs[a : a + run])
            assert got == want, run
        assert im.read_refs(refs[::-1]) == want[::-1]  # descending: the blocks sorted first


def test_damage_under_a_run_is_one_line(tmp_path: Path) -> None:
    files = _tree(tmp_path / "src")
    image = mksquashfs(tmp_path / "src", tmp_path / "img.sqfs", "-b", "16K")
    with SquashImage(image) as im:
        lst = im.listing()
        idx = lst.files()
        small = idx[(lst.size[idx] < 16384) & (lst.fragment[idx] == 0)]
        refs = lst.inode_ref[small]
        start, word = (int(x) for x in im.fragments[0])
        assert not word & (1 << 24) and len(refs) > 1, "fragment 0 is compressed and holds several files"
        with pytest.raises(CorruptSampleError, match="lies past its block's end") as e:
            im.read_refs(np.asarray([int(refs[0]) | 0xFFFF]))
        assert str(image) in str(e.value) and "\n" not in str(e.value)
    raw = bytearray(image.read_bytes())
    raw[start + 2 : start + 66] = bytes(64)  # the deflate stream of fragment block 0, zeroed
    image.write_bytes(bytes(raw))
    with SquashImage(image) as im, pytest.raises(CorruptSampleError, match="does not decompress") as e:
        im.read_refs(refs)
    assert str(image) in str(e.value) and "\n" not in str(e.value)
    assert sum(len(files[lst.paths[int(i)]]) for i in small.tolist()) > 0

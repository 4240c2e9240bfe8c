"""stager's SquashFS reader over images made by the real tools (mksquashfs 4.x, squashfs-tools-ng).

Every option a site's images may have been made with: each compressor (lzo reads when python-lzo is
installed, else refuses naming it), -noD/-noI/-no-fragments/-always-use-fragments, duplicates,
block sizes from 4 KiB to 1 MiB, xattrs (extended inodes), sparse and large files, deep trees and
indexed listings. Each image is read back byte-exact against its source tree; hard links, symlinks,
devices, FIFOs and sockets are reported, not read as samples.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from stager.errors import MissingBackendError, UnsafeArchiveError
from stager.formats.squashfs import SquashImage
from tests.squashfs_trees import HAVE_TOOLS, assert_reads, dirs_of, make_tree, mksquashfs

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="needs squashfs-tools: apt-get install squashfs-tools")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("sqfs-src") / "src"
    return root, make_tree(root)


OPTIONS = {
    "defaults": [],
    "zstd": ["-comp", "zstd"],
    "xz": ["-comp", "xz"],
    "xz-bcj": ["-comp", "xz", "-Xbcj", "x86,arm", "-Xdict-size", "50%"],
    "lz4": ["-comp", "lz4"],
    "lz4-hc": ["-comp", "lz4", "-Xhc"],
    "lzma": ["-comp", "lzma"],
    "gzip-1": ["-comp", "gzip", "-Xcompression-level", "1"],
    "zstd-3": ["-comp", "zstd", "-Xcompression-level", "3"],
    "noD": ["-noD"],
    "noI": ["-noI"],
    "noF": ["-noF"],
    "no-fragments": ["-no-fragments"],
    "always-fragments": ["-always-use-fragments"],
    "no-duplicates": ["-no-duplicates"],
    "no-exports-no-xattrs": ["-no-exports", "-no-xattrs"],
    "4k": ["-b", "4K"],
    "1m": ["-b", "1M"],
    "4k-noD-always": ["-b", "4K", "-noD", "-always-use-fragments"],
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_mksquashfs_images_read_byte_exact(tree: tuple[Path, dict[str, bytes]], tmp_path: Path, name: str) -> None:
    src, files = tree
    image = mksquashfs(src, tmp_path / "img.sqfs", *OPTIONS[name])
    im = assert_reads(image, files, dirs_of(files, ("emptydir",)))
    lst = im.listing()
    # ImageFolder's labels: each entry's top-level folder.
    for i in range(0, len(lst), 97):
        assert lst.paths[int(lst.top[i])] == lst.paths[i].split("/")[0]
    paths = [*lst.paths]
    a, b = paths.index("dups/one.bin"), paths.index("dups/two.bin")
    if name == "no-duplicates":
        assert lst.start_block[a] != lst.start_block[b]
    if name == "defaults":  # duplicates share their blocks
        assert lst.start_block[a] == lst.start_block[b]
    im.close()


def test_uncompressed_images_are_contiguous_ranges(tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    """-noD -no-fragments: every file is one stored range (sparse ones aside), read with one pread."""
    src, _files = tree
    image = mksquashfs(src, tmp_path / "raw.sqfs", "-noD", "-no-fragments", "-no-sparse")
    with SquashImage(image) as im:
        lst = im.listing()
        idx = lst.files()
        assert (lst.raw_offset[idx] >= 0).all()
        assert all(len(lst.pieces(int(i))) == -(-int(lst.size[i]) // lst.block_size) for i in idx)


def test_listing_matches_unsquashfs(tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    src, _ = tree
    image = mksquashfs(src, tmp_path / "img.sqfs")
    out = subprocess.run(["unsquashfs", "-l", "-d", "", str(image)], check=True, capture_output=True).stdout
    theirs = {line.decode()[1:] for line in out.splitlines() if line.startswith(b"/")}
    with SquashImage(image) as im:
        assert set(im.listing().paths) == theirs


def test_lzo_reads_or_names_its_package(tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    src, files = tree
    image = mksquashfs(src, tmp_path / "lzo.sqfs", "-comp", "lzo")
    if importlib.util.find_spec("lzo") is not None:
        assert_reads(image, files).close()
    else:
        with pytest.raises(MissingBackendError, match="pip install python-lzo"):
            SquashImage(image)


def test_a_missing_compressor_package_is_one_line_naming_it(tree: tuple[Path, dict[str, bytes]],
                                                            tmp_path: Path) -> None:
    """With zstandard unimportable, a zstd image is refused with the package to install (exit 2)."""
    src, _ = tree
    image = mksquashfs(src, tmp_path / "z.sqfs", "-comp", "zstd")
    code = ("import sys; sys.modules['zstandard'] = None\n"
            "from stager.formats.squashfs import SquashImage\n"
            "from stager.errors import StagerError\n"
            f"try:\n    SquashImage({str(image)!r})\n"
            "except StagerError as e:\n    print(type(e).__name__, e.exit_code, str(e)); sys.exit(0)\n"
            "sys.exit(1)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.startswith("MissingBackendError 2 ")
    assert "pip install zstandard" in r.stdout and r.stdout.count("\n") == 1


def test_gensquashfs_and_tar2sqfs_images(tree: tuple[Path, dict[str, bytes]], tmp_path: Path) -> None:
    if shutil.which("tar2sqfs") is None or shutil.which("gensquashfs") is None:
        pytest.skip("needs squashfs-tools-ng: apt-get install squashfs-tools-ng")
    src, files = tree
    tar = tmp_path / "src.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname=".")
    for comp in ("gzip", "zstd", "xz", "lz4"):
        image = tmp_path / f"t2s-{comp}.sqfs"
        with open(tar, "rb") as f:
            subprocess.run(["tar2sqfs", "-q", "-f", "-c", comp, str(image)], stdin=f, check=True)
        assert_reads(image, files).close()
    image = tmp_path / "gen.sqfs"
    subprocess.run(["gensquashfs", "-q", "-f", "-D", str(src), str(image)], check=True)
    assert_reads(image, files).close()


def test_links_and_special_files_are_reported(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "cls").mkdir(parents=True)
    (src / "cls" / "a.jpg").write_bytes(b"a" * 100)
    os.link(src / "cls" / "a.jpg", src / "cls" / "hard.jpg")
    os.symlink("a.jpg", src / "cls" / "soft.jpg")
    os.mkfifo(src / "cls" / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(src / "cls" / "sock"))
    s.close()
    with contextlib.suppress(PermissionError):
        os.mknod(src / "cls" / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    image = mksquashfs(src, tmp_path / "img.sqfs")
    with SquashImage(image) as im:
        lst = im.listing()
        found = "\n".join(lst.problems())
        assert "cls/hard.jpg: a hard link" in found and "cls/a.jpg: a hard link" in found
        assert "cls/soft.jpg: a symlink" in found and "cls/fifo: a FIFO" in found and "cls/sock: a socket" in found
        if (src / "cls" / "dev").exists():
            assert "cls/dev: a character device" in found
        with pytest.raises(UnsafeArchiveError) as e:
            lst.check_samples(str(image))
        assert "\n" not in str(e.value) and "more" in str(e.value)
        # Hard-linked files still read (the indexer decides what to do with them).
        assert im.read([*lst.paths].index("cls/hard.jpg")) == b"a" * 100


def test_imagenet_shaped_listing_uses_the_chains(tmp_path: Path) -> None:
    """Class folders of ~1,300 files: the directory index cuts each listing into short chains, and the
    bulk walk gives the same entries, in the same order, as unsquashfs."""
    src = tmp_path / "src"
    rng = np.random.default_rng(0)
    for c in range(30):
        d = src / f"n{c:08d}"
        d.mkdir(parents=True)
        for _ in range(1300 if c % 10 == 0 else 40):
            (d / f"n{c:08d}_{int(rng.integers(1 << 30))}.JPEG").write_bytes(b"")
    image = mksquashfs(src, tmp_path / "img.sqfs", "-b", "4K")
    out = subprocess.run(["unsquashfs", "-lc", "-d", "", str(image)], check=True, capture_output=True).stdout
    theirs = sorted(line.decode()[1:] for line in out.splitlines() if line.startswith(b"/"))
    with SquashImage(image) as im:
        lst = im.listing()
        files = [lst.paths[int(i)] for i in lst.files()]
    assert files == theirs  # class by class, names sorted: ImageFolder's order


def test_bulk_reads_by_reference_of_inodes_that_span_metadata_blocks(tmp_path: Path) -> None:
    """At 4 KiB blocks a 40 MB file's inode lists 10,000 block sizes (40 KB, five metadata blocks): read
    in bulk by reference (read_refs) beside small files, it is decoded on its own and reads back exact."""
    src = tmp_path / "src"
    rng = random.Random(3)
    files = {"big/huge.bin": rng.randbytes(40 << 20), **{f"small/s{i:03d}.txt": b"x%d" % i * rng.randrange(1, 300)
                                                          for i in range(300)}}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    image = mksquashfs(src, tmp_path / "img.sqfs", "-b", "4K", "-comp", "zstd")
    with SquashImage(image) as im:
        lst = im.listing()
        idx = lst.files()
        order = idx[::-1]
        assert im.read_refs(lst.inode_ref[order]) == [files[lst.paths[int(i)]] for i in order.tolist()]

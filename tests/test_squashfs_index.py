"""``stager index`` of SquashFS images made by plain ``mksquashfs`` from an ImageFolder tree (issue 41).

Invariants, for mksquashfs's defaults (gzip, fragments, duplicate detection) and for ``-comp zstd|xz|lz4``,
``-noD``, ``-no-fragments`` and block sizes from 4 KiB to 1 MiB: the samples are exactly the tree's
image files under its top-level folders (torchvision's ImageFolder rules: classes sorted, extensions
case-insensitive, files at the top or of other types left out, sub-folders included), each read back
byte-exact by the loader through the index (the image used in place with ``--out``), and ``verify
--deep`` indexes the image again and agrees. Bad input is one line, a non-zero exit, and nothing left
behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stager.index import IndexOptions, index_dataset
from stager.loader import make_numpy_loader
from stager.manifest import load_manifest
from stager.shardcheck import verify
from stager.stage.mount import mount_points
from tests.squashfs_trees import HAVE_TOOLS, fuse_unusable, mksquashfs
from tools.datagen import make_imagefolder, png_bytes

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="needs squashfs-tools: apt-get install squashfs-tools")

OPTIONS = {
    "defaults": (),
    "zstd": ("-comp", "zstd"),
    "xz": ("-comp", "xz"),
    "lz4": ("-comp", "lz4"),
    "noD": ("-noD",),
    "no-fragments": ("-no-fragments",),
    "uncompressed": ("-noD", "-noF", "-no-fragments"),
    "4K": ("-b", "4K"),
    "1M": ("-b", "1M", "-comp", "zstd"),
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes], list[str]]:
    """An ImageFolder tree: 3 classes of small JPEGs (``.JPEG``, as ImageNet's), a sub-folder, copies
    (mksquashfs stores them once), a lower-case extension, a 300 KB file (several blocks), and files
    ImageFolder skips; returns ``(root, {key: bytes} of the samples, classes)``."""
    root = make_imagefolder(tmp_path_factory.mktemp("sq_tree") / "train", num_classes=3, per_class=12, seed=4,
                            size=(40, 30))
    classes = sorted(p.name for p in root.iterdir())
    (root / classes[0] / "sub").mkdir()
    shutil.copy(sorted((root / classes[0]).iterdir())[0], root / classes[0] / "sub" / "copy.jpg")
    shutil.copy(sorted((root / classes[1]).iterdir())[0], root / classes[1] / "lower.jpg")
    noise = np.random.default_rng(1).integers(0, 256, (330, 330, 3), dtype=np.uint8)
    (root / classes[2] / "large.png").write_bytes(png_bytes(noise))  # ~330 KB: three 128 KiB blocks
    (root / "README.txt").write_text("not a sample")
    (root / classes[1] / "notes.txt").write_text("not a sample either")
    samples = {}
    for c in classes:
        for p in sorted((root / c).rglob("*")):
            if p.is_file() and p.suffix.lower() in (".jpg", ".jpeg", ".png"):
                samples[str(p.relative_to(root).with_suffix(""))] = p.read_bytes()
    return root, samples, classes


def _read_all(idx: Path) -> dict[str, tuple[int, bytes]]:
    """Every sample through the loader (raw payloads, 2 workers): ``{key: (label, bytes)}``."""
    got = {}
    ld = make_numpy_loader(idx, 7, rank=0, world_size=1, decode="raw", shuffle=True, seed=3, staged=False,
                           num_workers=2, multiprocessing_context="fork", drop_last=False)
    for b in ld:
        for k, lab, img in zip(b["key"], np.asarray(b["label"]).tolist(), b["image"], strict=True):
            got[k] = (lab, bytes(img))
    ld.close()
    return got


@pytest.mark.parametrize("name", list(OPTIONS))
def test_mksquashfs_images_are_adopted_in_place(tree: tuple[Path, dict[str, bytes], list[str]], tmp_path: Path,
                                                name: str) -> None:
    root, samples, classes = tree
    (tmp_path / "img").mkdir()
    image = mksquashfs(root, tmp_path / "img" / "train.sqfs", *OPTIONS[name])
    before = image.stat()
    index_dataset(image, tmp_path / "idx", IndexOptions())
    m = load_manifest(tmp_path / "idx")
    assert m.shard_root == str(tmp_path / "img") and m.classes == classes and m.format == "squashfs"
    assert sorted(m.shards[0].keys) == sorted(samples)
    assert m.shards[0].extents == ("bytes" if name == "uncompressed" else "inodes")
    got = _read_all(tmp_path / "idx")
    assert {k: v for k, (_, v) in got.items()} == samples
    assert all(lab == classes.index(k.split("/")[0]) for k, (lab, _) in got.items())
    assert verify(tmp_path / "idx", deep=True).ok
    after = image.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # used in place, untouched
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == ["train.sqfs"]


def test_a_directory_of_images_is_one_dataset(tree: tuple[Path, dict[str, bytes], list[str]], tmp_path: Path) -> None:
    """Several images (here: one per class) index as one set of shards; classes are all top-level folders."""
    root, samples, classes = tree
    (tmp_path / "imgs").mkdir()
    for i, c in enumerate(classes):
        subprocess.run(["mksquashfs", str(root / c), str(tmp_path / "imgs" / f"part-{i}.img"), "-keep-as-directory",
                        "-quiet", "-no-progress", "-comp", "zstd"], check=True, stdout=subprocess.DEVNULL)
    r = subprocess.run([sys.executable, "-m", "stager", "index", str(tmp_path / "imgs"), "--out", str(tmp_path / "idx"),
                        "--json"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kind"] == "squashfs"  # .img: known by its magic
    m = load_manifest(tmp_path / "idx")
    assert len(m.shards) == 3 and m.classes == classes
    assert {k: v for k, (_, v) in _read_all(tmp_path / "idx").items()} == samples


def test_an_adopted_image_is_staged_verified_read_there_and_mounted(tree: tuple[Path, dict[str, bytes], list[str]],
                                                                     tmp_path: Path) -> None:
    """``stager stage`` of an index copies the image (not a stager pack) into DEST, verified as any shard;
    the loader then reads the staged copy, and ``--mount`` shows the tree ImageFolder expects."""
    root, samples, classes = tree
    (tmp_path / "img").mkdir()
    mksquashfs(root, tmp_path / "img" / "train.sqfs", "-comp", "zstd")
    index_dataset(tmp_path / "img", tmp_path / "idx", IndexOptions())
    dest = tmp_path / "node" / "ds"
    r = _stager("stage", str(tmp_path / "idx"), str(dest), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["files_copied"] >= 1, r.stderr
    assert (dest / "train.sqfs").read_bytes() == (tmp_path / "img" / "train.sqfs").read_bytes()
    assert load_manifest(dest).shard_root is None
    (tmp_path / "img").rename(tmp_path / "away")  # the loader must read the staged copy: the original is gone
    ld = make_numpy_loader(tmp_path / "idx", 7, rank=0, world_size=1, decode="raw", seed=3, drop_last=False,
                           staging_roots=(str(tmp_path / "node"),))
    assert ld.stats()["staged"]
    assert {k: bytes(v) for b in ld for k, v in zip(b["key"], b["image"], strict=True)} == samples
    ld.close()
    why = fuse_unusable()
    if why:
        pytest.skip(why)
    try:
        r = _stager("stage", str(tmp_path / "idx"), str(dest), "--mount")
        assert r.returncode == 0, r.stderr
        point = dest / "mnt" / "train"
        assert sorted(p.name for p in point.iterdir() if p.is_dir()) == classes
        assert {str(p.relative_to(point).with_suffix("")): p.read_bytes() for p in point.rglob("*")
                if p.suffix.lower() in (".jpg", ".jpeg", ".png") and p.parent.name != point.name} == samples
        assert _stager("clean", str(dest)).returncode == 0 and not point.exists()
    finally:  # a failure half-way leaves nothing mounted
        for p in mount_points(tmp_path):
            subprocess.run(["fusermount3", "-u", "-z", p], check=False, capture_output=True)


def test_label_key_none_and_image_key(tree: tuple[Path, dict[str, bytes], list[str]], tmp_path: Path) -> None:
    root, samples, _ = tree
    image = mksquashfs(root, tmp_path / "a.sqfs")
    index_dataset(image, tmp_path / "unlabeled", IndexOptions(label_key="none"))
    m = load_manifest(tmp_path / "unlabeled")
    assert (m.shards[0].labels == -1).all()
    index_dataset(image, tmp_path / "some", IndexOptions(image_key="png;jpeg"))
    want = {str(p.relative_to(root).with_suffix("")) for p in root.rglob("*") if p.suffix in (".png", ".JPEG")}
    assert set(load_manifest(tmp_path / "some").shards[0].keys) == want and len(want) < len(samples)


def _stager(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stager", *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})


def _tree_with(tmp_path: Path, make: str) -> Path:
    src = make_imagefolder(tmp_path / "bad", num_classes=2, per_class=3, seed=5, size=(20, 20))
    cls = sorted(p.name for p in src.iterdir())[0]
    first = sorted((src / cls).iterdir())[0]
    if make == "hard link":
        os.link(first, src / cls / "hard.jpg")
    elif make == "symlink":
        os.symlink(first.name, src / cls / "soft.jpg")
    elif make == "same key":
        shutil.copy(first, first.with_suffix(".png"))
    elif make == "empty class":
        (src / "zz_empty").mkdir()
    return src


@pytest.mark.parametrize(("make", "code", "words"), [
    ("hard link", 3, "is a hard link"),
    ("symlink", 3, "is a symlink"),
    ("device", 3, "is a character device"),
    ("same key", 3, "are both sample"),
    ("empty class", 3, "holds no image"),
    ("truncated", 3, "truncated"),
    ("not squashfs", 3, "not a SquashFS image"),
    ("no classes", 2, "no top-level folders"),
])
def test_bad_images_are_one_line_and_leave_nothing(tmp_path: Path, make: str, code: int, words: str) -> None:
    image = tmp_path / "img.sqfs"
    if make == "not squashfs":
        image.write_bytes(b"PK\x03\x04 not an image" * 100)
    elif make == "no classes":
        (tmp_path / "flat").mkdir()
        (tmp_path / "flat" / "a.jpg").write_bytes(b"\xff\xd8\xff")
        mksquashfs(tmp_path / "flat", image)
    elif make == "device":  # a pseudo file: no root needed to put a device into an image
        src = _tree_with(tmp_path, "")
        cls = sorted(p.name for p in src.iterdir())[0]
        mksquashfs(src, image, "-p", f"{cls}/null c 666 0 0 1 3")
    else:
        mksquashfs(_tree_with(tmp_path, make if make != "truncated" else ""), image)
        if make == "truncated":
            image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])
    r = _stager("index", str(image), "--out", str(tmp_path / "idx"))
    assert r.returncode == code, r.stderr
    assert r.stderr.count("\n") == 1 and words in r.stderr and str(image) in r.stderr, r.stderr
    assert not (tmp_path / "idx").exists()


def test_a_compressor_without_its_package_names_the_package(tree: tuple[Path, dict[str, bytes], list[str]],
                                                              tmp_path: Path) -> None:
    root, _, _ = tree
    image = mksquashfs(root, tmp_path / "z.sqfs", "-comp", "zstd")
    block = tmp_path / "block"
    block.mkdir()
    (block / "zstandard.py").write_text("raise ImportError('blocked for this test')\n")
    r = _stager("index", str(image), "--out", str(tmp_path / "idx"), env={"PYTHONPATH": str(block)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "pip install zstandard" in r.stderr
    assert not (tmp_path / "idx").exists()


def test_conversion_of_an_image_to_every_format(tree: tuple[Path, dict[str, bytes], list[str]],
                                                tmp_path: Path) -> None:
    """``stager pack IMAGE OUT --format F``: the image is indexed in memory and its samples written (the
    command line once; the other formats in process, the same code without an interpreter each)."""
    from stager.pack import pack

    root, samples, classes = tree
    image = mksquashfs(root, tmp_path / "train.sqfs", "-comp", "zstd")
    for fmt in ("tar", "record", "hdf5", "squashfs"):
        if fmt == "tar":
            r = _stager("pack", str(image), str(tmp_path / fmt), "--format", fmt, "-q")
            assert r.returncode == 0, (fmt, r.stderr)
        else:
            pack(image, tmp_path / fmt, fmt)
        m = load_manifest(tmp_path / fmt)
        assert m.classes == classes and m.num_samples == len(samples)
        got = _read_all(tmp_path / fmt)
        assert sorted(v for _, v in got.values()) == sorted(samples.values()), fmt

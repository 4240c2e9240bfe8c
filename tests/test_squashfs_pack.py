"""``stager pack --format squashfs`` and ``stager stage --mount`` end to end (issue 41).

The images are checked by the tools sites use on them: ``unsquashfs -l`` lists ``<class>/<file>`` with
the source's file names, ``unsquashfs -s`` names the compression, the kernel driver (``mount -t squashfs``)
and squashfuse mount them, and the trees they show are the source tree byte for byte. JPEG and PNG
are stored as they are (each sample one byte range, at its manifest extent), other files compressed
(read by inode); a shard may mix both. ``stage --mount`` mounts the staged images under DEST/mnt,
``clean`` unmounts them first, and a failure leaves nothing mounted or behind.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stager.errors import CorruptSampleError
from stager.loader import make_loader, make_numpy_loader
from stager.manifest import load_manifest
from stager.stage.mount import MOUNT_DIR, MOUNTS_NAME, mount_points
from tests.squashfs_trees import HAVE_TOOLS, fuse_unusable, kernel_unusable
from tools.datagen import make_imagefolder, make_shapes, png_bytes

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="needs squashfs-tools: apt-get install squashfs-tools")
needs_fuse = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))


@pytest.fixture(autouse=True)
def _nothing_stays_mounted(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves mounted under its directory (when it fails half-way) is unmounted."""
    yield
    for point in sorted(mount_points(tmp_path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point] if os.geteuid() == 0 else ["fusermount3", "-u", "-z", point],
                       check=False, capture_output=True)


def stager(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stager", *map(str, args)], capture_output=True, text=True,
                          check=False)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder tree of JPEGs, with PNGs and BMPs (which the writer compresses) among them."""
    root = make_imagefolder(tmp_path_factory.mktemp("sqp") / "train", num_classes=3, per_class=15, seed=2,
                            size=(48, 40))
    rng = np.random.default_rng(3)
    for k, c in enumerate(sorted(p.name for p in root.iterdir())):
        img = (rng.integers(0, 4, (60, 50, 3)) * 60).astype(np.uint8)
        (root / c / f"extra_{k}.png").write_bytes(png_bytes(img))
        from PIL import Image

        Image.fromarray(img).save(root / c / f"bitmap_{k}.bmp")
    return root


def tree_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_pack_writes_images_that_the_tools_list_and_extract(src: Path, tmp_path: Path) -> None:
    r = stager("pack", src, tmp_path / "out", "--format", "squashfs", "--compression", "zstd", "--shard-size",
               "60K", "--keep-order", "-q")
    assert r.returncode == 0, r.stderr
    m = load_manifest(tmp_path / "out")
    assert len(m.shards) > 1 and m.num_samples == len(tree_of(src))
    extracted = tmp_path / "x"
    for s in m.shards:
        image = tmp_path / "out" / s.name
        listed = subprocess.run(["unsquashfs", "-l", str(image)], capture_output=True, text=True, check=True).stdout
        names = {ln.split("squashfs-root/", 1)[1] for ln in listed.splitlines() if ln.startswith("squashfs-root/")}
        files = {n for n in names if "/" in n}
        assert len(files) == s.samples  # <class>/<file>: one file per sample, nothing else
        assert "Compression zstd" in subprocess.run(["unsquashfs", "-s", str(image)], capture_output=True, text=True,
                                                    check=True).stdout
        subprocess.run(["unsquashfs", "-q", "-n", "-f", "-d", str(extracted), str(image)], check=True,
                       stdout=subprocess.DEVNULL)
    assert tree_of(extracted) == tree_of(src)  # the source's names and bytes
    # JPEG and PNG are stored: byte ranges of the image; the BMPs compressed: found by inode
    by_key = {}
    for s in m.shards:
        blob = (tmp_path / "out" / s.name).read_bytes()
        for k, off, size in zip(s.keys, s.offsets.tolist(), s.sizes.tolist(), strict=True):
            by_key[k] = (s.extents, blob[off : off + size] if off < len(blob) else None)
    for rel, data in tree_of(src).items():
        extents, at = by_key[rel.rsplit(".", 1)[0]]
        if rel.endswith(".bmp"):
            assert extents == "inodes" and at != data
        else:
            assert at == data
    # a shard with a BMP mixes stored and compressed samples; one without is plain byte ranges
    assert {s.extents for s in m.shards} == {"inodes", "bytes"}


@pytest.mark.parametrize("compression", ["none", "gzip", "zstd", "xz", "lz4"])
def test_every_compression_reads_back_exactly(src: Path, tmp_path: Path, compression: str) -> None:
    r = stager("pack", src, tmp_path / "out", "--format", "squashfs", "--compression", compression, "-q")
    assert r.returncode == 0, r.stderr
    m = load_manifest(tmp_path / "out")
    s = m.shards[0]
    info = subprocess.run(["unsquashfs", "-s", str(tmp_path / "out" / s.name)], capture_output=True, text=True,
                          check=True).stdout
    assert f"Compression {'gzip' if compression == 'none' else compression}" in info
    assert s.extents == ("bytes" if compression == "none" else "inodes")
    ld = make_numpy_loader(tmp_path / "out", 8, rank=0, world_size=1, decode="raw", staged=False, num_workers=1,
                           multiprocessing_context="fork")
    got = {k: bytes(v) for b in ld for k, v in zip(b["key"], b["image"], strict=True)}
    ld.close()
    assert got == {rel.rsplit(".", 1)[0]: data for rel, data in tree_of(src).items()}


def test_the_compression_flag_is_checked_where_it_is_parsed(src: Path, tmp_path: Path) -> None:
    r = stager("pack", src, tmp_path / "tar", "--format", "tar", "--compression", "zstd")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--compression zstd" in r.stderr, r.stderr
    r = stager("pack", src, tmp_path / "q", "--format", "squashfs", "--compression", "brotli")
    assert r.returncode == 2 and "--compression" in r.stderr and "brotli" in r.stderr, r.stderr
    assert not (tmp_path / "tar").exists() and not (tmp_path / "q").exists()


def test_two_samples_of_one_file_name_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "cat" / "a").mkdir(parents=True)
    img = png_bytes(np.zeros((4, 4, 3), np.uint8))
    (root / "cat" / "a_b.png").write_bytes(img)
    (root / "cat" / "a" / "b.png").write_bytes(img)  # cat/a/b and cat/a_b: both the file cat/a_b.png
    r = stager("pack", root, tmp_path / "out", "--format", "squashfs")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "a_b" in r.stderr, r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_fields_are_sidecar_files_beside_each_image(tmp_path: Path) -> None:
    shapes = make_shapes(tmp_path / "shapes", train=9, val=1, size=32, seed=4)
    r = stager("pack", shapes / "train.jsonl", tmp_path / "out", "--format", "squashfs", "--fields",
               "mask:mask,boxes:boxes,box_labels:box_labels", "--samples-per-shard", "4", "-q")
    assert r.returncode == 0, r.stderr
    m = load_manifest(tmp_path / "out")
    listed = subprocess.run(["unsquashfs", "-l", str(tmp_path / "out" / m.shards[0].name)], capture_output=True,
                            text=True, check=True).stdout
    files = {ln.removeprefix("squashfs-root/") for ln in listed.splitlines() if ln.startswith("squashfs-root/")}
    for key in m.shards[0].keys:  # unlabeled: _unlabeled/<key, '/' as '_'>.<jpg | field suffix>
        stem = "_unlabeled/" + key.replace("/", "_")
        assert {f"{stem}.{x}" for x in ("jpg", "mask.png", "boxes.json", "box_labels.json")} <= files, key
    assert len(files) == 1 + 4 * m.shards[0].samples
    ld = make_loader(tmp_path / "out", 3, rank=0, world_size=1, image_size=16, staged=False, seed=1)
    seen = 0
    for b in ld:
        assert b["mask"].shape[1:] == (16, 16) and len(b["boxes"]) == len(b["key"])
        seen += len(b["key"])
    assert seen == 9
    assert stager("verify", tmp_path / "out", "--deep").returncode == 0


def test_conversion_to_and_from_every_format(src: Path, tmp_path: Path) -> None:
    """tar -> squashfs -> hdf5/record/zarr/tar: every sample's bytes survive (zarr: decoded, same count).
    The command line once; the conversions back in process (the same code, without an interpreter each)."""
    from stager.pack import pack

    pack(src, tmp_path / "tar", "tar", quiet=True)
    r = stager("pack", tmp_path / "tar", tmp_path / "sq", "--format", "squashfs", "--compression", "xz", "-q")
    assert r.returncode == 0, r.stderr
    want = sorted(tree_of(src).values())
    for fmt in ("tar", "record", "hdf5", "zarr"):
        pack(tmp_path / "sq", tmp_path / f"back-{fmt}", fmt, resize=(8, 8) if fmt == "zarr" else None, quiet=True)
        m = load_manifest(tmp_path / f"back-{fmt}")
        assert m.num_samples == len(want)
        if fmt != "zarr":
            ld = make_numpy_loader(tmp_path / f"back-{fmt}", 16, rank=0, world_size=1, decode="raw", staged=False)
            assert sorted(bytes(v) for b in ld for v in b["image"]) == want, fmt
            ld.close()


@pytest.mark.parametrize("how", ["kernel", "squashfuse"])
def test_the_kernel_and_squashfuse_mount_the_images(src: Path, tmp_path: Path, how: str) -> None:
    why = kernel_unusable() if how == "kernel" else fuse_unusable()
    if why:
        pytest.skip(why)
    assert stager("pack", src, tmp_path / "out", "--format", "squashfs", "--shard-size", "60K", "-q").returncode == 0
    seen: dict[str, bytes] = {}
    for s in load_manifest(tmp_path / "out").shards:
        image = tmp_path / "out" / s.name
        point = tmp_path / f"mnt-{image.stem}"
        point.mkdir()
        cmd = (["mount", "-t", "squashfs", "-o", "loop,ro"] if how == "kernel" else ["squashfuse", "-o", "ro"])
        r = subprocess.run([*cmd, str(image), str(point)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"{how} refused {image.name}: {r.stderr}"  # mounts work here: the image's fault
        try:
            seen.update(tree_of(point))
        finally:
            subprocess.run(["umount", str(point)] if how == "kernel" else ["fusermount3", "-u", str(point)], check=True)
    assert seen == tree_of(src)


@needs_fuse
def test_stage_mount_mounts_each_image_and_clean_unmounts_them(src: Path, tmp_path: Path) -> None:
    assert stager("pack", src, tmp_path / "out", "--format", "squashfs", "--shard-size", "60K", "-q").returncode == 0
    m = load_manifest(tmp_path / "out")
    dest = tmp_path / "dest"
    for _ in range(2):  # the second finds the copy staged and the images mounted: nothing changes
        r = stager("stage", tmp_path / "out", dest, "--mount", "--json")
        assert r.returncode == 0, r.stderr
    points = {str(dest / MOUNT_DIR / s.name.removesuffix(".sqfs")) for s in m.shards}
    assert mount_points(dest) == points
    seen: dict[str, bytes] = {}
    for p in points:
        assert filecmp.dircmp(p, src).left_only == []  # class folders, as ImageFolder reads them
        seen.update(tree_of(Path(p)))
    assert seen == tree_of(src)
    r = stager("clean", dest)
    assert r.returncode == 0, r.stderr
    assert mount_points(dest) == set() and not (dest / MOUNT_DIR).exists() and not (dest / MOUNTS_NAME).exists()
    assert sorted(os.listdir(dest)) == []


@needs_fuse
def test_mount_refusals_leave_nothing_mounted_or_behind(src: Path, tmp_path: Path) -> None:
    assert stager("pack", src, tmp_path / "tar", "--format", "tar", "-q").returncode == 0
    r = stager("stage", tmp_path / "tar", tmp_path / "d1", "--mount")
    assert r.returncode == 2 and "no file system images" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "d1" / "manifest.json").exists()  # refused before anything was copied
    assert stager("pack", src, tmp_path / "sq", "--format", "squashfs", "-q").returncode == 0
    dest = tmp_path / "d2"
    (dest / MOUNT_DIR / "shard-00000").mkdir(parents=True)
    (dest / MOUNT_DIR / "shard-00000" / "mine.txt").write_text("the user's")  # a non-empty mount point
    r = stager("stage", tmp_path / "sq", dest, "--mount")
    assert r.returncode == 2 and "not empty" in r.stderr, r.stderr
    assert mount_points(dest) == set() and not (dest / MOUNTS_NAME).exists()
    assert (dest / MOUNT_DIR / "shard-00000" / "mine.txt").read_text() == "the user's"
    env = {**os.environ, "PATH": "/nonexistent"}
    r = subprocess.run([sys.executable, "-m", "stager", "stage", str(tmp_path / "sq"), str(tmp_path / "d3"), "--mount"],
                       capture_output=True, text=True, check=False, env=env)
    assert r.returncode == 2 and "apt-get install squashfuse" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "d3" / "manifest.json").exists()


def _epilog(conf: Path, job: int, uid: int, gid: int) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": str(job), "SLURM_JOB_UID": str(uid), "SLURM_JOB_GID": str(gid),
           "STAGER_PROLOG_CONF": str(conf)}
    return subprocess.run(["bash", str(Path(__file__).parents[1] / "tools" / "slurm" / "stager-epilog")], env=env,
                          capture_output=True, text=True, check=False, timeout=120)


@needs_fuse
def test_the_epilog_unmounts_the_jobs_own_mounts_before_removing_its_directory(src: Path, tmp_path: Path) -> None:
    """The prolog service's Epilog (root) unmounts the FUSE mounts in job<id>/ as the job's user, then
    removes it. A mount the job's user could not unmount (another user's: here root's, in a job of uid
    64101) stays, and rm does not cross it."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("the Epilog runs as root and drops to the job's user with setpriv (util-linux)")
    assert stager("pack", src, tmp_path / "sq", "--format", "squashfs", "--shard-size", "60K", "-q").returncode == 0
    root = tmp_path / "prolog-root"
    root.mkdir(mode=0o755)
    conf = tmp_path / "prolog.conf"
    conf.write_text(f"STAGER_PROLOG_ROOT={root}\nSTAGER_PROLOG_STATE={tmp_path / 'state'}\n")
    job = root / "job77"
    job.mkdir(mode=0o700)
    r = stager("stage", tmp_path / "sq", job / "ds", "--mount")  # the job script's `stager stage --mount`
    assert r.returncode == 0, r.stderr
    assert len(mount_points(job)) == len(load_manifest(tmp_path / "sq").shards) > 1
    e = _epilog(conf, 77, 0, 0)
    assert e.returncode == 0, e.stderr
    assert mount_points(job) == set() and not job.exists()

    other = root / "job78"
    other.mkdir(mode=0o700)
    os.chown(other, 64101, 64101)
    point = other / "theirs"
    point.mkdir()
    subprocess.run(["squashfuse", "-o", "ro", str(tmp_path / "sq" / "shard-00000.sqfs"), str(point)], check=True)
    try:
        e = _epilog(conf, 78, 64101, 64101)
        assert e.returncode == 0, e.stderr
        assert mount_points(other) == {str(point)}, "the job's user unmounted a mount that is not theirs"
        assert any(point.iterdir())
    finally:
        subprocess.run(["fusermount3", "-u", str(point)], check=False)


def test_a_damaged_compressed_block_raises_naming_the_sample_or_is_skipped(tmp_path: Path) -> None:
    """on_error: a block that no longer decompresses is a CorruptSampleError naming the shard and key, or,
    with on_error='skip', that sample alone is skipped."""
    root = tmp_path / "src"
    rng = np.random.default_rng(5)
    from PIL import Image

    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(3):  # 270 KB BMPs: two compressed blocks of their own and a tail in a fragment
            Image.fromarray((rng.integers(0, 3, (300, 300, 3)) * 90).astype(np.uint8)).save(root / c / f"{i}.bmp")
    assert stager("pack", root, tmp_path / "out", "--format", "squashfs", "--compression", "zstd",
                  "-q").returncode == 0
    m = load_manifest(tmp_path / "out")
    s = m.shards[0]
    assert s.extents == "inodes"
    from stager.formats.squashfs import SquashImage
    from stager.formats.squashfs.shards import INODE

    victim = 4
    with SquashImage(tmp_path / "out" / s.name) as im:
        _, pieces = im.ref_pieces(int(s.offsets[victim]) - INODE)
    block = next(p for p in pieces if p.compressed and not p.fragment)
    with open(tmp_path / "out" / s.name, "r+b") as f:
        f.seek(block.offset + block.stored // 2)
        f.write(b"\xa5" * 64)
    kw = {"rank": 0, "world_size": 1, "decode": "uint8", "image_size": 8, "staged": False, "num_workers": 0}
    with pytest.raises(CorruptSampleError, match=s.name) as ei:
        list(make_loader(tmp_path / "out", 4, **kw))
    assert s.keys[victim] in str(ei.value)
    skip = make_loader(tmp_path / "out", 4, on_error="skip", **kw)
    assert sum(len(b["key"]) for b in skip) == s.samples - 1
    assert skip.stats()["skipped_keys"] == [s.keys[victim]]


def test_packing_loads_no_reading_side(src: Path, tmp_path: Path) -> None:
    """`stager pack --format squashfs` imports the writer's modules only (the image reader, its listing,
    tree walk and ImageFolder check are ~10 ms of a sub-second command's start), and the lazily imported
    names still resolve for readers."""
    code = ("import sys; from stager.cli import main; "
            f"rc = main(['pack', {str(src)!r}, {str(tmp_path / 'out')!r}, '--format', 'squashfs', '-q']); "
            "print(rc or 0, ' '.join(m.rsplit('.', 1)[1] for m in sys.modules "
            "if m.startswith('stager.formats.squashfs.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rc, *loaded = r.stdout.split()
    assert rc == "0", r.stderr
    assert "writer" in loaded
    assert not {"reader", "listing", "walk", "refs", "inodes", "dirtable", "folder"} & set(loaded)
    from stager.formats import squashfs

    assert squashfs.SquashImage.__name__ == "SquashImage" and squashfs.ImageListing.__name__ == "ImageListing"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = squashfs.Nope

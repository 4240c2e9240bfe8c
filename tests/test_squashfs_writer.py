"""stager's SquashFS writer: its images pass the real readers (unsquashfs extraction, the kernel's
driver, squashfuse, sqfs2tar/rdsquashfs) byte-exact, are deterministic, store JPEG/PNG as contiguous
ranges, and round-trip through stager's reader for any tree (Hypothesis)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stager.errors import SourceError, UsageError
from stager.formats.squashfs import SquashImage
from stager.formats.squashfs.writer import SquashWriter
from tests.squashfs_trees import HAVE_TOOLS, SIZES, assert_reads, dirs_of, fuse_unusable, kernel_unusable, make_tree

COMPRESSIONS = ("none", "gzip", "zstd", "xz", "lz4")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return make_tree(tmp_path_factory.mktemp("sqfs-src") / "src", big_dir=1500, depth=25)


def write(path: Path, files: dict[str, bytes], **opts: object) -> Path:
    with SquashWriter(path, **opts) as w:  # type: ignore[arg-type]
        for rel, data in files.items():
            w.add_file(rel, data)
    return path


def _extract_equal(image: Path, dest: Path, files: dict[str, bytes]) -> None:
    subprocess.run(["unsquashfs", "-q", "-n", "-d", str(dest), str(image)], check=True, stdout=subprocess.DEVNULL)
    found = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert found == set(files)
    for rel, data in files.items():
        assert (dest / rel).read_bytes() == data, rel


@pytest.mark.skipif(not HAVE_TOOLS, reason="needs squashfs-tools: apt-get install squashfs-tools")
@pytest.mark.parametrize("comp", COMPRESSIONS)
@pytest.mark.parametrize("frag", ["fragments", "no-fragments", "always"])
def test_unsquashfs_extracts_our_images_byte_exact(tree: dict[str, bytes], tmp_path: Path, comp: str,
                                                    frag: str) -> None:
    image = write(tmp_path / "img.sqfs", tree, compression=comp, fragments=frag != "no-fragments",
                  always_fragments=frag == "always", block_size=32 << 10)
    _extract_equal(image, tmp_path / "x", tree)
    assert_reads(image, tree, dirs_of(tree)).close()
    listed = subprocess.run(["unsquashfs", "-l", "-d", "", str(image)], check=True, capture_output=True).stdout
    assert {ln.decode()[1:] for ln in listed.splitlines() if ln.startswith(b"/")} == set(tree) | dirs_of(tree)


def _mount_check(cmd: list[str], umount: list[str], image: Path, mnt: Path, files: dict[str, bytes]) -> None:
    """Mount our image (where mounts can be made: a refusal is the image's fault) and compare the tree."""
    mnt.mkdir()
    r = subprocess.run([*cmd, str(image), str(mnt)], check=False, capture_output=True, text=True)
    assert r.returncode == 0, f"{cmd[0]} refused our image: {r.stderr.strip()}"
    try:
        found = {str(p.relative_to(mnt)) for p in mnt.rglob("*") if p.is_file()}
        assert found == set(files)
        for rel, data in files.items():
            assert (mnt / rel).read_bytes() == data, rel
        assert (mnt / "big").stat().st_nlink == 2
    finally:
        subprocess.run([*umount, str(mnt)], check=True)


@pytest.mark.parametrize("comp", COMPRESSIONS)
def test_kernel_mounts_our_images(tree: dict[str, bytes], tmp_path: Path, comp: str) -> None:
    why = kernel_unusable()
    if why:
        pytest.skip(why)
    image = write(tmp_path / "img.sqfs", tree, compression=comp)
    _mount_check(["mount", "-t", "squashfs", "-o", "loop,ro"], ["umount"], image, tmp_path / "mnt", tree)


@pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))
@pytest.mark.parametrize("comp", ["none", "zstd", "lz4"])
def test_squashfuse_mounts_our_images(tree: dict[str, bytes], tmp_path: Path, comp: str) -> None:
    image = write(tmp_path / "img.sqfs", tree, compression=comp)
    _mount_check(["squashfuse"], ["fusermount3", "-u"], image, tmp_path / "mnt", tree)


@pytest.mark.skipif(shutil.which("sqfs2tar") is None or shutil.which("rdsquashfs") is None,
                    reason="needs squashfs-tools-ng: apt-get install squashfs-tools-ng")
def test_squashfs_tools_ng_reads_our_images(tree: dict[str, bytes], tmp_path: Path) -> None:
    image = write(tmp_path / "img.sqfs", tree, compression="zstd")
    tar = tmp_path / "out.tar"
    with open(tar, "wb") as f:
        subprocess.run(["sqfs2tar", str(image)], stdout=f, check=True)
    with tarfile.open(tar) as t:
        got = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}  # type: ignore[union-attr]
    assert got == tree
    for rel in ("big/n00007_xxxxxxx.JPEG", "large/file.bin"):
        out = subprocess.run(["rdsquashfs", "-c", rel, str(image)], check=True, capture_output=True).stdout
        assert out == tree[rel]


def test_output_is_deterministic_and_independent_of_threads(tree: dict[str, bytes], tmp_path: Path) -> None:
    for comp in ("gzip", "zstd"):
        a = write(tmp_path / f"a-{comp}.sqfs", tree, compression=comp, threads=1).read_bytes()
        b = write(tmp_path / f"b-{comp}.sqfs", tree, compression=comp, threads=4).read_bytes()
        assert a == b


def test_precompressed_files_are_contiguous_and_their_offset_known_at_once(tmp_path: Path) -> None:
    """JPEG/PNG are stored without fragments: add_file gives the offset a loader preads; text is
    compressed (and not contiguous) unless compression is none."""
    files = {f"c{i % 3}/img{i}.{ext}": os.urandom(n) for i, (ext, n) in
             enumerate([("jpg", 50), ("png", 200_000), ("JPEG", 131072), ("jpg", 0), ("webp", 7000)])}
    files["c0/meta.json"] = b'{"a": 1}' * 500
    for comp in COMPRESSIONS:
        path = tmp_path / f"{comp}.sqfs"
        added = {}
        with SquashWriter(path, compression=comp) as w:
            for rel, data in files.items():
                added[rel] = w.add_file(rel, data)
        raw = path.read_bytes()
        for rel, a in added.items():
            if rel.endswith(".json") and comp != "none":
                assert a.raw_offset == -1
            else:
                assert raw[a.raw_offset : a.raw_offset + a.size] == files[rel]
        with SquashImage(path) as im:
            lst = im.listing()
            for i in lst.files().tolist():
                a = added[lst.paths[i]]
                if a.raw_offset >= 0 and a.size:
                    assert lst.raw_offset[i] == a.raw_offset
            assert_reads(path, files).close()


def test_compress_precompressed_compresses_them(tmp_path: Path) -> None:
    data = b"\xff\xd8\xff" + b"\0" * 100_000  # a "JPEG" that does compress
    plain = write(tmp_path / "a.sqfs", {"a/x.jpg": data}, compression="gzip")
    forced = write(tmp_path / "b.sqfs", {"a/x.jpg": data}, compression="gzip", compress_precompressed=True)
    assert forced.stat().st_size < plain.stat().st_size
    assert_reads(forced, {"a/x.jpg": data}).close()


def test_writer_refuses_bad_paths_and_options(tmp_path: Path) -> None:
    with SquashWriter(tmp_path / "a.sqfs") as w:
        w.add_file("a/b.jpg", b"1")
        with pytest.raises(SourceError, match="added twice"):
            w.add_file("a/b.jpg", b"2")
        with pytest.raises(SourceError, match="is a file"):
            w.add_file("a/b.jpg/c.jpg", b"2")
        for bad in ("", "/abs.jpg", "a/../b.jpg", "a/./b", "a//b", "a/b\n", "x" * 256):
            with pytest.raises(UsageError):
                w.add_file(bad, b"")
    for opts in ({"block_size": 3000}, {"block_size": 2 << 20}, {"compression": "lzo"}, {"compression": "brotli"},
                 {"compression": "gzip", "level": 12}, {"compression": "lz4", "level": 3}):
        with pytest.raises(UsageError):
            SquashWriter(tmp_path / "b.sqfs", **opts)  # type: ignore[arg-type]


def test_an_empty_image_and_a_large_flat_directory(tmp_path: Path) -> None:
    empty = write(tmp_path / "e.sqfs", {})
    with SquashImage(empty) as im:
        assert len(im.listing()) == 0
    flat = {f"{k:06d}_{'y' * (k % 50)}.txt": b"%d" % k for k in range(30_000)}
    assert_reads(write(tmp_path / "f.sqfs", flat, compression="zstd"), flat).close()


NAME = st.text(st.characters(codec="utf-8", min_codepoint=0x20, exclude_characters="/\x7f"), min_size=1,
               max_size=12).filter(lambda s: s not in (".", "..") and len(s.encode()) < 255)
SIZE = st.one_of(st.sampled_from(SIZES), st.integers(0, 20_000),
                 st.sampled_from([4095, 4096, 4097, 8191, 8192, 8193, 12288]))


@st.composite
def trees(draw: st.DrawFn) -> dict[str, bytes]:
    paths = draw(st.lists(st.lists(NAME, min_size=1, max_size=4), min_size=0, max_size=25))
    files: dict[str, bytes] = {}
    taken: set[str] = set()
    for parts in paths:
        rel = "/".join(parts)
        prefixes = {"/".join(parts[:k]) for k in range(1, len(parts))}
        if rel in taken or prefixes & set(files) or any(f.startswith(rel + "/") for f in files):
            continue
        n = draw(SIZE)
        kind = draw(st.sampled_from(["zeros", "text", "random"]))
        data = bytes(n) if kind == "zeros" else (b"abc%d" % n * n)[:n] if kind == "text" else os.urandom(n)
        files[rel] = data
        taken.add(rel)
        taken.update(prefixes)
    return files


@settings(max_examples=40, deadline=dt.timedelta(seconds=20), derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(files=trees(), opts=st.fixed_dictionaries({"compression": st.sampled_from(["none", "gzip", "zstd", "lz4"]),
                                                   "fragments": st.booleans(), "always_fragments": st.booleans()}),
       exts=st.booleans())
def test_writer_reader_round_trip(tmp_path: Path, files: dict[str, bytes], opts: dict[str, object], exts: bool) -> None:
    if exts:  # half the examples as .jpg: stored, contiguous
        files = {f"{k}.jpg": v for k, v in files.items()}
    path = tmp_path / "rt.sqfs"
    write(path, files, block_size=4096, **opts)
    assert_reads(path, files, dirs_of(files)).close()

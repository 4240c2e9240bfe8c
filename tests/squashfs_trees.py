"""Source trees and checks shared by the SquashFS codec tests (tests/test_squashfs_*.py).

:func:`make_tree` writes a tree that exercises what images hold: sizes at and around the block and
fragment boundaries, empty files, a multi-block file, two identical files (mksquashfs's duplicate
detection), a sparse file, an xattr (an extended inode), a deep chain of folders, a folder large
enough for an indexed listing, and names with spaces and non-ASCII letters. :func:`fuse_unusable` and
:func:`kernel_unusable` say why a mount cannot be made here (the only reasons a mount test skips).
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from stager.formats.squashfs import SquashImage

HAVE_TOOLS = shutil.which("mksquashfs") is not None and shutil.which("unsquashfs") is not None


def fuse_unusable() -> str | None:
    """Why a squashfuse mount cannot be made on this machine, or None. Only what truly stops one: the
    programs missing (tools/setup_venv.sh installs them as root with apt) or no ``/dev/fuse`` (a
    container started without the device). Anything else that makes a mount fail is a test failure,
    never a skip: it may be the image's fault."""
    missing = [p for p in ("squashfuse", "fusermount3") if shutil.which(p) is None]
    if missing:
        return f"needs {' and '.join(missing)}: apt-get install squashfuse fuse3 (tools/setup_venv.sh does, as root)"
    try:
        if stat.S_ISCHR(os.stat("/dev/fuse").st_mode):
            return None
    except FileNotFoundError:
        pass
    return "no /dev/fuse device here (a container started without --device /dev/fuse): no FUSE mount can be made"


@functools.cache
def kernel_unusable() -> str | None:
    """Why the kernel's squashfs driver cannot mount an image here, or None: not root, no ``mount``, or a
    loop mount of an image made by ``mksquashfs`` (not by stager: a failure of ours must fail, not skip)
    refused (no loop devices or no squashfs driver in a container)."""
    if os.geteuid() != 0 or shutil.which("mount") is None or not HAVE_TOOLS:
        return "the kernel's squashfs driver needs root, mount and mksquashfs (apt-get install mount squashfs-tools)"
    with tempfile.TemporaryDirectory(prefix="stager-loop-probe-") as tmp:
        (Path(tmp) / "tree").mkdir()
        (Path(tmp) / "tree" / "f").write_bytes(b"probe")
        image = mksquashfs(Path(tmp) / "tree", Path(tmp) / "probe.sqfs")
        (Path(tmp) / "mnt").mkdir()
        r = subprocess.run(["mount", "-t", "squashfs", "-o", "loop,ro", str(image), str(Path(tmp) / "mnt")],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            return f"the kernel cannot loop-mount even a mksquashfs image here: {' '.join(r.stderr.split())[:200]}"
        subprocess.run(["umount", str(Path(tmp) / "mnt")], check=True)
    return None
SIZES = (0, 1, 100, 4095, 4096, 4097, 8191, 65536, 131071, 131072, 131073, 262144, 300001)


def make_tree(root: Path, *, seed: int = 0, big_dir: int = 600, depth: int = 40) -> dict[str, bytes]:
    """Write the tree; return ``{relative path: bytes}`` of its regular files."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i, n in enumerate(SIZES):
        files[f"sizes/rand_{i:02d}.bin"] = rng.randbytes(n)
        files[f"sizes/text_{i:02d}.txt"] = (b"line %d of a compressible text\n" % i * (n // 30 + 1))[:n]
    files["dups/one.bin"] = files["dups/two.bin"] = rng.randbytes(150_000)
    files["large/file.bin"] = rng.randbytes(3_000_000) + bytes(400_000) + rng.randbytes(5)
    files["names/with space.txt"] = b"space"
    files["names/ünïcödé ñame.txt"] = b"unicode"
    files["names/日本語.jpg"] = rng.randbytes(2000)
    deep = "/".join(f"d{k}" for k in range(depth))
    files[f"deep/{deep}/leaf.txt"] = b"deep leaf"
    for k in range(big_dir):
        files[f"big/n{k:05d}_{'x' * (k % 37)}.JPEG"] = rng.randbytes(rng.randrange(0, 3000))
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "emptydir").mkdir()
    os.setxattr(root / "sizes" / "text_05.txt", "user.stager", b"extended inode")
    with open(root / "large" / "sparse.bin", "wb") as f:  # holes: mksquashfs writes sparse blocks
        f.seek(1 << 20)
        f.write(b"end")
        files["large/sparse.bin"] = bytes(1 << 20) + b"end"
    return files


def mksquashfs(src: Path, out: Path, *opts: str) -> Path:
    subprocess.run(["mksquashfs", str(src), str(out), "-noappend", "-quiet", "-no-progress", *opts], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def assert_reads(image: Path, files: dict[str, bytes], dirs: set[str] | None = None) -> SquashImage:
    """Every file of ``files`` reads back byte-exact, one at a time and in bulk, and the listing holds
    exactly these files (and ``dirs``); a stored contiguous file is at its ``raw_offset``."""
    im = SquashImage(image)
    lst = im.listing()
    paths = [lst.paths[i] for i in range(len(lst))]
    got_files = {paths[int(i)] for i in lst.files()}
    assert got_files == set(files)
    if dirs is not None:
        assert {paths[i] for i in range(len(lst)) if lst.kind[i] == 1} == dirs
    idx = lst.files()
    for i in idx.tolist():
        assert im.read(i) == files[paths[i]], paths[i]
    assert im.read_many(idx[::-1]) == [files[paths[i]] for i in idx[::-1].tolist()]
    for i in idx[:: max(1, len(idx) // 50)].tolist():  # by inode reference, without the listing
        assert im.read_ref(int(lst.inode_ref[i])) == files[paths[i]]
    shuffled = idx[random.Random(1).sample(range(len(idx)), len(idx))]  # every file by reference, in bulk
    assert im.read_refs(lst.inode_ref[shuffled]) == [files[paths[i]] for i in shuffled.tolist()]
    raw = idx[lst.raw_offset[idx] >= 0]
    with open(image, "rb") as f:
        for i in raw.tolist():
            f.seek(int(lst.raw_offset[i]))
            assert f.read(int(lst.size[i])) == files[paths[i]]
    return im


def dirs_of(files: dict[str, bytes], extra: tuple[str, ...] = ()) -> set[str]:
    out = set(extra)
    for rel in files:
        parts = rel.split("/")[:-1]
        out.update("/".join(parts[: k + 1]) for k in range(len(parts)))
    return out


def mksquashfs_of_pack(pack_dir: Path, index_dir: Path, *opts: str) -> Path:
    """The ImageFolder tree of a stager squashfs pack, made again by mksquashfs (``opts``: e.g. ``-comp
    zstd``; its defaults put small files in compressed fragments) one image per shard, and adopted with
    ``stager index --out index_dir``: a dataset whose samples are read through their inodes."""
    from stager.index import IndexOptions, index_dataset
    from stager.manifest import load_manifest

    images = index_dir.parent / f"{index_dir.name}-images"
    images.mkdir(parents=True)
    for s in load_manifest(pack_dir).shards:
        tree = images / f"{s.name}.tree"
        subprocess.run(["unsquashfs", "-q", "-n", "-d", str(tree), str(pack_dir / s.name)], check=True,
                       stdout=subprocess.DEVNULL)
        mksquashfs(tree, images / s.name, *opts)
        shutil.rmtree(tree)
    index_dataset(images, index_dir, IndexOptions())
    return index_dir

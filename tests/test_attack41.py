"""Attacks on issue 41's surfaces (SquashFS images packed, adopted, read without a mount, staged with
``--mount``, cleaned, unmounted by the Epilog), each a defect found and fixed; every test fails on the
code before its fix.

* ``clean`` through a path with a symbolic link in it (``$HOME/scratch -> /local/...``) found no mount
  (mountinfo holds real paths), removed the record and left the images mounted: it now looks mounts
  up by the real path of the DEST it holds open.
* Slurm (proctrack/cgroup) ends every process of a job step when the step ends, squashfuse's daemon
  included: the documented ``srun stager stage --mount`` step left a mount that answered "Transport
  endpoint is not connected" to the training step, and a rerun of ``stage --mount`` took the dead
  mount for a live one. A PID namespace (``unshare --pid --fork``) is such a step here: the kernel
  ends every process in it when its first one exits. Now a dead mount is mounted again, and the
  recipe mounts in the step that reads.
* ``stage --repair --mount`` replaced a damaged image but left the mount serving the old, damaged
  file (squashfuse keeps it open): an image replaced since its mount is mounted again.
* Ctrl-C while squashfuse was mounting left the mount behind and dropped the record naming it.
* ``clean`` needed squashfuse on PATH to unmount (it needs only fusermount).
* A mount stage did not make at ``DEST/mnt/<shard>`` was taken as stage's, and ``clean`` unmounted it.
* An image whose names are not UTF-8 was indexed, and the loader, conversion and messages then failed
  with a traceback (a class folder: ``stager index`` itself): such names are now refused with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.errors import UnsafeArchiveError
from stager.formats.squashfs import SquashImage
from stager.manifest import load_manifest
from stager.stage import stage
from stager.stage.clean import clean
from stager.stage.mount import MOUNT_DIR, MOUNTS_NAME, mount_points
from tests.cli_support import AS_TYPED
from tests.squashfs_trees import HAVE_TOOLS, fuse_unusable, mksquashfs
from tools.datagen import make_imagefolder

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="needs squashfs-tools: apt-get install squashfs-tools")
needs_fuse = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))
UNSHARE = shutil.which("unshare")


@pytest.fixture(autouse=True)
def _nothing_stays_mounted(tmp_path: Path) -> Iterator[None]:
    """Whatever a test leaves mounted under its directory (when it fails half-way) is unmounted."""
    yield
    for point in sorted(mount_points(tmp_path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point] if os.geteuid() == 0 else ["fusermount3", "-u", "-z", point],
                       check=False, capture_output=True)


def stager(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stager", *map(str, args)], capture_output=True, text=True,
                          check=False, env=env, timeout=300)


def tree_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("a41") / "train", num_classes=2, per_class=4, seed=41,
                            size=(24, 20))


@pytest.fixture(scope="module")
def pack(src: Path) -> Path:
    out = src.parent / "sqfs"
    r = stager("pack", src, out, "--format", "squashfs", "-q")
    assert r.returncode == 0, r.stderr
    return out


def step_unusable() -> str | None:
    """Why a PID namespace cannot stand in for a Slurm step here, or None."""
    if UNSHARE is None or os.geteuid() != 0:
        return "a job step is modelled by a PID namespace: needs root and unshare (util-linux)"
    r = subprocess.run([UNSHARE, "--pid", "--fork", "true"], capture_output=True, text=True, check=False)
    return None if r.returncode == 0 else f"unshare --pid refused here: {r.stderr.strip()}"


def in_a_step(*argv: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    """``argv`` as a job step under proctrack/cgroup: when it exits, everything it started ends (the kernel
    kills a PID namespace's processes when its first one exits, before ``unshare`` returns)."""
    return subprocess.run([str(UNSHARE), "--pid", "--fork", "--kill-child", *map(str, argv)], capture_output=True,
                          text=True, check=False, timeout=300)


def answers(point: Path) -> bool:
    try:
        os.listdir(point)
    except OSError:
        return False
    return True


# ---- clean --------------------------------------------------------------------------------------------
@needs_fuse
def test_clean_through_a_symlinked_path_unmounts_what_stage_mounted(pack: Path, src: Path, tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "local")  # $HOME/scratch -> /local/$USER, as on many clusters
    dest = tmp_path / "local" / "ds"
    stage(pack, dest, mount=True)
    assert len(mount_points(dest)) == 1
    r = stager("clean", tmp_path / "scratch" / "ds", "--json")
    assert r.returncode == 0, r.stderr
    assert mount_points(dest) == set(), "clean removed the record and left the image mounted"
    assert not (dest / MOUNT_DIR).exists() and not (dest / MOUNTS_NAME).exists()


@needs_fuse
def test_clean_unmounts_with_fusermount_alone(pack: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ds"
    stage(pack, dest, mount=True)
    tools = tmp_path / "bin"  # a shell where squashfuse is not on PATH (a module not loaded): fusermount is
    tools.mkdir()
    (tools / "fusermount3").symlink_to(shutil.which("fusermount3") or "/bin/fusermount3")
    r = stager("clean", dest, env={**os.environ, "PATH": str(tools)})
    assert r.returncode == 0, r.stderr
    assert mount_points(dest) == set()


# ---- mounts that ended, or that serve a replaced image ------------------------------------------------
@needs_fuse
def test_a_mount_whose_daemon_ended_with_its_step_is_mounted_again(pack: Path, src: Path, tmp_path: Path) -> None:
    why = step_unusable()
    if why:
        pytest.skip(why)
    dest = tmp_path / "ds"
    r = in_a_step(sys.executable, "-m", "stager", "stage", pack, dest, "--mount", "-q")
    assert r.returncode == 0, r.stderr
    point = dest / MOUNT_DIR / "shard-00000"
    assert mount_points(dest) == {str(point)} and not answers(point)  # the step ended: squashfuse with it
    r = stager("stage", pack, dest, "--mount", "--json")
    assert r.returncode == 0, r.stderr
    assert answers(point), "stage --mount kept a mount whose squashfuse had ended"
    assert tree_of(point) == tree_of(src)
    clean(dest)
    assert mount_points(dest) == set()


@needs_fuse
def test_repair_mounts_the_replaced_image_again(pack: Path, src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ds"
    stage(pack, dest, mount=True)
    image = dest / "shard-00000.sqfs"
    with SquashImage(image) as im:  # damage a stored JPEG in place, before anything read it through the mount
        lst = im.listing()
        i = int(lst.files()[0])
        rel, at = lst.paths[i], int(lst.raw_offset[i])
    with open(image, "r+b") as f:
        f.seek(at + 64)
        f.write(b"\xa5" * 32)
    result = stage(pack, dest, mount=True, repair=True)
    assert result.repaired and result.mounts == [str(dest / MOUNT_DIR / "shard-00000")]
    assert (dest / MOUNT_DIR / "shard-00000" / rel).read_bytes() == (src / rel).read_bytes(), \
        "the mount still serves the damaged image that --repair replaced"
    clean(dest)


@needs_fuse
def test_a_mount_stage_did_not_make_is_refused_and_left_alone(pack: Path, tmp_path: Path) -> None:
    dest = tmp_path / "ds"
    stage(pack, dest)
    point = dest / MOUNT_DIR / "shard-00000"
    point.mkdir(parents=True)
    subprocess.run(["squashfuse", "-o", "ro", str(dest / "shard-00000.sqfs"), str(point)], check=True)
    r = stager("stage", pack, dest, "--mount", "--json")
    assert r.returncode == 2 and str(point) in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert json.loads(r.stdout)["exit_code"] == 2
    assert not (dest / MOUNTS_NAME).exists()  # no record claims the user's mount for clean to unmount
    clean(dest)
    assert mount_points(dest) == {str(point)} and answers(point)


# ---- Ctrl-C while mounting ----------------------------------------------------------------------------
@needs_fuse
def test_ctrl_c_while_squashfuse_mounts_leaves_nothing_mounted(pack: Path, tmp_path: Path) -> None:
    shims = tmp_path / "shims"
    shims.mkdir()
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    real = shutil.which("squashfuse")
    # squashfuse that has mounted, says so, and is still running when stager is interrupted
    (shims / "squashfuse").write_text(f'#!/bin/bash\n"{real}" "$@" || exit $?\nprintf m > "{ready}"\n'
                                      "exec sleep infinity\n")
    (shims / "squashfuse").chmod(0o755)
    dest = tmp_path / "ds"
    stage(pack, dest)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"}
    proc = subprocess.Popen([*AS_TYPED, sys.executable, "-m", "stager", "stage", str(pack), str(dest), "--mount",
                             "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        with open(ready, "rb") as f:  # the event: the image is mounted
            assert f.read() == b"m"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert json.loads(out)["exit_code"] == 130
    assert mount_points(dest) == set(), "the interrupted stage left the image mounted"
    assert not (dest / MOUNT_DIR).exists() and not (dest / MOUNTS_NAME).exists()


# ---- the documented job script, with steps that end ------------------------------------------------------
@needs_fuse
def test_the_stage_mount_recipe_survives_the_end_of_each_step(pack: Path, src: Path, tmp_path: Path) -> None:
    """docs/staging.md's stage-mount recipe, with ``srun`` a step whose processes end with it (as under
    proctrack/cgroup): the training step reads a live mount."""
    why = step_unusable()
    if why:
        pytest.skip(why)
    from tests.test_docs_recipes import TRAIN, recipes, run_recipe

    classes = sorted(p.name for p in src.iterdir())
    expect = tmp_path / "expect.tsv"
    expect.write_text("".join(f"{p.relative_to(src)}\t{classes.index(p.parent.name)}\n"
                              for p in sorted(src.rglob("*")) if p.is_file()))
    shims = tmp_path / "shims"
    shims.mkdir()
    for name, body in (("srun", f'while [ "${{1#-}}" != "$1" ]; do shift; done\nexec "{UNSHARE}" --pid --fork '
                                '--kill-child "$@"\n'),
                       ("python", f'exec {sys.executable} "$@"\n'),
                       ("stager", f'exec {sys.executable} -m stager "$@"\n')):
        (shims / name).write_text("#!/bin/bash\n" + body)
        (shims / name).chmod(0o755)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "train.py").write_text(TRAIN)
    (tmp_path / "slurm-tmp").mkdir()
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "SLURM_TMPDIR": str(tmp_path / "slurm-tmp"),
           "EXPECT": str(expect), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    assert "stage-mount" in recipes()
    data = {"base": tmp_path / "base", "pack": pack, "image": tmp_path / "unused.sqfs"}
    r = run_recipe("stage-mount", data, env, tmp_path)
    assert r.returncode == 0 and f"train.py: ok {len(tree_of(src))}" in r.stdout, r.stderr
    dest = tmp_path / "slurm-tmp" / "imagenet"
    assert mount_points(dest) == set() and not (dest / MOUNT_DIR).exists()


# ---- names that are not UTF-8 -----------------------------------------------------------------------------
def _tree_with(tmp_path: Path, src: Path, rel: bytes) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(src, tree)
    target = os.path.join(os.fsencode(tree), rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(next(src.rglob("*.JPEG")), target)
    return mksquashfs(tree, tmp_path / "img.sqfs")


@pytest.mark.parametrize("rel", [b"n00000000/caf\xe9.jpg", b"cl\xe4ss/a.jpg"], ids=["file", "class folder"])
def test_names_that_are_not_utf8_are_refused_with_one_line(src: Path, tmp_path: Path, rel: bytes) -> None:
    image = _tree_with(tmp_path, src, rel)
    with pytest.raises(UnsafeArchiveError, match="not UTF-8"), SquashImage(image) as im:
        im.listing()
    r = stager("index", image, "--out", tmp_path / "idx", "--json")
    assert r.returncode == 3 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    obj = json.loads(r.stdout)
    assert obj["exit_code"] == 3 and str(image) in obj["error"] and "UTF-8" in obj["error"], obj
    assert not (tmp_path / "idx" / "manifest.json").exists()
    r = stager("pack", image, tmp_path / "conv", "--format", "tar", "-q")  # converting the image in place
    assert r.returncode == 3 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_an_image_with_utf8_names_still_indexes(src: Path, tmp_path: Path) -> None:
    image = _tree_with(tmp_path, src, "n00000000/café ü 日本.jpg".encode())
    r = stager("index", image, "--out", tmp_path / "idx", "-q")
    assert r.returncode == 0, r.stderr
    assert "n00000000/café ü 日本" in list(load_manifest(tmp_path / "idx").shards[0].keys)


# ---- a deep tree of long names ------------------------------------------------------------------------------
def _deep(path: Path, depth: int) -> Path:
    from stager.formats.squashfs.writer import SquashWriter

    with SquashWriter(path, compression="gzip", block_size=4096) as w:
        w.add_file("/".join(f"d{k:04d}" + "x" * 245 for k in range(depth)) + "/f.jpg", b"\xff\xd8")
    return path


def test_a_path_longer_than_path_max_is_refused_before_it_costs_memory(tmp_path: Path) -> None:
    """Every entry's path is kept whole, so a deep tree of 250-byte names cost memory quadratic in its depth
    (2.3 GB for a 53 KB image of 3,000 levels); no program can open a path past PATH_MAX anyway."""
    assert len(SquashImage(_deep(tmp_path / "ok.sqfs", 16)).listing()) == 17  # 16 x 250 + 15 + 6 bytes: fine
    image = _deep(tmp_path / "deep.sqfs", 17)
    with pytest.raises(UnsafeArchiveError, match="PATH_MAX"), SquashImage(image) as im:
        im.listing()
    r = stager("index", image, "--out", tmp_path / "idx", "--json")
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and len(r.stderr) < 600, r.stderr
    assert json.loads(r.stdout)["exit_code"] == 3


# ---- where the messages send a newcomer ------------------------------------------------------------------------
def test_the_missing_squashfuse_message_names_a_section_that_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from stager.errors import MissingBackendError
    from stager.stage.mount import tools

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MissingBackendError) as ei:
        tools()
    (section,) = re.findall(r'docs/staging\.md, "([^"]+)"', str(ei.value))
    headings = [ln.lstrip("#").strip() for ln in (Path(__file__).resolve().parents[1] / "docs" / "staging.md")
                .read_text().splitlines() if ln.startswith("#")]
    assert any(h.startswith(section) for h in headings), (section, "is no heading of docs/staging.md")


@needs_fuse
def test_images_a_and_a_sqfs_get_mount_points_of_their_own(pack: Path, src: Path, tmp_path: Path) -> None:
    """Adopted images ``a`` (found by its magic) and ``a.sqfs`` both mapped to ``DEST/mnt/a``: the second mount
    was refused as "not empty" (the first image), telling the user to move their files away."""
    images = tmp_path / "images"
    images.mkdir()
    shutil.copyfile(pack / "shard-00000.sqfs", images / "a")
    other = {"other/" + p.split("/")[1]: b for p, b in tree_of(src).items() if p.startswith("n00000001/")}
    (tmp_path / "half" / "other").mkdir(parents=True)
    for rel, data in other.items():
        (tmp_path / "half" / rel).write_bytes(data)
    mksquashfs(tmp_path / "half", images / "a.sqfs")
    r = stager("index", images, "--out", tmp_path / "idx", "-q")
    assert r.returncode == 0, r.stderr
    dest = tmp_path / "ds"
    result = stage(tmp_path / "idx", dest, mount=True)
    assert sorted(result.mounts) == [str(dest / MOUNT_DIR / "a"), str(dest / MOUNT_DIR / "a.sqfs")]
    assert tree_of(dest / MOUNT_DIR / "a") == tree_of(src) and tree_of(dest / MOUNT_DIR / "a.sqfs") == other
    clean(dest)
    assert mount_points(dest) == set()


def test_a_tar_member_name_that_is_not_utf8_is_one_line_and_exit_3(tmp_path: Path) -> None:
    """Found beside the images: ``stager index`` of a webdataset tar with a Latin-1 member name crashed with
    a UnicodeEncodeError traceback (exit 1) where the keys were checked. Now one line naming the shard and
    the member, exit 3, and no index written; the same tar with UTF-8 names indexes."""
    import io
    import tarfile

    import numpy as np

    from tools.datagen import jpeg_bytes, render_image

    data = jpeg_bytes(render_image(np.random.default_rng(0), 0, 2, 16, 16))
    for names, ok in ((["s1.jpg", "s\xe92.jpg"], False), (["s1.jpg", "s\xe92.jpg"], True)):
        src = tmp_path / f"src-{ok}"
        src.mkdir()
        with tarfile.open(src / "a-000000.tar", "w", format=tarfile.GNU_FORMAT,
                          encoding="utf-8" if ok else "latin-1") as t:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        r = stager("index", src, "--out", tmp_path / f"idx-{ok}", "--json")
        if ok:
            assert r.returncode == 0, r.stderr
            continue
        assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
        (line,) = r.stdout.splitlines()
        err = json.loads(line)["error"]
        assert "a-000000.tar" in err and "not UTF-8" in err and "s\\udce92.jpg" in err, err
        assert not (tmp_path / f"idx-{ok}").exists()

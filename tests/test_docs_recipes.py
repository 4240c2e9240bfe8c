"""The SquashFS recipes of docs/staging.md ("SquashFS images: read in place, or mounted") run as written.

Each recipe is a fenced block after a ``<!-- recipe: NAME -->`` marker. It runs in bash with its
example paths replaced by test data (a ``stager pack --format squashfs`` of a small ImageFolder tree
for ``/lustre/proj/imagenet-sqfs``, a ``mksquashfs`` image of it for
``/shared/datasets/imagenet-train.sqfs``), ``srun`` by a stand-in that runs its command on this node,
and ``train.py`` by a script that reads ``--data`` as torchvision's ImageFolder does (torchvision's own
when installed) and checks every sample against the tree. Afterwards nothing may stay mounted.
Apptainer cannot be installed here (Debian has no apptainer package; its ``singularity`` is a game),
so that recipe is skipped saying so; the squashfuse, kernel and Epilog recipes run for real.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.stage.mount import mount_points
from tests.squashfs_trees import HAVE_TOOLS, fuse_unusable, kernel_unusable, mksquashfs
from tools.datagen import make_imagefolder

REPO = Path(__file__).resolve().parents[1]
STAGING = REPO / "docs" / "staging.md"
MARK = re.compile(r"^<!-- recipe: ([\w-]+) -->\n```bash\n(.*?)^```", re.M | re.S)

pytestmark = pytest.mark.skipif(not HAVE_TOOLS, reason="needs squashfs-tools: apt-get install squashfs-tools")

TRAIN = r'''
import argparse, os, sys
from PIL import Image
p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
root = p.parse_args().data
try:
    from torchvision.datasets import ImageFolder
    samples = ImageFolder(root).samples
except ImportError:  # ImageFolder's rules: sorted class folders, image extensions, any depth
    exts = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = [(os.path.join(d, f), i) for i, c in enumerate(classes)
               for d, _, fs in sorted(os.walk(os.path.join(root, c))) for f in sorted(fs) if f.lower().endswith(exts)]
want = {l.split("\t")[0]: int(l.split("\t")[1]) for l in open(os.environ["EXPECT"]).read().splitlines()}
got = {os.path.relpath(path, root): label for path, label in samples}
assert got == want, (sorted(got)[:3], sorted(want)[:3])
for path, _ in samples:
    Image.open(path).convert("RGB")
print("train.py: ok", len(samples))
'''


def recipes() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in MARK.finditer(STAGING.read_text())}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("recipes")
    src = make_imagefolder(base / "train", num_classes=3, per_class=6, seed=8, size=(24, 20))
    subprocess.run([sys.executable, "-m", "stager", "pack", str(src), str(base / "sqfs"), "--format", "squashfs",
                    "-q"], check=True)
    image = mksquashfs(src, base / "imagenet-train.sqfs", "-comp", "zstd")
    classes = sorted(p.name for p in src.iterdir())
    expect = base / "expect.tsv"
    expect.write_text("".join(f"{p.relative_to(src)}\t{classes.index(p.parent.name)}\n"
                              for p in sorted(src.rglob("*")) if p.is_file()))
    shims = base / "shims"
    shims.mkdir()
    for name, body in (("srun", 'while [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n'),
                       ("python", f'exec {sys.executable} "$@"\n'),
                       ("stager", f'exec {sys.executable} -m stager "$@"\n')):
        (shims / name).write_text("#!/bin/bash\n" + body)
        (shims / name).chmod(0o755)
    (base / "train.py").write_text(TRAIN)
    return {"base": base, "pack": base / "sqfs", "image": image, "expect": expect, "shims": shims}


@pytest.fixture
def sandbox(data: dict[str, Path], tmp_path: Path) -> Iterator[dict[str, str]]:
    (tmp_path / "slurm-tmp").mkdir()
    env = {**os.environ, "PATH": f"{data['shims']}:{os.environ['PATH']}", "SLURM_TMPDIR": str(tmp_path / "slurm-tmp"),
           "EXPECT": str(data["expect"]), "PYTHONPATH": str(REPO)}
    yield env
    for point in sorted(mount_points(tmp_path), key=len, reverse=True):
        subprocess.run(["umount", "-l", point] if os.geteuid() == 0 else ["fusermount3", "-u", "-z", point],
                       check=False, capture_output=True)


def run_recipe(name: str, data: dict[str, Path], env: dict[str, str],
               tmp_path: Path) -> subprocess.CompletedProcess[str]:
    text = recipes()[name]
    for old, new in (("/lustre/proj/imagenet-sqfs", data["pack"]),
                     ("/shared/datasets/imagenet-train.sqfs", data["image"]),
                     ("/mnt/imagenet", tmp_path / "mnt-imagenet"),
                     ("/opt/stager/tools/slurm", REPO / "tools" / "slurm")):
        text = text.replace(old, str(new))
    shutil.copy(data["base"] / "train.py", tmp_path / "train.py")
    return subprocess.run(["bash", "-c", text], cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
                          timeout=600)


def test_every_recipe_is_tested() -> None:
    assert set(recipes()) == {"stage-mount", "squashfuse", "kernel", "apptainer", "epilog"}


def needs_fuse() -> None:
    why = fuse_unusable()
    if why:
        pytest.skip(why)


def test_stage_mount_recipe(data: dict[str, Path], sandbox: dict[str, str], tmp_path: Path) -> None:
    needs_fuse()
    r = run_recipe("stage-mount", data, sandbox, tmp_path)
    assert r.returncode == 0 and "train.py: ok 18" in r.stdout, r.stderr
    dest = tmp_path / "slurm-tmp" / "imagenet"
    assert mount_points(dest) == set() and not (dest / "mnt").exists()  # the EXIT trap's clean unmounted


def test_squashfuse_recipe(data: dict[str, Path], sandbox: dict[str, str], tmp_path: Path) -> None:
    needs_fuse()
    r = run_recipe("squashfuse", data, sandbox, tmp_path)
    assert r.returncode == 0 and "train.py: ok 18" in r.stdout, r.stderr
    assert mount_points(tmp_path) == set()


def test_kernel_recipe(data: dict[str, Path], sandbox: dict[str, str], tmp_path: Path) -> None:
    why = kernel_unusable()
    if why:
        pytest.skip(why)
    r = run_recipe("kernel", data, sandbox, tmp_path)
    assert r.returncode == 0 and "train.py: ok 18" in r.stdout, r.stderr
    assert mount_points(tmp_path) == set()


def test_apptainer_recipe(data: dict[str, Path], sandbox: dict[str, str], tmp_path: Path) -> None:
    if shutil.which("apptainer") is None:
        pytest.skip("Apptainer is not installable here: Debian has no apptainer package (its `singularity` is a "
                    "game); install it from apptainer.org to run this recipe")
    r = run_recipe("apptainer", data, sandbox, tmp_path)
    assert r.returncode == 0 and "train.py: ok 18" in r.stdout, r.stderr


def test_epilog_recipe(data: dict[str, Path], sandbox: dict[str, str], tmp_path: Path) -> None:
    """A job directory with the job's squashfuse mounts (the job's user is root here: FUSE is root's
    alone on this machine) is unmounted and removed."""
    needs_fuse()
    if shutil.which("setpriv") is None:
        pytest.skip("the Epilog drops to the job's user with setpriv: apt-get install util-linux")
    job = tmp_path / "job9"
    r = subprocess.run([sys.executable, "-m", "stager", "stage", str(data["pack"]), str(job / "ds"), "--mount", "-q"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and mount_points(job), r.stderr
    env = {**sandbox, "JOBDIR": str(job), "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GID": str(os.getgid())}
    r = run_recipe("epilog", data, env, tmp_path)
    assert r.returncode == 0, r.stderr
    assert mount_points(job) == set() and not job.exists()

"""``stager hints`` advice that works when followed literally (issue 38.12).

Its ``next`` commands are run exactly as printed (``stager`` being this checkout's CLI): for an image
tree that is ``stager pack`` and then ``stager stage`` of the pack (``stage`` refuses an image tree).
``lfs setstripe`` is advised only where it means something: on Lustre (tests/test_lustre.py covers
that side with the stand-in ``lfs``).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from stager.shardcheck import verify
from tests.cli_support import clean_env, stager


def test_off_lustre_no_striping_is_advised(imagenet_tiny: Path, imagenet_tiny_tar: Path) -> None:
    for path in (imagenet_tiny, imagenet_tiny_tar):
        r = stager("hints", path, "--json")
        rep = json.loads(r.stdout)
        assert r.returncode == 0 and not rep["lustre"]["is_lustre"], r.stderr
        assert rep["lustre"]["recommended"] is None and "setstripe" not in r.stdout
        assert "setstripe" not in stager("hints", path).stdout


def test_the_next_commands_work_when_followed_literally(imagenet_tiny: Path, tmp_path: Path) -> None:
    tree = tmp_path / "my images"  # a space: the commands must be quoted to be followed literally
    shutil.copytree(imagenet_tiny, tree)
    local = tmp_path / "local"
    local.mkdir()
    env = clean_env(TMPDIR=str(local))
    rep = json.loads(stager("hints", tree, "--json", env=env).stdout)
    assert [shlex.split(c)[:2] for c in rep["next"]] == [["stager", "pack"], ["stager", "stage"]], rep["next"]
    human = stager("hints", tree, env=env).stdout
    assert all(c in human for c in rep["next"]), human
    for cmd in rep["next"]:
        argv = shlex.split(cmd)
        r = subprocess.run([sys.executable, "-m", "stager", *argv[1:]], capture_output=True, text=True, env=env,
                           check=False, timeout=600)
        assert r.returncode == 0, (cmd, r.stderr)
    (staged,) = local.glob("stager-*")
    assert verify(staged).ok and verify(staged).samples == sum(1 for p in imagenet_tiny.rglob("*") if p.is_file())
    # A pack's own advice is the staging command alone.
    packed = json.loads(stager("hints", f"{tree}-packed", "--json", env=env).stdout)
    assert [shlex.split(c)[:2] for c in packed["next"]] == [["stager", "stage"]]

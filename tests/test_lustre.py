"""File-system detection from a fixture mount table, lfs output parsing, the stand-in lfs, layouts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stager.fs import lustre
from stager.fs.info import detect_fs, parse_mountinfo
from stager.fs.kernel import statfs_magic
from stager.stage import stage
from stager.stage.plan import FileTask, order_for_streams
from tests.test_stage_support import LFS_BIN, assert_verified_copy, make_dataset, stager

PLAIN = """/mnt/lustre/test_file
lmm_stripe_count:  1
lmm_stripe_size:   1048576
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 0
\tobdidx\t\t objid\t\t objid\t\t group
\t     0\t            98\t         0x62\t             0

"""

WIDE = """/scratch/big.h5
lmm_stripe_count:  4
lmm_stripe_size:   4194304
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 5
\tobdidx\t\t objid\t\t objid\t\t group
\t     5\t         12345\t       0x3039\t             0
\t     6\t         12346\t       0x303a\t             0
\t     7\t         12347\t       0x303b\t             0
\t     0\t         12348\t       0x303c\t             0

"""

PFL = """/mnt/testfs/pfl_file
  lcm_layout_gen:    3
  lcm_mirror_count:  1
  lcm_entry_count:   3
    lcme_id:             1
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   67108864
      lmm_stripe_count:  1
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 3
      lmm_objects:
      - 0: { l_ost_idx: 3, l_fid: [0x100030000:0x2:0x0] }

    lcme_id:             2
    lcme_mirror_id:      0
    lcme_flags:          0
    lcme_extent.e_start: 67108864
    lcme_extent.e_end:   1073741824
      lmm_stripe_count:  4
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: -1

    lcme_id:             3
    lcme_mirror_id:      0
    lcme_flags:          0
    lcme_extent.e_start: 1073741824
    lcme_extent.e_end:   EOF
      lmm_stripe_count:  16
      lmm_stripe_size:   4194304
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: -1

"""


def test_parse_plain_layout() -> None:
    lay = lustre.parse_getstripe(PLAIN)
    assert lay.path == "/mnt/lustre/test_file" and not lay.composite
    assert (lay.stripe_count, lay.stripe_size, lay.stripe_offset) == (1, 1048576, 0)
    assert lay.first.osts == [0] and lay.first.pattern == "raid0"
    wide = lustre.parse_getstripe(WIDE)
    assert wide.first.osts == [5, 6, 7, 0] and wide.stripe_count == 4 and wide.stripe_offset == 5


def test_parse_pfl_layout() -> None:
    lay = lustre.parse_getstripe(PFL)
    assert lay.composite and len(lay.components) == 3
    c1, c2, c3 = lay.components
    assert (c1.start, c1.end, c1.stripe_count, c1.osts) == (0, 64 << 20, 1, [3])
    assert (c2.start, c2.end, c2.stripe_count, c2.osts, c2.stripe_offset) == (64 << 20, 1 << 30, 4, [], -1)
    assert (c3.end, c3.stripe_count, c3.stripe_size) == (None, 16, 4 << 20)
    assert lay.stripe_offset == 3 and lay.stripe_count == 16


@pytest.mark.parametrize("line", [
    "stripe_count:  1 stripe_size:   1048576 pattern:       0 stripe_offset: -1",
    "stripe_count:  1 stripe_size:   1048576 pattern:       raid0 stripe_offset: -1",
    "stripe_count:  1 stripe_size:   1048576 stripe_offset: -1",
])
def test_parse_directory_default_in_all_versions(line: str) -> None:
    lay = lustre.parse_getstripe(line + "\n", "/d")
    assert (lay.stripe_count, lay.stripe_size, lay.first.stripe_offset) == (1, 1048576, -1)


def test_parse_garbage_raises() -> None:
    with pytest.raises(lustre.LfsError):
        lustre.parse_getstripe("lfs: command not understood\n")


MOUNTINFO = """22 27 0:21 / /proc rw,relatime - proc proc rw
1 0 8:1 / / rw,relatime - ext4 /dev/sda1 rw
60 1 0:52 / /lustre/scratch rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,flock,lazystatfs
61 1 0:53 / /mnt/beeond rw,relatime - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beeond.conf
62 60 0:54 / /lustre/scratch/tmp\\040space rw - tmpfs tmpfs rw
"""


def test_fs_detection_from_fixture_mountinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mi = tmp_path / "mountinfo"
    mi.write_text(MOUNTINFO)
    monkeypatch.setenv("STAGER_MOUNTINFO", str(mi))
    lu = detect_fs("/lustre/scratch/user/imagenet/shard-0.tar")
    assert lu.is_lustre and lu.mount_point == "/lustre/scratch" and lu.source == "10.0.0.1@o2ib:/scratch"
    bee = detect_fs("/mnt/beeond/job123")
    assert bee.is_beegfs and bee.is_shared and bee.mount_point == "/mnt/beeond"
    assert detect_fs("/lustre/scratchy/x").fstype == "ext4"  # prefix match is per path component
    assert detect_fs("/lustre/scratch/tmp space/x").fstype == "tmpfs"  # octal escape, longest prefix
    # /proc/mounts format works as a fixture too.
    mounts = parse_mountinfo("10.0.0.1@o2ib:/scratch /lustre/scratch lustre rw 0 0\n")
    assert mounts[0].fstype == "lustre" and mounts[0].mount_point == "/lustre/scratch"


def test_statfs_magic_of_real_paths() -> None:
    assert statfs_magic("/proc") == 0x9FA0  # PROC_SUPER_MAGIC
    assert statfs_magic("/no/such/path") is None
    real = detect_fs("/proc/self")
    assert real.fstype == "proc"


@pytest.fixture
def fake_lustre(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """tmp_path/lustre looks like a Lustre mount with 4 OSTs served by the stand-in lfs."""
    mount = tmp_path / "lustre"
    mount.mkdir()
    mi = tmp_path / "mountinfo"
    mi.write_text(f"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n60 1 0:52 / {mount} rw - lustre 10.0.0.1@o2ib:/demo rw\n")
    state = tmp_path / "lfs_state.json"
    state.write_text(json.dumps({"fsname": "demo", "mount": str(mount), "osts": 4,
                                 "default": {"stripe_count": 1, "stripe_size": 1048576, "stripe_offset": -1}}))
    log = tmp_path / "lfs_calls.log"
    monkeypatch.setenv("STAGER_MOUNTINFO", str(mi))
    monkeypatch.setenv("STAGER_FAKE_LFS_STATE", str(state))
    monkeypatch.setenv("STAGER_FAKE_LFS_LOG", str(log))
    monkeypatch.setenv("PATH", f"{LFS_BIN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("STAGER_LFS", raising=False)
    return {"mount": mount, "state": state, "log": log}


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_stand_in_lfs_output_is_parsed(fake_lustre: dict[str, Path]) -> None:
    d = fake_lustre["mount"] / "data"
    d.mkdir()
    f = d / "a.bin"
    f.write_bytes(b"x")
    lay = lustre.getstripe(f)
    assert lay.stripe_count == 1 and lay.stripe_size == 1048576 and len(lay.first.osts) == 1
    assert lustre.stripe_index(f) == lay.stripe_offset
    assert lustre.stripe_count(f) == 1 and lustre.stripe_size(f) == 1048576
    assert lustre.getstripe(d).stripe_count == 1
    assert lustre.ost_count(d) == 4
    lustre.run_lfs(["setstripe", "-E", "64M", "-c", "1", "-E", "-1", "-c", "4", "-S", "4M", str(d / "pfl")])
    pfl = lustre.getstripe(d / "pfl")
    assert pfl.composite and [c.stripe_count for c in pfl.components] == [1, 4]


def test_prepare_pack_dir_many_shards_sets_count_1(fake_lustre: dict[str, Path]) -> None:
    out = fake_lustre["mount"] / "packed"
    res = lustre.prepare_pack_dir(out, total_bytes=100 << 30, num_shards=400)
    assert res["applied"] and res["stripe_count"] == 1 and res["stripe_size"] == 4 << 20
    assert ["setstripe", "-c", "1", "-S", "4M", str(out)] in _calls(fake_lustre["log"])
    assert lustre.getstripe(out).stripe_count == 1 and lustre.getstripe(out).stripe_size == 4 << 20


def test_prepare_pack_dir_one_huge_file_stripes_wide(fake_lustre: dict[str, Path]) -> None:
    out = fake_lustre["mount"] / "one"
    res = lustre.prepare_pack_dir(out, total_bytes=200 << 30, num_shards=1)
    assert res["applied"] and res["stripe_count"] == 4  # all 4 OSTs of the fake file system
    assert ["setstripe", "-c", "4", "-S", "4M", str(out)] in _calls(fake_lustre["log"])


def test_prepare_pack_dir_explicit_values_win(fake_lustre: dict[str, Path]) -> None:
    out = fake_lustre["mount"] / "explicit"
    lustre.prepare_pack_dir(out, total_bytes=1 << 30, num_shards=10, stripe_count=2, stripe_size=2 << 20)
    assert ["setstripe", "-c", "2", "-S", "2M", str(out)] in _calls(fake_lustre["log"])


def test_prepare_pack_dir_without_lfs_prints_the_command(fake_lustre: dict[str, Path], monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    out = fake_lustre["mount"] / "nolfs"
    res = lustre.prepare_pack_dir(out, total_bytes=10 << 30, num_shards=40)
    assert not res["applied"] and res["command"] == f"lfs setstripe -c 1 -S 4M {out}"
    assert res["command"] in capsys.readouterr().err


def test_prepare_pack_dir_off_lustre_is_a_no_op(tmp_path: Path, fake_lustre: dict[str, Path]) -> None:
    res = lustre.prepare_pack_dir(tmp_path / "local", total_bytes=1 << 30, num_shards=4)
    assert not res["lustre"] and not res["applied"] and res["command"] is None
    assert _calls(fake_lustre["log"]) == []


def test_recommendation_rules() -> None:
    assert lustre.recommend_layout(300 << 30, 1200, 64).stripe_count == 1
    assert lustre.recommend_layout(40 << 30, 1, 64).stripe_count == 64
    assert lustre.recommend_layout(400 << 30, 1, 200).stripe_count == lustre.MAX_WIDE_STRIPES
    small = lustre.recommend_layout(40 << 20, 2, 64)
    assert small.stripe_count == 4 and small.stripe_size == 1 << 20


def test_stage_from_lustre_interleaves_osts(tmp_path: Path, fake_lustre: dict[str, Path]) -> None:
    src = fake_lustre["mount"] / "ds"
    m = make_dataset(src, n=6, size=8 << 10)
    tasks = [FileTask(s.name, s.bytes, s.hash, str(src / s.name), i) for i, s in enumerate(m.shards)]
    ordered, how, block = order_for_streams(tasks, detect_fs(src))
    assert how == "ost-round-robin" and block % (1 << 20) == 0
    osts = [lustre.stripe_index(t.src_path) for t in ordered]
    # Any window of as many streams as there are distinct OSTs starts with all-different OSTs.
    k = len(set(osts))
    assert len(set(osts[:k])) == k
    assert sorted(t.name for t in ordered) == sorted(t.name for t in tasks)
    res = stage(src, tmp_path / "dest", workers=4)
    assert res.ordering == "ost-round-robin" and res.source_fs == "lustre"
    assert sum(1 for c in _calls(fake_lustre["log"]) if c[:2] == ["getstripe", "-i"]) >= 2 * len(m.shards)
    assert_verified_copy(m, tmp_path / "dest")


def test_hints_cli_on_lustre_tree(tmp_path: Path, fake_lustre: dict[str, Path]) -> None:
    tree = fake_lustre["mount"] / "imgs"
    for c in range(3):
        (tree / f"c{c}").mkdir(parents=True)
        for i in range(400):
            (tree / f"c{c}" / f"{i}.jpg").write_bytes(b"x" * (1000 + i))
    env = {k: os.environ[k] for k in ("STAGER_MOUNTINFO", "STAGER_FAKE_LFS_STATE", "STAGER_FAKE_LFS_LOG", "PATH")}
    env["STAGER_DEST"] = str(tmp_path)
    r = stager("hints", str(tree), "--json", env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["fs"]["fstype"] == "lustre" and rep["sizes"]["files"] == 1200
    assert rep["pack_command"].startswith(f"stager pack {tree} ")
    assert rep["lustre"]["current"]["components"][0]["stripe_count"] == 1
    assert rep["lustre"]["osts"] == 4
    assert rep["lustre"]["recommended"]["command"].startswith("lfs setstripe -c ")
    assert rep["fit"]["fits_dest"] is True and rep["fit"]["dest"] == str(tmp_path)
    human = stager("hints", str(tree), env=env)
    assert "small" not in human.stdout or "stager pack" in human.stdout
    assert "lfs setstripe" in human.stdout


def test_mountinfo_escapes_are_decoded_at_the_end_of_a_path_too() -> None:
    """The kernel writes a space as ``\\040``, at the end of a path too; fs detection and stage/mount.py
    (which finds its squashfuse mounts by their real paths) share this one decoder."""
    line = r"36 25 0:45 / /mnt/my\040data\040 rw,relatime shared:1 - fuse.squashfuse squashfuse rw" + "\n"
    (m,) = parse_mountinfo(line)
    assert m.mount_point == "/mnt/my data " and m.fstype == "fuse.squashfuse", m

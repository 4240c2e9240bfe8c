"""Permissions of what stage writes for a licensed (group-only) dataset, and what clean removes.

Invariant: with a source readable by owner and one group only (files 0640, directories 0750, group
G), every file stage writes into DEST (shards, companions, manifest, receipt, unpacked images) has
group G and no permission bits for others, and directories it creates grant others nothing either;
with a world-readable source, staged shards stay world-readable. `stager clean` removes exactly the
files stage wrote (checked against a listing taken before and after).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tools.faults import harness as h
from tools.faults.kill import staged_source
from tools.faults.tally import record

GROUP = 4242  # any gid other than ours: root may chown to it


def licensed_copy(work: Path, dst: Path) -> Path:
    """A copy of the packed test set with files 0640 / dirs 0750 and group GROUP."""
    import shutil

    src, _ = staged_source(work)
    shutil.copytree(src, dst)
    os.chmod(dst, 0o750)
    os.chown(dst, -1, GROUP)
    for p in dst.iterdir():
        os.chmod(p, 0o640)
        os.chown(p, -1, GROUP)
    return dst


def modes(root: Path) -> list[tuple[str, int, int, bool]]:
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(dirpath) / name
            st = p.lstat()
            out.append((str(p.relative_to(root)), stat.S_IMODE(st.st_mode), st.st_gid, stat.S_ISDIR(st.st_mode)))
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the source another group")
@pytest.mark.parametrize("unpack", [None, "also"])
def test_licensed_dataset_stays_group_only(work: Path, tmp_path: Path, unpack: str | None) -> None:
    src = licensed_copy(work, tmp_path / "licensed")
    dest = tmp_path / "dest"
    r = h.run_stager("stage", str(src), str(dest), "-q", *(["--unpack", unpack] if unpack else []))
    assert r.returncode == 0, r.stderr
    entries = modes(dest)
    # Files that hold data or describe it; the journal and lock are private (0600, our group) by design.
    data = [e for e in entries if not e[3] and not e[0].startswith(".stager-")]
    world = [e[0] for e in entries if e[1] & 0o007]
    wrong_group = [e[0] for e in data if e[2] != GROUP]
    ok = not world and not wrong_group
    bad = set(world) | set(wrong_group)
    record("licensed (group-only) source staged: files checked", group="permissions", trials=len(data),
           handled=len(data) - len(bad), lost=len(world),
           note="staged files + receipt keep group, never world-readable")
    assert not world, f"world-accessible: {world[:10]}"
    assert not wrong_group, f"not in the source's group {GROUP}: {wrong_group[:10]}"
    assert ok


def test_world_readable_source_stays_readable(work: Path, tmp_path: Path) -> None:
    src, m = staged_source(work)
    dest = tmp_path / "dest"
    r = h.run_stager("stage", str(src), str(dest), "-q")
    assert r.returncode == 0, r.stderr
    for s in m.shards:
        if os.stat(src / s.name).st_mode & 0o004:
            assert os.stat(dest / s.name).st_mode & 0o004, s.name


@pytest.mark.parametrize("unpack", [None, "also"])
def test_clean_removes_exactly_what_stage_wrote(work: Path, tmp_path: Path, unpack: str | None) -> None:
    src, _ = staged_source(work)
    root = tmp_path / "node-local"
    (root / "other-job").mkdir(parents=True)
    (root / "other-job" / "data.bin").write_bytes(b"x" * 100)
    dest = root / "dest"
    dest.mkdir()
    (dest / "user-notes.txt").write_text("mine")
    before = h.snapshot(root)
    r = h.run_stager("stage", str(src), str(dest), "-q", *(["--unpack", unpack] if unpack else []))
    assert r.returncode == 0, r.stderr
    (dest / "unpacked-extra.txt").write_text("also mine")
    keep = h.snapshot(root)
    r = h.run_stager("clean", str(dest), "-q")
    assert r.returncode == 0, r.stderr
    after = h.snapshot(root)
    staged = set(keep) - set(before) - {"dest/unpacked-extra.txt"}
    removed = set(keep) - set(after)
    ok = removed == staged and set(after) == set(before) | {"dest/unpacked-extra.txt"}
    record("`stager clean` after stage: entries checked", group="permissions", trials=len(keep),
           handled=len(keep) - len(removed ^ staged), lost=len(removed - staged),
           note="removes exactly the entries stage created")
    assert removed == staged, (sorted(removed - staged)[:10], sorted(staged - removed)[:10])
    assert ok

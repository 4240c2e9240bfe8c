"""A new user's first hour (issue 38): pack, stage, clean, cache and load a folder of photos with the
mistakes people make, through the real CLI. Each test failed on the main before it.

Every piece of advice checked here is followed literally: the command in backticks is run as printed
(:func:`follow`), and the problem must be gone afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from stager.checksum import hash_file
from stager.errors import CorruptSampleError
from stager.manifest import load_manifest
from stager.receipt import RECEIPT_NAME
from tests.test_stage_support import make_dataset, spawn, stager
from tools.datagen import jpeg_bytes, make_imagefolder


def tree_hashes(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root`` (relative path -> size and hash): what must not change."""
    return {str(p.relative_to(root)): hash_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def error_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if ": error:" in x]


def follow(stderr: str) -> list[subprocess.CompletedProcess[str]]:
    """Run every `stager ...` command the error line names, as printed; each must succeed."""
    cmds = [c for c in re.findall(r"`([^`]+)`", error_lines(stderr)[-1]) if c.startswith("stager ")]
    assert cmds, stderr
    out = []
    for cmd in cmds:
        r = stager(*shlex.split(cmd)[1:])
        assert r.returncode == 0, (cmd, r.stderr)
        out.append(r)
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder with the names people have: a class `sea lion`, a class `café` of `café_0190.jpg`..."""
    root = make_imagefolder(tmp_path_factory.mktemp("photos") / "data", num_classes=3, per_class=4, seed=7,
                            size=(40, 30))
    names = sorted(os.listdir(root))
    (root / names[0]).rename(root / "sea lion")
    (root / names[1]).rename(root / "café")
    for i, f in enumerate(sorted(os.listdir(root / "café"))):
        (root / "café" / f).rename(root / "café" / f"café_{190 + i:04d}.jpg")
    return root


@pytest.fixture(scope="module")
def packed(photos: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "P"
    r = stager("pack", str(photos), str(out), "--format", "tar", "--samples-per-shard", "3", "-q")
    assert r.returncode == 0, r.stderr
    return out


# ---- 1. DEST that is, contains or lies inside SRC, or holds another dataset -------------------------------
@pytest.mark.parametrize("flags", [[], ["--unpack"], ["--partition", "--node", "0", "--num-nodes", "2"],
                                   ["--shared", "--node", "0", "--num-nodes", "1"], ["--cache", "CACHE"]])
@pytest.mark.parametrize("where", ["src", "inside", "around", "link", "other-pack"])
def test_a_dest_that_overlaps_src_or_holds_another_dataset_is_refused(packed: Path, tmp_path: Path, where: str,
                                                                        flags: list[str]) -> None:
    src = tmp_path / "data" / "P"
    src.parent.mkdir()
    subprocess.run(["cp", "-a", str(packed), str(src)], check=True)
    other = tmp_path / "Q"
    make_dataset(other, n=2)
    dest = {"src": src, "inside": src / "sub", "around": src.parent, "link": tmp_path / "link",
            "other-pack": other}[where]
    if where == "link":
        dest.symlink_to(src)
    before = {p: tree_hashes(p) for p in (src, other)}
    flags = [str(tmp_path / "cache") if f == "CACHE" else f for f in flags]
    r = stager("stage", str(src), str(dest), *flags)
    assert r.returncode == 2, r.stderr
    assert len(error_lines(r.stderr)) == 1 and str(dest) in r.stderr
    # The README's trap runs clean next: it must not delete the dataset either.
    stager("clean", str(dest))
    assert {p: tree_hashes(p) for p in (src, other)} == before
    assert not (tmp_path / "cache").exists()


def test_a_mix_dest_that_contains_a_stream_is_refused(packed: Path, tmp_path: Path) -> None:
    packs = tmp_path / "packs"
    packs.mkdir()
    subprocess.run(["cp", "-a", str(packed), str(packs / "a")], check=True)
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"streams": [{"name": "x", "path": str(packs / "a")}]}))
    before = tree_hashes(packs)
    r = stager("stage", str(mix), str(packs))
    assert r.returncode == 2 and len(error_lines(r.stderr)) == 1, r.stderr
    assert tree_hashes(packs) == before


def test_a_bind_mount_of_src_is_src(packed: Path, tmp_path: Path) -> None:
    """A second path to SRC that is no symlink (a bind mount) is recognised by the directory's identity."""
    src = tmp_path / "P"
    subprocess.run(["cp", "-a", str(packed), str(src)], check=True)
    alias = tmp_path / "alias"
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(alias)], capture_output=True, check=False).returncode:
        pytest.skip("no bind mounts here (needs root and a mount namespace that allows them)")
    try:
        before = tree_hashes(src)
        for dest in (alias, alias / "sub"):
            r = stager("stage", str(src), str(dest))
            assert r.returncode == 2 and "SRC" in r.stderr, r.stderr
        assert tree_hashes(src) == before
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def test_advice_to_clean_another_datasets_copy_works(tmp_path: Path) -> None:
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    make_dataset(a, n=2, seed=1)
    make_dataset(b, n=2, seed=2)
    assert stager("stage", str(a), str(dest)).returncode == 0
    r = stager("stage", str(b), str(dest))
    assert r.returncode == 2 and f"stager clean {dest}" in r.stderr
    follow(r.stderr)
    assert stager("stage", str(b), str(dest)).returncode == 0


def test_advice_for_another_datasets_unfinished_stage_works(tmp_path: Path) -> None:
    """A DEST holding the journal of another dataset's failed stage: refused (its records would be lost),
    and the advised clean makes room."""
    a, b, dest = tmp_path / "a", tmp_path / "b", tmp_path / "dest"
    m = make_dataset(a, n=3, seed=1)
    make_dataset(b, n=2, seed=2)
    shard = a / m.shards[1].name
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])
    assert stager("stage", str(a), str(dest)).returncode == 3
    r = stager("stage", str(b), str(dest))
    assert r.returncode == 2 and "unfinished stage" in r.stderr, r.stderr
    follow(r.stderr)
    assert stager("stage", str(b), str(dest)).returncode == 0


def test_advice_for_a_damaged_receipt_works(packed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    assert stager("stage", str(packed), str(dest)).returncode == 0
    (dest / RECEIPT_NAME).write_text("{not json")
    (dest / "mine.txt").write_text("keep")
    r = stager("clean", str(dest))  # clean goes by the journal when the receipt is damaged
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(dest)) == ["mine.txt"]
    assert stager("stage", str(packed), str(dest)).returncode == 0


# ---- 2. names: any letter and spaces, byte-exact; control characters refused at pack --------------------
def test_names_with_spaces_and_letters_unpack_byte_exact(photos: Path, packed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    r = stager("stage", str(packed), str(dest), "--unpack")
    assert r.returncode == 0, r.stderr
    tree = dest / "unpacked"
    assert {"sea lion", "café"} <= set(os.listdir(tree))
    assert (tree / "café" / "café_0190.jpg").read_bytes() == (photos / "café" / "café_0190.jpg").read_bytes()
    for cls in os.listdir(photos):
        for f in os.listdir(photos / cls):  # the extension is the sniffed type's (.JPEG -> .jpg)
            got = tree / cls / (f.rsplit(".", 1)[0] + ".jpg")
            assert got.read_bytes() == (photos / cls / f).read_bytes(), (cls, f)


@pytest.mark.parametrize("bad", ["class", "file"])
def test_control_characters_are_refused_at_pack(photos: Path, tmp_path: Path, bad: str) -> None:
    src = tmp_path / "data"
    subprocess.run(["cp", "-a", str(photos), str(src)], check=True)
    if bad == "class":
        (src / "sea lion").rename(src / "sea\tlion")
    else:
        f = sorted((src / "café").iterdir())[0]
        f.rename(f.with_name("caf\x01e.jpg"))
    out = tmp_path / "out"
    r = stager("pack", str(src), str(out), "--format", "tar")
    assert r.returncode != 0 and len(error_lines(r.stderr)) == 1, r.stderr
    assert "control character" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists() or not list(out.iterdir())


# ---- 3. clean after a failed or interrupted stage -----------------------------------------------------
def test_clean_after_a_failed_stage_removes_what_it_wrote_and_nothing_else(tmp_path: Path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    m = make_dataset(src, n=6, size=96 << 10)
    shard = src / m.shards[3].name
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])  # the copy fails verification: exit 3
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    assert stager("stage", str(src), str(dest), "-j", "1").returncode == 3
    assert any(n.endswith(".tar") for n in os.listdir(dest))  # verified shards of the failed run
    r = stager("clean", str(dest), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["records"] == "journal" and res["left"] == ["keep.txt"]
    assert sorted(os.listdir(dest)) == ["keep.txt"]


def test_clean_after_a_stage_killed_at_any_point_leaves_nothing(tmp_path: Path) -> None:
    """kill -9 as soon as DEST holds the first file of the stage's (its lock, its journal's partial
    file, a shard's partial file: which one the kill meets varies), then the README's trap: `stager
    clean` of the default DEST removes every file the stage made, and DEST itself."""
    src = tmp_path / "src"
    m = make_dataset(src, n=6, size=96 << 10)
    root = tmp_path / "root"
    root.mkdir()
    env = {"STAGER_DEST": str(root), "STAGER_TEST_THROTTLE_BPS": str(m.num_bytes // 4)}
    for wait_for in (".stager-lock", ".partial", ".tar"):
        proc = spawn("stage", str(src), "-q", env=env)
        dest = root / f"stager-{m.dataset_id}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (dest.is_dir() and any(wait_for in n for n in os.listdir(dest))):
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        r = stager("clean", str(dest))
        assert r.returncode == 0, (wait_for, sorted(os.listdir(dest)), r.stderr)
        assert not dest.exists() or not os.listdir(dest), sorted(os.listdir(dest))


def test_clean_without_any_record_refuses(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "shard-000000.tar").write_bytes(b"x")
    r = stager("clean", str(tmp_path / "d"))
    assert r.returncode == 2 and "refusing to delete anything" in r.stderr
    assert (tmp_path / "d" / "shard-000000.tar").exists()


# ---- 4. a refused cache quota is never recorded ------------------------------------------------------
def test_a_refused_cache_quota_is_never_written(packed: Path, tmp_path: Path) -> None:
    cache, dest = tmp_path / "cache", tmp_path / "dest"
    st = os.statvfs(tmp_path)
    too_big = str(st.f_blocks * st.f_frsize * 2)
    r = stager("stage", str(packed), str(dest), "--cache", str(cache), "--cache-quota", too_big)
    assert r.returncode == 2 and "larger than its disk" in r.stderr, r.stderr
    assert not cache.exists() and not dest.exists()
    r = stager("cache", "init", "--quota", too_big, str(cache))
    assert r.returncode == 2 and not cache.exists()
    assert stager("stage", str(packed), str(dest), "--cache", str(cache)).returncode == 0
    assert stager("stage", str(packed), str(dest), "--cache", str(cache), "--cache-quota", too_big).returncode == 2
    assert stager("cache", "du", str(cache)).returncode == 0


def test_advice_for_a_recorded_quota_larger_than_the_disk_works(packed: Path, tmp_path: Path) -> None:
    """A marker recording a quota the disk cannot hold (written by an older stager, or the disk changed):
    the error names the command that records one that fits, and that command works."""
    cache = tmp_path / "cache"
    assert stager("stage", str(packed), str(tmp_path / "dest"), "--cache", str(cache)).returncode == 0
    marker = next(p for p in cache.iterdir() if p.is_file() and p.suffix == ".json")
    doc = json.loads(marker.read_text())
    doc["quota"] = "100P"
    marker.write_text(json.dumps(doc))
    r = stager("cache", "du", str(cache))
    assert r.returncode == 2 and "stager cache init --quota" in r.stderr, r.stderr
    follow(r.stderr)
    assert stager("cache", "du", str(cache)).returncode == 0


# ---- 5. empty class folders; OUT inside SRC ------------------------------------------------------------
def test_an_empty_class_folder_is_refused_or_kept_on_request(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "data"
    subprocess.run(["cp", "-a", str(photos), str(src)], check=True)
    (src / "aardvark").mkdir()  # sorts first: every later label would shift
    r = stager("pack", str(src), str(tmp_path / "out"), "--format", "tar")
    assert r.returncode != 0 and len(error_lines(r.stderr)) == 1 and "aardvark" in r.stderr, r.stderr
    assert "--allow-empty-classes" in r.stderr
    r = stager("pack", str(src), str(tmp_path / "out"), "--format", "tar", "--allow-empty-classes", "-q")
    assert r.returncode == 0, r.stderr
    assert load_manifest(tmp_path / "out").classes[0] == "aardvark"


def test_out_inside_src_is_refused(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "data"
    subprocess.run(["cp", "-a", str(photos), str(src)], check=True)
    before = sorted(os.listdir(src))
    r = stager("pack", str(src), str(src / "packed"), "--format", "tar")
    assert r.returncode == 2 and "outside SRC" in r.stderr, r.stderr
    assert sorted(os.listdir(src)) == before


# ---- 6. verify's advice repairs a damaged staged copy; a good copy's re-stage stays instant ----------------
def test_verify_advice_repairs_a_staged_copy(packed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    assert stager("stage", str(packed), str(dest)).returncode == 0
    shard = dest / load_manifest(packed).shards[1].name
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    r = stager("verify", str(dest))
    assert r.returncode == 3 and shard.name in r.stderr
    out = follow(r.stderr)
    assert json.loads(stager("stage", str(packed), str(dest), "--json").stdout.splitlines()[-1])["already_staged"]
    assert "repaired 1 damaged files" in out[0].stdout
    assert stager("verify", str(dest)).returncode == 0


def test_a_plain_restage_of_a_good_copy_reads_no_shard(packed: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    assert stager("stage", str(packed), str(dest)).returncode == 0
    for p in dest.glob("*.tar"):
        p.chmod(0o000)  # root reads it anyway: the check is the result's, not the mode's
    res = json.loads(stager("stage", str(packed), str(dest), "--json").stdout.splitlines()[-1])
    assert res["already_staged"] and res["bytes_copied"] == 0


# ---- 7. verify --deep decodes what the loader decodes ------------------------------------------------------
def _broken_jpeg(seed: int) -> bytes:
    """A JPEG whose structure passes the pack's header check but whose Huffman table cannot decode."""
    img = np.random.default_rng(seed).integers(0, 255, (30, 40, 3), dtype=np.uint8)
    j = bytearray(jpeg_bytes(img))
    i = j.index(b"\xff\xc4")
    j[i + 5:i + 21] = b"\xff" * 16
    return bytes(j)


def test_deep_verify_fails_where_the_loader_fails_and_its_advice_works(photos: Path, tmp_path: Path) -> None:
    from stager.loader.numpy_loader import make_numpy_loader

    src = tmp_path / "data"
    subprocess.run(["cp", "-a", str(photos), str(src)], check=True)
    victim = sorted((src / "sea lion").iterdir())[1]
    victim.write_bytes(_broken_jpeg(1))
    out = tmp_path / "P"
    assert stager("pack", str(src), str(out), "--format", "tar", "--samples-per-shard", "3", "-q").returncode == 0
    kw = {"transform": "train", "image_size": 16, "seed": 0, "drop_last": False, "staged": False}
    with pytest.raises(CorruptSampleError, match="stager verify --deep"):
        for _ in make_numpy_loader(str(out), 4, **kw):
            pass
    assert stager("verify", str(out)).returncode == 0  # the bytes are as packed
    r = stager("verify", str(out), "--deep")
    assert r.returncode == 3, r.stderr
    bad = [x for x in r.stderr.splitlines() if "BAD" in x]
    assert len(bad) == 1 and victim.stem in bad[0] and ".tar" in bad[0]
    assert "on_error='skip'" in r.stderr
    keys = [k for b in make_numpy_loader(str(out), 4, on_error="skip", **kw) for k in b["key"]]
    assert len(keys) == load_manifest(out).num_samples - 1 and not any(victim.stem in k for k in keys)


# ---- 8. a JSONL boxes column is typed as boxes and follows the crop --------------------------------------------
def test_jsonl_boxes_without_fields_follow_the_train_crop(tmp_path: Path) -> None:
    from stager.loader.numpy_loader import make_numpy_loader

    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg_bytes(rng.integers(0, 255, (200, 300, 3), dtype=np.uint8)))
        rows.append({"path": f"{i}.jpg", "label": i % 2, "boxes": [[10, 20, 290, 190], [100, 50, 200, 150]],
                     "box_labels": [1, 2]})
    (tmp_path / "list.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = stager("pack", str(tmp_path / "list.jsonl"), str(tmp_path / "P"), "--format", "tar", "-q")
    assert r.returncode == 0, r.stderr
    kinds = {f["name"]: f["kind"] for f in load_manifest(tmp_path / "P").fields}
    assert kinds == {"boxes": "boxes", "box_labels": "box_labels"}
    size = 64
    ld = make_numpy_loader(str(tmp_path / "P"), 4, transform="train", image_size=size, seed=1, drop_last=False,
                           fields=["boxes", "box_labels"], staged=False)
    n = 0
    for b in ld:
        for boxes in b["boxes"]:
            boxes = np.asarray(boxes)
            assert boxes.size and (boxes >= 0).all() and (boxes <= size).all(), boxes
            n += 1
    assert n == 8

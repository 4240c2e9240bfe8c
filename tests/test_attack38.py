"""Attacks on issue 38's surfaces ("nothing a user types loses data"), through the real CLI, as a
newcomer who mistypes and as a second uid on the node. Each test failed on the main before its fix:

* a staged copy as SRC and the original pack as DEST (the arguments swapped): the stage took the pack's
  files over and wrote a receipt into it, so ``stager clean PACK`` deleted the pack;
* a ``file://`` URL as SRC skipped the "DEST is, contains or lies inside SRC" check;
* a file in DEST under a name the stage writes (a shard name, the unpacked tree) was written over,
  and ``stager clean`` then removed it: a user's own file, or one a dataset's shard names on purpose;
* ``stage --unpack only`` followed by ``clean`` left the sample index behind, and a plain stage over
  an ``--unpack`` one left the unpacked tree (its receipt no longer named it, though the journal did);
* ``stager pack`` accepted two samples that ``stage --unpack`` can never write (one file name);
* ``--unpack-dir`` naming one of stager's own files (the receipt, the manifest) failed after the copy;
* a mix stream named ``stager-receipt.json`` made a DEST that ``clean`` refused;
* ``verify`` failed a sound ``--partition`` or ``--unpack only`` copy, and its printed repair made a
  full copy of it (or, after ``mv``, staged into the old path);
* a copy moved with ``mv`` could not be cleaned (its receipt names the unpacked tree by absolute path);
* a name holding a newline made ``stager pack``'s error a truncated line without its reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest

from stager.checksum import hash_file
from stager.manifest import Manifest, ShardInfo
from stager.receipt import RECEIPT_NAME
from tests.asuser import VICTIM, Node, run_as, stager_as
from tests.test_stage_support import make_dataset, stager
from tools.datagen import make_imagefolder


def tree_hashes(root: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``root`` (relative path -> size and hash), hidden ones included."""
    return {str(p.relative_to(root)): hash_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def one_line_error(r: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    lines = [x for x in r.stderr.splitlines() if ": error:" in x]
    assert r.returncode == code and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_imagefolder(tmp_path_factory.mktemp("photos") / "data", num_classes=2, per_class=4, seed=3,
                            size=(32, 24))


@pytest.fixture
def pack_dir(photos: Path, tmp_path: Path) -> Path:
    out = tmp_path / "pack"
    r = stager("pack", str(photos), str(out), "--format", "tar", "--samples-per-shard", "3", "-q")
    assert r.returncode == 0, r.stderr
    return out


# ---- A. the newcomer's mistypes ------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [[], ["--repair"], ["--unpack"]])
def test_a_staged_copy_restaged_into_the_original_pack_is_refused(pack_dir: Path, tmp_path: Path,
                                                                   flags: list[str]) -> None:
    """`stager stage COPY PACK` (the order swapped): the pack holds this dataset's manifest but no record
    of a stage. It took the pack over (a receipt naming its shards), and `clean PACK` deleted them."""
    copy = tmp_path / "copy"
    assert stager("stage", str(pack_dir), str(copy), "-q").returncode == 0
    before = tree_hashes(pack_dir)
    r = stager("stage", str(copy), str(pack_dir), *flags, "-q")
    one_line_error(r, 2, str(pack_dir), "no record")
    assert tree_hashes(pack_dir) == before
    r = stager("clean", str(pack_dir))  # what the README's trap runs next
    assert r.returncode == 2, r.stderr
    assert tree_hashes(pack_dir) == before


def test_a_copy_made_without_stager_is_not_taken_over(pack_dir: Path, tmp_path: Path) -> None:
    """`cp -a PACK X; stager stage PACK X`: X's files are not stage's to overwrite or clean."""
    other = tmp_path / "cp"
    subprocess.run(["cp", "-a", str(pack_dir), str(other)], check=True)
    before = tree_hashes(other)
    one_line_error(stager("stage", str(pack_dir), str(other), "-q"), 2, str(other))
    assert tree_hashes(other) == before


@pytest.mark.parametrize("dest", ["same", "parent"])
def test_a_file_url_src_is_checked_like_its_path(pack_dir: Path, dest: str) -> None:
    """`stager stage file:///data/P /data/P` wrote a receipt into the pack (and `clean` removed it)."""
    target = pack_dir if dest == "same" else pack_dir.parent
    before = tree_hashes(pack_dir)
    names = sorted(os.listdir(target))
    r = stager("stage", pack_dir.as_uri(), str(target), "-q")
    one_line_error(r, 2, "SRC")
    assert tree_hashes(pack_dir) == before and sorted(os.listdir(target)) == names


@pytest.mark.parametrize("kind", ["shard", "manifest", "unpacked"])
def test_stage_never_writes_over_a_file_it_has_no_record_of(photos: Path, pack_dir: Path, tmp_path: Path,
                                                           kind: str) -> None:
    """Other files in DEST are left alone, including one under a name the stage would write: refused
    (exit 2) instead of copied over, and so never removed by the `clean` that follows (which removed
    the user's own `unpacked/<class>/<sample stem>.png` too: the tree's files are matched by stem)."""
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("mine")
    flags: list[str] = []
    if kind == "shard":
        (dest / "shard-00000.tar").write_text("my own tar, not the dataset's")
    elif kind == "manifest":
        (dest / "manifest.json").write_bytes((pack_dir / "manifest.json").read_bytes())
    else:
        flags = ["--unpack", "only"]
        cls = sorted(os.listdir(photos))[0]
        mine = dest / "unpacked" / cls
        mine.mkdir(parents=True)
        for f in sorted(os.listdir(photos / cls)):
            (mine / (f.rsplit(".", 1)[0] + ".png")).write_text("my own edit of it")
    before = tree_hashes(dest)
    one_line_error(stager("stage", str(pack_dir), str(dest), *flags, "-q"), 2, str(dest), "no record")
    assert tree_hashes(dest) == before
    stager("clean", str(dest))
    assert tree_hashes(dest) == before


def test_other_files_and_resumes_still_work(pack_dir: Path, tmp_path: Path) -> None:
    """What the refusal must not catch: a DEST with unrelated files, a rerun, --repair, a rerun after
    clean, and a re-stage in another mode over a finished copy (its records name every file). Then
    clean removes all of it: the tree of the earlier `--unpack` run, which the last receipt does not
    name, was left behind."""
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("mine")
    for flags in ([], [], ["--repair"], ["--unpack"], ["--unpack", "only"], []):
        r = stager("stage", str(pack_dir), str(dest), *flags, "-q")
        assert r.returncode == 0, (flags, r.stderr)
    assert stager("verify", str(dest)).returncode == 0
    assert stager("clean", str(dest)).returncode == 0
    assert sorted(os.listdir(dest)) == ["mine.txt"]
    assert stager("stage", str(pack_dir), str(dest), "-q").returncode == 0


@pytest.mark.parametrize("name", ["manifest.json", "stager-receipt.json", ".stager-journal.jsonl", ".stager-lock"])
def test_an_unpack_dir_named_like_stagers_own_files_is_refused_up_front(pack_dir: Path, tmp_path: Path,
                                                                         name: str) -> None:
    """`--unpack-dir stager-receipt.json` copied every shard, then failed (exit 1, `[Errno 21] Is a
    directory`) and left a DEST that `clean` refused; `manifest.json` failed advising to remove it."""
    dest = tmp_path / "dest"
    one_line_error(stager("stage", str(pack_dir), str(dest), "--unpack", "--unpack-dir", name, "-q"), 2, name)
    assert not dest.exists()


@pytest.mark.parametrize("name", ["stager-receipt.json", "stager-mix.json", "manifest.json"])
def test_a_mix_stream_named_like_stagers_own_files_is_refused_up_front(pack_dir: Path, tmp_path: Path,
                                                                       name: str) -> None:
    """A stream staged into `DEST/stager-receipt.json` made a mix DEST that `clean` refused ("staging
    receipt is a directory ... remove it"); `stager-mix.json` failed (exit 1) after copying."""
    other = tmp_path / "other"
    make_dataset(other, n=2, size=8 << 10, seed=5)
    mix = tmp_path / "mix.yaml"
    mix.write_text(f'streams:\n  - {{name: "{name}", path: {pack_dir}}}\n  - {{name: two, path: {other}}}\n')
    dest = tmp_path / "dest"
    one_line_error(stager("stage", str(mix), str(dest), "-q"), 2, name)
    assert not dest.exists()


def test_clean_after_unpack_only_leaves_nothing_of_the_stage(pack_dir: Path, tmp_path: Path) -> None:
    """`--unpack only` stages the sample index too; its receipt did not list it, so clean left it."""
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "mine.txt").write_text("mine")
    assert stager("stage", str(pack_dir), str(dest), "--unpack", "only", "-q").returncode == 0
    assert any(n.endswith(".sidx") for n in os.listdir(dest))
    r = stager("clean", str(dest), "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(dest)) == ["mine.txt"]
    assert json.loads(r.stdout.strip().splitlines()[-1])["left"] == ["mine.txt"]


def test_a_copy_moved_with_mv_is_cleaned(pack_dir: Path, tmp_path: Path) -> None:
    """The receipt records the unpacked tree by its absolute path: after `mv DEST NEW`, clean of NEW
    refused (exit 3, "not a plain name inside DEST") and removed nothing."""
    old, new = tmp_path / "old", tmp_path / "new"
    assert stager("stage", str(pack_dir), str(old), "--unpack", "-q").returncode == 0
    old.rename(new)
    (new / "unpacked" / "mine.txt").write_text("mine")
    r = stager("clean", str(new))
    assert r.returncode == 0, r.stderr
    assert sorted(str(p.relative_to(new)) for p in new.rglob("*")) == ["unpacked", "unpacked/mine.txt"]


def follow_advice(stderr: str) -> None:
    """Run every `stager ...` command verify's error line names, exactly as printed; each must succeed."""
    line = [x for x in stderr.splitlines() if ": error:" in x][-1]
    cmds = [c for c in re.findall(r"`([^`]+)`", line) if c.startswith("stager ")]
    assert cmds, stderr
    for cmd in cmds:
        r = stager(*shlex.split(cmd)[1:])
        assert r.returncode == 0, (cmd, r.stderr)


@pytest.mark.parametrize("how", ["partition", "unpack-only", "moved"])
def test_verify_judges_a_copy_by_what_it_holds_and_its_advice_repairs_it(pack_dir: Path, tmp_path: Path,
                                                                         how: str) -> None:
    """A sound `--partition` (or `--unpack only`) copy failed verify (its other shards "missing"), and the
    printed `stage --repair SRC DEST` made it a full copy: on a node whose disk holds only its share, the
    repair fills the disk. After `mv`, the advice named the old path."""
    dest = tmp_path / "dest"
    flags = {"partition": ["--partition", "--node", "1", "--num-nodes", "2"], "unpack-only": ["--unpack", "only"],
             "moved": ["--unpack", "--unpack-dir", "tree"]}[how]
    assert stager("stage", str(pack_dir), str(dest), *flags, "-q").returncode == 0
    if how == "moved":
        dest = dest.rename(tmp_path / "moved")
    held = sorted(os.listdir(dest))
    r = stager("verify", str(dest))
    assert r.returncode == 0, r.stderr
    if how == "unpack-only":
        return
    shard = sorted(n for n in held if n.endswith(".tar"))[0]
    (dest / shard).write_bytes(b"\0" * 100)
    r = stager("verify", str(dest))
    assert r.returncode == 3 and str(dest) in r.stderr, r.stderr
    follow_advice(r.stderr)
    assert sorted(os.listdir(dest)) == held  # the same share, nothing more
    assert stager("verify", str(dest)).returncode == 0
    assert how != "moved" or not (tmp_path / "dest").exists()  # nothing staged at the old path


# ---- the one name rule: what pack accepts, stage --unpack can write ------------------------------------------
def _images(root: Path, names: list[str], photos: Path) -> None:
    jpg = sorted((photos / sorted(os.listdir(photos))[0]).iterdir())[0].read_bytes()
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(jpg)


@pytest.mark.parametrize("case", ["imagefolder", "list-nested", "list-class-prefix"])
def test_pack_refuses_samples_that_unpack_to_one_file(photos: Path, tmp_path: Path, case: str) -> None:
    """`cat/a/b.jpg` and `cat/a_b.jpg` both unpack to `cat/a_b.jpg`: pack accepted them and every
    `stage --unpack` of the pack failed (exit 3). Pack refuses them, one line naming both."""
    src = tmp_path / "src"
    if case == "imagefolder":
        _images(src, ["cat/a/b.jpg", "cat/a_b.jpg", "cat/c.jpg", "dog/a_b.jpg"], photos)
        arg = src
    else:
        rows = ["sub/a.jpg", "sub_a.jpg"] if case == "list-nested" else ["cat/a.jpg", "a.jpg"]
        _images(src, rows, photos)
        arg = src / "list.csv"
        arg.write_text("path,label\n" + "".join(f"{r},cat\n" for r in rows))
    out = tmp_path / "out"
    r = stager("pack", str(arg), str(out), "--format", "tar", "-q")
    line = one_line_error(r, r.returncode, "would both unpack", "rename one")
    assert r.returncode != 0 and line.count(str(src)) == 2
    assert not (out / "manifest.json").exists()


def test_pack_accepts_nested_folders_that_unpack_apart(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    _images(src, ["cat/a/b.jpg", "cat/a/c.jpg", "cat/b.jpg", "dog/a_b.jpg"], photos)
    out, dest = tmp_path / "out", tmp_path / "dest"
    assert stager("pack", str(src), str(out), "--format", "tar", "-q").returncode == 0
    r = stager("stage", str(out), str(dest), "--unpack", "only", "-q")
    assert r.returncode == 0, r.stderr
    got = sorted(str(p.relative_to(dest / "unpacked")) for p in (dest / "unpacked").rglob("*.jpg"))
    assert got == ["cat/a_b.jpg", "cat/a_c.jpg", "cat/b.jpg", "dog/a_b.jpg"]


@pytest.mark.parametrize("case", ["label", "class", "file"])
def test_a_newline_in_a_name_gives_one_whole_error_line(photos: Path, tmp_path: Path, case: str) -> None:
    """The error named the path with the name in it raw: the CLI keeps one line, so the message was cut
    at the newline (`.../list.jsonl/x`) and the reason lost."""
    src = tmp_path / "src"
    if case == "label":
        _images(src, ["a.jpg"], photos)
        arg = src / "list.jsonl"
        arg.write_text(json.dumps({"path": "a.jpg", "label": "x\ny"}) + "\n")
    else:
        _images(src, ["ok/a.jpg", "c\nd/b.jpg" if case == "class" else "ok/a\nb.jpg"], photos)
        arg = src
    r = stager("pack", str(arg), str(tmp_path / "out"), "--format", "tar", "-q")
    line = one_line_error(r, r.returncode, "control character", "rename it")
    assert r.returncode != 0 and "\\n" in line


# ---- B. a second uid: a dataset whose shard is named after the victim's own file ---------------------------
def test_a_dataset_cannot_name_a_victims_file_for_clean_to_delete(node: Node, tmp_path: Path) -> None:
    """Whoever writes a dataset names its shards. One named `notes.txt`, with a hash no copy matches: the
    victim's stage into their project directory failed (exit 3) after recording `notes.txt` in its
    journal, and the README's `stager clean DEST` then deleted the victim's own notes.txt."""
    ds = node.data / "ds"
    make_dataset(ds, n=2, size=16 << 10, seed=11)
    body = json.loads((ds / "manifest.json").read_text())
    good = [ShardInfo(s["name"], s["bytes"], s["hash"], [], *(np.zeros(0, np.int64),) * 3) for s in body["shards"]]
    (ds / good[0].name).rename(ds / "notes.txt")
    bad = ShardInfo("notes.txt", good[0].bytes, "0" * 32, [], *(np.zeros(0, np.int64),) * 3)
    (ds / "manifest.json").unlink()
    Manifest(format="tar", classes=[], shards=[bad, good[1]]).write(ds)
    for p in [ds, *ds.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    project = node.home(VICTIM) / "project"
    r = run_as(VICTIM, ["sh", "-c", 'mkdir -m 755 "$1" && echo "two years of notes" > "$1/notes.txt"', "sh",
                        str(project)])
    assert r.returncode == 0, r.stderr
    env = node.env(VICTIM)
    r = stager_as(VICTIM, "stage", str(ds), str(project), "-q", env=env)
    assert r.returncode == 2 and "notes.txt" in r.stderr and "Traceback" not in r.stderr, r.stderr
    stager_as(VICTIM, "clean", str(project), env=env)  # the README's trap runs it whatever stage did
    assert (project / "notes.txt").read_text() == "two years of notes\n"
    assert RECEIPT_NAME not in os.listdir(project)

"""stage --unpack: ImageFolder output from real packs, and hostile tar members refused safely."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest

from stager.checksum import hash_file
from stager.manifest import Manifest, ShardInfo, load_manifest
from stager.pack import pack
from stager.receipt import find_staged_copy, load_receipt
from stager.stage import stage
from tests.test_stage_support import last_json, stager


def _tree(root: Path) -> dict[str, bytes]:
    """{"<class>/<stem>": bytes}: pack normalises extensions (.JPEG -> .jpg), the bytes stay identical."""
    return {str(p.relative_to(root).with_suffix("")): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def packed_tar(imagenet_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "tar"
    pack(imagenet_tiny, out, format="tar", samples_per_shard=5)
    return out


def test_unpack_also_writes_imagefolder_identical_to_source(packed_tar: Path, imagenet_tiny: Path,
                                                             tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    r = stager("stage", str(packed_tar), str(dest), "--unpack", "--json")
    assert r.returncode == 0, r.stderr
    out = last_json(r.stdout)
    src_tree = _tree(imagenet_tiny)
    assert out["unpacked_files"] == len(src_tree)
    assert _tree(dest / "unpacked") == src_tree
    rec = load_receipt(dest)
    assert rec is not None and rec.unpacked == str(dest / "unpacked")
    assert (dest / "shard-00000.tar").exists()
    again = stager("stage", str(packed_tar), str(dest), "--unpack", "--json")
    assert last_json(again.stdout)["already_staged"]
    assert stager("clean", str(dest)).returncode == 0
    assert not (dest / "unpacked").exists() and not any(dest.iterdir())


def test_unpack_only_streams_from_source_and_keeps_no_shards(packed_tar: Path, imagenet_tiny: Path,
                                                             tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    res = stage(packed_tar, dest, unpack="only", unpack_dir="train")
    assert _tree(dest / "train") == _tree(imagenet_tiny)
    assert not list(dest.glob("shard-*"))
    m = load_manifest(packed_tar).detached()
    # The loader must not mistake an unpack-only DEST for a staged shard copy.
    assert find_staged_copy(m, [dest]) is None
    assert res.unpacked_files == m.num_samples


def test_unpack_only_no_fsync_journals_every_shard_as_volatile(packed_tar: Path, imagenet_tiny: Path,
                                                               tmp_path: Path) -> None:
    import json

    from stager.fs.kernel import boot_id

    dest = tmp_path / "dest"
    r = stager("stage", str(packed_tar), str(dest), "--unpack", "only", "--no-fsync", "--json")
    assert r.returncode == 0, r.stderr
    assert last_json(r.stdout)["durable"] is False
    assert _tree(dest / "unpacked") == _tree(imagenet_tiny)
    lines = [json.loads(x) for x in (dest / ".stager-journal.jsonl").read_text().splitlines()[1:]]
    shards = json.loads((packed_tar / "manifest.json").read_text())["shards"]
    assert sorted(x["u"] for x in lines if "u" in x) == sorted(s["name"] for s in shards)
    assert all(x["v"] == boot_id() for x in lines)


def test_unpack_only_catches_a_damaged_source_shard(packed_tar: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for p in packed_tar.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    shard = src / "shard-00001.tar"
    data = bytearray(shard.read_bytes())
    data[-600] ^= 0x40  # inside the end-of-archive padding region or last member: hashing catches it
    shard.write_bytes(bytes(data))
    r = stager("stage", str(src), str(tmp_path / "d"), "--unpack", "only", "-j", "1")
    assert r.returncode == 3, r.stderr
    assert "shard-00001.tar" in r.stderr


def test_unpack_reads_each_source_shard_once(packed_tar: Path, imagenet_tiny: Path, tmp_path: Path) -> None:
    """``--unpack`` of tar shards copies each shard and writes its members in one pass over SRC: the
    bytes the process reads (``/proc/self/io`` rchar, every thread) are the shards once, not once to
    copy and again from DEST to unpack. The copies are the verified ones, byte for byte, journaled."""
    import json
    import subprocess
    import sys

    code = ("import json, sys, stager.stage, stager.stage.unpack, numpy\n"
            "def rchar():\n"
            "    return int(dict(l.split(': ') for l in open('/proc/self/io').read().splitlines())['rchar'])\n"
            "before = rchar(); r = stager.stage.stage(sys.argv[1], sys.argv[2], unpack='also', workers=2)\n"
            "print(json.dumps({'read': rchar() - before, 'copied': r.files_copied, 'files': r.unpacked_files}))")
    dest = tmp_path / "dest"
    out = subprocess.run([sys.executable, "-c", code, str(packed_tar), str(dest)], capture_output=True, text=True,
                         check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    shards = sorted(packed_tar.glob("shard-*.tar"))
    shard_bytes = sum(p.stat().st_size for p in shards)
    assert got["copied"] == len(shards) and got["files"] == len(_tree(imagenet_tiny))
    assert shard_bytes <= got["read"] < 1.5 * shard_bytes, (got, shard_bytes)
    assert all((dest / p.name).read_bytes() == p.read_bytes() for p in shards)
    assert _tree(dest / "unpacked") == _tree(imagenet_tiny)
    lines = [json.loads(x) for x in (dest / ".stager-journal.jsonl").read_text().splitlines()[1:]]
    assert sorted(x["f"] for x in lines if "f" in x) == [p.name for p in shards]
    assert sorted(x["u"] for x in lines if "u" in x) == [p.name for p in shards]


# The child of the ordering test: every rename (CPython's audit hook, process-wide), every return from
# stager.fs.kernel.syncfs (a profile hook on every thread: the flush has completed) and, at each of them,
# the shard files the journal already lists.
_ORDER_CHILD = """
import json, os, sys, threading
dest = sys.argv[2]
journal = os.path.join(dest, ".stager-journal.jsonl")
kernel = os.path.join("stager", "fs", "kernel.py")
events, lock, local = [], threading.Lock(), threading.local()
def listed():
    try:
        with open(journal, "rb") as f:
            return sorted(json.loads(x)["f"] for x in f.read().splitlines()[1:] if b'"f"' in x)
    except OSError:
        return []
def record(what):
    # The guard is per thread (reading the journal inside record() is audited and profiled too); a shared
    # one dropped the rename another worker made meanwhile. The lock keeps each event with its listing.
    if getattr(local, "busy", False):
        return
    local.busy = True
    try:
        with lock:
            events.append(what + [listed()])
    finally:
        local.busy = False
def audit(event, args):
    if event == "os.rename":
        record(["rename", os.path.basename(os.fsdecode(args[1]))])
def profile(frame, event, arg):
    if event == "return" and frame.f_code.co_name == "syncfs" and frame.f_code.co_filename.endswith(kernel):
        record(["syncfs"])
import stager.stage
sys.addaudithook(audit)
threading.setprofile(profile)
sys.setprofile(profile)
stager.stage.stage(sys.argv[1], dest, unpack="also", workers=2)
sys.setprofile(None)
print(json.dumps(events))
"""


def test_unpack_journals_and_publishes_its_copies_only_after_a_syncfs(packed_tar: Path, tmp_path: Path) -> None:
    """The one-pass ``--unpack`` has no fsync per shard: each copy is renamed into place and made durable
    by the unpack's ``syncfs`` (as ``sync`` does). Seen in the syscalls the process makes, in order: a
    shard's journal line appears only after a ``syncfs`` that came after its rename; ``manifest.json``
    and then the receipt are renamed into place only after a ``syncfs`` that came after the last
    shard's rename. So a power loss can never leave a receipt, manifest or journal line that names a
    copy the disk does not hold (kill -9 loses nothing: the page cache outlives the process)."""
    import json
    import subprocess
    import sys

    dest = tmp_path / "dest"
    out = subprocess.run([sys.executable, "-c", _ORDER_CHILD, str(packed_tar), str(dest)], capture_output=True,
                         text=True, check=True)
    events = json.loads(out.stdout.splitlines()[-1])
    shards = sorted(p.name for p in packed_tar.glob("shard-*.tar"))
    renamed = {e[1]: i for i, e in enumerate(events) if e[0] == "rename" and e[1] in shards}  # to final names
    assert sorted(renamed) == shards, events
    syncs = [i for i, e in enumerate(events) if e[0] == "syncfs"]
    for name, i in renamed.items():
        first_listed = next((j for j, e in enumerate(events) if name in e[-1]), len(events))
        assert any(i < k < first_listed for k in syncs), (name, events)
        assert i < first_listed
    published = {e[1]: i for i, e in enumerate(events) if e[0] == "rename"
                 and e[1] in ("manifest.json", "stager-receipt.json")}
    assert set(published) == {"manifest.json", "stager-receipt.json"}, events
    last = max(renamed.values())
    assert any(last < k < published["manifest.json"] for k in syncs), events
    assert published["manifest.json"] < published["stager-receipt.json"]
    assert events[published["stager-receipt.json"]][-1] == shards  # the journal lists every copy by then


@pytest.mark.parametrize("damage", ["flipped", "grown"])
def test_unpack_of_a_damaged_shard_keeps_no_copy_no_member_and_no_manifest(packed_tar: Path, tmp_path: Path,
                                                                          damage: str) -> None:
    """A shard that differs from the manifest (a flipped byte; bytes appended after packing) fails the
    one-pass ``--unpack`` with exit 3 naming it: its partial copy and its members are removed, and DEST
    has no manifest.json (published only once every shard is in place)."""
    src = tmp_path / "src"
    src.mkdir()
    for p in packed_tar.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    shard = src / "shard-00001.tar"
    data = bytearray(shard.read_bytes())
    if damage == "flipped":
        data[-600] ^= 0x40
    else:
        data += b"\0" * (4 << 20)
    shard.write_bytes(bytes(data))
    dest = tmp_path / "d"
    r = stager("stage", str(src), str(dest), "--unpack", "-j", "1")
    assert r.returncode == 3, r.stderr
    assert "shard-00001.tar" in r.stderr.splitlines()[-1]  # its hash, size or a header: the line names it
    assert not (dest / "manifest.json").exists()
    assert not list(dest.glob("*.partial")) and not (dest / "shard-00001.tar").exists()
    members = {p.stem for p in (dest / "unpacked").rglob("*") if p.is_file()}
    keys = load_manifest(packed_tar).shards[1].keys
    assert not members & {k.rsplit("/", 1)[-1] for k in keys}


def test_unpack_hdf5_through_its_reader(imagenet_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "h5"
    pack(imagenet_tiny, out, format="hdf5", samples_per_shard=8)
    dest = tmp_path / "dest"
    stage(out, dest, unpack=True)
    assert _tree(dest / "unpacked") == _tree(imagenet_tiny)


# ---- hostile archives -----------------------------------------------------------------------------
def _hostile_shard(tmp: Path, kind: str) -> tuple[Path, str]:
    """A packed dir with one tar shard holding a benign image and one hostile member ``kind``."""
    src = tmp / f"src-{kind}"
    src.mkdir()
    buf = io.BytesIO()
    good = b"\xff\xd8good-jpeg-bytes\xff\xd9"
    evil_name = {"dotdot": "../../evil.jpg", "absolute": "/tmp/evil-abs.jpg", "symlink": "c0/link.jpg",
                 "hardlink": "c0/hard.jpg", "device": "c0/dev.jpg", "oversize": "c0/big.jpg",
                 "fifo": "c0/fifo.jpg"}[kind]
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        ti = tarfile.TarInfo("c0/a.jpg")
        ti.size = len(good)
        tf.addfile(ti, io.BytesIO(good))
        ti = tarfile.TarInfo(evil_name)
        payload = b""
        if kind == "symlink":
            ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
        elif kind == "hardlink":
            ti.type, ti.linkname = tarfile.LNKTYPE, "c0/a.jpg"
        elif kind == "device":
            ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
        elif kind == "fifo":
            ti.type = tarfile.FIFOTYPE
        else:
            payload = b"x" * 100
        ti.size = len(payload)
        tf.addfile(ti, io.BytesIO(payload))
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        members = tf.getmembers()
    shard = src / "shard-00000.tar"
    shard.write_bytes(buf.getvalue())
    keys = ["c0/a", evil_name.rsplit(".", 1)[0]]
    offsets = np.array([m.offset_data for m in members], np.int64)
    sizes = np.array([len(good), 10 if kind == "oversize" else members[1].size], np.int64)
    nbytes, h = hash_file(shard)
    info = ShardInfo(shard.name, nbytes, h, keys, np.zeros(2, np.int64), offsets, sizes)
    Manifest(format="tar", classes=["c0"], shards=[info]).write(src)
    return src, evil_name


def _snapshot(root: Path, skip: Path) -> set[str]:
    return {str(p) for p in root.rglob("*") if skip not in p.parents and p != skip}


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "device", "fifo", "oversize"])
def test_hostile_members_are_refused_and_nothing_escapes(tmp_path: Path, kind: str) -> None:
    src, evil = _hostile_shard(tmp_path, kind)
    dest = tmp_path / "work" / "dest"
    dest.parent.mkdir()
    before = _snapshot(tmp_path, dest)
    r = stager("stage", str(src), str(dest), "--unpack", "-q")
    assert r.returncode == 3, (kind, r.stderr)
    assert "shard-00000.tar" in r.stderr
    if kind in ("dotdot", "absolute", "oversize"):
        assert evil.lstrip("/").split("/")[-1] in r.stderr
    assert _snapshot(tmp_path, dest) == before  # nothing written outside DEST
    assert not os.path.exists("/tmp/evil-abs.jpg")
    files = [p for p in (dest / "unpacked").rglob("*") if p.is_file() or p.is_symlink()]
    assert files == []  # the benign member of the refused shard was removed too
    assert load_receipt(dest) is None


def test_hostile_class_name_is_refused(tmp_path: Path) -> None:
    src, _ = _hostile_shard(tmp_path, "oversize")
    m = load_manifest(src).detached()
    m.classes = ["../up"]
    m.shards[0].sizes[1] = 100
    m.digest = ""
    m.write(src)
    dest = tmp_path / "dest"
    r = stager("stage", str(src), str(dest), "--unpack", "-q")
    assert r.returncode == 3 and "../up" in r.stderr
    assert not (tmp_path / "up").exists()


def test_unpack_dir_symlink_is_refused(packed_tar: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dest / "unpacked").symlink_to(elsewhere)
    r = stager("stage", str(packed_tar), str(dest), "--unpack", "-q")
    # A refusal of a path someone could have planted: exit 2, one line naming it (docs/security.md).
    assert r.returncode == 2 and "unpack directory is a symlink" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not any(elsewhere.iterdir())


def test_cifar_pack_unpacks_with_distinct_names_and_cleans(cifar_tiny: Path, tmp_path: Path) -> None:
    """CIFAR keys (``data_batch_1/00006``, ``data_batch_2/00006``) share basenames within a class:
    they must unpack to distinct files, every sample once, and `stager clean` must remove them all."""
    import subprocess
    import sys


    out, dest = tmp_path / "p", tmp_path / "d"

    def run(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "stager", *a], check=False, capture_output=True, text=True)

    assert run("pack", str(cifar_tiny), str(out), "--format", "tar", "-q").returncode == 0
    r = run("stage", str(out), str(dest), "--unpack", "also", "-q")
    assert r.returncode == 0, r.stderr
    m = load_manifest(out)
    files = sorted(p for p in (dest / "unpacked").rglob("*") if p.is_file())
    assert len(files) == m.num_samples
    assert len({p.relative_to(dest / "unpacked") for p in files}) == m.num_samples
    r = run("clean", str(dest), "-q")
    assert r.returncode == 0, r.stderr
    assert not (dest / "unpacked").exists() or not any((dest / "unpacked").rglob("*.png"))

"""Hostile input: archives, manifests, receipts, images and pickles crafted to escape or exhaust.

Every case runs the real CLI (``python -m stager``) against a crafted dataset whose shard hashes
are correct (so integrity checks pass and the parsers are the line of defence), inside a sandbox
directory. Invariants: the command refuses with a non-zero exit and one error line (no
traceback); nothing is written, changed or removed outside DEST (a snapshot of the sandbox, DEST
excluded, is unchanged); victim files keep their bytes. Each case is recorded in the reliability
table (docs/reliability.md).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from stager.checksum import hash_file
from stager.manifest import Manifest, ShardInfo, load_manifest
from tools.faults import harness as h
from tools.faults.tally import record


@functools.cache
def small_jpeg() -> bytes:
    """A small real JPEG (8x8 grey)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 127, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


# ---- crafting ----------------------------------------------------------------------------------------------
def tar_bytes(members: list[tuple[tarfile.TarInfo, bytes]], fmt: int = tarfile.GNU_FORMAT
              ) -> tuple[bytes, dict[str, int]]:
    """A tar of ``members``; returns its bytes and each member's data offset (first occurrence)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    raw = buf.getvalue()
    offsets: dict[str, int] = {}
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        for m in t.getmembers():
            offsets.setdefault(m.name, m.offset_data)
    return raw, offsets


def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = target
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        ti.devmajor, ti.devminor = 1, 3  # /dev/null's numbers
    return ti, b""


def write_pack(src: Path, shard: bytes, samples: list[tuple[str, int, int, int]], classes: list[str], *,
               name: str = "shard-00000.tar", fmt: str = "tar") -> Path:
    """A packed directory with one shard of bytes ``shard`` indexed by ``(key, label, offset, size)``."""
    src.mkdir(parents=True, exist_ok=True)
    (src / name).write_bytes(shard)
    nbytes, digest = hash_file(src / name)
    arr = lambda i: np.array([s[i] for s in samples], dtype=np.int64)  # noqa: E731
    info = ShardInfo(name, nbytes, digest, [s[0] for s in samples], arr(1), arr(2), arr(3))
    Manifest(format=fmt, classes=classes, shards=[info]).write(src)
    return src


def hostile_tar_pack(src: Path, extra: list[tuple[tarfile.TarInfo, bytes]], *, first: bool = False,
                     fmt: int = tarfile.GNU_FORMAT) -> Path:
    """A pack whose one shard holds a valid sample ``k0.jpg`` plus the ``extra`` members."""
    good = [reg("k0.jpg", small_jpeg()), reg("k0.cls", b"0")]
    raw, offsets = tar_bytes(extra + good if first else good + extra, fmt)
    return write_pack(src, raw, [("k0", 0, offsets["k0.jpg"], len(small_jpeg()))], ["c0"])


class Sandbox:
    """``root/`` holds SRC, DEST (``root/box/a/dest``, so ``../`` lands inside the sandbox) and victims."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dest = root / "box" / "a" / "dest"
        self.dest.parent.mkdir(parents=True)
        self.victim = root / "box" / "victim.txt"
        self.victim.write_bytes(b"do not touch\n")
        self.before: dict[str, tuple[object, ...]] = {}

    def freeze(self) -> None:
        self.before = h.snapshot(self.root, skip=self.dest)

    def unchanged(self) -> bool:
        return h.snapshot(self.root, skip=self.dest) == self.before and self.victim.read_bytes() == b"do not touch\n"


def refused(r: subprocess.CompletedProcess[str], codes: tuple[int, ...] = (3,)) -> bool:
    return r.returncode in codes and bool(h.one_line_error(r.stderr))


def run_case(row: str, sb: Sandbox, src: Path, commands: list[list[str]], codes: tuple[int, ...] = (3,)) -> None:
    """Run each command on ``src``; all must be refused and leave the sandbox unchanged."""
    sb.freeze()
    handled = 0
    msgs = []
    for cmd in commands:
        args = [a.replace("{SRC}", str(src)).replace("{DEST}", str(sb.dest)) for a in cmd]
        r = h.cli(*args)
        ok = refused(r, codes) and sb.unchanged()
        handled += int(ok)
        msgs.append(f"{' '.join(cmd)} -> exit {r.returncode}: {r.stderr.strip()[-300:]}")
        if sb.dest.exists() and cmd[0] == "stage":
            import shutil

            shutil.rmtree(sb.dest)
    record(row, group="hostile input", trials=len(commands), handled=handled,
           lost=len(commands) - handled, note="refused with one line; nothing written outside DEST")
    assert handled == len(commands), msgs


UNPACK_AND_VERIFY = [
    ["stage", "{SRC}", "{DEST}", "--unpack", "also", "-q"],
    ["stage", "{SRC}", "{DEST}", "--unpack", "only", "-q"],
    ["verify", "{SRC}", "--deep", "-q"],
]


# ---- tar members ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../evil.jpg", "../../evil.jpg", "k1/../../../evil.jpg", "ABS", "./../evil.jpg"])
def test_escaping_member_names(tmp_path: Path, name: str) -> None:
    sb = Sandbox(tmp_path)
    if name == "ABS":
        name = str(sb.root / "box" / "abs-evil.jpg")
    src = hostile_tar_pack(tmp_path / "src", [reg(name, small_jpeg())])
    run_case("tar member named ../x or /abs/x", sb, src, UNPACK_AND_VERIFY)
    assert not list(sb.root.rglob("*evil*"))


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_escaping_long_names(tmp_path: Path, fmt: int) -> None:
    # > 100 bytes: tarfile writes a PAX 'path' record or a GNU 'L' long-name member.
    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [reg("../" * 3 + "x" * 120 + "/../../evil.jpg", small_jpeg())], fmt=fmt)
    run_case("tar PAX/GNU long name escaping DEST", sb, src, UNPACK_AND_VERIFY)
    assert not list(sb.root.rglob("*evil*"))


@pytest.mark.parametrize(("kind", "target"), [
    (tarfile.SYMTYPE, "../../victim.txt"), (tarfile.SYMTYPE, "/etc/passwd"),
    (tarfile.LNKTYPE, "VICTIM"), (tarfile.LNKTYPE, "k0.jpg"),
])
def test_link_members(tmp_path: Path, kind: bytes, target: str) -> None:
    sb = Sandbox(tmp_path)
    target = str(sb.victim) if target == "VICTIM" else target
    for first in (False, True):  # the link before or after the indexed sample
        src = hostile_tar_pack(tmp_path / f"src{int(first)}", [special("k1.jpg", kind, target)], first=first)
        run_case("tar symlink/hardlink member pointing outside", sb, src, UNPACK_AND_VERIFY)


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_device_members(tmp_path: Path, kind: bytes) -> None:
    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [special("k1.jpg", kind)])
    run_case("tar device/FIFO member", sb, src, UNPACK_AND_VERIFY)


def test_duplicate_member_names(tmp_path: Path) -> None:
    """A second ``k0.jpg`` must never replace the indexed one: refused, or the indexed bytes win."""
    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [reg("k0.jpg", b"EVIL" * 100)])
    sb.freeze()
    handled = 0
    r = h.cli("verify", str(src), "--deep", "-q")
    handled += int(refused(r) and "k0" in r.stderr + r.stdout)
    for mode in ("also", "only"):
        r = h.cli("stage", str(src), str(sb.dest), "--unpack", mode, "-q")
        out = sb.dest / "unpacked" / "c0" / "k0.jpg"
        ok = (refused(r) or (r.returncode == 0 and out.read_bytes() == small_jpeg())) and sb.unchanged()
        handled += int(ok)
        import shutil

        shutil.rmtree(sb.dest, ignore_errors=True)
    record("tar duplicate member names", group="hostile input", trials=3, handled=handled, lost=3 - handled,
           note="deep verify refuses; unpack writes only the indexed member")
    assert handled == 3


def test_enormous_declared_member_size(tmp_path: Path) -> None:
    sb = Sandbox(tmp_path)
    raw, offsets = tar_bytes([reg("k0.jpg", small_jpeg()), reg("k1.jpg", b"x" * 10)])
    # Patch k1's size field to the largest octal value (64 GiB) and fix its header checksum.
    hdr_at = offsets["k1.jpg"] - 512
    hdr = bytearray(raw[hdr_at:hdr_at + 512])
    hdr[124:136] = b"77777777777\0"
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    raw = raw[:hdr_at] + bytes(hdr) + raw[hdr_at + 512:]
    src = write_pack(tmp_path / "src", raw, [("k0", 0, offsets["k0.jpg"], len(small_jpeg()))], ["c0"])
    run_case("tar member with an enormous declared size", sb, src, UNPACK_AND_VERIFY)


def test_member_not_matching_index(tmp_path: Path) -> None:
    sb = Sandbox(tmp_path)
    raw, offsets = tar_bytes([reg("other.jpg", small_jpeg())])
    src = write_pack(tmp_path / "src", raw, [("k0", 0, offsets["other.jpg"], len(small_jpeg()))], ["c0"])
    run_case("tar member name not matching the manifest index", sb, src, UNPACK_AND_VERIFY[:2])


# ---- manifests -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["../evil.tar", "/tmp/evil.tar", "sub/evil.tar", "..", ".hidden.tar", "a\\b.tar",
                                 "manifest.json"])
def test_shard_names_with_separators(tmp_path: Path, bad: str) -> None:
    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [])
    m = load_manifest(src).detached()
    m.shards[0].name = bad
    (src / "manifest.json").write_bytes(m.to_bytes())  # a valid digest over the hostile body
    run_case("manifest shard name with a path separator / .. / reserved name", sb, src,
             [["stage", "{SRC}", "{DEST}", "-q"], ["verify", "{SRC}", "-q"], ["stage", "{SRC}", "{DEST}", "--unpack",
                                                                                "only", "-q"]])
    assert not sb.dest.exists() or not any(sb.dest.iterdir())


def test_companion_name_escaping(tmp_path: Path) -> None:
    from stager.manifest import AuxFile

    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [])
    m = load_manifest(src).detached()
    m.shards[0].aux = [AuxFile("../../evil.idx", 4, "00")]
    (src / "manifest.json").write_bytes(m.to_bytes())
    run_case("manifest shard name with a path separator / .. / reserved name", sb, src,
             [["stage", "{SRC}", "{DEST}", "-q"], ["verify", "{SRC}", "-q"]])


@pytest.mark.parametrize("cls", ["../../evil", "a/b", "..", ""])
def test_hostile_class_names(tmp_path: Path, cls: str) -> None:
    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [])
    m = load_manifest(src).detached()
    m.classes = [cls]
    (src / "manifest.json").write_bytes(m.to_bytes())
    run_case("manifest class name escaping the unpack tree", sb, src, UNPACK_AND_VERIFY[:2])
    assert not list(sb.root.rglob("*evil*"))


def test_enormous_declared_shard_size(tmp_path: Path) -> None:
    """A manifest claiming a 1 EB shard: stage refuses before copying (no space), verify by size."""
    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [])
    m = load_manifest(src).detached()
    m.shards[0].bytes = 1 << 60
    (src / "manifest.json").write_bytes(m.to_bytes())
    sb.freeze()
    cases = [(h.cli("stage", str(src), str(sb.dest), "-q"), (4,)),
             (h.cli("verify", str(src), "-q"), (3,))]
    handled = sum(int(refused(r, c) and sb.unchanged()) for r, c in cases)
    record("manifest with an enormous declared shard size", group="hostile input", trials=2, handled=handled,
           lost=2 - handled, note="stage: exit 4 before copying; verify: exit 3 (size)")
    assert handled == 2, [(r.returncode, r.stderr) for r, _ in cases]


# ---- receipts, clean, pre-planted links ------------------------------------------------------------------------
def staged(tmp_path: Path, sb: Sandbox, unpack: bool = False) -> Path:
    src = hostile_tar_pack(tmp_path / "src", [])
    r = h.cli("stage", str(src), str(sb.dest), "-q", *(["--unpack", "also"] if unpack else []))
    assert r.returncode == 0, r.stderr
    return src


@pytest.mark.parametrize("entry", ["../victim.txt", "../../victim.txt", "ABS", "LINKDIR/victim.txt"])
def test_clean_refuses_receipt_entries_outside_dest(tmp_path: Path, entry: str) -> None:
    import json

    sb = Sandbox(tmp_path)
    staged(tmp_path, sb)
    if entry == "ABS":
        entry = str(sb.victim)
    if entry.startswith("LINKDIR"):
        os.symlink(sb.victim.parent, sb.dest / "LINKDIR")
    rp = sb.dest / "stager-receipt.json"
    rec = json.loads(rp.read_bytes())
    rec["files"].insert(0, entry)
    rp.write_text(json.dumps(rec))
    inside = sorted(p.name for p in sb.dest.iterdir())
    run_case("receipt listing paths outside DEST (`stager clean`)", sb, sb.dest, [["clean", "{SRC}", "-q"]])
    assert sorted(p.name for p in sb.dest.iterdir()) == inside  # refused means nothing removed at all


def test_clean_removes_only_what_stage_wrote(tmp_path: Path) -> None:
    sb = Sandbox(tmp_path)
    staged(tmp_path, sb)
    mine = sb.dest / "my-notes.txt"
    mine.write_text("user data")
    r = h.cli("clean", str(sb.dest), "-q")
    ok = r.returncode == 0 and mine.read_text() == "user data" and sorted(p.name for p in sb.dest.iterdir()) == [
        "my-notes.txt"]
    record("`stager clean` next to files it did not stage", group="hostile input", trials=1, handled=int(ok),
           lost=1 - int(ok), note="only the receipt's files are removed")
    assert ok, (r.returncode, r.stderr, sorted(p.name for p in sb.dest.iterdir()))


def test_clean_keeps_user_files_inside_the_unpacked_tree(tmp_path: Path) -> None:
    """A file a user added under DEST/unpacked/ was not staged by stager: clean must keep it."""
    sb = Sandbox(tmp_path)
    staged(tmp_path, sb, unpack=True)
    mine = sb.dest / "unpacked" / "c0" / "my-label-fix.txt"
    mine.write_text("user data")
    r = h.cli("clean", str(sb.dest), "-q")
    ok = r.returncode == 0 and mine.exists() and not (sb.dest / "unpacked" / "c0" / "k0.jpg").exists()
    record("`stager clean` next to files it did not stage", group="hostile input", trials=1, handled=int(ok),
           lost=1 - int(ok), note="only the receipt's files are removed")
    assert ok, (r.returncode, r.stderr, [str(p) for p in h.files_under(sb.dest)])


def test_preplanted_symlinks_in_dest(tmp_path: Path) -> None:
    """Links planted in DEST (shared /tmp) before staging: never written through."""
    sb = Sandbox(tmp_path)
    src = hostile_tar_pack(tmp_path / "src", [])
    handled = 0
    # 1. the shard's final name is a symlink to the victim
    sb.dest.mkdir()
    os.symlink(sb.victim, sb.dest / "shard-00000.tar")
    sb.freeze()
    r = h.cli("stage", str(src), str(sb.dest), "-q")
    # Replaced, or (no record says a stage wrote that name: stager/stage/place.py) refused, exit 2.
    handled += int(sb.unchanged() and (refused(r, (2,)) or (r.returncode == 0
                                                             and not (sb.dest / "shard-00000.tar").is_symlink())))
    import shutil

    shutil.rmtree(sb.dest)
    # 2. the unpack tree's class directory is a symlink to a directory outside
    (sb.dest / "unpacked").mkdir(parents=True)
    os.symlink(sb.victim.parent, sb.dest / "unpacked" / "c0")
    sb.freeze()
    r = h.cli("stage", str(src), str(sb.dest), "--unpack", "also", "-q")
    handled += int(refused(r, (2, 3)) and sb.unchanged())
    shutil.rmtree(sb.dest)
    # 3. an unpacked file's final name is a symlink to the victim
    (sb.dest / "unpacked" / "c0").mkdir(parents=True)
    os.symlink(sb.victim, sb.dest / "unpacked" / "c0" / "k0.jpg")
    sb.freeze()
    r = h.cli("stage", str(src), str(sb.dest), "--unpack", "also", "-q")
    handled += int(sb.unchanged() and (refused(r, (2,)) or (
        r.returncode == 0 and (sb.dest / "unpacked" / "c0" / "k0.jpg").read_bytes() == small_jpeg())))
    record("symlinks pre-planted in DEST (shard, class dir, unpacked file)", group="hostile input", trials=3,
           handled=handled, lost=3 - handled, note="replaced or refused, never written through")
    assert handled == 3


# ---- decompression bombs --------------------------------------------------------------------------------------
def png_bomb(w: int = 15000, h_: int = 15000) -> bytes:
    """An 8-bit grayscale PNG of w x h zero pixels: ~0.2 MB on disk, 225 MB decoded (PIL's limit: 179 M pixels)."""
    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    c = zlib.compressobj(9)
    row = b"\0" * (w + 1)
    body = b"".join([c.compress(row) for _ in range(h_)] + [c.flush()])
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h_, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


def jpeg_bomb() -> bytes:
    """A real small JPEG whose frame header claims 60000 x 60000 pixels (10.8 GB decoded)."""
    data = bytearray(small_jpeg())
    i = 2
    while i < len(data):
        marker, length = data[i + 1], (data[i + 2] << 8) | data[i + 3]
        if marker in (0xC0, 0xC2):
            data[i + 5:i + 9] = struct.pack(">HH", 60000, 60000)
            break
        i += 2 + length
    return bytes(data)


@pytest.fixture(scope="module")
def bomb_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bombs") / "tree"
    (root / "c0").mkdir(parents=True)
    (root / "c0" / "bomb.png").write_bytes(png_bomb())
    (root / "c0" / "ok.jpg").write_bytes(small_jpeg())
    (root / "c1").mkdir()
    (root / "c1" / "bomb.jpg").write_bytes(jpeg_bomb())
    (root / "c1" / "ok.jpg").write_bytes(small_jpeg())
    return root


def limited(gb: float) -> Callable[[], None]:
    def pre() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (int(gb * (1 << 30)), int(gb * (1 << 30))))

    return pre


LOADER_SCRIPT = """
import sys
from stager.errors import CorruptSampleError
from stager.loader import make_loader
for policy in ("raise", "skip"):
    keys = []
    try:
        for b in make_loader(sys.argv[1], 2, staged=False, image_size=32, on_error=policy, shuffle=False):
            keys += b["key"]
    except CorruptSampleError as exc:
        print(policy, "REFUSED", exc)
        continue
    print(policy, "KEYS", sorted(keys))
"""


def test_decompression_bombs(bomb_tree: Path, tmp_path: Path) -> None:
    """Bomb images under a 3 GiB address-space limit: pack --resize refuses (PIL's limit), the loader
    refuses (raise) or skips them (skip), never allocating the decoded size."""
    handled = 0
    trials = 0
    # pack without re-encoding passes bytes through (headers are valid): the loader is the defence.
    out = tmp_path / "packed"
    r = h.run_stager("pack", str(bomb_tree), str(out), "--format", "tar", "-q", preexec_fn=limited(3))
    assert r.returncode == 0, r.stderr
    trials += 1
    r = h.run_stager("pack", str(bomb_tree), str(tmp_path / "resized"), "--format", "tar", "--resize", "32x32", "-q",
                     preexec_fn=limited(3))
    handled += int(refused(r, (3,)) and "bomb" in r.stderr)
    r = h.run([sys.executable, "-c", LOADER_SCRIPT, str(out)], preexec_fn=limited(3))
    lines = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if ln.startswith(("raise ", "skip ")))
    trials += 2
    handled += int(r.returncode == 0 and lines.get("raise", "").startswith("REFUSED") and "bomb" in lines["raise"])
    handled += int(r.returncode == 0 and lines.get("skip") == "KEYS ['c0/ok', 'c1/ok']")
    record("decompression-bomb images (PNG 225 Mpx, JPEG 3.6 Gpx)", group="hostile input", trials=trials,
           handled=handled, lost=trials - handled, note="PIL's pixel limit on; 3 GiB address-space cap holds")
    assert handled == trials, r.stdout + r.stderr


# ---- pickles ---------------------------------------------------------------------------------------------------
class _Exploit:
    def __init__(self, func: object, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.func, (self.arg,)


def cifar_dir_with(root: Path, batch: bytes, meta: bytes | None = None) -> Path:
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    (d / "data_batch_1").write_bytes(batch)
    if meta is not None:
        (d / "batches.meta").write_bytes(meta)
    return d


def good_batch() -> bytes:
    return pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}, protocol=2)


@pytest.mark.parametrize("variant", ["os.system", "eval", "subprocess", "meta", "nested", "protocol0", "codecs"])
def test_malicious_cifar_pickles_refused_without_executing(tmp_path: Path, variant: str) -> None:
    marker = tmp_path / "PWNED"
    cmd = f"touch {marker}"
    payloads = {
        "os.system": _Exploit(os.system, cmd),
        "eval": _Exploit(eval, f"__import__('os').system({cmd!r})"),
        "subprocess": _Exploit(subprocess.getoutput, cmd),
    }
    meta = None
    if variant in payloads:
        batch = pickle.dumps({b"data": payloads[variant], b"labels": [0]}, protocol=2)
    elif variant == "meta":
        batch, meta = good_batch(), pickle.dumps(_Exploit(os.system, cmd))
    elif variant == "nested":  # hidden deep inside an otherwise valid batch
        batch = pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0],
                              b"x": [{"y": (_Exploit(os.system, cmd),)}]}, protocol=4)
    elif variant == "protocol0":
        batch = pickle.dumps({b"data": _Exploit(os.system, cmd), b"labels": [0]}, protocol=0)
    else:  # _codecs.encode is allowed for latin1 only; any other codec is refused
        batch = b"\x80\x02c_codecs\nencode\nq\x00X\x03\x00\x00\x00abcq\x01X\x05\x00\x00\x00rot13q\x02\x86q\x03Rq\x04."
    src = cifar_dir_with(tmp_path / "c", batch, meta)
    r = h.cli("pack", str(src), str(tmp_path / "out"), "--format", "tar", "-q")
    ok = refused(r, (3,)) and "refusing" in r.stderr and not marker.exists()
    record("malicious pickle in a CIFAR batch (restricted unpickler)", group="hostile input", trials=1,
           handled=int(ok), lost=int(not ok), note="refused before any callable runs; marker file never created")
    assert ok, (r.returncode, r.stderr)
    assert not marker.exists()

"""A user's copies are the user's (docs/security.md), attacked for real: two unprivileged uids on one
node share a sticky ``tmp`` (tests/asuser.py); the attacker plants directories, receipts, shards,
journals, locks, links and FIFOs; the victim runs the real CLI and loader. Each test is a row of issue
29's table (and failed on the code before it was fixed) or an attack a security review adds (hard
links, FIFOs as shards, races at each check-then-use).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from stager.manifest import Manifest, ShardInfo, load_manifest
from tests.asuser import ACCOUNT_VICTIM, ATTACKER, VICTIM, Node, popen_as, python_argv, python_as, run_as, stager_as
from tests.test_stage_support import make_dataset
from tools.datagen import make_imagefolder

RESOLVE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from stager.loader.shard_access import resolve
r = resolve(sys.argv[1])
print(json.dumps({"root": r.root, "staged": r.staged}))
"""


def readable(root: Path) -> Path:
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


@pytest.fixture
def shards(node: Node) -> Path:
    """A packed directory of random shards in the node's shared data directory (everyone may read it)."""
    make_dataset(node.data / "ds", n=4, size=32 << 10, seed=3)
    return readable(node.data / "ds")


@pytest.fixture
def images(node: Node, tmp_path: Path) -> Path:
    """A real tar pack of JPEGs (the loader and --unpack need samples)."""
    from stager.pack import pack

    src = make_imagefolder(tmp_path / "if", num_classes=2, per_class=4, seed=5, size=(32, 32))
    pack(src, node.data / "pack", "tar", samples_per_shard=3)
    return readable(node.data / "pack")


def as_attacker(script: str, *args: str | os.PathLike[str]) -> None:
    r = run_as(ATTACKER, ["sh", "-c", script, "sh", *map(str, args)])
    assert r.returncode == 0, r.stderr


def victim(node: Node, *args: str | os.PathLike[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return stager_as(VICTIM, *args, env=node.env(VICTIM), timeout=timeout)


def one_line_refusal(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2, one line on stderr holding every needle, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def poisoned_copy(src: Path, dest: Path, owner: int = ATTACKER.uid) -> None:
    """Copy ``src``'s shards, with every byte of their middle flipped (same sizes), and its manifest."""
    dest.mkdir(mode=0o755, exist_ok=True)
    for p in src.iterdir():
        data = bytearray(p.read_bytes())
        if p.name != "manifest.json" and not p.name.endswith(".sidx"):
            mid = len(data) // 2
            data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
        (dest / p.name).write_bytes(bytes(data))
    for p in [dest, *dest.iterdir()]:
        os.chown(p, owner, owner)


def forged_receipt(src: Path, dest: Path, shards: list[str] | None = None) -> None:
    m = load_manifest(src)
    rec = {"schema": "stager.receipt/1", "dataset_id": m.dataset_id, "manifest_digest": m.digest,
           "source": str(src), "dest": str(dest), "created": "2020-01-01T00:00:00+00:00", "host": "node",
           "verified": "xxh3_128 while copying", "mode": "full", "partition": None,
           "shards": [s.name for s in m.shards] if shards is None else shards, "unpacked": None,
           "files": [], "stats": {}, "durable": True, "boot_id": ""}
    (dest / "stager-receipt.json").write_text(json.dumps(rec))
    os.chown(dest / "stager-receipt.json", ATTACKER.uid, ATTACKER.gid)


# ---- row 5: the loader and a shared $TMPDIR -------------------------------------------------------------
def test_loader_skips_a_planted_copy_that_sorts_first(node: Node, images: Path) -> None:
    """Row 5 (high): another user plants a directory with a receipt for this dataset and same-size
    poisoned shards that sorts before the victim's copy; the loader read it silently."""
    r = victim(node, "stage", images, "--json")
    assert r.returncode == 0, r.stderr
    mine = json.loads(r.stdout)["dest"]
    poison = node.tmp / "0-poison"
    poisoned_copy(images, poison)
    forged_receipt(images, poison)
    r = python_as(VICTIM, RESOLVE, str(images), env=node.env(VICTIM))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"root": mine, "staged": True}, r.stderr
    assert f"skipped the staged copy at {poison}" in r.stderr and f"owned by uid {ATTACKER.uid}" in r.stderr


def test_loader_skips_a_planted_receipt_without_shards(node: Node, images: Path) -> None:
    """Row 5 (high): a planted receipt that lists no shards made the loader fail."""
    empty = node.tmp / "0-empty"
    empty.mkdir(mode=0o755)
    os.chown(empty, ATTACKER.uid, ATTACKER.gid)
    forged_receipt(images, empty, shards=[])
    r = python_as(VICTIM, RESOLVE, str(images), env=node.env(VICTIM))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"root": str(images), "staged": False}, r.stderr
    assert f"skipped the staged copy at {empty}" in r.stderr


def test_loader_skips_copies_of_its_own_user_that_do_not_hold(node: Node, images: Path) -> None:
    """The victim's own directories count only when the receipt names that directory and lists
    shards of this dataset that are present, regular and not writable by others: each skip says why."""
    r = victim(node, "stage", images, "--json")
    mine = Path(json.loads(r.stdout)["dest"])
    moved = node.tmp / "0-moved"
    assert run_as(VICTIM, ["cp", "-a", str(mine), str(moved)]).returncode == 0
    shard = next(p for p in mine.iterdir() if p.suffix == ".tar")
    assert run_as(VICTIM, ["chmod", "0666", str(shard)]).returncode == 0
    r = python_as(VICTIM, RESOLVE, str(images), env=node.env(VICTIM))
    assert json.loads(r.stdout) == {"root": str(images), "staged": False}, r.stderr
    assert f"{moved}: its receipt was written for {mine}" in r.stderr
    assert f"{mine}: {shard.name} is missing, not a regular file of yours, writable by others" in r.stderr


# ---- row 6: stage and a shared $TMPDIR --------------------------------------------------------------------
def test_stage_never_uses_a_predictable_destination_someone_else_made(node: Node, shards: Path) -> None:
    """Row 6 (high): another user pre-creates ``$TMPDIR/stager-<id>``; stage crashed with a traceback.
    Now it stages into a fresh name of its own (the loader finds it) and says so."""
    taken = node.tmp / f"stager-{load_manifest(shards).dataset_id}"
    as_attacker('mkdir -m 0755 "$1"', taken)
    r = victim(node, "stage", shards, "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    res = json.loads(r.stdout)
    assert res["dest"].startswith(f"{taken}.") and res["files_copied"] == 4, res
    assert f"{taken} is a directory owned by uid {ATTACKER.uid}" in r.stderr and "staged into" in r.stderr
    assert not any(taken.iterdir())
    r = python_as(VICTIM, RESOLVE, str(shards), env=node.env(VICTIM))
    assert json.loads(r.stdout)["root"] == res["dest"], r.stderr
    again = victim(node, "stage", shards, "--json")  # found again: the fresh name is reused, not multiplied
    assert json.loads(again.stdout)["dest"] == res["dest"] and json.loads(again.stdout)["already_staged"]


def test_stage_never_keeps_files_seeded_in_a_world_writable_destination(node: Node, shards: Path) -> None:
    """Row 6 (high): the pre-created destination is world-writable and seeded with poisoned shards and a
    journal; stage reported ``files_kept`` and wrote a receipt saying "verified" without copying."""
    m = load_manifest(shards)
    taken = node.tmp / f"stager-{m.dataset_id}"
    poisoned_copy(shards, taken)
    journal = [{"journal": 1, "digest": m.digest}, *({"f": s.name, "b": s.bytes} for s in m.shards)]
    (taken / ".stager-journal.jsonl").write_text("".join(json.dumps(x) + "\n" for x in journal))
    os.chown(taken / ".stager-journal.jsonl", ATTACKER.uid, ATTACKER.gid)
    for p in [taken, *taken.iterdir()]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    r = victim(node, "stage", shards, "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["dest"] != str(taken) and res["files_kept"] == 0 and res["files_copied"] == 4, res
    assert victim(node, "verify", res["dest"]).returncode == 0
    assert not (taken / "stager-receipt.json").exists()


def test_stage_is_not_blocked_by_a_lock_another_user_holds(node: Node, shards: Path) -> None:
    """Row 6 (high): another user holds the lock of the predictable destination; the victim waited
    forever, silently (here: until --timeout)."""
    taken = node.tmp / f"stager-{load_manifest(shards).dataset_id}"
    as_attacker('mkdir -m 0777 "$1" && chmod 0777 "$1"', taken)
    hold = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666); os.fchmod(fd, 0o666); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()")
    holder = popen_as(ATTACKER, [*python_argv(), "-c", hold, str(taken / ".stager-lock")], env=node.env(ATTACKER))
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        r = victim(node, "stage", shards, "--json", "--timeout", "20")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["dest"] != str(taken)
    finally:
        holder.kill()
        holder.wait()


def test_stage_refuses_a_destination_that_is_not_the_users(node: Node, shards: Path) -> None:
    """Row 6 (high), an explicit DEST: one line, exit 2, naming the path, the owner or mode found and
    what to do; nothing is written there."""
    theirs = node.tmp / "theirs"
    as_attacker('mkdir -m 0755 "$1"', theirs)
    one_line_refusal(victim(node, "stage", shards, theirs), f"{theirs}: staging destination is a directory owned by "
                     f"uid {ATTACKER.uid}", "mode 0755", "choose another DEST")
    open_dir = node.tmp / "open"
    assert run_as(VICTIM, ["sh", "-c", f"mkdir -m 0777 {open_dir} && chmod 0777 {open_dir}"]).returncode == 0
    one_line_refusal(victim(node, "stage", shards, open_dir), "writable by others (mode 0777)", "chmod go-w")
    link = node.tmp / "link"
    as_attacker('ln -s "$1" "$2"', node.home(VICTIM), link)
    one_line_refusal(victim(node, "stage", shards, link), f"{link}: staging destination is a symlink")
    one_line_refusal(victim(node, "stage", shards, theirs / "sub"), f"lies in {theirs}")
    assert not any(theirs.iterdir()) and not any(open_dir.iterdir())
    assert not [p for p in node.home(VICTIM).iterdir() if p.name.startswith(("shard", "manifest"))]


def test_a_users_private_group_may_write(node: Node, shards: Path) -> None:
    """Sites that give each user a private group set ``umask 002``: a DEST the user made by hand is
    then group-writable, and that group is only theirs, so it is accepted; a shared group's write bit
    is not."""
    user = ACCOUNT_VICTIM
    if user.name == VICTIM.name or __import__("grp").getgrgid(user.gid).gr_name != user.name:
        pytest.skip("needs an account with a private group of its name")
    home = node.home(user)
    dest = home / "dest"
    r = run_as(user, ["sh", "-c", f"umask 002 && mkdir {dest}"])
    assert r.returncode == 0 and stat.S_IMODE(os.stat(dest).st_mode) == 0o775, r.stderr
    r = stager_as(user, "stage", shards, dest, "--json", env=node.env(user))
    assert r.returncode == 0, r.stderr
    os.chown(dest, user.uid, ATTACKER.gid)  # the same mode with a group others are in
    r = stager_as(user, "stage", shards, dest, env=node.env(user))
    one_line_refusal(r, "writable by its group (mode 0775)")


def test_bookkeeping_files_that_are_not_the_users_are_refused(node: Node, shards: Path) -> None:
    """Inside the user's own DEST: a journal that is a hard link (to the user's notes), a lock that is
    a FIFO, an unpack directory of another owner: refused in one line, never written through or
    blocked on."""
    home = node.home(VICTIM)
    dest = home / "dest"
    notes = home / "notes.txt"
    made = run_as(VICTIM, ["sh", "-c", f"mkdir {dest} && echo mine > {notes} && "
                                       f"ln {notes} {dest}/.stager-journal.jsonl"])
    assert made.returncode == 0, made.stderr
    one_line_refusal(victim(node, "stage", shards, dest), "staging journal", "2 hard links")
    assert notes.read_text() == "mine\n"
    os.unlink(dest / ".stager-journal.jsonl")
    os.mkfifo(dest / ".stager-lock")
    os.chown(dest / ".stager-lock", VICTIM.uid, VICTIM.gid)
    one_line_refusal(victim(node, "stage", shards, dest, timeout=60), "staging lock is a FIFO")
    os.unlink(dest / ".stager-lock")
    (dest / "unpacked").mkdir()
    os.chown(dest / "unpacked", ATTACKER.uid, ATTACKER.gid)
    one_line_refusal(victim(node, "stage", shards, dest, "--unpack"), "unpack directory",
                     f"owned by uid {ATTACKER.uid}")


# ---- row 7: the lock ---------------------------------------------------------------------------------------
def test_a_planted_lock_link_is_never_written_through(node: Node, shards: Path) -> None:
    """Row 7 (high): a symlink at ``.stager-lock`` was opened without O_NOFOLLOW, and the lock record
    overwrote its target (any file the victim can write): by stage and by clean."""
    notes = node.home(VICTIM) / "notes.txt"
    assert run_as(VICTIM, ["sh", "-c", f"echo precious > {notes}"]).returncode == 0
    shared = node.tmp / "scratch"
    as_attacker('mkdir -m 0777 "$1" && chmod 0777 "$1" && ln -s "$2" "$1/.stager-lock"', shared, notes)
    r = victim(node, "stage", shards, shared)
    assert r.returncode == 2 and notes.read_text() == "precious\n", (r.stderr, notes.read_text())
    forged_receipt(shards, shared)
    r = victim(node, "clean", shared)
    assert r.returncode == 2 and notes.read_text() == "precious\n", (r.stderr, notes.read_text())


# ---- row 8: clean --------------------------------------------------------------------------------------------
def test_clean_decides_under_the_lock_and_never_leaves_dest(node: Node, images: Path) -> None:
    """Row 8 (high): clean checked paths before taking the lock; another user (DEST writable by others)
    swapped a directory for a symlink after the check, and clean deleted a file outside DEST. Here the
    check is held at the old gap by a FIFO manifest the attacker planted."""
    dest = node.home(VICTIM) / "scratch"
    r = victim(node, "stage", images, dest, "--unpack")
    assert r.returncode == 0, r.stderr
    assert run_as(VICTIM, ["chmod", "0777", str(dest)]).returncode == 0  # a scratch directory others may write
    node.home(VICTIM).chmod(0o755)
    important = node.home(VICTIM) / "important"
    assert run_as(VICTIM, ["sh", "-c", f"mkdir {important} && echo data > {important}/x.tar"]).returncode == 0
    rec = json.loads((dest / "stager-receipt.json").read_text())
    rec["files"].insert(0, "sub/x.tar")
    r = run_as(ATTACKER, ["sh", "-c", 'mkdir "$1/sub" && echo bait > "$1/sub/x.tar" && cat > "$1/r.tmp" && '
                          'mv -f "$1/r.tmp" "$1/stager-receipt.json" && rm -f "$1/manifest.json" && '
                          'mkfifo -m 0666 "$1/manifest.json"', "sh", str(dest)], input=json.dumps(rec))
    assert r.returncode == 0, r.stderr
    cleaner = popen_as(VICTIM, [*python_argv(), "-m", "stager", "clean", str(dest)], env=node.env(VICTIM))
    from tests.test_trust_prolog import wait_for

    def writer() -> int | None:
        """A write end of the FIFO once clean has it open for reading (kept open: closing it is the
        reader's EOF), else None."""
        try:
            return os.open(dest / "manifest.json", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return None

    held: list[int] = []
    wait_for(lambda: cleaner.poll() is not None or held.append(fd := writer()) or fd is not None,
             "clean waits on the FIFO (or ended)")
    as_attacker('rm -rf "$1/sub" && ln -s "$2" "$1/sub"', dest, important)
    for fd in held:
        if fd is not None:
            os.write(fd, b"{}")
            os.close(fd)
    _, err = cleaner.communicate(timeout=120)
    assert (important / "x.tar").exists(), "clean deleted a file outside DEST"
    assert cleaner.returncode == 2 and "writable by others (mode 0777)" in err, err


# ---- row 9: reserved names -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["stager-receipt.json", "unpacked", "shard.0123456789ab.partial"])
def test_stagers_own_names_are_reserved_in_manifests(tmp_path: Path, name: str) -> None:
    """Row 9 (medium): a hostile dataset names a shard ``stager-receipt.json`` (a forged receipt once
    staged), or another of stager's own names; index, stage and verify refuse it in one line."""
    from stager.checksum import hash_file
    from tests.test_stage_support import stager

    src = tmp_path / "src"
    m = make_dataset(src, n=2, size=4 << 10)
    forged = json.dumps({"schema": "stager.receipt/1", "dataset_id": "elsewhere"}).encode()
    (src / name).write_bytes(forged)
    (src / m.shards[0].name).unlink()
    nbytes, h = hash_file(src / name)
    empty = m.shards[0].offsets[:0]
    shards = [ShardInfo(name, nbytes, h, [], empty, empty, empty), *m.shards[1:]]
    (src / "manifest.json").unlink()
    Manifest(format="tar", classes=[], shards=shards).write(src)
    for args in (["stage", str(src), str(tmp_path / "dest")], ["verify", str(src)]):
        r = stager(*args)
        assert r.returncode == 3 and "reserved for stager's own files" in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())
    if name == "unpacked":  # the other names end in suffixes `stager index` never takes for a shard
        loose = tmp_path / "loose"
        loose.mkdir()
        shutil.copy(src / m.shards[1].name, loose / name)
        r = stager("index", str(loose), "--format", "tar", "--out", str(tmp_path / "ix"))
        assert r.returncode == 3 and "reserved" in r.stderr, r.stderr


# ---- row 10: secrets ------------------------------------------------------------------------------------------
def test_url_secrets_never_printed_or_stored(node: Node, images: Path, tmp_path: Path) -> None:
    """Row 10 (medium): ``http://user:password@host/...`` and ``?token=`` appeared in --json, receipts
    (0644), error messages, inspect and the loader's log."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e .[http]; make venv)")
    from tests.test_stage_support import stager
    from tools.objstore_servers import RangeHTTPServer

    server = RangeHTTPServer(node.data)
    try:
        base = server.url.replace("http://", "http://alice:PASSWORD-7f3@")
        url = f"{base}/pack"
        dest = tmp_path / "dest"
        outs = []
        r = stager("stage", url, str(dest), "--json")
        assert r.returncode == 0, r.stderr
        outs += [r.stdout, r.stderr]
        receipt = dest / "stager-receipt.json"
        outs.append(receipt.read_text())
        assert stat.S_IMODE(os.stat(receipt).st_mode) == 0o600
        outs += [stager("inspect", url, "--json").stdout, stager("inspect", url).stdout]
        missing = stager("stage", f"{base}/nothing-here?token=TOKEN-9c1&sig=SIG-55", str(tmp_path / "d2"), "--json")
        assert missing.returncode != 0
        outs += [missing.stdout, missing.stderr]
        log = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
               "from stager.loader.shard_access import resolve; resolve(sys.argv[1], staging_roots=(sys.argv[2],))")
        r = subprocess.run([sys.executable, "-c", log, url, str(tmp_path)], capture_output=True, text=True,
                           timeout=180, check=False)
        assert "reading staged full copy" in r.stderr, r.stderr
        outs += [r.stdout, r.stderr]
        for text in outs:
            assert "PASSWORD-7f3" not in text and "TOKEN-9c1" not in text and "SIG-55" not in text, text
        assert "http://***@127.0.0.1" in outs[0] and "token=***" in missing.stderr
    finally:
        server.stop()


# ---- row 11: the umask ----------------------------------------------------------------------------------------
def test_modes_follow_the_umask(node: Node, images: Path) -> None:
    """Row 11 (low): shards, manifest, receipt and DEST took the source's mode whatever the umask.
    Now everything stage writes is the source's access less the umask (owner bits always)."""
    dest = node.home(VICTIM) / "private"
    r = run_as(VICTIM, ["sh", "-c", 'umask 077; exec "$0" -m stager stage "$1" "$2" --unpack', *python_argv(),
                        str(images), str(dest)], env=node.env(VICTIM))
    assert r.returncode == 0, r.stderr
    modes = {str(p.relative_to(dest)): stat.S_IMODE(os.lstat(p).st_mode) for p in [dest, *dest.rglob("*")]}
    files = {k: v for k, v in modes.items() if not (dest / k).is_dir()}
    dirs = {k: v for k, v in modes.items() if (dest / k).is_dir()}
    assert set(files.values()) == {0o600}, files
    assert set(dirs.values()) == {0o700}, dirs


def test_group_only_data_stays_group_only(node: Node, images: Path) -> None:
    """A group-only (licensed) source stays group-only in every file stage writes, and the umask can
    take the group away too, never add to it."""
    licensed = node.data / "licensed"
    shutil.copytree(images, licensed)
    for p in [licensed, *licensed.rglob("*")]:
        os.chown(p, 0, VICTIM.gid)
        p.chmod(0o750 if p.is_dir() else 0o640)
    for umask, fmode, dmode in (("022", 0o640, 0o750), ("027", 0o640, 0o750), ("077", 0o600, 0o700)):
        dest = node.home(VICTIM) / f"u{umask}"
        r = run_as(VICTIM, ["sh", "-c", f'umask {umask}; exec "$0" -m stager stage "$1" "$2" --unpack',
                            *python_argv(), str(licensed), str(dest)], env=node.env(VICTIM))
        assert r.returncode == 0, r.stderr
        for p in [dest, *dest.rglob("*")]:
            # stage's own bookkeeping (journal, lock) is private whatever the source: 0600
            want = dmode if p.is_dir() else 0o600 if p.name.startswith(".stager-") else fmode
            assert stat.S_IMODE(os.lstat(p).st_mode) == want, (umask, p, oct(os.lstat(p).st_mode))


# ---- FIFOs as data --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_a_fifo_in_a_datasets_place_never_blocks(tmp_path: Path, where: str) -> None:
    """A hostile dataset puts a FIFO where a shard or the manifest goes: stage, verify and inspect fail
    in one line, naming it, instead of blocking forever."""
    from tests.test_stage_support import stager

    src = tmp_path / "src"
    m = make_dataset(src, n=2, size=4 << 10)
    victim_name = m.shards[0].name if where == "shard" else "manifest.json"
    (src / victim_name).unlink()
    os.mkfifo(src / victim_name)
    runs = [["stage", str(src), str(tmp_path / "dest"), "-q"], ["verify", str(src), "-q"]]
    if where == "manifest":
        runs.append(["inspect", str(src)])
    for args in runs:
        r = stager(*args, timeout=60)  # the deadline only guards a hang
        assert r.returncode != 0 and "is a FIFO" in r.stderr and "Traceback" not in r.stderr, (args, r)
        assert victim_name in r.stderr.strip().splitlines()[-1 if args[0] != "verify" else 0], r.stderr


# ---- item 7: the documented cleanup with several copies ---------------------------------------------------------
def test_documented_cleanup_with_several_copies(node: Node, shards: Path, images: Path) -> None:
    """docs/staging.md's cleanup (``for d in "$TMPDIR"/stager-*/; do stager clean "$d"; done``) with
    several copies present: two datasets of the victim's, one of them under a fresh name because another
    user took the predictable one; the victim's copies go, the other user's directory stays."""
    taken = node.tmp / f"stager-{load_manifest(shards).dataset_id}"
    as_attacker('mkdir -m 0755 "$1" && echo theirs > "$1/keep"', taken)
    for src in (shards, images):
        assert victim(node, "stage", src).returncode == 0
    ours = [p for p in node.tmp.iterdir() if p.stat().st_uid == VICTIM.uid]
    assert len(ours) == 2
    loop = ('for d in "$TMPDIR"/stager-*/; do "$0" -m stager clean "$d" --json || echo "refused: $d" >&2; done')
    r = run_as(VICTIM, ["sh", "-c", loop, *python_argv()], env=node.env(VICTIM))
    assert not any(p.exists() for p in ours), r.stderr
    assert (taken / "keep").read_text() == "theirs\n" and f"refused: {taken}/" in r.stderr


def test_a_held_lock_is_never_waited_on_silently(tmp_path: Path) -> None:
    """Row 6's "waits forever, silently": a stage that waits for the node lock says who holds it
    (once, after a few seconds of waiting), and --timeout ends the wait with exit 5."""
    from stager.fs.lock import NodeLock
    from tests.test_stage_support import stager

    src = tmp_path / "src"
    make_dataset(src, n=1, size=4 << 10)
    dest = tmp_path / "dest"
    dest.mkdir(mode=0o700)
    with NodeLock(dest / ".stager-lock"):
        r = stager("stage", str(src), str(dest), "--timeout", "8")  # the notice comes at 5 s, the same clock
    assert r.returncode == 5, r.stderr
    assert f"waiting for {dest / '.stager-lock'}, held by pid {os.getpid()}" in r.stderr

"""stager.fs.safe, the one module every open, create, lock, rename and remove of a plantable path goes
through: links are never followed, FIFOs never block, owners and modes are checked on what is held,
and work inside a checked directory is relative to its handle. The owner rules are exercised with
real files of another uid (tests/asuser.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from stager.errors import UnsafePathError
from stager.fs.lock import NodeLock
from stager.fs.safe import SafeDir, check_chain, open_regular, open_trusted, private_dir, problem, read_trusted
from tests.asuser import ATTACKER, requires_users


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    (tmp_path / "d").mkdir(mode=0o700)
    os.symlink(target, tmp_path / "d" / "rec")
    with pytest.raises(UnsafePathError, match=r"d/rec: receipt is a symlink .*links are not followed"):
        read_trusted(tmp_path / "d" / "rec", what="receipt")
    with SafeDir.open(tmp_path / "d") as d:
        with pytest.raises(UnsafePathError, match="symlink"):
            d.open_file("rec", os.O_RDWR)
        d.write_atomic("rec", b"new", 0o600)  # replaces the link, never writes through it
        assert not os.path.islink(d.join("rec")) and Path(d.join("rec")).read_bytes() == b"new"
    assert target.read_bytes() == b"keep"
    os.symlink(tmp_path / "d", tmp_path / "link")
    with pytest.raises(UnsafePathError, match="link: directory is a symlink"):
        SafeDir.open(tmp_path / "link")


def test_a_fifo_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "shard-000.tar"
    os.mkfifo(fifo)
    done = threading.Event()

    def attempt() -> None:
        with pytest.raises(UnsafePathError, match="is a FIFO"):
            open_regular(fifo)
        with pytest.raises(UnsafePathError, match="FIFO"):
            open_trusted(fifo)
        done.set()

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(60)
    assert done.is_set(), "opening a FIFO blocked"


def test_modes_and_links_are_judged_on_what_is_held(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    f.chmod(0o644)
    assert problem(os.lstat(f)) is None
    f.chmod(0o664)
    assert "writable by its group" in (problem(os.lstat(f)) or "")
    f.chmod(0o646)
    assert "writable by others" in (problem(os.lstat(f)) or "")
    f.chmod(0o600)
    os.link(f, tmp_path / "g")
    assert problem(os.lstat(f)) is None
    assert "2 hard links" in (problem(os.lstat(f), single_link=True) or "")
    sticky = tmp_path / "t"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert problem(os.lstat(sticky), expect="dir") is not None
    assert problem(os.lstat(sticky), expect="dir", sticky_ok=True) is None
    assert "expected a directory" in (problem(os.lstat(f), expect="dir") or "")


@requires_users
def test_another_users_files_and_directories_are_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "rec").write_bytes(b"{}")
    os.chown(theirs, ATTACKER.uid, ATTACKER.gid)
    os.chown(theirs / "rec", ATTACKER.uid, ATTACKER.gid)
    with pytest.raises(UnsafePathError, match=rf"theirs: staging destination is a directory owned by uid "
                       rf"{ATTACKER.uid}, mode 0755 \(owned by uid {ATTACKER.uid}\); expected owned by .*root"):
        SafeDir.open(theirs, what="staging destination")
    with pytest.raises(UnsafePathError, match=f"owned by uid {ATTACKER.uid}"):
        read_trusted(theirs / "rec", what="receipt")
    with pytest.raises(UnsafePathError, match=r"lies in .*theirs"):
        check_chain(theirs / "sub")
    with pytest.raises(UnsafePathError, match=r"lies in .*theirs"):
        private_dir(theirs, "mine")


def test_private_dir_is_created_exclusively_and_reused_only_when_trusted(tmp_path: Path) -> None:
    d, created = private_dir(tmp_path / "a" / "b", "copy", 0o750)
    with d:
        assert created and stat.S_IMODE(d.st.st_mode) == 0o750 & ~_umask()
    d, created = private_dir(tmp_path / "a" / "b", "copy", 0o750)
    d.close()
    assert not created
    os.chmod(tmp_path / "a" / "b" / "copy", 0o777)
    with pytest.raises(UnsafePathError, match=r"writable by others \(mode 0777\)"):
        private_dir(tmp_path / "a" / "b", "copy")
    os.symlink(tmp_path, tmp_path / "a" / "b" / "planted")
    with pytest.raises(UnsafePathError, match="symlink"):
        private_dir(tmp_path / "a" / "b", "planted")


def test_remove_walks_handles_and_never_leaves_the_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.jpg").write_bytes(b"k")
    dest = tmp_path / "dest"
    (dest / "tree" / "cls").mkdir(parents=True)
    (dest / "tree" / "cls" / "a.jpg").write_bytes(b"aa")
    (dest / "tree" / "cls" / "mine.txt").write_bytes(b"user file")
    os.symlink(outside, dest / "tree" / "escape")
    with SafeDir.open(dest) as d:
        n, freed = d.remove("tree", keep=lambda rel: rel.endswith(".txt"))
    assert (outside / "keep.jpg").exists(), "followed a symlink out of the tree"
    assert sorted(p.name for p in (dest / "tree").rglob("*")) == ["cls", "mine.txt"]
    assert (n, freed) == (2, 2 + len(os.fsencode(str(outside))))  # a.jpg and the link itself
    with SafeDir.open(dest) as d:
        d.remove("tree")
    assert not (dest / "tree").exists() and (outside / "keep.jpg").exists()


def test_the_lock_itself_never_follows_or_blocks(tmp_path: Path) -> None:
    """The lock's own rules, whatever the directory: a symlink or FIFO at its name is refused."""
    target = tmp_path / "target"
    target.write_text("keep\n")
    os.symlink(target, tmp_path / ".stager-lock")
    with pytest.raises(UnsafePathError, match="stage lock is a symlink"), NodeLock(tmp_path / ".stager-lock"):
        pass
    assert target.read_text() == "keep\n"
    os.unlink(tmp_path / ".stager-lock")
    os.mkfifo(tmp_path / ".stager-lock")
    with pytest.raises(UnsafePathError, match="stage lock is a FIFO"), NodeLock(tmp_path / ".stager-lock"):
        pass


def test_removal_never_follows_a_component_swapped_during_the_walk(tmp_path: Path) -> None:
    """The race a review tries on any recursive delete: while the tree is walked, a directory in it is
    replaced by a symlink to outside, over and over. Whatever the interleaving, nothing outside goes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for i in range(20):
        (outside / f"{i}.jpg").write_bytes(b"x")
    dest = tmp_path / "dest"
    for _ in range(30):
        for c in range(8):
            (dest / "tree" / f"c{c}").mkdir(parents=True, exist_ok=True)
            for i in range(5):
                (dest / "tree" / f"c{c}" / f"{i}.jpg").write_bytes(b"y")
        stop = threading.Event()

        def swap(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                for c in range(8):
                    p = dest / "tree" / f"c{c}"
                    try:
                        os.rename(p, dest / f"aside{c}")
                        os.symlink(outside, p)
                    except OSError:
                        pass

        t = threading.Thread(target=swap)
        t.start()
        try:
            with SafeDir.open(dest) as d:
                d.remove("tree")
        finally:
            stop.set()
            t.join()
        assert sorted(p.name for p in outside.iterdir()) == sorted(f"{i}.jpg" for i in range(20))
        shutil.rmtree(dest)


def test_lock_never_writes_through_a_link_swapped_in_meanwhile(tmp_path: Path) -> None:
    """The lock's check-then-use: its name flips between a symlink to a file and nothing while locks are
    taken and released; the file is never written."""
    target = tmp_path / "target"
    target.write_text("keep\n")
    lock = tmp_path / ".stager-lock"
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileExistsError):
                os.symlink(target, lock)
            try:
                if os.path.islink(lock):
                    os.unlink(lock)
            except FileNotFoundError:
                pass

    t = threading.Thread(target=flip)
    t.start()
    taken = refused = 0
    try:
        for _ in range(300):
            try:
                with NodeLock(lock, timeout=5):
                    taken += 1
            except UnsafePathError:
                refused += 1
    finally:
        stop.set()
        t.join()
    assert target.read_text() == "keep\n" and taken + refused == 300


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m

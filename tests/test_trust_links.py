"""No path through another user's link (issue 39, item 3), attacked for real as unprivileged uids
(tests/asuser.py) against the real CLI and the unmodified tools/slurm scripts (stand-in
squeue/scontrol: tests/test_trust_prolog.py).

In a sticky, world-writable directory (``/tmp``, a shared scratch) anyone may create a symbolic link
and re-point it at any moment; the kernel refuses to follow another user's link there only with
``fs.protected_symlinks=1``, which this node does not set and stager must not rely on. So a DEST or a
prolog root whose path passes through such a link is refused in one line, and everything after the
check uses the real path, in Python (:func:`stager.fs.safe.check_chain`) and in the shell library
(``stager_resolve``).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.asuser import ATTACKER, VICTIM, Node, run_as, stager_as
from tests.test_stage_support import make_dataset
from tests.test_trust_prolog import JOB, Service, dataset, service  # noqa: F401 (the fixture)


def _one_line_refusal(r, *words: str) -> None:
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert all(w in lines[0] for w in words), lines[0]


def _as(user, script: str, *args: object) -> None:
    r = run_as(user, ["sh", "-c", script, "sh", *map(str, args)])
    assert r.returncode == 0, r.stderr


@pytest.fixture
def private(node: Node) -> Path:
    """The victim's private dataset (their home is 0700; the files 0600)."""
    src = node.home(VICTIM) / "private"
    make_dataset(src, n=3, size=16 << 10, seed=9)
    for p in [src, *src.iterdir()]:
        os.chown(p, VICTIM.uid, VICTIM.gid)
        p.chmod(0o700 if p.is_dir() else 0o600)
    return src


def test_a_dest_through_another_users_link_in_a_sticky_directory_is_refused(node: Node, private: Path) -> None:
    """Row 4 (medium): another user makes ``shared/alink -> the victim's directory``, then flips it to a
    directory of their own while the victim stages her private data to ``shared/alink/ds``; her files
    landed, readable, in their directory (check_chain checked the link's target, not who owns the link,
    and the stage went on through the unresolved path). Now the path is refused before anything is
    written, naming the link and its owner."""
    work = node.home(VICTIM) / "work"
    _as(VICTIM, 'mkdir -m 0755 "$1"', work)
    node.home(VICTIM).chmod(0o711)  # the attacker's link may point into it
    alink = node.tmp / "alink"
    _as(ATTACKER, 'ln -s "$1" "$2"', work, alink)
    r = stager_as(VICTIM, "stage", private, alink / "ds", "--json", env=node.env(VICTIM))
    _one_line_refusal(r, f"through the symbolic link {alink}, owned by uid {ATTACKER.uid}")
    assert not (work / "ds").exists()
    # The same through a chain of links (the victim's own link to the attacker's): still refused.
    mine = node.tmp / "mine"
    _as(VICTIM, 'ln -s "$1" "$2"', alink, mine)
    _one_line_refusal(stager_as(VICTIM, "stage", private, mine / "ds", env=node.env(VICTIM)), f"uid {ATTACKER.uid}")
    # A relative link of the attacker's, met after a link of the victim's: refused.
    rel = node.tmp / "rel"
    _as(ATTACKER, 'mkdir -m 0755 "$1" && ln -s ../alink "$1/to"', rel)
    mine2 = node.tmp / "mine2"
    _as(VICTIM, 'ln -s rel/to "$1"', mine2)
    _one_line_refusal(stager_as(VICTIM, "stage", private, mine2 / "ds", env=node.env(VICTIM)), f"uid {ATTACKER.uid}")


def test_a_dest_through_links_nobody_else_controls_is_staged_at_its_real_path(node: Node, private: Path) -> None:
    """What is allowed, and that the stage then works on the real path: the victim's own link in the
    sticky directory, and root's link in a root-only directory. The result, the receipt and every
    file name the real DEST; the loader finds the copy through the link too."""
    work = node.home(VICTIM) / "work"
    _as(VICTIM, 'mkdir -m 0700 "$1"', work)
    mylink = node.tmp / "mylink"
    _as(VICTIM, 'ln -s "$1" "$2"', work, mylink)
    rootlink = node.base / "rootlink"
    rootlink.symlink_to(mylink)  # root's, in root's 0755 directory: only root could re-point it
    for via in (mylink, rootlink):
        r = stager_as(VICTIM, "stage", private, via / "ds", "--json", env=node.env(VICTIM))
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["dest"] == str(work / "ds"), res
        assert json.loads((work / "ds" / "stager-receipt.json").read_text())["dest"] == str(work / "ds")
    assert stager_as(VICTIM, "verify", mylink / "ds", "-q", env=node.env(VICTIM)).returncode == 0


def test_a_prolog_root_through_a_users_link_is_refused(service: Service, node: Node) -> None:  # noqa: F811
    """Row 5 (low, configuration): with STAGER_PROLOG_ROOT under a sticky directory, a user's
    ``/shared/pr -> a root-only directory`` made root create ``root/`` there and chown ``job<id>`` to
    the user (the library resolved the path to check it, then ``mkdir -p``'d through the unresolved
    one). Now the shell library walks the path as the kernel does and refuses the user's link."""
    from tests.test_trust_prolog import ATTACKER as JOB_USER

    precious = node.base / "root-only"
    precious.mkdir(mode=0o700)
    pr = node.tmp / "pr"
    _as(JOB_USER, 'ln -s "$1" "$2"', precious, pr)
    service.conf.write_text(service.conf.read_text().replace(f"STAGER_PROLOG_ROOT={service.root}",
                                                             f"STAGER_PROLOG_ROOT={pr}/root"))
    service.comment(f"stager:{dataset(node)}")
    r = service.run("stager-prolog", JOB_USER)
    assert r.returncode == 0, r.stderr
    assert not any(precious.iterdir()), list(precious.rglob("*"))
    line = service.failure_record.read_text()
    assert line.startswith("stager-prolog exit 1: "), line
    assert f"symbolic link {pr}, owned by uid {JOB_USER.uid}" in line, line
    # The epilog and the task prolog do not go through it either.
    (precious / "root").mkdir(mode=0o755)
    (precious / "root" / f"job{JOB}").mkdir(mode=0o700)
    os.chown(precious / "root" / f"job{JOB}", JOB_USER.uid, JOB_USER.gid)
    assert service.run("stager-epilog", JOB_USER).returncode == 0
    assert (precious / "root" / f"job{JOB}").is_dir(), "the epilog removed through the user's link"
    t = service.run("stager-taskprolog", JOB_USER, as_user=JOB_USER)
    assert "STAGER_DEST" not in t.stdout, t.stdout


def test_a_prolog_root_through_roots_own_link_is_used_at_its_real_path(
        service: Service, node: Node) -> None:  # noqa: F811
    """Root's own link in a root-only directory is followed: the job directory is made at the real path,
    which the task prolog exports; the missing parents are made one at a time, root's, 0755."""
    from tests.test_trust_prolog import VICTIM as JOB_USER

    real = node.base / "local"
    real.mkdir(mode=0o755)
    link = node.base / "link"
    link.symlink_to(real)
    service.conf.write_text(service.conf.read_text().replace(f"STAGER_PROLOG_ROOT={service.root}",
                                                             f"STAGER_PROLOG_ROOT={link}/a/root"))
    service.comment(f"stager:{dataset(node)}")
    r = service.run("stager-prolog", JOB_USER)
    assert r.returncode == 0 and not service.failure_record.exists(), (r.stderr, service.admin_comment)
    job_dir = real / "a" / "root" / f"job{JOB}"
    st = os.lstat(real / "a")
    assert stat.S_ISDIR(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    assert list(job_dir.glob("stager-*/manifest.json")), list(real.rglob("*"))
    t = service.run("stager-taskprolog", JOB_USER, as_user=JOB_USER)
    assert t.stdout.splitlines()[0] == f"export STAGER_DEST={job_dir}", t.stdout
    assert service.run("stager-epilog", JOB_USER).returncode == 0 and not job_dir.exists()


def test_check_chain_walks_links_as_the_kernel_does(tmp_path: Path) -> None:
    """Attacking the walk itself: a loop of links is refused (not followed for ever), `..` inside a link
    is its target's parent (as the kernel resolves it, not the lexical one), and a relative link
    resolves against its own directory. (A path given is made absolute lexically first, as stager
    does with every path it is given.)"""
    from stager.errors import UnsafePathError
    from stager.fs.safe import check_chain

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "l1").symlink_to("l2")
    (tmp_path / "l2").symlink_to("l1")
    with pytest.raises(UnsafePathError, match="more than 40 symbolic links"):
        check_chain(tmp_path / "l1" / "x")
    (tmp_path / "tob").symlink_to("a/b")
    (tmp_path / "a" / "b" / "up").symlink_to("../../tob/..")
    assert check_chain(tmp_path / "tob" / "up" / "c") == str(tmp_path / "a" / "c")
    assert check_chain(tmp_path / "tob" / "new" / "deeper") == str(tmp_path / "a" / "b" / "new" / "deeper")

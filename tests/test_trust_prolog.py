"""The prolog service's trust boundary (docs/security.md), attacked for real: the unmodified
tools/slurm/stager-prolog, -epilog and -taskprolog run as root, the job's user and another user are
unprivileged numeric uids (tests/asuser.py), and Slurm's ``squeue``/``scontrol`` are stand-ins
bind-mounted over /usr/local/{s,}bin inside a private mount namespace (the scripts set their own
PATH; nothing on the machine changes). Each test is a row of issue 29's table or an attack a security
review adds; each failed on the scripts before the issue was fixed.

Waits are on events (a process appears, a script exits), each with a deadline that only guards a hang.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.asuser import ACCOUNT_ATTACKER, ACCOUNT_VICTIM, Node, User, popen_as, python_argv, run_as, stager_command
from tests.test_stage_support import make_dataset

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "tools" / "slurm"
JOB = 4242
# Accounts with passwd entries: the scripts look the job's user up (supplementary groups).
ATTACKER, VICTIM = ACCOUNT_ATTACKER, ACCOUNT_VICTIM

SQUEUE = """#!/bin/sh
# stand-in squeue: -o %k prints the job's comment, -o %T its state
case "$*" in
    *%k*) cat "$SHIM_DIR/comment" ;;
    *%T*) cat "$SHIM_DIR/state" 2>/dev/null || echo RUNNING ;;
esac
"""
SCONTROL = """#!/bin/sh
# stand-in scontrol: `update ... AdminComment=X` is recorded, `show job` prints it back
case "$1" in
    update) for a in "$@"; do
                case "$a" in AdminComment=*) printf '%s\\n' "${a#AdminComment=}" >> "$SHIM_DIR/admin";; esac
            done ;;
    show) [ -f "$SHIM_DIR/admin" ] && sed 's/^/   AdminComment=/' "$SHIM_DIR/admin" ;;
esac
exit 0
"""


def wait_for(cond: Callable[[], object], what: str, deadline: float = 120) -> object:
    """Poll ``cond`` until it returns something true; the deadline only guards against a hang."""
    end = time.monotonic() + deadline
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.02)


def feed(fifo: Path, data: bytes) -> bool:
    """Write ``data`` into ``fifo`` and close it if a reader has it open (True), else False at once."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader yet
            return False
        raise
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return True


def _environ(pid: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def processes_with(entry: str) -> list[int]:
    """Pids whose environment holds ``entry`` (``NAME=value``)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and entry in _environ(p)]


class Service:
    """The prolog service on one node of a fake cluster: the scripts as a site installs them, with a
    configuration file, stand-in Slurm commands, a job id and comment."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.root = node.tmp / "stager-prolog"  # the default's situation: in a directory everyone can write
        run = node.base / "run"
        run.mkdir(mode=0o755)
        self.state = run / "stager-prolog"
        self.shims = node.base / "shims"
        self.shims.mkdir(mode=0o755)
        for name, text in (("squeue", SQUEUE), ("scontrol", SCONTROL)):
            (self.shims / name).write_text(text)
            (self.shims / name).chmod(0o755)
        self.conf = node.base / "prolog.conf"
        self.conf.write_text(f"STAGER={stager_command(node.bin)}\nSTAGER_PROLOG_ROOT={self.root}\n"
                             f"STAGER_PROLOG_STATE={self.state}\nSTAGER_PROLOG_POLL=1\n")
        self.job_dir = self.root / f"job{JOB}"

    def comment(self, text: str) -> None:
        (self.shims / "comment").write_text(text + "\n")
        (self.shims / "comment").chmod(0o644)

    @property
    def admin_comment(self) -> str:
        p = self.shims / "admin"
        return p.read_text() if p.exists() else ""

    @property
    def failure_record(self) -> Path:
        return self.state / f"job{JOB}.failed"

    def env(self, job_user: User | None, **extra: str) -> dict[str, str]:
        env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": str(JOB), "STAGER_PROLOG_CONF": str(self.conf),
               "SHIM_DIR": str(self.shims), "HOME": "/"}
        if job_user is not None:
            env.update(SLURM_JOB_UID=str(job_user.uid), SLURM_JOB_GID=str(job_user.gid))
        env.update(extra)
        return env

    def argv(self, script: str, as_user: User | None) -> list[str]:
        mount = 'mount --bind "$0" /usr/local/sbin && mount --bind "$0" /usr/local/bin && exec "$@"'
        prefix = as_user.setpriv() if as_user is not None else []
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, str(self.shims), *prefix,
                "bash", str(SLURM / script)]

    def run(self, script: str, job_user: User | None, *, as_user: User | None = None,
            **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(script, as_user), env=self.env(job_user, **extra), cwd="/",
                              capture_output=True, text=True, timeout=300, check=False)

    def start(self, script: str, job_user: User | None, **extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(script, None), env=self.env(job_user, **extra), cwd="/",
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def service(node: Node) -> Service:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for the stand-in Slurm commands")
    return Service(node)


def dataset(node: Node, name: str = "ds", n: int = 3) -> Path:
    out = node.data / name
    make_dataset(out, n=n, size=16 << 10, seed=7)
    for p in [out, *out.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return out


def root_only_file(node: Node, name: str, text: str) -> Path:
    d = node.base / "root-only"
    d.mkdir(mode=0o700, exist_ok=True)
    p = d / name
    p.write_text(text)
    p.chmod(0o600)
    return p


def as_attacker(script: str, *args: str | os.PathLike[str]) -> None:
    r = run_as(ATTACKER, ["sh", "-c", script, "sh", *map(str, args)])
    assert r.returncode == 0, r.stderr


# ---- rows 1 and 2: links planted in job<id>/ that root wrote and read ------------------------------------
def test_root_never_writes_or_reads_through_links_the_job_user_plants(service: Service, node: Node) -> None:
    """Row 1 (critical) and row 2 (high). The job's user owns job<id>/; while their stage runs (held on a
    FIFO manifest of their own dataset) they replace every name root used there with a symlink: the
    captures and failure files to a root-only file (root would overwrite it with text from the dataset
    path: code execution as root via a cron file), the stderr capture to a root-only secret (root would
    copy its last line into the failure record, the AdminComment and the job's output)."""
    target = root_only_file(node, "cron-job", "ORIGINAL\n")
    secret = root_only_file(node, "shadow", "root:$6$SECRET-HASH:19000::::::\n")
    src = node.home(ATTACKER) / "ds"
    src.mkdir(mode=0o755)
    os.mkfifo(src / "manifest.json", 0o644)
    os.chown(src, ATTACKER.uid, ATTACKER.gid)
    os.chown(src / "manifest.json", ATTACKER.uid, ATTACKER.gid)
    service.comment(f"stager:{src}")
    prolog = service.start("stager-prolog", ATTACKER)
    try:
        wait_for(lambda: prolog.poll() is not None or processes_with(f"STAGER_DEST={service.job_dir}"),
                 "the prolog's stage started (or the prolog ended)")
        if service.job_dir.is_dir():
            as_attacker('cd "$1" && for n in .stage-1.json .stager-failed.tmp .stager-failed .stager-pid; do '
                        'rm -f "$n"; ln -s "$2" "$n"; done; rm -f .stage-1.err; ln -s "$3" .stage-1.err',
                        service.job_dir, target, secret)
        wait_for(lambda: prolog.poll() is not None or feed(src / "manifest.json", b"{not json"),
                 "a stage held on the FIFO was let go on (or the prolog ended)")
        out, err = prolog.communicate(timeout=300)
    finally:
        if prolog.poll() is None:
            prolog.kill()
    assert prolog.returncode == 0, err  # a failed stage never fails the prolog (that would drain the node)
    assert target.read_text() == "ORIGINAL\n" and os.stat(target).st_uid == 0, "root wrote through the link"
    seen = [out, err, service.admin_comment, *(p.read_text() for p in service.state.rglob("*") if p.is_file())]
    assert not any("SECRET" in s for s in seen), "root read a root-only file through the link"
    record = service.failure_record
    st = os.lstat(record)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o644
    assert record.read_text().startswith("stager-prolog exit 2: ") and "is a FIFO" in record.read_text()


# ---- row 3: the default root pre-created by a user ----------------------------------------------------------
def test_a_root_directory_planted_by_a_user_is_refused(service: Service, node: Node) -> None:
    """Row 3 (critical): a user creates the (default, /tmp-like) root first, with job<id> a symlink to
    a root-owned directory; root would chown that directory to the job's user."""
    precious = node.base / "root-dir"
    precious.mkdir(mode=0o700)
    (precious / "keys").write_text("root's\n")
    as_attacker('mkdir -m 0777 "$1" && chmod 0777 "$1" && ln -s "$2" "$1/job4242"', service.root, precious)
    service.comment(f"stager:{dataset(node)}")
    r = service.run("stager-prolog", ATTACKER)
    assert r.returncode == 0, r.stderr
    st = os.stat(precious)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700), "root gave its directory to the user"
    line = service.failure_record.read_text()
    assert line.startswith("stager-prolog exit 1: ") and "STAGER_PROLOG_ROOT" in line
    assert f"owned by uid {ATTACKER.uid}" in line and "mode 777" in line, line
    assert not any(precious.iterdir()) or [p.name for p in precious.iterdir()] == ["keys"]


def test_job_directory_is_created_exclusively_for_the_user(service: Service, node: Node) -> None:
    """The happy path under the rules: root makes the root (0755, root's) and job<id> (0700, the user's);
    the copy is the user's; the task prolog (as the user) exports STAGER_DEST; the epilog removes all."""
    src = dataset(node)
    service.comment(f"stager:{src}")
    r = service.run("stager-prolog", VICTIM)
    assert r.returncode == 0 and not service.failure_record.exists(), (r.stderr, service.admin_comment)
    st = os.lstat(service.root)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    st = os.lstat(service.job_dir)
    assert stat.S_ISDIR(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (VICTIM.uid, 0o700)
    copies = list(service.job_dir.glob("stager-*/*"))
    assert copies and all(os.lstat(p).st_uid == VICTIM.uid for p in copies)
    assert not [p for p in service.job_dir.iterdir() if p.name.startswith(".stage")], "root's files in the user's dir"
    t = service.run("stager-taskprolog", VICTIM, as_user=VICTIM)
    assert t.returncode == 0 and t.stdout.splitlines()[0] == f"export STAGER_DEST={service.job_dir}", t
    e = service.run("stager-epilog", VICTIM)
    assert e.returncode == 0 and not service.job_dir.exists() and not (service.state / f"job{JOB}").exists()


def test_task_prolog_trusts_only_the_users_own_job_directory(service: Service, node: Node) -> None:
    """Another user's job<id> (a root they made) is never exported as STAGER_DEST, and a failure line
    they forge there never ends the job."""
    as_attacker('mkdir -m 0755 "$1" "$1/job4242" && '
                'printf "stager-prolog exit 3: forged\\n" > "$1/job4242/.stager-failed"', service.root)
    t = service.run("stager-taskprolog", VICTIM, as_user=VICTIM)
    assert t.returncode == 0 and "STAGER_DEST" not in t.stdout and "forged" not in t.stdout, t


# ---- row 4: the epilog's kill ------------------------------------------------------------------------------
def test_epilog_never_kills_from_a_pid_file_the_user_wrote(service: Service, node: Node) -> None:
    """Row 4 (medium): the job's user writes another user's pid (a running `stager stage`) into the pid
    file the epilog read; root would kill the other user's stage."""
    victim = popen_as(VICTIM, [*python_argv(), "-c", "import time; time.sleep(600)", "stager stage"])
    try:
        service.root.mkdir(mode=0o755)
        service.job_dir.mkdir(mode=0o700)
        os.chown(service.job_dir, ATTACKER.uid, ATTACKER.gid)
        as_attacker('echo "$2" > "$1/.stager-pid"', service.job_dir, victim.pid)
        r = service.run("stager-epilog", ATTACKER)
        assert r.returncode == 0, r.stderr
        assert victim.poll() is None, "the epilog killed another user's process"
        assert not service.job_dir.exists()
    finally:
        victim.kill()
        victim.wait()


def test_epilog_ends_the_jobs_marked_stage_and_nothing_else(service: Service, node: Node) -> None:
    """What the epilog kills instead: processes of the job's uid marked with this job's id (the prolog's
    stage and what it started); the same user's other processes, and another job's, live on."""
    sleep = [*python_argv(), "-c", "import time; time.sleep(600)"]
    marked = popen_as(VICTIM, ["env", f"STAGER_PROLOG_JOB={JOB}", *sleep])
    other_job = popen_as(VICTIM, ["env", f"STAGER_PROLOG_JOB={JOB + 1}", *sleep])
    unmarked = popen_as(VICTIM, sleep)
    forged = popen_as(ATTACKER, ["env", f"STAGER_PROLOG_JOB={JOB}", *sleep])  # another uid cannot opt in
    procs = [marked, other_job, unmarked, forged]
    try:
        wait_for(lambda: len(processes_with(f"STAGER_PROLOG_JOB={JOB}")) == 2, "the marked processes started")
        r = service.run("stager-epilog", VICTIM)
        assert r.returncode == 0, r.stderr
        assert marked.wait(timeout=60) == -signal.SIGKILL
        assert other_job.poll() is None and unmarked.poll() is None and forged.poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ---- row 12: no SLURM_JOB_UID ---------------------------------------------------------------------------
def test_a_missing_job_uid_is_a_refusal_not_root(service: Service, node: Node) -> None:
    """Row 12 (low): without SLURM_JOB_UID the prolog staged as root."""
    service.comment(f"stager:{dataset(node)}")
    r = service.run("stager-prolog", None)
    assert r.returncode == 0, r.stderr
    assert not list(service.root.glob("job*/stager-*")), "staged without knowing whose job it is"
    line = service.failure_record.read_text()
    assert line.startswith("stager-prolog exit 2: ") and "SLURM_JOB_UID is not set" in line, line
    assert "SLURM_JOB_UID is not set" in service.admin_comment
    t = service.run("stager-taskprolog", VICTIM, as_user=VICTIM)
    assert t.returncode == 2 and "print stager-prolog exit 2" in t.stdout, t


# ---- what a review adds -----------------------------------------------------------------------------------
def test_a_job_directory_someone_else_made_is_refused(service: Service, node: Node) -> None:
    """A job<id> left in the root that is not the job user's (here: another user's, made while the root
    was open) is never staged into or chowned."""
    service.root.mkdir(mode=0o755)
    service.job_dir.mkdir(mode=0o755)
    os.chown(service.job_dir, ATTACKER.uid, ATTACKER.gid)
    service.comment(f"stager:{dataset(node)}")
    r = service.run("stager-prolog", VICTIM)
    assert r.returncode == 0, r.stderr
    assert os.stat(service.job_dir).st_uid == ATTACKER.uid and not list(service.job_dir.iterdir())
    line = service.failure_record.read_text()
    assert line.startswith("stager-prolog exit 2: ") and f"owned by uid {ATTACKER.uid}" in line, line


def test_a_state_directory_others_can_change_is_refused(service: Service, node: Node) -> None:
    """Root's own directory must be root's: a state directory another user made (or can write) stops
    the prolog before it writes anything, reported in the AdminComment (and the job is not staged)."""
    service.state.mkdir(mode=0o777)
    service.state.chmod(0o777)
    service.comment(f"stager:{dataset(node)}")
    r = service.run("stager-prolog", VICTIM)
    assert r.returncode == 0, r.stderr
    assert "STAGER_PROLOG_STATE" in service.admin_comment and "mode 777" in service.admin_comment
    assert not service.root.exists() and not list(service.state.iterdir())


def test_a_user_cannot_plant_in_the_root(service: Service, node: Node) -> None:
    """The check-then-use of job<id> holds because nobody but root can create names in the root: a
    user's attempt (the race a review would try, between mkdir and chown) fails."""
    service.comment(f"stager:{dataset(node)}")
    assert service.run("stager-prolog", VICTIM).returncode == 0
    r = run_as(ATTACKER, ["ln", "-s", "/", str(service.root / f"job{JOB + 1}")])
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = run_as(ATTACKER, ["mv", str(service.job_dir), str(service.root / "moved")])
    assert r.returncode != 0

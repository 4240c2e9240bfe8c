"""The second trust round (issue 39) attacked from outside: a helper's security review of the site
cache, its service account's fill, the leases users write, and the copies' groups. Every attack runs
for real as unprivileged numeric uids (tests/asuser.py) against the real CLI, loader and tools/slurm
scripts; each test failed on the code before its fix (docs/security.md names them).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from tests.asuser import ATTACKER, OTHER, VICTIM, Node, User, python_as, stager_as
from tests.test_cache_users import LICENSED_GID, LOADER, MEMBER, _chmod_tree, public, site  # noqa: F401 (fixtures)
from tests.test_stage_support import make_dataset
from tests.test_trust_prolog import service  # noqa: F401 (the fixture)

SERVICE_AS_MEMBER = User("service", OTHER.uid, MEMBER.gid, MEMBER.groups)  # the prolog's fill for a member


def _json(r) -> dict:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fill(node: Node, conf_env: dict[str, str], src: Path, cache: Path, user: User = OTHER) -> dict:
    return _json(stager_as(user, "stage", str(src), "--cache", str(cache), "--cache-only", "--json",
                           env=node.env(OTHER, **conf_env)))


# ---- a newcomer's site configuration --------------------------------------------------------------------
def test_a_site_quota_this_node_cannot_hold_fails_no_users_stage_or_loader(
        node: Node, site, public: Path) -> None:  # noqa: F811
    """One prolog.conf serves a cluster's nodes, whose disks differ, and every stage and loader on a
    node reads it. A STAGER_CACHE_QUOTA that did not parse (``60 %%``) made every user's `stage
    --cache` (of their own cache too) exit 2 and every loader die with a traceback; one larger than
    this node's disk (``1000P``) made every user's stage through the site cache, and so every job of
    the prolog service, fail with "give at most the disk's size", an error of the site's that no user
    can fix. Now both are a warning naming the file, the default quota applies, and a reader of a
    site cache (who never evicts) never resolves its owner's quota at all."""
    cache, conf_env = site
    _fill(node, conf_env, public, cache)
    conf = Path(conf_env["STAGER_PROLOG_CONF"])
    base = conf.read_text()
    home = node.home(VICTIM)
    env = node.env(VICTIM, **conf_env)
    for i, bad in enumerate(("60 %%", "1000P")):
        conf.write_text(base + f"STAGER_CACHE_QUOTA={bad}\n")
        res = _json(stager_as(VICTIM, "stage", public, home / f"site{i}", "--cache", cache, "--json", env=env))
        assert res["cache"]["files_hit"] > 0 and res["bytes_copied"] == 0, res["cache"]
        own = _json(stager_as(VICTIM, "stage", public, home / f"own{i}", "--cache", home / f"c{i}", "--json", env=env))
        assert own["cache"]["files_filled"] > 0, own
        assert any("STAGER_CACHE_QUOTA" in w and str(conf) in w for w in own["warnings"]), own["warnings"]
        out = _json(python_as(VICTIM, LOADER, str(public), env=env))
        assert out["staged_mode"] == "cache", out
        # The service account's fill goes on with the default quota (and says why).
        fill = _fill(node, conf_env, public, cache)
        assert any("STAGER_CACHE_QUOTA" in w for w in fill["warnings"]), fill["warnings"]


# ---- what a dataset record tells ------------------------------------------------------------------------
def test_a_manifest_the_fill_refuses_leaves_no_record_others_can_read(node: Node, site) -> None:  # noqa: F811
    """A licensed, group-only dataset whose ``manifest.json`` is a symbolic link (to the current
    version's file, as many trees keep it): the fill refuses the link, so it caches nothing, as it
    should; but it still wrote the dataset's record with no access to give it, 0644, so every user
    of the node read the licensed dataset's path, id and files in `stager cache ls`. Now a site
    cache's record is written only with the access of a manifest the job's user may read."""
    from stager.manifest import load_manifest

    cache, conf_env = site
    src = node.data / "licensed"
    make_dataset(src, n=3, size=16 << 10, seed=11)
    (src / "manifest.json").rename(src / "manifest.v2.json")
    (src / "manifest.json").symlink_to("manifest.v2.json")
    _chmod_tree(src, 0o750, 0o640, gid=LICENSED_GID)
    fill = _fill(node, conf_env, src, cache, user=SERVICE_AS_MEMBER)
    assert fill["cache"]["files_filled"] == 0 and any("symbolic link" in w for w in fill["warnings"]), fill
    for p in (cache / "datasets").iterdir():
        assert not stat.S_IMODE(p.stat().st_mode) & 0o004, f"{p} is world-readable"
    ls = stager_as(ATTACKER, "cache", "ls", cache, "--json", env=node.env(ATTACKER, **conf_env))
    text = ls.stdout + ls.stderr
    assert ls.returncode == 0 and str(src) not in text and load_manifest(src).dataset_id not in text, text
    # The member's own stage is unaffected: it copies as the user (the plain copy), and verifies.
    home = node.home(VICTIM)
    res = _json(stager_as(MEMBER, "stage", src, home / "d", "--cache", cache, "--json",
                          env=node.env(VICTIM, **conf_env)))
    assert res["files_copied"] > 0


# ---- groups: a setgid directory -----------------------------------------------------------------------
PROJECT_GID = 64300  # a project's group: the victim is a member, the attacker too


def test_a_setgid_directory_never_gives_its_group_a_copy(node: Node) -> None:
    """The victim's directory in a project tree is setgid with the project's group (``2750``, the
    way sites make project trees share). A dataset that grants read only to the victim's own group
    was staged there (plainly, and through the victim's own cache) as ``<victim>:<project> 0640``:
    every member of the project read it, and could list DEST. Copies took the directory's group
    because stager compared the source's group with its own process's, not with the group the file
    got. Now every copy, DEST itself, the receipt and a cache's objects have the source's group."""
    src = node.data / "ds"
    make_dataset(src, n=3, size=16 << 10, seed=4)
    _chmod_tree(src, 0o750, 0o640, gid=VICTIM.gid)  # the victim's group only
    proj = node.base / "proj"
    proj.mkdir()
    os.chown(proj, VICTIM.uid, PROJECT_GID)
    proj.chmod(0o2750)
    victim = User("victim", VICTIM.uid, VICTIM.gid, (PROJECT_GID,))
    member = User("colleague", ATTACKER.uid, ATTACKER.gid, (PROJECT_GID,))
    env = node.env(VICTIM)
    _json(stager_as(victim, "stage", src, proj / "plain", "--json", env=env))
    _json(stager_as(victim, "stage", src, proj / "cached", "--cache", proj / "cache", "--json", env=env))
    _json(stager_as(victim, "stage", src, proj / "again", "--cache", proj / "cache", "--json", env=env))
    from stager.pack import pack
    from tools.datagen import make_imagefolder

    packed = node.data / "packed"
    pack(make_imagefolder(node.base / "img", num_classes=2, per_class=3, seed=2, size=(32, 24)), packed, format="tar",
         samples_per_shard=3)
    _chmod_tree(packed, 0o750, 0o640, gid=VICTIM.gid)
    _json(stager_as(victim, "stage", packed, proj / "unpacked", "--unpack", "--json", env=env))
    assert len([p for p in (proj / "unpacked").rglob("*") if p.is_file()]) > 6  # the samples too
    wrong = [(str(p), p.lstat().st_gid, oct(stat.S_IMODE(p.lstat().st_mode)))
             for d in ("plain", "cached", "again", "cache", "unpacked") for p in [proj / d, *(proj / d).rglob("*")]
             if p.lstat().st_gid != VICTIM.gid and p.lstat().st_mode & 0o070]
    assert not wrong, f"given the project's group: {wrong[:6]}"
    # What the colleague (a project member, not in the victim's group) can read of it: nothing.
    r = python_as(member, "import os, sys; print(sum(1 for _ in os.scandir(sys.argv[1])))", str(proj / "plain"),
                  env=node.env(ATTACKER))
    assert r.returncode != 0 and "Permission denied" in r.stderr, r.stdout


# ---- leases/: what one user may make the service account read ----------------------------------------------
BIG_LEASES = r"""
import json, os, sys, time
leases, mine, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
st = os.stat(mine)
keys = [f"{i:032x}-{i:016x}" for i in range((15 << 20) // 52)]        # well-formed keys: each one is kept
body = json.dumps({"schema": "stager.cache.lease/1", "kind": "dest", "keys": keys, "time": time.time(),
                   "expires": time.time() + 3600, "dest": [[mine, st.st_dev, st.st_ino]], "uid": os.getuid()})
for i in range(n):
    with open(os.path.join(leases, f"big{i}.lease"), "w") as f:
        f.write(body)
    os.chmod(os.path.join(leases, f"big{i}.lease"), 0o644)
"""

PEAK = r"""
import json, resource, runpy, sys
sys.argv = ["stager", *sys.argv[1:]]
try:
    runpy.run_module("stager", run_name="__main__")
except SystemExit:
    pass
print(json.dumps({"maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def test_one_users_leases_cannot_exhaust_the_service_account(node: Node, site, public: Path) -> None:  # noqa: F811
    """``leases/`` is world-writable and every entry of it was read whole by every fill over quota and
    every `cache gc` (several times: once per batch of evictions), each lease up to 16 MiB of
    well-formed object keys, every key kept: 30 such leases of one user (450 MiB of disk) took the
    service account's gc to about 1.3 GB of memory, and a few hundred would kill every fill on the
    node. Now the entries of each user other than the cache's owner are read up to a budget (1024
    entries, 64 MiB together); the rest are not opened and are reported as one line of junk."""
    cache, conf_env = site
    _fill(node, conf_env, public, cache)
    mine = node.home(ATTACKER) / "job"
    r = python_as(ATTACKER, f"import os; os.mkdir({str(mine)!r})", env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    r = python_as(ATTACKER, BIG_LEASES, str(cache / "leases"), str(mine), "30", env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    out = python_as(OTHER, PEAK, "cache", "gc", str(cache), "--max-bytes", "0", "--json",
                    env=node.env(OTHER, **conf_env))
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) >= 2, out.stderr
    peak = json.loads(lines[-1])["maxrss_mib"]
    rep = json.loads(lines[-2])
    assert peak < 1000, f"the service account's gc took {peak:.0f} MiB reading one user's leases"
    assert rep["evicted"] and rep["junk"].count("\n") == 0 and "64 MiB" in rep["junk"], rep["junk"]
    assert rep["junk_leases"] >= 26, rep


# ---- bytes that are not UTF-8 ----------------------------------------------------------------------------
RAW_NAME = r"""
import os, sys
with open(os.path.join(os.fsencode(sys.argv[1]), b"\x9b2J\x9b31m\xff.lease"), "w") as f:
    f.write("{}")
"""


def _no_controls(data: bytes) -> None:
    """``data`` is UTF-8 without a control character (newlines and tabs aside) or an undecodable byte."""
    text = data.decode("utf-8")  # strict: a lone 0x9b (an 8-bit CSI) is not UTF-8
    bad = [c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F]
    assert not bad, repr(text)


def test_a_name_that_is_not_utf8_reaches_no_terminal_raw(node: Node, site, public: Path) -> None:  # noqa: F811
    """A lease named with raw bytes that are not UTF-8 (``\\x9b2J``: an 8-bit CSI that clears the screen
    of a terminal honouring C1 controls) was printed raw by the admin's `stager cache ls` and `cache gc`:
    names from ``os.listdir`` carry such bytes as lone surrogates, which ``printable`` let through and
    stdout wrote back as the bytes. Now they are escaped (``\\x9b``) like every control character."""
    import subprocess

    from tests.asuser import python_argv

    cache, conf_env = site
    _fill(node, conf_env, public, cache)
    r = python_as(ATTACKER, RAW_NAME, str(cache / "leases"), env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    for args in (("ls",), ("ls", "--json"), ("gc", "--dry-run"), ("gc", "--dry-run", "--json")):
        out = subprocess.run([*OTHER.setpriv(), *python_argv(), "-m", "stager", "cache", args[0], str(cache),
                              *args[1:]], capture_output=True, env=node.env(OTHER, **conf_env), cwd="/", check=False)
        assert out.returncode == 0, out.stderr
        _no_controls(out.stdout + out.stderr)
        assert b"\\x9b2J" in out.stdout, (args, out.stdout)


def test_a_comment_that_is_not_utf8_reaches_no_record_raw(service) -> None:  # noqa: F811
    """The job's comment carries raw bytes that are not UTF-8 (``stager:ds\\x9b2J``): the prolog's
    refusal put them, raw, into root's world-readable failure record, the AdminComment (read by
    admins' ``scontrol show job``) and the job's output. ``stager_redact`` replaced the C0 controls
    and UTF-8-encoded C1 controls only; bytes that are not UTF-8 now become ``?`` too."""
    import subprocess

    from tests.test_trust_prolog import VICTIM as JOB_USER

    (service.shims / "comment").write_bytes(b"stager:ds\x9b2J\xff/x\n")
    r = subprocess.run(service.argv("stager-prolog", None), env=service.env(JOB_USER), cwd="/", capture_output=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    record = service.failure_record.read_bytes()
    assert record.startswith(b"stager-prolog exit 2: ") and b"not an absolute path" in record, record
    admin = (service.shims / "admin").read_bytes()
    t = subprocess.run(service.argv("stager-taskprolog", JOB_USER), env=service.env(JOB_USER), cwd="/",
                       capture_output=True, timeout=300, check=False)
    for data in (record, admin, r.stderr, t.stdout):
        _no_controls(data)


# ---- the job's user against root's prolog ------------------------------------------------------------------
def test_the_job_cannot_keep_the_prolog_past_its_deadline(service, node: Node) -> None:  # noqa: F811
    """How long the prolog runs is the job's user's to decide (how big and how many datasets, a slow
    file system of theirs, the same dataset named a thousand times in the comment), and Slurm kills a
    prolog at PrologEpilogTimeout and *drains the node*: one user's job took a node from everyone.
    Now each dataset is staged once however often the comment names it, and past
    STAGER_PROLOG_TIMEOUT the prolog stops the stage and fails the job (exit 5) instead. The stage
    here is held at one byte a second (the copier's test throttle), so only the deadline ends it."""
    import subprocess

    from tests.test_trust_prolog import JOB, dataset, processes_with
    from tests.test_trust_prolog import VICTIM as JOB_USER

    src = dataset(node)
    service.comment("stager:" + ",".join([str(src)] * 5))
    r = service.run("stager-prolog", JOB_USER)
    assert r.returncode == 0 and not service.failure_record.exists(), (r.stderr, service.admin_comment)
    assert len(list((service.state / f"job{JOB}").glob("stage-*.json"))) == 1  # staged once
    assert service.run("stager-epilog", JOB_USER).returncode == 0
    service.conf.write_text(service.conf.read_text() + "STAGER_PROLOG_TIMEOUT=3\n")
    try:
        r = subprocess.run(service.argv("stager-prolog", None),
                           env=service.env(JOB_USER, STAGER_TEST_THROTTLE_BPS="1"), cwd="/", capture_output=True,
                           text=True, timeout=120, check=False)
        record = service.failure_record.read_text() if service.failure_record.exists() else ""
        left = processes_with(f"STAGER_PROLOG_JOB={JOB}")  # the prolog ended its stage itself
    except subprocess.TimeoutExpired:
        raise AssertionError("the prolog staged past its deadline (Slurm would have drained the node)") from None
    finally:
        service.run("stager-epilog", JOB_USER)  # ends a stage left running
    assert r.returncode == 0, r.stderr
    assert record.startswith("stager-prolog exit 5: ") and "STAGER_PROLOG_TIMEOUT" in record, (record, r.stderr)
    assert not left, left


def test_a_licensed_datasets_path_is_not_told_to_every_user_by_its_leases(node: Node, site) -> None:  # noqa: F811
    """A licensed dataset's record is its group's only, so that the node's other users do not learn
    which licensed data it caches; but ``leases/`` is every user's to read, and the fill's (and each
    stage's) lease said ``stage --cache-only /proj/licensed/...``: a non-member's `cache ls` named the
    licensed dataset while a member's job used it. Now a site cache's leases say what they are for
    without a location. (The fill is held at one byte a second, the copier's test throttle, so its
    lease is there to be read: the test waits for the file, never for a time.)"""
    from tests.asuser import popen_as, python_argv
    from tests.test_trust_prolog import wait_for

    cache, conf_env = site
    src = node.data / "licensed-imagenet"
    make_dataset(src, n=3, size=16 << 10, seed=11)
    _chmod_tree(src, 0o750, 0o640, gid=LICENSED_GID)
    fill = popen_as(SERVICE_AS_MEMBER, [*python_argv(), "-m", "stager", "stage", str(src), "--cache", str(cache),
                                        "--cache-only", "--json"],
                    env=node.env(OTHER, STAGER_TEST_THROTTLE_BPS="1", **conf_env))
    try:
        # Copying (a partial object is there): its lease was written and rewritten with its reservation.
        wait_for(lambda: any(p.name.endswith(".partial") for p in (cache / "objects").rglob("*")), "the fill's copy")
        ls = stager_as(ATTACKER, "cache", "ls", cache, "--json", env=node.env(ATTACKER, **conf_env))
        raw = python_as(ATTACKER, "import os, sys; d = sys.argv[1]; print([open(os.path.join(d, n)).read() "
                        "for n in os.listdir(d)])", str(cache / "leases"), env=node.env(ATTACKER))
    finally:
        fill.kill()
        fill.communicate()
    leases = _json(ls)["leases"]
    assert leases and all(le["what"] == "stage --cache-only" for le in leases), leases
    assert raw.returncode == 0 and "licensed-imagenet" not in raw.stdout + ls.stdout, raw.stdout


def test_a_destination_too_deep_leaves_no_trail_of_directories(node: Node, public: Path) -> None:  # noqa: F811
    """A newcomer's mistyped DEST (a path past PATH_MAX: a loop in a script appending a directory) was
    refused in one line, but only after making some 400 directories one at a time, left behind. Now
    the directories a refused DEST made are removed again: nothing half-made."""
    home = node.home(VICTIM)
    deep = home / "x" / ("abcdefghi/" * 500 + "d")
    r = stager_as(VICTIM, "stage", public, deep, env=node.env(VICTIM))
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (home / "x").exists(), "directories of the refused destination were left"

"""The shard cache on a node shared by users, run for real as unprivileged uids (tests/asuser.py).

* A user's own cache needs no admin: created 0700, theirs, used by their stages and loader.
* Nobody uses another user's cache, and no user's cache is trusted by root; a cache someone else
  planted in a shared ``/tmp`` is refused in one line.
* A site cache is written only by the service account the site configuration names (its fill runs
  with the job user's groups); users link from it, read it, and cannot put bytes into it; their
  loaders read the objects their own manifest names, with ``staged_mode: "cache"``.
* A licensed, group-only dataset keeps its group and mode in the site cache: members read it, others
  cannot.
* Junk in the one directory users may write (``leases/``) protects nothing and is cleared by eviction;
  a lease naming someone else's directory keeps nothing.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from stager.pack import pack
from tests.asuser import ATTACKER, OTHER, VICTIM, Node, User, python_as, stager_as
from tests.test_stage_support import make_dataset

LICENSED_GID = 64200
MEMBER = User("member", VICTIM.uid, VICTIM.gid, (LICENSED_GID,))

LOADER = """
import json, sys
from stager.loader.numpy_loader import make_numpy_loader
ld = make_numpy_loader(sys.argv[1], 4, decode="raw", staging_roots=tuple(sys.argv[2:]))
keys = sorted(k for b in ld for k in b["key"])
st = ld.stats()
print(json.dumps({"keys": keys, "staged": st["staged"], "staged_mode": st["staged_mode"],
                  "reading_from": st["reading_from"]}))
"""


def _json(r) -> dict:
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _one_line_refusal(r, *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def public(node: Node) -> Path:
    """A dataset every user may read (root's, 0755/0644)."""
    src = node.data / "public"
    make_dataset(src, n=4, size=32 << 10)
    return src


@pytest.fixture
def site(node: Node) -> tuple[Path, dict[str, str]]:
    """A site cache owned by the service account OTHER, named by a root-owned site configuration."""
    conf = node.bin / "prolog.conf"
    cache = node.base / "site-cache"
    conf.write_text(f"STAGER_CACHE_DIR={cache}\nSTAGER_CACHE_USER={OTHER.uid}\n")
    conf.chmod(0o644)
    cache.mkdir(mode=0o755)  # the admin's one step: an empty directory for the service account
    os.chown(cache, OTHER.uid, OTHER.gid)
    r = stager_as(OTHER, "cache", "init", str(cache), "--site", env=node.env(OTHER, STAGER_PROLOG_CONF=str(conf)))
    assert r.returncode == 0, r.stderr
    return cache, {"STAGER_PROLOG_CONF": str(conf)}


def test_a_users_own_cache_needs_no_admin(node: Node, public: Path) -> None:
    home = node.home(VICTIM)
    cache = home / "cache"
    env = node.env(VICTIM)
    first = _json(stager_as(VICTIM, "stage", str(public), str(home / "d1"), "--cache", str(cache), "--json", env=env))
    second = _json(stager_as(VICTIM, "stage", str(public), str(home / "d2"), "--cache", str(cache), "--json",
                             env=env))
    st = cache.stat()
    assert st.st_uid == VICTIM.uid and stat.S_IMODE(st.st_mode) == 0o700
    assert first["cache"]["files_filled"] > 0 and second["bytes_copied"] == 0 and second["cache"]["links"] == "hard"
    assert stager_as(VICTIM, "verify", str(home / "d2"), "-q", env=env).returncode == 0
    # Another user can neither read it nor use it; root does not use a user's cache either.
    _one_line_refusal(stager_as(ATTACKER, "cache", "ls", str(cache), env=node.env(ATTACKER)), str(cache))
    r = stager_as(ATTACKER, "stage", str(public), str(node.home(ATTACKER) / "d"), "--cache", str(cache),
                  env=node.env(ATTACKER))
    _one_line_refusal(r, "uid 64101")
    r = stager_as(None, "stage", str(public), str(node.base / "rootdest"), "--cache", str(cache), env=node.env(VICTIM))
    _one_line_refusal(r, "uid 64101")


def test_a_cache_planted_in_shared_tmp_is_refused(node: Node, public: Path) -> None:
    planted = node.tmp / "stager-cache"
    r = stager_as(ATTACKER, "cache", "init", str(planted), env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    planted.chmod(0o755)
    r = stager_as(VICTIM, "stage", str(public), str(node.home(VICTIM) / "d"), "--cache", str(planted),
                  env=node.env(VICTIM))
    _one_line_refusal(r, str(planted), "uid 64102")
    open_one = node.tmp / "open-cache"
    r = stager_as(VICTIM, "cache", "init", str(open_one), env=node.env(VICTIM))
    assert r.returncode == 0, r.stderr
    open_one.chmod(0o777)
    r = stager_as(VICTIM, "stage", str(public), str(node.home(VICTIM) / "d"), "--cache", str(open_one),
                  env=node.env(VICTIM))
    _one_line_refusal(r, "writable by others")
    # The victim's loader, pointed at the planted cache, does not use it.
    code = LOADER
    packed = node.data / "packed"
    pack(_tiny(node), packed, format="tar", samples_per_shard=6)
    _chmod_tree(packed)
    out = _json(python_as(VICTIM, code, str(packed), env=node.env(VICTIM, STAGER_CACHE=str(planted))))
    assert not out["staged"]


def _tiny(node: Node) -> Path:
    from tools.datagen import make_imagefolder

    return make_imagefolder(node.base / "images", num_classes=2, per_class=6, seed=3, size=(64, 48))


def _chmod_tree(root: Path, dmode: int = 0o755, fmode: int = 0o644, gid: int | None = None) -> None:
    for p in [root, *root.rglob("*")]:
        if gid is not None:
            os.chown(p, -1, gid)
        p.chmod(dmode if p.is_dir() else fmode)


def test_site_cache_is_written_by_the_service_account_only_and_read_by_users(node: Node, site) -> None:
    cache, conf_env = site
    packed = node.data / "packed"
    pack(_tiny(node), packed, format="tar", samples_per_shard=6)
    _chmod_tree(packed)
    fill = _json(stager_as(OTHER, "stage", str(packed), "--cache", str(cache), "--cache-only", "--json",
                           env=node.env(OTHER, **conf_env)))
    assert fill["cache"]["files_filled"] > 0
    objs = [p for p in (cache / "objects").rglob("*") if p.is_file()]
    assert objs and all(p.stat().st_uid == OTHER.uid and stat.S_IMODE(p.stat().st_mode) == 0o444 for p in objs)
    # The user links from it: nothing copied, symbolic links, the receipt names the site cache.
    jobs = node.home(VICTIM) / "jobs"
    env = node.env(VICTIM, **conf_env)
    res = _json(stager_as(VICTIM, "stage", str(packed), str(jobs / "d"), "--cache", str(cache), "--json", env=env))
    assert res["bytes_copied"] == 0 and res["cache"]["links"] == "symbolic" and res["cache"]["kind"] == "site"
    out = _json(python_as(VICTIM, LOADER, str(packed), str(jobs), env=env))
    from stager.manifest import load_manifest

    assert out["keys"] == sorted(load_manifest(packed).keys) and out["staged_mode"] == "cache"
    # Without a DEST, the site cache of the configuration is found too.
    out = _json(python_as(VICTIM, LOADER, str(packed), env=env))
    assert out["staged_mode"] == "cache" and out["reading_from"] == str(cache)
    # No user can put bytes into it, fill it, or evict from it.
    some = objs[0]
    r = python_as(ATTACKER, "import sys; open(sys.argv[1], 'r+b').write(b'X')", str(some), env=node.env(ATTACKER))
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = python_as(ATTACKER, "import sys, pathlib; pathlib.Path(sys.argv[1], 'evil').write_bytes(b'X')",
                  str(some.parent), env=node.env(ATTACKER))
    assert r.returncode != 0 and "Permission denied" in r.stderr
    r = stager_as(ATTACKER, "stage", str(packed), "--cache", str(cache), "--cache-only",
                  env=node.env(ATTACKER, **conf_env))
    _one_line_refusal(r, "owned by uid 64103")
    r = stager_as(ATTACKER, "cache", "gc", str(cache), "--max-bytes", "0", env=node.env(ATTACKER, **conf_env))
    _one_line_refusal(r, "only the cache's owner")
    # Without the site configuration naming the service account, a user does not trust its cache.
    r = stager_as(VICTIM, "stage", str(packed), str(jobs / "e"), "--cache", str(cache), env=node.env(VICTIM))
    _one_line_refusal(r, "uid 64103")


def test_licensed_dataset_keeps_its_group_and_mode_in_the_site_cache(node: Node, site) -> None:
    cache, conf_env = site
    src = node.data / "licensed"
    make_dataset(src, n=3, size=16 << 10)
    _chmod_tree(src, 0o750, 0o640, gid=LICENSED_GID)
    # The prolog fills as the service account with the job user's groups.
    service = User("service", OTHER.uid, MEMBER.gid, MEMBER.groups)
    fill = _json(stager_as(service, "stage", str(src), "--cache", str(cache), "--cache-only", "--json",
                           env=node.env(OTHER, **conf_env)))
    assert fill["cache"]["files_filled"] == 4
    objs = [p for p in (cache / "objects").rglob("*") if p.is_file()]
    assert all(p.stat().st_gid == LICENSED_GID and stat.S_IMODE(p.stat().st_mode) == 0o440 for p in objs), \
        [(p.stat().st_gid, oct(p.stat().st_mode)) for p in objs]
    # A member links and verifies; a non-member can read neither the source nor the cached copy.
    home = node.home(VICTIM)
    env = node.env(VICTIM, **conf_env)
    res = _json(stager_as(MEMBER, "stage", str(src), str(home / "d"), "--cache", str(cache), "--json", env=env))
    assert res["bytes_copied"] == 0
    assert stager_as(MEMBER, "verify", str(home / "d"), "-q", env=env).returncode == 0
    r = python_as(ATTACKER, "import sys; open(sys.argv[1], 'rb').read()", str(objs[0]), env=node.env(ATTACKER))
    assert r.returncode != 0 and "Permission denied" in r.stderr


def test_junk_in_a_site_caches_leases_protects_nothing(node: Node, site, public: Path) -> None:
    cache, conf_env = site
    fill = _json(stager_as(OTHER, "stage", str(public), "--cache", str(cache), "--cache-only", "--json",
                           env=node.env(OTHER, **conf_env)))
    n = fill["cache"]["files_filled"]
    leases = cache / "leases"
    code = """
import json, os, sys, time
d = sys.argv[1]
os.symlink("/etc/shadow", os.path.join(d, "a.lease"))
os.mkfifo(os.path.join(d, "b.lease"))
keys = [f for _, _, fs in os.walk(sys.argv[2]) for f in fs]
body = {"schema": "stager.cache.lease/1", "kind": "dest", "keys": keys, "time": time.time(),
        "expires": time.time() + 1e9, "dest": [["/", os.stat("/").st_dev, os.stat("/").st_ino]]}
open(os.path.join(d, "c.lease"), "w").write(json.dumps(body))
open(os.path.join(d, "d.lease"), "w").write("{not json")
"""
    r = python_as(ATTACKER, code, str(leases), str(cache / "objects"), env=node.env(ATTACKER))
    assert r.returncode == 0, r.stderr
    rep = _json(stager_as(OTHER, "cache", "gc", str(cache), "--max-bytes", "0", "--json",
                          env=node.env(OTHER, **conf_env)))
    assert len(rep["evicted"]) == n and rep["in_use"]["objects"] == 0 and rep["dead_leases_removed"] == 4
    assert not list(leases.iterdir())
    assert Path("/etc/shadow").exists()

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

SERVICE_AS_MEMBER = User("service", OTHER.uid, MEMBER.gid, MEMBER.groups)  # the prolog's fill for a member


def _json(r) -> dict:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fill(node: Node, conf_env: dict[str, str], src: Path, cache: Path, user: User = OTHER) -> dict:
    return _json(stager_as(user, "stage", str(src), "--cache", str(cache), "--cache-only", "--json",
                           env=node.env(OTHER, **conf_env)))


# ---- a newcomer's site configuration --------------------------------------------------------------------
def test_a_site_quota_this_node_cannot_hold_fails_no_users_stage_or_loader(node: Node, site,
                                                                          public: Path) -> None:  # noqa: F811
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

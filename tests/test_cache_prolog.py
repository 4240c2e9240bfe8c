"""The prolog service with a site-wide shard cache (STAGER_CACHE_DIR / STAGER_CACHE_USER in its
configuration), run for real: the unmodified tools/slurm scripts as root, the job's user and the
cache's service account as unprivileged uids, stand-in squeue/scontrol (tests/test_trust_prolog.py).

Root only makes the cache's directory for the service account; the service account fills the cache
with the job user's groups; the user's stage links from it and copies nothing; the job's loader reads
it with ``staged_mode: "cache"``; the epilog's removal of the job's directory ends the links' lease;
the next job finds everything cached.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from stager.manifest import load_manifest
from tests.asuser import OTHER, Node, python_as, stager_as
from tests.test_trust_prolog import JOB, VICTIM, Service, dataset, service  # noqa: F401 (the fixture)

LOADER = """
import json, sys
from stager.loader.numpy_loader import make_numpy_loader
ld = make_numpy_loader(sys.argv[1], 2, decode="raw")
n = sum(len(b["key"]) for b in ld)
st = ld.stats()
print(json.dumps({"samples": n, "staged_mode": st["staged_mode"], "reading_from": st["reading_from"]}))
"""


def _last_json(p: Path) -> dict:
    return json.loads(p.read_text().strip().splitlines()[-1])


def test_prolog_fills_the_site_cache_as_its_service_account_and_jobs_link_from_it(
        service: Service, node: Node) -> None:  # noqa: F811
    from stager.pack import pack
    from tools.datagen import make_imagefolder

    src = node.data / "packed"
    pack(make_imagefolder(node.base / "img", num_classes=2, per_class=4, seed=2, size=(64, 48)), src, format="tar",
         samples_per_shard=2)
    for p in [src, *src.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    m = load_manifest(src)
    cache = node.base / "site-cache"
    service.conf.write_text(service.conf.read_text() + f"STAGER_CACHE_DIR={cache}\nSTAGER_CACHE_USER={OTHER.uid}\n")
    service.comment(f"stager:{src}")
    r = service.run("stager-prolog", VICTIM)
    assert r.returncode == 0 and not service.failure_record.exists(), r.stderr
    st = cache.stat()
    assert st.st_uid == OTHER.uid and stat.S_IMODE(st.st_mode) == 0o755
    objs = [p for p in (cache / "objects").rglob("*") if p.is_file()]
    assert objs and all(p.stat().st_uid == OTHER.uid and not p.stat().st_mode & 0o222 for p in objs)
    state = service.state / f"job{JOB}"
    fill, staged = _last_json(state / "fill-1.json"), _last_json(state / "stage-1.json")
    files = len(list(m.files()))
    assert fill["cache"]["files_filled"] == files
    assert staged["bytes_copied"] == 0 and staged["cache"]["files_hit"] == files
    assert staged["cache"]["links"] == "symbolic" and staged["cache"]["kind"] == "site"
    dest = Path(staged["dest"])
    assert dest.parent == service.job_dir and all((dest / s.name).is_symlink() for s in m.shards)
    # The task prolog's environment: the job's loader reads the cached copy.
    tp = service.run("stager-taskprolog", VICTIM, as_user=VICTIM)
    exports = dict(ln.removeprefix("export ").split("=", 1) for ln in tp.stdout.splitlines() if ln.startswith("export"))
    assert exports["STAGER_DEST"] == str(service.job_dir) and exports["STAGER_PROLOG_CONF"] == str(service.conf)
    out = python_as(VICTIM, LOADER, str(src), env=node.env(VICTIM, **exports))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["samples"] == m.num_samples and got["staged_mode"] == "cache"
    # While the job's directory exists its links hold the objects; the epilog removes it, and then
    # the service account's eviction may take them.
    gc = ["cache", "gc", str(cache), "--max-bytes", "0", "--json"]
    env = node.env(OTHER, STAGER_PROLOG_CONF=str(service.conf))
    assert json.loads(stager_as(OTHER, *gc, env=env).stdout)["freed_bytes"] == 0
    assert service.run("stager-epilog", VICTIM).returncode == 0 and not service.job_dir.exists()
    # The next job of the chain: everything is cached, nothing copied.
    r = service.run("stager-prolog", VICTIM)
    assert r.returncode == 0 and not service.failure_record.exists(), r.stderr
    fill, staged = _last_json(state / "fill-1.json"), _last_json(state / "stage-1.json")
    assert fill["cache"]["files_filled"] == 0 and fill["cache"]["files_hit"] == files
    assert staged["bytes_copied"] == 0 and staged["cache"]["files_hit"] == files
    assert service.run("stager-epilog", VICTIM).returncode == 0
    rep = json.loads(stager_as(OTHER, *gc, env=env).stdout)
    assert rep["freed_bytes"] == sum(b for _, b, _ in m.files()) and rep["in_use"]["objects"] == 0


def test_prolog_never_fills_a_cache_as_root(service: Service, node: Node) -> None:  # noqa: F811
    src = dataset(node)
    cache = node.base / "site-cache"
    service.conf.write_text(service.conf.read_text() + f"STAGER_CACHE_DIR={cache}\nSTAGER_CACHE_USER=root\n")
    service.comment(f"stager:{src}")
    r = service.run("stager-prolog", VICTIM)
    assert r.returncode == 0 and not service.failure_record.exists(), r.stderr
    assert "site cache not used" in r.stderr and not cache.exists()
    staged = _last_json(service.state / f"job{JOB}" / "stage-1.json")
    assert staged["cache"] is None and staged["files_copied"] > 0

"""``stager cache init|ls|du|gc|pin|unpin|verify DIR``: look after a shard cache (stager/cache/).

Every sub-command but ``init`` refuses a DIR that is not a stager cache or that holds anything but
the cache's own files (it deletes only what it can tell is its own). ``gc``, ``pin`` and ``unpin``
change the cache and are its owner's; ``ls``, ``du`` and ``verify`` also work for readers of a site
cache. DIR defaults to ``$STAGER_CACHE`` (as for ``stager stage --cache``), except for ``pin`` and
``unpin``, whose DATASETs follow it. Exit codes: 0 ok, 2 usage (not a cache, not yours, a bad quota),
3 damaged objects found by ``verify``.
"""

from __future__ import annotations

import argparse

from stager.cli.args import (
    add_cache_dir,
    add_common,
    byte_count,
    cache_dir,
    duration,
    examples,
    prog_of,
    quota,
)
from stager.cli.result import CommandResult, warn
from stager.errors import ExitCode


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache", help="look after a node-local shard cache (ls, du, gc, pin, unpin, verify, init)",
        description="A shard cache (stager stage --cache DIR) keeps shards and index files under their verified "
        "hash on the node's local disk, so later stages of the same dataset copy nothing. These commands list it, "
        "measure it, evict from it (least recently used first, never what a live job uses), pin datasets, and "
        "verify every object against its name. DIR defaults to $STAGER_CACHE. Exit codes: 0 ok, 2 usage, "
        "3 damaged objects.",
        epilog=examples("stager cache ls   # the cache $STAGER_CACHE names", "stager cache du /local/cache --json",
                        "stager cache gc --max-bytes 200G --dry-run", "stager cache pin /local/cache /lustre/ds"))
    cmds = p.add_subparsers(dest="cache_command", required=True, metavar="CMD")

    c = cmds.add_parser("init", help="make DIR a cache (empty or new): a user's (0700) or, with --site, a site "
                        "cache written only by its owner (the service account)",
                        epilog=examples("stager cache init /local/cache --quota 200G",
                                        "stager cache init /scratch/site-cache --site --quota 50%"))
    c.add_argument("--site", action="store_true", help="a site-wide cache: readable by all, written only by you")
    c.add_argument("--quota", default=None, metavar="SIZE", type=quota,
                   help="the cache's own quota: bytes (200G) or a fraction of its disk (0.5, 50%%)")
    _dir(c)

    c = cmds.add_parser("ls", help="datasets in the cache: how much of each is there, uses, last use, pins; "
                        "leases; recent evictions", epilog=examples("stager cache ls", "stager cache ls /local/cache"))
    _dir(c)

    c = cmds.add_parser("du", help="bytes: total, quota, disk, in use, hard-linked, per dataset (alone/shared)",
                        epilog=examples("stager cache du --json"))
    _dir(c)

    c = cmds.add_parser("gc", help="evict least recently used objects down to the quota (or --max-bytes), never "
                        "one a live job uses, a destination links or a pinned dataset needs; says what and why",
                        epilog=examples("stager cache gc --dry-run", "stager cache gc /local/cache --max-bytes 100G"))
    c.add_argument("--max-bytes", type=byte_count, default=None, metavar="N",
                   help="evict down to N bytes (200G, 500GB or a plain number) instead of the quota")
    c.add_argument("--dry-run", action="store_true", help="say what would be evicted; change nothing")
    c.add_argument("--timeout", type=duration, default=None, metavar="SECONDS",
                   help="how long to wait for another eviction to finish (600, 10m; default: no limit)")
    _dir(c)

    for name, what in (("pin", "never evict"), ("unpin", "evict again when least recently used")):
        c = cmds.add_parser(name, help=f"{what} a dataset's files (by id from `ls`, or by its source path)",
                            epilog=examples(f"stager cache {name} /local/cache /lustre/$USER/imagenet-train",
                                            f"stager cache {name} /local/cache 3f2a9c   # an id (prefix) from ls"))
        c.add_argument("dir", metavar="DIR", help="the cache directory (given here: the datasets follow it)")
        add_common(c)
        c.add_argument("datasets", metavar="DATASET", nargs="+", help="a dataset id (or digest prefix) or its SRC")

    c = cmds.add_parser("verify", help="hash every object again and compare with its name; the owner's run "
                        "removes damaged objects (the next stage copies them again)",
                        epilog=examples("stager cache verify --no-repair"))
    c.add_argument("--no-repair", action="store_true", help="report only, remove nothing")
    _dir(c)
    p.set_defaults(func=run)


def _dir(c: argparse.ArgumentParser) -> None:
    add_cache_dir(c)
    add_common(c)


def run(args: argparse.Namespace) -> CommandResult:
    from stager.cache.config import Quota
    from stager.cache.store import Cache, set_marker_quota

    cmd = args.cache_command
    where = cache_dir(args)
    prog = prog_of(args)
    if cmd == "init":
        quota = Quota.parse(args.quota, "--quota") if args.quota else None
        cache = Cache.open(where, create=True, kind="site" if args.site else "user", quota=quota)
        if quota is not None:
            set_marker_quota(cache, quota)
        _warn(prog, cache.warnings)
        return CommandResult(cache.to_json(), f"{cache.root}: {cache.kind} cache of uid {cache.owner}, quota "
                             f"{cache.quota.text} ({(cache.quota_bytes or 0) / 1e9:.2f} GB)")
    cache = Cache.open(where, read_only=cmd in ("ls", "verify"))
    _warn(prog, cache.warnings)
    if cmd in ("gc", "pin", "unpin") and not cache.writable:
        from stager.errors import UsageError

        raise UsageError(f"{cache.root}: only the cache's owner (uid {cache.owner}) may {cmd}; ask them (or the "
                         "site's administrators)")
    cache.require_own_files()
    if cmd == "ls":
        from stager.cache.report import human_listing, listing

        result = listing(cache)
        return CommandResult(result, human_listing(result))
    if cmd == "du":
        from stager.cache.report import human_usage, usage

        result = usage(cache)
        return CommandResult(result, human_usage(result))
    if cmd == "gc":
        from stager.cache.evict import collect

        return CommandResult.of(collect(cache, target_bytes=args.max_bytes, dry_run=args.dry_run,
                                        timeout=args.timeout))
    if cmd in ("pin", "unpin"):
        from stager.cache.report import set_pinned

        result = set_pinned(cache, args.datasets, cmd == "pin")
        return CommandResult(result, "\n".join(
            f"{d['dataset_id']}: {'pinned' if d['pinned'] else 'unpinned'} ({d['files']} files, "
            f"{d['bytes'] / 1e9:.3f} GB) {d['source']}" for d in result["datasets"]))
    from stager.cache.objectcheck import verify_cache

    rep = verify_cache(cache, quiet=args.quiet, repair=not args.no_repair)
    if rep.ok:
        return CommandResult.of(rep)
    return CommandResult(rep.to_json(), f"{rep.summary()}\nerror: {len(rep.damaged)} of {rep.objects} objects are "
                         "damaged", exit_code=ExitCode.DAMAGED)


def _warn(prog: str, warnings: list[str]) -> None:
    for w in warnings:
        warn(prog, w)

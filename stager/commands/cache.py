"""``stager cache init|ls|du|gc|pin|unpin|verify DIR``: look after a shard cache (stager/cache/).

Every sub-command but ``init`` refuses a DIR that is not a stager cache or that holds anything but
the cache's own files (it deletes only what it can tell is its own). ``gc``, ``pin`` and ``unpin``
change the cache and are its owner's; ``ls``, ``du`` and ``verify`` also work for readers of a site
cache. Exit codes: 0 ok, 1 error, 2 usage (not a cache, not yours, a bad quota), 3 damaged objects
found by ``verify``.
"""

from __future__ import annotations

import argparse
from typing import Any

from stager.cli import add_common, emit, warn


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache", help="look after a node-local shard cache (ls, du, gc, pin, unpin, verify, init)",
        description="A shard cache (stager stage --cache DIR) keeps shards and index files under their verified "
        "hash on the node's local disk, so later stages of the same dataset copy nothing. These commands list it, "
        "measure it, evict from it (least recently used first, never what a live job uses), pin datasets, and "
        "verify every object against its name. Exit codes: 0 ok, 1 error, 2 usage, 3 damaged objects.")
    cmds = p.add_subparsers(dest="cache_command", required=True, metavar="CMD")

    c = cmds.add_parser("init", help="make DIR a cache (empty or new): a user's (0700) or, with --site, a site "
                        "cache written only by its owner (the service account)")
    c.add_argument("--site", action="store_true", help="a site-wide cache: readable by all, written only by you")
    c.add_argument("--quota", default=None, metavar="SIZE",
                   help="the cache's own quota: bytes (200G) or a fraction of its disk (0.5, 50%%)")
    _dir(c)

    c = cmds.add_parser("ls", help="datasets in the cache: how much of each is there, uses, last use, pins; "
                        "leases; recent evictions")
    _dir(c)

    c = cmds.add_parser("du", help="bytes: total, quota, disk, in use, hard-linked, per dataset (alone/shared)")
    _dir(c)

    c = cmds.add_parser("gc", help="evict least recently used objects down to the quota (or --max-bytes), never "
                        "one a live job uses, a destination links or a pinned dataset needs; says what and why")
    c.add_argument("--max-bytes", type=_size, default=None, metavar="N",
                   help="evict down to N bytes (200G, 500GB or a plain number) instead of the quota")
    c.add_argument("--dry-run", action="store_true", help="say what would be evicted; change nothing")
    c.add_argument("--timeout", type=float, default=None, help="seconds to wait for another eviction to finish")
    _dir(c)

    for name, what in (("pin", "never evict"), ("unpin", "evict again when least recently used")):
        c = cmds.add_parser(name, help=f"{what} a dataset's files (by id from `ls`, or by its source path)")
        _dir(c)
        c.add_argument("datasets", metavar="DATASET", nargs="+", help="a dataset id (or digest prefix) or its SRC")

    c = cmds.add_parser("verify", help="hash every object again and compare with its name; the owner's run "
                        "removes damaged objects (the next stage copies them again)")
    c.add_argument("--no-repair", action="store_true", help="report only, remove nothing")
    _dir(c)
    p.set_defaults(func=run)


def _dir(c: argparse.ArgumentParser) -> None:
    c.add_argument("dir", metavar="DIR", help="the cache directory")
    add_common(c)


def _size(text: str) -> int:
    from stager.commands.pack import parse_size

    if text.strip().isdigit():
        return int(text)
    return parse_size(text)


def run(args: argparse.Namespace) -> int:
    from stager.cache.config import Quota
    from stager.cache.store import Cache, set_marker_quota

    cmd = args.cache_command
    if cmd == "init":
        quota = Quota.parse(args.quota, "--quota") if args.quota else None
        cache = Cache.open(args.dir, create=True, kind="site" if args.site else "user", quota=quota)
        if quota is not None:
            set_marker_quota(cache, quota)
        _warn(cache.warnings)
        emit(args, {"ok": True, **cache.to_json()},
             f"{cache.root}: {cache.kind} cache of uid {cache.owner}, quota {cache.quota.text} "
             f"({(cache.quota_bytes or 0) / 1e9:.2f} GB)")
        return 0
    cache = Cache.open(args.dir, read_only=cmd in ("ls", "verify"))
    _warn(cache.warnings)
    if cmd in ("gc", "pin", "unpin") and not cache.writable:
        from stager.errors import UsageError

        raise UsageError(f"{cache.root}: only the cache's owner (uid {cache.owner}) may {cmd}; ask them (or the "
                         "site's administrators)")
    cache.require_own_files()
    result: dict[str, Any]
    if cmd == "ls":
        from stager.cache.report import human_listing, listing

        result = listing(cache)
        emit(args, result, human_listing(result))
    elif cmd == "du":
        from stager.cache.report import human_usage, usage

        result = usage(cache)
        emit(args, result, human_usage(result))
    elif cmd == "gc":
        return _gc(args, cache)
    elif cmd in ("pin", "unpin"):
        from stager.cache.report import set_pinned

        result = set_pinned(cache, args.datasets, cmd == "pin")
        emit(args, result, "\n".join(f"{d['dataset_id']}: {'pinned' if d['pinned'] else 'unpinned'} ({d['files']} "
                                     f"files, {d['bytes'] / 1e9:.3f} GB) {d['source']}" for d in result["datasets"]))
    else:
        from stager.cache.objectcheck import verify_cache

        rep = verify_cache(cache, quiet=args.quiet or args.json, repair=not args.no_repair)
        emit(args, rep.to_json(), rep.summary())
        return 0 if rep.ok else 3
    return 0


def _gc(args: argparse.Namespace, cache: Any) -> int:
    from stager.cache.evict import collect

    rep = collect(cache, target_bytes=args.max_bytes, dry_run=args.dry_run, timeout=args.timeout)
    emit(args, rep.to_json(), rep.summary())
    return 0


def _warn(warnings: list[str]) -> None:
    for w in warnings:
        warn("cache", w)

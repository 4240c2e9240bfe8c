"""``stager stage SRC [DEST]``: copy a packed dataset to node-local storage.

Three ways, one parser: a plain stage (:func:`stager.stage.run_stage`), ``--collective``
(:func:`stager.stage.collective.run_collective`) and ``--follow`` (:func:`stager.prefetch.follow.follow`).
Flags are turned into one :class:`~stager.stage.StageOptions` (``_stage_options``); a flag a mode
cannot honour is a :class:`~stager.errors.UsageError` (exit 2, and the error object under ``--json``).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from stager.cli.args import (
    add_common,
    add_storage_options,
    add_workers,
    duration,
    examples,
    interval,
    node_count,
    nonneg_int,
    positive_int,
    prog_of,
    quota,
    rank_list,
    size,
    storage_options,
)
from stager.cli.result import CommandResult, warn
from stager.errors import UsageError

if TYPE_CHECKING:
    from stager.cache.config import CacheOptions
    from stager.stage import StageOptions
    from stager.stage.collective import CollectiveOptions

# stager.stage.options' DEFAULT_UNPACK_DIR and FALLBACKS, spelled out so that registering the command
# imports neither numpy nor the staging engine (stager.stage is imported in run(); a test holds them equal).
DEFAULT_UNPACK_DIR = "unpacked"
FALLBACKS = ("direct", "none")
# stager.mix.file's mix-file suffixes and stager.cache.config's CACHE_ENV, spelled out for the same reason:
# a SRC without one of these suffixes is no mix file, and without --cache and $STAGER_CACHE there is no
# cache, so a plain stage imports neither the mix nor the cache modules (a test holds them equal).
MIX_SUFFIXES = (".yaml", ".yml", ".json")
CACHE_ENV = "STAGER_CACHE"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stage",
        help="copy a packed dataset to node-local storage (verified, resumable, once per node)",
        description="Copy SRC (a packed directory or its manifest.json; local path or fsspec URL) into DEST "
        "with parallel streams, verifying sizes and checksums while copying, then write a receipt the loader "
        "finds. DEST defaults to $STAGER_DEST, else $SLURM_TMPDIR, else $TMPDIR (a subdirectory "
        "stager-<dataset id> of it). Safe to run from every rank at once: one process copies, the others wait. "
        "Exit codes: 0 ok, 2 usage, 3 damaged data (verification failed), 4 out of space, 5 timeout or peer failure "
        "(README.md, Exit codes).",
        epilog=examples(
            "stager stage /lustre/$USER/imagenet-train   # into $STAGER_DEST, $SLURM_TMPDIR or $TMPDIR",
            "srun --ntasks-per-node=1 stager stage /lustre/ds /tmp/ds --partition   # each node its share",
            "srun --ntasks-per-node=1 stager stage /lustre/ds /tmp/ds --collective --timeout 600",
            "stager stage /lustre/ds --cache ~/.cache/stager   # through a node-local shard cache",
            "stager stage /lustre/ds /tmp/ds --follow --budget 40G --pid $TRAIN_PID   # prefetch beside training",
            "stager stage /lustre/ds-sqfs $SLURM_TMPDIR/ds --mount   # SquashFS shards, mounted under DEST/mnt",
        ),
    )
    p.add_argument("src", metavar="SRC", help="packed dataset directory, its manifest.json, or a URL; or a mix "
                   "file (MIX.yaml/.json: every stream staged, into DEST/<stream name> when DEST is given)")
    p.add_argument("dest", metavar="DEST", nargs="?", default=None, help="destination directory")
    add_workers(p, default=None, help="parallel copy streams (default: min(8, cores))")
    p.add_argument("--unpack", nargs="?", const="also", choices=["also", "only"], default=None,
                   help="also (or only) write an ImageFolder tree DEST/<unpack dir>/<class>/<key>.<ext>")
    p.add_argument("--unpack-dir", default=DEFAULT_UNPACK_DIR, help="name of the unpacked tree inside DEST")
    p.add_argument("--partition", action="store_true",
                   help="stage only this node's share (the loader's --partition uses the same assignment)")
    shared = p.add_mutually_exclusive_group()
    shared.add_argument("--shared", dest="shared", action="store_true", default=None,
                        help="DEST is one namespace shared by all nodes (BeeOND): each node copies its share")
    shared.add_argument("--no-shared", dest="shared", action="store_false",
                        help="treat DEST as node-local even on BeeGFS")
    p.add_argument("--node", type=nonneg_int, default=None, metavar="I",
                   help="this node's index, with --num-nodes (default: from the launcher's variables, "
                   "docs/staging.md)")
    p.add_argument("--num-nodes", type=node_count, default=None, metavar="N", help="number of nodes")
    p.add_argument("--ranks-per-node", type=positive_int, default=None, metavar="N",
                   help="training ranks per node (recorded)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the shard-to-node assignment (--follow: the loader's seed)")
    p.add_argument("--no-fsync", dest="fsync", action="store_false",
                   help="return once every shard is verified and renamed, without waiting for the disk (as cp "
                   "and dcp do); the receipt is marked non-durable and, after a reboot, ignored and staged again")
    p.add_argument("--repair", action="store_true",
                   help="hash DEST's copies again and copy again each one that no longer matches the manifest "
                   "(what `stager verify DEST` advises after finding damage); a plain re-stage trusts the receipt")
    p.add_argument("--mount", action="store_true",
                   help="then mount each staged SquashFS image read-only at DEST/mnt/<shard>/ with squashfuse, as "
                   "you (code reading a directory tree reads it there); `stager clean DEST` unmounts them")
    p.add_argument("--direct", action="store_true",
                   help="write shards with O_DIRECT (no page-cache copy: half the CPU, leaves the page cache to "
                   "training; the staged copy is then read from disk on first use)")
    p.add_argument("--timeout", type=duration, default=None, metavar="SECONDS",
                   help="how long to wait for another stager on this node or for peer nodes: 600, 90s, 10m, 1h "
                   "(default: no limit)")
    # Collective staging (stager/stage/collective/): one process per node, each byte read from SRC once.
    p.add_argument("--collective", action="store_true",
                   help="one process per node (srun --ntasks-per-node=1 / torchrun --nnodes): nodes read disjoint "
                   "shares of SRC and exchange them over the network (gloo), so SRC serves the data once")
    p.add_argument("--fallback", choices=FALLBACKS, default="direct",
                   help="--collective: what to do when the group cannot form within --timeout (default: direct)")
    p.add_argument("--chunk-size", type=size, default=8 << 20, metavar="BYTES",
                   help="--collective: bytes per node per exchange step; --follow: bytes per read of a fetch "
                   "(default 8MiB; 4M, 16MiB)")
    _add_cache_args(p)
    _add_follow_args(p)
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "shard cache (--cache; docs/staging.md, The shard cache)",
        "A node-local cache that outlives the job: shards and index files kept under their verified hash. A stage "
        "whose files are cached copies nothing and links them into DEST; concurrent stages of one dataset copy it "
        "once; least recently used files are evicted under the quota, never those a live job uses.")
    g.add_argument("--cache", metavar="DIR", default=None,
                   help="stage through the shard cache DIR (default: $STAGER_CACHE; created, 0700, when missing)")
    g.add_argument("--no-cache", action="store_true", help="ignore $STAGER_CACHE")
    g.add_argument("--cache-quota", metavar="SIZE", default=None, type=quota,
                   help="most bytes the cache keeps (200G, 500GB) or a fraction of its disk (0.5, 50%%) "
                   "(default: $STAGER_CACHE_QUOTA, else the cache's own, else 50%%)")
    g.add_argument("--cache-only", action="store_true",
                   help="fill the cache only, no DEST (a site cache's service account in the prolog)")
    g.add_argument("--verify-cache", action="store_true",
                   help="hash every cached file again before it is linked (by default only those changed since "
                   "they were verified)")


def _cache_options(args: argparse.Namespace) -> CacheOptions | None:
    """``--cache``/``$STAGER_CACHE``, ``--cache-quota``, ``--cache-only`` as one object (None: no cache)."""
    where = None if args.no_cache else (args.cache or os.environ.get(CACHE_ENV) or None)
    if where is None:
        if args.cache_only or args.cache_quota or args.verify_cache:
            raise UsageError("--cache-only, --cache-quota and --verify-cache need --cache DIR (or $STAGER_CACHE)")
        return None
    from stager.cache.config import CacheOptions, Quota

    if args.cache_only and args.dest is not None:
        raise UsageError("--cache-only fills the cache only: give no DEST")
    quota = Quota.parse(args.cache_quota) if args.cache_quota else None
    return CacheOptions(dir=where, quota=quota, only=args.cache_only, verify=args.verify_cache)


def run(args: argparse.Namespace) -> CommandResult:
    # Staging does no linear algebra: where it loads numpy (--unpack, --partition), OpenBLAS would start
    # a spinning thread per core at its import (~50 ms of CPU a run; docs/benchmarks.md, "Staging small sets").
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if os.path.splitext(os.fspath(args.src).rstrip("/"))[1].lower() in MIX_SUFFIXES:
        from stager.mix import is_mix_path

        if is_mix_path(args.src):
            return _run_mix(args)
    if args.follow:
        return _run_follow(args)
    if args.collective:
        return _run_collective(args)
    from stager.stage import run_stage

    return CommandResult.of(run_stage(args.src, args.dest, _stage_options(args)))


def _stage_options(args: argparse.Namespace) -> StageOptions:
    """The plain stage's options from the command line."""
    from stager.fs.copy import CopyTuning
    from stager.stage import NodeOptions, StageOptions

    return StageOptions(
        workers=args.workers,
        unpack=args.unpack,
        unpack_dir=args.unpack_dir,
        partition=args.partition,
        shared=args.shared,
        node=NodeOptions(args.node, args.num_nodes, args.ranks_per_node),
        seed=args.seed,
        timeout=args.timeout,
        quiet=args.quiet,
        fsync=args.fsync,
        tuning=CopyTuning(direct=True) if args.direct else None,
        storage_options=storage_options(args),
        cache=_cache_options(args),
        repair=args.repair,
        mount=args.mount,
    )


def _run_mix(args: argparse.Namespace) -> CommandResult:
    """SRC is a mix file: stage each stream (plain or collective) into DEST/<name> (stager.stage.mix)."""
    from stager.mix import load_mix_file

    if args.follow:
        raise UsageError(f"{args.src}: --follow prefetches one dataset; stage a mix's streams (plain, --partition or "
                         "--collective), or run one --follow per stream")
    mix = load_mix_file(args.src, storage_options(args))
    if args.collective:
        from stager.stage.collective.mix import run_collective_mix

        res = run_collective_mix(mix, args.dest, _collective_options(args))
    else:
        from stager.stage.mix import run_stage_mix

        res = run_stage_mix(mix, args.dest, _stage_options(args))
    return CommandResult.of(res)


def _collective_options(args: argparse.Namespace) -> CollectiveOptions:
    """``--collective``'s options from the command line (flags it cannot honour are a UsageError)."""
    from stager.stage import NodeOptions, StageOptions
    from stager.stage.collective import CollectiveOptions

    given = [flag for flag, on in (("--unpack", args.unpack), ("--shared", args.shared),
                                   ("--no-fsync", not args.fsync), ("--direct", args.direct),
                                   ("--repair", args.repair)) if on]
    if given:
        raise UsageError(f"--collective cannot be combined with {', '.join(given)} (it stages every shard "
                         "durably into a node-local DEST)")
    if args.mount:
        raise UsageError("--collective cannot be combined with --mount; after it, `stager stage SRC DEST --mount` "
                         "finds the copy staged and mounts its images")
    cache = _cache_options(args)
    if cache is not None and cache.only:
        raise UsageError("--collective cannot be combined with --cache-only (every node fills its own cache as it "
                         "stages: give --cache DIR and DEST)")
    common = StageOptions(partition=args.partition, node=NodeOptions(args.node, args.num_nodes, args.ranks_per_node),
                          seed=args.seed, timeout=args.timeout, quiet=args.quiet,
                          storage_options=storage_options(args), cache=cache)
    return CollectiveOptions(stage=common, fallback=args.fallback, chunk_bytes=args.chunk_size)


def _run_collective(args: argparse.Namespace) -> CommandResult:
    from stager.stage.collective import run_collective

    return CommandResult.of(run_collective(args.src, args.dest, _collective_options(args)))


# ---- --follow: prefetch beside training (stager/prefetch/follow.py) ------------------------------
# stager.order.epoch.SHUFFLE_MODES, spelled out so that `stager --help` does not import torch.
_SHUFFLE_MODES = ("runs", "shards", "random", "none")


def _add_follow_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "prefetch beside training (--follow)",
        "One process per node beside training keeps DEST filled with the shards this node's ranks read next, "
        "within --budget (docs/scaling.md). The ranks report progress with stager.prefetch.ProgressReporter; "
        "the loader flags below let fetching start before the first report (the ranks' own arguments win).",
    )
    g.add_argument("--follow", action="store_true",
                   help="run beside training until it finishes: fetch ahead and evict within --budget; point the "
                   "loader at DEST with staged=False")
    g.add_argument("--budget", type=size, default=None, metavar="SIZE",
                   help="--follow: most bytes of local copies in DEST, e.g. 40G")
    g.add_argument("--ranks", type=rank_list, default=None, metavar="LIST",
                   help="--follow: global ranks on this node, e.g. 0-3 or 4,5 (default: --node x --ranks-per-node "
                   "when --ranks-per-node is given, else the ranks that report)")
    g.add_argument("--batch-size", type=positive_int, default=None, metavar="N",
                   help="--follow: the loader's batch_size (per rank)")
    g.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                   help="--follow: number of training ranks")
    g.add_argument("--loader-workers", type=nonneg_int, default=0, metavar="N",
                   help="--follow: the loader's num_workers (default 0)")
    g.add_argument("--shuffle", choices=_SHUFFLE_MODES, default="runs", help="--follow: the loader's shuffle mode")
    g.add_argument("--drop-last", action="store_true", help="--follow: the loader's drop_last")
    g.add_argument("--shuffle-buffer", type=nonneg_int, default=None, metavar="N",
                   help="--follow: the loader's shuffle_buffer (samples per worker)")
    g.add_argument("--run-bytes", type=size, default=None, metavar="SIZE",
                   help="--follow: the loader's run_bytes")
    g.add_argument("--pid", type=positive_int, default=None, help="--follow: also stop when this process is gone")
    g.add_argument("--epochs", type=positive_int, default=None, metavar="N",
                   help="--follow: stop after this many epochs")
    g.add_argument("--poll", type=interval, default=0.05, metavar="SECONDS",
                   help="--follow: how often to read the progress files (default 0.05)")


def _run_follow(args: argparse.Namespace) -> CommandResult:
    import threading

    from stager.prefetch.follow import follow, stop_on_signals

    if args.dest is None:
        raise UsageError("--follow needs DEST (the directory the training loader reads)")
    if "://" in args.src and not args.src.startswith("file://"):
        raise UsageError(f"{args.src}: --follow reads SRC from a shared file system, not a URL; stage the URL "
                         "(plain, --partition or --collective) or let the loader stream it")
    if args.budget is None:
        raise UsageError("--follow needs --budget SIZE (bytes of local copies to keep, e.g. 40G)")
    if args.cache or args.cache_only:
        raise UsageError("--follow cannot be combined with --cache (it keeps a window of the dataset, not a copy)")
    if args.collective or args.unpack or args.partition or args.shared or not args.fsync or args.direct or args.mount:
        raise UsageError("--follow cannot be combined with --collective, --unpack, --partition, --shared, "
                         "--no-fsync, --direct or --mount")
    loader_kwargs = None
    if args.batch_size is not None:
        if args.world_size is None:
            raise UsageError("--follow --batch-size also needs --world-size (the number of training ranks)")
        loader_kwargs = {
            "batch_size": args.batch_size, "world_size": args.world_size, "num_workers": args.loader_workers,
            "seed": args.seed, "shuffle": args.shuffle, "drop_last": args.drop_last,
            "shuffle_buffer": args.shuffle_buffer, "run_bytes": args.run_bytes or "auto",
        }
    ranks = args.ranks
    if ranks is None and args.ranks_per_node is not None:
        node = _follow_node(args)
        ranks = list(range(node * args.ranks_per_node, (node + 1) * args.ranks_per_node))
    stop = threading.Event()
    prog = prog_of(args)
    with stop_on_signals(stop):
        res = follow(args.src, args.dest, budget=args.budget, loader_kwargs=loader_kwargs, ranks=ranks,
                     watch_pid=args.pid, epochs=args.epochs, poll=args.poll, chunk_bytes=args.chunk_size,
                     stop=stop, lock_timeout=args.timeout if args.timeout is not None else 0.0,
                     on_warning=lambda w: warn(prog, w))
    return CommandResult(res.to_json(), res.summary())  # its warnings were printed as they came


def _follow_node(args: argparse.Namespace) -> int:
    """This node's index for ``--follow --ranks-per-node``: ``--node``, else the launcher's (stager.world)."""
    if args.node is not None:
        return int(args.node)
    from stager.world import resolve_node

    identity = resolve_node(None, None, args.ranks_per_node)
    if identity.origin == "default":
        raise UsageError("--ranks-per-node needs --node (or a launcher's node variables, e.g. Slurm's) to name this "
                         "node's ranks")
    return identity.node

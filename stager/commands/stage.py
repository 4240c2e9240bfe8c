"""``stager stage SRC [DEST]``: copy a packed dataset to node-local storage (see stager/stage.py)."""

from __future__ import annotations

import argparse
import sys

from ..cli import add_common, emit
from ..stage import DEFAULT_UNPACK_DIR, stage


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stage",
        help="copy a packed dataset to node-local storage (verified, resumable, once per node)",
        description="Copy SRC (a packed directory or its manifest.json; local path or fsspec URL) into DEST "
        "with parallel streams, verifying sizes and checksums while copying, then write a receipt the loader "
        "finds. DEST defaults to $STAGER_DEST, else $SLURM_TMPDIR, else $TMPDIR (a subdirectory "
        "stager-<dataset id> of it). Safe to run from every rank at once: one process copies, the others wait. "
        "Exit codes: 0 ok, 1 error, 2 usage, 3 verification failed, 4 out of space, 5 timeout.",
    )
    p.add_argument("src", metavar="SRC", help="packed dataset directory, its manifest.json, or a URL")
    p.add_argument("dest", metavar="DEST", nargs="?", default=None, help="destination directory")
    p.add_argument("-j", "--workers", type=int, default=None, help="parallel copy streams (default: min(8, cores))")
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
    p.add_argument("--node", type=int, default=None, help="this node's index (default: Slurm, then torchrun env)")
    p.add_argument("--num-nodes", type=int, default=None, help="number of nodes")
    p.add_argument("--ranks-per-node", type=int, default=None, help="training ranks per node (recorded)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shard-to-node assignment")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for another stager on this node or for peer nodes (default: no limit)")
    # Collective staging (stager/collective.py): one process per node, each byte read from SRC once.
    p.add_argument("--collective", action="store_true",
                   help="one process per node (srun --ntasks-per-node=1 / torchrun --nnodes): nodes read disjoint "
                   "shares of SRC and exchange them over the network (gloo), so SRC serves the data once")
    p.add_argument("--fallback", choices=["direct", "none"], default="direct",
                   help="--collective: what to do when the group cannot form within --timeout (default: direct)")
    p.add_argument("--chunk-size", type=int, default=8 << 20, metavar="BYTES",
                   help="--collective: bytes per node per exchange step (default 8 MiB)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.collective:
        return _run_collective(args)
    res = stage(
        args.src,
        args.dest,
        workers=args.workers,
        unpack=args.unpack or False,
        unpack_dir=args.unpack_dir,
        partition=args.partition,
        shared=args.shared,
        node=args.node,
        num_nodes=args.num_nodes,
        ranks_per_node=args.ranks_per_node,
        seed=args.seed,
        timeout=args.timeout,
        quiet=args.quiet or args.json,
    )
    for w in res.warnings:
        print(f"stager stage: warning: {w}", file=sys.stderr)
    emit(args, res.to_json(), res.summary())
    return 0


def _run_collective(args: argparse.Namespace) -> int:
    from ..collective import stage_collective

    if args.unpack or args.shared:
        print("stager stage: error: --collective cannot be combined with --unpack or --shared", file=sys.stderr)
        return 2
    res = stage_collective(
        args.src,
        args.dest,
        partition=args.partition,
        node=args.node,
        num_nodes=args.num_nodes,
        ranks_per_node=args.ranks_per_node,
        seed=args.seed,
        timeout=args.timeout if args.timeout is not None else 300.0,
        fallback=args.fallback,
        chunk_bytes=args.chunk_size,
        quiet=args.quiet or args.json,
    )
    for w in res.warnings:
        print(f"stager stage: warning: {w}", file=sys.stderr)
    emit(args, res.to_json(), res.summary())
    return 0

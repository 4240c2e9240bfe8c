"""``stager hints PATH``: file system, size distribution, striping and fit advice (stager/advice/hints.py)."""

from __future__ import annotations

import argparse

from stager.cli.args import add_common, examples, node_count
from stager.cli.result import CommandResult


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hints", help="file system, file sizes, Lustre striping and staging advice for a dataset",
                       description="Inspect PATH (an image tree or a packed directory): file system, file count "
                       "and size distribution, small-file warning, current and recommended Lustre striping, "
                       "and whether it fits the node-local staging destination and RAM; then the commands to run "
                       "(pack an image tree first, then stage the pack).",
                       epilog=examples("stager hints imagenet/train   # an image tree: pack it, then stage the pack",
                                       "stager hints /lustre/$USER/imagenet-train --nodes 64 --json"))
    p.add_argument("path", metavar="PATH")
    p.add_argument("--dest", default=None, help="staging destination to check (default: $STAGER_DEST, "
                   "$SLURM_TMPDIR, $TMPDIR)")
    p.add_argument("--nodes", type=node_count, default=None, metavar="N",
                   help="nodes that will stage it (default: $SLURM_NNODES, else 1): picks direct, --collective, "
                   "--partition or streaming (docs/scaling.md)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> CommandResult:
    from stager.advice.hints import hints, human

    rep = hints(args.path, dest=args.dest, nodes=args.nodes)
    return CommandResult(rep, human(rep))

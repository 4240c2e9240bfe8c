"""``stager hints PATH``: file system, size distribution, striping and fit advice (stager/advice/hints.py)."""

from __future__ import annotations

import argparse

from stager.cli import add_common, emit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hints", help="file system, file sizes, Lustre striping and staging advice for a dataset",
                       description="Inspect PATH (an image tree or a packed directory): file system, file count "
                       "and size distribution, small-file warning, current and recommended Lustre striping, "
                       "and whether it fits the node-local staging destination and RAM.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--dest", default=None, help="staging destination to check (default: $STAGER_DEST, "
                   "$SLURM_TMPDIR, $TMPDIR)")
    p.add_argument("--nodes", type=int, default=None, help="nodes that will stage it (default: $SLURM_NNODES, "
                   "else 1): picks direct, --collective, --partition or streaming (docs/scaling.md)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stager.advice.hints import hints, human

    rep = hints(args.path, dest=args.dest, nodes=args.nodes)
    emit(args, rep, human(rep))
    return 0

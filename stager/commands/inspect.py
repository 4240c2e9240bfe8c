"""``stager inspect OUT``: summary and per-shard table of a pack, from its manifest."""

from __future__ import annotations

import argparse

from stager.cli import add_common, add_storage_options, emit, storage_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarise a pack (formats, counts, per-shard table)",
        description="Print a pack's summary and per-shard table from its manifest.",
    )
    p.add_argument("path", metavar="OUT", help="pack directory, its manifest.json, or a URL (s3://, https://, ...)")
    p.add_argument("--limit", type=int, default=50, help="table rows to print (default 50; --json prints all)")
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stager.summary import format_summary, summarize

    d = summarize(args.path, storage_options=storage_options(args))
    emit(args, d, format_summary(d, args.limit))
    return 0

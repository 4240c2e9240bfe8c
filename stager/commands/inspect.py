"""``stager inspect PACK``: summary, schema (classes, fields, clips) and per-shard table of a pack."""

from __future__ import annotations

import argparse

from stager.cli.args import add_common, add_storage_options, examples, nonneg_int, storage_options
from stager.cli.result import CommandResult


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarise a pack (format, counts, classes, fields, per-shard table)",
        description="Print a pack's (or an index's) summary from its manifest: format, samples, bytes, classes, "
        "the fields and clips of its samples, and the per-shard table.",
        epilog=examples(
            "stager inspect out/",
            "stager inspect out/ --limit 0   # the summary without the shard table",
            "stager inspect s3://bucket/imagenet --json | jq .fields",
        ),
    )
    p.add_argument("path", metavar="PACK", help="pack (or staged, or indexed) directory, its manifest.json, or a URL "
                   "(s3://, https://, ...)")
    p.add_argument("--limit", type=nonneg_int, default=50, metavar="N",
                   help="shard table rows to print (default 50; 0: none; --json prints all)")
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> CommandResult:
    from stager.summary import format_summary, summarize

    d = summarize(args.path, storage_options=storage_options(args))
    return CommandResult(d, format_summary(d, args.limit))

"""``stager verify PACK [--deep]``: re-hash every file of a pack (``--deep``: parse and decode every sample);
exit 3 naming each bad shard, with the command that repairs it (:func:`stager.shardcheck.advice`)."""

from __future__ import annotations

import argparse

from stager.cli.args import add_common, add_storage_options, examples, positive_int, storage_options
from stager.cli.result import CommandResult
from stager.errors import ExitCode


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check every shard's size and checksum (and samples with --deep)",
        description="Re-hash every shard and companion file against manifest.json; --deep also "
        "parses every sample through the format reader and decodes every image as the loader does. Exit 3 if "
        "anything is bad, naming each bad file; the message says which command repairs it.",
        epilog=examples(
            "stager verify out/",
            "stager verify $SLURM_TMPDIR/stager-<id> --deep --threads 8   # a staged copy, every sample parsed",
        ),
    )
    p.add_argument("path", metavar="PACK", help="pack (or staged, or indexed) directory, its manifest.json, or a URL")
    p.add_argument("--deep", action="store_true",
                   help="also parse every sample, compare it with the index, and decode every image as the loader does")
    p.add_argument("--threads", type=positive_int, default=4, metavar="N", help="files hashed concurrently (default 4)")
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> CommandResult:
    from stager.shardcheck import advice, verify

    r = verify(args.path, deep=args.deep, threads=args.threads, storage_options=storage_options(args))
    mode = "deep " if r.deep else ""
    if r.ok:
        return CommandResult(r.to_json(), f"{r.path}: OK ({mode}{r.files} files, {r.samples:,} samples, "
                             f"{r.bytes / 1e6:,.1f} MB in {r.seconds:.1f}s)")
    lines = [f"BAD {name}: {reason}" for name, reason in r.bad]
    lines.append(f"error: {len(r.bad)} of {r.files} files failed; {advice(r)}")
    return CommandResult(r.to_json(), "\n".join(lines), exit_code=ExitCode.DAMAGED)

"""``stager verify OUT [--deep]``: re-hash every file of a pack (``--deep``: parse and decode every sample);
exit 3 naming each bad shard, with the command that repairs it (:func:`stager.shardcheck.advice`)."""

from __future__ import annotations

import argparse
import sys

from stager.cli import add_common, add_storage_options, emit, storage_options
from stager.errors import VerificationError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="check every shard's size and checksum (and samples with --deep)",
        description="Re-hash every shard and companion file against manifest.json; --deep also "
        "parses every sample through the format reader and decodes every image as the loader does. Exit 3 if "
        "anything is bad; the message says which command repairs it.",
    )
    p.add_argument("path", metavar="OUT", help="pack (or staged) directory, its manifest.json, or a URL")
    p.add_argument("--deep", action="store_true",
                   help="also parse every sample, compare it with the index, and decode every image as the loader does")
    p.add_argument("--threads", type=int, default=4, help="files hashed concurrently (default 4)")
    add_storage_options(p)
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from stager.shardcheck import verify

    r = verify(args.path, deep=args.deep, threads=max(1, args.threads), storage_options=storage_options(args))
    mode = "deep " if r.deep else ""
    if r.ok:
        emit(
            args,
            r.to_json(),
            f"{r.path}: OK ({mode}{r.files} files, {r.samples:,} samples, {r.bytes / 1e6:,.1f} MB in {r.seconds:.1f}s)",
        )
        return 0
    emit(args, r.to_json())
    for name, reason in r.bad:
        print(f"stager verify: BAD {name}: {reason}", file=sys.stderr)
    from stager.shardcheck import advice

    print(f"stager verify: error: {len(r.bad)} of {r.files} files failed; {advice(r)}", file=sys.stderr)
    return VerificationError.exit_code

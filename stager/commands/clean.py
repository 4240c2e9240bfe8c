"""``stager clean DEST``: remove what ``stager stage`` wrote into DEST, by its own records (the engine:
:mod:`stager.stage.clean`, imported in :func:`run` so that registering the command loads no numpy)."""

from __future__ import annotations

import argparse

from stager.cli.args import add_common, duration, examples
from stager.cli.result import CommandResult

# stager.receipt.RECEIPT_NAME and MIX_RECEIPT_NAME, spelled out for the help text without importing the
# engine (a test holds them equal).
RECEIPT_NAME = "stager-receipt.json"
MIX_RECEIPT_NAME = "stager-mix.json"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("clean", help="remove a staged copy (only what stage wrote, by its records)",
                       description=f"Remove the files `stager stage` wrote into DEST, by its records: the "
                       f"receipt ({RECEIPT_NAME}) of a finished stage, the journal of a failed or interrupted one, "
                       f"or a staged mix's {MIX_RECEIPT_NAME}. Everything else in DEST stays. Refuses a DEST "
                       "with none of them. Exit codes: 0 ok, 2 no records, 3 unsafe records, 5 a stage still "
                       "holds the lock past --timeout.",
                       epilog=examples("stager clean $SLURM_TMPDIR/stager-<id> --dry-run   # what would go",
                                       "stager clean /tmp/ds   # in the job's epilog, after training"))
    p.add_argument("dest", metavar="DEST", help="a staging destination")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--timeout", type=duration, default=600.0, metavar="SECONDS",
                   help="how long to wait for a running stage: 600, 90s, 10m (default 600)")
    add_common(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> CommandResult:
    from stager.stage.clean import clean

    res = clean(args.dest, dry_run=args.dry_run, timeout=args.timeout)
    verb = "would remove" if res["dry_run"] else "removed"
    how = {"journal": " of an unfinished stage (by its journal)"}.get(res["records"], "")
    text = f"{res['dest']}: {verb} {res['files_removed']} entries{how} ({res['bytes_freed'] / 1e9:.3f} GB)"
    if res["left_count"]:
        shown = ", ".join(res["left"]) + (" ..." if res["left_count"] > len(res["left"]) else "")
        text += f"; left {res['left_count']} entries stage did not write: {shown}"
    return CommandResult(res, text)

"""The ``stager`` command line: one sub-command per module in :mod:`stager.commands`, one contract.

Each command module defines ``register(subparsers)``, which adds its parser (flag types and shared
flags from :mod:`stager.cli.args`) and sets ``func=run``, where ``run(args)`` returns a
:class:`~stager.cli.result.Result` and raises :class:`~stager.errors.StagerError` for what went wrong.
:func:`main` is the only place that prints results and errors and maps them to exit codes
(:class:`~stager.errors.ExitCode`, the table in README.md), by the rules of :mod:`stager.cli.result`:

* an error is one line ``stager <cmd>: error: <message>`` on stderr, never a traceback, with the exit
  code of its class; an OSError no code translated is mapped by its errno (:func:`stager.errors.from_os_error`);
  bad flags (argparse) are usage errors (2) like any other; Ctrl-C exits 130;
* ``--json`` prints exactly one JSON object on stdout in every one of those cases, and turns progress
  off (as ``-q`` does); ``-q`` also drops the summary of a successful command;
* only a bug in stager (an exception that is neither a StagerError nor an OSError) exits 1, with its
  traceback after the error line, so that it can be reported.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Sequence

from stager import __version__
from stager.cli.args import Parser, examples, json_requested, prog_of
from stager.cli.result import Result, print_result, report_error
from stager.errors import ExitCode, StagerError, UsageError, from_os_error, on_fatal

__all__ = ["COMMAND_MODULES", "build_parser", "main"]

COMMAND_MODULES = ("pack", "index", "inspect", "verify", "stage", "clean", "hints", "cache")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="stager",
        description="Pack image datasets into verified shards, stage them onto node-local storage, "
        "and stream them into PyTorch DDP. Exit codes: 0 ok, 1 internal error (a bug), 2 usage, 3 damaged data, "
        "4 out of space, 5 timeout or peer failure, 130 interrupted.",
        epilog=examples(
            "stager hints imagenet/train   # what to do with a dataset",
            "stager pack imagenet/train /lustre/$USER/imagenet-train --format tar",
            "srun --ntasks-per-node=1 stager stage /lustre/$USER/imagenet-train   # in the job script",
            "stager <command> --help   # each command's flags and examples",
        ),
    )
    parser.add_argument("--version", action="version", version=f"stager {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"stager.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"stager.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        prog = getattr(exc, "prog", "stager")
        report_error(prog, exc, exc.exit_code, as_json=json_requested(argv))
        return int(exc.exit_code)
    prog = prog_of(args, f"stager {args.command}")
    as_json = bool(getattr(args, "json", False))
    args.quiet = bool(getattr(args, "quiet", False)) or as_json  # --json: no progress (and the JSON, not a summary)
    # A watchdog thread that must end the process (errors.exit_now) reports the same way.
    on_fatal(lambda exc: report_error(prog, exc, exc.exit_code, as_json=as_json))
    return _run(args, prog, as_json=as_json, quiet=args.quiet)


def _run(args: argparse.Namespace, prog: str, *, as_json: bool, quiet: bool) -> int:
    """Run the parsed command; report its result or its error by the module's rules."""
    try:
        result = args.func(args)
        if not isinstance(result, Result):
            raise TypeError(f"{prog}: run() returned {type(result).__name__}, not a Result")
        return print_result(prog, result, as_json=as_json, quiet=quiet)
    except StagerError as exc:
        report_error(prog, exc, exc.exit_code, as_json=as_json)
        return int(exc.exit_code)
    except OSError as exc:  # an I/O failure no code translated: mapped by its errno, one line, no traceback
        err = from_os_error(exc)
        report_error(prog, err, err.exit_code, as_json=as_json)
        return int(err.exit_code)
    except KeyboardInterrupt as exc:
        report_error(prog, exc, ExitCode.INTERRUPTED, as_json=as_json,
                     message="interrupted")
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:  # a bug: the error line (and the JSON object), then the traceback to report it with
        report_error(prog, exc, ExitCode.INTERNAL, as_json=as_json, label="internal error (a bug in stager: please "
                     "report it with the traceback below)")
        traceback.print_exc(file=sys.stderr)
        return int(ExitCode.INTERNAL)


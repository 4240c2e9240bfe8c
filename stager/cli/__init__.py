"""The ``stager`` command line: one sub-command per module in :mod:`stager.commands`, one contract.

Each command module defines ``register(subparsers)``, which adds its parser (flag types and shared
flags from :mod:`stager.cli.args`) and sets ``func=run``, where ``run(args)`` returns a
:class:`~stager.cli.result.Result` and raises :class:`~stager.errors.StagerError` for what went wrong.
:func:`main` is the only place that prints results and errors and maps them to exit codes
(:class:`~stager.errors.ExitCode`, the table in README.md), by the rules of :mod:`stager.cli.result`:

* an error is one line ``stager <cmd>: error: <message>`` on stderr, never a traceback, with the exit
  code of its class; an OSError no code translated is mapped by its errno (:func:`stager.errors.from_os_error`);
  bad flags (argparse) are usage errors (2) like any other; Ctrl-C exits 130, and so do SIGTERM and SIGHUP
  (Slurm's time limit, ``scancel``, a closed terminal): each raises :class:`Interrupted` in the main thread,
  so that the same clean-up runs (no ``.partial`` file left) and ``--json`` still prints its object, even
  when the main thread is blocked in a system call (:mod:`stager.cli.signals`). A signal the parent set to
  be ignored (``nohup``) stays ignored;
* ``--json`` prints exactly one JSON object on stdout in every one of those cases, and turns progress
  off (as ``-q`` does); ``-q`` also drops the summary of a successful command;
* only a bug in stager (an exception that is neither a StagerError nor an OSError, or an OSError of an
  errno the table does not know) exits 1, with its traceback after the error line, so that it can be reported;
* stdin, stdout and stderr closed when stager starts are opened on ``/dev/null`` first (else the next file
  stager opens would take their descriptor, and whatever writes to it would write into that file); a reader
  that stops reading stdout ends the output quietly (:mod:`stager.cli.result`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from stager import __version__
from stager.cli.args import Parser, examples, json_requested, prog_of
from stager.cli.result import OutputGoneError, Result, print_result, report_error
from stager.cli.signals import Interrupted, end_on_signals
from stager.errors import ExitCode, StagerError, UsageError, from_os_error, on_fatal

__all__ = ["COMMAND_MODULES", "Interrupted", "build_parser", "entry", "main"]

COMMAND_MODULES = ("pack", "index", "inspect", "verify", "stage", "clean", "hints", "cache")
# Commands whose process leaves by os._exit once its output is out (:func:`entry`). A command joins
# only when every file it writes is closed by the command itself (what stage writes is fsynced and
# closed before its result is printed; `python -X dev` reports no unclosed file at its exit).
FAST_EXIT_COMMANDS = frozenset({"stage"})


def _open_std_streams() -> None:
    """Open ``/dev/null`` on stdin, stdout and stderr where they are closed, and give Python its streams back."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # the lowest free descriptor is this one, unless a lower one is closed too
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (the process's own stream)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``stager`` parser. With ``argv`` whose first word names a command, only that command's
    parser is built (and only its module imported: a third of a small stage's start-up went into
    building the other seven); anything else (``--help``, ``--version``, no or an unknown command)
    gets every command, so that help, usage and errors list them all as before."""
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
    wanted = argv[0] if argv and argv[0] in COMMAND_MODULES else None
    if wanted is None or not _register(sub, (wanted,)):
        _register(sub, COMMAND_MODULES)
    return parser


def _register(sub: argparse._SubParsersAction, names: Sequence[str]) -> int:
    """Add the parsers of the command modules ``names`` (a module not installed is left out); how many."""
    added = 0
    for name in names:
        try:
            module = importlib.import_module(f"stager.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"stager.commands.{name}":
                raise
            continue
        module.register(sub)
        added += 1
    return added


def entry() -> NoReturn:
    """The process's entry point (the ``stager`` script and ``python -m stager``): :func:`main`, then exit.

    Interpreter teardown (module and object clean-up, ~12 ms after a stage) does nothing a finished
    command needs, so a command of :data:`FAST_EXIT_COMMANDS` leaves with ``os._exit(code)`` once its
    result is printed, if :func:`_nothing_left_at_exit`: stdout and stderr flushed without error (a
    closed, broken or full stdout takes the normal exit, which reports it as before), no ``atexit`` or
    threading exit hook registered (temporary files, multiprocessing, logging) and no non-daemon thread
    alive. Otherwise (and for every other command) the normal ``SystemExit``.
    """
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] and argv[0] in FAST_EXIT_COMMANDS and _nothing_left_at_exit():
        os._exit(code)
    raise SystemExit(code)


def _nothing_left_at_exit() -> bool:
    """Whether interpreter teardown has nothing to do that the command's outcome depends on (see
    :func:`entry`); flushes stdout and stderr on the way."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except (OSError, ValueError):  # the normal exit reports it (and sets its exit code) as it always did
        return False
    ncallbacks = getattr(atexit, "_ncallbacks", None)  # CPython's; without it, no way to know: normal exit
    if ncallbacks is None or ncallbacks() > 0:
        return False
    threading = sys.modules.get("threading")
    if threading is None:
        return True
    if getattr(threading, "_threading_atexits", None):  # concurrent.futures' pools
        return False
    main_thread = threading.main_thread()
    return not any(t is not main_thread and not t.daemon and t.is_alive() for t in threading.enumerate())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _open_std_streams()
    end_on_signals()
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
    except UsageError as exc:
        prog = getattr(exc, "prog", "stager")
        report_error(prog, exc, exc.exit_code, as_json=json_requested(argv))
        return int(exc.exit_code)
    except KeyboardInterrupt as exc:  # while the command modules load
        report_error("stager", exc, ExitCode.INTERRUPTED, as_json=json_requested(argv),
                     message=str(exc) or "interrupted")
        return int(ExitCode.INTERRUPTED)
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
        try:
            return print_result(prog, result, as_json=as_json, quiet=quiet)
        except OutputGoneError as gone:
            return _output_gone(prog, gone, int(result.exit_code))
    except StagerError as exc:
        report_error(prog, exc, exc.exit_code, as_json=as_json)
        return int(exc.exit_code)
    except OSError as exc:  # an I/O failure no code translated: mapped by its errno, one line, no traceback
        err = from_os_error(exc)
        if err.exit_code == ExitCode.INTERNAL:  # an errno the table does not know: a bug to report
            return _bug(prog, exc, as_json=as_json)
        report_error(prog, err, err.exit_code, as_json=as_json)
        return int(err.exit_code)
    except KeyboardInterrupt as exc:
        report_error(prog, exc, ExitCode.INTERRUPTED, as_json=as_json, message=str(exc) or "interrupted")
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:  # a bug: the error line (and the JSON object), then the traceback to report it with
        return _bug(prog, exc, as_json=as_json)


def _bug(prog: str, exc: BaseException, *, as_json: bool) -> int:
    """A bug in stager: the error line (and the JSON object), then the traceback to report it with; exit 1."""
    report_error(prog, exc, ExitCode.INTERNAL, as_json=as_json, label="internal error (a bug in stager: please "
                 "report it with the traceback below)")
    import traceback  # noqa: PLC0415 (here: only a bug needs it; 2-3 ms of every start-up)

    with contextlib.suppress(OSError, ValueError):
        traceback.print_exc(file=sys.stderr)
    return int(ExitCode.INTERNAL)


def _output_gone(prog: str, gone: OutputGoneError, code: int) -> int:
    """The command ran (exit ``code``) but stdout could not take its output. A reader that stopped reading
    (EPIPE) wanted no more: ``code``, quietly. Anything else (a full disk, an I/O error) is that error's."""
    with contextlib.suppress(OSError):  # no second failure when Python flushes stdout at exit
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    exc = gone.os_error
    if exc.errno == errno.EPIPE:
        return code
    err = from_os_error(OSError(exc.errno, exc.strerror, "standard output"))
    err_code = ExitCode.USAGE if err.exit_code == ExitCode.INTERNAL else err.exit_code  # EBADF: not writable
    report_error(prog, err, err_code, as_json=False)
    return int(err_code)


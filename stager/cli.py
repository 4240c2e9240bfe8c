"""The ``stager`` command line: one sub-command per module in :mod:`stager.commands`.

Every command accepts ``--json`` (one JSON object on stdout, human text on stderr) and returns the
exit codes documented in :mod:`stager.errors`, so job prologues can test them. Errors are printed
as one line ``stager <cmd>: error: <message>``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from stager import __version__
from stager.errors import StagerError, on_fatal
from stager.redact import redact_text

# Each module defines ``register(subparsers)`` which adds its parser and sets ``func=run``, where
# ``run(args) -> dict`` returns the JSON-able result (printed with --json) and raises StagerError.
COMMAND_MODULES = ("pack", "index", "inspect", "verify", "stage", "clean", "hints", "cache")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stager",
        description="Pack image datasets into verified shards, stage them onto node-local storage, "
        "and stream them into PyTorch DDP.",
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


def add_common(p: argparse.ArgumentParser) -> None:
    """Options every command shares."""
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (progress goes to stderr)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def add_storage_options(p: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable) for commands that take a URL (stager/fs/open.py)."""
    p.add_argument("--storage-option", dest="storage_options", action="append", default=[], metavar="KEY=VALUE",
                   type=_storage_option_arg,
                   help="option for opening URLs (fsspec storage options; repeatable): dotted keys nest, values are "
                   "JSON where they parse, e.g. client_kwargs.endpoint_url=http://host:9000 or anon=true")


def _storage_option_arg(text: str) -> str:
    from stager.fs.open import storage_option_arg  # noqa: PLC0415 (only when the flag is given: start-up stays lean)

    return storage_option_arg(text)


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--storage-option`` flags as one nested dict."""
    from stager.fs.open import parse_storage_options  # noqa: PLC0415 (the opener's module, when a command runs)

    return parse_storage_options(getattr(args, "storage_options", None) or [])


def _redacted(value: Any) -> Any:
    """``value`` (a command's JSON-able result) with every string passed through :func:`redact_text`."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return value


def emit(args: argparse.Namespace, result: dict[str, Any], human: str | None = None) -> None:
    """Print a command's result: JSON on stdout with --json, else the human summary. Every location
    in either is redacted (stager.redact): no URL credentials or query values are ever printed."""
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(_redacted(result), default=lambda o: redact_text(str(o))) + "\n")
    elif human is not None:
        sys.stdout.write(redact_text(human.rstrip("\n")) + "\n")
    sys.stdout.flush()


def warn(command: str, text: str) -> None:
    """A warning of a running command on stderr, one line, redacted: ``stager <command>: warning: ...``."""
    print(f"stager {command}: warning: {redact_text(text)}", file=sys.stderr, flush=True)


def report_error(args: argparse.Namespace, exc: BaseException) -> None:
    """A failed command's report: with --json one JSON object on stdout; always one line on stderr."""
    text = redact_text(str(exc)).splitlines()[0] if str(exc) else type(exc).__name__
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps({"ok": False, "error": text, "type": type(exc).__name__}) + "\n")
        sys.stdout.flush()
    print(f"stager {args.command}: error: {text}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # A watchdog thread that must end the process (errors.exit_now) reports the same way.
    on_fatal(lambda exc: report_error(args, exc))
    try:
        rc = args.func(args)
    except StagerError as exc:
        report_error(args, exc)
        return exc.exit_code
    except OSError as exc:  # an I/O failure we did not translate: still one line, never a traceback
        report_error(args, exc)
        return 1
    except KeyboardInterrupt:
        print(f"stager {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())

"""What a command returns and how the CLI prints it: the one output contract of every ``stager`` command.

A command's ``run(args)`` returns a :class:`Result` and prints nothing itself; :func:`stager.cli.main`
is the only place that prints results and errors and maps them to exit codes (:class:`~stager.errors.ExitCode`):

* ``--json``: exactly one JSON object on stdout, whatever happens: the result's :meth:`Result.to_json`
  (with ``"ok"``), or, for an error, ``{"ok": false, "error", "type", "exit_code"}`` (:func:`error_object`),
  including bad flags and Ctrl-C. No progress on stderr; warnings and errors still go there.
* without it: a successful result's :meth:`Result.summary` on stdout, unless ``-q``; a failed result's
  summary on stderr, every line prefixed ``stager <cmd>: `` (verify's ``BAD <file>: ...`` lines, then its
  ``error:`` line), ``-q`` or not.
* warnings (:attr:`Result.warnings`) as ``stager <cmd>: warning: ...`` lines on stderr; an error as one
  line ``stager <cmd>: error: ...``. Every location printed passes :mod:`stager.redact` first, and every
  line for a terminal :func:`stager.redact.printable`: a path's newline, carriage return or escape sequence
  is shown as ``\\x0a``, ``\\x0d``, ``\\x1b`` (one line stays one line, and a file name cannot drive the
  terminal).
* the streams may be gone: a reader that stopped reading (``stager inspect X --json | head -c1``) ends the
  output quietly with the command's own exit code; stdout that cannot be written (a full disk) is an error
  of its errno (:func:`stager.errors.from_os_error`) on stderr; an unwritable stderr never fails a command.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from stager.errors import ExitCode
from stager.redact import printable, redact_text


@runtime_checkable
class Result(Protocol):
    """A command's outcome: whether it succeeded, its JSON form, its human summary, warnings, exit code."""

    @property
    def ok(self) -> bool: ...

    @property
    def warnings(self) -> Sequence[str]: ...

    @property
    def exit_code(self) -> int: ...

    def to_json(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


@dataclass
class CommandResult:
    """The :class:`Result` commands return: ``data`` (JSON-able; its ``"ok"`` is set from :attr:`ok`),
    ``text`` (the human summary; for a failed result, the lines printed on stderr), ``warnings`` and
    ``exit_code`` (:attr:`ExitCode.OK`, or the code of what failed: then :attr:`ok` is False)."""

    data: dict[str, Any]
    text: str = ""
    warnings: list[str] = field(default_factory=list)
    exit_code: int = ExitCode.OK

    @property
    def ok(self) -> bool:
        return self.exit_code == ExitCode.OK

    @classmethod
    def of(cls, res: Any, text: str | None = None) -> CommandResult:
        """An engine's result object (``to_json()``, ``summary()``, optional ``warnings``) as a Result."""
        return cls(res.to_json(), res.summary() if text is None else text,
                   warnings=list(getattr(res, "warnings", None) or []))

    def to_json(self) -> dict[str, Any]:
        return _with_ok(self.data, self.ok)

    def summary(self) -> str:
        return self.text


# ---- printing ---------------------------------------------------------------------------------------
class OutputGoneError(Exception):
    """Standard output cannot take the command's output (``errno``, ``strerror``): :func:`stager.cli.main`
    reports it (a reader that went away: quietly)."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(exc.strerror or str(exc))
        self.os_error = exc


def _stdout_write(text: str) -> None:
    """``text`` on stdout, flushed; an OSError (a closed pipe, a full disk) is raised as :class:`OutputGoneError`."""
    try:
        if sys.stdout is None:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))  # no stdout at all (a library caller's)
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        raise OutputGoneError(exc) from exc


def stderr_line(text: str) -> None:
    """One line on stderr, flushed; a stderr that cannot be written (closed, a full disk) is ignored, as a
    message nobody can read must not change what the command does or its exit code."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _with_ok(data: dict[str, Any], ok: bool) -> dict[str, Any]:
    """``data`` with ``"ok"`` first and equal to ``ok``."""
    return {"ok": ok, **{k: v for k, v in data.items() if k != "ok"}}


def _redacted(value: Any) -> Any:
    """``value`` (a JSON-able result) with every string passed through :func:`redact_text`."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return value


def write_json(obj: dict[str, Any]) -> None:
    """One JSON object, redacted, on one line of stdout (:class:`OutputGoneError` when stdout cannot take it)."""
    _stdout_write(json.dumps(_redacted(obj), default=lambda o: redact_text(str(o))) + "\n")


def warn(prog: str, text: str) -> None:
    """A warning on stderr, one line, redacted: ``stager <cmd>: warning: ...`` (live, while a command runs)."""
    stderr_line(f"{prog}: warning: {printable(redact_text(text))}")


def print_result(prog: str, result: Result, *, as_json: bool, quiet: bool) -> int:
    """Print ``result`` by the rules of the module docstring; return its exit code."""
    for w in result.warnings:
        warn(prog, w)
    if as_json:
        write_json(_with_ok(result.to_json(), result.ok))
    text = result.summary().rstrip("\n")
    if not result.ok:
        for line in text.splitlines():
            stderr_line(f"{prog}: {printable(redact_text(line))}")
    elif text and not as_json and not quiet:
        _stdout_write(redact_text(text) + "\n")  # several lines: newlines and tabs kept
    return int(result.exit_code)


def error_line(exc: BaseException) -> str:
    """``exc``'s message, redacted, on one line (:func:`printable`: a newline in a path does not cut it
    short); its type's name when it has none."""
    text = str(exc)
    return printable(redact_text(text).strip()) if text.strip() else type(exc).__name__


def error_object(exc: BaseException, code: int, message: str | None = None) -> dict[str, Any]:
    """What ``--json`` prints for a command that ended with ``exc`` (``message``: instead of its own)."""
    return {"ok": False, "error": message or error_line(exc), "type": type(exc).__name__, "exit_code": int(code)}


def report_error(prog: str, exc: BaseException, code: int, *, as_json: bool, label: str = "error",
                 message: str | None = None) -> None:
    """A failed command's report: with ``as_json`` one JSON object on stdout; always one line on stderr,
    ``<prog>: <label>: <message>`` (``message``: instead of the exception's own)."""
    if as_json:
        with contextlib.suppress(OutputGoneError):  # the error line below still says it; the exit code is the error's
            write_json(error_object(exc, code, message))
    stderr_line(f"{prog}: {label}: {message or error_line(exc)}")

"""One exception family for everything stager reports to users.

Every error inherits both :class:`StagerError` and the builtin it behaves like, so callers can catch
either (``except FileNotFoundError`` still works). Messages are one line that names the file and
says what to do. ``exit_code`` is what the CLI returns for it; job scripts test these codes:

====  =====================================================================
code  meaning
====  =====================================================================
0     success
1     generic failure (bad input, I/O error)
2     usage error (bad flags, missing path, unknown format)
3     verification failed (checksum or size mismatch, damaged manifest)
4     out of space (disk full, quota, file size limit)
5     timeout or peer failure (lock wait, collective staging, an object store that keeps failing)
====  =====================================================================
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from stager.redact import redact_text

_reporters: list[Callable[[StagerError], None]] = []


def on_fatal(reporter: Callable[[StagerError], None]) -> None:
    """Register how the running command reports an error :func:`exit_now` ends it with (the CLI:
    the one-line message on stderr and, with ``--json``, the JSON object on stdout)."""
    _reporters.append(reporter)


def exit_now(exc: StagerError) -> NoReturn:
    """End the process from any thread with ``exc``'s exit code, reported as the CLI reports errors.

    For a watchdog whose main thread is stuck where no exception reaches it (inside a collective, or
    a read from a file system that stopped answering): ``os._exit`` skips the CLI's own handling and
    every buffer, so the registered reporters run first and the streams are flushed.
    """
    if not _reporters:
        sys.stderr.write(f"stager: error: {redact_text(str(exc))}\n")
    for report in _reporters:
        with contextlib.suppress(Exception):
            report(exc)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exc.exit_code)


class StagerError(Exception):
    """Base of all stager errors. The message is passed through :func:`stager.redact.redact_text`,
    so no error carries a URL's credentials or query values."""

    exit_code = 1

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (redact_text(args[0]), *args[1:])
        super().__init__(*args)


class UsageError(StagerError, ValueError):
    """Bad command-line arguments or API parameters."""

    exit_code = 2


class SourceError(StagerError, ValueError):
    """Unreadable or invalid source data (a truncated image, an empty folder)."""


class SourceNotFoundError(StagerError, FileNotFoundError):
    """A source path does not exist."""

    exit_code = 2


class ManifestError(StagerError, ValueError):
    """A manifest is missing, malformed, of an unknown schema, or fails its own digest."""

    exit_code = 3


class VerificationError(StagerError, OSError):
    """A shard's size or checksum does not match the manifest."""

    exit_code = 3


class ShardMissingError(StagerError, FileNotFoundError):
    """A shard listed in the manifest is absent."""

    exit_code = 3


class CorruptSampleError(StagerError, ValueError):
    """A sample inside a shard cannot be parsed or decoded."""


class OutOfSpaceError(StagerError, OSError):
    """A write failed for lack of space, quota, or a file-size limit."""

    exit_code = 4


class UnsafeArchiveError(StagerError, ValueError):
    """An archive member or manifest entry would escape the destination or is not a regular file."""

    exit_code = 3


class UnsafePathError(StagerError, PermissionError):
    """A path someone else could have planted or can change: a symlink, hard link, FIFO or other
    non-regular file where stager reads or writes, or a file or directory not owned by the user (or
    root) or writable by others. The message names the path, the owner and mode found, and what to do
    (:mod:`stager.fs.safe`)."""

    exit_code = 2


class StagerTimeoutError(StagerError, TimeoutError):
    """A lock wait or a collective peer timed out."""

    exit_code = 5


class DestinationError(StagerError, OSError):
    """An output or staging destination holds something we must not overwrite."""

    exit_code = 2


class MissingBackendError(UsageError, ImportError):
    """A URL's scheme needs an optional package that is not installed (the message names the extra)."""

    exit_code = 2


class RemoteUnavailableError(StagerTimeoutError):
    """An object store or HTTP server kept failing (resets, 5xx, throttling, stalls) until the retries ran out."""

    exit_code = 5


class RemoteAccessError(StagerError, OSError):
    """An object store or HTTP server refused a request for good (credentials, permissions, a bad request)."""


class RemotePermissionError(RemoteAccessError, PermissionError):
    """The store refused the credentials (403, none found): still a PermissionError for callers."""


def install_hint(packages: str, extra: str | None = None) -> str:
    """How to install an optional dependency: the PyPI packages themselves (what works in any environment;
    stager is installed from a checkout, not from PyPI), and the checkout's extra where there is one."""
    hint = f"pip install {packages}"
    return f"{hint} (or, in a stager checkout: pip install -e '.[{extra}]')" if extra else hint

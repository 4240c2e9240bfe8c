"""One exception family for everything stager reports to users, and the exit-code table.

Every error inherits both :class:`StagerError` and the builtin it behaves like, so callers can catch
either (``except FileNotFoundError`` still works). Messages are one line that names the file and
says what to do. ``exit_code`` is what the CLI returns for it, one of :class:`ExitCode`, the one
table job scripts test (README.md, "Exit codes", is checked against it by tests/test_cli_contract.py):

====  ===========  ==========================================================================
code  name         meaning
====  ===========  ==========================================================================
0     OK           success
1     INTERNAL     a bug in stager, never a user's mistake: please report it (with the traceback)
2     USAGE        bad flags, a missing path, the wrong kind of input (a single shard, an image
                   tree where a pack is expected), a path that cannot be written or read as asked
3     DAMAGED      damaged data: a checksum or size mismatch, a damaged manifest, a corrupt
                   sample or source image, an I/O error from the storage
4     NO_SPACE     out of space: disk full, quota, file-size limit
5     TIMEOUT      a timeout or a peer's failure (lock wait, collective staging, an object store
                   that keeps failing)
130   INTERRUPTED  interrupted (Ctrl-C, SIGINT)
====  ===========  ==========================================================================

An :class:`OSError` that no code translated reaches the CLI as is: :func:`from_os_error` is the one
place that maps its ``errno`` onto this table (ENOENT, ENOTDIR, EROFS, EACCES ... -> 2, ENOSPC ... -> 4).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from stager.redact import redact_text


class ExitCode(enum.IntEnum):
    """The exit codes of every ``stager`` command (the table in the module docstring)."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    DAMAGED = 3
    NO_SPACE = 4
    TIMEOUT = 5
    INTERRUPTED = 130


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
    so no error carries a URL's credentials or query values. A bare ``StagerError`` is a broken
    invariant (exit 1, :attr:`ExitCode.INTERNAL`); what a user can cause is one of the subclasses."""

    exit_code: int = ExitCode.INTERNAL  # an ExitCode (subclasses elsewhere may give the plain int)

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (redact_text(args[0]), *args[1:])
        super().__init__(*args)


class UsageError(StagerError, ValueError):
    """Bad command-line arguments or API parameters."""

    exit_code = ExitCode.USAGE


class SourceError(StagerError, ValueError):
    """Unreadable or invalid source data (a truncated image, a malformed list or CIFAR batch)."""

    exit_code = ExitCode.DAMAGED


class UnreadableSourceError(SourceError):
    """A source file or folder the user may not read (permissions): the user's to fix, not damaged data. Still
    a :class:`SourceError`, so that ``--on-error skip`` skips such a sample as it skips a damaged one."""

    exit_code = ExitCode.USAGE


class UnsuitableSourceError(SourceError):
    """SRC cannot be packed as asked: it is not a kind of source ``stager pack`` reads (an empty folder, an
    unsupported file), or its images do not fit the format without a flag (several sizes for zarr: pass
    ``--resize``). The wrong input or a missing flag, not damaged data."""

    exit_code = ExitCode.USAGE


class SourceNotFoundError(StagerError, FileNotFoundError):
    """A source path does not exist."""

    exit_code = ExitCode.USAGE


class NotAPackError(StagerError, FileNotFoundError):
    """A path given where a pack (a directory holding ``manifest.json``, or the manifest) is expected
    holds none: a single shard, an image tree, an unfinished pack. The message says what it is and
    which command fits."""

    exit_code = ExitCode.USAGE


class PathError(StagerError, OSError):
    """A path the user gave cannot be used as asked: missing, of the wrong kind, on a read-only file
    system, not permitted (:func:`from_os_error`)."""

    exit_code = ExitCode.USAGE


class ManifestError(StagerError, ValueError):
    """A manifest is missing, malformed, of an unknown schema, or fails its own digest."""

    exit_code = ExitCode.DAMAGED


class VerificationError(StagerError, OSError):
    """A shard's size or checksum does not match the manifest."""

    exit_code = ExitCode.DAMAGED


class StorageError(StagerError, OSError):
    """The storage failed a read or write (EIO): the data could not be read or written intact."""

    exit_code = ExitCode.DAMAGED


class ShardMissingError(StagerError, FileNotFoundError):
    """A shard listed in the manifest is absent."""

    exit_code = ExitCode.DAMAGED


class CorruptSampleError(StagerError, ValueError):
    """A sample inside a shard cannot be parsed or decoded."""

    exit_code: int = ExitCode.DAMAGED  # int: the format modules' subclasses say 3


class OutOfSpaceError(StagerError, OSError):
    """A write failed for lack of space, quota, or a file-size limit."""

    exit_code = ExitCode.NO_SPACE


class UnsafeArchiveError(StagerError, ValueError):
    """An archive member or manifest entry would escape the destination or is not a regular file."""

    exit_code = ExitCode.DAMAGED


class UnsafePathError(StagerError, PermissionError):
    """A path someone else could have planted or can change: a symlink, hard link, FIFO or other
    non-regular file where stager reads or writes, or a file or directory not owned by the user (or
    root) or writable by others. The message names the path, the owner and mode found, and what to do
    (:mod:`stager.fs.safe`)."""

    exit_code = ExitCode.USAGE


class StagerTimeoutError(StagerError, TimeoutError):
    """A lock wait or a collective peer timed out, or a peer failed."""

    exit_code = ExitCode.TIMEOUT


class DestinationError(StagerError, OSError):
    """An output or staging destination holds something we must not overwrite."""

    exit_code = ExitCode.USAGE


class MissingBackendError(UsageError, ImportError):
    """A URL's scheme needs an optional package that is not installed (the message names the extra)."""

    exit_code = ExitCode.USAGE


class RemoteUnavailableError(StagerTimeoutError):
    """An object store or HTTP server kept failing (resets, 5xx, throttling, stalls) until the retries ran out."""

    exit_code = ExitCode.TIMEOUT


class RemoteAccessError(StagerError, OSError):
    """An object store or HTTP server refused a request for good (credentials, permissions, a bad
    request, a server that ignores Range requests): the user's to fix."""

    exit_code = ExitCode.USAGE


class RemotePermissionError(RemoteAccessError, PermissionError):
    """The store refused the credentials (403, none found): still a PermissionError for callers."""


class ResourceLimitError(StagerError, OSError):
    """A limit of this process ran out (open files: ``ulimit -n``): the message names the limit and how to stay
    under it or raise it, the user's to fix."""

    exit_code = ExitCode.USAGE


class WorkerLostError(ResourceLimitError):
    """A worker process of ``pack -j`` or ``index -j`` ended on its own (the OOM killer's SIGKILL, a ``kill``
    of that one process): the message names it, the signal, and what to do (fewer workers; the run resumes)."""


def install_hint(packages: str, extra: str | None = None) -> str:
    """How to install an optional dependency: the PyPI packages themselves (what works in any environment;
    stager is installed from a checkout, not from PyPI), and the checkout's extra where there is one."""
    hint = f"pip install {packages}"
    return f"{hint} (or, in a stager checkout: pip install -e '.[{extra}]')" if extra else hint


# ---- OSErrors no code translated: errno -> (exit code, what it is, what to do) ----------------------
_ERRNOS: dict[int, tuple[ExitCode, str]] = {
    errno.ENOENT: (ExitCode.USAGE, "check the path"),
    errno.ENOTDIR: (ExitCode.USAGE, "a component of the path is a file, not a directory: check the path"),
    errno.EISDIR: (ExitCode.USAGE, "give a file here, not a directory"),
    errno.ELOOP: (ExitCode.USAGE, "the path loops through symbolic links: check it"),
    errno.ENAMETOOLONG: (ExitCode.USAGE, "use a shorter path"),
    errno.EEXIST: (ExitCode.USAGE, "remove it or choose another path"),
    errno.ENOTEMPTY: (ExitCode.USAGE, "empty it or choose another path"),
    errno.EROFS: (ExitCode.USAGE, "the file system is mounted read-only: choose a directory on a writable one"),
    errno.EACCES: (ExitCode.USAGE, "choose a path you may use, or ask its owner (`ls -ld` shows owner and mode)"),
    errno.EPERM: (ExitCode.USAGE, "choose a path you may use, or ask its owner (`ls -ld` shows owner and mode)"),
    errno.EXDEV: (ExitCode.USAGE, "keep the paths on one file system"),
    errno.ENXIO: (ExitCode.USAGE, "no such device (or a FIFO nobody reads): check the path"),
    errno.ENODEV: (ExitCode.USAGE, "no such device: check the path"),
    errno.ESPIPE: (ExitCode.USAGE, "give a regular file, not a pipe or socket"),
    errno.EBUSY: (ExitCode.USAGE, "it is in use (a mount point, a busy device): choose another path"),
    errno.EOPNOTSUPP: (ExitCode.USAGE, "the file system does not support it: choose a path on another one"),
    errno.EMFILE: (ExitCode.USAGE, "too many open files for this process: raise `ulimit -n` or use fewer workers (-j)"),
    errno.ENFILE: (ExitCode.USAGE, "the system's table of open files is full: rerun later, or with fewer workers (-j)"),
    errno.EAGAIN: (ExitCode.USAGE, "a limit on processes or threads was reached (`ulimit -u`): use fewer workers "
                   "(-j), or rerun later"),
    errno.ENOMEM: (ExitCode.USAGE, "not enough memory: use fewer workers (-j), smaller shards, or a node with more"),
    errno.ENOSPC: (ExitCode.NO_SPACE, "free space or choose another destination, then rerun"),
    errno.EDQUOT: (ExitCode.NO_SPACE, "free space under your quota or choose another destination, then rerun"),
    errno.EFBIG: (ExitCode.NO_SPACE, "the file system (or `ulimit -f`) limits file sizes: choose another destination"),
    errno.EIO: (ExitCode.DAMAGED, "the storage reported an I/O error: check the device or file system, then rerun"),
    errno.ESTALE: (ExitCode.DAMAGED, "the file system lost the file under stager (a stale NFS handle): rerun"),
    errno.ETIMEDOUT: (ExitCode.TIMEOUT, "a peer or server did not answer: check it, then rerun"),
    errno.ECONNREFUSED: (ExitCode.TIMEOUT, "a peer or server refused the connection: check it, then rerun"),
    errno.ECONNRESET: (ExitCode.TIMEOUT, "a peer or server dropped the connection: check it, then rerun"),
    errno.EHOSTUNREACH: (ExitCode.TIMEOUT, "a peer or server cannot be reached: check the network, then rerun"),
    errno.ENETUNREACH: (ExitCode.TIMEOUT, "a peer or server cannot be reached: check the network, then rerun"),
    errno.ENETDOWN: (ExitCode.TIMEOUT, "the network is down: check it, then rerun"),
    errno.EHOSTDOWN: (ExitCode.TIMEOUT, "a peer or server is down: check it, then rerun"),
    errno.ECONNABORTED: (ExitCode.TIMEOUT, "a peer or server dropped the connection: check it, then rerun"),
}
_CLASS_OF: dict[ExitCode, type[StagerError]] = {
    ExitCode.USAGE: PathError, ExitCode.NO_SPACE: OutOfSpaceError, ExitCode.DAMAGED: StorageError,
    ExitCode.TIMEOUT: StagerTimeoutError,
}


def errno_code(exc: OSError) -> ExitCode | None:
    """The exit code of ``exc``'s errno in the table (None: an errno stager does not expect)."""
    entry = _ERRNOS.get(exc.errno or 0)
    return entry[0] if entry else None


def translated(exc: OSError, message: str, default: type[StagerError]) -> StagerError:
    """``message`` (a caller's own words for ``exc``: what it was doing, which path) as the error of
    ``exc``'s errno: ``default`` where the table agrees with its exit code or does not know the errno, else
    the table's class (a full disk while creating a directory is out of space, not a bad destination). A
    :class:`SourceError` default stays one (``--on-error skip`` catches it) with the table's code for a
    permission error (:class:`UnreadableSourceError`)."""
    code = errno_code(exc)
    if code is None or code == default.exit_code:
        return default(message)
    if issubclass(default, SourceError) and code == ExitCode.USAGE:
        return UnreadableSourceError(message)
    return _CLASS_OF.get(code, default)(message)


def from_os_error(exc: OSError) -> StagerError:
    """``exc`` (an OSError no code translated) as the :class:`StagerError` of its errno: one line naming the
    path(s), what happened and what to do, with the exit code of the table (an errno stager does not expect
    is :attr:`ExitCode.INTERNAL`). A StagerError is returned as it is."""
    if isinstance(exc, StagerError):
        return exc
    code, fix = _ERRNOS.get(exc.errno or 0, (ExitCode.INTERNAL, ""))
    what = exc.strerror or str(exc) or type(exc).__name__
    where = ", ".join(os.fsdecode(p) if isinstance(p, (str, bytes)) else f"file descriptor {p}"
                      for p in (exc.filename, exc.filename2) if p is not None)
    text = f"{where}: {what}" if where else what
    return _CLASS_OF.get(code, StagerError)(f"{text}; {fix}" if fix else text)

"""The one verified copy: written under a partial name, hashed while written, compared, then published.

Every copy stager makes of a file whose size and hash a manifest lists goes through here: the
plain stage's copy streams into DEST or a shard cache (``stage/copier.py``), the staged sample
index (``stage/dest.py``), the collective's stream sinks and the prefetcher (``stage/collective/io.py``),
and a cache adopting DEST's verified files (``stage/cached.py``). Unpacking compares the tar stream
it extracts with :func:`check`; ``stager verify`` and ``stager cache verify`` re-hash existing files
with :func:`verify_file`. Like CPython's one ``shutil.copyfileobj`` and ``tarfile``'s one filter
core, the rules below are decided here and nowhere else (``tests/test_one_mechanism.py`` scans
stager/ for another hash comparison or hash-while-copy loop):

* **The partial file**: ``<final>.<12 hex>.partial`` (:func:`stager.fs.atomic.partial_path`) beside the
  final name, or inside a checked directory handle (:class:`~stager.fs.safe.SafeDir`) where the caller
  holds one; created by :func:`stager.fs.copy.open_partial` over :func:`stager.fs.safe.create_exclusive`
  (``O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC``, ``O_DIRECT`` on request) with mode 0600: nobody
  else reads a copy before it is verified, and a name planted there is never written through.
* **Hash while writing**, the bytes written, read once: pulled from a readable source by
  :func:`copy_verified` with :mod:`stager.fs.copy`'s loops (write-behind, or ``O_DIRECT`` with its
  buffered fall-back), or pushed a piece at a time in stream order (:meth:`PartialCopy.write`: the
  collective's stream sinks).
* **The comparison and its one message** (:func:`mismatch`, :func:`check`): size, then hash, against an
  :class:`Expected`; a :class:`~stager.errors.VerificationError` (exit 3) reads
  ``<file>: verification failed<context>: <what differs, expected vs got>; <fix>``.
* **The way out.** On any failure the partial file is closed and removed, and a full disk or quota is
  a one-line :class:`~stager.errors.OutOfSpaceError`. On success :meth:`PartialCopy.publish` gives the
  caller's mode (its rule: :func:`stager.fs.access.copy_mode`, or the cache's ``object_mode``; never a
  write bit for group or others, never execute) and group, fsyncs unless the caller runs ``--no-fsync``,
  renames over the final name and, when asked, fsyncs the directory; :meth:`PartialCopy.seal` does the
  same but leaves the rename to the caller (the staged manifest publishes index and manifest last).

The copy streams hand the verified, still open copy to finisher threads that publish it while the
stream copies its next file; so the copy and its publication are two calls, and the copy is an object.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from stager.checksum import READ_CHUNK, Hasher, new_hasher
from stager.errors import StagerError, VerificationError
from stager.fs.access import give_group
from stager.fs.atomic import fsync_dir, partial_path, space_error
from stager.fs.copy import DIRECT_ALIGN, Readable, copy_hashed, copy_hashed_direct, open_partial, write_all
from stager.fs.writeback import WriteBehind

if TYPE_CHECKING:
    from stager.fs.safe import SafeDir

# A copy is never writable by group or others, never executable (fs/access.py: what fs/safe.py trusts).
MAX_COPY_MODE = 0o644


@dataclass(frozen=True)
class Expected:
    """What a file must be: ``bytes`` long with hex digest ``hash`` under ``algo`` (a manifest's
    entry). ``name`` names it in messages (a manifest name, or a path)."""

    name: str
    bytes: int
    hash: str
    algo: str


def mismatch(expect: Expected, got_bytes: int, got_hash: str) -> str | None:
    """What differs, or None: ``read N bytes, expected M`` (size first: a cut or grown file), else
    ``<algo> checksum G, expected E``. The comparison of every verified byte in stager."""
    if got_bytes != expect.bytes:
        return f"read {got_bytes} bytes, expected {expect.bytes}"
    if got_hash != expect.hash:
        return f"{expect.algo} checksum {got_hash}, expected {expect.hash}"
    return None


def check(expect: Expected, got_bytes: int, got_hash: str, *, context: str = "", fix: str) -> None:
    """Raise the one :class:`VerificationError` when :func:`mismatch` finds a difference:
    ``<name>: verification failed<context>: <reason>; <fix>``. ``context`` says how the bytes came
    (`` copying SRC``, `` after transfer from node 3``, `` while unpacking``), ``fix`` what to do."""
    reason = mismatch(expect, got_bytes, got_hash)
    if reason is not None:
        raise VerificationError(f"{expect.name}: verification failed{context}: {reason}; {fix}")


class PartialCopy:
    """A copy being written under its partial name, created exclusively (module docstring).

    ``final``: the final name: a path, or with ``within`` a single name inside that directory
    handle. ``expect``: what the bytes must be (None: bytes the caller vouches for, not hashed: the
    staged manifest). ``direct``: ask for ``O_DIRECT`` (:attr:`direct` says whether it was given).
    :meth:`write` appends, hashing; :meth:`verify` compares; :meth:`publish` or :meth:`seal` finish;
    any failure leaves nothing behind (:meth:`fail`). Not thread-safe: one writer, then one finisher.
    """

    def __init__(self, final: str | os.PathLike[str], *, expect: Expected | None = None,
                 within: SafeDir | None = None, direct: bool = False) -> None:
        self.final = Path(final)
        self.expect = expect
        self.dir_fd = within.fd if within is not None else None
        self._within = within
        if within is not None:
            within.join(os.fspath(final))  # one name inside the handle: ValueError otherwise
        tmp = partial_path(self.final)
        self.tmp = Path(tmp.name) if within is not None else tmp
        self.fd, self.direct = open_partial(self.tmp, direct=direct, dir_fd=self.dir_fd)
        self.hasher: Hasher | None = new_hasher(expect.algo) if expect is not None else None
        self.nbytes = 0

    @property
    def shown(self) -> str:
        """The final name for messages (a path even inside a directory handle)."""
        return self._within.join(self.final.name) if self._within is not None else os.fspath(self.final)

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` (hashed, counted); a failed write removes the partial file and raises."""
        try:
            if self.hasher is not None:
                self.hasher.update(data)
            write_all(self.fd, memoryview(data))
        except BaseException as exc:
            self.fail(exc)
        self.nbytes += len(data)

    def verify(self, *, context: str = "", fix: str) -> None:
        """:func:`check` what was written against :attr:`expect`; on a difference the partial file is
        removed before the :class:`VerificationError` is raised."""
        assert self.expect is not None and self.hasher is not None
        try:
            check(self.expect, self.nbytes, self.hasher.hexdigest(), context=context, fix=fix)
        except BaseException as exc:
            self.fail(exc)

    def seal(self, mode: int = 0o600, gid: int | None = None, *, fsync: bool = True) -> tuple[Path, bool]:
        """Give the copy ``mode`` (capped at :data:`MAX_COPY_MODE`) and group ``gid`` (None: left as
        created) by :func:`stager.fs.access.give_group`, fsync it (unless ``fsync=False``:
        ``--no-fsync``) and close it, still under its partial name; return ``(partial path, whether
        the group could be given)``. Failure removes it and raises."""
        group_ok = True
        try:
            # fs/access.py's rule: the source's group, or (EPERM) a group class no wider than others.
            group_ok = give_group(self.fd, gid, stat.S_IMODE(mode) & MAX_COPY_MODE)
            if fsync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
        except BaseException as exc:
            self.fail(exc)
        return self.tmp, group_ok

    def publish(self, mode: int = 0o600, gid: int | None = None, *, fsync: bool = True,
                sync_dir: bool = False) -> bool:
        """:meth:`seal`, then rename over the final name (and fsync its directory with ``sync_dir``);
        return whether the group could be given. Failure removes the partial file and raises."""
        _, group_ok = self.seal(mode, gid, fsync=fsync)
        try:
            os.replace(self.tmp, self.final, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException as exc:
            self.fail(exc)
        if sync_dir:
            if self._within is not None:
                self._within.fsync()
            else:
                fsync_dir(self.final.parent)
        return group_ok

    def discard(self) -> None:
        """Close the copy (if open) and remove its partial file (if there)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp, dir_fd=self.dir_fd)

    def fail(self, exc: BaseException) -> NoReturn:
        """:meth:`discard`, then re-raise ``exc`` (disk full or quota: one-line OutOfSpaceError)."""
        self.discard()
        if isinstance(exc, OSError) and not isinstance(exc, StagerError):
            err = space_error(exc, self.shown)
            if err is not None:
                raise err from exc
        raise exc


def copy_verified(src: Readable | str | os.PathLike[str], final: str | os.PathLike[str], expect: Expected, *,
                  context: str, fix: str, buf: memoryview | None = None, direct: bool = False, window: int = -1,
                  on_block: Callable[[int], None] | None = None, within: SafeDir | None = None) -> PartialCopy:
    """Copy ``src`` to a partial file of ``final`` (inside ``within`` when given), hashing what is
    written, and verify it against ``expect``; return the verified copy, still open under its
    partial name: :meth:`PartialCopy.publish` (or :meth:`~PartialCopy.seal`) it.

    ``src``: a readable file object from its current position (``readinto``: a file, an fsspec
    file), or a path (opened here, links followed: a staged file may be a link into a cache).
    ``buf``: the stream's reused buffer (default 8 MiB); ``direct``: write with ``O_DIRECT`` where the
    file system takes it and ``buf`` is aligned (:func:`stager.fs.copy.aligned_buffer`, a multiple
    of :data:`~stager.fs.copy.DIRECT_ALIGN`); ``window``: write-behind window in bytes for buffered
    writes (-1: none; worth it only when the copy will be fsynced); ``on_block(n)`` after every block
    (progress, cancellation: raise to stop). Reading stops once more than ``expect.bytes`` arrived.
    A mismatch is the one :class:`VerificationError` (:func:`check` with ``context`` and ``fix``);
    on any failure nothing is left behind.
    """
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb", buffering=0) as f:
            return copy_verified(f, final, expect, context=context, fix=fix, buf=buf, direct=direct, window=window,
                                 on_block=on_block, within=within)
    view = buf if buf is not None else memoryview(bytearray(READ_CHUNK))
    part = PartialCopy(final, expect=expect, within=within, direct=direct and len(view) % DIRECT_ALIGN == 0)
    assert part.hasher is not None
    try:
        if part.direct:
            part.nbytes = copy_hashed_direct(src, part.fd, view, part.hasher, limit=expect.bytes, on_block=on_block)
        else:
            wb = WriteBehind(part.fd, window) if window >= 0 else None
            part.nbytes = copy_hashed(src, part.fd, view, part.hasher, limit=expect.bytes, write_behind=wb,
                                      on_block=on_block)
    except BaseException as exc:
        part.fail(exc)
    part.verify(context=context, fix=fix)
    return part


def verify_file(file: str | os.PathLike[str] | int, expect: Expected, *, buf: memoryview | None = None) -> str | None:
    """Hash an existing file (a path, links followed, or an open descriptor read from offset 0) and
    return :func:`mismatch` against ``expect``: None when it is what it should be. The re-check of
    something already written (``stager verify``, ``stager cache verify``). OSError when unreadable."""
    if not isinstance(file, int):
        with open(file, "rb", buffering=0) as f:
            return verify_file(f.fileno(), expect, buf=buf)
    view = buf if buf is not None else memoryview(bytearray(READ_CHUNK))
    h = new_hasher(expect.algo)
    total = 0
    while n := os.preadv(file, [view], total):
        h.update(view[:n])
        total += n
    return mismatch(expect, total, h.hexdigest())


__all__ = ["MAX_COPY_MODE", "Expected", "PartialCopy", "check", "copy_verified", "mismatch", "verify_file"]

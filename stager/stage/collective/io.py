"""Reading a node's share from SRC as one byte stream, and writing streams back into verified files.

:class:`ShareReader` fills fixed-size buffers from a :class:`~stager.stage.collective.plan.StreamLayout`
(files back to back), counting every byte it takes from SRC: that count is the figure "bytes read
from the shared file system" in the summary, and the one the tests check against an independent
counting file system. A file the reading node already holds verified in DEST is read from there
instead, so a resumed run does not touch SRC for it.

:class:`StreamSink` is the inverse: fed a stream's bytes in order, it writes each file as
``<name>.<uuid>.partial`` (see :mod:`stager.fs.atomic`), hashes while writing, and on the file's
last byte checks size and checksum against the manifest before renaming it to its final name.
Files the node already has are consumed and dropped. Memory: the caller's buffers only.
:func:`copy_share` joins the two without an exchange. ``stager stage --follow``'s prefetcher
(:mod:`stager.prefetch.prefetcher`) copies single shards with the same three.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from stager.checksum import Hasher, new_hasher
from stager.errors import ShardMissingError, VerificationError
from stager.fs.atomic import commit_partial, partial_path, space_error
from stager.fs.open import join, open_read
from stager.fs.remote import RemoteFile
from stager.stage.collective.plan import FileEntry, StreamLayout


@dataclass
class IoCounters:
    """Bytes moved by one node. ``src_bytes``: read from SRC; ``local_bytes``: re-read from DEST;
    ``received_bytes``: payload bytes that came from peers; ``written_bytes``: written into DEST."""

    src_bytes: int = 0
    local_bytes: int = 0
    received_bytes: int = 0
    written_bytes: int = 0
    files_written: int = 0


class ShareReader:
    """Yields a stream's bytes into caller buffers: ``fill(view) -> n`` (n < len(view) only at the end).

    ``src_dir`` is SRC's packed directory or its URL prefix (opened by :func:`~stager.fs.open.open_read`
    with ``storage_options``: remote reads are retried ranged GETs);
    ``local_have`` names files to read from ``dest`` instead.
    """

    def __init__(
        self,
        src_dir: str,
        dest: str | os.PathLike[str],
        layout: StreamLayout,
        *,
        counters: IoCounters,
        local_have: set[str] = frozenset(),  # type: ignore[assignment]
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.src_dir = src_dir
        self.dest = Path(dest)
        self.files = layout.files
        self.counters = counters
        self.local_have = local_have
        self.storage_options = storage_options or {}
        self._i = 0
        self._f: BinaryIO | None = None
        self._left = 0
        self._from_src = True

    def _open(self, entry: FileEntry) -> BinaryIO:
        if entry.name in self.local_have:
            self._from_src = False
            path = str(self.dest / entry.name)
            f: BinaryIO = open(path, "rb", buffering=0)  # noqa: SIM115 - closed in _next/close
            size = os.fstat(f.fileno()).st_size
        else:
            self._from_src = True
            path = join(self.src_dir, entry.name)
            try:
                f = open_read(path, self.storage_options)
            except FileNotFoundError:
                raise ShardMissingError(
                    f"{path}: listed in the manifest but missing in SRC; re-run `stager pack`"
                ) from None
            size = f.size if isinstance(f, RemoteFile) else os.fstat(f.fileno()).st_size
        if size != entry.bytes:
            f.close()
            raise VerificationError(
                f"{path}: {size} bytes, the manifest says {entry.bytes}; SRC was modified: re-run `stager pack`"
            )
        return f

    def fill(self, view: memoryview) -> int:
        """Copy the next ``len(view)`` stream bytes into ``view``; return how many (short only at the end)."""
        n = 0
        while n < len(view):
            if self._f is None:
                while self._i < len(self.files) and self.files[self._i].bytes == 0:
                    self._i += 1
                if self._i >= len(self.files):
                    break
                entry = self.files[self._i]
                self._f = self._open(entry)
                self._left = entry.bytes
            want = min(len(view) - n, self._left)
            got = _readinto(self._f, view[n : n + want])
            if not got:
                name = self.files[self._i].name
                raise VerificationError(
                    f"{self.src_dir}/{name}: ended {self._left} bytes early while reading; re-run `stager pack`"
                )
            n += got
            self._left -= got
            if self._from_src:
                self.counters.src_bytes += got
            else:
                self.counters.local_bytes += got
            if self._left == 0:
                self._f.close()
                self._f = None
                self._i += 1
        return n

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _readinto(f: Any, view: memoryview) -> int:
    """``f.readinto(view)``, or ``read`` + copy for file objects without it (some fsspec files)."""
    if hasattr(f, "readinto"):
        return int(f.readinto(view) or 0)
    data = f.read(len(view))
    view[: len(data)] = data
    return len(data)


class StreamSink:
    """Writes one node's stream into verified files under ``dest`` (see module docstring).

    ``have``: names already verified here (their bytes are dropped). ``on_verified(entry)`` runs
    after each file is renamed to its final name. ``origin`` names the stream's sender in errors.
    """

    def __init__(
        self,
        dest: str | os.PathLike[str],
        layout: StreamLayout,
        *,
        algo: str,
        counters: IoCounters,
        have: set[str],
        on_verified: Callable[[FileEntry], None] | None = None,
        origin: str = "",
        from_peer: bool = False,
    ) -> None:
        self.dest = Path(dest)
        self.files = layout.files
        self.algo = algo
        self.counters = counters
        self.have = have
        self.on_verified = on_verified
        self.origin = origin
        self.from_peer = from_peer
        self._i = 0
        self._off = 0
        self._fd: int | None = None
        self._tmp: Path | None = None
        self._h: Hasher | None = None
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._i >= len(self.files)

    def feed(self, data: memoryview) -> None:
        """Consume the next ``len(data)`` bytes of the stream (bytes past its end are padding)."""
        pos = 0
        while self._i < len(self.files) and (pos < len(data) or self.files[self._i].bytes == self._off):
            entry = self.files[self._i]
            take = min(entry.bytes - self._off, len(data) - pos)
            if self.from_peer:
                self.counters.received_bytes += take
            if entry.name not in self.have:
                if self._fd is None:
                    self._start(entry)
                piece = data[pos : pos + take]
                self._write(piece)
                assert self._h is not None
                self._h.update(piece)
            pos += take
            self._off += take
            if self._off == entry.bytes:
                if entry.name not in self.have:
                    if self._fd is None:  # an empty file
                        self._start(entry)
                    self._finish(entry)
                self._i += 1
                self._off = 0

    def _start(self, entry: FileEntry) -> None:
        final = self.dest / entry.name
        self._tmp = partial_path(final)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._h = new_hasher(self.algo)

    def _write(self, piece: memoryview) -> None:
        assert self._fd is not None
        try:
            while piece:
                n = os.write(self._fd, piece)
                piece = piece[n:]
                self.counters.written_bytes += n
        except OSError as exc:
            self.abort()
            err = space_error(exc, self.dest / self.files[self._i].name)
            if err is not None:
                raise err from exc
            raise

    def _finish(self, entry: FileEntry) -> None:
        assert self._fd is not None and self._tmp is not None and self._h is not None
        got = self._h.hexdigest()
        if got != entry.hash:
            self.abort()
            raise VerificationError(
                f"{self.dest / entry.name}: {self.algo} mismatch after transfer{self.origin} "
                f"(expected {entry.hash}, got {got}); rerun to fetch it again (verified files are kept)"
            )
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        commit_partial(self._tmp, self.dest / entry.name)
        self._tmp = None
        self.counters.files_written += 1
        self.have.add(entry.name)
        if self.on_verified is not None:
            self.on_verified(entry)

    def abort(self) -> None:
        """Close and delete the file being written (nothing half-written stays under a final name)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            self._tmp = None


def copy_share(reader: ShareReader, sink: StreamSink, chunk: int) -> None:
    """Copy a stream straight from ``reader`` into ``sink`` (the no-exchange path: a partition share)."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    try:
        while True:
            n = reader.fill(view)
            if n:
                sink.feed(view[:n])
            if n < chunk:
                break
        sink.feed(view[:0])  # trailing empty files
    finally:
        reader.close()
        sink.abort()

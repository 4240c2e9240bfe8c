"""Reading a node's share from SRC as one byte stream, and writing streams back into verified files.

:class:`ShareReader` fills fixed-size buffers from a :class:`~stager.stage.collective.plan.StreamLayout`
(files back to back), counting every byte it takes from SRC: that count is the figure "bytes read
from the shared file system" in the summary, and the one the tests check against an independent
counting file system. A file the reading node already holds verified in DEST is read from there
instead, so a resumed run does not touch SRC for it.

:class:`StreamSink` is the inverse: fed a stream's bytes in order, it writes each file with the one
verified copy (:class:`stager.fs.verified.PartialCopy`: ``<name>.<uuid>.partial``, hashed while
written), and on the file's last byte checks size and checksum against the manifest before giving
it SRC's access (the plain stage's rule), fsyncing it and renaming it to its final name. Files the
node already has are consumed and dropped. Memory: the caller's buffers only.
:func:`copy_share` joins the two without an exchange. ``stager stage --follow``'s prefetcher
(:mod:`stager.prefetch.prefetcher`) copies single shards with the same three.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from stager.errors import ShardMissingError, VerificationError
from stager.fs.access import copy_mode
from stager.fs.open import join, open_read
from stager.fs.remote import RemoteFile
from stager.fs.verified import Expected, PartialCopy
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
    ``access``: the ``(mode, gid)`` each file gets before its rename (SRC's, by
    :func:`~stager.fs.access.source_access`; default: what :func:`~stager.fs.access.copy_mode`
    gives a world-readable source, and our group).
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
        access: tuple[int, int | None] | None = None,
    ) -> None:
        self.dest = Path(dest)
        self.files = layout.files
        self.algo = algo
        self.counters = counters
        self.have = have
        self.on_verified = on_verified
        self.origin = origin
        self.from_peer = from_peer
        self.access = access if access is not None else (copy_mode(0o644), None)
        self._i = 0
        self._off = 0
        self._part: PartialCopy | None = None
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
                if self._part is None:
                    self._start(entry)
                self._write(data[pos : pos + take])
            pos += take
            self._off += take
            if self._off == entry.bytes:
                if entry.name not in self.have:
                    if self._part is None:  # an empty file
                        self._start(entry)
                    self._finish(entry)
                self._i += 1
                self._off = 0

    def _start(self, entry: FileEntry) -> None:
        final = self.dest / entry.name
        self._part = PartialCopy(final, expect=Expected(str(final), entry.bytes, entry.hash, self.algo))

    def _write(self, piece: memoryview) -> None:
        part = self._part
        assert part is not None
        self._part = None  # a failed write removes the partial file itself
        part.write(piece)
        self._part = part
        self.counters.written_bytes += len(piece)

    def _finish(self, entry: FileEntry) -> None:
        part, self._part = self._part, None
        assert part is not None
        part.verify(context=f" after transfer{self.origin}", fix="rerun to fetch it again (verified files are kept)")
        part.publish(*self.access, sync_dir=True)
        self.counters.files_written += 1
        self.have.add(entry.name)
        if self.on_verified is not None:
            self.on_verified(entry)

    def abort(self) -> None:
        """Close and delete the file being written (nothing half-written stays under a final name)."""
        part, self._part = self._part, None
        if part is not None:
            part.discard()


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

"""Reading and writing objects of an fsspec filesystem, every request under the retry policy.

What :mod:`stager.fs.open` hands out for URLs. Reads are ranged GETs of at most the caller's
buffer (8 MiB for ``stage``): :func:`read_range` asks for ``[start, end)`` and, when a response
ends early (a connection cut mid-body), asks again for the rest from the offset reached, so a
flaky server still delivers every byte once; an error before any byte arrives is retried with
backoff (:mod:`stager.fs.retry`). A server that ignores ``Range`` (answers more than asked) is an
error, not something to stream around. :class:`RemoteFile` is a read-only file object over
:func:`read_range` whose size is asked once (one HEAD).

Writes are whole objects: :func:`upload_file` streams a local file up in ``part_size`` pieces
(a multipart upload on S3, blocks on Azure: memory is one part, whatever the file's size) and
:func:`put_bytes` writes a small object. On a store whose objects appear only complete (an S3 PUT
or completed multipart upload, an Azure block list commit, a GCS upload: ``atomic``), the object is
written under its final name; elsewhere (``file://``, ``memory://``) under ``<name>.<uuid>.partial``
and then moved. A failed upload is aborted (nothing appears) and, if transient, started again.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

from stager.errors import StagerError
from stager.fs.retry import Attempts, RetryPolicy, is_transient, with_retries

DEFAULT_PART = 8 << 20  # bytes per uploaded part (S3's minimum is 5 MiB)


def _timeout_kw(fs: Any, policy: RetryPolicy) -> dict[str, float]:
    """fsspec's per-call deadline for async filesystems (a stalled response then raises FSTimeoutError)."""
    return {"timeout": policy.timeout} if getattr(fs, "async_impl", False) and policy.timeout > 0 else {}


def object_size(fs: Any, path: str, url: str, policy: RetryPolicy | None = None) -> int:
    """The size of the object at ``path`` (FileNotFoundError when there is none)."""
    policy = policy or RetryPolicy.from_env()
    return int(with_retries(lambda: fs.size(path), url, "HEAD", policy))


def object_info(fs: Any, path: str, url: str, policy: RetryPolicy | None = None) -> dict[str, Any]:
    """fsspec's ``info`` of ``path`` (size, and an ``ETag`` on object stores)."""
    policy = policy or RetryPolicy.from_env()
    return dict(with_retries(lambda: fs.info(path), url, "HEAD", policy))


def read_range(fs: Any, path: str, start: int, end: int, url: str, *, policy: RetryPolicy | None = None) -> bytes:
    """Bytes ``[start, end)`` of the object at ``path``; every byte arrives once (see the module docstring).

    Raises FileNotFoundError for a missing object, :class:`~stager.errors.RemoteUnavailableError`
    (exit 5) when the retries run out, :class:`StagerError` when the server ignores ``Range``. A
    response that ends before ``end`` because the object ends there is returned short: the
    caller knows the size it expects.
    """
    policy = policy or RetryPolicy.from_env()
    attempts = Attempts(policy, url, f"GET bytes {start}-{end - 1}")
    pieces: list[bytes] = []
    pos = start
    kw = _timeout_kw(fs, policy)
    while pos < end:
        try:
            got = fs.cat_file(path, start=pos, end=end, **kw)
        except Exception as exc:
            if not is_transient(exc):
                raise
            attempts.failed(exc)
            continue
        if len(got) > end - pos:
            raise StagerError(
                f"{url}: asked for {end - pos} bytes at offset {pos}, got {len(got)}: the server ignores Range "
                "requests; serve the pack from one that honours them (or stage it with another tool first)"
            )
        if not got:
            # Nothing at all: past the object's end (the caller checks sizes), or a cut before any byte.
            if pos == start and not attempts.total_failures:
                break
            attempts.failed(ConnectionResetError(f"empty response at offset {pos}"))
            continue
        pieces.append(got)
        pos += len(got)
        attempts.progressed()
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class RemoteFile:
    """A read-only, seekable file object over ranged GETs (:func:`read_range`).

    ``size`` is the object's size if the caller knows it, else asked once (HEAD). Each
    :meth:`readinto` is one ranged read of at most ``len(buffer)`` bytes; :meth:`read` without a
    size reads to the end.
    """

    def __init__(self, fs: Any, path: str, url: str, *, size: int | None = None,
                 policy: RetryPolicy | None = None) -> None:
        self.fs, self.path, self.url = fs, path, url
        self.policy = policy or RetryPolicy.from_env()
        self.size = object_size(fs, path, url, self.policy) if size is None else size
        self.pos = 0
        self.closed = False

    def readinto(self, view: memoryview | bytearray) -> int:
        n = min(len(view), self.size - self.pos)
        if n <= 0:
            return 0
        data = read_range(self.fs, self.path, self.pos, self.pos + n, self.url, policy=self.policy)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        data = read_range(self.fs, self.path, self.pos, end, self.url, policy=self.policy)
        self.pos += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _temp_name(path: str) -> str:
    return f"{path}.{uuid.uuid4().hex[:12]}.partial"


def _stream_up(fs: Any, path: str, local: str, part_size: int) -> None:
    """Write the object ``path`` from the local file ``local``, ``part_size`` bytes at a time.

    On any error the upload is abandoned (S3: the multipart upload aborted) without committing.
    """
    f = fs.open(path, "wb", block_size=max(part_size, 5 << 20))
    try:
        with open(local, "rb") as src:
            while chunk := src.read(part_size):
                f.write(chunk)
        f.close()
    except BaseException:
        with contextlib.suppress(Exception):
            f.discard()
        f.closed = True  # never let close() (or __del__) commit what was written so far
        raise


def upload_file(fs: Any, local: str, path: str, url: str, *, atomic: bool, part_size: int = DEFAULT_PART,
                policy: RetryPolicy | None = None) -> None:
    """Upload the local file ``local`` to ``path`` (see the module docstring); retried as a whole."""
    policy = policy or RetryPolicy.from_env()
    if atomic:
        with_retries(lambda: _stream_up(fs, path, local, part_size), url, "upload", policy)
        return
    tmp = _temp_name(path)
    try:
        with_retries(lambda: _stream_up(fs, tmp, local, part_size), url, "upload", policy)
        with_retries(lambda: fs.mv(tmp, path), url, "rename", policy)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(tmp)
        raise


def put_bytes(fs: Any, path: str, data: bytes, url: str, *, atomic: bool, policy: RetryPolicy | None = None) -> None:
    """Write ``data`` as the object ``path`` (whole or not at all: see the module docstring)."""
    policy = policy or RetryPolicy.from_env()
    if atomic:
        with_retries(lambda: fs.pipe_file(path, data), url, "PUT", policy)
        return
    tmp = _temp_name(path)
    try:
        with_retries(lambda: fs.pipe_file(tmp, data), url, "PUT", policy)
        with_retries(lambda: fs.mv(tmp, path), url, "rename", policy)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(tmp)
        raise


def remove(fs: Any, path: str, url: str, policy: RetryPolicy | None = None) -> None:
    """Delete the object ``path``; a missing one is fine."""
    def rm() -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(path)
    with_retries(rm, url, "DELETE", policy or RetryPolicy.from_env())


def list_names(fs: Any, prefix: str, url: str, policy: RetryPolicy | None = None) -> list[str]:
    """Names (relative to ``prefix``, ``/``-separated) of every object under ``prefix``; [] if none."""
    def find() -> list[str]:
        fs.invalidate_cache(prefix)
        try:
            found = fs.find(prefix)
        except FileNotFoundError:
            return []
        root = prefix.rstrip("/") + "/"
        return sorted(p[len(root):] for p in found if p.startswith(root))
    return with_retries(find, url, "LIST", policy or RetryPolicy.from_env())

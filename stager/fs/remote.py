"""Reading and writing objects of an fsspec filesystem, every request under the retry policy.

What :mod:`stager.fs.open` hands out for URLs. Reads are ranged GETs of at most the caller's
buffer (8 MiB for ``stage``): :func:`read_range` asks for ``[start, end)`` and, when a response
ends early (a connection cut mid-body), asks again for the rest from the offset reached, so a
flaky server still delivers every byte once; an error before any byte arrives is retried with
backoff (:mod:`stager.fs.retry`). A server that ignores ``Range`` (answers more than asked) is an
error, not something to stream around. :class:`RemoteFile` is a read-only file object over
:func:`read_range_into` (each ``readinto`` fills the caller's buffer directly) whose size is asked
once (one HEAD).

On S3 and HTTP the response body is read in pieces into one buffer, so the bytes that arrived
before a cut are kept and the retry asks only for the rest; a piece that does not arrive within
``$STAGER_REQUEST_TIMEOUT`` seconds is a stall (the request is cancelled and retried; the wait
for a response's headers is bounded by the library's own timeouts: botocore's ``read_timeout``,
aiohttp's). Other backends answer a range whole or fail (``cat_file``, under fsspec's deadline).

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

from stager.errors import RemoteAccessError
from stager.fs.retry import Attempts, RetryPolicy, is_transient, permanent_error, with_retries

DEFAULT_PART = 8 << 20  # bytes per uploaded part (S3's minimum is 5 MiB)
STREAM_PIECE = 1 << 20  # most bytes asked of a streamed response body per read (it hands over what has arrived)


def object_size(fs: Any, path: str, url: str, policy: RetryPolicy | None = None) -> int:
    """The size of the object at ``path`` (FileNotFoundError when there is none)."""
    policy = policy or RetryPolicy.from_env()
    return int(with_retries(lambda: fs.size(path), url, "HEAD", policy))


def object_info(fs: Any, path: str, url: str, policy: RetryPolicy | None = None) -> dict[str, Any]:
    """fsspec's ``info`` of ``path`` (size, and an ``ETag`` on object stores)."""
    policy = policy or RetryPolicy.from_env()
    return dict(with_retries(lambda: fs.info(path), url, "HEAD", policy))


class _Sink:
    """Where the pieces of one ranged read go: ``view`` filled from the front, ``n`` bytes so far.

    Preallocated by the caller (appending to a growing bytearray copies the data over and over);
    ``n`` survives an exception, so a retry asks only for the rest.
    """

    def __init__(self, view: memoryview) -> None:
        self.view, self.n = view, 0
        self.overflow = False  # the server sent more than asked: it ignores Range

    def add(self, piece: bytes | bytearray | memoryview) -> None:
        k = len(piece)
        if self.n + k > len(self.view):
            self.overflow = True
            raise _RangeIgnoredError()
        self.view[self.n:self.n + k] = piece
        self.n += k


class _RangeIgnoredError(Exception):
    pass


def read_range(fs: Any, path: str, start: int, end: int, url: str, *, policy: RetryPolicy | None = None) -> bytes:
    """Bytes ``[start, end)`` of the object at ``path`` (see :func:`read_range_into`)."""
    out = bytearray(end - start)
    read_range_into(fs, path, start, memoryview(out), url, policy=policy)
    return bytes(out)


def read_range_into(fs: Any, path: str, start: int, view: memoryview, url: str, *,
                    policy: RetryPolicy | None = None) -> None:
    """Fill ``view`` with bytes ``[start, start + len(view))`` of ``path``; every byte arrives once.

    The range must not pass the object's end (callers know its size: the manifest's, or one HEAD),
    so a response that ends early is a cut, resumed from where it stopped. Raises
    FileNotFoundError for a missing object, :class:`~stager.errors.RemoteUnavailableError` (exit 5)
    when the retries run out, :class:`RemoteAccessError` when the server ignores ``Range``.
    """
    policy = policy or RetryPolicy.from_env()
    end = start + len(view)
    attempts = Attempts(policy, url, f"GET bytes {start}-{end - 1}")
    sink = _Sink(view)
    while sink.n < len(view):
        before = sink.n
        try:
            _fetch_into(fs, path, (start + before, end), sink, policy.timeout)
        except _RangeIgnoredError:
            pass
        except Exception as exc:
            if not is_transient(exc):
                err = permanent_error(exc, url, "GET")
                if err is exc:
                    raise
                raise err from exc
            if sink.n > before:
                attempts.progressed()  # bytes arrived before the cut: go on from there
            else:
                attempts.failed(exc)
            continue
        if sink.overflow:
            raise RemoteAccessError(
                f"{url}: asked for {end - start - before} bytes at offset {start + before}, got more: the server "
                "ignores Range requests; serve the pack from one that honours them (or copy it with another tool)"
            )
        if sink.n > before:
            attempts.progressed()
        else:  # callers ask only for bytes the object has (they know its size): nothing back is a fault
            attempts.failed(ConnectionResetError(f"empty response at offset {start + before}"))


def _fetch_into(fs: Any, path: str, span: tuple[int, int], sink: _Sink, timeout: float) -> None:
    """Add bytes ``span`` = ``[start, end)`` of ``path`` to ``sink`` as they arrive.

    On S3 and HTTP the body is streamed in pieces, so what arrived before a cut stays in ``sink``
    and the caller resumes from there; a piece that takes more than ``timeout`` seconds is a stall
    (TimeoutError). Other filesystems answer whole (``cat_file``) or not at all.
    """
    kind = type(fs).__name__
    streams = {"S3FileSystem": ("_call_s3", "split_path"), "HTTPFileSystem": ("set_session", "encode_url")}
    if kind in streams and getattr(fs, "async_impl", False) and all(hasattr(fs, a) for a in streams[kind]):
        from fsspec.asyn import sync  # noqa: PLC0415 (fsspec only for URLs)

        stream = _s3_stream if kind == "S3FileSystem" else _http_stream
        sync(fs.loop, stream, fs, path, span, sink, timeout or None)
        return
    kw = {"timeout": timeout} if getattr(fs, "async_impl", False) and timeout > 0 else {}
    sink.add(fs.cat_file(path, start=span[0], end=span[1], **kw))


async def _read_pieces(read: Any, sink: _Sink, timeout: float | None) -> None:
    """``await read()`` until the body ends (``b""``), adding each piece to ``sink``; a piece that takes
    more than ``timeout`` seconds raises TimeoutError (a stall)."""
    import asyncio  # noqa: PLC0415 (only for streamed URL reads: ~20 ms the CLI's start-up never needs)

    if timeout is None or not hasattr(asyncio, "timeout_at"):  # Python 3.10: a task per piece
        while piece := await asyncio.wait_for(read(), timeout):
            sink.add(piece)
        return
    loop = asyncio.get_running_loop()
    async with asyncio.timeout_at(loop.time() + timeout) as deadline:  # one deadline, moved on at each piece
        while piece := await read():
            sink.add(piece)
            deadline.reschedule(loop.time() + timeout)


def _pieces_of(content: Any, fallback: Any) -> Any:
    """The reader of a response body's pieces as they arrived: aiohttp's ``readany`` hands over each
    received chunk as it is (``read(n)`` joins chunks into a new ``n``-byte object first: a copy, and a
    fresh allocation the kernel must fault in, per MiB), else ``fallback``."""
    readany = getattr(content, "readany", None)
    return readany if readany is not None else fallback


async def _s3_stream(fs: Any, path: str, span: tuple[int, int], sink: _Sink, timeout: float | None) -> None:
    start, end = span
    bucket, key, version = fs.split_path(path)
    kw = {"VersionId": version} if version else {}
    # The response's start is bounded by botocore's own timeouts (and s3fs/botocore retry it inside);
    # the body, piece by piece, by ours.
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **kw, **fs.req_kw)
    body = resp["Body"]
    try:
        content = getattr(getattr(body, "_raw_stream", None), "content", None)  # aiobotocore's aiohttp response
        await _read_pieces(_pieces_of(content, lambda: body.read(STREAM_PIECE)), sink, timeout)
    finally:
        body.close()


async def _http_stream(fs: Any, url: str, span: tuple[int, int], sink: _Sink, timeout: float | None) -> None:
    start, end = span
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
        if r.status == 404:
            raise FileNotFoundError(url)
        r.raise_for_status()
        if r.status == 200 and (r.content_length or 0) > end - start:
            sink.overflow = True  # the whole object came back: reported by read_range_into
            return
        await _read_pieces(_pieces_of(r.content, lambda: r.content.read(STREAM_PIECE)), sink, timeout)


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
        read_range_into(self.fs, self.path, self.pos, memoryview(view)[:n], self.url, policy=self.policy)
        self.pos += n
        return n

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


def stream_to(src: Any, out: Any | None, hasher: Any | None = None, block: int = DEFAULT_PART) -> int:
    """Read ``src`` (a :class:`RemoteFile` or any file with ``readinto``) to its end in ``block``-byte
    ranged reads into one reused buffer, writing each block to ``out`` (a binary file, or None) and
    feeding ``hasher`` (or None); returns the bytes read."""
    buf = memoryview(bytearray(block))
    total = 0
    while n := src.readinto(buf):
        piece = buf[:n]
        if hasher is not None:
            hasher.update(piece)
        if out is not None:
            out.write(piece)
        total += n
    return total


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

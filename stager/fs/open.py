"""One way to open what a user names: a local path or an fsspec URL, with the user's storage options.

Every read of a path-or-URL in stager goes through here (manifests, shards for ``stage``, the
collective reader, the loader's remote reads), so the ``storage_options`` a command was given reach
every open, not only the first. Local paths are opened unbuffered with ``POSIX_FADV_SEQUENTIAL``
for streaming reads; URLs through :func:`fsspec.core.url_to_fs` (imported only when a URL is used).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any


def is_url(path: str | os.PathLike[str]) -> bool:
    """``path`` names an fsspec URL (``s3://...``, ``https://...``, ``file://...``), not a local path."""
    return "://" in os.fspath(path)


def join(root: str, name: str) -> str:
    """``name`` inside ``root``: ``/`` for URLs, the OS separator for paths."""
    if is_url(root):
        return root.rstrip("/") + "/" + name
    return os.path.join(root, name)


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` for ``url`` with ``storage_options``."""
    import fsspec  # noqa: PLC0415 (fsspec only for URLs (~50 ms to import))

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, str(path)


def open_read(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
              *, sequential: bool = True) -> Any:
    """Open ``path`` (local path or URL) for reading bytes; the caller closes it.

    A binary file object with ``read``/``readinto`` (``io.FileIO`` locally, an fsspec file for URLs).
    Local files are unbuffered (callers read big blocks with ``readinto``) and, with ``sequential``,
    advised ``POSIX_FADV_SEQUENTIAL``. Raises FileNotFoundError when it does not exist.
    """
    p = os.fspath(path)
    if is_url(p):
        fs, fp = filesystem(p, storage_options)
        return fs.open(fp, "rb")
    f = open(p, "rb", buffering=0)  # noqa: SIM115 - returned to the caller, who closes it
    if sequential:
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return f


def read_bytes(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
               limit: int | None = None) -> bytes:
    """The bytes of ``path`` (at most ``limit`` + 1 when given, so a caller can refuse oversized input)."""
    with open_read(path, storage_options, sequential=False) as f:
        return f.read() if limit is None else f.read(limit + 1)

"""One way to open what a user names: a local path or a URL, with the user's storage options.

Every read and write of a path-or-URL in stager goes through here (manifests, shards for
``stage``, the collective reader, the loader's remote reads, ``pack`` to an object store, ``verify``
and ``inspect`` of a URL), so the ``storage_options`` a command was given reach every open, not
only the first, and every remote request runs under one retry policy (:mod:`stager.fs.retry`).

The scheme table (:data:`BACKENDS`, as fsspec's ``registry.py`` and webdataset's ``gopen``): for
each URL scheme, the packages its fsspec implementation needs, the ``stager[...]`` extra that
installs them, whether an object written there appears only complete (``atomic``: S3, Azure and GCS
uploads), and the environment it takes defaults from. A URL whose backend is missing is a one-line
:class:`~stager.errors.MissingBackendError` (exit 2) naming the extra; fsspec is imported only when
a URL is used. Local paths are opened unbuffered with ``POSIX_FADV_SEQUENTIAL`` for streaming reads.

Storage options: the API's ``storage_options=`` dict, or the CLI's repeatable ``--storage-option
KEY=VALUE`` (:func:`parse_storage_options`: dotted keys nest, values are JSON where they parse).
Explicit options win over the environment: each backend's libraries read their own variables
(S3: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_DEFAULT_REGION``, ``AWS_CA_BUNDLE``; Azure: ``AZURE_STORAGE_CONNECTION_STRING``,
``AZURE_STORAGE_ACCOUNT_NAME``, ...), and ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` are passed
on explicitly so that an S3-compatible store (Ceph, MinIO) is reached whatever the botocore version.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stager.errors import MissingBackendError, UsageError, install_hint
from stager.fs.safe import open_regular


def _s3_env(env: Mapping[str, str], given: Mapping[str, Any]) -> dict[str, Any]:
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if not endpoint or "endpoint_url" in given:
        return {}
    return {"client_kwargs": {"endpoint_url": endpoint}}


def _no_env(env: Mapping[str, str], given: Mapping[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Backend:
    """One family of URL schemes: what it needs installed and how its writes behave."""

    schemes: tuple[str, ...]
    modules: tuple[str, ...]  # importable names the fsspec implementation needs
    extra: str | None  # the checkout's extra (``pip install -e '.[<extra>]'``); None: none ships one
    packages: str  # pip names, for the message
    atomic: bool  # an object appears only complete (no temporary name needed)
    env: Callable[[Mapping[str, str], Mapping[str, Any]], dict[str, Any]] = _no_env


BACKENDS: tuple[Backend, ...] = (
    Backend(("s3", "s3a"), ("s3fs",), "s3", "s3fs", True, _s3_env),
    Backend(("http", "https"), ("aiohttp", "requests"), "http", "aiohttp requests", True),
    Backend(("az", "abfs", "abfss"), ("adlfs",), "azure", "adlfs", True),  # block list commit: atomic
    Backend(("gs", "gcs"), ("gcsfs",), None, "gcsfs", True),
    Backend(("file", "local"), (), None, "", False),
    Backend(("memory",), (), None, "", False),
)
_BY_SCHEME = {s: b for b in BACKENDS for s in b.schemes}
_GENERIC = Backend((), (), None, "", False)  # any other fsspec protocol: fsspec's own checks apply


def is_url(path: str | os.PathLike[str]) -> bool:
    """``path`` names a URL (``s3://...``, ``https://...``, ``file://...``), not a local path."""
    return "://" in os.fspath(path)


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if is_url(url) else ""


def backend_of(url: str) -> Backend:
    """The :class:`Backend` of ``url``'s scheme (a generic one for schemes not in the table)."""
    return _BY_SCHEME.get(scheme_of(url), _GENERIC)


def local_path_of(path: str | os.PathLike[str]) -> str | None:
    """The local path ``path`` names (a plain path, or a ``file://`` URL), else None."""
    p = os.fspath(path)
    if not is_url(p):
        return p
    if scheme_of(p) in ("file", "local"):
        return p.split("://", 1)[1]
    return None


def join(root: str, name: str) -> str:
    """``name`` inside ``root``: ``/`` for URLs, the OS separator for paths."""
    if is_url(root):
        return root.rstrip("/") + "/" + name
    return os.path.join(root, name)


def require_backend(url: str) -> Backend:
    """``url``'s backend, or a one-line :class:`MissingBackendError` (exit 2) naming what to install."""
    b = backend_of(url)
    missing = [m for m in b.modules if importlib.util.find_spec(m) is None]
    if missing:
        how = install_hint(b.packages, b.extra)
        raise MissingBackendError(
            f"{url}: {scheme_of(url)}:// URLs need {', '.join(missing)} (not installed); run: {how}"
        )
    return b


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``over``, nested dicts merged (``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def effective_options(url: str, storage_options: Mapping[str, Any] | None = None,
                      env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options ``url`` is opened with: the backend's environment defaults, then the caller's."""
    given = copy.deepcopy(dict(storage_options or {}))
    return _merge(backend_of(url).env(os.environ if env is None else env, given), given)


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` for ``url`` with ``storage_options``.

    Raises :class:`MissingBackendError` (the extra to install) and :class:`UsageError` (a scheme
    fsspec does not know, options the backend refuses).
    """
    require_backend(url)
    import fsspec  # noqa: PLC0415 (fsspec only for URLs (~50 ms to import))

    try:
        fs, path = fsspec.core.url_to_fs(url, **effective_options(url, storage_options))
    except ImportError as exc:
        raise MissingBackendError(f"{url}: {exc}".splitlines()[0]) from exc
    except (ValueError, TypeError) as exc:
        if "protocol" in str(exc).lower() and "known" in str(exc).lower():
            raise UsageError(f"{url}: unknown URL scheme {scheme_of(url)!r}; expected a local path or one of "
                             f"{', '.join(sorted(_BY_SCHEME))}") from exc
        raise UsageError(f"{url}: cannot open with the given storage options ({exc})".splitlines()[0]) from exc
    return fs, str(path)


def open_read(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
              *, sequential: bool = True, size: int | None = None) -> Any:
    """Open ``path`` (local path or URL) for reading bytes; the caller closes it.

    A binary file object with ``read``/``readinto``: ``io.FileIO`` locally (unbuffered: callers
    read big blocks with ``readinto``; with ``sequential``, advised ``POSIX_FADV_SEQUENTIAL``), a
    :class:`~stager.fs.remote.RemoteFile` for URLs (each ``readinto`` one retried ranged GET; its
    size is asked once unless ``size`` is given). Raises FileNotFoundError when it does not exist,
    IsADirectoryError for a directory and :class:`~stager.errors.UnsafePathError` for anything else
    that is not a regular file (a FIFO never blocks: :func:`stager.fs.safe.open_regular`).
    """
    p = os.fspath(path)
    local = local_path_of(p)
    if local is None:
        from stager.fs.remote import RemoteFile  # noqa: PLC0415 (URLs only: a local stage never loads it)

        fs, fp = filesystem(p, storage_options)
        return RemoteFile(fs, fp, p, size=size)
    # Not a bare open(): a FIFO or a device planted as a shard would block it or never end.
    f = io.FileIO(open_regular(local), "rb", closefd=True)
    f.name = local
    if sequential:
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return f


def read_bytes(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None,
               limit: int | None = None) -> bytes:
    """The bytes of ``path`` (at most ``limit`` + 1 when given, so a caller can refuse oversized input)."""
    p = os.fspath(path)
    if local_path_of(p) is None:
        from stager.fs.remote import object_size, read_range  # noqa: PLC0415 (URLs only)

        fs, fp = filesystem(p, storage_options)
        size = object_size(fs, fp, p)
        end = size if limit is None else min(size, limit + 1)
        return read_range(fs, fp, 0, end, p) if end else b""
    with open_read(p, storage_options, sequential=False) as f:
        return f.read() if limit is None else f.read(limit + 1)


def exists(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``path`` (local path or URL) names an existing file or object."""
    p = os.fspath(path)
    local = local_path_of(p)
    if local is not None:
        return os.path.exists(local)
    from stager.fs.retry import with_retries  # noqa: PLC0415 (URLs only)

    fs, fp = filesystem(p, storage_options)
    return bool(with_retries(lambda: fs.exists(fp), p, "HEAD"))


# ---- storage options from the command line ---------------------------------------------------------
def _value(text: str) -> Any:
    """A JSON value where ``text`` is one (``true``, ``3``, ``{"a": 1}``, ``"x"``), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_storage_options(items: Iterable[str]) -> dict[str, Any]:
    """``["client_kwargs.endpoint_url=http://h:9000", "anon=true"]`` -> nested dict.

    Dotted keys nest (``config_kwargs.retries.max_attempts=2``); values are JSON where they parse
    (``true``, ``2``, ``null``, ``{...}``), else strings. Raises :class:`UsageError` naming the item.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise UsageError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. client_kwargs.endpoint_url=http://host:9000")
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise UsageError(f"--storage-option {item!r}: {part!r} was already given a value")
            node = nxt
        node[parts[-1]] = _value(text)
    return out

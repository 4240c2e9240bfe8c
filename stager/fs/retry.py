"""Retries with exponential backoff and full jitter for requests to object stores and HTTP servers.

One policy for every remote request stager makes (:mod:`stager.fs.remote`): a request that fails
with a *transient* error (:func:`is_transient`: reset or refused connections, timeouts and stalls,
a body cut short, HTTP 5xx, 408/429, S3's ``SlowDown``/``InternalError``/``ServiceUnavailable``) is
tried again after ``uniform(0, min(cap, base * 2**k))`` seconds (AWS's "full jitter": concurrent
clients that failed together do not come back together); anything else (404, 403, a bad request)
is raised at once. When ``attempts`` tries in a row made no progress, the last error becomes a
one-line :class:`~stager.errors.RemoteUnavailableError` (exit 5) naming the URL.

The policy's numbers come from the environment, read once per call of :meth:`RetryPolicy.from_env`:
``STAGER_RETRIES`` (attempts, default 8), ``STAGER_RETRY_BASE`` (seconds, default 0.25),
``STAGER_RETRY_CAP`` (seconds, default 20) and ``STAGER_REQUEST_TIMEOUT`` (seconds without a byte
of a response body before the request counts as stalled, default 120).
"""

from __future__ import annotations

import errno
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from stager.errors import RemoteAccessError, RemotePermissionError, RemoteUnavailableError, StagerError, UsageError

T = TypeVar("T")

RETRIES_ENV = "STAGER_RETRIES"
BASE_ENV = "STAGER_RETRY_BASE"
CAP_ENV = "STAGER_RETRY_CAP"
TIMEOUT_ENV = "STAGER_REQUEST_TIMEOUT"

# Exception class names (anywhere in an error's cause chain) that mean "try again": connection and
# stream failures of aiohttp, botocore, http.client and fsspec, matched by name so that this module
# imports none of them.
TRANSIENT_NAMES = frozenset({
    "ClientPayloadError", "ClientConnectionError", "ClientOSError", "ServerDisconnectedError",
    "ServerTimeoutError", "ClientConnectorError", "ContentLengthError", "TransferEncodingError",
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "IncompleteReadError", "ResponseStreamingError", "ProxyConnectionError", "HTTPClientError",
    "IncompleteRead", "RemoteDisconnected", "FSTimeoutError", "ChunkedEncodingError",
})
# Error codes of an S3-style error response that mean "try again".
TRANSIENT_CODES = frozenset({
    "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling", "ThrottlingException",
    "RequestLimitExceeded", "TooManyRequestsException", "ServerBusy", "OperationTimedOut",
})
TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
                              errno.ETIMEDOUT, errno.EBUSY, errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH})
# Permanent by nature, whatever else the chain says.
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StagerError)


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status an error carries (aiohttp's ``status``, botocore's response metadata)."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is worth a retry; see the module docstring."""
    if isinstance(exc, PERMANENT):
        return False
    for e in _chain(exc):
        if isinstance(e, PERMANENT) and e is not exc:
            return False
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in TRANSIENT_NAMES:
            return True
        status = _status_of(e)
        if status is not None and (status >= 500 or status in (408, 429)):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in TRANSIENT_CODES:
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
        if any(code in str(e) for code in ("SlowDown", "ServiceUnavailable", "InternalError")):
            return True
    return False


def _env_float(name: str, default: float) -> float:
    """``$name`` as a non-negative number, ``default`` when unset or empty; anything else is a one-line
    usage error (a typo in a job script must not silently mean the default)."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise UsageError(f"{name}={text!r}: expected a non-negative number (see docs/staging.md, \"Object storage\")")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a remote request is tried (see the module docstring)."""

    attempts: int = 8
    base: float = 0.25
    cap: float = 20.0
    timeout: float = 120.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        return cls(attempts=max(1, int(_env_float(RETRIES_ENV, cls.attempts))), base=_env_float(BASE_ENV, cls.base),
                   cap=_env_float(CAP_ENV, cls.cap), timeout=_env_float(TIMEOUT_ENV, cls.timeout))

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (1-based): full jitter."""
        return random.uniform(0.0, min(self.cap, self.base * 2 ** (failures - 1)))


class Attempts:
    """Counts failures in a row for one logical operation; :meth:`failed` sleeps or gives up.

    Progress (a ranged read that returned some bytes) resets the count, so a server that cuts every
    response short still delivers the object, one piece at a time.
    """

    def __init__(self, policy: RetryPolicy, url: str, what: str) -> None:
        self.policy, self.url, self.what = policy, url, what
        self.failures = 0
        self.total_failures = 0
        self.start = time.monotonic()

    def progressed(self) -> None:
        self.failures = 0

    def failed(self, exc: BaseException) -> None:
        """Record a transient failure: sleep before the next try, or raise RemoteUnavailableError."""
        self.failures += 1
        self.total_failures += 1
        if self.failures >= self.policy.attempts:
            took = time.monotonic() - self.start
            msg = str(exc).splitlines()[0][:200] if str(exc) else ""
            raise RemoteUnavailableError(
                f"{self.url}: {self.what} failed {self.failures} times in a row over {took:.1f}s "
                f"(last: {type(exc).__name__}{': ' + msg if msg else ''}); the server is unreachable, throttling "
                f"or cutting connections: retry later (more tries: ${RETRIES_ENV}, now {self.policy.attempts})"
            ) from exc
        time.sleep(self.policy.delay(self.failures))


def permanent_error(exc: BaseException, url: str, what: str) -> BaseException:
    """What to raise for a non-transient failure: ``exc`` itself when callers handle it (a missing
    object, a stager error), else a one-line :class:`~stager.errors.RemoteAccessError` naming the URL
    (no credentials, 403, a bad request: retrying would not help)."""
    if isinstance(exc, (FileNotFoundError, StagerError)) or not isinstance(exc, Exception):
        return exc
    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
    cls = RemotePermissionError if isinstance(exc, PermissionError) else RemoteAccessError
    return cls(f"{url}: {what} refused ({type(exc).__name__}{': ' + msg if msg else ''}); check the "
                             "URL, the credentials and the storage options")


def with_retries(fn: Callable[[], T], url: str, what: str, policy: RetryPolicy | None = None) -> T:
    """``fn()``, tried again on transient errors under ``policy`` (default: from the environment)."""
    attempts = Attempts(policy or RetryPolicy.from_env(), url, what)
    while True:
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                err = permanent_error(exc, url, what)
                if err is exc:
                    raise
                raise err from exc
            attempts.failed(exc)

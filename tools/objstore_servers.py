"""Servers for the object-storage tests, all on 127.0.0.1 and started by the tests themselves.

* :class:`MotoServer`: a real S3 API (moto in server mode) in a child process.
* :class:`AzuriteServer`: Azure's Blob emulator (azurite, from the npm registry; tools/setup_venv.sh
  installs it under ``.venv/azurite`` when npm is there) in a child process.
* :class:`RangeHTTPServer`: a static file server that honours ``Range`` (python's http.server does not).
* :class:`FaultProxy`: an HTTP reverse proxy in front of either, which injects faults
  deterministically: "the next N requests matching M are cut after K body bytes / reset / stalled /
  answered 503 SlowDown". Nothing is random, so a test's outcome does not depend on timing.

Used by tests/test_objstore.py and tools/bench/bench_objstore.py.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_MOTO_CHILD = r"""
import sys
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes our stdin (or dies)
s.stop()
"""

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_SESSION_TOKEN": "testing"}


class MotoServer:
    """moto's S3 in a child process; :attr:`endpoint` is ``http://127.0.0.1:<port>``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _MOTO_CHILD], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"moto server did not start (printed {line!r})")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment a client needs to reach this server (or ``endpoint``, e.g. a proxy in front)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint or self.endpoint}

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- Azure Blob (azurite) ------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
# azurite's well-known development account key (public, documented by Microsoft; not a secret).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_path() -> str | None:
    """The ``azurite-blob`` executable: ``$STAGER_AZURITE``, the venv's, or on PATH; None if absent."""
    import shutil

    for cand in (os.environ.get("STAGER_AZURITE"), str(ROOT / ".venv" / "azurite" / "node_modules" / ".bin" /
                                                      "azurite-blob"), shutil.which("azurite-blob")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


class AzuriteServer:
    """azurite's Blob service on 127.0.0.1 (in memory, no telemetry); :meth:`connection_string`."""

    def __init__(self, exe: str) -> None:
        self.proc = subprocess.Popen([exe, "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence",
                                      "--disableTelemetry", "--skipApiVersionCheck", "--loose"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        self.port = 0
        deadline = time.monotonic() + 180
        for line in self.proc.stdout:
            m = re.search(r"listens on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
            if time.monotonic() > deadline:
                break
        if not self.port:
            self.stop()
            raise RuntimeError("azurite did not start")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # Keep draining its output so that it never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.proc.stdout or ()], daemon=True).start()

    def connection_string(self, endpoint: str | None = None) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={endpoint or self.endpoint}/devstoreaccount1;")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- a static file server with Range ----------------------------------------------------------------
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path

    def log_message(self, *args: Any) -> None:
        pass

    def _file(self) -> Path | None:
        rel = self.path.split("?", 1)[0].lstrip("/")
        p = (self.root / rel).resolve()
        if self.root not in p.parents or not p.is_file():
            self.send_error(404)
            return None
        return p

    def do_HEAD(self) -> None:
        p = self._file()
        if p is None:
            return
        self.send_response(200)
        self.send_header("Content-Length", str(p.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        p = self._file()
        if p is None:
            return
        size = p.stat().st_size
        start, end = 0, size
        m = _RANGE.match(self.headers.get("Range", ""))
        if m:
            a, b = m.groups()
            start, end = (int(a), min(size, int(b) + 1) if b else size) if a else (max(0, size - int(b)), size)
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        with open(p, "rb") as f:
            f.seek(start)
            self.wfile.write(f.read(end - start))


class RangeHTTPServer:
    """Serves the files under ``root`` over HTTP with ``Range`` support, on a thread."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        handler = type("Handler", (_RangeHandler,), {"root": Path(root).resolve()})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---- the fault-injecting proxy -----------------------------------------------------------------------
@dataclass
class Fault:
    """Applied to the next ``count`` requests with ``method`` whose path contains ``path``.

    ``kind``: ``"cut"`` (send the headers and ``after`` body bytes, then close), ``"reset"`` (TCP
    RST after ``after`` body bytes; 0: before the status line), ``"stall"`` (send ``after`` body
    bytes, then nothing for ``stall`` seconds, then close; 0: hold the request without forwarding
    it), ``"status"`` (answer ``status`` with an S3-style error body, ``SlowDown`` for 503, without
    asking the upstream).
    """

    kind: str
    count: int
    method: str = "GET"
    path: str = ""
    after: int = 0
    status: int = 503
    stall: float = 30.0
    applied: int = 0


@dataclass
class ProxyStats:
    requests: int = 0
    faults: int = 0
    by_method: dict[str, int] = field(default_factory=dict)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: FaultProxy

    def log_message(self, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _forward(self) -> None:
        body = self._body()
        fault = self.proxy.take_fault(self.command, self.path)
        if fault is not None and fault.kind == "status":
            self._error(fault.status)
            return
        if fault is not None and fault.kind in ("reset", "stall") and fault.after == 0:
            if fault.kind == "stall":  # the request never reaches the upstream (an upload that hangs)
                self.proxy.wait_released(fault.stall)
            self._reset()
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(self.proxy.upstream_host, self.proxy.upstream_port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                self.send_header(k, v)
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault is None:
            self.wfile.write(data)
            return
        self.wfile.write(data[: fault.after])
        self.wfile.flush()
        if fault.kind == "stall":
            self.proxy.wait_released(fault.stall)
        if fault.kind == "reset":
            self._reset()
        self.close_connection = True

    def _error(self, status: int) -> None:
        code = {503: "SlowDown", 500: "InternalError"}.get(status, "ServiceUnavailable")
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected</Message>'
                "</Error>").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.close()

    def do_GET(self) -> None:  # http.server's naming
        self._forward()

    def do_HEAD(self) -> None:
        self._forward()

    def do_PUT(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def do_DELETE(self) -> None:
        self._forward()


class FaultProxy:
    """A reverse proxy to ``upstream`` (``http://host:port``) on a thread, with :meth:`inject`."""

    def __init__(self, upstream: str) -> None:
        hostport = upstream.split("://", 1)[1].rstrip("/")
        self.upstream_host, port = hostport.rsplit(":", 1)
        self.upstream_port = int(port)
        handler = type("Handler", (_ProxyHandler,), {"proxy": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults: list[Fault] = []
        self.stats = ProxyStats()
        # Stalls end at their timeout or when clear() bumps the generation they started in (a
        # counter, not an Event set and cleared: a stalled thread that runs late still sees it).
        self._released = threading.Condition()
        self._generation = 0
        self._stopped = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def inject(self, kind: str, count: int, **kw: Any) -> Fault:
        f = Fault(kind, count, **kw)
        with self._lock:
            self.faults.append(f)
        return f

    def clear(self) -> None:
        """Drop every fault not yet applied and end every stall."""
        with self._lock:
            self.faults.clear()
        self._release_stalls()

    def _release_stalls(self) -> None:
        with self._released:
            self._generation += 1
            self._released.notify_all()

    def wait_released(self, timeout: float) -> None:
        """Block a stalled request for ``timeout`` seconds, or until :meth:`clear`/:meth:`stop`."""
        with self._released:
            start = self._generation
            self._released.wait_for(lambda: self._stopped or self._generation != start, timeout)

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.stats.requests += 1
            self.stats.by_method[method] = self.stats.by_method.get(method, 0) + 1
            for f in self.faults:
                if f.applied < f.count and f.method == method and f.path in path:
                    f.applied += 1
                    self.stats.faults += 1
                    return f
        return None

    def stop(self) -> None:
        self._stopped = True
        self._release_stalls()
        self.server.shutdown()
        self.server.server_close()

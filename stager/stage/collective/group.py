"""The process group of collective staging: rendezvous, heartbeats, and naming the node that failed.

One process per node joins a ``torch.distributed`` group (gloo over TCP on CPU; NCCL possible where
the exchange buffers live on GPUs) whose rank is the node index. Rendezvous goes through a
``TCPStore`` on node 0 at ``MASTER_ADDR:MASTER_PORT`` (or the first host of ``SLURM_JOB_NODELIST``).

Failure handling, the reason this module exists: a collective blocks until every member takes part,
so a dead node would otherwise leave the others waiting, and gloo's own error says only "connection
closed". Each node therefore runs a small heartbeat thread with its own store connection that

* bumps ``hb/<node>`` = ``"<count> <step> <steps>"`` every ``interval`` seconds;
* watches one neighbour (node+1 mod N) - O(1) store traffic per node at any scale - and, when the
  neighbour's counter has not moved for ``stale_after`` seconds (default 10 s) and over
  :data:`STALE_BEATS` of its own beats (so a watcher that was itself starved of CPU on a busy node
  does not mistake its own pause for the neighbour's), publishes
  ``abort`` = ``"<node>\\t<host>\\t<reason>"`` naming it;
* polls ``abort``; once set, the main thread raises :class:`StagerTimeoutError` at its next check or
  collective error, and a main thread stuck inside a collective (which Python cannot interrupt)
  is ended by the watchdog after a short grace period with the same message and exit code 5.

The process-group timeout (``--timeout``) bounds every collective as a backstop for a node that is
alive but stuck. Node 0 hosts the store, so on failure it lingers a moment for the others to read
the reason; if node 0 itself disappears the others report that the store host is unreachable.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from stager.errors import StagerTimeoutError, UsageError, exit_now
from stager.world import expand_hostlist

DEFAULT_PORT = 29417
ABORT_KEY = "abort"
STALE_BEATS = 6  # consecutive unchanged looks at a neighbour's counter before it counts as stopped
T = TypeVar("T")


class RendezvousError(StagerTimeoutError):
    """The group could not form (peers missing, store unreachable) within the timeout."""


def resolve_endpoint(
    env: Mapping[str, str] | None = None, master_addr: str | None = None, master_port: int | None = None
) -> tuple[str, int]:
    """``(address, port)`` of node 0's rendezvous store.

    Address: ``master_addr``, else ``$MASTER_ADDR``, else the first host of ``$SLURM_JOB_NODELIST``.
    Port: ``master_port``, else ``$MASTER_PORT``, else derived from ``$SLURM_JOB_ID`` (so concurrent
    jobs sharing a node do not collide), else :data:`DEFAULT_PORT`.
    """
    env = os.environ if env is None else env
    addr = master_addr or env.get("MASTER_ADDR")
    if not addr:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodelist:
            hosts = expand_hostlist(nodelist)
            addr = hosts[0] if hosts else None
    if not addr:
        raise UsageError(
            "collective staging needs node 0's address: set MASTER_ADDR (and MASTER_PORT), or run under "
            "Slurm (srun --ntasks-per-node=1), which sets SLURM_JOB_NODELIST"
        )
    if master_port is not None:
        port = master_port
    elif env.get("MASTER_PORT"):
        try:
            port = int(env["MASTER_PORT"])
        except ValueError as exc:
            raise UsageError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number") from exc
    elif (env.get("SLURM_JOB_ID") or "").isdigit():
        port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
    else:
        port = DEFAULT_PORT
    if not 0 < port < 65536:
        raise UsageError(f"port {port} out of range 1..65535")
    return addr, port


class Group:
    """A formed group of ``num_nodes`` processes (rank = node) plus its heartbeat thread.

    Use as ``with Group(...) as g:``; :meth:`collective` wraps every collective call so failures
    become one :class:`StagerTimeoutError` that names the failed node.
    """

    def __init__(
        self,
        node: int,
        num_nodes: int,
        *,
        addr: str,
        port: int,
        timeout: float,
        backend: str = "gloo",
        interval: float = 0.5,
        stale_after: float | None = None,
    ) -> None:
        if timeout <= 0:
            raise UsageError(f"timeout must be > 0 seconds, got {timeout}")
        self.node, self.num_nodes = node, num_nodes
        self.addr, self.port = addr, port
        self.timeout = timeout
        self.backend = backend
        self.interval = interval
        # A neighbour is declared stopped only after both ``stale_after`` seconds and STALE_BEATS of
        # our own beats without a change: on a busy node our own thread may not run for a while, and
        # one late look at an unchanged counter must not abort a healthy group.
        self.stale_after = stale_after if stale_after is not None else min(timeout, max(10.0, 20 * interval))
        self.host = socket.gethostname()
        self.store: Any = None
        self.step, self.steps = 0, 0
        self.aborted: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_collective = False
        self._formed = False

    # ---- forming ------------------------------------------------------------------------------
    def _make_store(self, is_master: bool, wait: bool) -> Any:
        import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)

        # Only the group's own members pass world_size (they are what the master waits for);
        # heartbeat connections pass None so they are not counted.
        return dist.TCPStore(
            self.addr,
            self.port,
            self.num_nodes if wait else None,
            is_master,
            dt.timedelta(seconds=self.timeout),
            wait_for_workers=wait,
        )

    def form(self) -> Group:
        import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)

        if dist.is_initialized():
            raise UsageError("a torch.distributed group is already initialised in this process; stage before it")
        # torchrun's agent may already host the store at MASTER_PORT: then everyone is a client.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        is_master = self.node == 0 and not agent
        try:
            if not is_master and not _wait_for_port(self.addr, self.port, time.monotonic() + self.timeout):
                raise TimeoutError(f"nothing listens at {self.addr}:{self.port} (node 0 not started?)")
            self.store = self._make_store(is_master, True)
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore("stager-pg", self.store),
                rank=self.node,
                world_size=self.num_nodes,
                timeout=dt.timedelta(seconds=self.timeout),
            )
        except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
            self._teardown()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RendezvousError(
                f"collective staging: the group of {self.num_nodes} nodes did not form at {self.addr}:{self.port} "
                f"within {self.timeout:g}s (node {self.node}: {first[:200]}); check that every node runs "
                "the same command, or use --fallback direct"
            ) from exc
        self._formed = True
        self.store.set(f"id/{self.node}", f"{self.host} {os.getpid()}")
        self._thread = threading.Thread(target=self._heartbeat, name="stager-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> Group:
        return self.form()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        self.close(failed=et is not None)

    # ---- heartbeat / watchdog -----------------------------------------------------------------
    def _heartbeat(self) -> None:
        try:
            client = self._make_store(False, False)
        except (RuntimeError, OSError) as exc:
            self._on_abort(f"0\t{self.addr}\tstopped: its rendezvous store is unreachable ({exc})")
            return
        count = 0
        watched = (self.node + 1) % self.num_nodes
        last_seen: bytes | None = None
        last_change = time.monotonic()
        unchanged = 0  # our beats since the neighbour's counter last changed
        while not self._stop.wait(self.interval):
            count += 1
            try:
                client.set(f"hb/{self.node}", f"{count} {self.step} {self.steps}")
                if client.check([ABORT_KEY]):
                    self._on_abort(client.get(ABORT_KEY).decode())
                    return
                if watched == self.node:
                    continue
                key = f"hb/{watched}"
                seen = client.get(key) if client.check([key]) else None
            except (RuntimeError, OSError) as exc:
                if self._stop.is_set():
                    return
                self._on_abort(f"0\t{self.addr}\tstopped: its rendezvous store became unreachable ({exc})")
                return
            if seen == b"done":
                watched = self.node  # it finished; nothing left to watch
                continue
            now = time.monotonic()
            if seen != last_seen:
                last_seen, last_change, unchanged = seen, now, 0
                continue
            unchanged += 1
            if unchanged >= STALE_BEATS and now - last_change > self.stale_after:
                where = _progress_text(seen)
                host = _host_of(client, watched)
                reason = f"{watched}\t{host}\tstopped: no heartbeat for {now - last_change:.1f}s{where}"
                with contextlib.suppress(RuntimeError, OSError):
                    client.compare_set(ABORT_KEY, "", reason)
                self._on_abort(client.get(ABORT_KEY).decode() if client.check([ABORT_KEY]) else reason)
                return

    def _on_abort(self, raw: str) -> None:
        self.aborted = raw
        # The main thread raises by itself unless it is stuck in a collective; give it a moment.
        deadline = time.monotonic() + max(2.0, 2 * self.interval)
        while time.monotonic() < deadline:
            if self._stop.wait(0.1):
                return
        if self._stop.is_set():
            return
        if self.node == 0:
            time.sleep(self.interval)  # let the others read the abort reason from our store
        exit_now(StagerTimeoutError(self.abort_message()))

    def abort_message(self) -> str:
        raw = self.aborted or ""
        parts = raw.split("\t", 2)
        if len(parts) == 3:
            node, host, reason = parts
            who = f"node {node} ({host})"
        else:
            who, reason = "a peer", raw
        return (
            f"collective staging aborted: {who} {reason}; every node stops with exit 5; rerun the same "
            "command to resume from the verified shards"
        )

    # ---- use ------------------------------------------------------------------------------------
    def set_progress(self, step: int, steps: int) -> None:
        self.step, self.steps = step, steps

    def check(self) -> None:
        """Raise if a peer has reported a failure (called between steps)."""
        if self.aborted is not None:
            raise StagerTimeoutError(self.abort_message())

    def fail(self, reason: str) -> None:
        """Tell every node that this one is giving up (a local error such as a checksum mismatch)."""
        if self.store is None or self.aborted is not None:
            return
        self.aborted = f"{self.node}\t{self.host}\t{reason}"
        with contextlib.suppress(RuntimeError, OSError):
            self.store.compare_set(ABORT_KEY, "", self.aborted)

    def collective(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one collective; turn any failure into a :class:`StagerTimeoutError` naming the culprit."""
        self.check()
        self._in_collective = True
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, OSError) as exc:
            raise StagerTimeoutError(self._diagnose(exc)) from exc
        finally:
            self._in_collective = False

    def _diagnose(self, exc: BaseException) -> str:
        # Our heartbeat thread (or a neighbour's) publishes the culprit within stale_after seconds.
        deadline = time.monotonic() + self.stale_after + 3 * self.interval
        while time.monotonic() < deadline and self.aborted is None:
            time.sleep(self.interval / 2)
        if self.aborted is not None:
            return self.abort_message()
        laggard = self._slowest()
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return (
            f"collective staging: a collective failed on node {self.node} ({first}){laggard}; every node "
            "stops with exit 5; rerun the same command to resume from the verified shards"
        )

    def _slowest(self) -> str:
        """Name the node(s) furthest behind, from their heartbeat progress."""
        try:
            steps = {}
            for n in range(self.num_nodes):
                key = f"hb/{n}"
                if self.store.check([key]):
                    v = self.store.get(key).split()
                    if len(v) == 3:
                        steps[n] = int(v[1])
        except (RuntimeError, OSError):
            return "; node 0's store is unreachable, so node 0 stopped"
        if not steps:
            return ""
        lo = min(steps.values())
        behind = [n for n, s in steps.items() if s == lo]
        missing = [n for n in range(self.num_nodes) if n not in steps]
        if len(behind) == len(steps) and not missing:
            return ""
        names = ", ".join(str(n) for n in sorted(missing + behind))
        return f"; lagging or missing: node {names} (at step {lo})"

    def close(self, failed: bool = False) -> None:
        """Stop the heartbeat and leave the group; node 0 keeps the store up until the others are done."""
        if not self._formed:
            return
        if failed:
            if self.node == 0:
                self.fail("aborted")  # no-op when a reason is already published
                time.sleep(2 * self.interval + 0.5)
            self._stop.set()
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            with contextlib.suppress(RuntimeError, OSError):
                self.store.set(f"hb/{self.node}", "done")
                self.store.add("finished", 1)
                if self.node == 0:
                    deadline = time.monotonic() + self.timeout
                    while self.store.add("finished", 0) < self.num_nodes and time.monotonic() < deadline:
                        time.sleep(0.05)
        self._formed = False
        self._teardown()

    def _teardown(self) -> None:
        import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)

        if dist.is_initialized():
            with contextlib.suppress(RuntimeError, OSError, ValueError):
                dist.destroy_process_group()
        self.store = None


def _progress_text(seen: bytes | None) -> str:
    if not seen:
        return " (it never reported progress)"
    v = seen.split()
    if len(v) == 3:
        return f" (last at step {int(v[1])} of {int(v[2])})"
    return ""


def _host_of(client: Any, node: int) -> str:
    key = f"id/{node}"
    try:
        if client.check([key]):
            host, pid = client.get(key).decode().split()
            return f"{host}, pid {pid}"
    except (RuntimeError, OSError, ValueError):
        pass
    return "host unknown"


def _wait_for_port(addr: str, port: int, deadline: float) -> bool:
    """Poll until node 0's store accepts connections; False at the deadline. (The store client's
    own retry backs off to seconds, which adds up to ~10 s when every node starts at once.)"""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

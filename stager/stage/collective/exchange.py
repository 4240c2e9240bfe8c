"""The exchange loop of collective staging: read a chunk, all-gather it, write every node's chunk.

At step ``s`` every node contributes chunk ``s`` of its read share (:class:`~.io.ShareReader`) and
receives chunk ``s`` of every node's share in one ``all_gather``; each node's part of the receive
buffer is fed to that node's :class:`~.io.StreamSink`, which writes verified files. Three threads
overlap the work: a reader thread stays one chunk ahead, this thread runs the collectives, a writer
thread drains the receive buffers. Two send buffers (``chunk`` bytes) and two receive buffers
(``num_nodes * chunk``) circulate through queues, so memory stays at 2 + 2N chunks however long the
share. The first error on any thread stops the others and is raised here; a peer's failure arrives
through the group (:class:`~.group.Group`), which names it.

``$STAGER_TEST_COLLECTIVE_KILL=<node>:<step>[:STOP]`` (test-only) makes that node SIGKILL (or, with
``:STOP``, SIGSTOP: a hung node) itself at that exchange step, so tests can fail a node mid-exchange
deterministically.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from typing import Any, TypeVar

from stager.progress import Progress
from stager.stage.collective.group import Group
from stager.stage.collective.io import ShareReader, StreamSink
from stager.world import local_rank

KILL_ENV = "STAGER_TEST_COLLECTIVE_KILL"
BUFFERS = 2  # send buffers and receive buffers in flight

T = TypeVar("T")


class Exchange:
    """One node's part of the exchange: ``steps`` all-gathers of ``chunk`` bytes per node.

    ``reader`` yields this node's share; ``sinks[j]`` writes node ``j``'s share (this node's own
    included: what it reads, it also writes). :meth:`run` returns once every sink has its last byte.
    """

    def __init__(self, group: Group, reader: ShareReader, *, sinks: list[StreamSink], steps: int, chunk: int,
                 progress: Progress) -> None:
        self.group = group
        self.reader = reader
        self.sinks = sinks
        self.steps = steps
        self.chunk = chunk
        self.progress = progress
        self._free_send: queue.Queue[bytearray] = queue.Queue()
        self._full_send: queue.Queue[bytearray | BaseException] = queue.Queue()
        self._free_recv: queue.Queue[bytearray] = queue.Queue()
        self._to_write: queue.Queue[bytearray | None] = queue.Queue()
        for _ in range(BUFFERS):
            self._free_send.put(bytearray(chunk))
            self._free_recv.put(bytearray(group.num_nodes * chunk))
        self._stop = threading.Event()
        self._errors: list[BaseException] = []  # the writer thread's failure
        self._transport = _Transport(group, chunk)
        self._kill_at, self._kill_sig = _kill_step(group.node)

    def run(self) -> None:
        reader = threading.Thread(target=self._read_loop, name="stager-read", daemon=True)
        writer = threading.Thread(target=self._write_loop, name="stager-write", daemon=True)
        reader.start()
        writer.start()
        try:
            self._gather_loop()
            self._to_write.put(None)
            writer.join()
            self._raise_writer_error()
            for sink in self.sinks:
                sink.feed(memoryview(b""))  # trailing empty files of a stream
        finally:
            self._stop.set()
            self._to_write.put(None)
            for t in (reader, writer):
                t.join(timeout=5)

    def _gather_loop(self) -> None:
        """This thread: one all-gather per step, from a filled send buffer into a free receive buffer."""
        for step in range(self.steps):
            if step == self._kill_at:
                os.kill(os.getpid(), self._kill_sig)
            item = self._get(self._full_send)
            if isinstance(item, BaseException):
                raise item
            recv = self._get(self._free_recv)
            self.group.collective(self._transport.all_gather, item, recv)
            self._free_send.put(item)
            self._to_write.put(recv)
            self.group.set_progress(step + 1, self.steps)
            self.progress.update(1, self.group.num_nodes * self.chunk)

    def _get(self, q: queue.Queue[T]) -> T:
        """The next item of ``q``, raising when the writer failed or the group aborted meanwhile."""
        item = _get(q, self._stop, self.group)
        self._raise_writer_error()
        assert item is not None  # _stop is set only after a writer error, raised above
        return item

    def _raise_writer_error(self) -> None:
        if self._errors:
            raise self._errors[0]

    def _read_loop(self) -> None:
        """Reader thread: fill each free send buffer from this node's share (a failure is passed on)."""
        try:
            for _ in range(self.steps):
                buf = _get(self._free_send, self._stop)
                if buf is None:
                    return
                self.reader.fill(memoryview(buf))
                self._full_send.put(buf)
        except BaseException as exc:
            self._full_send.put(exc)
        finally:
            self.reader.close()

    def _write_loop(self) -> None:
        """Writer thread: feed each node's part of a receive buffer to its sink, then free the buffer."""
        chunk = self.chunk
        while True:
            buf = self._to_write.get()
            if buf is None:
                return
            try:
                view = memoryview(buf)
                for j, sink in enumerate(self.sinks):
                    sink.feed(view[j * chunk : (j + 1) * chunk])
            except BaseException as exc:
                self._errors.append(exc)
                self._stop.set()
                return
            finally:
                self._free_recv.put(buf)


def _get(q: queue.Queue[Any], stop: threading.Event, group: Group | None = None) -> Any:
    """``q.get()`` that gives up (None) when ``stop`` is set and raises when the group aborted."""
    while True:
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            if group is not None:
                group.check()
            if stop.is_set():
                return None


class _Transport:
    """All-gather of fixed-size byte chunks over the group's backend (host memory for gloo, GPU for NCCL)."""

    def __init__(self, group: Group, chunk: int) -> None:
        import torch  # noqa: PLC0415 (torch is imported only where a process group is used)

        self.group = group
        self.chunk = chunk
        self.device = None
        if group.backend == "nccl":
            self.device = torch.device("cuda", local_rank())
            self.dev_send = torch.empty(chunk, dtype=torch.uint8, device=self.device)
            self.dev_recv = torch.empty(group.num_nodes * chunk, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _gather(out: Any, inp: Any) -> None:
        import torch.distributed as dist  # noqa: PLC0415 (torch is imported only where a process group is used)

        # torch >= 2.10 names it all_gather_single; all_gather_into_tensor before that.
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn(out, inp)

    def all_gather(self, send: bytearray, recv: bytearray) -> None:
        import torch  # noqa: PLC0415 (torch is imported only where a process group is used)

        s = torch.frombuffer(send, dtype=torch.uint8)
        r = torch.frombuffer(recv, dtype=torch.uint8)
        if self.device is None:
            self._gather(r, s)
            return
        self.dev_send.copy_(s)
        self._gather(self.dev_recv, self.dev_send)
        r.copy_(self.dev_recv.cpu())


def _kill_step(node: int) -> tuple[int, int]:
    """(step, signal) from $STAGER_TEST_COLLECTIVE_KILL for this node, or (-1, 0)."""
    parts = os.environ.get(KILL_ENV, "").split(":")
    if len(parts) >= 2 and parts[0].strip() == str(node):
        sig = signal.SIGSTOP if parts[2:] == ["STOP"] else signal.SIGKILL
        return int(parts[1]), sig
    return -1, 0

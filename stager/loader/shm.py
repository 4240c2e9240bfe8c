"""Batch buffers that cross from a DataLoader worker to the main process through reused shared memory.

Why not torch's own tensor sharing: it puts every batch into a *fresh* shared-memory segment and
passes its file descriptor through ``multiprocessing.resource_sharer`` (a socket connection and an
HMAC handshake per tensor). On the reference machine a fresh 6.4 MB tmpfs segment costs ~9 ms to
fill (tmpfs page allocation), ~1 ms more to hand over: ~150 us per ImageNet-sized sample, more than
the whole read. Here each worker owns a small **ring of slots** (one shared-memory file each, mapped
once on both sides and reused), and a batch travels as a :class:`ShmRef` (a ring, a slot and a size):

* worker: :meth:`WorkerRing.acquire` returns a writable ``uint8`` view of a free slot and its ref;
* main process: unpickling the ref (:func:`attach`) maps the slot once and returns a uint8 tensor
  over a fresh ``memoryview`` slice of the persistent mapping. Every view the user derives (tensor
  slices, ``.numpy()``, ``memoryview``) keeps that slice alive; when the last one dies, a
  ``weakref.finalize`` on it marks the slot free in the ring's control block (one byte per slot,
  shared), and the worker may reuse it.

So a slot is never rewritten while any view of its batch exists (tested by holding a whole epoch
of batches). A worker whose slots are all held (a consumer that keeps batches) adds slots up to
:data:`MAX_SLOTS`, then falls back to one-off segments: never blocking, never overwriting.

**Nothing has a name.** Every segment is an anonymous file (``memfd_create``), never a name under
``/dev/shm``: a name outlives the processes that know it, and a trainer killed with SIGKILL (the OOM
killer, ``scancel`` past its grace time) left its workers' segments there until the next reboot. The
worker hands each segment's descriptor to the main process instead (``SCM_RIGHTS``), tagged with its pid
and key, before the first ref that needs it, so the main process finds it there when it unpickles the
ref. The descriptors travel over a **socket pair** that :func:`open_channel` makes for one epoch (or one
worker pool): the main process keeps one end (its :class:`Inbox`), the DataLoader's dataset carries the
other (:class:`Channel`) into the workers it starts (inherited by ``fork``, passed by ``spawn`` and
``forkserver`` as multiprocessing passes sockets), and the main process closes its copy of that end
once they have started (:meth:`Channel.close`). Nothing listens and nothing has an address, so no other
process, of this user or another, can connect, squat a name or fill a queue (an abstract address did:
anyone on the node could read it in ``/proc/net/unix`` and fill its listen backlog, and the workers'
``connect`` then hung the epoch; tests/test_attack_loader.py). A segment's memory is freed by the kernel
when the last mapping or descriptor of it goes, whoever exits, however.

Each mapping the main process holds keeps one descriptor open (Python's ``mmap`` keeps its own): a
ring's control block and slots (``MAX_SLOTS + 1`` per worker), plus one per one-off batch still held.
A descriptor that cannot be received (the process is at its ``ulimit -n``) is not dropped silently
(the kernel discards it, and the epoch would wait for it forever): the batch that needed it raises
:class:`~stager.errors.ResourceLimitError` in one line when the Loader finishes it (:func:`check_batch`).

A process forked from the main process (a user's ``os.fork``, a DataLoader worker) inherits every
mapping and its batches' finalizers: a slot is released only by the process that received it, so a
child that drops or exits with its copies never frees a slot the parent still holds; and the child
closes its copies of the inboxes (``os.register_at_fork``). :func:`cleanup` closes a channel's inbox
(batches already handed out stay valid: they hold their own mappings). Without ``memfd_create`` or
descriptor passing (not Linux, a sandbox that refuses them), :func:`open_channel` gives None and the
caller falls back to torch's shared tensors.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import resource
import socket
import sys
import threading
import uuid
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from stager.errors import ResourceLimitError

MAX_SLOTS = 16
_FREE, _BUSY = 0, 1
_KEY_BYTES = 64  # a key message's longest text ("<pid> ctl", "<pid> <slot>-<gen>", "<pid> x<n>")


@functools.cache
def available() -> bool:
    """Whether batches can travel through rings here: anonymous shared files and descriptor passing (Linux;
    tried once, since a sandbox may refuse ``memfd_create`` that the platform has)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")):
        return False
    try:
        os.close(os.memfd_create("stager-probe", os.MFD_CLOEXEC))
    except OSError:
        return False
    return True


class Channel:
    """The workers' end of one token's socket pair: what a DataLoader's dataset carries into its workers.

    Pickled (``spawn``, ``forkserver``) it travels as multiprocessing passes a socket (a duplicate of the
    descriptor); ``fork`` inherits it. Every worker of the pool shares it (one message is one descriptor
    and its key, sent whole). :meth:`close` in the main process once the workers have started.
    """

    def __init__(self, token: str, sock: socket.socket) -> None:
        self.token = token
        self.sock = sock

    def close(self) -> None:
        self.sock.close()


def open_channel() -> Channel | None:
    """Open one epoch's (or one worker pool's) channel: the main process' :class:`Inbox` and the workers' end,
    or None when rings are not available here (the caller then uses torch's shared tensors).
    :func:`cleanup` closes the inbox."""
    if not available():
        return None
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        main_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        return None
    with _LOCK:
        _INBOXES[token] = Inbox(main_end)
    return Channel(token, worker_end)


def _segment(tag: str, nbytes: int) -> tuple[mmap.mmap, int]:
    """A new anonymous shared file of ``nbytes`` (at least 1), mapped: ``(mapping, descriptor)``."""
    fd = os.memfd_create(f"stager-{tag}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        return mmap.mmap(fd, max(nbytes, 1)), fd
    except BaseException:
        os.close(fd)
        raise


class ShmRef(NamedTuple):
    """A batch buffer in a worker's ring; unpickles in the receiving process as a uint8 tensor of ``shape``.

    ``ring``: ``<token>:<worker pid>``. ``key``: the segment's key on the channel (``<slot>-<gen>``,
    or ``x<n>`` for a one-off segment, ``slot`` -1, used once).
    """

    ring: str
    key: str
    slot: int
    gen: int
    nbytes: int
    shape: tuple[int, ...]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return attach, (tuple(self),)


class WorkerRing:
    """The worker's side: slots it writes batches into, reused once the main process released them."""

    def __init__(self, channel: Channel) -> None:
        self.token = channel.token
        self._pid = os.getpid()
        self.ring = f"{channel.token}:{self._pid}"
        self._conn = channel.sock
        self._ctl = self._share("ctl", MAX_SLOTS)
        self._ctl_view = np.frombuffer(self._ctl, dtype=np.uint8)
        self._slots: list[tuple[mmap.mmap | None, int]] = []  # (mapping, capacity)
        self._gens: list[int] = []  # the generation of each slot's current file
        self._gen = 0
        self._oneoff = 0

    def _share(self, key: str, nbytes: int) -> mmap.mmap:
        """A new segment, its descriptor sent to the main process under ``key`` (before any ref names it)."""
        mm, fd = _segment(key, nbytes)
        try:
            socket.send_fds(self._conn, [f"{self._pid} {key}".encode()], [fd])
        except BaseException:
            mm.close()
            raise
        finally:
            os.close(fd)  # the mapping (and the descriptor in flight) keep the segment
        return mm

    def acquire(self, nbytes: int, shape: tuple[int, ...]) -> tuple[np.ndarray, ShmRef]:
        """A writable uint8 array of ``nbytes`` and the ref that hands it to the main process."""
        ctl = self._ctl_view
        pick = -1
        for i, (_mm, cap) in enumerate(self._slots):
            if ctl[i] == _FREE and cap >= nbytes:
                pick = i
                break
        if pick < 0:
            free_small = [i for i in range(len(self._slots)) if ctl[i] == _FREE]
            if free_small:
                pick = free_small[0]
            elif len(self._slots) < MAX_SLOTS:
                pick = len(self._slots)
                self._slots.append((None, -1))
                self._gens.append(0)
            else:  # every slot held by the consumer: a one-off segment, mapped once by the receiver
                self._oneoff += 1
                key = f"x{self._oneoff}"
                mm = self._share(key, nbytes)
                return np.frombuffer(mm, dtype=np.uint8, count=nbytes), ShmRef(self.ring, key, -1, 0, nbytes, shape)
            # (Re)create the slot with headroom, so that slowly growing raw batches do not
            # re-create it every time.
            self._gen += 1
            cap = max(nbytes + nbytes // 4, 1 << 16)
            self._slots[pick] = (self._share(f"{pick}-{self._gen}", cap), cap)
            self._gens[pick] = self._gen
        slot_mm = self._slots[pick][0]
        assert slot_mm is not None
        ctl[pick] = _BUSY
        gen = self._gens[pick]
        ref = ShmRef(self.ring, f"{pick}-{gen}", pick, gen, nbytes, shape)
        return np.frombuffer(slot_mm, dtype=np.uint8, count=nbytes), ref


# ---- the receiving (main) process --------------------------------------------------------------


class _Ring:
    """The main process' view of one worker's ring: its control block and its mapped slots."""

    def __init__(self, ctl: mmap.mmap) -> None:
        self.ctl = ctl
        self.slots: dict[int, tuple[int, memoryview]] = {}  # slot -> (generation, view of its mapping)


class Inbox:
    """The main process' end of one channel: the descriptors its workers sent, and their rings (by worker pid)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.waiting: dict[tuple[int, str], int] = {}  # descriptors received before their refs
        self.rings: dict[int, _Ring] = {}

    def take(self, pid: int, key: str) -> int:
        """The descriptor worker ``pid`` sent under ``key`` (read off the channel, in the order sent)."""
        while (pid, key) not in self.waiting:
            msg, fds, flags, _addr = socket.recv_fds(self.sock, _KEY_BYTES, 1)
            if not msg:
                raise RuntimeError(f"stager.loader: the DataLoader workers' channel closed before worker {pid} "
                                   f"sent {key!r}")
            for fd in fds[1:]:
                os.close(fd)
            if not fds or flags & socket.MSG_CTRUNC:
                raise _descriptor_limit()  # the kernel dropped it: waiting for it would wait forever
            sender, name = msg.decode().split(" ", 1)
            self.waiting[(int(sender), name)] = fds[0]
        return self.waiting.pop((pid, key))

    def map(self, pid: int, key: str, nbytes: int | None = None) -> mmap.mmap:
        fd = self.take(pid, key)
        try:
            return mmap.mmap(fd, nbytes if nbytes is not None else os.fstat(fd).st_size)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):  # mmap keeps a duplicate of the descriptor
                raise _descriptor_limit() from None
            raise
        finally:
            os.close(fd)

    def ring(self, pid: int) -> _Ring:
        """Worker ``pid``'s ring (its control block is the first segment it sent)."""
        r = self.rings.get(pid)
        if r is None:
            r = self.rings[pid] = _Ring(self.map(pid, "ctl", MAX_SLOTS))
        return r

    def close(self) -> None:
        for fd in self.waiting.values():
            os.close(fd)
        self.waiting.clear()
        self.rings.clear()
        self.sock.close()


def _descriptor_limit() -> ResourceLimitError:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return ResourceLimitError(
        f"stager.loader: this process reached its limit of {soft} open files (ulimit -n), so a batch from a "
        "DataLoader worker cannot be received; every batch kept beyond the workers' "
        f"{MAX_SLOTS} reused buffers holds one open file until it is dropped: keep fewer batches (or keep "
        "copies: batch['image'].clone()), or raise the limit (ulimit -n in the job script)")


class _Lost:
    """What :func:`attach` gives instead of a tensor when the batch could not be received: the error, raised by
    :func:`check_batch` in the Loader (an error raised while torch unpickles the batch would be replaced by
    torch's own message, which suggests another sharing strategy, or kill the pin-memory thread)."""

    __slots__ = ("error",)

    def __init__(self, error: ResourceLimitError) -> None:
        self.error = error


_LOCK = threading.Lock()  # the pin-memory thread unpickles batches while the main thread may clean up
_INBOXES: dict[str, Inbox] = {}


def _forget_inboxes() -> None:
    """In a forked child: close the copies of the parent's inboxes (the parent reads them, never the child)."""
    global _LOCK  # noqa: PLW0603 (a fresh lock: a thread of the parent may have held it at the fork)
    _LOCK = threading.Lock()
    for inbox in _INBOXES.values():
        inbox.sock.close()  # the waiting descriptors are the parent's too: closing a copy frees nothing of his
        for fd in inbox.waiting.values():
            os.close(fd)
    _INBOXES.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inboxes)


def _release(ctl: mmap.mmap, slot: int, owner: int) -> None:
    if os.getpid() != owner:
        return  # a forked child's copy of a parent's batch: the parent still holds it
    with contextlib.suppress(ValueError):  # mapping already closed at interpreter exit
        ctl[slot] = _FREE


def attach(spec: tuple[str, str, int, int, int, tuple[int, ...]]) -> torch.Tensor | _Lost:
    """Unpickle a :class:`ShmRef`: a uint8 tensor of ``shape`` over the slot (no copy)."""
    ring, key, slot, gen, nbytes, shape = spec
    token, wpid = ring.rsplit(":", 1)
    pid = int(wpid)
    try:
        with _LOCK:
            inbox = _INBOXES.get(token)
            if inbox is None:
                raise RuntimeError(f"stager.loader: a batch of a finished epoch's ring {ring} arrived after its "
                                   "cleanup")
            r = inbox.ring(pid)
            if slot < 0:
                if nbytes == 0:
                    os.close(inbox.take(pid, key))
                    return torch.empty(shape, dtype=torch.uint8)
                view = memoryview(inbox.map(pid, key, nbytes))
            else:
                got = r.slots.get(slot)
                if got is None or got[0] != gen:
                    got = r.slots[slot] = (gen, memoryview(inbox.map(pid, key)))
                view = got[1][:nbytes]
    except ResourceLimitError as e:
        return _Lost(e)
    if slot >= 0:
        if nbytes == 0:
            _release(r.ctl, slot, os.getpid())
            return torch.empty(shape, dtype=torch.uint8)
        weakref.finalize(view, _release, r.ctl, slot, os.getpid())
    return torch.frombuffer(view, dtype=torch.uint8).view(shape)


def check_batch(batch: dict[str, Any]) -> None:
    """Raise the error of a buffer of ``batch`` that could not be received (:func:`attach`), if any."""
    for value in batch.values():
        if isinstance(value, _Lost):
            raise value.error


def cleanup(token: str) -> None:
    """Close this token's inbox: its channel and the descriptors not yet claimed.

    Batches already handed out stay valid (they hold their own mappings); the memory of every segment
    is freed once the last mapping of it, on either side, is gone.
    """
    with _LOCK:
        inbox = _INBOXES.pop(token, None)
        if inbox is not None:
            inbox.close()

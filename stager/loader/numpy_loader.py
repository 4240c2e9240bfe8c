"""``NumpyLoader``: one rank's batches as numpy arrays, from plain worker processes: no torch.

For TensorFlow, Keras and JAX users (docs/loader.md, "Without torch"). It is the torch
:class:`~stager.loader.Loader` with another transport: the same :class:`~stager.loader.rank.RankDataset`
(plan, reads, decoding), the same :class:`~stager.loader.base.LoaderBase` (epochs, counting, resume
state, stats), so for the same settings (seed, world size, workers, batch size) it yields the same
samples in the same batches in the same order, and a state saved by either resumes the other.

Transport: ``num_workers`` processes (``multiprocessing``; default start method ``"spawn"``, since
TensorFlow and JAX run threads a ``fork`` would copy mid-flight). Worker ``k`` yields worker stream
``k``'s batches (rank batches ``k, k + W, ...``) into its own bounded queue (``prefetch_factor``
batches, default 2); the main process takes them in turn, so batch ``i`` comes from worker
``i mod W``. The workers live across epochs (each epoch's position reaches them as one message) until
:meth:`NumpyLoader.close`, collection or interpreter exit; an epoch left half-read stops them (the
next epoch starts fresh ones). ``num_workers=0`` builds the batches in the calling process.

Batches: ``key`` (list[str]), ``label`` and ``index`` (int64 arrays (B,)), and ``image``: uint8
(B, H, W, C) for ``decode="uint8"`` (channels last, what Keras and TF expect), a list of
``memoryview`` payloads for ``"raw"``, PIL images for ``"pil"``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import time
import traceback
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from stager.errors import UsageError
from stager.loader.assemble import raw_views
from stager.loader.base import EpochBatches, LoaderBase
from stager.loader.forkgc import frozen_for_fork
from stager.loader.mix.dataset import MixDataset
from stager.loader.options import LoaderOptions
from stager.loader.rank import EpochPosition, RankDataset
from stager.mix import Mix, is_mix

# How long a blocked queue operation waits between checks that the other side still lives.
_POLL_S = 1.0
DEFAULT_START_METHOD = "spawn"


def _put(q: Any, item: Any, parent: int, stop: Any) -> bool:
    """Put ``item`` on a bounded queue; False when the loader is closing or the main process is gone."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            if os.getppid() != parent:
                return False
    return False


def _picklable(exc: BaseException) -> tuple[BaseException, str]:
    """The worker's exception (or a RuntimeError naming it when it does not pickle) and its traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc, text


class Channel(NamedTuple):
    """A worker's ends: its task queue (epoch positions; None: exit), its bounded result queue, the
    pool's stop event and the main process' pid."""

    tasks: Any
    results: Any
    stop: Any
    parent: int


def worker_main(ds: RankDataset, worker: int, channel: Channel) -> None:
    """A worker process: for each epoch position received, put stream ``worker``'s batches, then ``end``."""
    tasks, results, stop, parent = channel
    while True:
        try:
            position = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if position is None:
            return
        ds.seek(position)
        try:
            for batch in ds.worker_batches(worker, in_worker=True):
                if not _put(results, ("batch", batch), parent, stop):
                    return
            msg: tuple[str, Any] = ("end", None)
        except Exception as exc:
            msg = ("error", _picklable(exc))
        if not _put(results, msg, parent, stop):
            return


def _drain(q: Any) -> None:
    with contextlib.suppress(queue.Empty, OSError, EOFError):
        while True:
            q.get_nowait()


class WorkerProcesses:
    """``num_workers`` processes running :func:`worker_main` over one dataset, with a task and a result
    queue each."""

    def __init__(self, ds: RankDataset, num_workers: int, context: Any, depth: int, timeout: float) -> None:
        self.timeout = timeout
        self.stop = context.Event()  # set by close(): a worker mid-epoch stops putting batches
        self.tasks = [context.Queue() for _ in range(num_workers)]
        self.results = [context.Queue(maxsize=depth) for _ in range(num_workers)]
        self.procs = [
            context.Process(
                target=worker_main,
                args=(ds, k, Channel(self.tasks[k], self.results[k], self.stop, os.getpid())),
                name=f"stager-numpy-worker-{k}",
                daemon=True,
            )
            for k in range(num_workers)
        ]
        with frozen_for_fork():
            for p in self.procs:
                p.start()
        self.closed = False

    def start_epoch(self, position: EpochPosition) -> None:
        for q in self.tasks:
            q.put(position)

    def receive(self, worker: int) -> tuple[str, Any]:
        """Worker ``worker``'s next message; raises when it died or (``timeout`` > 0) took too long."""
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        while True:
            try:
                return self.results[worker].get(timeout=_POLL_S)
            except queue.Empty:
                p = self.procs[worker]
                if not p.is_alive():
                    raise RuntimeError(f"stager.loader: numpy loader worker {worker} (pid {p.pid}) exited "
                                       f"with code {p.exitcode}") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"stager.loader: numpy loader worker {worker} sent nothing "
                                       f"within timeout={self.timeout:g}s") from None

    def batch(self, worker: int) -> dict[str, Any]:
        kind, value = self.receive(worker)
        if kind == "batch":
            return value
        if kind == "error":
            exc, text = value
            raise exc from RuntimeError(f"in numpy loader worker {worker}:\n{text}")
        raise RuntimeError(f"stager.loader: numpy loader worker {worker} ended its epoch early")

    def close(self) -> None:
        """Stop and join the workers (terminated if they do not stop). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        for q in self.tasks:
            q.put(None)
        for p, results in zip(self.procs, self.results, strict=True):
            deadline = time.monotonic() + 5 * _POLL_S
            while p.is_alive() and time.monotonic() < deadline:
                _drain(results)  # a worker blocked on a full queue gets to see the stop
                p.join(timeout=0.05)
            if p.is_alive():
                p.terminate()
                p.join()
        for q in (*self.tasks, *self.results):
            q.cancel_join_thread()  # an unread batch must not block the exit
            q.close()


class NumpyLoader(LoaderBase):
    """Iterable of one rank's numpy batch dicts (module docstring); epochs, ``len``, ``state_dict`` /
    ``load_state_dict`` and ``stats`` as :class:`~stager.loader.Loader`'s."""

    def __init__(self, dataset: RankDataset) -> None:
        opts: LoaderOptions = dataset.options
        if opts.pin_memory:
            raise UsageError("pin_memory is a torch DataLoader setting; the numpy loader has none: drop it")
        self.num_workers = int(opts.num_workers or 0)
        self.persistent_workers = opts.persistent_workers is None or bool(opts.persistent_workers)
        self.depth = int(opts.prefetch_factor or 2)
        self.timeout = float(opts.timeout)
        ctx = opts.multiprocessing_context or DEFAULT_START_METHOD
        self.context = multiprocessing.get_context(ctx) if isinstance(ctx, str) else ctx
        self._procs: WorkerProcesses | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        super().__init__(dataset)

    def _open_epoch(self) -> EpochBatches:
        ds = self.dataset
        if self.num_workers == 0:
            return EpochBatches(ds.worker_batches(0, in_worker=False).__next__, lambda clean: None)
        procs = self._workers()
        procs.start_epoch(ds.position)
        total = len(ds) - ds.start_batch
        count = [0]

        def next_batch() -> dict[str, Any]:
            i = count[0]
            if i >= total:
                raise StopIteration
            batch = procs.batch(i % self.num_workers)
            count[0] = i + 1
            return batch

        def end(clean: bool) -> None:
            if procs.closed:  # close() came first (the iterator was dropped after it): nothing left to end,
                return  # and self.close() now would stop a newer epoch's workers
            if clean and count[0] == total and self.persistent_workers:
                for k in range(self.num_workers):  # each worker's end marker: the queues are empty again
                    if procs.receive(k)[0] != "end":
                        self.close()
                        return
                return
            self.close()  # half-read, failed, or not persistent: the next epoch starts fresh workers

        return EpochBatches(next_batch, end)

    def _finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        batch.pop("_fields", None)  # field entries stay numpy arrays and lists (docs/fields.md)
        if "data" in batch:
            batch["image"] = raw_views(batch["data"], batch["offsets"])
        return batch

    def _workers(self) -> WorkerProcesses:
        if self._procs is None or self._procs.closed:
            self._procs = WorkerProcesses(self.dataset, self.num_workers, self.context, self.depth, self.timeout)
            self._finalizer = weakref.finalize(self, self._procs.close)
        return self._procs

    def close(self) -> None:
        """Stop the worker processes now (the next epoch starts new ones). No-op without workers."""
        if self._finalizer is not None:
            self._finalizer()
        self._procs = self._finalizer = None


def make_numpy_loader(path: str | os.PathLike[str] | Mix | Sequence[Any], batch_size: int,
                      **settings: Any) -> NumpyLoader:
    """A per-rank iterable of numpy batch dicts; the keyword settings are :func:`~stager.loader.make_loader`'s
    (``pin_memory`` excepted; ``multiprocessing_context`` defaults to ``"spawn"``, ``prefetch_factor``
    is each worker's queue depth); ``path`` may be a mix, as there. Imports no torch."""
    options = LoaderOptions.from_kwargs(settings, batch_size=batch_size)
    if is_mix(path):
        return NumpyLoader(MixDataset(path, options))
    if options.composition is not None:
        raise UsageError(f"composition={options.composition!r} applies to a mix of datasets; {path} is one dataset")
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"expected a dataset path, a mix file or a list of streams, got {type(path).__name__}")
    return NumpyLoader(RankDataset(path, options))

"""``LoaderBase``: what every transport's loader shares: epochs, batch counting, resume state, stats.

A loader hands out one rank's batches of :class:`~stager.loader.rank.RankDataset`, epoch after
epoch. Which process builds them is the transport's business: torch's DataLoader
(:class:`~stager.loader.Loader`) or plain multiprocessing (:class:`~stager.loader.numpy_loader.NumpyLoader`).
Everything else is here, once: the epoch's phases (begin: next epoch or the resume position; open
the transport's :class:`EpochBatches`; receive each batch: check the round robin, count, finish;
end), the padding and drop counts, the stats, and the resume state
(:class:`~stager.loader.state.LoaderState`, elastic resume included). This module imports no torch.

A subclass provides ``num_workers`` (set before calling ``LoaderBase.__init__``), :meth:`_open_epoch`,
:meth:`_finish` (a received batch as its user sees it) and :meth:`close`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from stager.errors import UsageError
from stager.loader.rank import RankDataset
from stager.loader.state import LoaderState
from stager.loader.stats import LoaderStats

log = logging.getLogger("stager.loader")


class EpochBatches:
    """One epoch's batch source: ``next_batch()`` (raises StopIteration at the end) and ``end(clean)``.

    ``clean``: the consumer stopped between batches (a break, or the epoch's end); otherwise a worker
    error or a broken contract interrupted it.
    """

    def __init__(self, next_batch: Callable[[], dict[str, Any]], end: Callable[[bool], None]) -> None:
        self.next_batch = next_batch
        self.end = end


class LoaderBase:
    """Iterable of one rank's batch dicts over ``dataset``, with epochs, ``len``, resume state and stats.

    ``len(loader)`` is the number of batches per rank in the current epoch, equal on every rank.
    After a complete pass the next ``iter()`` moves to the next epoch unless ``set_epoch`` is
    called; ``set_epoch(e)`` with the epoch of a just-loaded state keeps the resume position. A state
    saved at an epoch's end makes the next ``iter()`` the next epoch (``epoch`` says so), unless
    ``set_epoch(e)`` pins the saved one (then its pass is empty), so loops with and without
    ``set_epoch`` resume alike.
    A world detected rather than passed follows the initialised process group (:meth:`_check_world`).
    """

    num_workers: int

    def __init__(self, dataset: RankDataset) -> None:
        self.dataset = dataset
        self._done = 0
        self._resume_pending = False
        self._completed = False
        # A loaded state at an epoch's end: the next pass is the next epoch, unless set_epoch pins this one.
        self._at_end = False
        self._parent: dict[str, Any] | None = None
        # The pass (iterator) now open, by number (0: none). A loader makes one pass at a time; a newer
        # iter() replaces an open one (see __iter__).
        self._passes = 0
        self._open_pass = 0
        # Its batch source, weakly: the pass's generator owns it (a strong reference would be a cycle through
        # the transport's closures, keeping a dropped loader's workers alive until the cyclic GC ran).
        self._open_batches: weakref.ref[EpochBatches] | None = None
        self._stats = LoaderStats(rank=dataset.rank, world_size=dataset.world_size, **dataset.origin())
        self._log_plan()

    # ---- the transport ------------------------------------------------------------------------------
    def _open_epoch(self) -> EpochBatches:
        """The epoch's batch source, from ``dataset.start_batch`` on."""
        raise NotImplementedError

    def _finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A received batch as the user sees it (in place)."""
        return batch

    def close(self) -> None:
        """Stop the transport's worker processes, if any (the next epoch starts new ones)."""

    def _log_plan(self) -> None:
        ds = self.dataset
        per = int(ds.batch_sizes().sum())
        total = ds.samples_in_epoch()
        if ds.group.node_partitioned:
            log.info(
                "stager.loader: node-partitioned staged copy: rank %d reads only this node's %d samples "
                "(node-local shuffle), %d per rank on every node",
                ds.rank,
                total,
                per,
            )
        world = ds.group.world_size
        padded = max(0, world * per - total)
        dropped = max(0, total - world * per)
        if padded:
            log.info("stager.loader: epoch padded with %d repeated samples so all %d ranks get %d", padded, world, per)
        if dropped:
            log.info("stager.loader: drop_last drops %d samples per epoch (%d per rank kept)", dropped, per)

    # ---- epoch / length ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next pass makes or continues (after loading a state saved at an epoch's end: the next)."""
        return self.dataset.epoch + int(self._at_end)

    def set_epoch(self, epoch: int) -> None:
        self._check_world()
        if self._resume_pending and epoch == self.dataset.epoch:
            self._at_end = False  # the loop pinned the epoch it resumes: keep the position
            return
        self._at_end = False
        self._resume_pending = False
        self._completed = False
        self._done = 0
        self._parent = None
        self.dataset.set_epoch(epoch)

    @property
    def batches_done(self) -> int:
        """Batches of the current epoch handed out (``len(self)`` once the epoch is complete)."""
        return self._done

    def skip_to(self, batch: int) -> None:
        """Start the next pass at batch ``batch`` of its epoch, without reading the batches before it.

        Absolute: after :meth:`load_state_dict` at that same batch nothing more is skipped. The epoch is
        the one the next ``iter()`` would make (the next one after a complete pass). Accelerate's
        ``skip_first_batches`` calls this (:mod:`stager.loader.frameworks.accelerate`).
        """
        self._check_world()
        self._advance_if_done()
        if not 0 <= batch <= len(self.dataset):
            raise UsageError(f"cannot skip to batch {batch} of an epoch of {len(self.dataset)} batches")
        self._resume_at(batch, self._parent)

    @property
    def fields(self) -> tuple[str, ...]:
        """The keys every batch has, in every decode mode (raw batches from workers add ``data``/``offsets``)."""
        return self.dataset.batch_fields()

    def __len__(self) -> int:
        self._check_world()
        return len(self.dataset)

    def _check_world(self) -> None:
        """Follow the initialised process group when the dataset's detected world no longer matches it
        (:meth:`~stager.loader.rank.RankDataset.rebind_world`): new stats, the workers restarted. A state
        loaded for the old world is refused: load it once the process group is up."""
        if not self.dataset.rebind_world():
            return
        self.close()
        self._stats.rank, self._stats.world_size = self.dataset.rank, self.dataset.world_size
        if self._resume_pending:
            self._resume_pending = False
            raise UsageError(
                "stager.loader: a loader state was loaded before the process group was initialised and the world "
                f"changed to rank {self.dataset.rank} of {self.dataset.world_size}: load the state after "
                "init_process_group (in the rank's own process)"
            )
        self._log_plan()

    # ---- iteration ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """One pass: the epoch's batches from the position on.

        A loader makes one pass at a time. An ``iter()`` while another iterator of it is mid-epoch
        (kept by the caller, or dropped but not yet finalised, as tf.data's generator is) replaces that
        pass, as a torch DataLoader's new iterator resets its persistent workers: the new pass starts
        the epoch afresh, and the replaced iterator raises a one-line :class:`UsageError` if it is
        advanced again (two iterators sharing one position would each skip the other's batches).
        """
        self._check_world()
        if self._open_pass:
            self._open_pass = 0
            replaced = self._open_batches() if self._open_batches is not None else None
            if replaced is not None:  # fresh (non-persistent) workers are that pass's own: end them now, not
                replaced.end(False)  # when the caller drops the replaced iterator
            self.close()  # its workers hold the replaced pass's batches: this pass starts fresh ones
        if not self._begin_epoch():
            return
        padding = self._padded_positions()
        batches = self._open_epoch()
        self._passes += 1
        me = self._open_pass = self._passes
        self._open_batches = weakref.ref(batches)
        st = self._stats
        st.start()
        clean_end = False
        try:
            while (batch := self._receive(batches, padding)) is not None:
                st.stop()
                clean_end = True  # a consumer leaving here (break, GeneratorExit) leaves a sane pool
                at = (self.dataset.epoch, self._done)
                yield batch
                if self._open_pass != me:
                    raise UsageError(
                        "stager.loader: this iterator's pass was replaced by a newer iter() of the same loader "
                        "(a loader makes one pass at a time): iterate the newest one"
                    )
                if (self.dataset.epoch, self._done) != at:
                    if at[1] == len(padding):  # the pass had handed out its last batch: it ends as it would have
                        return
                    raise UsageError(
                        "stager.loader: set_epoch, skip_to or load_state_dict moved the loader while this iterator "
                        "was mid-epoch: start a new iter() of the loader after moving it"
                    )
                clean_end = False
                st.start()
            clean_end = True
        finally:
            st.stop()
            if self._open_pass == me:
                self._open_pass = 0
                self._open_batches = None
                batches.end(clean_end)
            else:  # replaced: end only what is this pass's own (close() already stopped shared workers)
                batches.end(False)

    def _advance_if_done(self) -> None:
        """Move to the next epoch when this one is done: after a complete pass, or after loading a state saved
        at its end (unless ``set_epoch`` pinned that epoch)."""
        if (self._completed and not self._resume_pending) or self._at_end:
            self.set_epoch(self.dataset.epoch + 1)

    def _begin_epoch(self) -> bool:
        """Move to the pass to make (the next epoch after a finished one, else the position); False: none left."""
        self._advance_if_done()
        if not self._resume_pending:
            self._done = 0
        self._resume_pending = False
        self._completed = False
        self.dataset.start_batch = self._done
        if self._done >= len(self.dataset):
            self._completed = True
            return False
        return True

    def _receive(self, batches: EpochBatches, padding: np.ndarray) -> dict[str, Any] | None:
        """The next batch, checked and counted (None at the epoch's end)."""
        st = self._stats
        t = time.perf_counter()
        try:
            batch = batches.next_batch()
        except StopIteration:
            return None
        st.wait_seconds += time.perf_counter() - t
        w = batch.pop("_w")
        if int(w["batch"]) != self._done:  # the round-robin contract, checked on every batch
            raise RuntimeError(f"stager.loader: expected batch {self._done}, worker sent {w['batch']}")
        st.add_worker(w)
        st.batches += 1
        st.samples += len(batch["key"])
        st.padded += int(padding[self._done])
        self._finish(batch)
        self._done += 1
        if self._done == len(padding):
            self._completed = True
        return batch

    def _padded_positions(self) -> np.ndarray:
        """Per batch of this rank: how many of its samples are padding repeats (int64, (batches,))."""
        ds = self.dataset
        if self._dropped_or_padded() >= 0:
            return np.zeros(len(ds), dtype=np.int64)  # nothing padded: skip planning here
        return ds.batch_padding()

    def _dropped_or_padded(self) -> int:
        """Samples of the epoch no rank sees (> 0: dropped) or, negative, the repeats that pad it."""
        ds = self.dataset
        return ds.samples_in_epoch() - ds.group.world_size * int(ds.batch_sizes().sum())

    # ---- observability ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-rank figures: samples/s, bytes/s, I/O vs decode seconds, padded, skipped, staged or source."""
        d = self._stats.to_dict()
        d["dropped"] = max(0, self._dropped_or_padded())
        return d

    # ---- resume ----------------------------------------------------------------------------------------
    def _plan_key(self) -> str:
        return self.dataset.plan_key()

    def state_dict(self) -> dict[str, Any]:
        """The position between batches: a plain dict (see :class:`~stager.loader.state.LoaderState`)."""
        self._check_world()
        ds = self.dataset
        st = LoaderState(
            dataset_id=ds.dataset_id,
            epoch=ds.epoch,
            batches_done=self._done,
            seed=ds.seed,
            world_size=ds.world_size,
            num_workers=self.num_workers,
            batch_size=ds.batch_size,
            mode=ds.mode,
            drop_last=ds.drop_last,
            rank=ds.rank,
            buffer_samples=ds.buffer_samples(max(1, self.num_workers)),
            plan_key=self._plan_key(),
            parent=self._parent,
        )
        return st.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next ``iter()`` yields exactly the epoch's remaining batches.

        Same world size and worker count: the plan is identical and the position is a batch count.
        Different world size or worker count with the same global batch (``batch_size *
        world_size``): *elastic* resume. The samples the old ranks consumed are reconstructed from
        the old plan (all ranks consume batches in lockstep under DDP, so one rank's count is
        everyone's), and the rest of the epoch, in the old epoch order, is re-planned over the new
        world. Other changes are refused.
        """
        self._check_world()
        st = LoaderState.from_dict(state)
        self._check_same_order(st)
        ds = self.dataset
        same = (
            st.world_size == ds.world_size
            and st.num_workers == self.num_workers
            and st.batch_size == ds.batch_size
            and st.buffer_samples == ds.buffer_samples(max(1, self.num_workers))
        )
        if same:
            ds.resume(st.epoch, self._remaining(st.parent) if st.parent is not None else None)
            if st.batches_done > len(ds):
                raise UsageError(f"loader state is at batch {st.batches_done} of an epoch of {len(ds)} batches")
            self._resume_at(st.batches_done, st.parent)
            self._at_end = st.batches_done == len(ds)
            return
        if st.batch_size * st.world_size != ds.batch_size * ds.world_size:
            raise UsageError(
                f"cannot resume: the state's global batch is {st.batch_size}x{st.world_size}, this loader's is "
                f"{ds.batch_size}x{ds.world_size}; keep batch_size*world_size constant for an elastic resume"
            )
        if ds.group.node_partitioned:
            raise UsageError(
                "cannot resume elastically over a node-partitioned staged copy; re-stage for the new world size"
            )
        remaining = self._remaining(st.to_dict())
        ds.resume(st.epoch, remaining)
        self._resume_at(0, st.to_dict())
        self._at_end = len(ds) == 0
        log.info(
            "stager.loader: elastic resume of epoch %d: %d samples left, re-planned over world size %d",
            st.epoch,
            len(remaining),
            ds.world_size,
        )

    def _check_same_order(self, st: LoaderState) -> None:
        """Refuse a state of another dataset, seed, shuffle mode, drop_last or run layout (naming each)."""
        ds = self.dataset
        mismatch = [
            f"{name}: state {a!r}, loader {b!r}"
            for name, a, b in (
                ("dataset_id", st.dataset_id, ds.dataset_id),
                ("seed", st.seed, ds.seed),
                ("shuffle mode", st.mode, ds.mode),
                ("drop_last", st.drop_last, ds.drop_last),
                ("run layout", st.plan_key, self._plan_key()),
            )
            if a != b
        ]
        if mismatch:
            raise UsageError("loader state does not match this loader (" + "; ".join(mismatch) + ")")

    def _resume_at(self, batches_done: int, parent: dict[str, Any] | None) -> None:
        self._parent = parent
        self._done = batches_done
        self._resume_pending = True
        self._completed = False

    def _remaining(self, state: dict[str, Any]) -> np.ndarray:
        """The epoch sequence minus what every rank of ``state``'s world consumed (old order kept)."""
        st = LoaderState.from_dict(state)
        return self.dataset.unconsumed(st, self._remaining(st.parent) if st.parent is not None else None)



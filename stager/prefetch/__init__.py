"""Clairvoyant prefetch beside training (docs/scaling.md).

Modules: :mod:`.prefetcher` (``Prefetcher``: Belady's MIN over the loader's own read schedule,
:mod:`stager.order.reads`, within a byte budget; ``prepare_dest``, ``rank_reads``), :mod:`.reports`
(the progress files ranks write: ``ProgressReporter``, ``loader_config``), :mod:`.follow` (the
``stager stage --follow`` process: ``follow`` runs a ``Follower``).
"""

from stager.prefetch.prefetcher import (
    NEVER,
    EpochReads,
    Prefetcher,
    PrefetchStats,
    Read,
    prepare_dest,
    rank_reads,
    remove_fetch_partials,
)
from stager.prefetch.reports import (
    DONE_MARKER,
    PROGRESS_DIR,
    ProgressReporter,
    loader_config,
    loader_read_ahead,
    mark_done,
    read_progress,
    read_reports,
    report_progress,
)

__all__ = [
    "DONE_MARKER",
    "NEVER",
    "PROGRESS_DIR",
    "EpochReads",
    "PrefetchStats",
    "Prefetcher",
    "ProgressReporter",
    "Read",
    "loader_config",
    "loader_read_ahead",
    "mark_done",
    "prepare_dest",
    "rank_reads",
    "read_progress",
    "read_reports",
    "remove_fetch_partials",
    "report_progress",
]

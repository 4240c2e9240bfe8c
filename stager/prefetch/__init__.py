"""Clairvoyant prefetch beside training (docs/scaling.md): the prefetcher, the ranks' progress
reports and the ``stage --follow`` process."""

from stager.prefetch.prefetcher import (
    DONE_MARKER,
    NEVER,
    PROGRESS_DIR,
    EpochReads,
    Prefetcher,
    PrefetchStats,
    ProgressReporter,
    Read,
    loader_config,
    loader_read_ahead,
    mark_done,
    prepare_dest,
    rank_reads,
    read_progress,
    read_reports,
    remove_fetch_partials,
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

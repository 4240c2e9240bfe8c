"""Starting worker processes with ``fork`` without their garbage collector copying the parent's heap.

A forked worker shares the parent's memory page by page until either side writes to a page. CPython's
cyclic garbage collector writes to every object it examines (its reference-count scratch field), so
the first *full* collection in a worker touches every container object inherited from the parent
(a process that imported torch holds ~170,000) and makes the kernel copy each page they sit on.
When that collection comes depends only on the allocation counters the worker inherits: a few
hundred more objects in the parent (a module more) put it on the worker's first steps, before its
first batch: ~0.1 s of CPU per worker and ~40 MB of copied pages, whatever the dataset's size
(docs/benchmarks.md, "Loader start-up (issue 40)").

:func:`frozen_for_fork` moves every object the parent holds into the collector's permanent
generation (``gc.freeze()``, what the Python documentation recommends before a ``fork``) while the
workers start, and back afterwards (``gc.unfreeze()``), so the parent collects as before while each
worker keeps them frozen: its collections examine only what the worker itself allocated. A program
that froze its heap itself (``gc.get_freeze_count() > 0``) is left alone: unfreezing would undo its
own freeze. With ``spawn`` or ``forkserver`` nothing is inherited and the freeze changes nothing.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_for_fork() -> Iterator[None]:
    """Inside: the parent's heap is frozen (``gc.freeze``), so processes forked here inherit it frozen;
    on exit the parent's objects are unfrozen again (into the oldest generation, where nearly all of
    them already were)."""
    if gc.get_freeze_count():  # the program manages its own freeze
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

"""What a process forked from a training process must leave alone: the DataLoader workers of its parent.

A plain ``os.fork()`` copies the Loader with its torch DataLoader iterator (a persistent pool's lives as
long as the Loader, so with stager's default of persistent workers there is one at any time after the
first epoch). The workers are the parent's children, not the child's, yet two things in the child act
on them as its own: torch's iterator, when the child collects it (dropping the Loader, or at exit), sets
the workers' shared "done" event and queues their stop markers, so the *parent's* workers exit; and
multiprocessing's exit handler terminates every daemonic process it lists as a child (the parent's
list, copied), so the parent's next batch fails with "DataLoader worker ... is killed by signal:
Terminated". :func:`track` registers each iterator stager starts; after a fork, the child marks its
copies shut down and drops their workers from its list of children (``os.register_at_fork``). The child
itself starts workers of its own if it iterates (:mod:`stager.loader.persistent`). multiprocessing's own
children (``Process.start()`` with ``fork``) already begin with no children and end with ``os._exit``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import weakref
from typing import Any

_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()


def track(iterator: Any) -> None:
    """Register a torch multiprocessing DataLoader iterator (one that has ``_workers``) started here."""
    if hasattr(iterator, "_workers"):
        _ITERATORS.add(iterator)


def _disown() -> None:
    """In a forked child: the tracked iterators' workers are the parent's; leave them running."""
    children = getattr(multiprocessing.process, "_children", None)
    for it in list(_ITERATORS):
        it._shutdown = True  # torch's _shutdown_workers (run by __del__) returns at once
        for w in getattr(it, "_workers", ()):
            if children is not None:
                children.discard(w)
    _ITERATORS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown)

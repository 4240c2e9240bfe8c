"""Collective staging (``stager stage --collective``): each byte read from the shared file system once.

One process per node; together they read disjoint shares of SRC and all-gather them, so every node
ends with the whole dataset in its DEST. :func:`stage_collective` is the API (:func:`run_collective`
the same with a :class:`~stager.stage.options.CollectiveOptions`); the modules, lowest first:
:mod:`~stager.stage.collective.plan` (read shares and stream layouts, pure),
:mod:`~stager.stage.collective.io` (a share read as one byte stream; streams written back into
verified files), :mod:`~stager.stage.collective.group` (rendezvous, heartbeats, naming a failed
node), :mod:`~stager.stage.collective.exchange` (the pipelined all-gather loop),
:mod:`~stager.stage.collective.result` and :mod:`~stager.stage.collective.run` (the phases).
"""

from stager.stage.collective.result import CollectiveResult
from stager.stage.collective.run import run_collective, stage_collective
from stager.stage.options import CollectiveOptions

__all__ = ["CollectiveOptions", "CollectiveResult", "run_collective", "stage_collective"]

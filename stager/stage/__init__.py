"""``stager stage``: copy a packed dataset onto node-local storage, verified, resumable, once per node.

The public face is :func:`stage` (and ``stager stage`` on the command line); what it returns is a
:class:`StageResult`. Inside, one module per step of a run, each a layer above the previous:

* :mod:`~stager.stage.options`: :class:`StageOptions`, what the caller asks, validated once;
* :mod:`~stager.stage.names`: the names of the bookkeeping files in DEST;
* :mod:`~stager.stage.plan`: :func:`plan_stage`, what this node stages where (:class:`StagePlan`);
* :mod:`~stager.stage.journal`: the append-only record of verified files a rerun resumes from;
* :mod:`~stager.stage.copier`: the parallel, verifying copy streams;
* :mod:`~stager.stage.dest`: DEST's bookkeeping: done check, claim, free space, staged manifest,
  shared-mode barrier, receipt;
* :mod:`~stager.stage.unpack`: ``--unpack``'s ImageFolder tree;
* :mod:`~stager.stage.run`: :func:`stage` as named phases;
* :mod:`~stager.stage.collective`: ``--collective``, each byte read from SRC once for all nodes.

Node identity (``--node``/Slurm/torchrun) is :func:`stager.world.resolve_node`, re-exported here.
"""

from stager.stage.options import DEFAULT_UNPACK_DIR, NodeOptions, StageOptions
from stager.stage.plan import StagePlan, plan_stage
from stager.stage.result import StageResult
from stager.stage.run import run_stage, stage
from stager.world import NodeIdentity, resolve_node

__all__ = [
    "DEFAULT_UNPACK_DIR",
    "NodeIdentity",
    "NodeOptions",
    "StageOptions",
    "StagePlan",
    "StageResult",
    "plan_stage",
    "resolve_node",
    "run_stage",
    "stage",
]

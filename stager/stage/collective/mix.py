"""``stager stage MIX.yaml DEST --collective``: a mix's streams staged collectively, one group for all of them.

The nodes form their group once (:func:`~stager.stage.collective.run.form_group`) and stage the
streams one after another through it (:func:`~stager.stage.collective.run.run_collective` with
``group=``), in the mix's order on every node, so each stream's bytes are read from SRC once in total
as for one dataset. On a single node, or when the group cannot form and ``--fallback direct``, every
stream is staged plainly from its source instead (the reason among the warnings). Where the streams
land and the mix receipt: :mod:`stager.stage.mix`.
"""

from __future__ import annotations

import os
from dataclasses import replace

from stager.mix import Mix, Stream
from stager.stage.collective.group import Group
from stager.stage.collective.result import CollectiveResult
from stager.stage.collective.run import form_group, run_collective
from stager.stage.mix import MixStageResult, check_sources, stage_streams, stream_stage_options
from stager.stage.options import CollectiveOptions, NodeOptions
from stager.stage.result import StageResult
from stager.stage.run import run_stage


def run_collective_mix(mix: Mix, dest: str | os.PathLike[str] | None, options: CollectiveOptions) -> MixStageResult:
    """Stage every stream of ``mix`` collectively through one group (module docstring)."""
    check_sources(mix, options.stage)
    identity = options.stage.node.resolve()
    options = replace(options, stage=replace(options.stage, node=NodeOptions.of(identity)))
    group, warnings = form_group(options)
    fell_back = group is None and identity.num_nodes > 1

    def stage_one(s: Stream, where: str | None) -> CollectiveResult | StageResult:
        opts = replace(options, stage=stream_stage_options(s, options.stage))
        if fell_back:
            return run_stage(s.path, where, opts.stage)
        return run_collective(s.path, where, opts, group=group)

    failed = True
    try:
        res = stage_streams(mix, dest, stage_one)
        failed = False
    finally:
        _close(group, failed)
    res.warnings = warnings + res.warnings
    return res


def _close(group: Group | None, failed: bool) -> None:
    if group is not None:
        group.close(failed=failed)

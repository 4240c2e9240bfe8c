"""``stager stage``: copy a packed dataset onto node-local storage, verified, resumable, once per node."""

from stager.stage.run import DEFAULT_UNPACK_DIR, StagePlan, StageResult, plan_stage, resolve_node, stage

__all__ = ["DEFAULT_UNPACK_DIR", "StagePlan", "StageResult", "plan_stage", "resolve_node", "stage"]

"""``stager stage``: copy a packed dataset onto node-local storage, verified, resumable, once per node."""

from stager.stage.plan import DEFAULT_UNPACK_DIR, StagePlan, plan_stage, resolve_node
from stager.stage.result import StageResult
from stager.stage.run import stage

__all__ = ["DEFAULT_UNPACK_DIR", "StagePlan", "StageResult", "plan_stage", "resolve_node", "stage"]

"""Collective staging: each byte read from the shared file system once, moved between nodes."""

from stager.stage.collective.run import CollectiveResult, stage_collective

__all__ = ["CollectiveResult", "stage_collective"]

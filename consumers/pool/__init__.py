"""A worker process's models under a memory budget: ``ModelPool`` (load on demand, single-flight, LRU eviction,
back-off after a failed load), ``ServedVersions`` (what one worker of a model serves) and the budget's parsing and
sizes (``fleet.consumers.pool.budget``). Nothing here imports torch."""

from fleet.consumers.pool.budget import budget_bytes, parse_budget
from fleet.consumers.pool.pool import Key, ModelPool
from fleet.consumers.pool.versions import ServedVersions, by_version

__all__ = ["Key", "ModelPool", "ServedVersions", "budget_bytes", "by_version", "parse_budget"]

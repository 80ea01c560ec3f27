"""Prefect tasks: each a thin wrapper around one mergecore call, with retries and cache policies.

Only merge_unit is cached (per unit of the plan: a layer group, or an output file on object storage; across runs); the others look at files and run every time,
so they carry NO_CACHE rather than Prefect's default key (which hashes their inputs and source).
"""

from .checkpoint import discover_shards, plan_groups, prepare_staging, validate_metadata
from .hub import push_to_hub
from .merge import finalize_model, merge_unit
from .verify import FolderChecks, engine_check, run_equivalence_tests

__all__ = ["discover_shards", "validate_metadata", "plan_groups", "prepare_staging", "merge_unit",
           "finalize_model", "run_equivalence_tests", "engine_check", "push_to_hub", "FolderChecks"]

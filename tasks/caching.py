"""Where task results and locks live, and the cache policy of merge_group.

Results are persisted (so a new run of the same promotion reuses finished groups) under
`CKPTFLOW_RESULTS` or, by default, a hidden folder beside the target. SERIALIZABLE isolation with
a file lock makes concurrent runs on one checkpoint compute each group once; the lock ends with its
holder's process, so a killed run never blocks the next (see locks.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect.cache_policies import CachePolicy

from mergecore.fingerprints import group_key

from .locks import FlockLockManager
from .sources import prepared_for


def results_folder(target: str) -> Path:
    configured = os.environ.get("CKPTFLOW_RESULTS")
    if configured:
        return Path(configured).expanduser().absolute()
    from mergecore.remote_output import is_remote, shadow_folder
    from mergecore.storage import Location

    if is_remote(target):  # beside the target's local shadow folder
        shadow = shadow_folder(Location.of(target))
        return shadow.parent / f".{shadow.name}.ckptflow-results"
    target_path = Path(target).absolute()
    return target_path.parent / f".{target_path.name}.ckptflow-results"


def merge_group_key(context, parameters: dict) -> str:
    """Fingerprints of the files the group reads + its slice of the plan + dtype + code + staging path."""
    prepared = prepared_for(parameters["ref"])
    return "merge-group-" + group_key(prepared.source, parameters["plan"], parameters["group"], parameters["staging"])


def group_cache_policy(target: str) -> CachePolicy:
    locks = FlockLockManager(lock_files_directory=results_folder(target) / "locks")
    return CachePolicy.from_cache_key_fn(merge_group_key).configure(isolation_level="SERIALIZABLE", lock_manager=locks)

"""Where task results and locks live, and the cache policy of merge_unit.

Results are persisted (so a new run of the same promotion reuses finished groups) under
`CKPTFLOW_RESULTS` or, by default, a hidden folder beside the target. SERIALIZABLE isolation with
a file lock makes concurrent runs on one checkpoint compute each group once; the lock ends with its
holder's process, so a killed run never blocks the next (see locks.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect.cache_policies import CachePolicy

from mergecore.engine.fingerprints import unit_key

from .locks import FlockLockManager
from .sources import opened


def results_folder(target: str) -> Path:
    configured = os.environ.get("CKPTFLOW_RESULTS")
    if configured:
        return Path(configured).expanduser().absolute()
    from mergecore.targets import open_target

    return open_target(target).results_folder


def merge_unit_key(context, parameters: dict) -> str:
    """Fingerprints of the files the unit reads + its slice of the plan + dtype + code + where it is staged."""
    source = opened(parameters["request"], parameters["discovered"])
    return "merge-unit-" + unit_key(source, parameters["planned"].plan, parameters["unit"], parameters["staged"].staging)


def unit_cache_policy(target: str) -> CachePolicy:
    """Keyed by `merge_unit_key`; one run computes each key at a time (SERIALIZABLE, with locks in the results
    folder)."""
    locks = FlockLockManager(lock_files_directory=results_folder(target) / "locks")
    return CachePolicy.from_cache_key_fn(merge_unit_key).configure(isolation_level="SERIALIZABLE", lock_manager=locks)

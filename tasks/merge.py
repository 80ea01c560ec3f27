"""Merging one layer group, and finishing the folder."""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore import CheckpointError, MergePlan
from mergecore import finalize as finalize_folder
from mergecore import merge_group as merge_one_group
from mergecore.merge import nonfinite_error, nonfinite_found, refresh_published
from mergecore.output import BackgroundHashes
from mergecore.writer import room_checked

from .caching import results_folder
from .sources import CheckpointRef, prepared_for


def transient_io_error(task, task_run, state) -> bool:
    """Retry OS/network errors (fsspec raises OSError subclasses); bad input and bugs fail at once."""
    try:
        state.result()
    except OSError:
        return True
    except BaseException:
        return False
    return False


@task(name="merge_group", retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_io_error,
      persist_result=True, task_run_name="merge_group[{group}]")
def merge_group(ref: CheckpointRef, plan: MergePlan, group: str, staging: str, workers: int = 1) -> dict:
    """Read one group's slices from every rank, convert, and write them at their final offsets."""
    if not Path(staging).exists():
        raise CheckpointError(f"{staging}: staging folder is gone and group {group} has no cached result; "
                              "rerun with overwrite=True to rebuild the target")
    receipt = merge_one_group(prepared_for(ref).source, plan, group, Path(staging), workers, on_nonfinite=ref.on_nonfinite)
    if receipt.get("nonfinite"):
        from prefect import get_run_logger

        get_run_logger().warning("non-finite weights written (on_nonfinite=warn): %s", receipt["nonfinite"])
    return receipt


@task(name="finalize_model", cache_policy=NO_CACHE)
def finalize_model(ref: CheckpointRef, staging: str, target: str, overwrite: bool, receipts: list[dict],
                   hashes: BackgroundHashes | None = None) -> dict:
    """Round-trip check against the shards, index/config/tokenizer/manifest, atomic publish.

    `hashes`: the flow's hasher of the weight files, already through the groups merged so far; it
    finishes while the round-trip check runs. On a rerun whose weights are already published (no
    staging folder), only changed metadata is redone.
    """
    prepared = prepared_for(ref)
    found = nonfinite_found(receipts)
    if found and ref.on_nonfinite == "fail":  # cached receipts of an earlier "warn" run say so too
        raise nonfinite_error(found, prepared.source.location)
    with exclusive(results_folder(target) / "finalize.lock"), room_checked(Path(staging)):  # one publisher at a time
        if not Path(staging).exists():
            return refresh_published(prepared, Path(target))
        return finalize_folder(prepared, Path(staging), Path(target), overwrite, extra={"groups_written": receipts},
                               hashes=hashes)


@contextmanager
def exclusive(lock_file: Path):
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

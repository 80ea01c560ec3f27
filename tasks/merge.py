"""Merging one layer group, and finishing the folder."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from mergecore import CheckpointError, MergePlan
from mergecore import finalize as finalize_folder
from mergecore import merge_group as merge_one_group
from mergecore.merge import published_manifest

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
    return merge_one_group(prepared_for(ref).source, plan, group, Path(staging), workers)


@task(name="finalize_model")
def finalize_model(ref: CheckpointRef, staging: str, target: str, overwrite: bool, receipts: list[dict]) -> dict:
    """Round-trip check against the shards, index/config/tokenizer/manifest, atomic publish.

    A target that already holds this exact merge (a rerun after success) is left as it is.
    """
    prepared = prepared_for(ref)
    existing = published_manifest(Path(target), prepared)
    if existing and not Path(staging).exists():
        return {**existing, "reused": True}
    return finalize_folder(prepared, Path(staging), Path(target), overwrite, extra={"groups_written": receipts})

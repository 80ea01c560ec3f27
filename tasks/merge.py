"""Merging one layer group, and finishing the folder."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore import CheckpointError, MergePlan, MergeRequest
from mergecore import merge_group as merge_one_group
from mergecore.engine.merge import Planned, prepared_from
from mergecore.numbers.nonfinite import nonfinite_error, nonfinite_found
from mergecore.targets.output import BackgroundHashes
from mergecore.targets import open_target
from mergecore.proofs.verify import reference_checks

from .sources import opened


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
def merge_group(request: MergeRequest, discovered: dict, plan: MergePlan, group: str, staging: str) -> dict:
    """Read one group's slices from every rank, convert, and write them at their final offsets. One thread per
    group: the task runner runs groups side by side."""
    if not Path(staging).exists():
        raise CheckpointError(f"{staging}: staging folder is gone and group {group} has no cached result; "
                              "rerun with overwrite=True to rebuild the target")
    from prefect import get_run_logger

    receipt = merge_one_group(opened(request, discovered), plan, group, Path(staging), 1,
                              on_nonfinite=request.how.on_nonfinite, chunk_bytes=request.how.chunk_bytes)
    # where it ran: with a Dask runner, which worker process (the receipt stays free of it: it goes in the manifest)
    get_run_logger().info("group %s merged by process %d on %s", group, os.getpid(), socket.gethostname())
    if receipt.get("nonfinite"):
        get_run_logger().warning("non-finite weights written (on_nonfinite=warn): %s", receipt["nonfinite"])
    return receipt


@task(name="merge_file", retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_io_error,
      persist_result=True, task_run_name="merge_file[{file}]")
def merge_file(request: MergeRequest, discovered: dict, validated: dict, planned: Planned, file: str,
               weights_id: str) -> dict:
    """Stream one output file straight to the remote target, read it back and check it against the shards:
    the unit of work for object storage, where a file cannot be written at offsets by several tasks."""
    from prefect import get_run_logger

    prepared = prepared_from(request, opened(request, discovered), validated, planned)
    receipt = open_target(request.where.target).write_unit(prepared, file, {"weights_id": weights_id},
                                                           on_nonfinite=request.how.on_nonfinite,
                                                           chunk_bytes=request.how.chunk_bytes)
    get_run_logger().info("file %s merged by process %d on %s", file, os.getpid(), socket.gethostname())
    if receipt.get("nonfinite"):
        get_run_logger().warning("non-finite weights written (on_nonfinite=warn): %s", receipt["nonfinite"])
    return receipt


@task(name="finalize_model", cache_policy=NO_CACHE)
def finalize_model(request: MergeRequest, discovered: dict, validated: dict, planned: Planned, staged: dict,
                   receipts: list[dict], hashes: BackgroundHashes | None = None, reference: str | None = None,
                   trust_remote_code: bool = False) -> dict:
    """Round-trip check against the shards and, with a reference, its tensors and logits; then
    index/config/tokenizer/card/manifest and the publish. Nothing is published unless all pass.

    `staged`: what prepare_staging returned. `hashes`: the flow's hasher of the weight files, already through
    the groups merged so far; it finishes while the round-trip check runs. On a rerun whose weights are
    already published, only changed metadata is redone.
    """
    prepared = prepared_from(request, opened(request, discovered), validated, planned)
    checks = (lambda folder: reference_checks(folder, Path(reference), trust_remote_code)) if reference else None
    target, overwrite = open_target(request.where.target), request.where.overwrite
    with target.lock():  # held by the flow since staging (re-entrant): one writer publishes at a time
        if staged["published"]:  # the receipts are those of the run that wrote it, in its manifest
            check_nonfinite(request, prepared, (target.manifest() or {}).get("groups_written", []))
            return target.refresh(prepared, checks=checks)
        check_nonfinite(request, prepared, receipts)
        return target.finalize(prepared, staged, receipts, overwrite=overwrite, hashes=hashes, checks=checks)


def check_nonfinite(request: MergeRequest, prepared, receipts: list[dict]) -> None:
    """With on_nonfinite="fail", receipts of an earlier "warn" run (cached or published) that found NaN/Inf fail too.
    (on_nonfinite is not in merge_group's cache key: it changes no byte written.)"""
    found = nonfinite_found(receipts)
    if found and request.how.on_nonfinite == "fail":
        raise nonfinite_error(found, prepared.source.location)

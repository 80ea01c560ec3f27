"""Merging one unit of the plan, and finishing the folder."""

from __future__ import annotations

import os
import socket

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore import MergeRequest
from mergecore.engine.merge import Planned, prepared_from
from mergecore.numbers.nonfinite import nonfinite_error, nonfinite_found
from mergecore.engine.hashes import BackgroundHashes
from mergecore.assembly import assembly_for
from mergecore.targets.base import Staged

from .sources import opened
from .verify import FolderChecks


def transient_io_error(task, task_run, state) -> bool:
    """Retry OS/network errors (fsspec raises OSError subclasses); bad input and bugs fail at once."""
    try:
        state.result()
    except OSError:
        return True
    except BaseException:
        return False
    return False


def _run_name() -> str:
    """`merge_group[layers.0]` or `merge_file[model-00001-of-00002.safetensors]`: what the unit is, in the UI."""
    from prefect.runtime import task_run

    given = task_run.parameters
    return f"merge_{assembly_for(given['request'].where.target).unit.removesuffix('s')}[{given['unit']}]"


@task(name="merge_unit", retries=2, retry_delay_seconds=[1, 5], retry_condition_fn=transient_io_error,
      persist_result=True, task_run_name=_run_name)
def merge_unit(request: MergeRequest, discovered: dict, validated: dict, planned: Planned, unit: str,
               staged: Staged) -> dict:
    """Merge one unit of the plan into the request's target (`Assembly.write_unit`): a layer group read from every
    rank and written at its final offsets in the staged files, or, on object storage, one output file streamed,
    read back and checked against the shards. One thread per unit: the task runner runs them side by side."""
    from prefect import get_run_logger

    target = assembly_for(request.where.target)
    prepared = prepared_from(request, opened(request, discovered), validated, planned)
    receipt = target.write_unit(prepared, unit, staged, on_nonfinite=request.how.on_nonfinite,
                                chunk_bytes=request.how.chunk_bytes)
    # where it ran: with a Dask runner, which worker process (the receipt stays free of it: it goes in the manifest)
    get_run_logger().info("%s %s merged by process %d on %s", target.unit.removesuffix("s"), unit, os.getpid(),
                          socket.gethostname())
    if receipt.get("nonfinite"):
        get_run_logger().warning("non-finite weights written (on_nonfinite=warn): %s", receipt["nonfinite"])
    return receipt


@task(name="finalize_model", cache_policy=NO_CACHE)
def finalize_model(request: MergeRequest, discovered: dict, validated: dict, planned: Planned, staged: Staged,
                   receipts: list[dict], hashes: BackgroundHashes | None = None,
                   checks: FolderChecks = FolderChecks()) -> dict:
    """Round-trip check against the shards and the `checks` of the finished folder (a reference's tensors and
    logits, the serving engine); then index/config/tokenizer/card/manifest and the publish. Nothing is published
    unless all pass.

    `staged`: what prepare_staging returned. `hashes`: the flow's hasher of the weight files, already through
    the groups merged so far; it finishes while the round-trip check runs. On a rerun whose weights are
    already published, only changed metadata is redone.
    """
    prepared = prepared_from(request, opened(request, discovered), validated, planned)
    checks = checks or None
    target, overwrite = assembly_for(request.where.target), request.where.overwrite
    with target.lock():  # held by the flow since staging (re-entrant): one writer publishes at a time
        if staged.published:  # the receipts are those of the run that wrote it, in its manifest
            check_nonfinite(request, prepared, (target.target.manifest() or {}).get("groups_written", []))
            return target.refresh(prepared, checks=checks)
        check_nonfinite(request, prepared, receipts)
        return target.finalize(prepared, staged, receipts, overwrite=overwrite, hashes=hashes, checks=checks)


def check_nonfinite(request: MergeRequest, prepared, receipts: list[dict]) -> None:
    """With on_nonfinite="fail", receipts of an earlier "warn" run (cached or published) that found NaN/Inf fail too.
    (on_nonfinite is not in merge_group's cache key: it changes no byte written.)"""
    found = nonfinite_found(receipts)
    if found and request.how.on_nonfinite == "fail":
        raise nonfinite_error(found, prepared.source.location)

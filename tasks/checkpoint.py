"""Discover, validate and plan: metadata only, no tensor data is read. Each task's result is the next one's input
(plain data, shown in the Prefect UI); the opened checkpoint behind them is `sources.opened`."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore import MergeRequest
from mergecore.engine.merge import Planned, plan_merge, prepared_from, validate
from mergecore.assembly import assembly_for
from mergecore.targets.base import Staged

from .sources import discover, opened


@task(name="discover_shards", cache_policy=NO_CACHE)
def discover_shards(request: MergeRequest) -> dict:
    """Find the rank files, world size, mesh and huggingface/ folder behind a path or URL, with the input files'
    fingerprints (and their digest, `identity`) that every later task checks it reads."""
    return discover(request)


@task(name="validate_metadata", cache_policy=NO_CACHE)
def validate_metadata(request: MergeRequest, discovered: dict) -> dict:
    """All ranks present and consistent, shapes agree with config.json. Fails the run on bad input. Returns the
    config and tied-embeddings answer the plan is made from, and a summary."""
    return validate(request, opened(request, discovered))


@task(name="plan_groups", cache_policy=NO_CACHE)
def plan_groups(request: MergeRequest, discovered: dict, validated: dict) -> Planned:
    """Layer groups packed into output files; every header fixed before any data is read."""
    return plan_merge(request, opened(request, discovered), validated)


@task(name="prepare_staging", cache_policy=NO_CACHE)
def prepare_staging(request: MergeRequest, discovered: dict, validated: dict, planned: Planned) -> Staged:
    """Pre-size the output files beside the target (object storage: list the files to write); files kept from an
    interrupted run are reused. `published`: the target already holds this merge, so nothing is staged.

    Under the target's lock (the flow holds it from here to the publish; re-entrant in this process).
    """
    target = assembly_for(request.where.target)
    prepared = prepared_from(request, opened(request, discovered), validated, planned)
    with target.lock():
        return target.stage(prepared, request.where.overwrite, sources=[request.what.checkpoint])

"""Discover, validate and plan: metadata only, no tensor data is read."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergecore import MergePlan
from mergecore.engine.fingerprints import input_fingerprints
from mergecore.targets import open_target

from .sources import CheckpointRef, prepared_for, source_for


@task(name="discover_shards", cache_policy=NO_CACHE)
def discover_shards(ref: CheckpointRef) -> dict:
    """Find the rank files, world size, mesh and huggingface/ folder behind a path or URL."""
    source = source_for(ref)
    return {**source.describe(), "fingerprints": input_fingerprints(source)}


@task(name="validate_metadata", cache_policy=NO_CACHE)
def validate_metadata(ref: CheckpointRef) -> dict:
    """All ranks present and consistent, shapes agree with config.json. Fails the run on bad input."""
    prepared = prepared_for(ref)
    return {"tensors": len(prepared.source.tensors()), "model_type": prepared.config.get("model_type"),
            "architectures": prepared.config.get("architectures")}


@task(name="plan_groups", cache_policy=NO_CACHE)
def plan_groups(ref: CheckpointRef) -> MergePlan:
    """Layer groups packed into output files; every header fixed before any data is read."""
    return prepared_for(ref).plan


@task(name="prepare_staging", cache_policy=NO_CACHE)
def prepare_staging(ref: CheckpointRef, target: str, overwrite: bool) -> dict:
    """Pre-size the output files beside the target (object storage: list the files to write); files kept from an
    interrupted run are reused. `published`: the target already holds this merge, so nothing is staged.

    Under the target's lock (the flow holds it from here to the publish; re-entrant in this process).
    """
    target = open_target(target)
    with target.lock():
        return target.stage(prepared_for(ref), overwrite, sources=[ref.checkpoint])

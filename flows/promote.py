"""The promotion DAG, top to bottom:

discover_shards -> validate_metadata -> plan_groups -> prepare_staging -> merge_unit (mapped over the plan's units:
layer groups, or output files for an object-storage target)
(each passing its result on: the checkpoint's description and fingerprints -> the validated config -> the plan)
-> finalize_model (round-trip, reference tensors and logits, engine_check in vLLM, then the atomic publish)
-> run_equivalence_tests -> push_to_hub
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from mergecore import MergeRequest
from mergecore.numbers.nonfinite import nonfinite_found
from mergecore.model.card import markdown_text
from mergecore.engine.hashes import BackgroundHashes
from mergecore.storage import Location
from mergecore.assembly import assembly_for
from ckptflow.tasks import (FolderChecks, discover_shards, finalize_model, merge_unit, plan_groups, prepare_staging,
                            push_to_hub, run_equivalence_tests, validate_metadata)
from ckptflow.tasks.caching import results_folder, unit_cache_policy

from .runners import group_task_runner, seen_from_workers
from .pictures import publish_picture
from .progress import GroupProgress
from .reports import equivalence_rows, merge_report
from .requests import PromotionRequest
from .settings import in_process_settings


@flow(name="merge-checkpoint", task_runner=group_task_runner("threads"))
def merge_checkpoint(request: MergeRequest, checks: FolderChecks = FolderChecks()) -> dict:
    """Checkpoint -> verified Hugging Face folder at the request's target; groups are cached across runs. Each
    step's result is the next one's input (discovered -> validated -> planned). The run holds the target's lock
    from staging to publish (its tasks, here or on Dask workers, write under it)."""
    discovered = discover_shards(request)
    validated = validate_metadata(request, discovered)
    planned = plan_groups(request, discovered, validated)
    place = assembly_for(request.where.target)
    with place.lock():
        return merge_under_lock(request, place, discovered, validated, planned, checks)


def merge_under_lock(request: MergeRequest, place, discovered: dict, validated: dict, planned,
                     checks: FolderChecks) -> dict:
    """The rest of `merge_checkpoint`: stage, merge the target's units (layer groups into a folder's staged
    files; whole files, each written by one task, on object storage), finalize."""
    target, plan = place.url, planned.plan
    edges = as_is(discovered), as_is(validated), as_is(planned)  # large: not walked for futures
    discovered_as_is, validated_as_is, planned_as_is = edges
    staged = prepare_staging(request, discovered_as_is, validated_as_is, planned_as_is)
    units = place.units(plan)
    if staged.published:  # a rerun after success: the target holds every unit
        futures = {}
    else:
        merge = merge_unit.with_options(cache_policy=unit_cache_policy(target), result_storage=results_folder(target))
        rewritten = place.rewritten(plan, staged)
        futures = {merge.with_options(refresh_cache=unit in rewritten).submit(
            request, discovered_as_is, validated_as_is, planned_as_is, unit, staged): unit
            for unit in largest_first(plan, units)}
    hashing = place.hashes(staged)  # sha256 of the staged files as their units are written
    with GroupProgress(len(futures), f"{place.unit} merged into {target}") as progress, hashing as hashes:
        states, receipts = finished_groups(futures, units, plan, progress, hashes)
        manifest = finalize_model(request, discovered_as_is, validated_as_is, planned_as_is, staged, receipts, hashes,
                                  checks)
    cached = [u for u in units if not futures or states[u].name == "Cached"]  # reused: all of them
    written = receipts if futures else manifest.get("groups_written", [])  # reused: as the run that wrote them
    create_markdown_artifact(merge_report(discovered, plan, written, cached, manifest), key="merge-report",
                             description=f"merge of {markdown_text(discovered['location'])}")
    publish_picture(request, discovered, target)  # the checkpoint drawn ranks × groups: an artifact and an HTML page
    return {**manifest, "cached_groups": cached}


@flow(name="promote-checkpoint")
def promote_checkpoint(request: PromotionRequest) -> dict:
    """Merge a training checkpoint, prove it equal to what was trained, and publish it to the Hub.

    The flow takes one `PromotionRequest` (flows/requests.py), which the Prefect UI shows as a form and a rerun
    edits; it is checked by the library's rules as it is built, and the tasks receive its `MergeRequest`.

    NaN/Inf weights fail the run unless `how.on_nonfinite="warn"` (then they are listed in the result
    and the manifest). A LoRA checkpoint is published fused (`what.lora.output`: both, the default, also writes
    the PEFT adapter to `lora_adapter/` of the same folder and repo; fuse); a save_lora_only one needs
    `what.lora.base_model`.

    `runner.task_runner="dask"` merges the groups on a Dask cluster: the scheduler at `runner.dask_address`, or a
    LocalCluster of `runner.dask_workers` processes started for this run (see flows/runners.py).

    `how.quantize` (fp8-block, w8a16, w4a16) publishes the quantized model instead, proven within the scheme's
    bound (`how.quantize_ignore`: module patterns kept unquantized; see docs/quantization.md)."""
    merge = request.merge_request()
    where_run = request.runner
    runner = group_task_runner(where_run.task_runner, where_run.dask_address, where_run.dask_workers)
    if where_run.task_runner != "threads":
        what = merge.what
        merge = merge.with_source(checkpoint=seen_from_workers(what.checkpoint), hf_dir=seen_from_workers(what.hf_dir),
                                  custom_mapping=seen_from_workers(what.custom_mapping))
    proofs = request.folder_checks()
    with in_process_settings():  # nested: no heartbeat thread of its own to join
        manifest = merge_checkpoint.with_options(task_runner=runner)(merge, proofs)
    target = merge.where.target
    checks = run_equivalence_tests(target, manifest, proofs)
    create_table_artifact(equivalence_rows(checks), key="equivalence", description="equivalence tests")
    result = {"target": Location.of(target).url, "checks": checks, "cached_groups": manifest["cached_groups"],
              "nonfinite": nonfinite_found(manifest.get("groups_written", []))}
    hub = request.hub
    if hub:
        pushed = push_to_hub(target, hub.repo, hub.revision, hub.private, hub.tag, hub.token_secret)
        create_link_artifact(pushed["url"], link_text=f"{hub.repo}@{pushed['revision']}", key="hub-revision")
        result["hub"] = pushed
    return result


def as_is(plan):
    """The plan marked not to be walked for futures (Prefect's walk of a large plan costs ms per task);
    except for Dask, whose submit unpacks tuples and Prefect's `quote` with them (the task got `(plan,)`)."""
    from prefect.context import FlowRunContext

    return quote(plan) if isinstance(FlowRunContext.get().task_runner, ThreadPoolTaskRunner) else plan


def largest_first(plan, units: list[str]) -> list[str]:
    """Groups (or files) by decreasing bytes, so no large one is left for last."""
    size = {unit: 0 for unit in units}
    for t in plan.tensors:
        size[t.file if t.file in size else t.group] += t.end - t.begin
    return sorted(units, key=lambda unit: -size[unit])


def finished_groups(futures: dict, units: list[str], plan, progress: GroupProgress, hashes: BackgroundHashes | None):
    """{unit: final state} and the receipts in plan order (`units`: its groups, or its files), gathered as
    they finish; raises the first failure once every one has run. Meanwhile (`hashes`) written files are
    hashed as far as they are done. No futures (the target already holds this merge): no states, no receipts."""
    states, receipts = {}, {}
    for future in as_completed(list(futures)):
        future.wait()
        unit = futures[future]
        states[unit] = future.state
        receipts[unit] = future.state.result(raise_on_failure=False)  # while the others still run
        if hashes is not None:
            hashes.start_written(plan, {g for g, state in states.items() if state.is_completed()})
        progress.advance()
    for state in states.values():
        if not state.is_completed():
            state.result()
    return states, [receipts[u] for u in units if u in receipts]


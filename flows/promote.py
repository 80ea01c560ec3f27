"""The promotion DAG, top to bottom:

discover_shards -> validate_metadata -> plan_groups -> prepare_staging -> merge_group (mapped; merge_file,
one per output file, for an object-storage target)
(each passing its result on: the checkpoint's description and fingerprints -> the validated config -> the plan)
-> finalize_model (round-trip, reference tensors and logits, then the atomic publish)
-> run_equivalence_tests -> push_to_hub
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from mergecore import LoraSettings, MergeRequest, MergeSettings, MergeSource, MergeTarget
from mergecore.hub import check_repo_id
from mergecore.numbers.nonfinite import nonfinite_found
from mergecore.targets.card import markdown_text
from mergecore.targets.output import BackgroundHashes
from mergecore.storage import Location
from mergecore.targets import open_target
from ckptflow.tasks import (discover_shards, finalize_model, merge_file, merge_group, plan_groups, prepare_staging, push_to_hub,
                   run_equivalence_tests, validate_metadata)
from ckptflow.tasks.caching import group_cache_policy, merge_file_key, results_folder

from .engines import group_task_runner, seen_from_workers
from .pictures import publish_picture
from .progress import GroupProgress
from .reports import equivalence_rows, merge_report


@flow(name="merge-checkpoint", task_runner=group_task_runner("threads"))
def merge_checkpoint(request: MergeRequest, reference: str | None = None, trust_remote_code: bool = False) -> dict:
    """Checkpoint -> verified Hugging Face folder at the request's target; groups are cached across runs. Each
    step's result is the next one's input (discovered -> validated -> planned). The run holds the target's lock
    from staging to publish (its tasks, here or on Dask workers, write under it)."""
    discovered = discover_shards(request)
    validated = validate_metadata(request, discovered)
    planned = plan_groups(request, discovered, validated)
    place = open_target(request.where.target)
    with place.lock():
        return merge_under_lock(request, place, discovered, validated, planned, reference, trust_remote_code)


def merge_under_lock(request: MergeRequest, place, discovered: dict, validated: dict, planned, reference: str | None,
                     trust_remote_code: bool) -> dict:
    """The rest of `merge_checkpoint`: stage, merge the target's units (layer groups into a folder's staged
    files; whole files, each written by one task, on object storage), finalize."""
    target, plan = place.url, planned.plan
    edges = as_is(discovered), as_is(plan), as_is(validated), as_is(planned)  # large: not walked for futures
    discovered_as_is, plan_as_is, validated_as_is, planned_as_is = edges
    staged = prepare_staging(request, discovered_as_is, validated_as_is, planned_as_is)
    units = plan.files if place.unit == "files" else plan.groups
    if staged["published"]:  # a rerun after success: the target holds every unit
        futures = {}
    elif place.unit == "files":
        merge = merge_file.with_options(cache_policy=group_cache_policy(target, merge_file_key),
                                        result_storage=results_folder(target))
        futures = {merge.with_options(refresh_cache=file in staged["created"]).submit(
            request, discovered_as_is, validated_as_is, planned_as_is, file, staged["weights_id"]): file
            for file in largest_first(plan, units)}
    else:
        merge = merge_group.with_options(cache_policy=group_cache_policy(target), result_storage=results_folder(target))
        rewritten = {g for g in plan.groups if any(t.file in staged["created"] for t in plan.in_group(g))}
        futures = {merge.with_options(refresh_cache=group in rewritten).submit(
            request, discovered_as_is, plan_as_is, group, staged["staging"]): group for group in largest_first(plan, units)}
    hashing = BackgroundHashes(Path(staged["staging"])) if place.unit == "groups" else nullcontext()  # sha256 as written
    with GroupProgress(len(futures), f"{place.unit} merged into {target}") as progress, hashing as hashes:
        states, receipts = finished_groups(futures, units, plan, progress, hashes)
        manifest = finalize_model(request, discovered_as_is, validated_as_is, planned_as_is, staged, receipts, hashes,
                                  reference, trust_remote_code)
    cached = [u for u in units if not futures or states[u].name == "Cached"]  # reused: all of them
    written = receipts if futures else manifest.get("groups_written", [])  # reused: as the run that wrote them
    create_markdown_artifact(merge_report(discovered, plan, written, cached, manifest), key="merge-report",
                             description=f"merge of {markdown_text(discovered['location'])}")
    publish_picture(request, discovered, target)  # the checkpoint drawn ranks × groups: an artifact and an HTML page
    return {**manifest, "cached_groups": cached}


@flow(name="promote-checkpoint")
def promote_checkpoint(
    checkpoint: str,
    target: str,
    dtype: str = "auto",
    reference: str | None = None,
    hub_repo: str | None = None,
    revision: str | None = None,
    private: bool = True,
    max_shard_size: str = "5GB",
    role: str = "actor",
    backend: str = "auto",
    hf_dir: str | None = None,
    tag: str | None = None,
    hub_token_secret: str | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    custom_mapping: str | None = None,
    on_nonfinite: str = "fail",
    lora: str | None = None,
    lora_alpha: float | None = None,
    lora_r: int | None = None,
    target_modules: str | None = None,
    base_model: str | None = None,
    task_runner: str = "threads",
    dask_address: str | None = None,
    dask_workers: int | None = None,
    quantize: str | None = None,
    quantize_ignore: list[str] | None = None,
) -> dict:
    """Merge a training checkpoint, prove it equal to what was trained, and publish it to the Hub.

    The parameters are flat because deployments and event triggers name them; they become one `MergeRequest`
    here, checked before anything is opened, and that request is what the tasks receive.

    NaN/Inf weights fail the run unless `on_nonfinite="warn"` (then they are listed in the result
    and the manifest). A LoRA checkpoint is published fused (`lora`: both, the default, also writes the
    PEFT adapter to `lora_adapter/` of the same folder and repo; fuse); a save_lora_only one needs `base_model`.

    `task_runner="dask"` merges the groups on a Dask cluster: the scheduler at `dask_address`, or a
    LocalCluster of `dask_workers` processes started for this run (see flows/engines.py).

    `quantize` (fp8-block, w8a16, w4a16) publishes the quantized model instead, proven within the scheme's bound
    (`quantize_ignore`: module patterns kept unquantized; see docs/quantization.md)."""
    parameters = dict(locals())  # first thing in the body: locals() holds exactly the parameters
    request, hub = promotion_request(parameters), promotion_hub(parameters)
    return promote(request, reference=reference, trust_remote_code=trust_remote_code, hub=hub,
                   engine=Engine(task_runner, dask_address, dask_workers))


def promotion_request(parameters: dict) -> MergeRequest:
    """The `MergeRequest` of `promote_checkpoint`'s flat parameters (every one, defaults included: see
    `promotion_parameters`), built, and so checked, in one place: the flow builds it first, and the CLI before
    Prefect starts, so that a bad value is one line and not a failed flow run with Prefect's traceback."""
    p = parameters
    lora = LoraSettings(output=p["lora"], alpha=p["lora_alpha"], r=p["lora_r"], target_modules=p["target_modules"],
                        base_model=p["base_model"])
    return MergeRequest(
        MergeSource(p["checkpoint"], role=p["role"], backend=p["backend"], hf_dir=p["hf_dir"],
                    custom_mapping=p["custom_mapping"], lora=lora),
        MergeSettings(dtype=p["dtype"], max_shard_size=p["max_shard_size"], on_nonfinite=p["on_nonfinite"],
                      quantize=p["quantize"], quantize_ignore=tuple(p["quantize_ignore"] or ())),
        MergeTarget(p["target"], overwrite=p["overwrite"]))


def promotion_hub(parameters: dict) -> HubPush | None:
    """Where `promote_checkpoint`'s parameters push to (None: no push), checked with the request and as early."""
    p = parameters
    return HubPush(p["hub_repo"], p["revision"], p["private"], p["tag"], p["hub_token_secret"]) if p["hub_repo"] else None


def promotion_parameters(**given) -> dict:
    """`given` with `promote_checkpoint`'s defaults for the rest (a name it does not take is a TypeError).

    >>> promotion_parameters(checkpoint="ckpts/run1", target="out/model")["dtype"]
    'auto'
    """
    bound = inspect.signature(promote_checkpoint.fn).bind(**given)
    bound.apply_defaults()
    return dict(bound.arguments)


@dataclass(frozen=True)
class HubPush:
    """Where a promotion is pushed: the repo, branch, visibility of a new repo, tag, and the Secret block holding
    the token (default HF_TOKEN)."""

    repo: str
    revision: str | None = None
    private: bool = True
    tag: str | None = None
    token_secret: str | None = None

    def __post_init__(self):
        check_repo_id(self.repo)  # the Hub's own rule, before any work: never a merge that cannot be pushed


@dataclass(frozen=True)
class Engine:
    """Where the groups are merged: threads of this process, or a Dask cluster (flows/engines.py)."""

    task_runner: str = "threads"
    dask_address: str | None = None
    dask_workers: int | None = None


def promote(request: MergeRequest, reference: str | None, trust_remote_code: bool, hub: HubPush | None,
            engine: Engine) -> dict:
    """`promote_checkpoint` on its request: merge (cached per group), the equivalence checks, the push."""
    runner = group_task_runner(engine.task_runner, engine.dask_address, engine.dask_workers)  # fails here if bad
    if engine.task_runner != "threads":
        what = request.what
        request = request.with_source(checkpoint=seen_from_workers(what.checkpoint),
                                      hf_dir=seen_from_workers(what.hf_dir),
                                      custom_mapping=seen_from_workers(what.custom_mapping))
    manifest = merge_checkpoint.with_options(task_runner=runner)(request, reference, trust_remote_code)
    target = request.where.target
    checks = run_equivalence_tests(target, manifest, reference, trust_remote_code)
    create_table_artifact(equivalence_rows(checks), key="equivalence", description="equivalence tests")
    result = {"target": Location.of(target).url, "checks": checks, "cached_groups": manifest["cached_groups"],
              "nonfinite": nonfinite_found(manifest.get("groups_written", []))}
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


"""The library's public entry points, one per thing a user does: `merge`, `verify`, `inspect`, `push` (and
`write_adapter_folder` for a LoRA adapter alone).

`merge` holds the target's lock from the first check to the publish (`mergecore.assembly`), so two writers of one
target never interleave: the second waits, then finds the first one's model. Each takes plain values (paths, URLs)
or a `MergeRequest` (`mergecore.request`) built once by the caller.

>>> from ckptflow.testing.examples import example_checkpoint, example_target
>>> model = example_target("api-model")
>>> manifest = merge(example_checkpoint(), model, dtype="bf16")
>>> manifest["dtype"], [check["ok"] for check in verify(model)]
('bfloat16', [True, True, True])
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .engine.merge import Prepared, Stopwatch, as_merged, metadata_bytes, open_source, prepare, recorded_source
from .formats import CheckpointSource
from .request import MergeRequest, MergeSource
from .assembly import assembly_for
from .targets import Target, open_target
from .targets.base import check_apart


def merge(
    request: MergeRequest | str | Path,
    target: str | Path | None = None,
    *,
    on_group: Callable[[str, dict], None] | None = None,
    on_tensor: Callable[[str], None] | None = None,
    checks: Callable[[Path], list[dict]] | None = None,
    prepared: Prepared | None = None,
    **options,
) -> dict:
    """Merge a checkpoint into a verified Hugging Face model at `target` (a folder, published by one atomic rename,
    or an fsspec URL, published by writing its manifest last); returns its manifest. `request` is a
    `MergeRequest`, or the checkpoint's path with the request's `options` as keywords (dtype, max_shard_size,
    overwrite, role, lora, ...: `MergeRequest.of`). `on_group(unit, receipt)` follows the groups (files, on object
    storage); `checks(folder)` adds checks (a reference model) before the publish; `prepared`: the request
    already prepared by the caller, who checked the target before reading the checkpoint. A target that already
    holds this very merge is reused (its metadata refreshed if it changed).

    >>> from ckptflow.testing.examples import example_checkpoint, example_target
    >>> manifest = merge(example_checkpoint(), example_target("merged"), dtype="fp32", max_shard_size="100KB")
    >>> manifest["dtype"], len(manifest["files"]) > 1, manifest["verification"][0]["check"]
    ('float32', True, 'round-trip')
    """
    if not isinstance(request, MergeRequest):
        request = MergeRequest.of(str(request), None if target is None else str(target), **options)
    elif target is not None or options:
        raise TypeError("merge(request): the target and options belong in the MergeRequest")
    if request.where is None:
        raise TypeError("merge: give a target (the request has none)")
    how, where = request.how, request.where
    place = assembly_for(where.target)
    with place.lock():
        if prepared is None:  # else the caller checked the target before it read the checkpoint (the CLI does)
            place.target.check(where.overwrite, [request.what.checkpoint])
            prepared = prepare(request)
        clock = Stopwatch()  # the phases from here on; preparing timed itself, here or by the caller
        clock.laps["prepare"] = prepared.seconds
        try:
            staged = place.stage(prepared, where.overwrite, metadata_bytes(prepared.source))  # the check that counts
            if staged.published:
                return place.refresh(prepared, verify=how.verify, workers=how.workers, checks=checks)
            return place.merge(prepared, staged, overwrite=where.overwrite, verify=how.verify, workers=how.workers,
                               on_unit=on_group, on_tensor=on_tensor, on_nonfinite=how.on_nonfinite,
                               chunk_bytes=how.chunk_bytes, extra={"timings": clock.laps}, checks=checks)
        except BaseException:  # a failed check, a signal: no half-made folder stays beside the target
            place.target.discard()
            raise


merge_checkpoint = merge  # the name scripts and tests have used


def verify(
    folder: str | Path,
    reference: str | Path | None = None,
    *,
    source: str | None = None,
    hf_dir: str | None = None,
    custom_mapping: str | None = None,
    skip_source: bool = False,
    logits: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    trust_remote_code: bool = False,
    engine: str | None = None,
    engine_python: str | None = None,
) -> list[dict]:
    """Re-check a merged model (a folder, or an fsspec URL, read file by file): every file's sha256 against its
    manifest, nothing beside them, the files copied from the source's huggingface/, and (unless `skip_source`)
    the round trip against the checkpoint it was merged from, reopened as its merge opened it. `source`,
    `hf_dir`, `custom_mapping` override the manifest's (whose locations are used only when local). With
    `reference`: its tensors too (and logits with `logits`). With `engine` ("vllm"): loaded in that engine
    (`engine_python`: an interpreter that has it), its logprobs compared with transformers'. Returns the check
    rows; a failed check raises VerificationError, an engine that cannot run it here EngineUnavailable.

    >>> from ckptflow.testing.examples import example_checkpoint, example_target
    >>> model = example_target("to-verify")
    >>> _ = merge(example_checkpoint(), model)
    >>> [row["check"] for row in verify(model)]
    ['manifest', 'copied files', 'round-trip']
    """
    from .proofs.published import verify_model
    from .proofs.reader import model_reader
    from .proofs.verify import reference_checks
    from .serving import check_engine, engine_check

    if engine:
        check_engine(engine)  # before any work
    place = open_target(folder)
    manifest = place.require_manifest()
    opened = None if skip_source else merged_source(manifest, source, hf_dir, custom_mapping)
    results = verify_model(model_reader(place.url), manifest, opened)  # a remote model by ranged reads, file by file
    if reference or engine:
        with place.local_copy() as local:  # a remote model is compared from a local copy of its files
            if reference:
                results += reference_checks(Path(local), Path(reference), trust_remote_code, logits, atol, rtol)
            if engine:
                results.append(engine_check(Path(local), engine, engine_python))
    return results


def merged_source(manifest: dict, source: str | None = None, hf_dir: str | None = None,
                  custom_mapping: str | None = None) -> CheckpointSource:
    """The checkpoint a manifest names (or `source`), opened as its merge opened it (`recorded_source`: backend,
    custom mapping, LoRA fused, Hub layout); the manifest's own locations only when local (`manifest_source`)."""
    from .proofs.verify import as_recorded, manifest_source

    manifest = as_recorded(manifest)  # the full paths of this machine's merges (storage.ledger)
    location, folder = manifest_source(manifest, source, hf_dir)
    return as_merged(recorded_source(manifest, location, folder, custom_mapping))


def inspect(checkpoint: str | Path | MergeSource, **source_options) -> dict:
    """Describe a checkpoint without reading tensor data: format, world size, mesh, placements, and tensors,
    bytes, dtypes and layouts per layer group (a LoRA save: its rank, alpha, target modules, where each came
    from). `source_options`: role, backend, custom_mapping, lora (`MergeSource`).

    >>> from ckptflow.testing.examples import example_checkpoint
    >>> report = inspect(example_checkpoint())
    >>> report["checkpoint"]["format"], report["checkpoint"]["world_size"], report["groups"][0]["group"]
    ('verl-fsdp', 1, 'embed')
    """
    from .describe import describe_source, shown_view

    what = checkpoint if isinstance(checkpoint, MergeSource) else MergeSource(str(checkpoint), **source_options)
    return describe_source(shown_view(open_source(what)), what.lora.overrides() or None)


def push(folder: str | Path, repo_id: str, *, revision: str | None = None, private: bool = True,
         tag: str | None = None, token: str | None = None) -> dict:
    """Push a merged model (folder or fsspec URL) to a Hub repo as published, card and manifest included, and
    check what the Hub then holds (endpoint and token from HF_ENDPOINT / HF_TOKEN unless `token`). Only a model
    whose manifest still matches its files is pushed: anything else is refused before the Hub is contacted.

    >>> from ckptflow.testing.examples import example_target
    >>> push(example_target("never-merged"), "org/model")
    Traceback (most recent call last):
      ...
    mergecore.errors.CheckpointError: ...never-merged: ...
    """
    from .hub import push_folder

    return push_folder(folder, repo_id, revision=revision, private=private, token=token, tag=tag)


def check_apart_from_source(target: Target, source: CheckpointSource) -> None:
    """The target overlaps none of the folders the checkpoint was read from (its role folder, huggingface/)."""
    for place in (source.location, source.hf_dir):
        check_apart(target.url, str(place))


def write_adapter_folder(request: MergeRequest, source: CheckpointSource | None = None) -> dict:
    """Write the adapter of a LoRA checkpoint (full or save_lora_only) as a PEFT folder at the request's target,
    checked piece by piece and published atomically (`source`: the checkpoint already opened). Returns a small
    report.

    >>> write_adapter_folder(MergeRequest.of("ckpts/run1", "out/adapter", lora={"output": "adapter"}))  # doctest: +SKIP
    {'adapter': 'out/adapter', 'tensors': 8, 'pieces': 16, 'r': 8, 'alpha': 16.0}
    """
    from .model.adapter import write_adapter_files
    from .views.lora import adapter_of

    source = source or open_source(request.what)
    lora, where = request.what.lora, request.where
    inner, hyper = adapter_of(source, lora.overrides())  # refuses without alpha, before anything is written
    target = open_target(where.target)
    with target.lock():
        target.check(where.overwrite, [str(source.location)])
        check_apart_from_source(target, source)
        staging = target.open_staging(fresh=True)
        try:
            written = write_adapter_files(inner, hyper, staging, lora.base_model)
            target.publish(staging, where.overwrite)
        except BaseException:
            target.discard()
            raise
    return {"adapter": target.url, **written, "r": hyper.r, "alpha": hyper.alpha}

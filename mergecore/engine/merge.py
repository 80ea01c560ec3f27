"""The merge engine, step by step, on one `MergeRequest`: open it as merged (`as_merged`) -> `validate` ->
`plan_merge` -> (`prepared_from`) -> merge one group -> finish the folder.

Each step is one function whose result (JSON, or a dataclass of JSON) is the next one's input, so a pipeline runs
them as separate tasks passing those results along; `prepare` runs the first ones in a row. Where the output goes
(staging, lock, publish) is the target's business (`mergecore.targets`), and `mergecore.api.merge` runs it all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..numbers.arrays import bitwise_equal
from ..numbers.budget import chunk_bytes as budget_of
from ..numbers.budget import parse_size
from ..errors import CheckpointError
from ..formats import CheckpointSource, open_checkpoint
from ..formats.base import read_hf_config
from ..families.config_check import check_config, tied_aliases, writes_output_head
from ..families.layout import EMBEDDING, OUTPUT, tied_embeddings
from ..request import LoraSettings, MergeRequest, MergeSource, as_request
from ..views.lora import fused_lora, lora_view, output_mode
from ..numbers.nonfinite import check_nonfinite_policy
from .plan import MergePlan, make_plan, output_config, output_dtype
from ..quantize.schemes import check_ignore_patterns, quantize_spec
from ..quantize.stream import nonfinite_weights
from ..storage import publishable_hf_files
from ..model.folder import write_descriptive_files
from ..model.adapter import write_adapter_beside
from ..model.manifest import write_manifest
from .writer import TensorWriter


class Stopwatch:
    """Seconds per phase, for reports: `lap("merge")` records the time since the previous lap."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 3)
        self._last = now


@dataclass
class Prepared:
    """A checkpoint that passed validation, with its config and plan: nothing written yet."""

    source: CheckpointSource
    config: dict
    plan: MergePlan
    options: dict = field(default_factory=dict)  # how it was opened and planned: recorded, so `verify` reopens alike
    seconds: float = 0.0  # opening, validating and planning it: the manifest's "prepare" timing


LORA_FIELDS = tuple(LoraSettings.__dataclass_fields__)


def check_tied_embeddings(source: CheckpointSource, config: dict, requested: bool | None) -> dict[str, str]:
    """The tied tensors the output stores once (`tied_aliases`: dropped name -> the name holding its values);
    the checkpoint must agree with the config."""
    tied = tied_embeddings(config)
    where = source.hf_dir.join("config.json")
    if requested is not None and requested != tied:
        raise CheckpointError(
            f"--tie-word-embedding {str(requested).lower()} contradicts tie_word_embeddings={str(tied).lower()} in "
            f"{where}; drop the flag or fix the config"
        )
    names = source.tensors()
    if not tied and EMBEDDING in names and OUTPUT not in names and writes_output_head(config):
        raise CheckpointError(
            f"{source.location}: has no {OUTPUT} but {where} says tie_word_embeddings=false; "
            "set it to true if training tied the embeddings"
        )
    aliases = tied_aliases(config, names)
    for dropped, kept in aliases.items():
        if not same_values(source, kept, dropped):
            raise CheckpointError(
                f"{source.location}: {dropped} differs from {kept} but {where} says tie_word_embeddings=true; "
                "set it to false (the model was trained untied)"
            )
    return aliases


def same_values(source: CheckpointSource, a: str, b: str) -> bool:
    """Whether two tensors hold the same values, compared shard by shard (no full copy of either)."""
    pieces_a = {(p.source, p.offsets): p for p in source.pieces(a) if p.primary}
    pieces_b = [p for p in source.pieces(b) if p.primary]
    if source.tensors()[a].shape != source.tensors()[b].shape:
        return False
    if len(pieces_b) != len(pieces_a) or any((p.source, p.offsets) not in pieces_a for p in pieces_b):
        return bitwise_equal(source.read(a), source.read(b))  # laid out differently: compare whole
    return all(bitwise_equal(pieces_a[(p.source, p.offsets)].tensor, p.tensor) for p in pieces_b)


def merge_view(source: CheckpointSource, lora: dict | None = None) -> CheckpointSource:
    """The checkpoint under the names and values a merge writes: a LoRA checkpoint as its fused model (HF names),
    then, on those names, the Hub's layout where transformers keeps another in memory (packed MoE experts, VLM
    prefixes). The one place both views are applied, in this order; applying it twice changes nothing."""
    from ..views.hub_layout import hub_view

    return hub_view(lora_view(source, lora))


def open_source(what: MergeSource) -> CheckpointSource:
    """The checkpoint a request names, opened as stored (rank files mmapped, their metadata read)."""
    return open_checkpoint(what.checkpoint, what.role, what.backend, what.hf_dir, what.custom_mapping)


def lora_output(what: MergeSource, source: CheckpointSource, quantize: str | None = None) -> str | None:
    """What a merge of this (opened, as stored) checkpoint writes for its LoRA: None (no LoRA), fuse, both or
    adapter (`views.lora.output_mode`); LoRA settings for a checkpoint without LoRA, and `quantize` with the
    adapter alone, are refused in one line."""
    mode = output_mode(source, what.lora.output, what.lora.base_model, quantize)
    if mode is None and what.lora.given():
        raise CheckpointError(f"{source.location}: LoRA flags given but the checkpoint has no LoRA adapter tensors; drop them")
    return mode


def as_merged(what: MergeSource, source: CheckpointSource | None = None) -> CheckpointSource:
    """The checkpoint of `what` (opened here unless `source`, opened as stored, is given) as a merge reads it:
    `merge_view` with the LoRA output decided. The one way prepare, the pipeline's tasks and verify see it.
    A request whose output is the LoRA adapter alone is no merge: refused, naming the ways to it."""
    source = source or open_source(what)
    mode = lora_output(what, source)
    if mode == "adapter":
        raise CheckpointError(f"{source.location}: holds a LoRA adapter to write alone (--lora adapter, or a "
                              "save_lora_only checkpoint without --base-model), not a model to merge: write it with "
                              "`ckptflow merge --lora adapter`, or pass --base-model to fuse it into its base model")
    return merge_view(source, what.lora.overrides(mode) if mode else None)


def described_inputs(source: CheckpointSource) -> dict:
    """What discovery found, as JSON: format, location, world size, mesh, files, and the input files'
    fingerprints (size, time or etag; no data read) with their digest, `identity`, that names this state."""
    from .fingerprints import digest, input_fingerprints

    fingerprints = input_fingerprints(source)
    return {**source.describe(), "fingerprints": fingerprints, "identity": digest(fingerprints)}


def validate(request: MergeRequest, source: CheckpointSource) -> dict:
    """Every rank present and consistent, config.json read, tied embeddings agreed with it. Returns what the
    later steps use, as JSON: `config`, `tied`, and a summary (`tensors`, `model_type`, `architectures`)."""
    fused = fused_lora(source)
    if fused is not None and fused.hf_dir != fused.inner.hf_dir:  # save_lora_only: the base model's, checked alike
        publishable_hf_files(source.hf_dir, source.location)
    config = read_hf_config(source)
    source.validate(check_replicas=request.how.check_replicas)
    tied = check_tied_embeddings(source, config, request.how.tie_word_embedding)
    return {"config": config, "tied": tied, "tensors": len(source.tensors()), "model_type": config.get("model_type"),
            "architectures": config.get("architectures")}


@dataclass(frozen=True)
class Planned:
    """The plan of a validated checkpoint and how config.json was found to describe what it writes."""

    plan: MergePlan
    config_check: dict  # {"by": "transformers", "model": ...} or {"by": "shape table", ...}: kept in the manifest


def plan_merge(request: MergeRequest, source: CheckpointSource, validated: dict) -> Planned:
    """Layer groups packed into output files (every header fixed before any data is read), then checked against
    what the config's model class saves (`families.config_check`). A quantized merge that publishes NaN/Inf
    (`--on-nonfinite warn`) first finds the weights holding them, which it keeps unquantized."""
    config, how = validated["config"], request.how
    options = planning_options(how)
    plan = output_plan(source, config, validated["tied"], options, quantized=False)
    checked = check_config(source, config, plan)  # what the merge writes, per transformers: the unquantized names
    if how.quantize:  # the same plan with each selected weight as its quantized parts
        scan = budget_of(how.chunk_bytes) if how.on_nonfinite == "warn" else None
        plan = output_plan(source, config, validated["tied"], options, scan_nonfinite=scan)
    return Planned(plan, checked)


def planning_options(how) -> dict:
    """The settings (`request.MergeSettings`) a plan is made from, as the manifest records them (`prepared_from`)."""
    return {"dtype": how.dtype, "max_shard_size": how.max_shard_size, "quantize": how.quantize,
            "quantize_ignore": list(how.quantize_ignore)}


def output_plan(source: CheckpointSource, config: dict, tied: bool | dict[str, str], options: dict, *,
                quantized: bool = True, scan_nonfinite: int | None = None) -> MergePlan:
    """The plan a merge of `source` with `options` (`planning_options`, or a manifest's: `dtype`, `max_shard_size`,
    `quantize`, `quantize_ignore`, `quantize_kept_nonfinite`) writes: made here by the merge and again by `verify`,
    so both read the same decisions. The dtype is resolved once (`plan.output_dtype`: bf16 under --quantize with
    auto); each --quantize-ignore pattern must match a module of the checkpoint; with `scan_nonfinite` (a read
    budget) the selected weights holding NaN/Inf are found and kept unquantized (`stream.nonfinite_weights`).
    `quantized=False`: the same files with every weight unquantized (what the config check compares)."""
    quantize = options.get("quantize")
    spec = quantize_spec(quantize, tuple(options.get("quantize_ignore") or ()), config.get("model_type"),
                         tuple(options.get("quantize_kept_nonfinite") or ())) if quantized else None
    if spec:
        check_ignore_patterns(spec, source.tensors(), source.location)  # before the scan: a typo costs no read
        if scan_nonfinite is not None:
            spec = {**spec, "kept_nonfinite": sorted(nonfinite_weights(source, spec, scan_nonfinite))}
    dtype = output_dtype(str(options.get("dtype") or "auto"), config, quantize)
    shard_size = parse_size(options.get("max_shard_size") or "5GB")
    return make_plan(str(source.location), source.tensors(), dtype, tied, shard_size, spec)


def prepared_from(request: MergeRequest, source: CheckpointSource, validated: dict, planned: Planned) -> Prepared:
    """The steps' results put together for the targets, with how it was opened and planned recorded (so `verify`
    reopens it alike: `recorded_source`)."""
    what, how = request.what, request.how
    options = {"config_check": planned.config_check, "backend": source.backend,
               "hf_dir": str(source.hf_dir) if what.hf_dir else None, "custom_mapping": what.custom_mapping,
               "dtype": how.dtype, "max_shard_size": how.max_shard_size,
               "tie_word_embedding": how.tie_word_embedding, "check_replicas": how.check_replicas}
    if how.quantize:
        kept = planned.plan.quantization.get("kept_nonfinite") or []  # found by the plan's scan: verify plans alike
        options.update(quantize=how.quantize, quantize_ignore=list(how.quantize_ignore), quantize_kept_nonfinite=kept)
    fused = fused_lora(source)
    if fused is not None:
        options["lora"] = what.lora.overrides(fused.output)
    return Prepared(source, validated["config"], planned.plan, options)


def recorded_source(manifest: dict, location: str, hf_dir: str | None = None,
                    custom_mapping: str | None = None) -> MergeSource:
    """The `what` of the merge a manifest records (its options), read from `location`; `hf_dir` and
    `custom_mapping` given here win over the recorded ones."""
    used = manifest["source"].get("options", {})
    lora = {k: v for k, v in (used.get("lora") or {}).items() if k in LORA_FIELDS}
    return MergeSource(location, backend=used.get("backend") or "auto", hf_dir=hf_dir,
                       custom_mapping=custom_mapping or used.get("custom_mapping") or manifest["source"].get("custom_mapping"),
                       lora=LoraSettings(**lora))


def prepare(request: MergeRequest | str, source: CheckpointSource | None = None, *, since: float | None = None,
            **options) -> Prepared:
    """Discover, validate against config.json, and plan: nothing written. Raises CheckpointError on bad input.
    `source`: the checkpoint already opened (as stored), `since` the `time.perf_counter()` reading when its
    opening began (so what was read before counts as preparing: `Prepared.seconds`); `request` may be a path,
    with `options` for the request.

    >>> from ckptflow.testing.examples import example_checkpoint
    >>> prepared = prepare(example_checkpoint(), dtype="bf16", max_shard_size="100KB")
    >>> prepared.plan.dtype, len(prepared.plan.files) > 1
    ('bfloat16', True)
    """
    started = time.perf_counter() if since is None else since
    request = as_request(request, **options)
    source = as_merged(request.what, source)
    validated = validate(request, source)
    prepared = prepared_from(request, source, validated, plan_merge(request, source, validated))
    prepared.seconds = round(time.perf_counter() - started, 3)
    return prepared


def merge_group(
    source: CheckpointSource,
    plan: MergePlan,
    group: str,
    staging: Path,
    workers: int = 2,
    on_tensor: Callable[[str], None] | None = None,
    on_nonfinite: str = "warn",
    chunk_bytes: int | str | None = None,
) -> dict:
    """Assemble every tensor of one group and write it to its place in the staging files.

    Each floating tensor is checked for NaN/Inf as converted (so fp16 overflow counts too):
    `on_nonfinite="fail"` raises CheckpointError, `"warn"` writes it and lists it in the receipt
    as `nonfinite: {tensor: {"nan": n, "+inf": p, "-inf": m}}`.
    Memory: each tensor is read, cast, checked and written in row blocks within `chunk_bytes` per worker
    (default `CKPTFLOW_CHUNK_BYTES`, 64 MiB; 0: whole tensors), and at most `CKPTFLOW_BLOCKS_IN_FLIGHT` blocks (2)
    held by the process at a time, however many groups run (`numbers.budget.in_flight`).
    Returns a small receipt.
    """
    started = time.perf_counter()
    check_nonfinite_policy(on_nonfinite)
    budget = budget_of(chunk_bytes)
    planned = plan.in_group(group)
    if not planned:
        raise CheckpointError(f"group {group!r} is not in the plan (groups: {', '.join(plan.groups)})")

    def one(entry):
        found: dict = {}
        writer.write_tensor(source, entry, budget, on_nonfinite, found)
        if on_tensor:
            on_tensor(entry.name)
        return entry.end - entry.begin, entry.name, found.get(entry.name)

    with TensorWriter(plan, staging) as writer, ThreadPoolExecutor(max(1, workers)) as pool:
        done = list(pool.map(one, planned))
    receipt = {"group": group, "tensors": len(planned), "bytes": sum(size for size, _, _ in done),
               "seconds": round(time.perf_counter() - started, 3)}
    nonfinite = {name: counts for _, name, counts in done if counts}
    return {**receipt, "nonfinite": nonfinite} if nonfinite else receipt


def write_beside_weights(prepared: Prepared, folder: Path) -> list[str]:
    """Write what a model holds beside its weights and card into `folder` — index, config, the files copied from
    huggingface/, a LoRA merge's lora_adapter/ (checked as written) — and return their names."""
    plan = prepared.plan
    descriptive = write_descriptive_files(prepared.source, output_config(prepared.config, plan), plan.index(), folder)
    fused = fused_lora(prepared.source)  # a fused LoRA merge with output "both" carries its PEFT adapter too
    if fused is None or fused.output != "both":
        return descriptive
    return descriptive + write_adapter_beside(folder, fused.inner, fused.hyperparameters, fused.base_model)


def finish_folder(
    prepared: Prepared,
    folder: Path,
    descriptive: list[str],
    results: list[dict],
    extra: dict | None = None,
    known: dict[str, str] | None = None,
    stored: dict[str, dict] | None = None,
    checks: Callable[[Path], list[dict]] | None = None,
) -> dict:
    """Card and manifest of `folder`, whose other files are written (`write_beside_weights`), once `checks(folder)`
    (a reference model's tensors and logits) passed; `results` are the checks already made (the round trip). Returns the manifest.

    `known`: sha256 digests already computed; `stored`: entries of weight files that live elsewhere (object storage).
    """
    from .fingerprints import metadata_id, weights_id

    plan = prepared.plan
    results = [*results, *(checks(folder) if checks else [])]
    fields = {"source": {**prepared.source.describe(), "options": prepared.options}, "dtype": plan.dtype or "keep",
              "groups": plan.groups, "aliases": plan.aliases,
              **({"quantization": {k: v for k, v in plan.quantization.items() if k != "config"}} if plan.quantization
                 else {}),
              **(extra or {}), "weights_id": weights_id(prepared.source, plan),
              "metadata_id": metadata_id(prepared.source, prepared.config), "verification": results}
    return write_manifest(fields, prepared.config, folder, [*plan.files, *descriptive], known, stored)


def metadata_bytes(source: CheckpointSource) -> int:
    """Room for everything but the weights: the huggingface/ files (copied, or rewritten like config.json)
    plus 1 MiB for the index and the manifest."""
    return sum(int(source.hf_dir.join(name).info().get("size") or 0) for name in source.hf_dir.listdir()) + (1 << 20)

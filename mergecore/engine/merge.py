"""The merge engine, step by step: prepare (discover, validate, plan) -> merge one group -> finish the folder.

Each step is one function so a pipeline can run them as separate tasks; where the output goes (staging, lock,
publish) is the target's business (`mergecore.targets`), and `mergecore.api.merge_checkpoint` runs it all in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..numbers.arrays import bitwise_equal
from ..numbers.budget import parse_size
from ..numbers.dtypes import resolve_dtype
from ..errors import CheckpointError
from ..formats import CheckpointSource, open_checkpoint
from ..formats.base import read_hf_config
from ..families.config_check import check_config, tied_aliases, writes_output_head
from ..families.layout import EMBEDDING, OUTPUT, tied_embeddings
from ..views.lora import lora_view, write_adapter_beside
from ..numbers.nonfinite import check_nonfinite_policy
from .plan import MergePlan, make_plan
from ..quantize.schemes import quantize_spec
from ..storage import publishable_files
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
    prefixes). The one place both views are applied, in this order; applying it twice changes nothing.

    >>> merge_view(open_checkpoint("ckpts/run1")).tensors()  # doctest: +SKIP
    """
    from ..views.hub_layout import hub_view

    return hub_view(lora_view(source, lora))


def prepare(
    checkpoint: str,
    role: str = "actor",
    backend: str = "auto",
    hf_dir: str | None = None,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    tie_word_embedding: bool | None = None,
    check_replicas: bool = False,
    custom_mapping: str | None = None,
    source: CheckpointSource | None = None,
    lora: dict | None = None,
    quantize: str | None = None,
    quantize_ignore: tuple[str, ...] = (),
) -> Prepared:
    """Discover, validate against config.json, and plan. Raises CheckpointError on bad input.

    >>> prepared = prepare("ckpts/run1", dtype="bf16")   # doctest: +SKIP
    >>> prepared.plan.files                              # doctest: +SKIP
    ['model-00001-of-00001.safetensors']
    """
    source = source or open_checkpoint(checkpoint, role, backend, hf_dir, custom_mapping)  # or one already opened
    opened_hf_dir = source.hf_dir
    source = merge_view(source, lora)  # fused LoRA, then the Hub's layout
    if source.hf_dir != opened_hf_dir:  # a save_lora_only merge takes the base model's: checked like the checkpoint's
        publishable_files(source.hf_dir, source.location)
    config = read_hf_config(source)
    quantized = quantize_spec(quantize, tuple(quantize_ignore), config.get("model_type"))  # an unknown scheme: first
    source.validate(check_replicas=check_replicas)
    aliases = check_tied_embeddings(source, config, tie_word_embedding)
    plan = make_plan(str(source.location), source.tensors(), resolve_dtype(dtype, config), aliases,
                     parse_size(max_shard_size))
    options = {"config_check": check_config(source, config, plan),  # what the merge writes, per transformers
               "backend": source.backend, "hf_dir": str(source.hf_dir) if hf_dir else None,
               "custom_mapping": custom_mapping, "dtype": dtype, "max_shard_size": max_shard_size,
               "tie_word_embedding": tie_word_embedding, "check_replicas": check_replicas}
    if quantized:  # the same plan with each selected weight as its quantized parts (config checked unquantized)
        plan = make_plan(plan.source, source.tensors(), plan.dtype, aliases, parse_size(max_shard_size), quantized)
        options.update(quantize=quantize, quantize_ignore=list(quantize_ignore))
    if lora:
        options["lora"] = lora
    return Prepared(source, config, plan, options)


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
    (default `CKPTFLOW_CHUNK_BYTES`, 64 MiB; 0: whole tensors), so at most `workers` blocks at a time.
    Returns a small receipt.
    """
    from ..numbers.budget import chunk_bytes as budget_of

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


def describe_folder(prepared: Prepared, folder: Path) -> list[str]:
    """Write what a model holds beside its weights and card into `folder` — index, config, the files copied from
    huggingface/, a LoRA merge's lora_adapter/ (checked as written) — and return their names."""
    from ..targets.output import write_descriptive_files

    descriptive = write_descriptive_files(prepared.source, prepared.config, prepared.plan, folder)
    return descriptive + write_adapter_beside(prepared.source, folder)


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
    """Card and manifest of the described `folder` (`describe_folder`), once `checks(folder)` (a reference model's
    tensors and logits) passed; `results` are the checks already made (the round trip). Returns the manifest.

    `known`: sha256 digests already computed; `stored`: entries of weight files that live elsewhere (object storage).
    """
    from .fingerprints import metadata_id, weights_id
    from ..targets.output import write_manifest

    results = [*results, *(checks(folder) if checks else [])]
    extra = {**(extra or {}), "source": {**prepared.source.describe(), "options": prepared.options},
             "weights_id": weights_id(prepared.source, prepared.plan),
             "metadata_id": metadata_id(prepared.source, prepared.config), "verification": results}
    return write_manifest(prepared.source, prepared.config, prepared.plan, folder, descriptive, extra, known, stored)


def metadata_bytes(source: CheckpointSource) -> int:
    """Room for everything but the weights: the huggingface/ files (copied, or rewritten like config.json)
    plus 1 MiB for the index and the manifest."""
    return sum(int(source.hf_dir.join(name).info().get("size") or 0) for name in source.hf_dir.listdir()) + (1 << 20)

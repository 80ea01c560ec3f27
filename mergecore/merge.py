"""Merging, step by step: prepare (discover, validate, plan) -> merge groups -> finalize.

Each step is one function so a pipeline can run them as separate tasks; `merge_checkpoint`
runs them in order for the direct CLI path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .arrays import FLOATING, bitwise_equal, nonfinite_counts
from .dtypes import resolve_dtype
from .errors import CheckpointError
from .formats import CheckpointSource, open_checkpoint
from .formats.base import read_hf_config
from .lora import lora_view, write_adapter_beside
from .layout import EMBEDDING, OUTPUT, check_against_config, tied_embeddings
from .nonfinite import check_nonfinite_policy, nonfinite_error
from .plan import MergePlan, make_plan, parse_size
from .storage import Location, publishable_files
from .writer import PARTIAL_SUFFIX, TensorWriter, prepare_files, room_checked

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


def check_tied_embeddings(source: CheckpointSource, config: dict, requested: bool | None) -> bool:
    """Whether the output ties embeddings; the checkpoint must agree with the config."""
    tied = tied_embeddings(config)
    where = source.hf_dir.join("config.json")
    if requested is not None and requested != tied:
        raise CheckpointError(
            f"--tie-word-embedding {str(requested).lower()} contradicts tie_word_embeddings={str(tied).lower()} in "
            f"{where}; drop the flag or fix the config"
        )
    names = source.tensors()
    if not tied and EMBEDDING in names and OUTPUT not in names and config.get("architectures", [""])[0].endswith("CausalLM"):
        raise CheckpointError(
            f"{source.location}: has no {OUTPUT} but {where} says tie_word_embeddings=false; "
            "set it to true if training tied the embeddings"
        )
    if tied and OUTPUT in names and EMBEDDING in names:
        if not same_values(source, EMBEDDING, OUTPUT):
            raise CheckpointError(
                f"{source.location}: {OUTPUT} differs from {EMBEDDING} but {where} says tie_word_embeddings=true; "
                "set it to false (the model was trained untied)"
            )
    return tied


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
    from .hub_layout import hub_view

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
) -> Prepared:
    """Discover, validate against config.json, and plan. Raises CheckpointError on bad input.

    >>> prepared = prepare("ckpts/run1", dtype="bf16")   # doctest: +SKIP
    >>> prepared.plan.files
    ['model-00001-of-00001.safetensors']
    """
    source = source or open_checkpoint(checkpoint, role, backend, hf_dir, custom_mapping)  # or one already opened
    opened_hf_dir = source.hf_dir
    source = merge_view(source, lora)  # fused LoRA, then the Hub's layout
    if source.hf_dir != opened_hf_dir:  # a save_lora_only merge takes the base model's: checked like the checkpoint's
        publishable_files(source.hf_dir, source.location)
    config = read_hf_config(source)
    source.validate(check_replicas=check_replicas)
    shapes = {name: info.shape for name, info in source.tensors().items()}
    check_against_config(shapes, config, str(source.hf_dir.join("config.json")),
                         allow_unknown=bool(getattr(source, "custom_mapping", None)))
    tied = check_tied_embeddings(source, config, tie_word_embedding)
    plan = make_plan(str(source.location), source.tensors(), resolve_dtype(dtype, config), tied, parse_size(max_shard_size))
    options = {"backend": source.backend, "hf_dir": str(source.hf_dir) if hf_dir else None,
               "custom_mapping": custom_mapping, "dtype": dtype, "max_shard_size": max_shard_size,
               "tie_word_embedding": tie_word_embedding, "check_replicas": check_replicas}
    if lora:
        options["lora"] = lora
    return Prepared(source, config, plan, options)


def staging_folder(target: str | Path) -> Path:
    """Where output is assembled before it is published by rename: beside the target, hidden.

    Its name is fixed per target so an interrupted run can resume into it.
    """
    target = Path(target).absolute()
    return target.parent / f".{target.name}{PARTIAL_SUFFIX}"


def check_target(target: str | Path, overwrite: bool) -> Path | None:
    """The target as a local path, after repairing what a crash during an earlier publish left there
    (a remote target is only checked: None)."""
    from .publish import repair_target

    location = Location.of(target)
    if not location.is_local:
        from .remote_output import check_remote_target

        check_remote_target(location, overwrite)
        return None
    path = Path(location.url)
    repair_target(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
        raise CheckpointError(f"{path}: already exists and is not empty; pass --overwrite or choose another --target_dir")
    return path


def stage(prepared: Prepared, target: str | Path, overwrite: bool) -> dict:
    """Where a merge into `target` writes: `published` when the target already holds this very merge
    (nothing to write); else the staging folder, prepared, with the files created anew (their groups must
    be written; files kept from an interrupted run keep theirs). A different non-empty target needs `overwrite`.
    """
    from .writer import prepare_files

    if not Location.of(target).is_local:  # written file by file at the target itself (remote_output)
        from .remote_output import stage_remote

        return stage_remote(prepared, str(target), overwrite)
    target_path = check_target(target, overwrite=True)  # repairs first; whether it may be replaced comes next
    staging = staging_folder(target_path)
    if published_manifest(target_path, prepared):
        return {"staging": str(staging), "created": [], "published": True}
    check_target(target_path, overwrite)
    return {"staging": str(staging), "created": prepare_files(prepared.plan, staging), "published": False}


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
    from .budget import chunk_bytes as budget_of

    started = time.perf_counter()
    check_nonfinite_policy(on_nonfinite)
    budget = budget_of(chunk_bytes)
    planned = plan.in_group(group)
    if not planned:
        raise CheckpointError(f"group {group!r} is not in the plan (groups: {', '.join(plan.groups)})")

    def one(entry):
        found: dict = {}
        for start, block in checked_blocks(source, entry, budget, on_nonfinite, found):
            writer.write_rows(entry, start, block)
            del block  # the next block is read while this one would otherwise still be held
        if on_tensor:
            on_tensor(entry.name)
        return entry.end - entry.begin, entry.name, found.get(entry.name)

    with TensorWriter(plan, staging) as writer, ThreadPoolExecutor(max(1, workers)) as pool:
        done = list(pool.map(one, planned))
    receipt = {"group": group, "tensors": len(planned), "bytes": sum(size for size, _, _ in done),
               "seconds": round(time.perf_counter() - started, 3)}
    nonfinite = {name: counts for _, name, counts in done if counts}
    return {**receipt, "nonfinite": nonfinite} if nonfinite else receipt


def checked_blocks(source: CheckpointSource, entry, budget: int | None, on_nonfinite: str, found: dict):
    """`source.row_blocks` of planned tensor `entry`, in order, each checked for NaN/Inf as converted (so fp16
    overflow counts too): with `on_nonfinite="fail"` the first raises CheckpointError; otherwise the counts
    add up in `found[entry.name]`.

    >>> for start, block in checked_blocks(source, entry, 64 << 20, "warn", found): ...  # doctest: +SKIP
    """
    for start, block in source.row_blocks(entry.name, entry.dtype, budget):
        counts = nonfinite_counts(block) if entry.dtype in FLOATING else None
        if counts and on_nonfinite == "fail":
            raise nonfinite_error({entry.name: counts}, source.location)
        if counts:
            found[entry.name] = add_counts(found.get(entry.name), counts)
        yield start, block
        del block  # not held while the next block is read


def add_counts(total: dict[str, int] | None, more: dict[str, int] | None) -> dict[str, int] | None:
    """Non-finite counts of two row blocks together (None: all finite)."""
    if not (total and more):
        return total or more
    return {kind: total[kind] + more[kind] for kind in total}


def finalize(
    prepared: Prepared,
    staging: Path,
    target: Path,
    overwrite: bool,
    verify: bool = True,
    workers: int = 2,
    extra: dict | None = None,
    hashes=None,
    checks: Callable[[Path], list[dict]] | None = None,
) -> dict:
    """Prove the staging folder equals the shards, write index, config, copied files, card and manifest,
    and publish atomically. `checks(folder)` adds checks of the finished folder (a reference model's
    tensors and logits), run before anything is published and recorded in the manifest and card.

    The published folder holds exactly the planned weight files, the index, the copied metadata, the
    card and the manifest. Nothing reaches `target` unless every check passed (when `verify`).
    """
    from .fingerprints import metadata_id, weights_id
    from .output import BackgroundHashes, clear_strays, write_descriptive_files, write_manifest
    from .publish import publish, start_writeback
    from .verify import verify_round_trip

    plan = prepared.plan
    clock = Stopwatch()
    clear_strays(staging, set(plan.files))
    hashes = hashes or BackgroundHashes(staging)  # may already be through the groups merged so far
    hashes.start(plan.files)  # finishes while the round-trip check runs
    descriptive = write_descriptive_files(prepared.source, prepared.config, plan, staging)
    descriptive += write_adapter_beside(prepared.source, staging)  # a LoRA merge's lora_adapter/, checked as written
    start_writeback([staging / file for file in plan.files])  # to disk while the checks run; publish fsyncs
    results = [verify_round_trip(prepared.source, staging, plan.aliases, workers)] if verify else []
    results += checks(staging) if checks else []
    clock.lap("verify")
    extra = dict(extra or {})
    extra["timings"] = {**extra.get("timings", {}), **clock.laps}
    extra.update(source={**prepared.source.describe(), "options": prepared.options},
                 weights_id=weights_id(prepared.source, plan),
                 metadata_id=metadata_id(prepared.source, prepared.config), verification=results)
    manifest = write_manifest(prepared.source, prepared.config, plan, staging, descriptive, extra, hashes.digests())
    publish(staging, target, overwrite)
    return manifest


def published_manifest(target: Path, prepared: Prepared) -> dict | None:
    """The manifest of `target` if its weight files are exactly this merge's (same inputs, plan, code)."""
    from .fingerprints import weights_id
    from .output import MANIFEST_FILE
    from .tensorio import read_json

    manifest_file = Path(target) / MANIFEST_FILE
    if not manifest_file.exists():
        return None
    manifest = read_json(manifest_file)
    return manifest if manifest.get("weights_id") == weights_id(prepared.source, prepared.plan) else None


def refresh_published(prepared: Prepared, target: Path, verify: bool = True, workers: int = 2,
                      checks: Callable[[Path], list[dict]] | None = None) -> dict:
    """Reuse the weights already published at `target`; rewrite config, tokenizer files, card and manifest
    if they changed.

    The weight files are hard-linked into a new staging folder (never written), so the swap is atomic.
    """
    import os
    import shutil

    from .fingerprints import metadata_id

    manifest = published_manifest(target, prepared)
    if manifest is None:
        raise CheckpointError(f"{target}: does not hold this checkpoint's merge; rerun with overwrite to rebuild it")
    if manifest.get("metadata_id") == metadata_id(prepared.source, prepared.config):
        return {**manifest, "reused": True}
    staging = staging_folder(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for file in prepared.plan.files:
        os.link(Path(target) / file, staging / file)
    return finalize(prepared, staging, Path(target), overwrite=True, verify=verify, workers=workers,
                    extra={"groups_written": manifest.get("groups_written", [])}, checks=checks)


def metadata_bytes(source: CheckpointSource) -> int:
    """Room for everything but the weights: the huggingface/ files (copied, or rewritten like config.json)
    plus 1 MiB for the index and the manifest."""
    return sum(int(source.hf_dir.join(name).info().get("size") or 0) for name in source.hf_dir.listdir()) + (1 << 20)


def merge_checkpoint(
    checkpoint: str,
    target: str | Path,
    *,
    role: str = "actor",
    backend: str = "auto",
    hf_dir: str | None = None,
    dtype: str = "auto",
    max_shard_size: str | int = "5GB",
    tie_word_embedding: bool | None = None,
    overwrite: bool = False,
    verify: bool = True,
    check_replicas: bool = False,
    workers: int = 2,
    on_group: Callable[[str, dict], None] | None = None,
    on_tensor: Callable[[str], None] | None = None,
    prepared: Prepared | None = None,
    checks: Callable[[Path], list[dict]] | None = None,
    on_nonfinite: str = "warn",
    chunk_bytes: int | str | None = None,
) -> dict:
    """Merge a checkpoint into a verified Hugging Face folder at `target`, published atomically.
    `chunk_bytes`: the memory budget per worker (see `merge_group`).

    >>> manifest = merge_checkpoint("ckpts/run1", "out/model", dtype="bf16")  # doctest: +SKIP
    >>> manifest["verification"][0]["ok"]                                      # doctest: +SKIP
    True

    A remote `target` (`s3://...`) is published by writing its manifest last: see `remote_output`.
    """
    if not Location.of(target).is_local:
        from .remote_output import merge_to_remote

        return merge_to_remote(checkpoint, str(target), overwrite=overwrite, prepared=prepared, role=role,
                               backend=backend, hf_dir=hf_dir, dtype=dtype, max_shard_size=max_shard_size,
                               tie_word_embedding=tie_word_embedding, check_replicas=check_replicas, verify=verify,
                               workers=workers, on_group=on_group, on_tensor=on_tensor, checks=checks,
                               on_nonfinite=on_nonfinite, chunk_bytes=chunk_bytes)
    target_path = check_target(target, overwrite)
    check_nonfinite_policy(on_nonfinite)
    clock = Stopwatch()
    prepared = prepared or prepare(checkpoint, role, backend, hf_dir, dtype, max_shard_size, tie_word_embedding, check_replicas)
    clock.lap("prepare")
    staging = staging_folder(target_path)
    from .output import BackgroundHashes

    plan = prepared.plan
    try:
        with BackgroundHashes(staging) as hashes:
            prepare_files(plan, staging, metadata_bytes(prepared.source))
            receipts = []
            for group in plan.groups:
                receipts.append(merge_group(prepared.source, plan, group, staging, workers, on_tensor, on_nonfinite,
                                            chunk_bytes))
                hashes.start_written(plan, {r["group"] for r in receipts})  # files hash as far as they are written
                if on_group:
                    on_group(group, receipts[-1])
            clock.lap("merge")
            extra = {"groups_written": receipts, "timings": clock.laps}
            with room_checked(staging):  # index, config, copied files and manifest
                return finalize(prepared, staging, target_path, overwrite, verify, workers, extra, hashes, checks)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise

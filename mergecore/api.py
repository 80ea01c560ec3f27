"""The library's whole-job entry points: a checkpoint merged into a target, or a LoRA adapter written to one.

Each holds the target's lock from the first check to the publish (`mergecore.targets`), so two writers of one
target never interleave: the second waits, then finds the first one's model.

>>> manifest = merge_checkpoint("ckpts/run1", "out/model", dtype="bf16")  # doctest: +SKIP
>>> manifest["verification"][0]["ok"]                                      # doctest: +SKIP
True
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .formats import CheckpointSource
from .engine.merge import Prepared, Stopwatch, metadata_bytes, prepare
from .numbers.nonfinite import check_nonfinite_policy
from .targets import Target, open_target
from .targets.base import check_apart


def merge_checkpoint(
    checkpoint: str,
    target: str | Path | Target,
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
    quantize: str | None = None,
    quantize_ignore: tuple[str, ...] = (),
) -> dict:
    """Merge a checkpoint into a verified Hugging Face model at `target` (a folder, published by one atomic
    rename, or an fsspec URL, published by writing its manifest last). `on_group(unit, receipt)` follows the
    groups (files, on object storage); `chunk_bytes` is the memory budget per worker (see `merge.merge_group`).
    A target that already holds this very merge is reused (its metadata refreshed if it changed).

    >>> manifest = merge_checkpoint("ckpts/run1", "out/model", dtype="bf16")  # doctest: +SKIP
    """
    check_nonfinite_policy(on_nonfinite)
    target = open_target(target)
    with target.lock():
        target.check(overwrite, [checkpoint])
        clock = Stopwatch()
        prepared = prepared or prepare(checkpoint, role, backend, hf_dir, dtype, max_shard_size, tie_word_embedding,
                                       check_replicas, quantize=quantize, quantize_ignore=quantize_ignore)
        clock.lap("prepare")
        try:
            staged = target.stage(prepared, overwrite, metadata_bytes(prepared.source))  # checks the source's folders too
            if staged["published"]:
                return target.refresh(prepared, verify=verify, workers=workers, checks=checks)
            return target.merge(prepared, staged, overwrite=overwrite, verify=verify, workers=workers, on_unit=on_group,
                                on_tensor=on_tensor, on_nonfinite=on_nonfinite, chunk_bytes=chunk_bytes,
                                extra={"timings": clock.laps}, checks=checks)
        except BaseException:  # a failed check, a signal: no half-made folder stays beside the target
            target.discard()
            raise


def check_apart_from_source(target: Target, source: CheckpointSource) -> None:
    """The target overlaps none of the folders the checkpoint was read from (its role folder, huggingface/)."""
    for place in (source.location, source.hf_dir):
        check_apart(target.url, str(place))


def write_adapter_folder(source: CheckpointSource, target: str | Path | Target, overwrite: bool = False,
                         overrides: dict | None = None, base_model: str | None = None) -> dict:
    """Write the adapter of a LoRA checkpoint (full or save_lora_only) as a PEFT folder at `target`, checked
    piece by piece and published atomically. Returns a small report.

    >>> write_adapter_folder(open_checkpoint("ckpts/run1"), "out/adapter")  # doctest: +SKIP
    {'adapter': 'out/adapter', 'tensors': 8, 'pieces': 16, 'r': 8, 'alpha': 16.0}
    """
    from .views.lora import adapter_of, write_adapter_files

    inner, hyper = adapter_of(source, overrides)  # refuses without alpha, before anything is written
    target = open_target(target)
    with target.lock():
        target.check(overwrite, [str(source.location)])
        check_apart_from_source(target, source)
        staging = target.open_staging(fresh=True)
        try:
            written = write_adapter_files(inner, hyper, staging, base_model)
            target.publish(staging, overwrite)
        except BaseException:
            target.discard()
            raise
    return {"adapter": target.url, **written, "r": hyper.r, "alpha": hyper.alpha}



"""One opened checkpoint per process, shared by the tasks that run there.

Opening mmaps every rank file and reads their metadata; tasks of the same run (threads, or one
Dask worker) reuse it. The key holds the input files' fingerprints, taken once per flow run, so a
file changed since the last run reopens. (Each group's cache key stats its own files afresh.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mergecore import Prepared, prepare
from mergecore.formats import CheckpointSource, open_checkpoint


@dataclass(frozen=True)
class CheckpointRef:
    """Everything that names a checkpoint and how to merge it: the plain inputs every task takes."""

    checkpoint: str
    role: str = "actor"
    backend: str = "auto"
    hf_dir: str | None = None
    dtype: str = "auto"
    max_shard_size: str = "5GB"
    tie_word_embedding: bool | None = None
    custom_mapping: str | None = None
    # "fail" or "warn" on NaN/Inf weights. Not in merge_group's cache key (it changes no byte written):
    # receipts carry the findings, and finalize_model applies "fail" to cached receipts too.
    on_nonfinite: str = "warn"
    # A LoRA checkpoint: (key, value) pairs of `lora_options` (output, alpha, r, target_modules, base_model);
    # a tuple so the ref stays hashable.
    lora: tuple = ()
    # A quantized export (`--quantize`): the scheme and the extra module patterns left unquantized.
    quantize: str | None = None
    quantize_ignore: tuple[str, ...] = ()

    @property
    def lora_overrides(self) -> dict | None:
        return dict(self.lora) or None


@lru_cache(maxsize=4)
def _opened(ref: CheckpointRef, fingerprints: str) -> CheckpointSource:
    from mergecore.engine.merge import merge_view

    # the groups read the view prepare() planned (a LoRA checkpoint fused, the Hub's layout)
    return merge_view(open_checkpoint(ref.checkpoint, ref.role, ref.backend, ref.hf_dir, ref.custom_mapping),
                      ref.lora_overrides)


@lru_cache(maxsize=4)
def _prepared(ref: CheckpointRef, fingerprints: str) -> Prepared:
    return prepare(ref.checkpoint, ref.role, ref.backend, ref.hf_dir, ref.dtype, ref.max_shard_size,
                   ref.tie_word_embedding, custom_mapping=ref.custom_mapping, source=_opened(ref, fingerprints),
                   lora=ref.lora_overrides, quantize=ref.quantize, quantize_ignore=ref.quantize_ignore)


def _fingerprints(ref: CheckpointRef) -> str:
    """Listing the folder and stat-ing the input files: once per flow run, as every task needs them."""
    run_id = _flow_run_id()
    return _fingerprints_in_run(ref, run_id) if run_id else _listed_and_stated(ref)


def _flow_run_id():
    from prefect.context import FlowRunContext, TaskRunContext

    if task_run := TaskRunContext.get():
        return task_run.task_run.flow_run_id
    flow_run = FlowRunContext.get()
    return flow_run.flow_run.id if flow_run and flow_run.flow_run else None


@lru_cache(maxsize=8)
def _fingerprints_in_run(ref: CheckpointRef, run_id) -> str:
    return _listed_and_stated(ref)


def _listed_and_stated(ref: CheckpointRef) -> str:
    from mergecore.engine.fingerprints import digest, input_fingerprints

    return digest(input_fingerprints(open_checkpoint(ref.checkpoint, ref.role, ref.backend, ref.hf_dir, ref.custom_mapping)))


def source_for(ref: CheckpointRef) -> CheckpointSource:
    """The opened checkpoint for `ref` (rank files mmapped once per process while they are unchanged)."""
    return _opened(ref, _fingerprints(ref))


def prepared_for(ref: CheckpointRef) -> Prepared:
    """The validated, planned checkpoint for `ref`, sharing `source_for`'s opened files."""
    return _prepared(ref, _fingerprints(ref))


def lora_options(checkpoint: str, role: str, backend: str, hf_dir: str | None, custom_mapping: str | None,
                 requested: str | None, overrides: dict | None) -> tuple:
    """`CheckpointRef.lora` for a promotion: the LoRA output chosen (fused model, with lora_adapter/ for `both`)
    and the explicit hyperparameters; () for a checkpoint without LoRA. The pipeline publishes a fused model:
    an adapter-only output (`--lora adapter`, or save_lora_only without --base-model) is refused in one line."""
    from mergecore import CheckpointError
    from mergecore.views.lora import output_mode

    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if custom_mapping is not None:
        if requested is not None or overrides:
            raise CheckpointError("--lora and the LoRA flags apply to verl FSDP LoRA checkpoints, not with --custom-mapping: drop one")
        return ()
    source = open_checkpoint(checkpoint, role, backend, hf_dir, custom_mapping)
    mode = output_mode(source, requested, overrides.get("base_model"))
    if mode is None:
        if overrides:
            raise CheckpointError(f"{source.location}: LoRA flags given but the checkpoint has no LoRA adapter tensors; drop them")
        return ()
    if mode == "adapter":
        raise CheckpointError(f"{source.location}: promote publishes a fused model; for the adapter alone use "
                              "`ckptflow merge --lora adapter` (or pass --base-model to fuse a save_lora_only checkpoint)")
    return tuple(sorted({**overrides, "output": mode}.items()))

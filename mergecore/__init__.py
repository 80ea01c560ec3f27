"""mergecore: turn distributed training checkpoints into verified Hugging Face folders.

Pure library (torch, safetensors, transformers, fsspec); the Prefect pipeline wraps it.

>>> from mergecore import merge_checkpoint
>>> merge_checkpoint("ckpts/global_step_100/actor", "out/model", dtype="bf16")  # doctest: +SKIP
"""

from .errors import CheckpointError, VerificationError
from .formats import open_checkpoint
from .merge import Prepared, finalize, merge_checkpoint, merge_group, prepare, staging_folder
from .plan import MergePlan
from .verify import compare_logits, compare_with_reference, verify_manifest, verify_round_trip

__all__ = [
    "CheckpointError", "VerificationError", "MergePlan", "Prepared", "open_checkpoint", "prepare",
    "merge_group", "finalize", "merge_checkpoint", "staging_folder", "verify_round_trip",
    "verify_manifest", "compare_with_reference", "compare_logits",
]

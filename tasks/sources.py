"""One opened checkpoint per process, shared by the tasks that run there.

Opening mmaps every rank file and reads their metadata; tasks of the same run (threads, or one
Dask worker) reuse it. The key holds the input files' fingerprints, so a changed file reopens.
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


@lru_cache(maxsize=4)
def _opened(ref: CheckpointRef, fingerprints: str) -> CheckpointSource:
    return open_checkpoint(ref.checkpoint, ref.role, ref.backend, ref.hf_dir, ref.custom_mapping)


@lru_cache(maxsize=4)
def _prepared(ref: CheckpointRef, fingerprints: str) -> Prepared:
    return prepare(ref.checkpoint, ref.role, ref.backend, ref.hf_dir, ref.dtype, ref.max_shard_size,
                   ref.tie_word_embedding, custom_mapping=ref.custom_mapping, source=_opened(ref, fingerprints))


def _fingerprints(ref: CheckpointRef) -> str:
    """Listing the folder and stat-ing the input files: cheap, and it changes when any input does."""
    from mergecore.fingerprints import digest, input_fingerprints

    return digest(input_fingerprints(open_checkpoint(ref.checkpoint, ref.role, ref.backend, ref.hf_dir, ref.custom_mapping)))


def source_for(ref: CheckpointRef) -> CheckpointSource:
    """The opened checkpoint for `ref` (rank files mmapped once per process while they are unchanged)."""
    return _opened(ref, _fingerprints(ref))


def prepared_for(ref: CheckpointRef) -> Prepared:
    """The validated, planned checkpoint for `ref`, sharing `source_for`'s opened files."""
    return _prepared(ref, _fingerprints(ref))

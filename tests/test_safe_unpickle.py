"""Checkpoint pickles are untrusted: only tensors and ShardedTensor metadata may come out of them."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from mergecore import CheckpointError
from mergecore.formats.fsdp import load_rank_file
from mergecore.formats.safe_unpickle import load_restricted


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ckptflow-pwned",))


def test_restricted_loader_refuses_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.ones(2), "x": Payload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        load_restricted(str(path))
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        load_rank_file(str(path), "evil.pt")
    assert not os.path.exists("/tmp/ckptflow-pwned")


def test_sharded_tensor_rank_files_load_without_a_process_group(demo):
    role = demo("fsdp1-sharded-tensor-tied").role_dir
    state = load_rank_file(str(role / "model_world_size_2_rank_1.pt"), "rank1")
    record = state["model.embed_tokens.weight"]
    assert record.global_shape == (1001, 64)
    (shard,) = record.local_shards
    assert shard.metadata.shard_offsets == [501, 0] and tuple(shard.tensor.shape) == (500, 64)

"""Checkpoint pickles are untrusted: only tensors and layout metadata may come out of them.

FSDP rank files are read without torch (mergecore.formats.torchfile); what comes out must equal
what torch's own loader gives, for every way verl saves.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mergecore import CheckpointError
from mergecore.numbers.arrays import to_numpy
from mergecore.formats.fsdp import load_rank_file
from mergecore.formats.megatron.legacy import load_model_file
from mergecore.formats.torchfile import DTensorRecord


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ckptflow-pwned",))


def test_loaders_refuse_code(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weight": torch.ones(2), "x": Payload()}, path)
    with pytest.raises(CheckpointError, match=r"evil.pt: refused to unpickle .*(posix|os)\.system"):
        load_model_file(str(path), "evil.pt")
    with pytest.raises(CheckpointError, match=r"evil.pt: refused to unpickle .*(posix|os)\.system"):
        load_rank_file(str(path), "evil.pt")
    assert not os.path.exists("/tmp/ckptflow-pwned")


def test_plain_tensors_of_every_dtype_and_layout(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    saved = {
        "bf16": base.to(torch.bfloat16), "fp16": base.half(), "i64": base.long(), "bool": base > 5,
        "strided": base.t(),                     # non-contiguous view
        "offset": base.reshape(-1)[7:13],         # a view with a storage offset
        "empty": torch.empty(0, 3),
        "param": torch.nn.Parameter(base.clone()),
    }
    torch.save(saved, tmp_path / "plain.pt")
    loaded = load_rank_file(str(tmp_path / "plain.pt"), "plain.pt")
    for name, tensor in saved.items():
        assert np.array_equal(loaded[name], to_numpy(tensor.detach())), name
        assert loaded[name].dtype == to_numpy(tensor.detach()).dtype, name
        assert not loaded[name].flags.writeable, name  # views of the file: never written through


@pytest.mark.parametrize("variant", ["fsdp2-w4-placement", "hsdp-2x2", "fsdp1-mesh-llama"])
def test_dtensor_files_read_as_torch_reads_them(demo, variant):
    import torch.distributed.tensor  # noqa: F401  (torch's loader needs it; ours does not)

    role = demo(variant).role_dir
    for path in sorted(role.glob("model_world_size_*_rank_*.pt")):
        ours = load_rank_file(str(path), path.name)
        theirs = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        assert list(ours) == list(theirs)
        for name, dtensor in theirs.items():
            record = ours[name]
            assert isinstance(record, DTensorRecord)
            assert record.shape == tuple(dtensor.shape) and record.dtype == str(dtensor.dtype).removeprefix("torch.")
            assert [(str(p), repr(p)) for p in record.placements] == [(str(p), repr(p)) for p in dtensor.placements]
            assert np.array_equal(record.device_mesh.mesh, dtensor.device_mesh.mesh.numpy())
            assert tuple(record.device_mesh.mesh_dim_names) == tuple(dtensor.device_mesh.mesh_dim_names)
            assert np.array_equal(record.local, dtensor.to_local().numpy()), (path.name, name)


def test_sharded_tensor_rank_files_load_without_a_process_group(demo):
    role = demo("fsdp1-sharded-tensor-tied").role_dir
    state = load_rank_file(str(role / "model_world_size_2_rank_1.pt"), "rank1")
    record = state["model.embed_tokens.weight"]
    assert record.shape == (1001, 64) and record.dtype == "float32"
    (shard,) = record.local_shards
    assert shard.metadata.shard_offsets == [501, 0] and tuple(shard.tensor.shape) == (500, 64)


def test_truncated_and_foreign_files_are_one_line_errors(tmp_path):
    torch.save({"w": torch.ones(1000)}, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"^cut.pt: cannot be read .*copy it again"):
        load_rank_file(str(tmp_path / "cut.pt"), "cut.pt")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"^list.pt: holds a list, not a state dict"):
        load_rank_file(str(tmp_path / "list.pt"), "list.pt")


def test_untrusted_docstrings():
    import doctest

    import mergecore.formats.untrusted

    assert doctest.testmod(mergecore.formats.untrusted).failed == 0
